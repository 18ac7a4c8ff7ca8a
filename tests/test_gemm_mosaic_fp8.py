"""The Mosaic GPU GEMM on the fp8 tensor cores (e4m3 weights, e4m3/e5m2
inputs; MXFP4 weights decoded to e4m3, W4A8) in the Mosaic GPU interpreter on
the CPU, compiled on a Hopper GPU: every input scale with every weight scale
against a float64 NumPy product, the three layouts it takes with their edge
cases, what it refuses, the plan's choice, and its lowering for the GPU.

What we measure: interpreted, the kernel's f32 sums of exact 8-bit products
against the float64 product of the dequantized operands, ~4e-8 (bound 1e-5);
compiled, the tensor cores sum each 128-deep step in their own reduced
precision (~1e-4 on the H200, bound 1e-3)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax import tuning as T
from humming_jax.gemm import gemm_call, plan, takes_activation
from humming_jax.tuning import heuristic
from pallas_kernels.gemm import mosaic, mx_e4m3
from pallas_kernels.gemm import mosaic_fp8 as kernel

import gemm_layouts
import np_ref
from np_ref import relative_error
from sweep import FULL

KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
BOUND = 1e-5 if KERNEL_BACKEND == "interpret" else 1e-3
E, N, K, M = 4, 256, 256, 40
TILES = kernel.Tiles(64, 256, stages=2, group_m=2)  # the heuristic's tile, fewer stages
SQUARE = kernel.Tiles(128, 128, stages=2, group_m=2)  # 128-row tiles, 64 columns a warpgroup

WEIGHT_OF = {"block": "fp8_block128", "channel": "fp8_channel", "tensor": "fp8_tensor"}
INPUT_OF = {"group": "fp8_dynamic_group128", "token": "fp8_dynamic_token", "tensor": "fp8_static_tensor"}


def _weight(rng, fmt_name: str, e: int = E, bias: bool = False):
    w = jnp.asarray(rng.normal(0, 0.05, (e, N, K)), jnp.float32)
    fmt = F.get_format(fmt_name)
    b = jnp.asarray(rng.normal(size=(e, N)), jnp.float32) if bias else None
    return F.quantize_weight(w, fmt.with_bias() if bias else fmt, bias=b)


def _mxfp4(rng, half_bits: bool, gaps: int = 12, e: int = E, k_major: bool = True):
    """Planar MXFP4 whose 32-column groups' scales differ by up to 2**gaps
    within a row; its scales ``[E, K/32, N]`` as the modules store them
    (``k_major``) or ``[E, N, K/32]``."""
    spread = np.exp2(rng.integers(-gaps, 1, (e, N, K // 32))).repeat(32, axis=-1)
    w = jnp.asarray(rng.normal(0, 0.05, (e, N, K)) * spread, jnp.float32)
    return F.to_planar(F.quantize_weight(w, F.get_format("mxfp4")), half_bits=half_bits, k_major_scales=k_major)


def _input(rng, quant_name: str, m: int = M):
    quant = Q.get_input_spec(quant_name)
    x = jnp.asarray(rng.normal(size=(m, K)), jnp.float32)
    static = jnp.float32(np.abs(np.asarray(x)).max() / quant.dtype.max_value) if quant.mode.is_static else None
    return Q.quantize_input(x, quant, static_scale=static)


def _check(out, x, weight, layout):
    want = np_ref.gemm_of(x, weight, layout)
    got = np.asarray(out, np.float64)
    assert np.all(np.isfinite(got)), "a row left unwritten reads as NaN in the interpreter"
    assert relative_error(got, want) < BOUND
    unowned = np.all(want == 0, axis=1)
    assert np.all(got[unowned] == 0), "rows no expert owns must be zero"


@pytest.mark.parametrize(
    "x_mode,w_mode,tiles",
    [
        ("group", "block", TILES),  # DeepSeek-V3's W8A8: both scales per step
        pytest.param("group", "block", SQUARE, marks=FULL),
        ("token", "channel", TILES),  # every scale on the sum
        pytest.param("token", "channel", SQUARE, marks=FULL),
        ("tensor", "tensor", SQUARE),
        pytest.param("group", "channel", TILES, marks=FULL),  # the input's scale per step, the weight's on the sum
        pytest.param("token", "block", TILES, marks=FULL),  # the weight's per step, the input's on the sum
        pytest.param("group", "tensor", TILES, marks=FULL),
    ],
)
def test_every_scaling_against_numpy(x_mode, w_mode, tiles, rng):
    """Expert ranges with an empty expert and rows past the last range."""
    weight, x = _weight(rng, WEIGHT_OF[w_mode]), _input(rng, INPUT_OF[x_mode])
    layout = gemm_layouts.layouts(rng, E, M)["grouped_contiguous"]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    _check(out, x, weight, layout)


@pytest.mark.parametrize("tiles", [TILES, pytest.param(SQUARE, marks=FULL)], ids=["64x256", "128x128"])
def test_block_scales_of_64_rows(tiles, rng):
    """A w13 interleaved by 64 rows stores a scale a 64-row block (its 128-row
    block's): each warpgroup's 128 columns (64 x 256) promote two column
    slices with their own scales, 64 columns (128 x 128) one. Without the
    activation the output keeps the stored rows' order."""
    weight = hj.interleave_gate_up(_weight(rng, "fp8_block128"), 64)
    x = _input(rng, "fp8_dynamic_group128")
    layout = gemm_layouts.layouts(rng, E, M)["grouped_contiguous"]
    assert weight.scale.shape == (E, N // 64, K // 128)
    assert gemm_call(x, weight, layout, jnp.float32, interpret=True).weight.block_n == 64
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    want = np_ref.gemm_of(x, weight, layout)[:, np_ref.gate_up_rows(N, 64)]
    assert relative_error(np.asarray(out, np.float64), want) < BOUND


@pytest.mark.parametrize(
    "layout_kind,quant_name,bias",
    [
        ("grouped_masked", "fp8_dynamic_group128", False),  # an empty and an over-full expert
        ("dense", "fp8_dynamic_group128", True),
        pytest.param("grouped_contiguous", "fp8_e5m2_dynamic_token", True, marks=FULL),  # e5m2 x e4m3
        pytest.param("grouped_masked", "fp8_e5m2_dynamic_token", False, marks=FULL),
    ],
)
def test_layouts_e5m2_and_bias(layout_kind, quant_name, bias, rng):
    weight = _weight(
        rng, "fp8_block128" if "group" in quant_name else "fp8_channel", 1 if layout_kind == "dense" else E, bias
    )
    x, layout = _input(rng, quant_name), gemm_layouts.layouts(rng, E, M)[layout_kind]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=TILES, backend=KERNEL_BACKEND)
    _check(out, x, weight, layout)


@pytest.mark.parametrize(
    "weight_name,quant_name,tiles",
    [
        ("fp8_block128", "fp8_dynamic_group128", TILES),
        ("mxfp4", "fp8_dynamic_group128", SQUARE),
        pytest.param("fp8_channel", "fp8_dynamic_token", SQUARE, marks=FULL),
        pytest.param("mxfp4", "fp8_dynamic_token", TILES, marks=FULL),
    ],
)
def test_indexed_through_gathered_rows(weight_name, quant_name, tiles, rng):
    """The indexed layout (blocks of block_m rows): each slot's row and scale
    gathered, a tile a block, the results stored in block order and gathered
    to their slots — a dropped slot listed past the padded blocks gets zeros,
    padding is skipped, and no row is left unwritten (the interpreter's NaN)."""
    weight = _mxfp4(rng, True) if weight_name == "mxfp4" else _weight(rng, weight_name)
    x = _input(rng, quant_name)
    layout = gemm_layouts.layouts(rng, E, M, block_size=tiles.block_m)["indexed"]
    call = gemm_call(x, weight, layout, jnp.float32, interpret=True)
    assert kernel.supports(tiles, call) is None
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    assert out.shape == (2 * M, N)
    _check(out, x, weight, layout)


@pytest.mark.parametrize("weight_name", ["mxfp4", pytest.param("fp8_block128", marks=FULL)])
def test_indexed_slots_the_layout_does_not_list_are_zeros(weight_name, rng):
    """A layout that does not list its dropped slots (``lists_dropped=False``):
    the slots no block holds are zeros, the others the slot's product."""
    weight = _mxfp4(rng, True) if weight_name == "mxfp4" else _weight(rng, weight_name)
    x = _input(rng, "fp8_dynamic_group128")
    layout = gemm_layouts.layouts(rng, E, M, block_size=SQUARE.block_m)["indexed"]
    unlisted = dataclasses.replace(layout, lists_dropped=False)
    assert kernel.supports(SQUARE, gemm_call(x, weight, unlisted, jnp.float32, interpret=True)) is None
    out = hj.gemm(x, weight, unlisted, out_dtype=jnp.float32, tuning=SQUARE, backend=KERNEL_BACKEND)
    _check(out, x, weight, unlisted)
    listed = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=SQUARE, backend=KERNEL_BACKEND)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(listed))


def test_block_table_of_dead_blocks():
    """A block past num_tokens_padded, of expert −1 or of an expert past E is
    no tile (group E, 0 rows); the others their expert's rows."""
    table = mosaic.block_table(jnp.asarray([2, -1, 0, 7, 1]), jnp.asarray([256]), 4, 64)
    np.testing.assert_array_equal(
        np.asarray(table),
        [[2, 0, 0, 64], [4, 64, 64, 0], [0, 128, 128, 64], [4, 192, 192, 0], [4, 256, 256, 0]],
    )


@pytest.mark.parametrize("counts", [(0, 0, 1, 0), (0, 130, 0, 0)], ids=["T=1", "one-hot-expert"])
def test_one_row_and_one_hot_expert(counts, rng):
    """One row (a tile of one row, the rest of its box not stored) and every
    row on one expert (three row tiles of it), a bf16 output."""
    m = sum(counts) + 3
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
    weight, x = _weight(rng, "fp8_block128"), _input(rng, "fp8_dynamic_group128", m)
    layout = hj.GroupedContiguous(offsets)
    out = hj.gemm(x, weight, layout, out_dtype=jnp.bfloat16, tuning=TILES, backend=KERNEL_BACKEND)
    want = np_ref.gemm_of(x, weight, layout)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert relative_error(got, want) < 1e-2  # a bf16 output
    assert np.all(got[sum(counts) :] == 0)


@pytest.mark.parametrize(
    "half_bits,quant_name,tiles,k_major",
    [
        (True, "fp8_dynamic_group128", SQUARE, True),  # the anchor's W4A8, as the modules store it
        (False, "fp8_dynamic_group128", TILES, False),
        pytest.param(True, "fp8_dynamic_token", TILES, True, marks=FULL),
        pytest.param(False, "fp8_e5m2_dynamic_token", SQUARE, False, marks=FULL),
    ],
)
def test_mxfp4_decoded_to_e4m3(half_bits, quant_name, tiles, k_major, rng):
    """W4A8: each group's e2m1 codes times 2**(6 - gap) are exact in e4m3 for
    gaps up to 14 (here 12 and the quantizer's own spread), so interpreted
    the result is the float64 product's within f32 sums; scales in either
    stored order."""
    weight, x = _mxfp4(rng, half_bits, k_major=k_major), _input(rng, quant_name)
    layout = gemm_layouts.layouts(rng, E, M)["grouped_contiguous"]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    _check(out, x, weight, layout)


FIRST = kernel.Tiles(64, 256, stages=2, group_m=2, dequantize_first=True)  # an e4m3 copy, then the channel product


@pytest.mark.parametrize("half_bits", [True, pytest.param(False, marks=FULL)], ids=["half_bits", "nibbles"])
def test_mxfp4_decoded_copy_against_numpy(half_bits, rng):
    """``decoded_weight``: each code as e2m1 x 2**(6 - gap) in e4m3, in K
    order — the float64 dequantized weight over its column's 2**(largest -
    133), rounded once to e4m3 (exact to a gap of 14; further down, e4m3's
    subnormals and zero), bit for bit, gaps up to 18 included."""
    weight = _mxfp4(rng, half_bits, gaps=18)
    codes, raw, top, columns = mx_e4m3.mx_operands(weight.values, weight.scale, k_major=True)
    got = mx_e4m3.decoded_weight(codes, raw, top, half_bits, interpret=KERNEL_BACKEND == "interpret")
    assert got.dtype == jnp.float8_e4m3fn and got.shape == (E, N, K)
    dequantized = np.asarray(F.dequantize_weight(weight), np.float64)
    want = (dequantized / np.asarray(columns, np.float64)[..., None]).astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    gaps = np.asarray(top)[:, None, :] - np.asarray(raw, np.int64)
    assert gaps.max() > 14  # some groups round (towards e4m3's subnormals)


@pytest.mark.parametrize(
    "quant_name,layout_kind",
    [
        ("fp8_dynamic_group128", "grouped_contiguous"),
        pytest.param("fp8_dynamic_token", "indexed", marks=FULL),
        pytest.param("fp8_dynamic_group128", "grouped_masked", marks=FULL),
    ],
)
def test_mxfp4_dequantized_first(quant_name, layout_kind, rng):
    """W4A8 through the e4m3 copy (``dequantize_first``): the e4m3 product with
    one scale per column, against float64 NumPy; refused with e4m3 weights
    and with ``swap_ab``."""
    weight, x = _mxfp4(rng, half_bits=True), _input(rng, quant_name)
    layout = gemm_layouts.layouts(rng, E, M, block_size=FIRST.block_m)[layout_kind]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=FIRST, backend=KERNEL_BACKEND)
    _check(out, x, weight, layout)
    e4m3 = gemm_call(x, _weight(rng, "fp8_block128"), layout, jnp.float32, interpret=True)
    assert "nothing to decode" in kernel.supports(FIRST, e4m3)
    swapped = dataclasses.replace(FIRST, swap_ab=True)
    call = gemm_call(x, weight, layout, jnp.bfloat16, interpret=True)
    assert "dequantize_first with swap_ab" in kernel.supports(swapped, call)
    # the copy's e4m3 steps (40 KB each with x's scales) in six stages: past a program's shared memory
    assert "shared-memory buffers" in kernel.supports(dataclasses.replace(FIRST, stages=6), call)


SWAP = kernel.Tiles(128, 128, stages=2, group_m=2, swap_ab=True)  # out.T, the decoded step the A operand
SWAP_WIDE = kernel.Tiles(64, 256, stages=2, group_m=2, swap_ab=True)


@pytest.mark.parametrize(
    "half_bits,quant_name,tiles,layout_kind,bias",
    [
        (True, "fp8_dynamic_group128", SWAP, "grouped_contiguous", False),
        (False, "fp8_dynamic_token", SWAP_WIDE, "grouped_contiguous", True),
        # the indexed layout: test_indexed_through_gathered_rows runs MXFP4 there in make test
        pytest.param(True, "fp8_dynamic_group128", SWAP, "indexed", False, marks=FULL),
        pytest.param(True, "fp8_dynamic_token", SWAP_WIDE, "grouped_masked", True, marks=FULL),
        pytest.param(False, "fp8_e5m2_dynamic_token", SWAP, "dense", False, marks=FULL),
    ],
)
def test_mxfp4_swap_ab(half_bits, quant_name, tiles, layout_kind, bias, rng):
    """W4A8 with the decoded step as the wgmma's A operand (out.T): the codes
    repacked in the fragment order, the per-step and epilogue scales along the
    transposed accumulator's rows and columns, the transposed store (and the
    indexed form's row stores). Interpreted, the product runs from shared
    memory (the register operand is compiled only)."""
    e = 1 if layout_kind == "dense" else E
    weight = _mxfp4(rng, half_bits, e=e)
    if bias:
        b = jnp.asarray(rng.normal(size=(e, N)), jnp.float32)
        weight = dataclasses.replace(weight, bias=b, format=weight.format.with_bias())
    x = _input(rng, quant_name)
    layout = gemm_layouts.layouts(rng, E, M, block_size=tiles.block_m)[layout_kind]
    # out.T is stored through a 16-bit transposed view: bf16 outputs (f32 ones fail layout inference).
    assert "16-bit transposed view" in kernel.supports(tiles, gemm_call(x, weight, layout, jnp.float32, interpret=True))
    call = gemm_call(x, weight, layout, jnp.bfloat16, interpret=True)
    assert kernel.supports(tiles, call) is None
    out = hj.gemm(x, weight, layout, out_dtype=jnp.bfloat16, tuning=tiles, backend=KERNEL_BACKEND)
    want = np_ref.gemm_of(x, weight, layout)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)) and relative_error(got, want) < 1e-2  # one bf16 rounding of the result
    assert np.all(got[np.all(want == 0, axis=1)] == 0)


@pytest.mark.parametrize(
    "weight_name,tiles",
    [
        pytest.param("fp8_block128", TILES, marks=FULL),  # W8A8: both scales per step
        pytest.param("mxfp4", SQUARE, marks=FULL),  # W4A8, the decoded step staged
        pytest.param("mxfp4", SWAP_WIDE, marks=FULL),  # the register operand (compiled; interpreted, staged)
        pytest.param("mxfp4", SWAP, marks=FULL),
    ],
    ids=["w8a8", "w4a8-staged", "w4a8-swap-64x256", "w4a8-swap-128x128"],
)
def test_tiles_after_tiles_in_one_program(weight_name, tiles, two_programs, rng):
    """Two programs take a dozen tiles or more each (row tiles of three
    experts, several column tiles, eight K steps), as the persistent grid does
    at prefill: each tile's result is the float64 product's, the rows no
    expert owns zeros — what a pipeline slot released too early or a tile's
    epilogue racing the next tile's loads would break."""
    m, n, k = 600, 512, 1024
    w = jnp.asarray(rng.normal(0, 0.05, (3, n, k)), jnp.float32)
    weight = F.quantize_weight(w, F.get_format(weight_name))
    if weight_name == "mxfp4":
        weight = F.to_planar(weight, half_bits=True, k_major_scales=True)
    x = Q.quantize_input(jnp.asarray(rng.normal(size=(m, k)), jnp.float32), Q.get_input_spec("fp8_dynamic_group128"))
    layout = hj.GroupedContiguous(jnp.asarray([0, 250, 250, 560], jnp.int32))
    out_dtype = jnp.bfloat16 if tiles.swap_ab else jnp.float32  # out.T: a 16-bit transposed store
    out = hj.gemm(x, weight, layout, out_dtype=out_dtype, tuning=tiles, backend=KERNEL_BACKEND)
    want = np_ref.gemm_of(x, weight, layout)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), "a row left unwritten reads as NaN in the interpreter"
    assert relative_error(got, want) < (1e-2 if tiles.swap_ab else BOUND)
    assert np.all(got[560:] == 0), "rows no expert owns must be zero"


def test_fragment_columns_against_numpy(rng):
    """The register operand's column order: thread q of a row's quad holds
    halves 2q and 2q + 1 of a unit, whose positions land in the columns the
    8-bit WGMMA layout gives thread q (4q .. 4q + 3 and 16 + 4q .. 16 + 4q + 3);
    x permuted by ``fragment_columns`` puts planar column h + 8 j (half h,
    position j) at column ``fragment_column(h, j)`` of each unit, so the
    product with planar codes is the planar product."""
    assert sorted(kernel.fragment_column(h, j) for h in range(8) for j in range(4)) == list(range(32))
    for q in range(4):
        held = {kernel.fragment_column(2 * q + p, j) for p in range(2) for j in range(4)}
        assert held == {4 * q + c for c in range(4)} | {16 + 4 * q + c for c in range(4)}
    x = rng.normal(size=(5, 128)).astype(np.float32)
    permuted = np.asarray(kernel.fragment_columns(jnp.asarray(x)))
    for u in range(4):
        for h in range(8):
            for j in range(4):
                np.testing.assert_array_equal(
                    permuted[:, 32 * u + kernel.fragment_column(h, j)], x[:, 32 * u + h + 8 * j]
                )
    # Codes placed by the fragment map times the permuted x: the planar product.
    w = rng.normal(size=(3, 128)).astype(np.float32)
    placed = np.zeros_like(w)
    for u in range(4):
        for h in range(8):
            for j in range(4):
                placed[:, 32 * u + kernel.fragment_column(h, j)] = w[:, 32 * u + h + 8 * j]
    np.testing.assert_allclose(permuted @ placed.T, x @ w.T, rtol=1e-5)


def test_mx_operands_against_numpy(rng):
    """Per call: the bytes ``[E, K/32, N]`` (transposed from ``[E, N, K/32]``,
    or as stored K-major), each column's largest byte and its scale
    2**(largest - 133) (f32 subnormals included; a byte 255, e8m0 NaN, makes
    its column's scale NaN); in the kernel each piece's factor 2**(12 - gap)
    from its byte (gaps from the column's largest, clamped at MAX_GAP), from
    the f16 bits."""
    e, n, k = 2, 8, 512
    raw = rng.integers(100, 130, (e, n, k // 32)).astype(np.uint8)
    raw[0, 0, :4] = (0, 140, 3, 1)  # gaps past MAX_GAP, a largest byte of 140
    raw[1, 2, 5] = 255
    values = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
    codes, major, top, columns = mx_e4m3.mx_operands(values, jnp.asarray(raw))
    assert codes.dtype == jnp.uint16 and codes.shape == (e, n, k // 4)
    np.testing.assert_array_equal(np.asarray(major), np.swapaxes(raw, 1, 2))
    want_top = raw.astype(np.int64).max(-1)
    np.testing.assert_array_equal(np.asarray(top), want_top)
    want = np.where(want_top == 255, np.nan, np.exp2(want_top - 133.0))
    np.testing.assert_array_equal(np.asarray(columns, np.float64), want)
    assert np.isnan(np.asarray(columns)[1, 2]) and np.sum(np.isnan(np.asarray(columns))) == 1
    factors = mx_e4m3.step_factor(major, top[:, None, :])
    gap = np.minimum(want_top[..., None] - raw, mx_e4m3.MAX_GAP)
    assert factors.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(factors, np.float64), np.swapaxes(np.exp2(12.0 - gap), 1, 2))
    # the bytes stored [E, K/32, N] (k_major): the same operands
    stored = mx_e4m3.mx_operands(values, jnp.asarray(np.swapaxes(raw, 1, 2)), k_major=True)
    for got, expected in zip(stored, (codes, major, top, columns), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_what_the_kernel_refuses(rng):
    """``supports`` names why; a tiling passed by the caller raises with it."""
    x = _input(rng, "fp8_dynamic_group128")
    layouts = gemm_layouts.layouts(rng, E, M)

    def reason(weight, layout, tiles=TILES, x=x, **options):
        call = gemm_call(x, weight, layout, jnp.bfloat16, interpret=True, **options)
        return kernel.supports(tiles, call)

    block = _weight(rng, "fp8_block128")
    assert reason(block, layouts["grouped_contiguous"]) is None
    assert "a tile is a block" in reason(block, layouts["indexed"])  # blocks of 16
    assert "int8 weights" in reason(_weight(rng, "int8_channel"), layouts["grouped_contiguous"])
    assert "bfloat16 inputs" in reason(
        block, layouts["dense"], x=Q.quantize_input(jnp.ones((M, K), jnp.bfloat16), Q.NONE)
    )
    assert "at most 8192 values twice" in reason(block, layouts["dense"], kernel.Tiles(128, 256))
    token = _input(rng, "fp8_dynamic_token")
    assert reason(_weight(rng, "fp8_channel"), layouts["dense"], kernel.Tiles(128, 256), x=token) is None  # one sum
    # the weight's TMA box spans the tile's columns: at most 256 (lowering would fail past it)
    wide = reason(_weight(rng, "fp8_channel"), layouts["dense"], kernel.Tiles(64, 512), x=token)
    assert "block_n=512 (at most 256" in wide
    assert "f16 accumulation" in reason(block, layouts["dense"], use_f16_accum=True)
    k_order = F.quantize_weight(jnp.ones((E, N, K), jnp.float32), F.get_format("mxfp4"))
    assert "K order" in reason(k_order, layouts["dense"])
    assert reason(F.to_planar(k_order), layouts["dense"]) is None
    nvfp4 = F.quantize_weight(jnp.ones((E, N, K), jnp.float32), F.get_format("nvfp4"))
    assert "MXFP4: e8m0 per 32" in reason(F.to_planar(nvfp4), layouts["dense"])
    with pytest.raises(ValueError, match="block_m=32"):
        hj.gemm(x, block, layouts["grouped_contiguous"], tuning=kernel.Tiles(32, 256), backend="interpret")
    with pytest.raises(ValueError, match="block_m"):
        kernel.Tiles(block_m=0)


def test_the_plan_takes_it_from_128_rows_an_expert():
    """The heuristic lists the fp8 kernel first for e4m3 weights with fp8
    inputs from 128 rows an expert, from 128 rows in all for weights of over
    2**31 values (an indexed layout: with K of 4096 or more, or those weights),
    the Triton tile after it; W4A8 from 128 rows an expert on the 16-bit kernel."""
    fmt = F.get_format("fp8_block128")
    prefill = T.heuristic_candidates(128, 1536, 2048, fmt, input_dtype="float8_e4m3")
    assert isinstance(prefill[0], kernel.Tiles) and len(prefill) == 2
    assert not isinstance(T.heuristic_candidates(64, 1536, 2048, fmt, input_dtype="float8_e4m3")[0], kernel.Tiles)
    indexed = T.heuristic_candidates(128, 1536, 2048, fmt, block_size=64, input_dtype="float8_e4m3")
    assert not any(isinstance(t, kernel.Tiles) for t in indexed)
    long_k = T.heuristic_candidates(128, 4096, 4096, fmt, block_size=64, input_dtype="float8_e4m3")
    assert long_k[0] == kernel.Tiles(64, 256)
    # DeepSeek-V3's w2 (2**31 e4m3 values and more: the Triton kernel reads them as byte pairs):
    # from 128 rows in all (T=16 at top-8), grouped or indexed; at 8 (T=1) the Triton tile.
    for block in (None, 64):
        byte_pairs = T.heuristic_candidates(
            1, 7168, 2048, fmt, block, input_dtype="float8_e4m3", num_experts=256, total_rows=128
        )
        assert byte_pairs[0] == kernel.Tiles(64, 256)
        one_token = T.heuristic_candidates(
            1, 7168, 2048, fmt, block, input_dtype="float8_e4m3", num_experts=256, total_rows=8
        )
        assert not isinstance(one_token[0], kernel.Tiles)
    # W4A8 (planar MXFP4): 64-row tiles from 32 rows an expert, the decoded step the register
    # operand (the staged form after it where a call refuses that; indexed: the Triton tile);
    # from 128 the input multiplied out and the 16-bit kernel decoding the codes (indexed too).
    mx = F.get_format("mxfp4")
    mid = T.heuristic_candidates(32, 1536, 2048, mx, input_dtype="float8_e4m3")
    assert mid[:2] == [heuristic.MX_FP8_SWAP, dataclasses.replace(heuristic.MX_FP8_SWAP, swap_ab=False)]
    # many experts (qwen3's entries): the W4A16 mid tile on the input multiplied out, the register form after it
    many = T.heuristic_candidates(32, 1536, 2048, mx, input_dtype="float8_e4m3", num_experts=128)
    assert many[:2] == [dataclasses.replace(heuristic.MID_48, dequantize_input=True), heuristic.MX_FP8_SWAP]
    for block in (None, 64):
        assert T.heuristic_candidates(64, 1536, 2048, mx, block, input_dtype="float8_e4m3")[0] == heuristic.MX_FP8_SWAP
    assert not isinstance(T.heuristic_candidates(32, 1536, 2048, mx, 32, input_dtype="float8_e4m3")[0], kernel.Tiles)
    for block, tiles in ((None, heuristic.decode_tiles(128, 1)), (128, heuristic.DECODE_MOSAIC)):
        square = T.heuristic_candidates(128, 1536, 2048, mx, block, input_dtype="float8_e4m3")[0]
        assert square == dataclasses.replace(tiles, dequantize_input=True)  # an indexed block: its rows
    assert not isinstance(T.heuristic_candidates(16, 1536, 2048, mx, input_dtype="float8_e4m3")[0], kernel.Tiles)
    # From E4M3_COPY_MIN_ROWS grouped (not indexed), the e4m3 copy while it stays under its cap.
    rows = heuristic.E4M3_COPY_MIN_ROWS
    copy = T.heuristic_candidates(rows, 1536, 2048, mx, input_dtype="float8_e4m3", num_experts=128)
    assert copy[0] == heuristic.E4M3_COPY and copy[0].dequantize_first
    assert T.heuristic_candidates(rows - 1, 1536, 2048, mx, input_dtype="float8_e4m3")[0] != heuristic.E4M3_COPY
    assert T.heuristic_candidates(rows, 1536, 2048, mx, 128, input_dtype="float8_e4m3")[0] != heuristic.E4M3_COPY
    huge = T.heuristic_candidates(rows, 4096, 7168, mx, input_dtype="float8_e4m3", num_experts=256)  # 7.5 GB
    assert huge[0] != heuristic.E4M3_COPY
    # Indexed from E4M3_COPY_MIN_ROWS_INDEXED, its block the copy's rows (or the copy's choice).
    rows = heuristic.E4M3_COPY_MIN_ROWS_INDEXED
    for block in (None, heuristic.E4M3_COPY.block_m):
        listed = T.heuristic_candidates(rows, 1536, 2048, mx, block, input_dtype="float8_e4m3", indexed=True)
        assert listed[0] == heuristic.E4M3_COPY
        fewer = T.heuristic_candidates(rows - 1, 1536, 2048, mx, block, input_dtype="float8_e4m3", indexed=True)
        assert heuristic.E4M3_COPY not in fewer
    assert heuristic.E4M3_COPY not in T.heuristic_candidates(rows, 1536, 2048, mx, 128, input_dtype="float8_e4m3")
    # The H200 table leaves the copy's range to the heuristic: qwen3's w2 (K=768) indexed from
    # 512 rows an expert (its Triton entry ends below), grouped past 256 (its 144-row entry's range).
    qwen3_w2 = F.to_planar(F.quantize_weight(jnp.ones((1, 8, 768), jnp.float32), F.get_format("mxfp4"))).format
    for layout, rows in (
        ("indexed", heuristic.E4M3_COPY_MIN_ROWS_INDEXED),
        ("grouped_contiguous", 2 * heuristic.E4M3_COPY_MIN_ROWS),
    ):
        listed = T.candidates(layout, qwen3_w2, rows * 128, 128, 2048, 768, half_bits=True, input_dtype="float8_e4m3")
        assert listed[0] == heuristic.E4M3_COPY, layout
    rng = np.random.default_rng(0)
    weight, x = _weight(rng, "fp8_block128"), _input(rng, "fp8_dynamic_group128", E * 128)
    offsets = jnp.arange(0, E * 128 + 1, 128, dtype=jnp.int32)
    tiles, _ = plan(x, weight, hj.GroupedContiguous(offsets), valid_shape_m=E * 128, interpret=True)
    assert isinstance(tiles, kernel.Tiles)
    # W4A8 at 32 rows an expert with f32 outputs: the register form refuses them (out.T is
    # stored through a 16-bit view), the staged form runs.
    mx_weight, mx_x = _mxfp4(rng, half_bits=True), _input(rng, "fp8_dynamic_group128", E * 32)
    layout = hj.GroupedContiguous(jnp.arange(0, E * 32 + 1, 32, dtype=jnp.int32))
    for out_dtype, swap in ((jnp.bfloat16, True), (jnp.float32, False)):
        tiles, _ = plan(mx_x, mx_weight, layout, out_dtype, valid_shape_m=E * 32, interpret=True)
        assert isinstance(tiles, kernel.Tiles) and tiles.swap_ab == swap


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "scaling",
    [
        kernel.Scaling("group", "block"),
        kernel.Scaling("token", "channel"),
        kernel.Scaling("group", "block", block_rows=64),
    ],
)
def test_lowers_for_the_gpu(scaling):
    """Both forms (a product scaled per step, one accumulator) lower to a
    Mosaic GPU custom call on the CPU (layouts, TMA boxes, the 8-bit wgmma);
    block scales of 64 rows as two column slices a warpgroup."""
    shapes = {"group": (300, 2), "token": (300, 1), "block": (3, 512 // scaling.block_rows, 2), "channel": (3, 512, 1)}
    x = jax.ShapeDtypeStruct((300, 256), jnp.float8_e4m3fn)
    w = jax.ShapeDtypeStruct((3, 512, 256), jnp.float8_e4m3fn)
    x_scale = jax.ShapeDtypeStruct(shapes[scaling.x], jnp.float32)
    w_scale = jax.ShapeDtypeStruct(shapes[scaling.w], jnp.float32)
    offsets = jax.ShapeDtypeStruct((4,), jnp.int32)
    run = functools.partial(
        kernel.expert_gemm_fp8, tiles=kernel.Tiles(64, 256), scaling=scaling, out_dtype=jnp.bfloat16
    )
    lowered = jax.jit(lambda *a: run(*a)).trace(x, x_scale, w, w_scale, offsets)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("tiles", [SWAP, SWAP_WIDE], ids=["128x128", "64x256"])
def test_swap_ab_lowers_for_the_gpu(tiles):
    """The register-operand form lowers (layout inference included, which the
    interpreter never runs) with bf16 outputs, for group and token inputs."""
    for scaling, x_groups in ((kernel.Scaling("group", "mx", True), 2), (kernel.Scaling("token", "mx", False), 1)):
        args = (
            jax.ShapeDtypeStruct((40, 256), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((40, x_groups), jnp.float32),
            jax.ShapeDtypeStruct((4, 256, 128), jnp.uint8),
            jax.ShapeDtypeStruct((4, 256, 8), jnp.uint8),
            jax.ShapeDtypeStruct((5,), jnp.int32),
        )
        run = functools.partial(kernel.expert_gemm_fp8, tiles=tiles, scaling=scaling, out_dtype=jnp.bfloat16)
        lowered = jax.jit(lambda *a, run=run: run(*a)).trace(*args)
        assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "tiles,half_bits",
    [(SQUARE, False), (SQUARE, True), (SWAP, True), (SWAP_WIDE, True)],
    ids=str,
)
def test_mxfp4_lowers_for_the_gpu(tiles, half_bits):
    """The compiled decoder (the e2m1 program on the WGMMA layout's 32-bit
    registers, both bit orders) with the staged 32-column pieces, and the
    register form (the decoded step regrouped into the 8-bit WGMMA layout,
    the register operand's wgmma, the transposed epilogue) lower."""
    x = jax.ShapeDtypeStruct((300, 256), jnp.float8_e4m3fn)
    w = jax.ShapeDtypeStruct((3, 512, 128), jnp.uint8)
    x_scale = jax.ShapeDtypeStruct((300, 2), jnp.float32)
    w_scale = jax.ShapeDtypeStruct((3, 512, 8), jnp.uint8)
    offsets = jax.ShapeDtypeStruct((4,), jnp.int32)
    scaling = kernel.Scaling("group", "mx", half_bits)
    run = functools.partial(kernel.expert_gemm_fp8, tiles=tiles, scaling=scaling, out_dtype=jnp.bfloat16)
    lowered = jax.jit(lambda *a: run(*a)).trace(x, x_scale, w, w_scale, offsets)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("half_bits", [True, False], ids=["half_bits", "nibbles"])
def test_dequantized_first_lowers_for_the_gpu(half_bits):
    """The decoding pass (the compiled decoder, its stores into the swizzled
    output stage) and the e4m3 product after it lower."""
    x = jax.ShapeDtypeStruct((300, 256), jnp.float8_e4m3fn)
    w = jax.ShapeDtypeStruct((3, 512, 128), jnp.uint8)
    x_scale = jax.ShapeDtypeStruct((300, 2), jnp.float32)
    w_scale = jax.ShapeDtypeStruct((3, 8, 512), jnp.uint8)
    offsets = jax.ShapeDtypeStruct((4,), jnp.int32)
    scaling = kernel.Scaling("group", "mx", half_bits, k_major_scales=True)
    run = functools.partial(kernel.expert_gemm_fp8, tiles=FIRST, scaling=scaling, out_dtype=jnp.bfloat16)
    text = jax.jit(lambda *a: run(*a)).trace(x, x_scale, w, w_scale, offsets).lower(lowering_platforms=("cuda",))
    assert text.as_text().count("mosaic_gpu") >= 2


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_block_order_form_lowers_for_the_gpu():
    """The indexed form's kernel (row tiles given as a table, whole-tile stores in block order) lowers."""
    blocks = 5
    x = jax.ShapeDtypeStruct((blocks * 64, 256), jnp.float8_e4m3fn)
    w = jax.ShapeDtypeStruct((3, 512, 256), jnp.float8_e4m3fn)
    x_scale = jax.ShapeDtypeStruct((blocks * 64, 2), jnp.float32)
    w_scale = jax.ShapeDtypeStruct((3, 4, 2), jnp.float32)
    table = jax.ShapeDtypeStruct((blocks, 4), jnp.int32)

    def run(x, x_scale, w, w_scale, table):
        scaling = kernel.Scaling("group", "block")
        return kernel.expert_gemm_fp8(x, x_scale, w, w_scale, None, TILES, scaling, out_dtype=jnp.bfloat16, table=table)

    lowered = jax.jit(run).trace(x, x_scale, w, w_scale, table)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_tiles_text_names_the_kernel():
    from humming_jax import tiles_text

    tiles = dataclasses.replace(TILES, group_m=8)
    assert tiles_text.gemm_to_text(tiles) == "mosaic_fp8:block_m=64,block_n=256,stages=2"
    assert tiles_text.gemm_from_text("mosaic_fp8:block_m=64,block_n=256,stages=2") == tiles


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", [pytest.param("w4a8_mxfp4", marks=FULL), pytest.param("w8a8_fp8_block128", marks=FULL)])
def test_the_offline_ir_tool_reads_the_fp8_kernel(fmt):
    """``benchmarks.mosaic_ir`` lowers the fp8 kernel's tiles too: a K step's
    4 fp8 products (K = 32 each) per warpgroup slab in the module, TMA copies,
    and for W4A8 the e2m1 decode's 16-bit integer operations."""
    from benchmarks import mosaic_ir

    tiles = SWAP_WIDE if fmt == "w4a8_mxfp4" else TILES
    counts = mosaic_ir.key_counts(mosaic_ir.mosaic_ir(fmt, (3, 512, 256), 300, tiles))
    assert counts["wgmma.mma_async"] % 4 == 0 and counts["wgmma.mma_async"] >= 4
    assert counts["nvvm.cp.async.bulk.tensor"] > 0
    assert (counts["vector<2xi16>"] > 0) == (fmt == "w4a8_mxfp4")


@pytest.mark.parametrize(
    "weight_name,quant_name,tiles,kind",
    [
        ("mxfp4", "fp8_dynamic_group128", TILES, "silu"),  # W4A8, the decoded step staged in shared memory
        ("fp8_channel", "fp8_dynamic_token", TILES, "gelu_tanh"),  # every scale on the sum
        # W8A8's w13 (to_kernel_order): a scale a 64-row block, two a warpgroup's 128 columns
        ("fp8_block128", "fp8_dynamic_group128", TILES, "silu"),
        pytest.param("fp8_block128", "fp8_dynamic_token", TILES, "silu", marks=FULL),  # the rows' scale on the sum
        pytest.param(
            "mxfp4", "fp8_dynamic_group128", dataclasses.replace(TILES, dequantize_first=True), "silu", marks=FULL
        ),
        # The register form (W4A8's entries from 32 rows an expert): rows r and r + 64 of out.T
        # (interpreted: the product from shared memory, the same transposed sums).
        ("mxfp4", "fp8_dynamic_group128", SWAP_WIDE, "silu"),
    ],
)
def test_activation_in_the_epilogue(weight_name, quant_name, tiles, kind, rng):
    """``gemm(activation=)`` on the fp8 kernel: a warpgroup's 128 columns, one
    gate/up pair of 64 (w13 interleaved), give 64 outputs; against the float64
    activation of the float64 product, rows no expert owns zero."""
    weight = _mxfp4(rng, True) if weight_name == "mxfp4" else _weight(rng, weight_name)
    weight = hj.interleave_gate_up(weight, 64)
    spec = hj.ActivationSpec(kind, gate_up_block=64)
    x, layout = _input(rng, quant_name), gemm_layouts.layouts(rng, E, M)["grouped_contiguous"]
    out_dtype = jnp.bfloat16 if tiles.swap_ab else jnp.float32  # swap_ab: 16-bit out
    out = hj.gemm(x, weight, layout, out_dtype=out_dtype, tuning=tiles, activation=spec, backend=KERNEL_BACKEND)
    product = np_ref.gemm_of(x, weight, layout)
    want = np_ref.activation(product, kind)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert got.shape == want.shape and relative_error(got, want) < (1e-2 if tiles.swap_ab else BOUND)
    assert np.all(got[np.all(product == 0, axis=1)] == 0)


def test_w8a8_gate_up_pairs_of_128_take_no_activation(rng):
    """A W8A8 w13 interleaved by 128 (its scale blocks whole; to_kernel_order
    interleaves by 64 since v78) has no pair inside a warpgroup's 128
    columns: the fp8 kernel refuses the activation, naming why, so a
    pipeline would run w13 plain and the pass. (A hand-over between the
    warpgroups tied the pass on the H200 and was removed: layer.md, v67.)"""
    from pallas_kernels.gemm.spec import EpilogueActivation

    act = EpilogueActivation("silu", gate_up_block=128)
    assert "gate/up pairs" in mosaic.activation_refusal(TILES, act)
    assert "gate/up pairs" in mosaic.activation_refusal(SWAP_WIDE, act)
    weight = hj.interleave_gate_up(_weight(rng, "fp8_block128"), 128)
    spec = hj.ActivationSpec("silu", gate_up_block=128)
    x = _input(rng, "fp8_dynamic_group128")
    layout = gemm_layouts.layouts(rng, E, M, TILES.block_m)["grouped_contiguous"]
    assert not takes_activation(x, weight, layout, spec, tuning=TILES, backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="gate/up pairs"):
        hj.gemm(x, weight, layout, tuning=TILES, activation=spec, backend=KERNEL_BACKEND)


@pytest.mark.parametrize(
    "layout_kind,weight_name",
    [
        ("grouped_contiguous", "fp8_block128"),
        ("grouped_masked", "fp8_block128"),
        pytest.param("indexed", "fp8_block128", marks=FULL),
        ("grouped_contiguous", "mxfp4"),  # W4A8 on its e4m3 copy (dequantize_first: the layer's mixtral T=4096)
    ],
)
def test_activated_rows_quantized_in_the_epilogue(layout_kind, weight_name, rng):
    """``gemm(activation=, out_quant="fp8_dynamic_group128")`` on W8A8's w13
    (interleaved by 64): a tile's 128 outputs a row are one group of w2's
    input, 64 from each warpgroup's gate/up pair — the two exchange their row
    maxima, each stores its e4m3 half, the tile's row scales gathered to
    ``[M, N/256]`` by the tiles' own rows. Against the reference (the same
    quantizer on the f32 activation: scales to ~1e-6, codes within a
    rounding) and the float64 activation; rows no expert owns: zero values
    and scales (the outputs NaN-poisoned in the interpreter)."""
    weight = _mxfp4(rng, True) if weight_name == "mxfp4" else _weight(rng, weight_name)
    weight = hj.interleave_gate_up(weight, 64)
    tiles = dataclasses.replace(TILES, dequantize_first=weight_name == "mxfp4")
    spec = hj.ActivationSpec("silu", gate_up_block=64)
    x = _input(rng, "fp8_dynamic_group128")
    layout = gemm_layouts.layouts(rng, E, M, TILES.block_m)[layout_kind]
    kw = dict(activation=spec, out_quant="fp8_dynamic_group128")
    quant = Q.FP8_DYNAMIC_GROUP128
    assert takes_activation(x, weight, layout, spec, tuning=tiles, backend=KERNEL_BACKEND, out_quant=quant)
    got = hj.gemm(x, weight, layout, tuning=tiles, backend=KERNEL_BACKEND, **kw)
    ref = hj.gemm(x, weight, layout, backend="reference", **kw)
    rows = layout.output_rows(M)
    assert got.values.dtype == jnp.float8_e4m3fn and got.values.shape == ref.values.shape == (rows, N // 2)
    assert got.scale.shape == ref.scale.shape == (rows, N // 256)
    # Compiled, the fp8 wgmma's accumulator keeps fewer bits than f32 (the file's BOUND).
    scale_rtol = 2e-6 if KERNEL_BACKEND == "interpret" else 2 * BOUND
    np.testing.assert_allclose(np.asarray(got.scale), np.asarray(ref.scale), rtol=scale_rtol, atol=0)
    product = np_ref.gemm_of(x, weight, layout)
    want = np_ref.activation(product, "silu")
    assert relative_error(np_ref.dequantize_input(got), want) < 4e-2  # e4m3 values
    # Compiled, those accumulator bits move a few values across an e4m3 rounding.
    codes_bound = 2e-3 if KERNEL_BACKEND == "interpret" else 1e-2
    assert relative_error(np_ref.dequantize_input(got), np_ref.dequantize_input(ref)) < codes_bound
    unowned = np.all(product == 0, axis=1)
    assert np.all(np.asarray(got.scale)[unowned] == 0)
    assert np.all(np.asarray(got.values.astype(jnp.float32))[unowned] == 0)


def test_quantized_output_refusals(rng):
    """Only fp8 groups of 128, after a gated activation, on a tile whose 128
    outputs a row are one group (64 x 256, not swapped); the 16-bit and
    Triton kernels refuse it, naming why (a tile of theirs holds part of a
    group, or its store has no exchange); ``gemm`` checks the argument."""
    from pallas_kernels.gemm import triton
    from pallas_kernels.gemm.spec import EpilogueActivation

    act = EpilogueActivation("silu", gate_up_block=64)
    assert kernel.quantized_output_refusal(TILES, act, "fp8_dynamic_group128") is None
    assert "only" in kernel.quantized_output_refusal(TILES, act, "fp8_dynamic_token")
    assert "gated" in kernel.quantized_output_refusal(TILES, None, "fp8_dynamic_group128")
    assert "block_n=128" in kernel.quantized_output_refusal(SQUARE, act, "fp8_dynamic_group128")
    assert "swap_ab" in kernel.quantized_output_refusal(SWAP_WIDE, act, "fp8_dynamic_group128")
    scaling = kernel.Scaling("group", "block", block_rows=64)
    plain = kernel.shared_memory_bytes(TILES, scaling, jnp.bfloat16)
    quantized = kernel.shared_memory_bytes(TILES, scaling, jnp.bfloat16, quantized=True)
    # one e4m3 slot of 128 columns for the two bf16 slots of 64, the row maxima and scales, two barriers
    assert quantized - plain == 64 * 128 - 2 * 64 * 64 * 2 + 4 * 3 * 64 + 16
    weight = hj.interleave_gate_up(_weight(rng, "fp8_block128"), 64)
    x = _input(rng, "fp8_dynamic_group128")
    layout = gemm_layouts.layouts(rng, E, M, TILES.block_m)["grouped_contiguous"]
    spec = hj.ActivationSpec("silu", gate_up_block=64)
    call = gemm_call(x, weight, layout, jnp.bfloat16, interpret=True, activation=spec)
    call = dataclasses.replace(call, out_quant="fp8_dynamic_group128")
    assert kernel.supports(TILES, call) is None
    assert "gate/up pairs" in kernel.supports(SQUARE, call)  # the activation's refusal first
    assert "fraction of an output group" in triton.supports(triton.Tiles(16, 64, 256), call)
    with pytest.raises(ValueError, match="out_quant: .*only fp8_dynamic_group128"):
        hj.gemm(x, weight, layout, activation=spec, out_quant="fp8_dynamic_token", backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="out_quant: the output quantized after a gated activation only"):
        hj.gemm(x, weight, layout, out_quant="fp8_dynamic_group128", backend=KERNEL_BACKEND)


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "tiles,mx,out_quant",
    [
        (SWAP_WIDE, True, "none"),
        (TILES, True, "none"),
        (TILES, False, "none"),
        (TILES, False, "fp8_dynamic_group128"),
    ],
    ids=["register-form", "staged", "w8a8-blocks-of-64", "w8a8-quantized"],
)
def test_activation_in_the_epilogue_lowers_for_the_gpu(tiles, mx, out_quant):
    """The epilogue with the activation lowers, layouts inferred: W4A8's
    register form's transposed sums (rows r and r + 64 of a thread: the
    interpreter runs it from shared memory) and staged form's, W8A8's
    w13 with a scale a 64-row block (two column slices a warpgroup), and its
    rows quantized there (the row maxima exchanged through two barriers, each
    warpgroup's e4m3 half of the shared slot, the row scales' copy)."""
    from benchmarks.mosaic_ir import capture_mosaic_modules, capture_tma_copies, misaligned
    from pallas_kernels.gemm.spec import EpilogueActivation

    m, n, k = 300, 512, 256
    if mx:
        weight = (jax.ShapeDtypeStruct((4, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((4, n, k // 32), jnp.uint8))
        scaling = kernel.Scaling("group", "mx", True)
    else:
        weight = (
            jax.ShapeDtypeStruct((4, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((4, n // 64, k // 128), jnp.float32),
        )
        scaling = kernel.Scaling("group", "block", block_rows=64)
    x = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, k // 128), jnp.float32))
    act = EpilogueActivation("silu", gate_up_block=64)
    run = functools.partial(
        kernel.expert_gemm_fp8, tiles=tiles, scaling=scaling, out_dtype=jnp.bfloat16, act=act, out_quant=out_quant
    )
    with capture_mosaic_modules() as texts, capture_tma_copies() as copies:
        traced = jax.jit(lambda *a: run(*a)).trace(*x, *weight, jax.ShapeDtypeStruct((5,), jnp.int32))
        traced.lower(lowering_platforms=("cuda",))
    assert copies and not misaligned(copies)  # the e4m3 slot's rows: 128 bytes, from any row
    outputs = traced.out_info if out_quant != "none" else (traced.out_info,)
    assert outputs[0].shape == (m, n // 2)
    if out_quant != "none":
        assert outputs[0].dtype == jnp.float8_e4m3fn and outputs[1].shape == (m, n // 256)
    assert "ex2" in texts[-1] or "exp" in texts[-1]
