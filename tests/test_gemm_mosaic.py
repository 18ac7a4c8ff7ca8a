"""The Mosaic GPU grouped GEMM (Hopper: TMA, warp-specialized wgmma) in the
Mosaic GPU interpreter on the CPU, against a float64 NumPy product; its
``supports`` answers and the op's choice among candidates; its row-tile table
exhaustively; its lowering for the GPU."""

import collections
import dataclasses
import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import formats as F
from humming_jax.tiles_text import gemm_from_text
from humming_jax.tuning import heuristic
from pallas_kernels.gemm import mosaic, mosaic_mid, triton

from sweep import FULL

KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
ON_GPU_ONLY = pytest.mark.skipif(KERNEL_BACKEND != "pallas", reason="a register wgmma operand runs compiled only")
PARTIAL_ON_GPU = pytest.mark.skipif(KERNEL_BACKEND != "pallas", reason="a partial tile runs compiled only (TMA's fill)")
TILES = mosaic.Tiles(64, 256, 64, stages=2, group_m=2)
G = importlib.import_module("humming_jax.gemm")  # the module: the package exports the function under its name


def _expected(x, w, offsets, m):
    """float64 NumPy: row r through the expert whose range holds it, else 0."""
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((m, ws.shape[1]))
    for e in range(ws.shape[0]):
        out[offsets[e] : offsets[e + 1]] = xs[offsets[e] : offsets[e + 1]] @ ws[e].T
    return out


WIDE = mosaic.Tiles(128, 256, 64, stages=3, group_m=8)  # the H200 table's 16-bit prefill tiles
SPLIT = mosaic.Tiles(128, 256, 64, stages=4, group_m=8)  # no room for a second slot: one slot's row halves


@pytest.mark.parametrize(
    "counts,dtype,out_dtype,tuning",
    [
        pytest.param((7, 0, 23, 3), jnp.bfloat16, jnp.float32, TILES, marks=FULL),  # an empty expert, ragged tiles
        pytest.param((0, 0, 40, 0), jnp.bfloat16, jnp.bfloat16, TILES, marks=FULL),  # all rows on one expert
        ((1, 70, 0, 30), jnp.float16, jnp.float32, TILES),  # tiles straddling the 8-row grid, two tiles on one expert
        pytest.param((1, 70, 0, 30), jnp.bfloat16, jnp.bfloat16, WIDE, marks=FULL),  # 128-row tiles, the table's entry
        # The split slot: tiles of 1, 70 and 130 rows (their rows in one half, in both, and a tile of 2 rows).
        ((1, 70, 0, 130), jnp.bfloat16, jnp.bfloat16, SPLIT),
        # Clusters of two programs on adjacent column tiles of one row tile, x multicast to both
        # (make test: the empty expert and ragged tiles of the first case).
        ((7, 0, 23, 3), jnp.bfloat16, jnp.float32, dataclasses.replace(TILES, block_n=128, cluster_n=2)),
    ],
)
def test_grouped_rows_against_numpy(counts, dtype, out_dtype, tuning, rng):
    """Expert ranges cut into row tiles from the 8-row grid; rows past the
    last range (5 here) are zeros (the interpreter fills fresh memory with NaN,
    so a row left unwritten would show)."""
    m, n, k = sum(counts) + 5, 256, 256  # 4 K steps of 64
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(0, 0.1, (len(counts), n, k)), dtype)
    layout = hj.GroupedContiguous(jnp.asarray(offsets))
    out = hj.gemm(x, w, layout, out_dtype=out_dtype, tuning=tuning, backend=KERNEL_BACKEND)
    want = _expected(x, w, offsets, m)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    bound = 1e-5 if out_dtype == jnp.float32 else 1e-2
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < bound
    assert np.all(got[offsets[-1] :] == 0), "rows no expert owns must be zero"


@pytest.mark.parametrize("weight_kind", ["bf16", "int4", pytest.param("mxfp4", marks=FULL)])
def test_indexed_rows_gathered_in_block_order(weight_kind, rng):
    """The indexed layout: slot s's row ``s // top_k`` gathered in block order,
    one tile a block (dead blocks are no tile: nothing computed or stored),
    each result moved to its slot by one gather; the dropped slot's row
    (listed past the padded blocks), the slots of a block of expert −1 (an
    expert map's) and the slots no block lists are zeros; a block other than
    the tile's rows is refused with the reason."""
    import gemm_layouts
    import np_ref

    m, n, k = 40, 256, 256
    weights = jnp.asarray(rng.normal(0, 0.1, (4, n, k)), jnp.float32)
    if weight_kind == "bf16":
        weight = weights.astype(jnp.bfloat16)
    else:
        fmt = F.INT4_G128 if weight_kind == "int4" else F.MXFP4
        # int4's scales [E, K/128, N] here (the other tests store them [E, N, K/128])
        weight = hj.to_planar(F.quantize_weight(weights, fmt), k_major_scales=weight_kind == "int4")
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    tiles = mosaic.Tiles(64, 256, 64 if weight_kind == "bf16" else 128, stages=2, group_m=2)
    layout = gemm_layouts.layouts(rng, 4, m, block_size=64)["indexed"]
    layout = dataclasses.replace(layout, expert_ids=layout.expert_ids.at[1].set(-1))  # a live block of no expert
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    want = np_ref.gemm_of(x, G.as_weight(weight), layout, bf16_weight=weight_kind == "int4")
    got = np.asarray(out, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert np.all(got[np.all(want == 0, axis=1)] == 0)
    with pytest.raises(ValueError, match="a tile is a block"):
        hj.gemm(
            x, weight, gemm_layouts.layouts(rng, 4, m, block_size=16)["indexed"], tuning=tiles, backend=KERNEL_BACKEND
        )


def test_block_order_to_slots():
    """Block-order rows to slot order: padding (slot m_out) dropped, an unnamed slot zero."""
    rows = jnp.arange(5 * 2, dtype=jnp.float32).reshape(5, 2) + 1
    got = mosaic.to_slots(rows, jnp.asarray([3, 0, 4, 4, 1]), 4)
    np.testing.assert_array_equal(np.asarray(got), [[3, 4], [9, 10], [0, 0], [1, 2]])


@pytest.mark.parametrize(
    "tuning",
    [
        pytest.param(TILES, marks=FULL),
        WIDE,  # the table's 16-bit prefill entry: make test's one case of its tiles
        dataclasses.replace(TILES, block_n=128, cluster_n=2),
    ],
    ids=["64-rows", "128-rows", "column-pairs"],
)
def test_grouped_masked_rows_against_numpy(tuning, rng):
    """The grouped-masked layout: expert e's first ``counts[e]`` of its 40 rows
    through its weight, the rest zeros (NaN-filled memory: a row left unwritten
    shows) — an empty expert, a full one and a count past max_tokens (clipped)."""
    counts, max_tokens, n, k = (5, 0, 40, 47), 40, 256, 128
    e = len(counts)
    x = jnp.asarray(rng.normal(size=(e * max_tokens, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.1, (e, n, k)), jnp.bfloat16)
    layout = hj.GroupedMasked(jnp.asarray(counts, jnp.int32))
    out = np.asarray(hj.gemm(x, w, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND), np.float64)
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want, owned = np.zeros_like(out), np.zeros(len(out), bool)
    for g, count in enumerate(counts):
        rows = slice(g * max_tokens, g * max_tokens + min(count, max_tokens))
        want[rows], owned[rows] = xs[rows] @ ws[g].T, True
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-5
    assert np.all(out[~owned] == 0), "rows past each expert's count must be zero"


def test_dense_and_t_equals_one(rng):
    """One expert (dense), one row: the row is loaded inside a padded tile."""
    k, n = 64, 256
    x = jnp.asarray(rng.normal(size=(1, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(1, n, k)), jnp.bfloat16)
    out = hj.gemm(x, w, hj.Dense(), out_dtype=jnp.float32, tuning=TILES, backend=KERNEL_BACKEND)
    want = _expected(x, w, [0, 1], 1)
    assert np.linalg.norm(np.asarray(out) - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("stored", [pytest.param("k_order", marks=FULL), "half_bits"])
def test_quantized_weights_through_dequantize_first(stored, rng):
    """W4A16 prefill on this kernel: the weight dequantized to bf16 once
    (``dequantize_first``), then the 16-bit product — equal to the folded
    (rounded-once) reference; int4 in K order, MXFP4 in the planar decoder's
    bit order (the Flax modules' layout)."""
    m, n, k, e = 48, 256, 128, 3
    fmt = F.INT4_G128 if stored == "k_order" else F.MXFP4
    weight = F.quantize_weight(jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32), fmt)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    offsets = np.asarray([0, 20, 20, 48], np.int32)
    layout = hj.GroupedContiguous(jnp.asarray(offsets))
    tuning = mosaic.Tiles(64, 256, 64, stages=2, dequantize_first=True)
    stored_weight = weight if stored == "k_order" else hj.to_planar(weight, half_bits=True)
    out = hj.gemm(x, stored_weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=KERNEL_BACKEND)
    rounded = F.dequantize_weight(weight).astype(jnp.bfloat16)
    want = _expected(x, rounded, offsets, m)
    assert np.linalg.norm(np.asarray(out) - want) / np.linalg.norm(want) < 1e-5


INT4_G128_F16 = F.WeightFormat("int4_g128_f16", "int4", "group", "float16", 128)


@pytest.mark.parametrize(
    "fmt,dtype,options",
    [
        # (make test: int4 g128 on the expert pipelines below)
        pytest.param(F.INT4_G128, jnp.bfloat16, {}, marks=FULL),
        pytest.param(F.UINT4_ZP_G128, jnp.bfloat16, {}, marks=FULL),  # zero points per group (and clustered below)
        (F.INT4_CHANNEL, jnp.bfloat16, {}),  # per-channel scales, repeated per 128 columns
        (INT4_G128_F16, jnp.float16, {}),  # f16: the code as 1024 + q
        # The decoded piece as the register operand (compiled only: the interpreter
        # cannot take a register wgmma operand; the lowering test covers it on the CPU).
        pytest.param(F.UINT4_ZP_G128, jnp.bfloat16, {"swap_ab": True}, marks=ON_GPU_ONLY),
        pytest.param(F.INT4_G128, jnp.bfloat16, {"swap_ab": True}, marks=ON_GPU_ONLY),
        # Decode-sized row tiles: x's 16 or 32 rows are the wgmma's N (17- and 23-row experts take 2 and 1 tiles).
        pytest.param(F.INT4_G128, jnp.bfloat16, {"swap_ab": True, "block_m": 16}, marks=ON_GPU_ONLY),
        pytest.param(F.UINT4_ZP_G128, jnp.bfloat16, {"swap_ab": True, "block_m": 32}, marks=ON_GPU_ONLY),
        # Clusters of two column tiles, x's pieces multicast (staged, and the register operand).
        (F.UINT4_ZP_G128, jnp.bfloat16, {"cluster_n": 2, "block_n": 128}),
        pytest.param(
            F.INT4_G128,
            jnp.bfloat16,
            {"swap_ab": True, "word_decode": True, "cluster_n": 2, "block_n": 128},
            marks=ON_GPU_ONLY,
        ),
        # Nibbles from the codes' 32-bit registers (compiled; interpreted, the 16-bit form runs).
        pytest.param(F.INT4_G128, jnp.bfloat16, {"word_decode": True}, marks=FULL),
        pytest.param(INT4_G128_F16, jnp.float16, {"swap_ab": True, "word_decode": True}, marks=ON_GPU_ONLY),
        pytest.param(F.UINT4_ZP_G128, jnp.bfloat16, {"swap_ab": True, "word_decode": True}, marks=ON_GPU_ONLY),
        pytest.param(
            F.INT4_G128, jnp.bfloat16, {"swap_ab": True, "word_decode": True, "block_m": 16}, marks=ON_GPU_ONLY
        ),
        # Row tiles sized to an expert's rows, no power of two (the table's prefill tiles).
        pytest.param(
            F.INT4_G128, jnp.bfloat16, {"swap_ab": True, "word_decode": True, "block_m": 48}, marks=ON_GPU_ONLY
        ),
        pytest.param(
            F.INT4_G128,
            jnp.bfloat16,
            {"swap_ab": True, "word_decode": True, "block_m": 144, "cluster_n": 2, "block_n": 128},
            marks=ON_GPU_ONLY,
        ),
    ],
    ids=[
        "int4",
        "uint4",
        "int4-channel",
        "int4-f16",
        "uint4-swap",
        "int4-swap",
        "int4-swap-16-rows",
        "uint4-swap-32-rows",
        "uint4-cluster-pair",
        "int4-swap-words-cluster-pair",
        "int4-words",
        "int4-f16-swap-words",
        "uint4-swap-words",
        "int4-swap-words-16-rows",
        "int4-swap-words-48-rows",
        "int4-swap-words-144-rows-cluster-pair",
    ],
)
def test_nibble_weights_decoded_in_the_kernel(fmt, dtype, options, rng):
    """Planar 4-bit weights decoded in the compute warpgroups each K step
    (``(magic + q - offset) * scale``, staged in shared memory for the wgmma)
    equal the product with the dequantized weight rounded once to the input
    dtype — against float64 NumPy, with an empty expert, heavy-tailed weights
    and rows no expert owns (NaN-filled memory: they must be stored as zeros)."""
    m, n, k, e = 45, 256, 384, 3
    weights = rng.standard_t(3, size=(e, n, k)) * 0.05
    weight = hj.to_planar(F.quantize_weight(jnp.asarray(weights, jnp.float32), fmt))
    assert weight.nibble_unit == mosaic.UNIT
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    offsets = np.asarray([0, 17, 17, 40], np.int32)
    options = dict(options)
    block_m = options.pop("block_m", 64)
    block_n = options.pop("block_n", 256)
    tuning = mosaic.Tiles(block_m, block_n, 128, stages=2, group_m=2, **options)
    # swap_ab stores out.T through a transposed shared view: 16-bit outputs only.
    out_dtype, tolerance = (dtype, 5e-3) if options.get("swap_ab") else (jnp.float32, 1e-5)
    out = hj.gemm(
        x,
        weight,
        hj.GroupedContiguous(jnp.asarray(offsets)),
        out_dtype=out_dtype,
        tuning=tuning,
        backend=KERNEL_BACKEND,
    )
    rounded = F.dequantize_weight(weight).astype(dtype)
    want = _expected(x, rounded, offsets, m)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tolerance
    assert np.all(got[offsets[-1] :] == 0)


# The 4-bit prefill tile (the H200 table's int4 entries, the heuristic's MXFP4 one): 128
# rows, the decoded pieces as the register operand, clusters of two.
PREFILL_4BIT = heuristic.DECODE_MOSAIC


def _two_program_tiles(**options) -> mosaic.Tiles:
    """64 x 256 tiles, 3 stages, bands of 2 row tiles (so both programs meet every band)."""
    return mosaic.Tiles(64, 256, **{"block_k": 128, "stages": 3, "group_m": 2, **options})


@pytest.mark.parametrize(
    "fmt,tuning,k",
    [
        pytest.param(None, _two_program_tiles(block_k=64), 1024, marks=FULL),  # bf16, staged
        pytest.param(F.INT4_G128, _two_program_tiles(word_decode=True), 1024, marks=FULL),
        pytest.param(
            F.INT4_G128, _two_program_tiles(swap_ab=True, word_decode=True, cluster_n=2), 1024, marks=ON_GPU_ONLY
        ),
        pytest.param(F.MXFP4, _two_program_tiles(swap_ab=True, word_decode=True), 1024, marks=ON_GPU_ONLY),
        # The table's own tile, with twice the K steps: more of each tile's
        # steps run while the slots of the tile before are being refilled.
        pytest.param(F.INT4_G128, PREFILL_4BIT, 2048, marks=ON_GPU_ONLY),
        pytest.param(F.MXFP4, PREFILL_4BIT, 2048, marks=ON_GPU_ONLY),
    ],
    ids=[
        "bf16",
        "int4-words",
        "int4-swap-words-cluster-pair",
        "mxfp4-swap-words",
        "int4-prefill-tile",
        "mxfp4-prefill-tile",
    ],
)
def test_tiles_after_tiles_in_one_program(fmt, tuning, k, two_programs, rng):
    """Two programs take some twenty tiles each (row tiles of three experts,
    two column tiles, eight or sixteen K steps): every tile's result is the
    float64 product's, the rows no expert owns zeros — what a pipeline slot
    released too early or a tile's epilogue racing the next tile's loads would
    break."""
    m, n = 600, 512
    offsets = np.asarray([0, 250, 250, 560], np.int32)
    out = _many_tiles_product(fmt, tuning, offsets, m, n, k, rng)
    _check_many_tiles(*out, offsets)


# The table's expert-sized prefill tile (144 rows: 256 rows an expert in two tiles).
EXPERT_SIZED_4BIT = dataclasses.replace(PREFILL_4BIT, block_m=144)


@ON_GPU_ONLY
@pytest.mark.parametrize("tuning", [PREFILL_4BIT, EXPERT_SIZED_4BIT], ids=["128-rows", "144-rows"])
@pytest.mark.parametrize("fmt", [F.INT4_G128, F.MXFP4], ids=["int4", "mxfp4"])
def test_prefill_tile_on_the_whole_grid(fmt, tuning, rng):
    """The prefill tile at a prefill shape on the full persistent grid (16
    uneven experts, 8,192 rows, K of 2,048: each program loops over tiles
    while every SM loads): the timing under which a slot released a step late
    was overwritten at T=4096 in the benchmark (gemm.md, v39) though the
    two-program test passed."""
    sizes = np.asarray([0, 1000, 17, 640, 0, 900, 64, 300, 1200, 5, 700, 512, 333, 800, 1, 720], np.int32)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    m, n, k = 8192, 1024, 2048
    out = _many_tiles_product(fmt, tuning, offsets, m, n, k, rng)
    _check_many_tiles(*out, offsets)


@ON_GPU_ONLY
@pytest.mark.parametrize("tuning", [EXPERT_SIZED_4BIT, heuristic.MID_48], ids=["144-rows", "mid-48"])
def test_expert_sized_tile_on_the_masked_layout_with_nan_padding(tuning, rng):
    """The batched layer's prefill w13 (the contiguous layout's 144-row entry,
    and the heuristic's ``mosaic_mid`` tile, on the masked layout, its input
    as the caller gave it: NaN past each count): the counts' rows against
    float64, every row past a count zero (its tile loads NaN rows and must
    store none of them)."""
    counts, max_tokens, n, k = np.asarray([0, 272, 17, 300, 144, 1], np.int32), 272, 1024, 2048
    e = len(counts)
    weight = hj.to_planar(F.quantize_weight(jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32), F.INT4_G128))
    x = rng.normal(size=(e, max_tokens, k)).astype(np.float32)
    past = np.arange(max_tokens)[None, :] >= counts[:, None]
    x[past] = np.nan
    x = jnp.asarray(x.reshape(e * max_tokens, k), jnp.bfloat16)
    layout = hj.GroupedMasked(jnp.asarray(counts))
    out = hj.gemm(x, weight, layout, tuning=tuning, backend=KERNEL_BACKEND)
    got = np.asarray(out.astype(jnp.float32), np.float64).reshape(e, max_tokens, n)
    rounded = np.asarray(F.dequantize_weight(weight).astype(jnp.bfloat16), np.float64)
    xs = np.asarray(x, np.float64).reshape(e, max_tokens, k)
    assert np.all(got[past] == 0)
    for g, count in enumerate(np.minimum(counts, max_tokens)):
        want = xs[g, :count] @ rounded[g].T
        if count:
            assert np.linalg.norm(got[g, :count] - want) / np.linalg.norm(want) < 5e-3, g


def _many_tiles_product(fmt, tuning: mosaic.Tiles, offsets, m: int, n: int, k: int, rng):
    """The kernel's product of random inputs over ``offsets``' experts
    (``fmt`` None: bf16 weights) with ``tuning``, and the float64 NumPy
    product of the same rounded operands."""
    weights = jnp.asarray(rng.normal(0, 0.05, (len(offsets) - 1, n, k)), jnp.float32)
    mx = fmt is F.MXFP4
    quantized = fmt is not None
    weight = (
        hj.to_planar(F.quantize_weight(weights, fmt), half_bits=mx, k_major_scales=mx)
        if quantized
        else weights.astype(jnp.bfloat16)
    )
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    out_dtype, tolerance = (jnp.bfloat16, 5e-3) if tuning.swap_ab else (jnp.float32, 1e-5)
    layout = hj.GroupedContiguous(jnp.asarray(offsets))
    out = hj.gemm(x, weight, layout, out_dtype=out_dtype, tuning=tuning, backend=KERNEL_BACKEND)
    rounded = F.dequantize_weight(weight).astype(jnp.bfloat16) if quantized else weight
    return np.asarray(out.astype(jnp.float32), np.float64), _expected(x, rounded, offsets, m), tolerance


def _check_many_tiles(got, want, tolerance: float, offsets) -> None:
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tolerance
    # Every expert's rows, not only the whole: a few corrupted tiles would hide in the norm.
    for e in range(len(offsets) - 1):
        rows = slice(offsets[e], offsets[e + 1])
        if offsets[e + 1] > offsets[e]:
            scale = max(np.linalg.norm(want[rows]), 1e-30)
            assert np.linalg.norm(got[rows] - want[rows]) / scale < 2 * tolerance, f"expert {e}"
    assert np.all(got[offsets[-1] :] == 0)


def test_nibble_weights_refused_with_the_reason(rng):
    """What the in-kernel decode cannot take names itself: K-order codes,
    groups other than 128 columns, MXFP4 (dequantize_first runs those)."""
    x = jnp.asarray(rng.normal(size=(16, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.05, (2, 256, 256)), jnp.float32)
    grouped = hj.GroupedContiguous(jnp.asarray([0, 8, 16], jnp.int32))
    run = dict(tuning=mosaic.Tiles(64, 256, 128, stages=2), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="tuning.*K order.*to_planar"):
        hj.gemm(x, F.quantize_weight(w, F.INT4_G128), grouped, **run)
    with pytest.raises(ValueError, match="tuning.*128-column groups"):
        hj.gemm(x, hj.to_planar(F.quantize_weight(w, F.INT4_G64)), grouped, **run)
    with pytest.raises(ValueError, match="tuning.*MXFP4 codes in K order"):
        hj.gemm(x, F.quantize_weight(w, F.MXFP4), grouped, **run)
    with pytest.raises(ValueError, match="tuning.*MXFP4 weights with float16 inputs"):
        hj.gemm(x.astype(jnp.float16), hj.to_planar(F.quantize_weight(w, F.MXFP4)), grouped, **run)
    with pytest.raises(ValueError, match="tuning.*float8_e4m3 weights.*dequantize_first"):
        hj.gemm(x, F.quantize_weight(w, F.get_format("fp8_channel")), grouped, **run)
    planar = hj.to_planar(F.quantize_weight(w, F.INT4_G128))
    with pytest.raises(ValueError, match="block_k=64 with 4-bit weights"):
        hj.gemm(x, planar, grouped, tuning=mosaic.Tiles(64, 256, 64), backend=KERNEL_BACKEND)
    if KERNEL_BACKEND == "interpret":
        with pytest.raises(ValueError, match="swap_ab runs compiled only"):
            swap = mosaic.Tiles(64, 256, 128, swap_ab=True)
            hj.gemm(x, planar, grouped, tuning=swap, backend=KERNEL_BACKEND)


@pytest.mark.parametrize(
    "half_bits,options,k_major",
    [
        (True, {}, True),
        pytest.param(False, {}, False, marks=FULL),
        pytest.param(True, {"swap_ab": True}, True, marks=ON_GPU_ONLY),
    ],
    ids=["half-bits", "nibbles", "half-bits-swap"],
)
def test_mxfp4_decoded_in_the_kernel(half_bits, options, k_major, rng):
    """Planar MXFP4 (bf16 inputs) decoded in the compute warpgroups, each
    32-column unit times its folded factor 2**(s - 183) (exact: a power of
    two), the sum times 2**62: the product with the dequantized weight,
    against float64 NumPy; groups whose scales differ by up to 2**12, an
    empty expert, rows no expert owns; scales ``[E, K/32, N]`` (as the
    modules store them) or ``[E, N, K/32]``."""
    m, n, k, e = 45, 256, 256, 3
    spread = np.exp2(rng.integers(-12, 1, (e, n, k // 32))).repeat(32, axis=-1)
    weights = rng.normal(0, 0.05, (e, n, k)) * spread
    quantized = F.quantize_weight(jnp.asarray(weights, jnp.float32), F.MXFP4)
    weight = hj.to_planar(quantized, half_bits=half_bits, k_major_scales=k_major)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    offsets = np.asarray([0, 17, 17, 40], np.int32)
    tuning = mosaic.Tiles(64, 256, 128, stages=2, group_m=2, **options)
    out_dtype, tolerance = (jnp.bfloat16, 5e-3) if options.get("swap_ab") else (jnp.float32, 1e-5)
    layout = hj.GroupedContiguous(jnp.asarray(offsets))
    out = hj.gemm(x, weight, layout, out_dtype=out_dtype, tuning=tuning, backend=KERNEL_BACKEND)
    want = _expected(x, F.dequantize_weight(weight), offsets, m)  # e2m1 x 2**s: exact in bf16
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tolerance
    assert np.all(got[offsets[-1] :] == 0)


def test_e2m1_factor_from_every_byte():
    """The kernel's factor from each e8m0 byte s: 2**(s - 183) exactly (a
    normal bf16) from the smallest byte that gives one, zero below it, NaN
    for 255 — eagerly and jitted, against float64 NumPy."""
    raw = np.arange(256)
    want = np.where(raw < mosaic.E2M1_FACTOR_MIN_BYTE, 0.0, np.exp2(raw - 183.0))
    want[255] = np.nan
    assert np.exp2(mosaic.E2M1_FACTOR_MIN_BYTE - 183.0) == 2.0**-126  # bf16's smallest normal
    for factor in (mosaic.e2m1_factor, jax.jit(mosaic.e2m1_factor)):
        got = factor(jnp.asarray(raw, jnp.uint8))
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32), np.float64), want)


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("swap_ab", [False, True])
def test_mxfp4_decode_lowers_for_the_gpu(swap_ab):
    """The e2m1 decoder on the WGMMA layout's registers, per 32-column unit, staged or as the register operand."""
    e, n, k = 3, 512, 512
    codes = jax.ShapeDtypeStruct((e, n, k // 4), jnp.uint16)
    factors = jax.ShapeDtypeStruct((e, k // 32, n), jnp.uint8)  # the e8m0 bytes
    x = jax.ShapeDtypeStruct((300, k), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    tiles = mosaic.Tiles(128, 256, 128, stages=3, swap_ab=swap_ab)
    decode = mosaic.NibbleDecode(k // 32, e2m1=True, half_bits=True)

    def run(x, codes, offsets, factors):
        return mosaic.expert_gemm_mosaic(
            x, codes, offsets, tiles, out_dtype=jnp.bfloat16, decode=decode, scales=factors
        )

    text = jax.jit(run).trace(x, codes, offsets, factors).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_what_the_kernel_refuses(rng):
    x = jnp.asarray(rng.normal(size=(16, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(2, 256, 64)), jnp.bfloat16)
    grouped = hj.GroupedContiguous(jnp.asarray([0, 8, 16], jnp.int32))
    run = dict(tuning=TILES, backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="tuning.*int4 weights with group scales"):
        hj.gemm(x, F.quantize_weight(w.astype(jnp.float32), F.INT4_G32), grouped, **run)
    with pytest.raises(ValueError, match="tuning.*indexed"):
        ids = jnp.arange(16, dtype=jnp.int32)
        indexed = hj.Indexed(ids, jnp.zeros((1,), jnp.int32), jnp.asarray([16], jnp.int32), top_k=1, block_size=16)
        hj.gemm(x, w, indexed, **run)
    with pytest.raises(ValueError, match="block_n"):
        hj.gemm(x, w[:, :192], grouped, **run)
    # The weight's TMA box spans the tile's columns: at most 256 (lowering would fail past it).
    with pytest.raises(ValueError, match="block_n=512 .at most 256"):
        hj.gemm(x, w, grouped, tuning=mosaic.Tiles(128, 512, 64), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="accumulator"):  # a 256-row swap tile's 256 x 128 f32 outgrow the registers
        mosaic.check_tiles(
            mosaic.Tiles(256, 256, 128, swap_ab=True, word_decode=True), 512, 256, jnp.bfloat16, mosaic.NibbleDecode(2)
        )
    with pytest.raises(ValueError, match="dequantize_first with a 16-bit weight"):
        hj.gemm(x, w, grouped, tuning=dataclasses.replace(TILES, dequantize_first=True), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="cluster_n: 1 or 2"):
        mosaic.Tiles(64, 256, 64, cluster_n=4)
    with pytest.raises(ValueError, match="cluster_n=2 with N=768"):
        mosaic.check_tiles(mosaic.Tiles(64, 256, 64, cluster_n=2), 768, 128, jnp.bfloat16)
    # a cluster pair splits x's box in 8-row pieces: 152 rows (19 pieces) cannot be halved
    with pytest.raises(ValueError, match="block_m=152 with cluster_n=2"):
        mosaic.check_tiles(mosaic.Tiles(152, 256, 64, cluster_n=2, swap_ab=True), 1024, 128, jnp.bfloat16)
    with pytest.raises(ValueError, match="word_decode with 16-bit weights"):
        hj.gemm(x, w, grouped, tuning=dataclasses.replace(TILES, word_decode=True), backend=KERNEL_BACKEND)
    with pytest.raises(TypeError, match="triton.Tiles, mosaic.Tiles, mosaic_mid.Tiles, mosaic_fp8.Tiles"):
        hj.gemm(x, w, grouped, tuning=(64, 256, 64), backend=KERNEL_BACKEND)
    # five 48 KB steps and the epilogue's 32 KB: past the 227 KB a program has
    with pytest.raises(ValueError, match="tuning.*shared-memory buffers"):
        hj.gemm(x, w, grouped, tuning=mosaic.Tiles(128, 256, 64, stages=5), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="mosaic GEMM: .*shared-memory buffers"):
        mosaic.expert_gemm_mosaic(
            x, w, grouped.expert_offsets, mosaic.Tiles(128, 256, 64, stages=5), out_dtype=jnp.bfloat16, interpret=True
        )


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.parametrize(
    "fmt, config",
    [
        ("bf16", "mosaic:"),  # four stages: 229,376 bytes, the most a shipped tile takes
        ("int4_g128", "mosaic:block_m=144,block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2"),
        ("int4_g128", "mosaic:block_k=128,stages=3,word_decode=1"),  # staged pieces
        ("uint4_zp_g128", "mosaic:block_k=128,stages=2"),
        ("mxfp4", "mosaic:block_m=160,block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2"),
        ("w8a8_fp8_block128", "mosaic_fp8:block_m=64,block_n=256"),
        ("w4a8_mxfp4", "mosaic_fp8:block_m=64,block_n=256,swap_ab=1"),
        ("w4a8_mxfp4", "mosaic_fp8:block_m=128,block_n=128"),  # staged decode
    ],
)
def test_shared_memory_counted_as_the_kernel_allocates(fmt, config):
    """The bytes ``supports()`` weighs against a program's shared memory are
    the buffers the lowered kernel launches with, short only of its barriers
    and alignment (under ``SHARED_MEMORY_SLACK``)."""
    from benchmarks import mosaic_ir
    from benchmarks.inspect_gemm import parse_config
    from pallas_kernels.gemm import mosaic_fp8

    tiles = parse_config(config)
    launched = mosaic_ir.shared_memory_size(mosaic_ir.mosaic_ir(fmt, (2, 512, 1024), 512, tiles))
    if fmt in mosaic_ir.FP8_FORMATS:
        scaling = mosaic_fp8.Scaling("group", "mx" if fmt == "w4a8_mxfp4" else "block", half_bits=True)
        counted = mosaic_fp8.shared_memory_bytes(tiles, scaling, jnp.bfloat16)
    else:
        e2m1, zero_points = fmt == "mxfp4", fmt.startswith("uint4")
        unit = mosaic.E2M1_UNIT if e2m1 else mosaic.UNIT
        decode = None if fmt == "bf16" else mosaic.NibbleDecode(1024 // unit, zero_points=zero_points, e2m1=e2m1)
        counted = mosaic.shared_memory_bytes(tiles, jnp.bfloat16, jnp.bfloat16, decode)
    assert counted <= launched <= counted + mosaic.SHARED_MEMORY_SLACK


def test_output_slot_split_in_row_halves_where_a_second_does_not_fit():
    """Where a second slot does not fit (the 144- and 160-row pairs, bf16's
    4-stage tile) a warpgroup's one slot takes each chunk's two row halves in
    turn, in the same shared memory; not where a second fits (the 96-row
    pair), for 32-bit outputs, or where the halves would cut the wgmma
    layout's row pieces (64 rows without swap_ab: halves of 32)."""
    int4 = mosaic.NibbleDecode(2048 // mosaic.UNIT)
    pair = dict(block_k=128, stages=3, swap_ab=True, word_decode=True, cluster_n=2)
    bf16 = jnp.bfloat16
    for rows in (144, 160):
        tiles = mosaic.Tiles(block_m=rows, **pair)
        assert mosaic.split_slot(tiles, bf16, bf16, int4)
        assert not mosaic.split_slot(tiles, bf16, jnp.float32, int4)
        one = mosaic.shared_memory_bytes(tiles, bf16, bf16, int4)
        assert one + mosaic.SHARED_MEMORY_SLACK <= mosaic.SHARED_MEMORY_BYTES
    assert not mosaic.split_slot(mosaic.Tiles(block_m=96, **pair), bf16, bf16, int4)
    assert mosaic.split_slot(SPLIT, bf16, bf16)
    assert not mosaic.split_slot(mosaic.Tiles(64, 256, 64, stages=5), bf16, bf16)


def _check_table(table, want, m: int, block_m: int, ranges: int):
    """Every row of ``[0, m)`` stored by exactly one tile of group ``want[row]``,
    every load box inside the padded x on the 8-row grid holding the stored
    rows, the tiles within the static bound."""
    assert table.shape[0] == mosaic.max_row_tiles(ranges, m, block_m)
    owner = np.full(m, -1)
    for group, load, first, rows in table:
        if rows == 0:
            continue
        assert load % mosaic.ROW_ALIGN == 0 and 0 <= load <= mosaic.padded_rows(m, block_m) - block_m
        assert load <= first and first + rows <= load + block_m
        assert np.all(owner[first : first + rows] == -1)
        owner[first : first + rows] = group
    np.testing.assert_array_equal(owner, want)


@pytest.mark.parametrize("block_m", [pytest.param(64, marks=FULL), 128])
def test_row_tile_table_covers_every_row_once(block_m, rng):
    """Grouped-contiguous ranges (rows outside them: group E) and grouped-masked
    ones (each expert's rows past its count: group E), over random routings,
    empty and full — the Triton kernel's table, equal to the XLA reference's."""
    reference = jax.jit(mosaic.row_tile_table, static_argnums=(2, 3, 4))  # one program a shape, not one an op
    interpret = KERNEL_BACKEND == "interpret"  # compiled on a GPU
    kernel = jax.jit(functools.partial(mosaic.tile_table, interpret=interpret), static_argnums=(2, 3, 4))

    def table_of(offsets, counts, m, e, block_m):  # the kernel's table, bit-equal to the reference's
        table = np.asarray(kernel(offsets, counts, m, e, block_m))
        ranges = mosaic.row_ranges(offsets, counts, m, e)
        np.testing.assert_array_equal(table, np.asarray(reference(*ranges, e, m, block_m)))
        return table

    # Random ranges over a few fixed shapes: each shape is traced and compiled once, the trials reuse it.
    for trial, (e, m) in enumerate([(1, 1), (2, 64), (3, 130), (4, 399)] * 2 + [(3, 7)]):
        cuts = np.sort(rng.integers(0, m + 1, size=e + 1))
        if trial % 3 == 0:
            cuts[0] = 0
        want = np.full(m, e)
        for g in range(e):
            want[cuts[g] : cuts[g + 1]] = g
        _check_table(table_of(jnp.asarray(cuts, jnp.int32), None, m, e, block_m), want, m, block_m, e + 2)
    for e, max_tokens in [(1, 1), (2, 13), (4, 200), (2, 13)]:
        counts = rng.integers(-2, max_tokens + 3, size=e)  # out-of-range counts are clipped
        want = np.full(e * max_tokens, e)
        for g in range(e):
            want[g * max_tokens : g * max_tokens + int(np.clip(counts[g], 0, max_tokens))] = g
        table = table_of(None, jnp.asarray(counts, jnp.int32), e * max_tokens, e, block_m)
        _check_table(table, want, e * max_tokens, block_m, 2 * e)


@pytest.mark.parametrize("e,rows,block_m", [(128, 16384, 144), (256, 2048, 80), (600, 1200, 64)])
def test_tile_table_kernel_at_model_sizes(e, rows, block_m, rng):
    """The kernel's table at a model's expert counts (qwen3 T=2048, deepseek-v3
    T=256, and 1,200 ranges: a program then takes fewer tiles than 32, its
    comparison block kept small), equal to the reference's and covering each
    row once; more ranges than the kernel compares are refused by name."""
    from pallas_kernels.gemm import row_tiles

    if e == 600:  # grouped-masked: each expert's 2 rows, a random count of them its own
        counts = rng.integers(0, 3, size=e)
        offsets, counts = None, jnp.asarray(counts, jnp.int32)
        want = np.repeat(np.arange(e), 2)
        want[1::2] = np.where(np.asarray(counts) == 2, np.arange(e), e)
        want[::2] = np.where(np.asarray(counts) >= 1, np.arange(e), e)
        ranges = 2 * e
    else:
        cuts = np.sort(rng.integers(0, rows + 1, size=e + 1))
        cuts[e // 2 + 1] = cuts[e // 2]  # an empty expert
        offsets, counts = jnp.asarray(cuts, jnp.int32), None
        want = np.full(rows, e)
        for g in range(e):
            want[cuts[g] : cuts[g + 1]] = g
        ranges = e + 2
    table = np.asarray(mosaic.tile_table(offsets, counts, rows, e, block_m, interpret=KERNEL_BACKEND == "interpret"))
    starts, ends = mosaic.row_ranges(offsets, counts, rows, e)
    np.testing.assert_array_equal(table, np.asarray(mosaic.row_tile_table(starts, ends, e, rows, block_m)))
    _check_table(table, want, rows, block_m, ranges)
    assert row_tiles.supports(row_tiles.MAX_RANGES + 1) and not row_tiles.supports(ranges)
    with pytest.raises(ValueError, match=r"row_tile_table: 4098 row ranges \(1 to 4096"):
        mosaic.tile_table(jnp.zeros((row_tiles.MAX_RANGES + 1,), jnp.int32), None, 64, row_tiles.MAX_RANGES, 64)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_lowers_for_the_gpu():
    """The kernel lowers to a Mosaic GPU custom call on the CPU (what the
    interpreter cannot check: layouts, TMA boxes on tiled shared memory)."""
    x = jax.ShapeDtypeStruct((300, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((3, 512, 256), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((4,), jnp.int32)
    bias = jax.ShapeDtypeStruct((3, 512), jnp.float32)
    # Half the columns a warpgroup; with a bias and x multicast to column-tile pairs.
    for tiles in (mosaic.Tiles(128, 256, 64, stages=4), mosaic.Tiles(128, 256, 64, stages=3, cluster_n=2)):
        run = functools.partial(mosaic.expert_gemm_mosaic, tiles=tiles, out_dtype=jnp.bfloat16)
        with_bias = tiles.cluster_n > 1
        args = (x, w, offsets) + ((bias,) if with_bias else ())
        lowered = jax.jit(lambda x, w, o, *b, run=run: run(x, w, o, bias=b[0] if b else None)).trace(*args)
        assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "zero_points,swap_ab",
    [(False, False), (True, False), (True, True)],
)
def test_nibble_decode_lowers_for_the_gpu(zero_points, swap_ab):
    """The 4-bit path (swizzled staging of the decoded pieces, 4 x pieces and
    the codes per pipeline step) lowers for the GPU on the CPU; the swap_ab form
    with a bias (broadcast along out.T's rows)."""
    e, n, k = 3, 512, 512
    codes = jax.ShapeDtypeStruct((e, n, k // 4), jnp.uint16)
    scales = jax.ShapeDtypeStruct((e, k // 128, n), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((300, k), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    tiles = mosaic.Tiles(128, 256, 128, stages=3)
    if swap_ab:  # the decoded pieces as the register operand, out.T stored transposed
        tiles = mosaic.Tiles(128, 256, 128, stages=3, swap_ab=True)
    decode = mosaic.NibbleDecode(k // 128, zero_points=zero_points)

    def run(x, codes, offsets, scales):
        zeros = scales if zero_points else None
        bias = jnp.ones((e, n), jnp.float32) if swap_ab else None
        return mosaic.expert_gemm_mosaic(
            x, codes, offsets, tiles, out_dtype=jnp.bfloat16, decode=decode, scales=scales, zero_points=zeros, bias=bias
        )

    text = jax.jit(run).trace(x, codes, offsets, scales).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_decode_sized_row_tiles_need_swap_ab():
    """Row tiles of any multiple of 8 up to 256 are the swap_ab form's (x's
    rows the wgmma's N, sized to an expert's rows) while the accumulator fits;
    the other forms put x's rows on the wgmma's M: 64 or 128."""
    decode = mosaic.NibbleDecode(2)
    for rows in (8, 16, 48, 144, 176):
        mosaic.check_tiles(mosaic.Tiles(rows, 256, 128, stages=4, swap_ab=True), 256, 256, jnp.bfloat16, decode)
    mosaic.check_tiles(mosaic.Tiles(256, 128, 128, stages=4, swap_ab=True), 256, 256, jnp.bfloat16, decode)
    with pytest.raises(ValueError, match=r"block_m=16 \(64 or 128\)"):
        mosaic.check_tiles(mosaic.Tiles(16, 256, 128, stages=4), 256, 256, jnp.bfloat16, decode)
    for rows in (12, 264):
        with pytest.raises(ValueError, match=rf"block_m={rows} \(with swap_ab a multiple of 8, at most 256\)"):
            mosaic.check_tiles(mosaic.Tiles(rows, 256, 128, stages=4, swap_ab=True), 256, 256, jnp.bfloat16, decode)
    with pytest.raises(ValueError, match=r"accumulator of 184 x 128"):
        mosaic.check_tiles(mosaic.Tiles(184, 256, 128, stages=4, swap_ab=True), 256, 256, jnp.bfloat16, decode)


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("rows", [48, 144])
def test_expert_sized_swap_tiles_lower_for_the_gpu(rows):
    """Swap-form row tiles that are no power of two (an expert's rows: 48 at
    32 an expert, 144 at 256 in two tiles) lower, MXFP4 and int4: the wgmma's
    N, x's TMA box, the transposed stores of the rows a tile owns."""
    e, n, k = 3, 512, 512
    x = jax.ShapeDtypeStruct((300, k), jnp.bfloat16)
    codes = jax.ShapeDtypeStruct((e, n, k // 4), jnp.uint16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    tiles = mosaic.Tiles(rows, 256, 128, stages=3, swap_ab=True, word_decode=True)
    for decode, groups, scale_dtype in (
        (mosaic.NibbleDecode(k // 32, e2m1=True, half_bits=True), k // 32, jnp.uint8),
        (mosaic.NibbleDecode(k // 128), k // 128, jnp.bfloat16),
    ):
        scales = jax.ShapeDtypeStruct((e, groups, n), scale_dtype)

        def run(x, codes, offsets, scales, decode=decode):
            return mosaic.expert_gemm_mosaic(
                x, codes, offsets, tiles, out_dtype=jnp.bfloat16, decode=decode, scales=scales
            )

        text = jax.jit(run).trace(x, codes, offsets, scales).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_store_rows_takes_any_row_tile(monkeypatch):
    """A tile of a size that is no power of two stores its rows as a sum of
    power-of-two boxes that covers exactly ``[offset, offset + rows)``."""
    copies = []
    monkeypatch.setattr(mosaic.pl, "when", lambda cond: lambda body: body() if cond else None)
    monkeypatch.setattr(mosaic.plgpu, "copy_smem_to_gmem", lambda src, dst, **_: copies.append((src, dst)))

    class Rows:
        def __init__(self):
            self.at = self

        def __getitem__(self, index):
            return (index.start, index.size)

    for block_m in (48, 144, 176):
        for rows in (0, 1, 7, 40, block_m):
            copies.clear()
            mosaic.store_rows(Rows(), Rows(), 1000, 3, rows, block_m)
            starts = sorted((int(src[0]), src[1]) for src, _ in copies)
            covered = [r for start, size in starts for r in range(start, start + size)]
            assert covered == list(range(3, 3 + rows))
            assert all(int(dst[0]) - 1000 == int(src[0]) - 3 for src, dst in copies)


def _table(monkeypatch, *tiles):
    """The tuning table's entries for every call: ``tiles``, in order."""
    from humming_jax import tuning as T

    monkeypatch.setattr(T, "table_entries", lambda *args: [T.Entry(0, 1 << 30, t) for t in tiles])


def test_the_plan_takes_the_first_candidate_its_kernel_supports(monkeypatch, rng):
    """The op runs the table's entry when its kernel takes the call, else the
    next candidate: the H200's int4 prefill entry (the Mosaic swap_ab form)
    runs as listed on a Hopper GPU with 16-bit outputs; with f32 outputs,
    interpreted or off Hopper its kernel refuses and the heuristic's Triton
    tile runs; K-order int4 (which the kernel does not decode) takes the
    heuristic's dequantize-first candidate with rows enough an expert, else
    its Triton tile; planar MXFP4 the entry too (the kernel decodes it), K-order MXFP4 the Triton tile; a
    column-pair entry on an odd number of column tiles is refused. A
    tiling passed by hand runs as given or raises with the kernel's reason."""
    entry = mosaic.Tiles(128, 256, 128, stages=3, group_m=8, swap_ab=True, word_decode=True)
    _table(monkeypatch, entry)
    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    x = G.as_quantized_input(jnp.asarray(rng.normal(size=(64, 256)), jnp.bfloat16))
    w = jnp.asarray(rng.normal(0, 0.05, (2, 256, 256)), jnp.float32)
    planar = hj.to_planar(F.quantize_weight(w, F.INT4_G128))
    layout = hj.GroupedContiguous(jnp.asarray([0, 40, 64], jnp.int32))

    def plan(weight=planar, **options):
        return G.plan(x, weight, layout, **{"out_dtype": jnp.bfloat16, **options})

    assert plan() == (entry, [])
    for options, why in (({"out_dtype": jnp.float32}, "16-bit transposed view"), ({"interpret": True}, "compiled")):
        ran, reasons = plan(**options)
        assert isinstance(ran, triton.Tiles) and ran.pair_decode and why in reasons[0]
    k_order = F.quantize_weight(w, F.INT4_G128)
    many = 2 * 2 * hj.tuning.DEQUANTIZE_MIN_ROWS  # rows enough an expert (2 experts) to pay for the pass
    ran, reasons = plan(k_order, valid_shape_m=many)
    assert ran == mosaic.Tiles(128, 256, 64, stages=3, group_m=8, dequantize_first=True) and "K order" in reasons[0]
    ran, _ = plan(k_order)  # 32 rows an expert: the heuristic's Triton tile, which reads K order
    assert isinstance(ran, triton.Tiles) and ran.pair_decode
    mxfp4 = hj.to_planar(F.quantize_weight(w, F.MXFP4), half_bits=True)
    assert plan(mxfp4, valid_shape_m=many) == (entry, [])
    ran, reasons = plan(F.quantize_weight(w, F.MXFP4), valid_shape_m=many)  # K order: the Triton decoder
    assert isinstance(ran, triton.Tiles) and ran.fold_scales and "K order" in reasons[0]
    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: False)
    ran, reasons = plan()
    assert isinstance(ran, triton.Tiles) and "Hopper" in reasons[0]
    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    paired = mosaic.Tiles(64, 256, 64, stages=2, group_m=2, cluster_n=2)
    _table(monkeypatch, paired, dataclasses.replace(paired, cluster_n=1))
    # Three column tiles: compiled, the last pair's second program lies past N (TMA's fill);
    # interpreted, the pair is refused and the single-program tile runs.
    for n, interpret, want in ((768, False, 2), (768, True, 1), (512, False, 2)):
        weight = G.as_weight(jnp.asarray(rng.normal(0, 0.05, (2, n, 256)), jnp.bfloat16))
        assert plan(weight, interpret=interpret)[0].cluster_n == want
    ran, reasons = plan(tuning=entry, out_dtype=jnp.float32)
    assert ran is None and "16-bit transposed view" in reasons[0]


def test_swap_ab_refuses_32_bit_outputs():
    """The swap_ab form stores out.T through a transposed shared view, which
    takes 16-bit values: f32 outputs are refused with the reason (the Mosaic
    compiler's own error is a failed layout search)."""
    e, n, k = 2, 256, 256
    tiles = mosaic.Tiles(128, 256, 128, stages=3, swap_ab=True)
    decode = mosaic.NibbleDecode(k // 128)
    codes = jax.ShapeDtypeStruct((e, n, k // 4), jnp.uint16)
    scales = jax.ShapeDtypeStruct((e, k // 128, n), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((64, k), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)

    def run(x, codes, offsets, scales):
        return mosaic.expert_gemm_mosaic(x, codes, offsets, tiles, out_dtype=jnp.float32, decode=decode, scales=scales)

    with pytest.raises(ValueError, match="swap_ab with out_dtype=float32.*16-bit"):
        jax.jit(run).trace(x, codes, offsets, scales)


def test_a_table_entry_its_kernel_refuses_runs_the_next_candidate(monkeypatch, rng):
    """Run interpreted: a Mosaic table entry with N off its tiles gives way to
    the heuristic's Triton tile; K-order int4 runs the dequantize-first
    candidate when the estimate gives an expert rows enough, else the Triton
    tile — the same numbers either way. A tiling passed by hand still fails
    with the reason."""
    m, k = 24, 64
    offsets = np.asarray([0, 9, 24], np.int32)
    layout = hj.GroupedContiguous(jnp.asarray(offsets))
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.1, (2, 256, k)), jnp.float32)
    _table(monkeypatch, TILES)
    launches = []
    launch = mosaic.expert_gemm_mosaic
    monkeypatch.setattr(mosaic, "expert_gemm_mosaic", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    narrow = w[:, :192].astype(jnp.bfloat16)  # N off the kernel's 256-column tiles
    out = hj.gemm(x, narrow, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND)
    want = _expected(x, narrow, offsets, m)
    assert np.linalg.norm(np.asarray(out) - want) / np.linalg.norm(want) < 1e-5 and not launches
    with pytest.raises(ValueError, match="block_n"):
        hj.gemm(x, narrow, layout, tuning=TILES, backend=KERNEL_BACKEND)
    k_order = F.quantize_weight(w, F.INT4_CHANNEL)
    want = _expected(x, F.dequantize_weight(k_order).astype(jnp.bfloat16), offsets, m)
    _table(monkeypatch, mosaic.Tiles(64, 256, 128, stages=2))
    for estimate, on_mosaic in ((4096, True), (None, False)):
        del launches[:]
        out = hj.gemm(x, k_order, layout, out_dtype=jnp.float32, valid_shape_m=estimate, backend=KERNEL_BACKEND)
        assert np.linalg.norm(np.asarray(out) - want) / np.linalg.norm(want) < 1e-5
        assert bool(launches) == on_mosaic


@pytest.mark.parametrize(
    "fmt,layout_kind,tuning",
    [
        pytest.param(F.BF16, "grouped", TILES, marks=FULL),
        (F.BF16, "masked", WIDE),
        (F.INT4_G128, "grouped", mosaic.Tiles(64, 256, 128, stages=2)),
        pytest.param(F.INT4_G128, "grouped", mosaic.Tiles(64, 256, 128, stages=2, swap_ab=True), marks=ON_GPU_ONLY),
    ],
    ids=["bf16-grouped", "bf16-masked-128-rows", "int4-grouped", "int4-swap"],
)
def test_bias_added_to_each_experts_rows(fmt, layout_kind, tuning, rng):
    """A bias ``[E, N]`` added in f32 to the rows of its expert (gpt-oss); rows
    no expert owns stay zero, without the bias."""
    e, n, k = 3, 256, 128
    if layout_kind == "grouped":
        m, offsets = 50, np.asarray([0, 20, 20, 44], np.int32)
        layout = hj.GroupedContiguous(jnp.asarray(offsets))
    else:
        counts, max_tokens = (7, 0, 16), 16
        m, layout = e * max_tokens, hj.GroupedMasked(jnp.asarray(counts, jnp.int32))
        offsets = None
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    values = jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(e, n)), jnp.float32)
    weight = F.quantize_weight(values, fmt.with_bias(), bias=bias)
    weight = hj.to_planar(weight) if fmt.is_quantized else weight
    out_dtype, tolerance = (jnp.bfloat16, 5e-3) if tuning.swap_ab else (jnp.float32, 1e-5)  # swap_ab: 16-bit out
    out = hj.gemm(x, weight, layout, out_dtype=out_dtype, tuning=tuning, backend=KERNEL_BACKEND)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    rounded = np.asarray(F.dequantize_weight(weight).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    xs, want = np.asarray(x, np.float64), np.zeros((m, n))
    ranges = (
        [(offsets[g], offsets[g + 1]) for g in range(e)]
        if offsets is not None
        else [(g * max_tokens, g * max_tokens + counts[g]) for g in range(e)]
    )
    for g, (lo, hi) in enumerate(ranges):
        want[lo:hi] = xs[lo:hi] @ rounded[g].T + np.asarray(bias, np.float64)[g]
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < tolerance
    owned = np.zeros(m, bool)
    for lo, hi in ranges:
        owned[lo:hi] = True
    assert np.all(out[~owned] == 0)


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_offline_ir_tool_sees_the_decode():
    """``benchmarks.mosaic_ir`` captures the module the custom call carries:
    the 4-bit path loads codes with ldmatrix, stages pieces with stmatrix and
    fences them for the wgmma; the 16-bit path has no codes to load."""
    from benchmarks import mosaic_ir

    int4 = mosaic_ir.key_counts(
        mosaic_ir.mosaic_ir("int4_g128", (2, 256, 256), 64, mosaic.Tiles(64, 256, 128, stages=2))
    )
    bf16 = mosaic_ir.key_counts(mosaic_ir.mosaic_ir("bf16", (2, 256, 256), 64, TILES))
    assert int4["nvvm.ldmatrix"] > 0 and int4["nvvm.fence.proxy"] > bf16["nvvm.fence.proxy"]
    assert int4["nvvm.stmatrix"] > bf16["nvvm.stmatrix"] and int4["wgmma.mma_async"] > 0
    assert bf16["nvvm.ldmatrix"] == 0 and bf16["vector<2xi16>"] == 0


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "fmt,config",
    [
        # 2 stages: uint4's zero points do not fit 3
        ("uint4_zp_g128", "mosaic:block_k=128,stages=2"),
        ("int4_g128", "mosaic:block_k=128,stages=3,swap_ab=1,cluster_n=2"),
    ],
)
def test_word_decode_shifts_32_bit_registers(fmt, config):
    """With ``word_decode`` the compiled module takes each nibble from the
    32-bit registers that hold two codes (a shift on ``i32``, then the mask
    and the or as one ``lop3`` per pair: written apart, ptxas issues them as
    two, each with its immediate); without it the same ops run on 16-bit
    lanes (``vector<2xi16>``, whose shifts LLVM unpacks per lane). Both feed
    the same bf16 arithmetic."""
    from benchmarks import mosaic_ir
    from benchmarks.inspect_gemm import parse_config

    def shifts(config: str) -> dict[str, int]:
        text = mosaic_ir.mosaic_ir(fmt, (2, 512, 512), 256, parse_config(config))
        ops = re.findall(r"arith\.(shrui|andi|ori) %\S+, %\S+ : (vector<1xi32>|vector<2xi16>)", text)
        counts = collections.Counter(f"{op} {ty}" for op, ty in ops)
        counts["lop3"] = len(re.findall(r"lop3\.b32 \$0, \$1, 0x000F000F", text))
        return counts

    lanes = shifts(config)
    words = shifts(config + ",word_decode=1")
    # Pieces 1-3 of a unit shift, all four mask and or (16 registers of a 128 x 32 piece a thread).
    assert lanes["shrui vector<2xi16>"] > 0 and lanes["shrui vector<1xi32>"] == 0 and lanes["lop3"] == 0
    assert words["shrui vector<2xi16>"] == 0 and words["andi vector<2xi16>"] == 0
    assert words["shrui vector<1xi32>"] == lanes["shrui vector<2xi16>"]
    assert words["lop3"] == lanes["ori vector<2xi16>"] > 0
    assert words["andi vector<1xi32>"] == words["ori vector<1xi32>"] == 0


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "config",
    [
        "mosaic:block_m=16,block_k=128,swap_ab=1,word_decode=1",
        "mosaic:block_k=128,stages=3,swap_ab=1",
        "mosaic:block_k=128,stages=3",
    ],
)
def test_register_counts_fit_the_launch(config):
    """The warp-specialized pipeline's ``setmaxnreg`` counts fit the registers
    a program launches with: ``setmaxnreg.inc`` waits until the registers it
    asks for are free, so compute warpgroups asking for more than the memory
    warpgroup gives back hang (four compute warpgroups did on the H200: 4 x 112
    + 40 > 5 x 96)."""
    from benchmarks import mosaic_ir
    from benchmarks.inspect_gemm import parse_config

    module = mosaic_ir.mosaic_ir("int4_g128", (2, 512, 512), 256, parse_config(config))
    increase = [int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+)", module)]
    decrease = [int(n) for n in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+)", module)]
    assert len(set(increase)) == 1 and len(set(decrease)) == 1, (increase, decrease)
    warpgroups = mosaic.COMPUTE_WGS + 1
    at_launch = 65536 // (128 * warpgroups) // 8 * 8  # a thread's registers, in steps of 8
    assert mosaic.COMPUTE_WGS * increase[0] + decrease[0] <= warpgroups * at_launch


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", ["int4_g128", "mxfp4"])
def test_register_operands_retire_a_piece_behind(fmt):
    """The decoding swap tile issues a step's four products with at most two
    in flight (a ``wait_group 1`` after each but the last): the four pieces'
    register operands beside a tall tile's accumulator outgrow the compute
    warpgroup's 232 registers, and ptxas then waits out every wgmma before
    issuing the next (its "wgmma serialized" report, seen on the 160-row
    tile) — the decode never overlaps a product."""
    from benchmarks import mosaic_ir
    from benchmarks.inspect_gemm import parse_config

    config = "mosaic:block_m=160,block_k=128,stages=3,swap_ab=1,word_decode=1"
    text = mosaic_ir.mosaic_ir(fmt, (2, 512, 512), 256, parse_config(config))
    waits = collections.Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", text))
    assert text.count("wgmma.commit_group.sync.aligned") == mosaic.PIECES
    assert waits["1"] == mosaic.PIECES - 1, waits


def test_word_decode_is_for_4_bit_weights():
    x = jnp.zeros((64, 128), jnp.bfloat16)
    w = jnp.zeros((1, 256, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="word_decode with 16-bit weights"):
        mosaic.expert_gemm_mosaic(
            x, w, None, mosaic.Tiles(64, 256, 64, word_decode=True), out_dtype=jnp.bfloat16, interpret=True
        )
    with pytest.raises(TypeError, match="pair_decode"):  # a Triton option: not a field of the Mosaic tiles
        mosaic.Tiles(128, 256, 128, word_decode=True, pair_decode=True)


@pytest.mark.parametrize(
    "fmt,pipelines",
    [
        # make test: int4 (decoded in the kernel) on the grouped pipeline; the bf16
        # kernel's rows, biases and masked layout are tested on their own above.
        pytest.param("bf16+bias", ("batched",), marks=FULL),
        ("int4_g128", ("grouped",)),
        pytest.param("bf16+bias", ("grouped",), marks=FULL),
        pytest.param("int4_g128", ("batched",), marks=FULL),
    ],
)
def test_expert_pipelines_on_the_mosaic_kernel(fmt, pipelines, monkeypatch, rng):
    """The grouped and the batched (masked) pipelines with every expert GEMM on
    the Mosaic kernel (the table's entry forced to it): int4 weights planar,
    as the Flax modules store them, decoded in the kernel; bf16 weights with
    biases — against the same pipelines on the reference."""
    block_k = 128 if fmt.startswith("int4") else 64
    _table(monkeypatch, mosaic.Tiles(64, 128, block_k, stages=2, group_m=2))
    launches = []
    launch = mosaic.expert_gemm_mosaic
    monkeypatch.setattr(mosaic, "expert_gemm_mosaic", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format=fmt)
    w13 = jnp.asarray(rng.normal(size=(4, config.w13_n, 128)) / np.sqrt(128), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(4, 128, 128)) / np.sqrt(128), jnp.float32)
    bias = {}
    if "bias" in fmt:
        bias = dict(
            w13_bias=jnp.asarray(rng.normal(size=(4, config.w13_n)) * 0.1, jnp.float32),
            w2_bias=jnp.asarray(rng.normal(size=(4, 128)) * 0.1, jnp.float32),
        )
    weights = hj.quantize_experts(w13, w2, config, **bias)
    weights = dataclasses.replace(weights, w13=hj.to_planar(weights.w13), w2=hj.to_planar(weights.w2))
    x = jnp.asarray(rng.normal(size=(20, 128)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(4, 2, replace=False) for _ in range(20)]), jnp.int32)
    tw = jnp.asarray(rng.random((20, 2)), jnp.float32)
    results = []
    if "grouped" in pipelines:
        grouped = hj.humming_grouped_experts(x, weights, tw, ids, config, backend=KERNEL_BACKEND)
        results.append((grouped, hj.humming_grouped_experts(x, weights, tw, ids, config, backend="reference")))
    if "batched" in pipelines:
        counts = jnp.asarray([3, 0, 8, 5], jnp.int32)
        xb = jnp.asarray(rng.normal(size=(4, 8, 128)), jnp.bfloat16)
        batched = hj.batched_humming_grouped_experts(xb, counts, weights, config, backend=KERNEL_BACKEND)
        results.append((batched, hj.batched_humming_grouped_experts(xb, counts, weights, config, backend="reference")))
        assert np.all(np.asarray(batched)[1] == 0) and np.all(np.asarray(batched)[0, 3:] == 0)
    assert len(launches) == 2 * len(pipelines), "every expert GEMM on the Mosaic kernel"
    for got, ref in results:
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.parametrize(
    "fmt,config",
    [
        ("bf16", "mosaic:stages=3"),
        ("int4_g128", "mosaic:block_k=128,stages=3,swap_ab=1,word_decode=1"),
    ],
)
def test_cluster_pairs_multicast(fmt, config):
    """``cluster_n=2``: x's TMA loads carry a multicast mask (each program of the
    pair fetches half of x's tile from L2 and both receive all of it), the
    weight's do not; without clusters no load multicasts."""
    from benchmarks import mosaic_ir
    from benchmarks.inspect_gemm import parse_config

    alone = mosaic_ir.mosaic_ir(fmt, (2, 1024, 512), 256, parse_config(config))
    loads = "nvvm.cp.async.bulk.tensor.shared.cluster.global"
    paired = mosaic_ir.mosaic_ir(fmt, (2, 1024, 512), 256, parse_config(f"{config},cluster_n=2"))
    multicast = [line for line in paired.splitlines() if loads in line and "multicast_mask" in line]
    assert multicast and len(multicast) < sum(loads in line for line in paired.splitlines())
    assert "multicast_mask" not in alone


@pytest.mark.parametrize(
    "fmt,kind,layout_kind,tuning",
    [
        (F.BF16.with_bias(), "silu", "grouped", TILES),
        (F.INT4_G128, "gelu_tanh", "masked", mosaic.Tiles(64, 256, 128, stages=2)),
        pytest.param(F.MXFP4, "swiglustep", "indexed", mosaic.Tiles(64, 256, 128, stages=2), marks=FULL),
        pytest.param(F.BF16, "relu2_no_mul", "grouped", WIDE, marks=FULL),
        # The decoding swap tile (the 4-bit prefill entries): rows r and r + 64 of out.T.
        pytest.param(
            F.INT4_G128, "silu", "grouped", mosaic.Tiles(64, 256, 128, stages=2, swap_ab=True), marks=ON_GPU_ONLY
        ),
        # One warpgroup a program (mosaic_mid): the gate/up pairs in its whole tile.
        (F.BF16.with_bias(), "silu", "masked", mosaic_mid.Tiles(64, 128, 64, stages=2)),
        pytest.param(F.INT4_G128, "gelu_tanh", "indexed", mosaic_mid.Tiles(64, 128, 128, stages=2), marks=FULL),
        pytest.param(
            F.INT4_G128.with_bias(),
            "silu",
            "grouped",
            mosaic_mid.Tiles(48, 128, 128, stages=2, swap_ab=True, word_decode=True),
            marks=ON_GPU_ONLY,
        ),
    ],
    ids=[
        "bf16-bias-silu",
        "int4-masked-gelu_tanh",
        "mxfp4-indexed-swiglustep",
        "bf16-relu2",
        "int4-swap",
        "mid-bf16-bias-masked-silu",
        "mid-int4-indexed-gelu_tanh",
        "mid-int4-bias-swap-48",
    ],
)
def test_activation_in_the_epilogue(fmt, kind, layout_kind, tuning, rng):
    """``gemm(activation=)`` on the Mosaic kernel's plain tiles: a warpgroup's
    128 columns hold a gate/up pair of 64 (w13 interleaved), it stores 64
    outputs; against the float64 activation of the float64 product (weights
    as the tile rounds them), rows no expert owns zero."""
    import np_ref

    e, n, k = 4, 256, 128
    m = 40
    layouts = {
        "grouped": hj.GroupedContiguous(jnp.asarray([0, 7, 7, 30, 33], jnp.int32)),  # empty, tail rows
        "masked": hj.GroupedMasked(jnp.asarray([0, 10, 3, 10], jnp.int32)),
    }
    if layout_kind == "indexed":
        ids = jnp.asarray(rng.integers(0, e, size=(m, 2)), jnp.int32)
        layouts["indexed"] = hj.Indexed(*hj.moe_align_block_size(ids, tuning.block_m, e), top_k=2, block_size=64)
    layout = layouts[layout_kind]
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    bias = jnp.asarray(rng.normal(size=(e, n)), jnp.float32) if fmt.has_bias else None
    weight = F.quantize_weight(jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32), fmt, bias=bias)
    weight = hj.to_planar(weight, k_major_scales=True) if fmt.is_quantized else weight
    spec = hj.ActivationSpec(kind, clamp_limit=5.0 if kind == "swiglustep" else None)
    if spec.interleaves:
        weight = hj.interleave_gate_up(weight, 64)
        spec = dataclasses.replace(spec, gate_up_block=64)
    out_dtype, bound = (jnp.bfloat16, 1e-2) if tuning.swap_ab else (jnp.float32, 1e-5)  # swap_ab: 16-bit out
    out = hj.gemm(x, weight, layout, out_dtype=out_dtype, tuning=tuning, activation=spec, backend=KERNEL_BACKEND)
    bf16_weight = fmt.value_type.value == "int4"  # the decoded tile: (q - 8) * s rounded once
    product = np_ref.gemm_of(x, weight, layout, bf16_weight=bf16_weight)
    want = np_ref.activation(product, kind, spec.clamp_limit)
    assert out.shape == want.shape
    assert np_ref.relative_error(out, want) < bound
    assert np.all(np.asarray(out)[np.all(product == 0, axis=1)] == 0)


@pytest.mark.parametrize(
    "fmt,layout_kind,tuning",
    [
        (F.BF16, "grouped", TILES),  # two warpgroups, 64 outputs each: the row maxima exchanged
        (F.INT4_G128, "masked", mosaic.Tiles(64, 256, 128, stages=2)),
        (F.BF16, "masked", mosaic_mid.Tiles(64, 256, 64, stages=2)),  # one warpgroup holds the group
        # The decoding swap tile (W4A8's prefill entries on the input multiplied out): out.T's rows.
        pytest.param(F.INT4_G128, "grouped", mosaic.Tiles(64, 256, 128, stages=2, swap_ab=True), marks=ON_GPU_ONLY),
    ],
    ids=["bf16-exchange", "int4-masked", "mid-one-warpgroup", "int4-swap"],
)
def test_activated_rows_quantized_and_multiplied_back(fmt, layout_kind, tuning, rng):
    """``gemm(activation=, out_quant="fp8_dynamic_group128", out_dequantized=True)``
    on the 16-bit kernel: a tile's 128 outputs a row are one fp8 group of w2's
    input, quantized in the epilogue and multiplied back by its scale (the
    quantizing pass with ``dequantize``, as W4A8's multiplied-out w2 reads it);
    against the reference (the same quantizer on the f32 activation) and the
    float64 activation; rows no expert owns zero."""
    import np_ref

    e, n, k, m = 4, 256, 128, 40
    layouts = {
        "grouped": hj.GroupedContiguous(jnp.asarray([0, 7, 7, 30, 33], jnp.int32)),  # empty, tail rows
        "masked": hj.GroupedMasked(jnp.asarray([0, 10, 3, 10], jnp.int32)),
    }
    layout = layouts[layout_kind]
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    weight = F.quantize_weight(jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32), fmt)
    weight = hj.to_planar(weight, k_major_scales=True) if fmt.is_quantized else weight
    weight = hj.interleave_gate_up(weight, 64)
    spec = hj.ActivationSpec("silu", gate_up_block=64)
    kw = dict(activation=spec, out_quant="fp8_dynamic_group128", out_dequantized=True, out_dtype=jnp.float32)
    if tuning.swap_ab:
        kw["out_dtype"] = jnp.bfloat16  # swap_ab: 16-bit out
    got = hj.gemm(x, weight, layout, tuning=tuning, backend=KERNEL_BACKEND, **kw)
    ref = hj.gemm(x, weight, layout, backend="reference", **kw)
    assert got.shape == ref.shape == (m, n // 2) and got.dtype == kw["out_dtype"]
    got64, ref64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    # Interpreted, bf16 weights give the reference's f32 sums (an e4m3 rounding apart at most); int4's
    # decoded tile rounds (q - 8) * s to bf16, which moves a row's scale and so all its values a little.
    exact = KERNEL_BACKEND == "interpret" and not fmt.is_quantized
    assert np_ref.relative_error(got64, ref64) < (2e-3 if exact else 2e-2)
    bf16_weight = fmt.value_type.value == "int4"
    product = np_ref.gemm_of(x, weight, layout, bf16_weight=bf16_weight)
    want = np_ref.activation(product, "silu")
    assert np_ref.relative_error(got64, want) < 4e-2  # e4m3 values
    assert np.all(got64[np.all(product == 0, axis=1)] == 0)


def test_quantized_output_refusals_of_the_16_bit_kernel():
    """The 16-bit kernel quantizes only to multiply back out (the fp8 kernel
    stores e4m3), fp8 groups of 128 after a gated activation, one group a
    tile's row; the Triton tiles refuse any quantized output."""
    from pallas_kernels.gemm.spec import EpilogueActivation

    act = EpilogueActivation("silu", gate_up_block=64)
    q = "fp8_dynamic_group128"
    assert mosaic.quantized_output_refusal(TILES, act, q, True) is None
    assert mosaic.quantized_output_refusal(mosaic_mid.Tiles(64, 256, 64), act, q, True) is None
    assert "e4m3" in mosaic.quantized_output_refusal(TILES, act, q, False)
    assert "only" in mosaic.quantized_output_refusal(TILES, act, "fp8_dynamic_token", True)
    assert "gated" in mosaic.quantized_output_refusal(TILES, None, q, True)
    assert "block_n=128" in mosaic.quantized_output_refusal(mosaic_mid.Tiles(64, 128, 64), act, q, True)
    plain = mosaic.shared_memory_bytes(TILES, jnp.bfloat16, jnp.bfloat16)
    assert mosaic.shared_memory_bytes(TILES, jnp.bfloat16, jnp.bfloat16, exchange=True) == plain + 4 * 2 * 64 + 16
    swapped = dataclasses.replace(TILES, swap_ab=True)  # a third barrier: the cross-warp maxima in turn
    plain = mosaic.shared_memory_bytes(swapped, jnp.bfloat16, jnp.bfloat16)
    assert mosaic.shared_memory_bytes(swapped, jnp.bfloat16, jnp.bfloat16, exchange=True) == plain + 4 * 2 * 64 + 24


def test_quantized_output_left_to_the_pass_past_one_row_tile_an_expert():
    """Past one row tile an expert (on average; a masked layout's capacity)
    the 16-bit kernel leaves a quantized output to the pass after it."""
    from pallas_kernels.gemm.spec import LayoutSpec

    tiles = mosaic.Tiles(144, 256, 128, swap_ab=True)
    grouped = LayoutSpec("grouped_contiguous", 32768, 32768)  # qwen3 T=4096: 256 rows each of 128 experts
    assert mosaic.rows_an_expert(grouped, 128) == 256
    assert "256 rows an expert" in mosaic.busy_rows_refusal(tiles, grouped, 128)
    assert mosaic.busy_rows_refusal(tiles, grouped, 256) is None  # deepseek-v3's 256 experts: 128 rows each
    indexed = LayoutSpec("indexed", 4096, 32768, top_k=8, num_blocks=300, block_size=144)
    assert mosaic.rows_an_expert(indexed, 256) == 128
    assert mosaic.rows_an_expert(LayoutSpec("grouped_masked", 2048, 2048, max_tokens=256), 8) == 256
    assert mosaic.rows_an_expert(LayoutSpec("grouped_contiguous", 1001, 1001), 8) == 126  # rounded up
    assert mosaic.busy_rows_refusal(tiles, LayoutSpec("dense", 145, 145), 1) is not None


def test_what_cannot_apply_the_activation_in_a_mosaic_tile():
    from pallas_kernels.gemm.spec import EpilogueActivation

    blocks, plain = EpilogueActivation("silu", gate_up_block=64), mosaic.Tiles(64, 256, 64)
    swapped = dataclasses.replace(plain, swap_ab=True)
    assert mosaic.activation_refusal(plain, blocks) is None
    assert mosaic.activation_refusal(swapped, blocks) is None
    assert mosaic.activation_refusal(plain, EpilogueActivation("silu", gate_up_block=32)) is None
    assert mosaic.activation_refusal(plain, EpilogueActivation("relu2_no_mul")) is None
    assert "swap_ab" in mosaic.activation_refusal(swapped, EpilogueActivation("silu", gate_up_block=32))
    assert "halves" in mosaic.activation_refusal(plain, EpilogueActivation("silu"))
    assert "adjacent columns" in mosaic.activation_refusal(plain, EpilogueActivation("swigluoai"))
    assert "output slots" in mosaic.activation_refusal(dataclasses.replace(plain, block_n=128), blocks)
    # A partial last column tile stores whole output slots only: N/2 a multiple of 64.
    assert mosaic.activation_refusal(plain, blocks, n=5760) is None  # gpt-oss's w13: 2880 outputs
    assert "partial column tile" in mosaic.activation_refusal(plain, blocks, n=5696)
    assert mosaic.activation_refusal(plain, blocks, n=5632) is None  # whole tiles


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("swap_ab,out_quant", [(False, "none"), (True, "none"), (True, "fp8_dynamic_group128")])
def test_activation_in_the_epilogue_lowers_for_the_gpu(swap_ab, out_quant):
    """The epilogue (slices of the WGMMA accumulator: columns of a plain
    tile, rows r and r + 64 of a swapped one; the activation; the half-width
    store) lowers for the GPU, layouts inferred — what the interpreter cannot
    check, and the swapped form it cannot run: the int4 decoding swap tile."""
    from benchmarks.mosaic_ir import capture_mosaic_modules
    from pallas_kernels.gemm.spec import EpilogueActivation

    e, n, k = 3, 512, 256
    act = EpilogueActivation("silu", gate_up_block=64)
    x = jax.ShapeDtypeStruct((300, k), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    if swap_ab:
        tiles = mosaic.Tiles(160, 256, 128, stages=3, swap_ab=True, word_decode=True)
        w = jax.ShapeDtypeStruct((e, n, k // mosaic.PIECES), jnp.uint16)
        quant = (jax.ShapeDtypeStruct((e, k // mosaic.UNIT, n), jnp.bfloat16),)
        run = functools.partial(
            mosaic.expert_gemm_mosaic,
            tiles=tiles,
            out_dtype=jnp.bfloat16,
            act=act,
            decode=mosaic.NibbleDecode(k // 128),
            out_quant=out_quant,
        )
    else:
        w, quant = jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16), ()
        run = functools.partial(mosaic.expert_gemm_mosaic, tiles=WIDE, out_dtype=jnp.bfloat16, act=act)
    with capture_mosaic_modules() as texts:
        traced = jax.jit(lambda x, w, o, *q: run(x, w, o, scales=q[0] if q else None)).trace(x, w, offsets, *quant)
        traced.lower(lowering_platforms=("cuda",))
    assert traced.out_info.shape == (300, n // 2)
    assert "ex2" in texts[-1] or "exp" in texts[-1]


# The staged 4-bit decode at 128 x 256 (two stages: three pass the shared memory a program has).
STAGED_4BIT = mosaic.Tiles(128, 256, 128, stages=2)


# A last column tile past N (gpt-oss-120b: N = 5760 / 2880 on 256-column tiles), compiled
# only: TMA fills the weight's rows past N with zeros and drops the stores past it.
@PARTIAL_ON_GPU
@pytest.mark.parametrize(
    "fmt,n,tuning",
    [
        (None, 320, WIDE),  # 16-bit weights, 64 columns in the last tile
        (None, 576, dataclasses.replace(WIDE, cluster_n=2)),  # 3 tiles: the last pair's second past N
        (F.MXFP4, 320, EXPERT_SIZED_4BIT),  # the swap tile, the decoded weight the register operand
        (F.INT4_G128, 448, STAGED_4BIT),  # the staged decode, half a tile past N
    ],
    ids=["bf16", "bf16-cluster", "mxfp4-swap", "int4-staged"],
)
def test_partial_column_tile_with_bias(fmt, n, tuning, rng, k=512):
    """Every column of a partial last tile against float64 (the bias
    included: the epilogue loads a warpgroup's whole columns of it); the
    swap form stores bf16 (its transposed view is 16-bit)."""
    counts = (40, 0, 300, 9)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    m, e = int(offsets[-1]) + 5, len(counts)
    weights = jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(e, n)), jnp.float32)
    mx = fmt is F.MXFP4
    weight = F.quantize_weight(weights, (fmt or F.BF16).with_bias(), bias=bias)
    if fmt is not None:
        weight = hj.to_planar(weight, half_bits=mx, k_major_scales=mx)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    layout = hj.GroupedContiguous(jnp.asarray(offsets))
    out_dtype = jnp.bfloat16 if tuning.swap_ab else jnp.float32
    out = hj.gemm(x, weight, layout, out_dtype=out_dtype, tuning=tuning, backend=KERNEL_BACKEND)
    rounded = F.dequantize_weight(weight).astype(jnp.bfloat16)
    want = _expected(x, rounded, offsets, m)
    for g in range(e):
        want[offsets[g] : offsets[g + 1]] += np.asarray(bias[g], np.float64)
    got = np.asarray(out, np.float64)
    assert got.shape == (m, n) and np.all(np.isfinite(got))
    _check_column_bands(got, want, tuning.block_n)
    _check_many_tiles(got, want, 6e-3 if tuning.swap_ab else 5e-3, offsets)


def _check_column_bands(got, want, block_n: int, tolerance: float = 6e-3) -> None:
    """Each column tile's relative error on its own (a wrong partial tile or
    K tail shows as the bands it touches, which the whole norm would dilute)."""
    errors = []
    for start in range(0, want.shape[1], block_n):
        band = slice(start, start + block_n)
        errors.append(np.linalg.norm(got[:, band] - want[:, band]) / max(np.linalg.norm(want[:, band]), 1e-30))
    bad = [(i * block_n, round(float(err), 5)) for i, err in enumerate(errors) if err >= tolerance]
    assert not bad, f"column tiles (first column, relative error) off: {bad}"


# gpt-oss-120b's K = 2880 ends with half a 128-column step: MXFP4 codes only.
@PARTIAL_ON_GPU
@pytest.mark.parametrize("tuning", [EXPERT_SIZED_4BIT, STAGED_4BIT], ids=["swap", "staged"])
def test_partial_last_k_step_of_mxfp4(tuning, rng):
    """K = 320 (two steps and 64 columns) and N = 320: x, the codes and the
    factors past K read as zeros; every column against float64."""
    test_partial_column_tile_with_bias(F.MXFP4, 320, tuning, rng, k=320)


# gpt-oss-120b's MXFP4 on the table's swap tiles, each tail alone and both: the benchmark's
# w13 / w2 at T=4096 measured 1.1-1.4e-2 against 1.7e-3 on the Triton tile (62nd session).
@PARTIAL_ON_GPU
@pytest.mark.parametrize(
    "n,k",
    [(3072, 2880), (2880, 2816), (2816, 2816), (2880, 2880), (5760, 2880)],
    ids=["k-tail", "n-tail", "odd-pairs", "both-w2", "both-w13"],
)
@pytest.mark.parametrize("tuning", [EXPERT_SIZED_4BIT, PREFILL_4BIT], ids=["144-rows", "128-rows"])
def test_gpt_oss_mxfp4_tails(n, k, tuning, rng):
    """MXFP4 with K = 2880 (half a last step), N = 2880 (a partial last
    column tile), 11 column tiles (the last cluster pair's second program
    past N), and gpt-oss's w2 / w13 (all three) on the table's swap tiles,
    against float64 column tile by column tile: which part is wrong, if one is."""
    # Some 280 output tiles on 132 SMs: most programs run two or three tiles, one pipeline after another.
    counts = (600, 0, 700, 217)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    m, e = int(offsets[-1]) + 3, len(counts)
    weights = jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32)
    k_order = F.quantize_weight(weights, F.MXFP4)
    weight = hj.to_planar(k_order, half_bits=True, k_major_scales=True)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    layout = hj.GroupedContiguous(jnp.asarray(offsets))
    out = hj.gemm(x, weight, layout, out_dtype=jnp.bfloat16, tuning=tuning, backend=KERNEL_BACKEND)
    dequantized = np.asarray(F.dequantize_weight(k_order), np.float64)
    want = _expected(x, dequantized, offsets, m)
    got = np.asarray(out, np.float64)
    try:
        _check_column_bands(got, want, tuning.block_n)
        _check_many_tiles(got, want, 6e-3, offsets)
    except AssertionError as error:
        scales = 2.0 ** (np.asarray(k_order.scale, np.float64) - 127)
        fits = _tail_hypotheses(dequantized, scales, tuning.block_n)
        errors = {name: _relative(got, _expected(x, w, offsets, m)) for name, w in fits.items()}
        raise AssertionError(f"{error}; the result against what each misread would give: {errors}") from None


# The benchmark's routing at gpt-oss T=4096: ~128 rows an expert, so most take two row tiles and
# each row tile's first stored row sits mid-expert or right after another expert's last row (63rd
# session: the swap form went wrong exactly there, in the columns a store past N would reach).
@PARTIAL_ON_GPU
@pytest.mark.parametrize("n,e", [(2880, 24), (5760, 12)], ids=["w2", "w13"])
@pytest.mark.parametrize("tuning", [EXPERT_SIZED_4BIT, PREFILL_4BIT], ids=["144-rows", "128-rows"])
def test_gpt_oss_mxfp4_every_row_at_the_benchmarks_routing(n, e, tuning, rng):
    """MXFP4, K = 2880, ``e`` experts of 115-154 rows: every row against
    float64 on its own (one wrong row in thousands hides in any norm of many)."""
    k = 2880
    counts = rng.integers(115, 155, size=e)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    m = int(offsets[-1])
    weights = jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32)
    k_order = F.quantize_weight(weights, F.MXFP4)
    weight = hj.to_planar(k_order, half_bits=True, k_major_scales=True)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    out = hj.gemm(x, weight, hj.GroupedContiguous(jnp.asarray(offsets)), tuning=tuning, backend=KERNEL_BACKEND)
    want = _expected(x, np.asarray(F.dequantize_weight(k_order), np.float64), offsets, m)
    got = np.asarray(out, np.float64)
    errors = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    bad = np.nonzero(errors >= 1e-2)[0]
    where = [(int(r), int(r - offsets[np.searchsorted(offsets, r, side="right") - 1])) for r in bad[:8]]
    assert not len(bad), f"{len(bad)} rows off (row, its place in its expert): {where}"
    columns = np.nonzero(np.abs(got - want).max(axis=0) > 0.1 * np.sqrt(np.mean(want**2)))[0]
    assert not len(columns), f"columns off: {columns[:8].tolist()} … {columns[-4:].tolist()}"


def _relative(got, want) -> float:
    return round(float(np.linalg.norm(got - want) / np.linalg.norm(want)), 5)


def _tail_hypotheses(w, scales, block_n: int, step: int = 128) -> dict:
    """Weights ``[E, N, K]`` (float64, K order) as the kernel would use them if
    a box past the arrays' end were moved back inside them instead of
    zero-filled: the last K step's factor rows (``factors``), its codes
    (``codes``), both (``codes+factors``), the last column tile's weight rows
    (``columns``); and the K tail dropped (``no tail``) — for a failed
    check's message."""
    n, k = w.shape[1:]
    fits = {}
    tail = k % step
    if tail:
        start = k - tail  # the last step's first column; its box would start `step - tail` earlier
        back = step - tail
        codes = w / np.repeat(scales, 32, axis=2)  # the e2m1 values before their group's scale
        group = np.repeat(scales, 32, axis=2)
        moved = {}
        moved["factors"] = codes[..., start:] * group[..., start - back : k - back]
        moved["codes"] = codes[..., start - back : k - back] * group[..., start:]
        moved["codes+factors"] = w[..., start - back : k - back]
        for name, part in moved.items():
            fits[name] = np.concatenate([w[..., :start], part], axis=2)
        fits["no tail"] = np.concatenate([w[..., :start], np.zeros_like(w[..., start:])], axis=2)
    last = n - n % block_n
    if n % block_n:  # rows [last, n) read from the box moved back to end at n
        moved_rows = np.concatenate([w[:, :last], w[:, n - block_n : n - block_n + (n - last)]], axis=1)
        fits["columns"] = moved_rows
    return fits


def test_tail_hypotheses_name_a_planted_misread(rng):
    """The gpt-oss test's diagnosis: a product computed with one misread's
    weights matches that misread's hypothesis exactly and no other."""
    weights = jnp.asarray(rng.normal(0, 0.05, (1, 320, 320)), jnp.float32)
    k_order = F.quantize_weight(weights, F.MXFP4)
    w = np.asarray(F.dequantize_weight(k_order), np.float64)
    scales = 2.0 ** (np.asarray(k_order.scale, np.float64) - 127)
    fits = _tail_hypotheses(w, scales, 256)
    assert sorted(fits) == ["codes", "codes+factors", "columns", "factors", "no tail"]
    x = rng.normal(size=(8, 320))
    for planted, misread in fits.items():
        got = x @ misread[0].T
        errors = {name: _relative(got, x @ fit[0].T) for name, fit in fits.items()}
        assert errors[planted] == 0 and all(err > 1e-3 for name, err in errors.items() if name != planted), errors
    # The last step's 64 columns moved back 64: codes+factors is the weight's own columns 192..255.
    np.testing.assert_array_equal(fits["codes+factors"][..., 256:], w[..., 192:256])


def test_partial_column_tiles_compiled_only(monkeypatch, rng):
    """Interpreted, a column count the tiles do not divide is refused; on a
    Hopper GPU the kernel takes it. A partial K step of other 4-bit codes than
    MXFP4's, or of K not a multiple of 64, is refused."""
    x = jnp.asarray(rng.normal(size=(16, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.05, (2, 320, 256)), jnp.bfloat16)
    grouped = hj.GroupedContiguous(jnp.asarray([0, 8, 16], jnp.int32))
    call = G.gemm_call(G.as_quantized_input(x), G.as_weight(w), grouped, jnp.bfloat16, interpret=True)
    assert "N=320, not a multiple of block_n=256" in mosaic.supports(WIDE, call)
    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    assert mosaic.supports(WIDE, dataclasses.replace(call, interpret=False)) is None
    staged = gemm_from_text("mosaic:block_k=128,stages=3")
    for k, partial, e2m1, taken in (
        (2880, True, True, True),
        (2880, False, True, False),  # interpreted
        (2912, True, True, False),  # a tail of 96 columns: not a multiple of 64
        (2880 + 128, True, False, False),  # int4's 128-column groups: K % 128 == 0 anyway
    ):
        decode = mosaic.NibbleDecode(k // (mosaic.E2M1_UNIT if e2m1 else mosaic.UNIT), e2m1=e2m1, half_bits=e2m1)
        reason = mosaic.tiles_refusal(staged, 2880, k, jnp.bfloat16, decode, partial=partial)
        assert (reason is None) == taken, (k, partial, e2m1, reason)


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.parametrize(
    "fmt,shape,tiles",
    [
        ("bf16", (4, 5760, 2880), "mosaic:stages=3,cluster_n=2"),
        ("bf16", (4, 2880, 2880), "mosaic:stages=3"),
        ("int4_g128", (4, 2880, 2816), "mosaic:block_m=144,block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2"),
        ("mxfp4", (4, 5760, 2880), "mosaic:block_m=144,block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2"),
        ("mxfp4", (4, 2880, 2880), "mosaic:block_k=128,stages=3"),
    ],
)
def test_gpt_oss_shapes_lower_for_the_gpu(fmt, shape, tiles, monkeypatch):
    """gpt-oss-120b's weights lower for the GPU with every TMA box on TMA's
    128-byte rule: bf16 (K = 2880: 45 steps of 64), int4 on a K of 2816
    (N = 2880: a partial column tile) and MXFP4, whose last 128-column step is
    half past K (its codes' boxes tiled 16 wide)."""
    from benchmarks import mosaic_ir

    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    with mosaic_ir.capture_tma_copies() as copies:
        mosaic_ir.mosaic_ir(fmt, shape, 600, gemm_from_text(tiles))
    assert copies and not mosaic_ir.misaligned(copies), (fmt, shape)
    jax.clear_caches()
