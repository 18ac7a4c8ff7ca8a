"""The Pallas GEMM (interpret mode on the CPU, compiled on a GPU) against the
reference, for every layout and weight format, over random routings.

What we measure: the kernel feeds the raw quantized values (exact in bf16) to
the product and applies the scales to the f32 partial products, so with an f32
output ‖kernel − reference‖/‖reference‖ is ~3e-7 (summation order) for every
quantized format; bound 1e-5. Tilings with folded scales (the H200 decode
entries) round the scaled integer weight once to bf16: they are held to the
reference on the bf16-rounded weight, same bound. f16 weights with bf16 activations are rounded
to bf16 first (~1.7e-3; bound 5e-3). A bf16 output adds its own rounding
(bound 1e-2). Rows no tile owns must be exactly zero.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import humming_jax as hj
from humming_jax import backend as B
from humming_jax import formats as F
from humming_jax.gemm import as_quantized_input, plan
from pallas_kernels import word_decode as wd
from pallas_kernels.gemm import triton as kernel
from pallas_kernels.gemm.spec import LayoutSpec, WeightSpec

import gemm_layouts
import np_ref
from np_ref import relative_error
from sweep import sweep

KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
E, N, K, M = 4, 64, 256, 40


def _weight(rng, fmt, e, k=K):
    w = jnp.asarray(rng.normal(0, 0.05, (e, N, k)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(e, N)), jnp.float32) if fmt.has_bias else None
    return F.quantize_weight(w, fmt, bias=bias)


def _layouts(rng, block_size=16):
    return gemm_layouts.layouts(rng, E, M, block_size)


def _reference(x, weight, layout):
    """The GEMM in float64 NumPy (the ``jnp`` reference is held to it in test_gemm_reference)."""
    return np_ref.gemm_of(x, weight, layout)


def _kernel_reference(x, weight, layout):
    """The reference the kernel's default tiling must match: with folded scales
    (the H200 table's decode entries) integer and fp8-with-float-scale weights
    are rounded to bf16 once; e2m1/e4m3 values times e8m0/e4m3 scales are exact."""
    tiles, _ = plan(as_quantized_input(x), weight, layout, out_dtype=jnp.float32, interpret=True)
    return _reference_for(tiles, x, weight, layout)


def _reference_for(tuning, x, weight, layout):
    """The folded reference when ``tuning`` folds scales that round, else the reference."""
    fmt = weight.format
    exact = fmt.value_type.value in ("float4_e2m1", "float8_e4m3") and fmt.scale_type.value in ("e8m0", "float8_e4m3")
    if getattr(tuning, "fold_scales", False) and fmt.is_quantized and not exact:
        return _folded_reference(x, weight, layout)
    return _reference(x, weight, layout)


def _folded_reference(x, weight, layout):
    """What a kernel with folded scales computes: the product with the
    dequantized weight rounded once to bf16 (exact for the e2m1/e4m3 formats)."""
    return np_ref.gemm_of(x, weight, layout, bf16_weight=True)


def _check(out, ref, bound=1e-2):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert relative_error(out, ref) < bound
    unowned = np.all(ref == 0, axis=1)
    assert np.all(out[unowned] == 0), "rows no tile owns must be zero"


def _check_tiling(rng, fmt_name, layout_kind, tuning, k=K, x_dtype=jnp.bfloat16):
    """The kernel under ``tuning`` equals the reference (f32 output, bound 1e-5)."""
    weight = _weight(rng, F.get_format(fmt_name), 1 if layout_kind == "dense" else E, k)
    x = jnp.asarray(rng.normal(size=(M, k)), x_dtype)
    layout = _layouts(rng, tuning.block_m)[layout_kind]
    ref = _reference(x, weight, layout)
    _check(hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND), ref, bound=1e-5)


# Every format on the grouped layout (the pipelines'); the other layouts with one
# format of each kind (their row logic is the format's code's caller, not its part).
# Each other layout meets a 16-bit, a 4-bit integer, an 8-bit and a 4-bit float format, and
# every kind of format meets at least two of them.
_OTHER_LAYOUTS = {
    "dense": ["bf16", "int4_g128+bias", "fp8_block128", "nvfp4"],
    "grouped_masked": ["f16", "uint4_zp_g128", "int8_channel", "mxfp4"],
    "indexed": ["bf16", "uint4_zp_g128", "fp8_block128", "mxfp4"],
}
# int4_g64 and int8_g32 read as int4_g32 and int8_g64 do (groups narrower than a span).
_GROUPED_FORMATS = sorted(set(F.PRESETS) - {"int4_g64", "int8_g32"}) + ["int4_g128+bias", "mxfp4+bias"]
_BF16_OUTPUT = ("bf16", "int4_g128", "fp8_block128", "mxfp4")
_FORMAT_LAYOUTS = [(f, "grouped_contiguous") for f in _GROUPED_FORMATS] + [
    (f, layout) for layout, formats in _OTHER_LAYOUTS.items() for f in formats
]
# make test: a format of each value type, zero point and bias on the grouped
# layout (f16, channel and tensor scales: in the tiling tests below; bf16 on the
# indexed layout; MXFP8's e4m3 codes and e8m0 scales as fp8_block128's and
# MXFP4's); one or two formats of different kinds on each other layout.
_FORMAT_LAYOUTS_CI = [
    *[
        (f, "grouped_contiguous")
        for f in ("int4_g128", "uint4_zp_g128", "int8_g64", "fp8_block128", "mxfp4+bias", "nvfp4")
    ],
    ("int4_g128+bias", "dense"),
    ("uint4_zp_g128", "grouped_masked"),
    ("bf16", "indexed"),
    ("mxfp4", "indexed"),
]


@pytest.mark.parametrize("fmt_name,layout_kind", sweep(_FORMAT_LAYOUTS, _FORMAT_LAYOUTS_CI))
@pytest.mark.bounds
def test_kernel_every_layout_every_format(layout_kind, fmt_name, rng):
    fmt = F.get_format(fmt_name)
    weight = _weight(rng, fmt, 1 if layout_kind == "dense" else E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = _layouts(rng)[layout_kind]
    ref = _kernel_reference(x, weight, layout)
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND)
    _check(out, ref, bound=5e-3 if fmt.value_type.value == "float16" else 1e-5)
    if fmt_name in _BF16_OUTPUT:  # the output dtype's store is the common epilogue: once a kind of format
        out_bf16 = hj.gemm(x, weight, layout, backend=KERNEL_BACKEND)
        assert out_bf16.dtype == jnp.bfloat16
        _check(out_bf16, ref)


@pytest.mark.parametrize("split_k", sweep([2, 4], [2]))
def test_split_k_is_deterministic(split_k, rng):
    weight = _weight(rng, F.INT4_G32, E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = _layouts(rng)["grouped_contiguous"]
    tuning = kernel.Tiles(block_m=16, block_n=32, block_k=32, split_k=split_k)
    first = hj.gemm(x, weight, layout, tuning=tuning, backend=KERNEL_BACKEND)
    again = hj.gemm(x, weight, layout, tuning=tuning, backend=KERNEL_BACKEND)
    np.testing.assert_array_equal(np.asarray(first, np.float32), np.asarray(again, np.float32))
    _check(first, _reference(x, weight, layout))
    with pytest.raises(ValueError, match="split_k"):
        hj.gemm(x, weight, layout, tuning=tuning, batch_invariant=True, backend=KERNEL_BACKEND)


def test_f16_compute_and_accumulation(rng):
    weight = _weight(rng, F.F16, E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float16)
    layout = _layouts(rng)["grouped_masked"]
    ref = _reference(x, weight, layout)
    for accum in (False, True):
        out = hj.gemm(x, weight, layout, use_f16_accum=accum, backend=KERNEL_BACKEND)
        assert out.dtype == jnp.float16
        _check(out, ref)


def test_batch_invariance(rng):
    """A row's result does not depend on the other rows of the batch."""
    weight = _weight(rng, F.MXFP4, 1)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    full = hj.gemm(x, weight, hj.Dense(), batch_invariant=True, backend=KERNEL_BACKEND)
    part = hj.gemm(x[5:9], weight, hj.Dense(), batch_invariant=True, backend=KERNEL_BACKEND)
    np.testing.assert_array_equal(np.asarray(full[5:9], np.float32), np.asarray(part, np.float32))


@settings(max_examples=1)  # interpreted kernels: ~4-6 s an example (more: test_gemm_reference)
@given(
    st.integers(1, 48),
    st.sampled_from([1, 2, 8]),
    st.sampled_from([16, 32, 64]),
    st.integers(0, 2**31 - 1),
    st.sampled_from(np_ref.ROUTING_SHAPES),
    st.booleans(),
    st.booleans(),
)
@pytest.mark.bounds
def test_kernel_over_random_routings(num_tokens, top_k, block_size, seed, shape, ignore_invalid, lists_dropped):
    """Indexed (reading [T, K]) and grouped (reading the permuted rows) kernels
    agree with the reference, slot by slot, for any routing. The indexed
    layout's dropped slots are in blocks of expert -1 (``ignore_invalid``
    False, with an expert map) or past the padded blocks; with
    ``lists_dropped`` the kernel alone zeroes their rows (no zero fill)."""
    rng = np.random.default_rng(seed)
    ids, emap, local = np_ref.small_routing(rng, num_tokens, top_k, shape)
    emap = None if emap is None else jnp.asarray(emap)
    num_experts = np_ref.SMALL_EXPERTS
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(local, 32, 64)), jnp.float32), F.INT4_G32)
    x = jnp.asarray(rng.normal(size=(num_tokens, 64)), jnp.bfloat16)
    aligned = hj.moe_align_block_size(jnp.asarray(ids), block_size, num_experts, emap, ignore_invalid, local)
    indexed = hj.Indexed(*aligned, top_k=top_k, block_size=block_size, lists_dropped=lists_dropped)
    _check(
        hj.gemm(x, weight, indexed, backend=KERNEL_BACKEND),
        _reference(x, weight, indexed),
    )
    permuted = hj.moe_permute(x, jnp.asarray(ids), num_experts, emap, local)
    grouped = hj.GroupedContiguous(permuted.expert_first_token_offset)
    rows = permuted.permuted_hidden_states
    _check(
        hj.gemm(rows, weight, grouped, backend=KERNEL_BACKEND),
        _reference(rows, weight, grouped),
    )


def test_kernel_backend_refuses_what_it_cannot_run(monkeypatch, rng):
    """float32 inputs have no kernel (the tensor cores take 16- and 8-bit operands)."""
    weight = _weight(rng, F.FP8_CHANNEL, E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    layout = _layouts(rng)["grouped_masked"]
    with pytest.raises(ValueError, match="float32 inputs"):
        hj.gemm(x, weight, layout, backend=KERNEL_BACKEND)
    if KERNEL_BACKEND == "pallas":  # on a GPU the default raises too
        with pytest.raises(ValueError, match="on the GPU"):
            hj.gemm(x, weight, layout)
        return
    monkeypatch.setattr(B, "_WARNED", set())
    with pytest.warns(UserWarning, match="no kernel takes this call"):  # off a GPU the default runs the reference
        assert hj.gemm(x, weight, layout).shape == (M, N)


@pytest.mark.parametrize("layout_kind", sweep(["dense", "grouped_contiguous", "indexed"], ["indexed"]))
def test_act_order_group_index(layout_kind, rng):
    """GPTQ act-order: column k uses group group_index[e, k] (per-element scales in the kernel)."""
    e = 1 if layout_kind == "dense" else E
    weight = _weight(rng, F.UINT4_ZP_G128, e)
    group_index = jnp.asarray(np.stack([rng.permutation(K) // 128 for _ in range(e)]), jnp.int32)
    weight = dataclasses.replace(weight, group_index=group_index)
    weight.validate()
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = _layouts(rng)[layout_kind]
    ref = _reference(x, weight, layout)
    w64 = np_ref.dequantize_weight(weight)  # independent: scales gathered by group_index in NumPy
    np.testing.assert_allclose(np.asarray(hj.dequantize_weight(weight), np.float64), w64, rtol=1e-6, atol=1e-12)
    _check(hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND), ref, bound=5e-3)
    planar = hj.to_planar(weight)  # groups by group_index, codes in the planar order: the same product
    _check(hj.gemm(x, planar, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND), ref, bound=5e-3)
    with pytest.raises(ValueError, match="group_index"):
        dataclasses.replace(_weight(rng, F.INT8_CHANNEL, e), group_index=group_index).validate()


@pytest.mark.parametrize(
    "fmt_name,layout_kind",
    sweep(
        [
            (f, k)
            for f in ("bf16", "int4_g128+bias", "uint4_fzp_g128", "mxfp4", "nvfp4", "fp8_block128")
            for k in ("grouped_contiguous", "indexed")
        ]
        + [("int4_g128+bias", "dense"), ("mxfp4", "grouped_masked")],
        [("int4_g128+bias", "grouped_contiguous"), ("nvfp4", "indexed")],
    ),
)
def test_swap_ab_tiles(layout_kind, fmt_name, rng):
    """``swap_ab`` (out.T = w @ x.T, the decode tiling) computes the same values."""
    _check_tiling(rng, fmt_name, layout_kind, kernel.Tiles(block_m=16, block_n=64, block_k=128, swap_ab=True))


@pytest.mark.parametrize(
    "fmt_name,layout_kind",  # each format on two layouts, each layout twice
    sweep(
        [
            ("int4_g32", "dense"),
            ("int4_g32", "grouped_contiguous"),
            ("uint4_fzp_g128", "grouped_masked"),
            ("mxfp4+bias", "grouped_contiguous"),
            ("nvfp4", "dense"),
            ("nvfp4", "grouped_masked"),
        ],
        [("int4_g32", "dense"), ("nvfp4", "grouped_masked")],
    ),
)
@pytest.mark.parametrize("block_k", [128])
def test_prefill_tiles_split_x(layout_kind, fmt_name, block_k, rng):
    """Row tiles of 64+ read a copy of x with each span's columns split even/odd
    (packed formats): same values as the reference."""
    _check_tiling(rng, fmt_name, layout_kind, kernel.Tiles(block_m=64, block_n=32, block_k=block_k))


@pytest.mark.parametrize(
    "layout_kind,group_m",
    sweep(
        [(k, g) for k in ("dense", "grouped_contiguous", "indexed") for g in (2, 4)],
        [("indexed", 4)],
    ),
)
def test_banded_program_order(group_m, layout_kind, rng):
    """Programs in bands of ``group_m`` row tiles (a partial last band
    included) cover every output tile exactly once."""
    _check_tiling(rng, "int4_g32", layout_kind, kernel.Tiles(block_m=16, block_n=16, block_k=64, group_m=group_m))


@pytest.mark.bounds
def test_masked_row_tiles_over_many_experts(rng):
    """Every row tile of the masked layout, in whatever order the programs
    take them: each row of a layout of many experts (empty, full, a count
    past the buffer, one row, several tiles) is its expert's product, every
    row past a count zero — NaN in the input there."""
    e, max_tokens, k, n = 9, 40, 64, 32
    counts = np.asarray([0, 40, 3, 0, 17, 99, 1, 0, 32], np.int32)
    w = jnp.asarray(rng.normal(0, 0.1, (e, n, k)), jnp.bfloat16)
    x = rng.normal(size=(e, max_tokens, k)).astype(np.float32)
    past = np.arange(max_tokens)[None, :] >= np.minimum(counts, max_tokens)[:, None]
    x[past] = np.nan
    x = jnp.asarray(x.reshape(e * max_tokens, k), jnp.bfloat16)
    tiles = kernel.Tiles(block_m=16, block_n=16, block_k=32)
    out = hj.gemm(x, w, hj.GroupedMasked(jnp.asarray(counts)), tuning=tiles, backend=KERNEL_BACKEND)
    got = np.asarray(out.astype(jnp.float32), np.float64).reshape(e, max_tokens, n)
    assert np.all(got[past] == 0)
    xs, ws = np.asarray(x, np.float64).reshape(e, max_tokens, k), np.asarray(w, np.float64)
    for g in range(e):
        rows = min(int(counts[g]), max_tokens)
        np.testing.assert_allclose(got[g, :rows], xs[g, :rows] @ ws[g].T, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "fmt_name,layout_kind,block_m",
    # 64-row tiles read the split copy of x; an indexed tile is its alignment block (16 here).
    sweep(
        [("int4_g128", layout, block_m) for layout, block_m in (("dense", 64), ("grouped_contiguous", 16))]
        + [("int4_g128", "grouped_masked", 64), ("int4_g128", "indexed", 16)]
        + [("uint4_fzp_g128", "grouped_masked", 64), ("uint4_fzp_g128", "indexed", 16)]
        + [("mxfp4+bias", "dense", 64), ("mxfp4+bias", "grouped_contiguous", 16)],
        [("int4_g128", "indexed", 16), ("mxfp4+bias", "dense", 64)],
    ),
)
def test_word_decode(block_m, layout_kind, fmt_name, rng):
    """``word_decode``: packed weights read as uint32 words, 8 pieces per span
    (on a GPU, integer codes are decoded by inline PTX); same values."""
    _check_tiling(rng, fmt_name, layout_kind, kernel.Tiles(block_m=block_m, block_n=32, block_k=128, word_decode=True))


@pytest.mark.parametrize("fmt_name", sweep(["int4_g128", "uint4_zp_g128", "mxfp4"], ["mxfp4"]))
def test_word_decode_swap_ab(fmt_name, rng):
    """Word-decoded weights as the MMA's A operand (decode tiles)."""
    tuning = kernel.Tiles(block_m=16, block_n=32, block_k=256, swap_ab=True, word_decode=True)
    _check_tiling(rng, fmt_name, "grouped_contiguous", tuning)


_PAIR_TILINGS = {
    "grouped": ("grouped_contiguous", kernel.Tiles(16, 32, 128, word_decode=True, pair_decode=True)),
    "indexed_fold": ("indexed", kernel.Tiles(16, 32, 256, word_decode=True, pair_decode=True, fold_scales=True)),
    "masked_64rows": ("grouped_masked", kernel.Tiles(64, 32, 128, word_decode=True, pair_decode=True)),
    "dense_swap_fold": (
        "dense",
        kernel.Tiles(16, 32, 256, swap_ab=True, word_decode=True, pair_decode=True, fold_scales=True),
    ),
    # the prefill candidate's shape: 64 rows, swap, bands, folded scales
    "prefill_swap_fold": (
        "grouped_contiguous",
        kernel.Tiles(64, 32, 128, swap_ab=True, group_m=2, word_decode=True, pair_decode=True, fold_scales=True),
    ),
}
_PAIR_FORMATS = ("int4_g128", "uint4_zp_g128", "mxfp4+bias")


# make test: each weight once, on the decode, folded-indexed and prefill tilings.
@pytest.mark.parametrize(
    "fmt_name,tiling",
    sweep(
        [(f, t) for f in _PAIR_FORMATS for t in _PAIR_TILINGS],
        [("uint4_zp_g128", "indexed_fold"), ("mxfp4+bias", "prefill_swap_fold")],
    ),
)
def test_pair_decode(fmt_name, tiling, rng):
    """``pair_decode``: 4 pieces per span, each pairing nibbles j and j+4 of a
    word as consecutive K (x split to match); folded tilings against the
    bf16-rounded reference (f32 output, bound 1e-5), others as every tiling."""
    layout_kind, tuning = _PAIR_TILINGS[tiling]
    if not tuning.fold_scales:
        _check_tiling(rng, fmt_name, layout_kind, tuning)
        return
    weight = _weight(rng, F.get_format(fmt_name), 1 if layout_kind == "dense" else E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = _layouts(rng, tuning.block_m)[layout_kind]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
    _check(out, _folded_reference(x, weight, layout), bound=1e-5)


def test_pair_decode_with_a_partial_last_tile(rng):
    """Pairs when the last K tile is partial (K=384, 256-wide tiles: the peeled tail)."""
    weight = _weight(rng, F.INT4_G128, E, k=384)
    x = jnp.asarray(rng.normal(size=(M, 384)), jnp.bfloat16)
    layout = _layouts(rng)["grouped_contiguous"]
    tuning = kernel.Tiles(16, 32, 256, word_decode=True, pair_decode=True, fold_scales=True)
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
    _check(out, _folded_reference(x, weight, layout), bound=1e-5)


def test_pair_decode_needs_word_decode():
    with pytest.raises(ValueError, match="pair_decode"):
        kernel.Tiles(16, 32, 128, pair_decode=True)


def test_split_packed_columns_for_pairs():
    """Piece j of a pair-decoded span meets x columns 8u + j, 8u + j + 4 (u = 0, 1, ...)."""
    from pallas_kernels.gemm.triton import split_packed_columns

    x = jnp.arange(2 * 256, dtype=jnp.float32).reshape(2, 256)
    split = np.asarray(split_packed_columns(x, 128, 8, pairs=True))
    expected = [8 * u + j + 4 * h for j in range(4) for u in range(16) for h in range(2)]
    np.testing.assert_array_equal(split[0, :128], expected)
    np.testing.assert_array_equal(split[1, 128:], 256 + 128 + np.asarray(expected))


def test_piece_column_order():
    """The kernel's column map in NumPy: in K order it is the split copy of x
    (bytes, words, pairs), and for planar weights every column appears once
    and pair pieces are runs of unit/4 consecutive columns."""
    from pallas_kernels.gemm.triton import piece_column_order, split_packed_columns

    x = np.arange(384)[None, :]
    for span, ways, pairs in ((64, 2, False), (128, 8, False), (256, 8, True)):
        pieces = ways // 2 if pairs else ways
        split = np.asarray(split_packed_columns(jnp.asarray(x), span, ways, pairs))[0]
        order = piece_column_order(384, span, pieces, 0)
        np.testing.assert_array_equal(np.where(order < 384, order, 0), np.where(order < 384, split, 0))
    for span, pieces, unit in ((64, 2, 128), (128, 8, 128), (256, 4, 128), (256, 8, 32), (128, 4, 16)):
        order = piece_column_order(512, span, pieces, unit)
        np.testing.assert_array_equal(np.sort(order), np.arange(512))
        if pieces == 4:  # pairs: runs of unit/4 (or the whole piece when the span is smaller)
            runs = order.reshape(-1, min(unit // 4, span // 4))
            np.testing.assert_array_equal(np.diff(runs, axis=1), 1)


@pytest.mark.parametrize(
    "fmt_name,word,block_m,layout_kind",  # each format with both row counts, each on another layout
    sweep(
        [
            (f, w, b, k)
            for f, w in (("int4_g128", True), ("mxfp4", False), ("bf16", False))
            for b, k in ((1, "grouped_contiguous"), (8, "dense"))
        ],
        [("int4_g128", True, 1, "grouped_contiguous")],
    ),
)
def test_multiply_add_tiles(block_m, fmt_name, word, layout_kind, rng):
    """``use_mma=False``: row tiles of 1-8 rows multiply on the CUDA cores (f32),
    every format's pieces and scales as in the MMA path."""
    tuning = kernel.Tiles(block_m=block_m, block_n=32, block_k=128, word_decode=word, use_mma=False)
    _check_tiling(rng, fmt_name, layout_kind, tuning)


@pytest.mark.parametrize("block_size", sweep([4, 8], [4]))
@pytest.mark.bounds
def test_indexed_blocks_under_16_rows(block_size, rng):
    """An indexed layout aligned to blocks of 4 or 8 rows runs on the kernel
    (multiply-add tiles) and equals the reference."""
    weight = _weight(rng, F.INT4_G128, E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    ids = rng.integers(0, E, size=(M, 2)).astype(np.int32)
    aligned = hj.moe_align_block_size(jnp.asarray(ids), block_size, E)
    layout = hj.Indexed(*aligned, top_k=2, block_size=block_size, lists_dropped=True)
    ref = _kernel_reference(x, weight, layout)
    _check(hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND), ref, bound=1e-5)


@pytest.mark.parametrize("lists_dropped", sweep([False, True], [True]))
@pytest.mark.bounds
def test_indexed_rows_of_dead_blocks_are_zero(lists_dropped, rng):
    """Hand-made indexed layouts (16 slots, blocks of 16): slot 3 sits in a block
    of expert -1 and slot 7 past ``num_tokens_padded``; with ``lists_dropped``
    the kernel zeroes both rows itself (the output starts uninitialized: NaN
    when interpreted), without it slot 12, listed nowhere, is zero too (the
    zero-filled output)."""
    from humming_jax.gemm import _layout_spec

    weight = _weight(rng, F.INT4_G128, E)
    x = jnp.asarray(rng.normal(size=(16, K)), jnp.bfloat16)
    sentinel = 16
    live = [s for s in range(16) if s not in (3, 7, 12)]
    blocks = [live[:6], [3], live[6:], [7, 12] if lists_dropped else [7]]
    sorted_ids = np.concatenate([np.pad(b, (0, 16 - len(b)), constant_values=sentinel) for b in blocks])
    layout = hj.Indexed(
        jnp.asarray(sorted_ids, jnp.int32),
        jnp.asarray([1, -1, 2, -1], jnp.int32),
        jnp.asarray([48], jnp.int32),
        top_k=1,
        block_size=16,
        lists_dropped=lists_dropped,
    )
    assert _layout_spec(layout, 16)[0].zero_filled is not lists_dropped
    out = np.asarray(hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND))
    assert np.all(out[[3, 7, 12]] == 0)
    _check(jnp.asarray(out), _kernel_reference(x, weight, layout), bound=1e-5)


@pytest.mark.parametrize("fmt_name,top_k", sweep([("int4_g128", 4), ("bf16", 1), ("mxfp4", 2)], [("int4_g128", 4)]))
def test_indexed_in_slot_order(fmt_name, top_k, rng):
    """Each slot its own block (``moe_slot_blocks``, ``slot_order``: decode's
    layout, the kernel reading expert_ids alone): ids outside ``[0, E)``, −1 and
    a repeated expert; equals the same arrays read as a plain indexed layout
    bit for bit, and the float64 product; the rows of invalid slots are zero
    in an output the kernel alone writes (NaN-poisoned when interpreted)."""
    from humming_jax.gemm import _layout_spec

    weight = _weight(rng, F.get_format(fmt_name), E)
    tokens = 3
    x = jnp.asarray(rng.normal(size=(tokens, K)), jnp.bfloat16)
    ids = rng.integers(0, E, size=(tokens, top_k)).astype(np.int32)
    ids.reshape(-1)[[0, -1]] = (-1, E)  # a dropped slot each end
    ids.reshape(-1)[1] = ids.reshape(-1)[2]  # an expert twice
    if ids.size > 4:  # int32's extremes: dead blocks too, never an address
        ids.reshape(-1)[[3, 4]] = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)
    arrays = hj.moe_slot_blocks(jnp.asarray(ids), 16)
    ordered = hj.Indexed(*arrays, top_k=top_k, block_size=16, lists_dropped=True, slot_order=True)
    plain = dataclasses.replace(ordered, slot_order=False)
    assert _layout_spec(ordered, tokens)[0].slot_order and not _layout_spec(ordered, tokens)[0].zero_filled
    got, want = (
        np.asarray(hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND))
        for layout in (ordered, plain)
    )
    np.testing.assert_array_equal(got, want)
    dead = np.flatnonzero((ids.reshape(-1) < 0) | (ids.reshape(-1) >= E))
    assert np.all(got[dead] == 0)
    _check(jnp.asarray(got), _kernel_reference(x, weight, plain), bound=1e-5)


@pytest.mark.parametrize(
    "fmt_name,tokens,top_k,tuning",
    sweep(
        [
            ("int4_g128", 5, 4, None),
            ("bf16", 16, 3, None),
            ("mxfp4", 1, 1, None),
            ("int4_g128", 7, 2, kernel.Tiles(block_m=16, block_n=32, block_k=128, swap_ab=True)),
            ("fp8_channel", 3, 6, kernel.Tiles(block_m=16, block_n=64, block_k=64, split_k=2)),
            ("int4_g128", 2, 2, None),
            ("int4_g128", 1, 4, None),
        ],
        [("int4_g128", 5, 4, None), ("int4_g128", 1, 4, None)],
    ),
)
def test_indexed_tiled_by_expert(fmt_name, tokens, top_k, tuning, rng):
    """Slot blocks tiled by expert (``tile_by_expert=k``: decode's few tokens,
    a row tile an expert, a row a token, no grouping): both GEMMs' layouts (w13
    reading token rows, ``top_k=k``: a token's row stored to each of its slots
    on the expert; w2 reading slot rows, ``top_k=1``: a tile an expert and
    level) with ids outside ``[0, E)``, int32's extremes, an expert twice in a
    token and a hot expert; equal bit for bit to the same arrays in slot order,
    and to the float64 product; the rows of invalid slots zero in an output the
    kernel alone writes."""
    from humming_jax.gemm import _layout_spec

    weight = _weight(rng, F.get_format(fmt_name), E)
    ids = rng.integers(0, E, size=(tokens, top_k)).astype(np.int32)
    ids[:, 0] = 2  # a hot expert
    flat = ids.reshape(-1)
    flat[-1] = E
    if flat.size > 4:
        flat[[1, 2]] = (-1, np.iinfo(np.int32).max)
    if top_k > 2:
        ids[0, 1:3] = 3  # an expert twice in one token
    slots = jnp.asarray(rng.normal(size=(tokens * top_k, K)), jnp.bfloat16)
    rows = jnp.asarray(rng.normal(size=(tokens, K)), jnp.bfloat16)
    arrays = hj.moe_slot_blocks(jnp.asarray(ids), 16)
    for x, layout_top_k in ((rows, top_k), (slots, 1)):
        ordered = hj.Indexed(*arrays, top_k=layout_top_k, block_size=16, lists_dropped=True, slot_order=True)
        tiled = dataclasses.replace(ordered, tile_by_expert=top_k)
        assert _layout_spec(tiled, x.shape[0])[0].tile_by_expert == top_k
        got, want = (
            np.asarray(hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND, tuning=tuning))
            for layout in (tiled, ordered)
        )
        np.testing.assert_array_equal(got, want)
        dead = np.flatnonzero((flat < 0) | (flat >= E))
        assert np.all(got[dead] == 0)
        reference = _reference_for(tuning, x, weight, ordered) if tuning else _kernel_reference(x, weight, ordered)
        _check(jnp.asarray(got), reference, bound=1e-5)


def test_tile_by_expert_layout_validation():
    ids = jnp.asarray([[1, 2], [3, 0]], jnp.int32)
    arrays = hj.moe_slot_blocks(ids, 2)
    x = jnp.ones((2, K), jnp.bfloat16)
    weight = _weight(np.random.default_rng(0), F.INT4_G128, E)
    plain = hj.Indexed(*arrays, top_k=2, block_size=2, lists_dropped=True)
    with pytest.raises(ValueError, match="layout.tile_by_expert: tiles slot blocks"):
        hj.gemm(x, weight, dataclasses.replace(plain, tile_by_expert=2), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match=r"layout.tile_by_expert: M·top_k=4 slots are not whole tokens of 3"):
        hj.gemm(x, weight, dataclasses.replace(plain, slot_order=True, tile_by_expert=3), backend=KERNEL_BACKEND)
    big = hj.Indexed(*hj.moe_slot_blocks(jnp.zeros((3, 2), jnp.int32), 2), top_k=2, block_size=2, lists_dropped=True)
    with pytest.raises(ValueError, match="at most block_size=2 of them"):
        layout = dataclasses.replace(big, slot_order=True, tile_by_expert=2)
        hj.gemm(jnp.ones((3, K), jnp.bfloat16), weight, layout, backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="layout.tile_by_expert: expected 0 or the slots"):
        hj.gemm(x, weight, dataclasses.replace(plain, slot_order=True, tile_by_expert=-1), backend=KERNEL_BACKEND)


def test_slot_order_layout_validation():
    ids = jnp.asarray([[1, 2], [3, 0]], jnp.int32)
    arrays = hj.moe_slot_blocks(ids, 16)
    x = jnp.ones((2, K), jnp.bfloat16)
    weight = _weight(np.random.default_rng(0), F.INT4_G128, E)
    with pytest.raises(ValueError, match="layout.lists_dropped: slot_order"):
        hj.gemm(x, weight, hj.Indexed(*arrays, top_k=2, block_size=16, slot_order=True), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match=r"layout.expert_ids: slot_order .* M·top_k=2"):
        layout = hj.Indexed(*arrays, top_k=1, block_size=16, lists_dropped=True, slot_order=True)
        hj.gemm(x, weight, layout, backend=KERNEL_BACKEND)


def test_multiply_add_config_validation():
    with pytest.raises(ValueError, match="use_mma"):
        kernel.Tiles(block_m=16, use_mma=False)
    with pytest.raises(ValueError, match="block_m"):
        kernel.Tiles(block_m=4)


def test_word_decode_f16(rng):
    tuning = kernel.Tiles(block_m=16, block_n=32, block_k=128, word_decode=True)
    _check_tiling(rng, "int4_g128", "grouped_contiguous", tuning, x_dtype=jnp.float16)


_FOLDED_TILINGS = {
    "prefill": kernel.Tiles(block_m=64, block_n=32, block_k=128, swap_ab=True, fold_scales=True),
    "decode_word": kernel.Tiles(block_m=16, block_n=32, block_k=128, word_decode=True, fold_scales=True),
}
_FOLDED_FORMATS = (
    "int4_g128+bias",
    "int4_channel",
    "uint4_zp_g128",
    "uint4_fzp_g128",
    "int8_g64",
    "mxfp4",
    "nvfp4",
    "fp8_block128",
)


# make test: a weight of each kind, the two tilings in turn.
@pytest.mark.parametrize(
    "fmt_name,tiling",
    sweep(
        [(f, t) for f in _FOLDED_FORMATS for t in _FOLDED_TILINGS],
        [
            (f, list(_FOLDED_TILINGS)[i % 2])
            for i, f in enumerate(_FOLDED_FORMATS)
            if f not in ("int4_channel", "uint4_fzp_g128", "int8_g64", "int4_g128+bias")
        ],
    ),
)
def test_folded_scales(fmt_name, tiling, rng):
    """``fold_scales``: the kernel multiplies the decoded tile by its scales and
    rounds ``(q - z) * s`` once to bf16, so it equals the reference run on the
    bf16-rounded dequantized weight (f32 output, bound 1e-5); e2m1 values times
    their scales are exact (NVFP4's global scale comes after the product, MXFP4
    and NVFP4 carry the split exponent, E2M1_FOLDED_EXPONENT)."""
    layout_kind, tuning = "indexed", _FOLDED_TILINGS[tiling]
    weight = _weight(rng, F.get_format(fmt_name), E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = _layouts(rng, tuning.block_m)[layout_kind]
    ref = _reference_for(tuning, x, weight, layout)
    _check(hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND), ref, bound=1e-5)


@pytest.mark.parametrize("fmt_name", ["uint4_zp_g128"])
def test_folded_zero_points_with_a_partial_last_tile(fmt_name, rng):
    """Folded scales and zero points (one load per group run) when the last K
    tile is partial (K=384 with 256-wide tiles): the bf16-rounded reference."""
    weight = _weight(rng, F.get_format(fmt_name), E, k=384)
    x = jnp.asarray(rng.normal(size=(M, 384)), jnp.bfloat16)
    # The K tail is the same code on every layout: the pipelines' two.
    for layout in (_layouts(rng)[kind] for kind in ("grouped_contiguous", "indexed")):
        tuning = kernel.Tiles(16, 32, 256, word_decode=True, fold_scales=True)
        out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
        _check(out, _folded_reference(x, weight, layout), bound=1e-5)


_K_TAILS = [
    ("mxfp4", 96, kernel.Tiles(block_m=64, block_n=32, block_k=64)),  # split x, scales in the weights
    ("mxfp4", 160, kernel.Tiles(block_m=16, block_n=32, block_k=128, word_decode=True)),
    ("int4_channel", 160, kernel.Tiles(block_m=64, block_n=32, block_k=128, word_decode=True)),
    # The partial tile in the last split, and (split_k=4) a split with no tile at all.
    ("mxfp4", 160, kernel.Tiles(block_m=16, block_n=32, block_k=64, split_k=2)),
    ("int4_channel", 144, kernel.Tiles(block_m=16, block_n=32, block_k=32, split_k=4)),
]


@pytest.mark.parametrize("fmt_name,k,tuning", sweep(_K_TAILS, [_K_TAILS[4]]))
@pytest.mark.bounds
def test_k_not_a_multiple_of_the_tile(fmt_name, k, tuning, rng):
    """A last K tile that is partly past K (gpt-oss: K=2880 with 128-wide tiles)."""
    _check_tiling(rng, fmt_name, "grouped_contiguous", tuning, k=k)


_PLANAR_TILINGS = {
    "bytes_16rows": kernel.Tiles(16, 32, 64),
    "pairs_fold": kernel.Tiles(16, 32, 256, word_decode=True, pair_decode=True, fold_scales=True),
    "prefill_swap_fold_pairs": kernel.Tiles(
        64, 32, 128, swap_ab=True, group_m=2, word_decode=True, pair_decode=True, fold_scales=True
    ),
    "multiply_add": kernel.Tiles(8, 32, 64, use_mma=False),
    "split_k": kernel.Tiles(16, 32, 64, split_k=2),
    # The T=1 decode candidates: two splits of K, each with folded pairs.
    "pairs_fold_split_k": kernel.Tiles(
        16, 32, 128, split_k=2, swap_ab=True, word_decode=True, pair_decode=True, fold_scales=True
    ),
}


_HALF_BITS_TILINGS = ("bytes_16rows", "multiply_add", "pairs_fold", "split_k")


_PLANAR_CASES = [("int4_g128", "grouped_contiguous"), ("uint4_zp_g128", "indexed"), ("mxfp4+bias", "grouped_masked")]


# Each tiling with two of the three weights, each weight with four of the six tilings.
# make test: each tiling once (the weights in turn).
@pytest.mark.parametrize(
    "tiling,fmt_name,layout_kind",
    sweep(
        [(t, *_PLANAR_CASES[(i + j) % 3]) for i, t in enumerate(sorted(_PLANAR_TILINGS)) for j in (0, 1)],
        [
            (t, *_PLANAR_CASES[i % 3])
            for i, t in enumerate(sorted(_PLANAR_TILINGS))
            if t not in ("split_k", "bytes_16rows")
        ],
    ),
)
def test_planar_weights(fmt_name, layout_kind, tiling, rng):
    """Weights repacked at load time (``to_planar``: each unit's nibbles in the
    order the pair decoder reads, x used as it is) give the same output as in
    K order under every kind of tiling: byte, word and pair decode, 64-row
    tiles, swap_ab, folded scales, multiply-add tiles, split-K; bit-equal
    with the group scales stored ``[E, K/g, N]`` (``k_major_scales``)."""
    tuning = _PLANAR_TILINGS[tiling]
    if not tuning.use_mma and layout_kind == "indexed":  # indexed tiles are 16-row blocks: no multiply-add tiles
        layout_kind = "grouped_masked"
    fmt = F.get_format(fmt_name)
    weight = _weight(rng, fmt, 1 if layout_kind == "dense" else E)
    planar = hj.to_planar(weight)
    assert planar.nibble_unit == F.planar_unit(fmt, K) > 0
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = _layouts(rng, tuning.block_m)[layout_kind]
    run = dict(out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
    ref = _reference_for(tuning, x, weight, layout)
    out = hj.gemm(x, planar, layout, **run)
    _check(out, ref, bound=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(hj.gemm(x, weight, layout, **run)), rtol=1e-6, atol=1e-6)
    # group scales stored [E, K/g, N] (what to_kernel_order gives MXFP4): the same loads, transposed
    major = hj.to_planar(weight, k_major_scales=True)
    assert major.k_major_scales
    np.testing.assert_array_equal(np.asarray(hj.gemm(x, major, layout, **run)), np.asarray(out))
    if fmt.value_type == F.ValueType.FLOAT4_E2M1 and tiling in _HALF_BITS_TILINGS:
        # the decoder's bit order is read as pairs + fold only (bytes, multiply-adds, split K refused)
        bits = hj.to_planar(weight, half_bits=True)
        assert bits.half_bits and not np.array_equal(np.asarray(bits.values), np.asarray(planar.values))
        if not (tuning.pair_decode and tuning.fold_scales and tuning.block_k >= 128):
            with pytest.raises(ValueError, match="half-bits"):
                hj.gemm(x, bits, layout, **run)
        pairs = dict(word_decode=True, pair_decode=True, fold_scales=True, block_k=max(128, tuning.block_k))
        out_bits = hj.gemm(x, bits, layout, **dict(run, tuning=dataclasses.replace(tuning, **pairs)))
        _check(out_bits, _reference(x, weight, layout), bound=1e-5)


@pytest.mark.bounds
def test_planar_weights_with_a_partial_last_tile(rng):
    """K=384 with 256-wide tiles: the last K tile's second unit is masked."""
    weight = _weight(rng, F.INT4_G128, E, k=384)
    x = jnp.asarray(rng.normal(size=(M, 384)), jnp.bfloat16)
    layout = _layouts(rng)["grouped_contiguous"]
    tuning = kernel.Tiles(16, 32, 256, word_decode=True, pair_decode=True, fold_scales=True)
    out = hj.gemm(x, hj.to_planar(weight), layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
    _check(out, _folded_reference(x, weight, layout), bound=1e-5)


def test_planar_weights_need_no_split_copy_of_x(rng):
    """With K-order 4-bit weights a word-decoded tiling first copies x with
    each span's columns grouped by piece (a transpose XLA runs before the
    kernel); planar weights hand x to the kernel as it is."""
    weight = _weight(rng, F.INT4_G128, E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = _layouts(rng)["grouped_contiguous"]
    tuning = kernel.Tiles(16, 32, 256, word_decode=True, pair_decode=True, fold_scales=True)

    def outside_kernels(jaxpr):  # primitive names, through nested jits, not into the Pallas kernels
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            if eqn.primitive.name == "pallas_call":
                continue
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from outside_kernels(inner)

    def primitives(w):
        closed = jax.make_jaxpr(lambda x, w: hj.gemm(x, w, layout, tuning=tuning, backend=KERNEL_BACKEND))(x, w)
        names = set(outside_kernels(closed.jaxpr))
        assert "pallas_call" in names
        return names

    assert "transpose" in primitives(weight)
    assert "transpose" not in primitives(hj.to_planar(weight))


def test_folded_e2m1_split_of_the_exponent():
    """Folded e2m1 scales carry the decoder's missing factor: the decoded value
    times the folded scale is the weight times 2**-62 on every path (the GPU's
    word decoder without its normalizing multiply: 2**-126 x 2**64; bytes or
    interpret mode: 2**-6 x 2**-56), and the sum is multiplied by 2**62."""
    plan = dict(span=256, in_weights=True, x_split=False, compute_dtype=jnp.bfloat16, scale_in_compute=True)
    for on_gpu, ways, decoded in ((True, 8, wd.E2M1_RAW_FACTOR), (False, 8, wd.E2M1_FACTOR), (True, 2, wd.E2M1_FACTOR)):
        p = kernel._SpanPlan(**plan, ways=ways, on_gpu=on_gpu, folded_e2m1=True)
        assert p.raw_e2m1 == (on_gpu and ways == 8)
        assert decoded * 2.0**p.scale_exponent == 2.0**-kernel.E2M1_FOLDED_EXPONENT
    fold = kernel.Tiles(16, 32, 256, word_decode=True, pair_decode=True, fold_scales=True)
    mxfp4 = WeightSpec(E, N, K, "float4_e2m1", "group", "e8m0", 32)
    assert kernel.folds_e2m1(mxfp4, fold, jnp.bfloat16) and not kernel.folds_e2m1(mxfp4, fold, jnp.float16)
    assert not kernel.folds_e2m1(mxfp4, dataclasses.replace(fold, fold_scales=False), jnp.bfloat16)
    assert kernel.value_factor(mxfp4, True) == 2.0**62 and kernel.value_factor(mxfp4) == 64.0


def test_grouped_row_tiles_cover_work_and_gaps():
    """The grouped grid's static bound on row tiles, min(E, M) + (M - min(E, M)) // bm + 1,
    is one more than the most tiles any split of M rows over E experts needs
    (exhaustive for small cases), and at least the chunks of bm rows outside
    every group (before the first, after the last), which row tile t zeroes
    chunk by chunk; T=1 on 128 experts launches 9 row tiles, not 129."""
    import itertools

    for m, e, bm in ((8, 4, 4), (9, 3, 4), (12, 5, 4), (40, 4, 16), (6, 8, 2), (5, 2, 16)):
        layout = LayoutSpec("grouped_contiguous", m, m)
        bound = kernel.num_row_tiles(layout, e, bm)
        most = 0
        for cuts in itertools.combinations_with_replacement(range(m + 1), e - 1):
            most = max(most, int(np.sum(-(-np.diff([0, *cuts, m]) // bm))))
        assert most == bound - 1, (m, e, bm)
        gaps = max(-(-first // bm) + -(-(m - last) // bm) for first in range(m + 1) for last in range(first, m + 1))
        assert gaps <= bound, (m, e, bm)
    assert kernel.num_row_tiles(LayoutSpec("grouped_contiguous", 8, 8), 128, 16) == 9


@pytest.mark.bounds
def test_gap_chunks_cover_the_rows_outside_every_group():
    """The chunks of bm rows the row tiles zero cover [0, first) and [last, M) once each."""
    for first, last, m, bm in ((0, 33, 40, 16), (5, 5, 40, 4), (17, 20, 64, 16), (0, 0, 7, 16), (3, 40, 40, 2)):
        head, tail = -(-first // bm), -(-(m - last) // bm)
        seen = []
        for chunk in range(head + tail):
            rows, keep = kernel.gap_chunk_rows(jnp.int32(first), jnp.int32(last), m, bm, jnp.int32(chunk))
            seen += np.asarray(rows)[np.asarray(keep)].tolist()
        assert sorted(seen) == [*range(first), *range(last, m)], (first, last, m, bm)


@pytest.mark.parametrize(
    "offsets,tuning",
    [
        ((17, 34, 36, 38, 39), kernel.Tiles(16, 32, 128)),  # 17 rows before the first group, 1 after the last
        ((9, 12, 12, 20, 23), kernel.Tiles(16, 32, 128)),
        ((9, 12, 12, 20, 23), kernel.Tiles(16, 32, 128, split_k=2)),  # zeros in both partials
        ((0, 1, 2, 3, 4), kernel.Tiles(16, 16, 128, swap_ab=True)),  # E rows + 36 outside
        ((0, 0, 0, 0, 0), kernel.Tiles(16, 32, 64)),  # no group: every row outside
        ((40, 40, 40, 40, 40), kernel.Tiles(16, 32, 64, split_k=2)),
    ],
)
@pytest.mark.bounds
def test_grouped_rows_outside_every_group_are_zero(offsets, tuning, rng):
    """No zero-filled buffer: the row tiles zero the rows outside every group
    (head and tail, split K, column tiles, swap_ab, no group at all);
    interpreted outputs start as NaN, so a row left unwritten fails."""
    weight = _weight(rng, F.INT4_G128, E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = hj.GroupedContiguous(jnp.asarray(offsets, jnp.int32))
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
    ref = _reference(x, weight, layout)
    _check(out, ref, bound=1e-5)
    outside = np.r_[0 : offsets[0], offsets[-1] : M]
    assert np.all(np.asarray(out)[outside] == 0) and np.all(np.asarray(ref)[outside] == 0)


@pytest.mark.bounds
def test_grouped_tiles_at_the_bound(rng):
    """Routings that need every row tile of the bound (one row on each of three
    experts, the rest on the fourth; and the reverse) against the reference."""
    weight = _weight(rng, F.INT4_G128, E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    tuning = kernel.Tiles(16, 32, 128)
    for counts in ((1, 1, 1, M - 3), (M - 7, 5, 1, 1)):
        layout = hj.GroupedContiguous(jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32))
        out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
        _check(out, _reference(x, weight, layout), bound=1e-5)


@pytest.mark.parametrize("fmt_name", ["nvfp4"])
def test_half_bits_with_a_partial_last_tile(fmt_name, rng):
    """e2m1 weights in the decoder's bit order with K=160 (gpt-oss's K=2880 is
    not a multiple of 128 either): the 128-wide pair tiles they need end in a
    partial one, with the tiles given and with the chosen ones."""
    weight = _weight(rng, F.get_format(fmt_name), E, k=160)
    x = jnp.asarray(rng.normal(size=(M, 160)), jnp.bfloat16)
    layout = _layouts(rng)["grouped_contiguous"]
    bits = hj.to_planar(weight, half_bits=True)
    tuning = kernel.Tiles(16, 32, 128, word_decode=True, pair_decode=True, fold_scales=True)
    out = hj.gemm(x, bits, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
    _check(out, _reference(x, weight, layout), bound=1e-5)
    _check(hj.gemm(x, bits, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND), _reference(x, weight, layout))
    with pytest.raises(ValueError, match="half-bits"):  # a tiling passed by hand runs as given or raises
        hj.gemm(x, bits, layout, tuning=kernel.Tiles(16, 32, 64), backend=KERNEL_BACKEND)


@pytest.mark.parametrize(
    "offsets",
    [
        (-(2**31) + 5, 5, 5, 30, 2**31 - 7),  # far-negative start, end near INT32_MAX
        (-3, -1, 12, 12, 90),  # an expert wholly before the rows, an end past them
        (45, 50, 60, 70, 80),  # every range past the rows: all zeros
        (0, 30, 10, 20, 40),  # decreasing: expert 1 owns nothing, expert 2 nothing, expert 3 rows 30-39
        (25, 3, 2**31 - 1, -5, 36),  # decreasing around extremes
    ],
)
@pytest.mark.bounds
def test_grouped_offsets_outside_the_rows(offsets, rng):
    """Offsets outside ``[0, M]`` or decreasing (public ``gemm`` and
    ``moonep_grouped_gemm`` take the caller's): every row written, equal to the
    reference, which owns row r by ``owned[e] <= r < owned[e+1]`` of the
    clipped running maximum (``GroupedContiguous.owned_offsets``)."""
    weight = _weight(rng, F.INT4_G128, E)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = hj.GroupedContiguous(jnp.asarray(offsets, jnp.int32))
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=kernel.Tiles(16, 32, 128), backend=KERNEL_BACKEND)
    assert np.all(np.isfinite(np.asarray(out)))
    _check(out, _reference(x, weight, layout), bound=1e-5)


# (format, layout, tiling, activation, input quantization, gate/up block): a tile of 64
# columns over half a pair of 64-row blocks (the decode tiles on the layer's order) or one
# pair of 32, of 128 over one pair of 64 or two of 32, of 32 over a quarter pair; plain
# and swapped accumulators, SWIGLUOAI's pairs, an ungated kind, fp8 inputs.
_EPILOGUE_ACTIVATIONS = [
    ("bf16", "grouped_contiguous", kernel.Tiles(block_m=16, block_n=64, block_k=64), "silu", None, 64),
    (
        "int4_g128",
        "indexed",
        kernel.Tiles(16, 64, 256, swap_ab=True, word_decode=True, fold_scales=True, pair_decode=True),
        "gelu_tanh",
        None,
        64,
    ),
    (
        "mxfp4",
        "grouped_masked",
        kernel.Tiles(32, 128, 128, num_warps=8, swap_ab=True, word_decode=True),
        "silu",
        None,
        32,
    ),
    ("mxfp4+bias", "dense", kernel.Tiles(block_m=16, block_n=64, block_k=128), "swigluoai", None, 0),
    ("nvfp4", "grouped_contiguous", kernel.Tiles(block_m=32, block_n=128, block_k=64), "relu2_no_mul", None, 0),
    (
        "fp8_channel",
        "grouped_contiguous",
        kernel.Tiles(block_m=16, block_n=128, block_k=128),
        "swiglustep",
        "fp8_dynamic_token",
        64,
    ),
    ("uint4_zp_g128", "indexed", kernel.Tiles(block_m=16, block_n=128, block_k=128), "gelu", None, 32),
    ("bf16+bias", "grouped_masked", kernel.Tiles(block_m=16, block_n=32, block_k=64), "silu", None, 64),
    # W8A8's decode tile on blocks of 128 (whole scale blocks): its two runs in two scale blocks.
    ("fp8_block128", "indexed", kernel.Tiles(16, 64, 256), "silu", "fp8_dynamic_group128", 128),
    # ... and on blocks of 64 (what to_kernel_order stores: a scale a 64-row block).
    ("fp8_block128", "grouped_contiguous", kernel.Tiles(16, 64, 256), "silu", "fp8_dynamic_group128", 64),
]


def _activated_reference(x, weight, layout, activation, bf16_weight: bool):
    """act(the float64 product) on the weight's logical rows (gate, then up), float64."""
    product = np_ref.gemm_of(x, weight, layout, bf16_weight=bf16_weight)
    return np_ref.activation(product, activation.kind.value, activation.clamp_limit)


@pytest.mark.parametrize(
    "fmt_name,layout_kind,tiling,kind,quant,block", sweep(_EPILOGUE_ACTIVATIONS, _EPILOGUE_ACTIVATIONS[:4])
)
def test_activation_in_the_epilogue(fmt_name, layout_kind, tiling, kind, quant, block, rng):
    """``gemm(activation=)``: the tile applies the activation to its f32 sums
    and stores ``N/2`` columns (gated) from gate and up rows interleaved by
    blocks (SWIGLUOAI: its own pairs); against the float64 activation of
    the float64 product, rows no tile owns zero (the output NaN-poisoned when
    interpreted), bf16 output within its rounding."""
    fmt = F.get_format(fmt_name)
    n, e = max(128, 2 * block), 1 if layout_kind == "dense" else E
    w = jnp.asarray(rng.normal(0, 0.05, (e, n, K)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(e, n)), jnp.float32) if fmt.has_bias else None
    weight = F.quantize_weight(w, fmt, bias=bias)
    if fmt.value_type.is_packed and tiling.word_decode:
        weight = hj.to_planar(weight, half_bits=tiling.pair_decode and fmt.value_type.value == "float4_e2m1")
    activation = hj.ActivationSpec(kind, clamp_limit=3.0 if kind == "silu" and tiling.swap_ab else None)
    if activation.interleaves:
        weight = hj.interleave_gate_up(weight, block)
        activation = dataclasses.replace(activation, gate_up_block=block)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    if quant is not None:
        x = hj.quantize_input(x, quant)
    layout = _layouts(rng, tiling.block_m)[layout_kind]
    bf16_weight = tiling.fold_scales and fmt.value_type.value not in ("float4_e2m1", "float8_e4m3")
    ref = _activated_reference(x, weight, layout, activation, bf16_weight)
    out = hj.gemm(
        x, weight, layout, out_dtype=jnp.float32, tuning=tiling, activation=activation, backend=KERNEL_BACKEND
    )
    assert out.shape == (layout.output_rows(M), activation.output_width(n))
    _check(out, ref, bound=1e-5)
    _check(hj.gemm(x, weight, layout, tuning=tiling, activation=activation, backend=KERNEL_BACKEND), ref)
    reference = hj.gemm(x, weight, layout, out_dtype=jnp.float32, activation=activation, backend="reference")
    _check(reference, _activated_reference(x, weight, layout, activation, False), bound=1e-5)


def test_activation_in_the_epilogue_of_a_zero_filled_indexed_output(rng):
    """An indexed layout that does not list its dropped slots: the kernel
    updates a zeroed output of ``N/2`` columns."""
    weight = hj.interleave_gate_up(_weight(rng, F.INT4_G128, E), 32)
    activation = hj.ActivationSpec("silu", gate_up_block=32)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = dataclasses.replace(_layouts(rng)["indexed"], lists_dropped=False)
    tiling = kernel.Tiles(block_m=16, block_n=64, block_k=128)
    out = hj.gemm(
        x, weight, layout, out_dtype=jnp.float32, tuning=tiling, activation=activation, backend=KERNEL_BACKEND
    )
    _check(out, _activated_reference(x, weight, layout, activation, False), bound=1e-5)


def test_what_cannot_apply_the_activation(rng):
    """Split K, gate and up in halves, a tile cutting a gate/up pair and the
    Mosaic kernel's swapped tiles on blocks of 32 refuse with a reason; ``plan`` keeps the
    tiling the call runs without the activation (a later candidate was not
    tuned for it); the activation must read the weight's row order."""
    from humming_jax.gemm import as_epilogue_activation, as_quantized_input, gemm_call
    from pallas_kernels.gemm import mosaic

    weight = _weight(rng, F.BF16, E)  # N = 64
    layout = _layouts(rng)["grouped_contiguous"]
    x = as_quantized_input(jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16))
    interleaved = hj.interleave_gate_up(weight, 32)
    silu32 = hj.ActivationSpec("silu", gate_up_block=32)

    def refusal(tiles, w, activation):
        call = gemm_call(x, w, layout, jnp.bfloat16, interpret=True)
        call = dataclasses.replace(call, activation=as_epilogue_activation(activation))
        module = kernel if isinstance(tiles, kernel.Tiles) else mosaic
        return module.supports(tiles, call)

    tile = kernel.Tiles(block_m=16, block_n=64, block_k=64)
    assert refusal(tile, interleaved, silu32) is None
    assert "split_k" in refusal(dataclasses.replace(tile, split_k=2), interleaved, silu32)
    assert "halves" in refusal(tile, weight, hj.ActivationSpec("silu"))
    assert "cuts gate/up blocks" in refusal(
        tile, hj.interleave_gate_up(weight, 16), hj.ActivationSpec("silu", gate_up_block=48)
    )
    assert "swap_ab" in refusal(mosaic.Tiles(swap_ab=True), interleaved, silu32)
    # The table's first candidate for the call (here: the caller's) decides.
    found, reasons = plan(
        x, interleaved, layout, tuning=dataclasses.replace(tile, split_k=2), activation=silu32, interpret=True
    )
    assert found is None and "split_k" in reasons[-1]
    with pytest.raises(ValueError, match="gate_up_block"):
        hj.gemm(x, interleaved, layout, activation="silu", backend=KERNEL_BACKEND)  # halves asked, blocks stored
    with pytest.raises(ValueError, match="tuning"):
        hj.gemm(x, weight, layout, tuning=tile, activation="silu", backend=KERNEL_BACKEND)


@pytest.mark.parametrize("kind,block", [("silu", 32), ("swigluoai", 0)])
@pytest.mark.bounds
def test_activation_in_a_partial_last_tile(kind, block, rng):
    """N = 192 on 128-column tiles (gpt-oss's 5760 on 256): the last tile holds
    one pair of 32-row blocks (SWIGLUOAI: 32 pairs) and masked columns; its
    outputs past N/2 are not stored."""
    w = jnp.asarray(rng.normal(0, 0.05, (E, 192, K)), jnp.float32)
    weight = F.quantize_weight(w, F.BF16)
    activation = hj.ActivationSpec(kind)
    if block:
        weight, activation = hj.interleave_gate_up(weight, block), hj.ActivationSpec(kind, gate_up_block=block)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    layout = _layouts(rng)["grouped_contiguous"]
    tiling = kernel.Tiles(block_m=16, block_n=128, block_k=64)
    out = hj.gemm(
        x, weight, layout, out_dtype=jnp.float32, tuning=tiling, activation=activation, backend=KERNEL_BACKEND
    )
    assert out.shape == (M, 96)
    _check(out, _activated_reference(x, weight, layout, activation, False), bound=1e-5)
