"""The Triton GEMM with quantized inputs (W8A8, W4A8, int8, MXFP8, NVFP4, …;
interpret mode on the CPU, compiled on a GPU) against the reference, and the
reference against an independent float64 NumPy product.

What we measure: 8-bit input values enter the product exactly (fp8 operands
where both sides are exact in e4m3, else bf16), group scales multiply each
span's f32 partial product and row/tensor scales the sum, so against the
reference (f32, dequantized operands) ‖kernel − reference‖/‖reference‖ is
~3e-7 (summation order); bound 1e-5. Compiled, fp8 x fp8 products sum 128
columns on the tensor cores in their own reduced precision between f32
promotions (``fp8_dot.PROMOTE_K``, as the CUDA libraries do): ~1e-4 on the
H200, bound 1e-3 for those calls. Tilings with folded weight scales are
held to the reference on the bf16-rounded weight (as in test_gemm_kernel).
Rows no tile owns must be exactly zero.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax.gemm import gemm_call, plan
from pallas_kernels.gemm import mosaic, mosaic_mid
from pallas_kernels.gemm import triton as kernel

import gemm_layouts
import np_ref
from np_ref import relative_error
from sweep import FULL, sweep

KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
E, N, K, M = 4, 64, 128, 40
# Every advertised quantized pair but repeats: integer groups of 32 and 64
# read as those of 128 do and per-tensor / per-channel weight scales as each
# other (test_gemm_kernel covers each weight with 16-bit inputs), so those
# weights meet one input each; e5m2 per token reads as int8 per token (bf16
# operands, a row scale) but for its load, kept with two weights.
_REPEATS = {"int4_g32", "int4_g64", "int8_g32", "int8_g64"}
_ONE_INPUT = {"fp8_tensor": "fp8_static_tensor", "int4_channel": "fp8_dynamic_token", "int8_g128": "int8_dynamic_token"}
_E5M2_WITH = {"fp8_channel", "int4_g128"}
PAIRS = [
    (fmt_name, quant.name)
    for fmt_name in sorted(set(F.PRESETS) - _REPEATS)
    for quant in hj.supported_input_specs(F.get_format(fmt_name))
    if quant.is_quantized
    and (quant.dtype.value != "float8_e5m2" or fmt_name in _E5M2_WITH)
    and _ONE_INPUT.get(fmt_name, quant.name) == quant.name
]
# make test: one pair per operand path and scale kind (the others read as one of them).
_PAIRS_CI = [
    ("fp8_block128", "fp8_dynamic_group128"),
    ("fp8_tensor", "fp8_static_tensor"),  # (per-token input scales: int4 and uint4 below)
    ("fp8_channel", "fp8_e5m2_dynamic_token"),
    ("int4_g128", "fp8_dynamic_token"),
    ("int4_g128", "int8_dynamic_token"),
    ("int8_channel", "int8_dynamic_token"),
    ("mxfp4", "fp8_dynamic_group128"),
    ("mxfp8", "mxfp8_dynamic"),
    ("nvfp4", "nvfp4_dynamic"),
    ("uint4_zp_g128", "fp8_dynamic_token"),
]
# One pair per operand path for the other layouts and the edge cases.
PATHS = [
    ("fp8_block128", "fp8_dynamic_group128"),  # fp8 operands, group and block scales per span
    ("mxfp4", "fp8_dynamic_group128"),  # bf16 operands, e2m1 scales folded, input scale per span
    ("int8_channel", "int8_dynamic_token"),  # bf16 operands, row scale in the epilogue
    ("nvfp4", "nvfp4_dynamic_token"),  # 4-bit input read as exact bf16, second scale per row
]


def _weight(rng, fmt, e=E, k=K, n=N):
    w = jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32)
    return F.quantize_weight(w, fmt)


def _input(rng, quant, m=M, k=K):
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    static = jnp.float32(np.abs(np.asarray(x)).max() / quant.dtype.max_value) if quant.mode.is_static else None
    return Q.quantize_input(x, quant, static_scale=static)


def _layouts(rng, block_size=16):
    return gemm_layouts.layouts(rng, E, M, block_size)


def _reference(x, weight, layout, tuning=None):
    """The float64 NumPy product the kernel must match: with folded scales that
    round (integer weights, fp8 with f32 scales) the weight is rounded to bf16
    once, with ``dequantize_input`` the scaled input (test_reference_matches_numpy
    holds the ``jnp`` reference to it)."""
    if tuning is None:
        tuning, _ = plan(x, weight, layout, out_dtype=jnp.float32, interpret=True)
    fmt = weight.format
    exact = fmt.value_type.value in ("float4_e2m1", "float8_e4m3") and fmt.scale_type.value in ("e8m0", "float8_e4m3")
    # (a bf16 weight takes no quantized input: no checks)
    if getattr(tuning, "dequantize_input", False):  # the op rounds the scaled input to bf16 first
        x = Q.dequantize_input(x).astype(jnp.bfloat16)
    return np_ref.gemm_of(x, weight, layout, bf16_weight=getattr(tuning, "fold_scales", False) and not exact)


def _bound(x, weight, layout, tiles=None) -> float:
    """1e-5, or for a compiled call on fp8 tensor cores 1e-3 (see above)."""
    if KERNEL_BACKEND == "interpret":
        return 1e-5
    if tiles is None:
        tiles, _ = plan(x, weight, layout, out_dtype=jnp.float32)
    call = gemm_call(x, weight, layout, jnp.float32)
    fp8 = isinstance(tiles, kernel.Tiles) and kernel.operand_dtype(call, tiles) == jnp.float8_e4m3fn
    return 1e-3 if fp8 else 1e-5


def _check(out, ref, bound=1e-5):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    assert relative_error(out, ref) < bound
    unowned = np.all(ref == 0, axis=1)
    assert np.all(out[unowned] == 0), "rows no tile owns must be zero"


@pytest.mark.parametrize("fmt_name,quant_name", sweep(PAIRS, _PAIRS_CI))
def test_every_pair_on_the_grouped_layout(fmt_name, quant_name, rng):
    fmt, quant = F.get_format(fmt_name), Q.get_input_spec(quant_name)
    weight, x = _weight(rng, fmt), _input(rng, quant)
    layout = _layouts(rng)["grouped_contiguous"]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND)
    _check(out, _reference(x, weight, layout), _bound(x, weight, layout))


@pytest.mark.parametrize(
    "fmt_name,quant_name,layout_kind",
    sweep(
        [(*path, kind) for kind in ("grouped_masked", "indexed") for path in PATHS] + [(*PATHS[0], "dense")],
        [
            (*PATHS[i], kind)
            for i, kind in ((0, "grouped_masked"), (1, "indexed"), (2, "indexed"), (3, "grouped_masked"))
        ]
        + [(*PATHS[0], "dense")],
    ),
)
@pytest.mark.bounds
def test_other_layouts(fmt_name, quant_name, layout_kind, rng):
    fmt, quant = F.get_format(fmt_name), Q.get_input_spec(quant_name)
    weight = _weight(rng, fmt, 1 if layout_kind == "dense" else E)
    x, layout = _input(rng, quant), _layouts(rng)[layout_kind]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND)
    _check(out, _reference(x, weight, layout), _bound(x, weight, layout))


@pytest.mark.parametrize("fmt_name,quant_name", PATHS)
def test_reference_matches_numpy(fmt_name, quant_name, rng):
    """The reference of a quantized pair is the float64 product of the
    dequantized input and weight (decoded here from their bits)."""
    fmt, quant = F.get_format(fmt_name), Q.get_input_spec(quant_name)
    weight, x = _weight(rng, fmt), _input(rng, quant)
    offsets = np.array([0, 7, 7, 30, 33])
    out = hj.gemm(x, weight, hj.GroupedContiguous(jnp.asarray(offsets, jnp.int32)), backend="reference")
    xd, wd = np_ref.dequantize_input(x), np_ref.dequantize_weight(weight)
    want = np.zeros((M, N))
    for e in range(E):
        rows = slice(offsets[e], offsets[e + 1])
        want[rows] = xd[rows] @ wd[e].T
    assert relative_error(np.asarray(out, np.float64), want) < 1e-2  # a bf16 output


def test_operand_paths():
    """e4m3 inputs meet e4m3 / e2m1 / int4 weights on the fp8 tensor cores when
    the spans hold a whole fp8 MMA; the other pairs as exact 16-bit values."""

    def operand(fmt_name, quant_name, tiles):
        fmt, quant = F.get_format(fmt_name), Q.get_input_spec(quant_name)
        x = Q.QuantizedInput(jax.ShapeDtypeStruct((M, K), quant.dtype.storage_dtype), spec=quant, k=K)
        weight = jax.eval_shape(lambda: _weight(np.random.default_rng(0), fmt))
        call = gemm_call(x, weight, hj.Dense(), jnp.bfloat16)
        assert kernel.supports(tiles, call) is None
        return jnp.dtype(kernel.operand_dtype(call, tiles)).name

    plain = kernel.Tiles(64, 64, 128)
    assert operand("fp8_block128", "fp8_dynamic_group128", plain) == "float8_e4m3fn"
    assert operand("mxfp8", "mxfp8_dynamic", plain) == "float8_e4m3fn"  # spans of 32: one fp8 MMA each
    assert operand("int4_g128", "fp8_dynamic_token", plain) == "float8_e4m3fn"  # byte pieces of 64 columns
    assert operand("fp8_block128", "fp8_e5m2_dynamic_token", plain) == "bfloat16"
    assert operand("int8_channel", "int8_dynamic_token", plain) == "int8"
    assert operand("int4_g128", "int8_dynamic_token", plain) == "int8"
    assert operand("uint4_zp_g128", "int8_dynamic_token", plain) == "bfloat16"
    assert operand("mxfp4", "fp8_dynamic_group128", plain) == "bfloat16"  # pieces of 16 columns
    pairs = kernel.Tiles(64, 64, 128, word_decode=True, pair_decode=True, fold_scales=True)
    assert operand("mxfp4", "fp8_dynamic_group128", pairs) == "float8_e4m3fn"  # scales shifted to the span's
    assert operand("nvfp4", "fp8_dynamic_token", pairs) == "bfloat16"  # e4m3 group scales: products, not shifts
    decode = kernel.Tiles(16, 64, 128, word_decode=True, pair_decode=True, fold_scales=True)
    assert operand("mxfp4", "fp8_dynamic_group128", decode) == "bfloat16"  # the bf16 decode is cheaper
    assert operand("int4_g128", "fp8_dynamic_token", kernel.Tiles(64, 64, 128, fold_scales=True)) == "bfloat16"


@pytest.mark.parametrize(
    "fmt,quant",
    [
        (F.FP8_CHANNEL, Q.FP8_DYNAMIC_GROUP128),
        (F.FP8_BLOCK128, Q.FP8_DYNAMIC_GROUP128),
        (F.INT4_G128, Q.FP8_DYNAMIC_TOKEN),
    ],
    ids=["fp8_channel", "fp8_block128", "int4_g128"],
)
@pytest.mark.parametrize("tiles", [kernel.Tiles(16, 32, 256), kernel.Tiles(16, 64, 64, split_k=2)])
@pytest.mark.bounds
def test_k_tail_and_split_k(tiles, fmt, quant, rng):
    """K=384 with 256-column steps ends in a partial tile (the input's group
    scales past K are masked, and no weight scale past K is read: a block or
    group scale there is out of bounds); split K sums the scaled partials."""
    weight, x = _weight(rng, fmt, k=384, n=128), _input(rng, quant, k=384)
    layout = _layouts(rng)["grouped_contiguous"]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    _check(out, _reference(x, weight, layout, tiles), _bound(x, weight, layout, tiles))


@pytest.mark.parametrize("planar", [False, True])
def test_int4_codes_on_fp8_operands_prefill_tile(planar, rng):
    """The heuristic's prefill tile for int4 weights with fp8 inputs (64 rows,
    decoded weight as the A operand, nibble pairs, scales kept out of the tile
    so the product runs on e4m3), on K-order and planar codes."""
    from humming_jax.tuning import heuristic

    fmt, quant = F.INT4_G128, Q.FP8_DYNAMIC_TOKEN
    (tiles,) = heuristic.heuristic_candidates(64, N, K, fmt, input_dtype=quant.dtype.value)
    assert (tiles.block_m, tiles.swap_ab, tiles.pair_decode, tiles.fold_scales) == (64, True, True, False)
    weight, x = _weight(rng, fmt), _input(rng, quant)
    weight = F.to_planar(weight) if planar else weight
    layout = _layouts(rng)["grouped_contiguous"]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    _check(out, _reference(x, weight, layout, tiles), _bound(x, weight, layout, tiles))


@pytest.mark.parametrize("stored", ["k_order", "planar", "kernel_order"])
def test_mxfp4_on_fp8_operands_prefill_tile(stored, rng):
    """MXFP4 weights with fp8 inputs on the heuristic's 64-row tile: the group
    scales folded relative to each span's largest (``shifts_e2m1``), the
    product on e4m3 operands, on K-order and half-bits planar codes, the
    scales ``[E, N, K/32]`` or ``[E, K/32, N]`` (what the modules store)."""
    from humming_jax.tuning import heuristic

    fmt, quant = F.MXFP4, Q.FP8_DYNAMIC_GROUP128
    weight, x = _weight(rng, fmt), _input(rng, quant)
    planar = stored != "k_order"
    if planar:
        weight = F.to_planar(weight, half_bits=True, k_major_scales=stored == "kernel_order")
    # The Triton tile, after the fp8 Mosaic kernel that planar codes take first (test_gemm_mosaic_fp8).
    tiles = heuristic.heuristic_candidates(64, N, K, fmt, half_bits=planar, input_dtype=quant.dtype.value)[-1]
    layout = _layouts(rng)["grouped_contiguous"]
    call = gemm_call(x, weight, layout, jnp.float32)
    assert kernel.operand_dtype(call, tiles) == jnp.float8_e4m3fn and kernel.shifts_e2m1(
        call.weight, tiles, jnp.float8_e4m3fn
    )
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    _check(out, _reference(x, weight, layout, tiles), _bound(x, weight, layout, tiles))


_GROUP_SCALED = [name for name in sorted(F.PRESETS) if F.PRESETS[name].scale_granularity == F.ScaleGranularity.GROUP]


# --full only: MXFP4's K-major scales run in every pipeline test of make test.
@pytest.mark.parametrize("fmt_name", sweep(_GROUP_SCALED, []))
def test_k_major_group_scales_are_bit_equal(fmt_name, rng):
    """Every per-group format with its scales stored ``[E, K/g, N]`` (what
    ``to_kernel_order`` gives MXFP4 and MXFP8) gives the outputs of ``[E,
    N, K/g]``, bit for bit, on the op's tiling for bf16 inputs and for each
    quantized input the format takes (packed formats planar, as stored)."""
    fmt = F.get_format(fmt_name)
    weight = F.to_planar(_weight(rng, fmt))
    major = F.to_planar(weight, k_major_scales=True)
    assert major.k_major_scales and major.scale.shape == (E, K // fmt.group_size, N)
    layout = _layouts(rng)["grouped_contiguous"]
    quants = [quant for quant in hj.supported_input_specs(fmt) if quant.is_quantized][:2]
    inputs = [jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16), *(_input(rng, quant) for quant in quants)]
    for x in inputs:
        run = dict(out_dtype=jnp.float32, backend=KERNEL_BACKEND)
        want = np.asarray(hj.gemm(x, weight, layout, **run))
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(np.asarray(hj.gemm(x, major, layout, **run)), want)


def test_mxfp4_on_fp8_operands_far_groups(rng):
    """Groups whose scale lies more than 14 powers of two under their span's
    largest round to the nearest e4m3 value (against an independent float64
    model of that rounding, and within 2**-10 of the span's scale of the exact
    product); a NaN scale byte (255) makes its rows NaN, no other."""
    fmt, quant = F.MXFP4, Q.FP8_DYNAMIC_TOKEN
    spread = 2.0 ** -np.array([0, 7, 14, 17, 20, 3, 12, 16])  # per group of 32 columns, K=256
    w = rng.normal(0, 0.05, (E, N, 256)) * np.repeat(spread, 32)
    weight = F.quantize_weight(jnp.asarray(w, jnp.float32), fmt)
    scale = np.asarray(weight.scale)
    gaps = scale.reshape(E, N, 2, 4).max(-1, keepdims=True) - scale.reshape(E, N, 2, 4)
    assert gaps.max() > 14  # (the test's premise)
    x = _input(rng, quant, k=256)
    tiles = kernel.Tiles(32, 64, 128, fold_scales=True, word_decode=True, pair_decode=True)
    layout = _layouts(rng)["grouped_contiguous"]
    out = np.asarray(
        hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND), np.float64
    )
    offsets, xd = np.asarray(layout.expert_offsets), np_ref.dequantize_input(x)
    want, exact = np.zeros((M, N)), np.zeros((M, N))
    shifted, true = np_ref.shifted_mxfp4(weight), np_ref.dequantize_weight(weight)
    for e in range(E):
        rows = slice(offsets[e], offsets[e + 1])
        want[rows], exact[rows] = xd[rows] @ shifted[e].T, xd[rows] @ true[e].T
    assert relative_error(out, want) < 1e-5 if KERNEL_BACKEND == "interpret" else 1e-3
    assert 0 < relative_error(want, exact) < 2.0**-10

    poisoned = scale.copy()
    poisoned[1, 3, 5] = 255  # expert 1, output column 3, group 5 (the second span)
    bad = F.QuantizedWeight(weight.values, jnp.asarray(poisoned), format=fmt, shape=weight.shape)
    out = np.asarray(hj.gemm(x, bad, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND))
    nan_rows = np.isnan(out).any(axis=1)
    expected = np.zeros(M, bool)
    expected[offsets[1] : offsets[2]] = True
    np.testing.assert_array_equal(nan_rows, expected)
    assert np.isnan(out[expected, 3]).all() and not np.isnan(np.delete(out, 3, axis=1)).any()


def test_f16_output_and_accumulation(rng):
    """A float16 output computes in f16 operands (8-bit values are exact in
    f16), with ``use_f16_accum`` in an f16 accumulator."""
    weight, x = _weight(rng, F.FP8_CHANNEL), _input(rng, Q.FP8_E5M2_DYNAMIC_TOKEN)
    layout = _layouts(rng)["grouped_contiguous"]
    ref = _reference(x, weight, layout)
    for f16_accum, bound in ((False, 1e-3), (True, 5e-3)):
        out = hj.gemm(x, weight, layout, out_dtype=jnp.float16, use_f16_accum=f16_accum, backend=KERNEL_BACKEND)
        assert out.dtype == jnp.float16
        _check(out, ref, bound)


@pytest.mark.parametrize("fmt_name,quant_name", PATHS[:1])
def test_batch_invariant_rows(fmt_name, quant_name, rng):
    """With ``batch_invariant`` a row's result is bitwise the same computed in
    a batch of 256 rows on one expert (which would otherwise take a prefill
    tile: another order of sums) or alone — one tiling for every batch."""
    fmt, quant = F.get_format(fmt_name), Q.get_input_spec(quant_name)
    m = 256
    weight, x = _weight(rng, fmt), _input(rng, quant, m=m)
    layout = hj.GroupedContiguous(jnp.asarray([0, 0, m, m, m], jnp.int32))
    free, _ = plan(x, weight, layout)
    fixed, _ = plan(x, weight, layout, batch_invariant=True)
    assert free != fixed  # the batch alone would have chosen another tiling
    batch = np.asarray(hj.gemm(x, weight, layout, batch_invariant=True, backend=KERNEL_BACKEND))
    row = jax.tree.map(lambda a: a[5:6] if a.ndim == 2 and a.shape[0] == m else a, x)
    one = hj.GroupedContiguous(jnp.asarray([0, 0, 1, 1, 1], jnp.int32))
    alone = hj.gemm(row, weight, one, batch_invariant=True, backend=KERNEL_BACKEND)
    np.testing.assert_array_equal(np.asarray(alone)[0], batch[5])


def test_expert_gemm_checks_its_input_scale(rng):
    weight, x = _weight(rng, F.FP8_CHANNEL), _input(rng, Q.FP8_DYNAMIC_TOKEN)
    layout = _layouts(rng)["grouped_contiguous"]
    call = gemm_call(x, weight, layout, jnp.float32, interpret=True)
    parts = (weight.values, weight.scale)
    with pytest.raises(ValueError, match="x_scale: the call's input scale is 'token'"):
        kernel.expert_gemm(call, kernel.Tiles(16, 64, 128), x.values, parts, None, (layout.expert_offsets,))


@pytest.mark.parametrize(
    "fmt_name,quant_name,layout_kind",
    [
        ("fp8_block128", "fp8_dynamic_group128", "grouped_contiguous"),  # e4m3 operands, pieces of 64 columns
        ("int8_channel", "int8_dynamic_token", "indexed"),  # int8 operands
        pytest.param("fp8_channel", "fp8_dynamic_token", "grouped_masked", marks=FULL),
    ],
)
def test_eight_bit_weights_past_2_to_31_values_read_as_byte_pairs(fmt_name, quant_name, layout_kind, monkeypatch, rng):
    """JAX 0.11's Triton lowering indexes an array of at most 2**32 bytes with
    signed 32-bit element offsets, which wrap past 2**31 elements: a 3.8 GB
    e4m3 weight (DeepSeek-V3's w2) read experts 146 and up from before its
    start (relative error 0.75 on the H200). Such weights are read as uint16
    byte pairs, the even and odd columns two pieces; here with the threshold
    lowered to this weight's size (the shapes are this test's own: a kernel
    compiled elsewhere with the same shapes would be reused). 8-bit inputs past
    the threshold are refused with the reason."""
    k = 384
    monkeypatch.setattr(kernel, "WRAPPING_ELEMENTS", E * N * k - 1)
    jax.clear_caches()
    fmt, quant = F.get_format(fmt_name), Q.get_input_spec(quant_name)
    weight, x = _weight(rng, fmt, k=k), _input(rng, quant, k=k)
    layout = _layouts(rng)[layout_kind]
    assert kernel.reads_byte_pairs(gemm_call(x, weight, layout, jnp.float32).weight)
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND)
    _check(out, _reference(x, weight, layout), _bound(x, weight, layout))
    monkeypatch.setattr(kernel, "WRAPPING_ELEMENTS", M * k - 1)
    call = gemm_call(x, weight, layout, jnp.float32)
    assert "the lowering's 32-bit offsets wrap" in kernel.supports(kernel.Tiles(16, 64, 128), call)
    jax.clear_caches()


# The weight-only tiles an op runs after multiplying the input out: Triton's at
# decode, the 16-bit Mosaic kernel's decoded MXFP4 at prefill (its interpreted
# form: no register operand).
TRITON_DEQUANTIZED = kernel.Tiles(16, 64, 128, 4, 3, word_decode=True, fold_scales=True, pair_decode=True)
MOSAIC_DEQUANTIZED = mosaic.Tiles(64, 128, 128, stages=2, group_m=2)


@pytest.mark.parametrize(
    "fmt_name,quant_name,layout_kind,tiles",
    [
        ("mxfp4", "fp8_dynamic_group128", "grouped_contiguous", TRITON_DEQUANTIZED),  # the anchor's W4A8 at decode
        ("mxfp4", "fp8_dynamic_group128", "grouped_contiguous", MOSAIC_DEQUANTIZED),  # and at prefill
        pytest.param("mxfp4", "fp8_dynamic_token", "grouped_masked", MOSAIC_DEQUANTIZED, marks=FULL),
        pytest.param("int4_g128", "fp8_dynamic_token", "indexed", TRITON_DEQUANTIZED, marks=FULL),
        pytest.param("mxfp4", "mxfp4_dynamic", "grouped_contiguous", TRITON_DEQUANTIZED, marks=FULL),  # e2m1 inputs
    ],
)
def test_input_dequantized_before_the_kernel(fmt_name, quant_name, layout_kind, tiles, rng):
    """``Tiles.dequantize_input``: the op multiplies the input's values by its
    scales into bf16 (one rounding an element) and runs the weight-only tile:
    the product of the weight with that bf16 input, against float64 NumPy."""
    mosaic_kernel = isinstance(tiles, mosaic.Tiles)
    # The Mosaic kernel reads MXFP4 as planar 32-column units; Triton's pair decoder as nibble pairs.
    weight = _weight(rng, F.get_format(fmt_name), n=2 * N if mosaic_kernel else N)  # Mosaic: 128-column tiles
    weight = F.to_planar(weight, half_bits=fmt_name == "mxfp4" and not mosaic_kernel)
    x = _input(rng, Q.get_input_spec(quant_name))
    layout = _layouts(rng)[layout_kind]
    tiles = dataclasses.replace(tiles, dequantize_input=True)
    call = gemm_call(x, weight, layout, jnp.float32, interpret=True)
    supports = mosaic.supports if mosaic_kernel else kernel.supports
    assert supports(tiles, call) is None
    if mosaic_kernel:  # without the field the 16-bit kernel refuses the scaled input
        assert "quantized inputs" in supports(dataclasses.replace(tiles, dequantize_input=False), call)
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    rounded = Q.dequantize_input(x).astype(jnp.bfloat16)
    exact = fmt_name == "mxfp4"  # e2m1 times e8m0 folds exactly; int4 codes times bf16 scales round once
    _check(out, np_ref.gemm_of(rounded, weight, layout, bf16_weight=not exact))
    # Against the unrounded input: within the bf16 rounding of each input value.
    _check(out, np_ref.gemm_of(x, weight, layout, bf16_weight=not exact), bound=1e-2)


def test_dequantize_input_needs_a_quantized_input(rng):
    from humming_jax.gemm import as_quantized_input

    weight = _weight(rng, F.get_format("int4_g128"))
    x = as_quantized_input(jnp.ones((M, K), jnp.bfloat16))
    tiles = kernel.Tiles(16, 64, 128, dequantize_input=True)
    call = gemm_call(x, weight, _layouts(rng)["dense"], jnp.float32, interpret=True)
    assert "nothing to dequantize" in kernel.supports(tiles, call)


def test_heuristic_choices_for_quantized_inputs():
    """What the heuristic runs where the H200 A/Bs chose (quantized_input.md
    v13, v16): 4-bit weights with e4m3 inputs at decode multiply the input out
    to bf16 first (not with int8 inputs, not 8-bit weights); indexed W4A8 from
    128 rows an expert on the 16-bit Mosaic kernel, the input multiplied out
    (v19, v21), and indexed W8A8 with long K from 128 on the fp8 one (v20), its
    tile's rows the layout's block."""
    from humming_jax import tuning as T
    from humming_jax.tuning import heuristic
    from pallas_kernels.gemm import mosaic_fp8

    def first(layout, fmt, quant, shape_m, e, n, k, **kw):
        return T.candidates(layout, fmt, shape_m, e, n, k, input_dtype=quant.dtype.value, **kw)

    grouped, indexed = "grouped_contiguous", "indexed"
    for fmt, quant in ((F.MXFP4, Q.FP8_DYNAMIC_GROUP128), (F.INT4_G128, Q.FP8_DYNAMIC_TOKEN)):
        for layout in (grouped, indexed):
            tiles = first(layout, fmt, quant, 16 * 8, 128, 1536, 2048, half_bits=True)[0]
            assert isinstance(tiles, kernel.Tiles) and tiles.block_m == 16 and tiles.dequantize_input
    assert not first(grouped, F.INT4_G128, Q.INT8_DYNAMIC_TOKEN, 16 * 8, 128, 1536, 2048)[0].dequantize_input
    assert not first(grouped, F.FP8_BLOCK128, Q.FP8_DYNAMIC_GROUP128, 16 * 8, 128, 1536, 2048)[0].dequantize_input
    # Indexed W4A8: the 16-bit kernel's tiles sized to the experts' rows (the block: 144 rows,
    # two a 256-row expert), or the fp8 one's 64 x 256 when the caller's block is 64 (a shape
    # with no table entry: the heuristic's).
    listed = first(indexed, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 4096 * 8, 128, 1024, 2048, half_bits=True)
    multiplied_out = dataclasses.replace(heuristic.decode_tiles(256, 128), dequantize_input=True)
    assert listed[0] == multiplied_out and T.indexed_block_rows(listed) == 144
    # qwen3's w13 at T=4096: the table's 144-row tile first (its rows the block).
    qwen3 = first(indexed, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 4096 * 8, 128, 1536, 2048, half_bits=True)
    assert qwen3[0].block_m == 144 and qwen3[0].dequantize_input and T.indexed_block_rows(qwen3) == 144
    wide = first(indexed, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 4096 * 8, 128, 1536, 2048, block_size=64, half_bits=True)
    assert wide[0] == mosaic_fp8.Tiles(64, 256, stages=4, group_m=8)
    # 32 rows an expert, few experts: the heuristic's fp8 register-operand 64 x 256 (v24); mixtral's
    # table entry the 16-bit 48-row pair on the input multiplied out (78th); qwen3's entries keep
    # Triton's 32-row tile with the input multiplied out.
    few_experts = T.heuristic_candidates(
        32, 28672, 4096, F.MXFP4, input_dtype="float8_e4m3", indexed=True, num_experts=8
    )
    assert few_experts[0] == heuristic.MX_FP8_SWAP
    mid = first(indexed, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 128 * 2, 8, 28672, 4096, half_bits=True)
    assert mid[0].block_m == 48 and mid[0].dequantize_input and T.indexed_block_rows(mid) == 48
    for n_out, k_in in ((1536, 2048), (2048, 768)):
        few = first(indexed, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 512 * 8, 128, n_out, k_in, half_bits=True)
        assert isinstance(few[0], kernel.Tiles) and few[0].block_m == 32 and few[0].dequantize_input
    # Mixtral's w2 at 128 rows an expert (T=512): the 160-row decoding tile on the input
    # multiplied out (the table, 73rd); at 80 rows (T=320) the register-operand 128 x 128.
    w2_mid = first(grouped, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 512 * 2, 8, 4096, 14336, half_bits=True)[0]
    assert w2_mid == dataclasses.replace(heuristic.decode_tiles(128, 8), dequantize_input=True)
    w2_below = first(grouped, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 320 * 2, 8, 4096, 14336, half_bits=True)[0]
    assert w2_below == mosaic_fp8.Tiles(128, 128, swap_ab=True)
    # Indexed W8A8: mixtral's long K at 1024 rows an expert, not qwen3's K=2048.
    long_k = first(indexed, F.FP8_BLOCK128, Q.FP8_DYNAMIC_GROUP128, 4096 * 2, 8, 28672, 4096)
    assert long_k[0] == mosaic_fp8.Tiles(64, 256, stages=4, group_m=8) and T.indexed_block_rows(long_k) == 64
    short_k = first(indexed, F.FP8_BLOCK128, Q.FP8_DYNAMIC_GROUP128, 4096 * 8, 128, 1536, 2048)
    assert not any(isinstance(t, mosaic_fp8.Tiles) for t in short_k)
    # At decode, 4-bit weights with fp8 inputs run the weight-only format's table entry with the
    # input multiplied out (mixtral's w2 at T=1: its split-K tile).
    w2 = first(grouped, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 2, 8, 4096, 14336, half_bits=True)[0]
    weight_only = T.candidates(grouped, F.MXFP4, 2, 8, 4096, 14336, half_bits=True)[0]
    assert w2 == dataclasses.replace(weight_only, dequantize_input=True) and w2.split_k > 1
    # W4A16 MXFP4 indexed at prefill: the 16-bit Mosaic kernel on rows gathered in block order
    # (the table's class entry, the heuristic below it), but for qwen3's short-K w2.
    for shape_m, e, n, k in ((4096 * 8, 128, 1536, 2048), (4096 * 2, 8, 28672, 4096)):
        gathered = T.candidates(indexed, F.MXFP4, shape_m, e, n, k, half_bits=True)
        assert isinstance(gathered[0], mosaic.Tiles) and T.indexed_block_rows(gathered) == gathered[0].block_m
    assert isinstance(T.candidates(indexed, F.MXFP4, 4096 * 8, 128, 2048, 768, half_bits=True)[0], kernel.Tiles)
    # W4A16 MXFP4 and int4 (bf16 inputs) on a shape without entries: the 16-bit Mosaic kernel
    # decodes planar codes from 128 rows an expert, on row tiles sized to them.
    for fmt in (F.MXFP4, F.INT4_G128):
        listed = T.candidates(grouped, fmt, 1024 * 2, 8, 32768, 6144, half_bits=True)
        assert listed[0] == heuristic.decode_tiles(256, 8)
    # (at mixtral's T=512 the table's row tile sized to its 128 rows an expert comes first)
    sized = T.candidates(grouped, F.MXFP4, 512 * 2, 8, 28672, 4096, half_bits=True)[0]
    assert sized == dataclasses.replace(heuristic.DECODE_MOSAIC, block_m=160)
    assert T.candidates(grouped, F.MXFP4, 512 * 8, 128, 1536, 2048, half_bits=True)[0] != heuristic.DECODE_MOSAIC
    # qwen3's W4A8 from 32 rows an expert (the table, quantized_input.md v19 and the 69th session): the
    # input multiplied out to bf16 for the weight-only tiles — mosaic_mid's 48-row tile, the 16-bit Mosaic
    # kernel at prefill.
    for k_in, n_out in ((2048, 1536), (768, 2048)):
        mid = first(grouped, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 512 * 8, 128, n_out, k_in, half_bits=True)[0]
        assert isinstance(mid, mosaic_mid.Tiles) and mid.block_m == 48 and mid.dequantize_input
    # At T=4096 (256 rows an expert) the table's 144-row decoding tile (78th) before the heuristic's
    # e4m3 copy.
    prefill = first(grouped, F.MXFP4, Q.FP8_DYNAMIC_GROUP128, 4096 * 8, 128, 1536, 2048, half_bits=True)
    multiplied_out = dataclasses.replace(heuristic.decode_tiles(256, 128), dequantize_input=True)
    assert prefill[:2] == [multiplied_out, heuristic.E4M3_COPY]


@pytest.mark.parametrize(
    "quant_name,n,k",
    [
        ("fp8_dynamic_group128", 192, 256),  # W8A8: the last 128-row weight block half full
        ("none", 192, 320),  # e4m3 weights, bf16 inputs: partial blocks along N and K
    ],
)
def test_weight_blocks_are_128_by_128_with_a_partial_last(quant_name, n, k, rng):
    """A block-scaled weight's scale [i, j] covers rows 128 i.. and columns
    128 j.. (as block-scaled checkpoints store them), the last block of an axis
    partial: the quantizer, the reference and the kernel agree on it (they once
    split N=192 into two blocks of 96)."""
    w = jnp.asarray(rng.normal(0, 0.05, (E, n, k)), jnp.float32)
    weight = F.quantize_weight(w, F.get_format("fp8_block128"))
    assert weight.scale.shape == (E, 2, -(-k // 128))
    scale = np.asarray(weight.scale, np.float64)
    amax = np.abs(np.asarray(w, np.float64))[:, 128:, :128].max(axis=(1, 2))  # the second block row's first block
    np.testing.assert_allclose(scale[:, 1, 0], amax / 448, rtol=1e-6)
    x = jnp.asarray(rng.normal(size=(M, k)), jnp.float32)
    x = x.astype(jnp.bfloat16) if quant_name == "none" else Q.quantize_input(x, Q.get_input_spec(quant_name))
    layout = gemm_layouts.layouts(rng, E, M)["grouped_contiguous"]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND)
    want = np_ref.gemm_of(x, weight, layout)
    assert relative_error(np.asarray(out, np.float64), want) < 1e-2
