"""The tilings ``python -m humming_jax tune`` sweeps, by rows an expert holds.
Each row is one kernel's ``Tiles``; what each measured and why it is here is
in benchmarks/notes/gemm.md (candidates that never won were pruned there)."""

from __future__ import annotations

import dataclasses

from humming_jax.tuning.heuristic import DECODE_ROWS_MAX, decode_tile_of, expert_sized_rows
from pallas_kernels.gemm import mosaic, mosaic_fp8, mosaic_mid, triton

# Prefill split where the row tile sized to an expert's rows changes (T=4096 at top-8 is
# M=32768, the anchor's prefill point); each range is swept at representative_m.
M_RANGES = (
    (0, 16),
    (16, 128),
    (128, 1024),
    (1024, 4096),
    (4096, 8192),
    (8192, 16384),
    (16384, 32768),
    (32768, 1 << 30),
)


def swept_ranges(min_m: int = 0, max_m: int = 0) -> tuple[tuple[int, int], ...]:
    """The :data:`M_RANGES` a ``tune --min-m --max-m`` sweeps: those ending at or
    above ``min_m`` and (``max_m`` non-zero) starting below ``max_m``."""
    return tuple((low, high) for low, high in M_RANGES if high >= min_m and not (max_m and low >= max_m))


def representative_m(low: int, high: int) -> int:
    """The M a range ``(low, high]`` is swept at: its top, or twice its bottom when open-ended."""
    return high if high < 1 << 30 else 2 * low


DECODE_MAX_ROWS = 32  # experts with up to this many rows sweep DECODE
SPLIT_MAX_ROWS = 2  # split-K decode candidates only where experts hold a row or two (T=1-2)

_PAIRS = dict(word_decode=True, fold_scales=True, pair_decode=True)
_SWAP_PAIRS = dict(swap_ab=True, **_PAIRS)


def _t(block_m, block_n, block_k, warps, stages, **options) -> triton.Tiles:
    return triton.Tiles(block_m, block_n, block_k, warps, stages, **options)


DECODE = (
    _t(16, 64, 128, 4, 3),
    _t(16, 128, 128, 8, 3, swap_ab=True),
    _t(16, 128, 256, 4, 3, word_decode=True, fold_scales=True),
    _t(16, 64, 256, 4, 3, word_decode=True, fold_scales=True),
    _t(16, 32, 256, 2, 3, word_decode=True, fold_scales=True),
    _t(16, 64, 256, 4, 3, **_PAIRS),
    _t(16, 32, 256, 2, 3, **_PAIRS),
    _t(16, 128, 256, 4, 3, **_PAIRS),
    _t(16, 128, 256, 4, 2, **_PAIRS),
    _t(16, 64, 512, 4, 3, **_PAIRS),
    _t(16, 128, 512, 8, 2, **_PAIRS),
    _t(16, 64, 256, 4, 3, **_SWAP_PAIRS),
    _t(32, 128, 256, 4, 3, **_PAIRS),
    _t(32, 64, 256, 4, 3, **_PAIRS),
    _t(16, 64, 256, 4, 3, split_k=2, **_SWAP_PAIRS),
    _t(16, 64, 256, 4, 3, split_k=4, **_SWAP_PAIRS),
    _t(16, 64, 256, 4, 3, split_k=8, **_SWAP_PAIRS),
    # Split K for 8-bit weights (the 4-bit decode options above are refused for them):
    # a long K over few column tiles (mixtral's w2 at T=1: 128 programs) leaves SMs idle.
    _t(16, 64, 256, 4, 3, split_k=2),
    _t(16, 64, 256, 4, 3, split_k=4),
    _t(16, 64, 256, 4, 3, split_k=8),
    # 8-bit weights on 32 columns: twice the programs where few column tiles leave SMs a second,
    # partly filled wave (qwen3's w13 at T=1: 192 programs of 64 columns on 132 SMs).
    _t(16, 32, 256, 4, 3),
    # 8-bit weights swapped: the weight is the A operand of a native e4m3 wgmma, no widening to f16.
    _t(16, 64, 256, 4, 3, swap_ab=True),
    _t(16, 256, 256, 8, 3, **_PAIRS),
    # Scaled inputs multiplied out to bf16 first: the weight-only tiles (refused for 16-bit inputs).
    _t(16, 128, 256, 4, 3, dequantize_input=True, **_PAIRS),
    _t(16, 64, 256, 4, 3, dequantize_input=True, **_SWAP_PAIRS),
    _t(32, 128, 256, 4, 3, dequantize_input=True, **_PAIRS),
    # One warpgroup a program on 32 rows, several programs an SM: 16 rows an expert at a long K (gpt-oss MXFP4).
    mosaic_mid.Tiles(32, 128, 128, stages=3, swap_ab=True, word_decode=True),
)
# Experts of 17-32 rows on average: one 64-row tile decodes the weight once.
MID = (
    _t(64, 128, 256, 4, 3, **_PAIRS),
    _t(64, 128, 256, 4, 2, **_PAIRS),
    _t(64, 128, 256, 4, 3, **_SWAP_PAIRS),
    _t(64, 128, 128, 4, 3, **_SWAP_PAIRS),
    _t(64, 256, 128, 8, 3, **_SWAP_PAIRS),
    # 32 rows swapped: the decoded weight is wgmma's register operand at a size that
    # leaves room for several CTAs an SM (MXFP4, and fp8 inputs multiplied out).
    _t(32, 256, 128, 8, 3, **_SWAP_PAIRS),
    _t(32, 256, 128, 8, 3, dequantize_input=True, **_SWAP_PAIRS),
    # MXFP4 with fp8 inputs: the fp8 kernel's decoded step as the register operand.
    mosaic_fp8.Tiles(64, 256, stages=4, swap_ab=True),
    # One warpgroup a program, a program per output tile (several an SM): 48 rows, the
    # decoded weight as the register operand, on 128 columns and 2 stages or 256 and 3.
    mosaic_mid.Tiles(48, 128, 128, stages=2, swap_ab=True, word_decode=True),
    mosaic_mid.Tiles(48, 256, 128, stages=3, swap_ab=True, word_decode=True),
    # 64 rows for experts of ~64 rows, which pad 48-row tiles by a third.
    mosaic_mid.Tiles(64, 256, 128, stages=3, swap_ab=True, word_decode=True),
    # and fp8 inputs multiplied out to bf16 first (W4A8 at 32 rows an expert).
    mosaic_mid.Tiles(48, 128, 128, stages=2, swap_ab=True, word_decode=True, dequantize_input=True),
)
PREFILL = (
    _t(128, 256, 64, 8, 4),
    _t(128, 256, 64, 8, 4, group_m=8),
    _t(128, 128, 64, 8, 4, group_m=8),
    _t(64, 128, 128, 4, 3, swap_ab=True, word_decode=True, group_m=8),
    _t(128, 128, 128, 8, 3, group_m=8, **_SWAP_PAIRS),
    _t(256, 128, 128, 8, 3, group_m=8, **_SWAP_PAIRS),
    _t(128, 256, 128, 8, 3, group_m=8, **_SWAP_PAIRS),
    _t(128, 256, 128, 8, 3, group_m=8, dequantize_input=True, **_SWAP_PAIRS),
    mosaic.Tiles(128, 256, 64, stages=4),
    mosaic.Tiles(128, 256, 64, stages=3),
    mosaic.Tiles(128, 256, 64, stages=3, group_m=1),
    mosaic.Tiles(128, 128, 64, stages=4),
    mosaic.Tiles(64, 256, 64, stages=4),
    mosaic.Tiles(128, 256, 64, stages=3, cluster_n=2),
    mosaic.Tiles(128, 256, 64, stages=3, dequantize_first=True),
    mosaic.Tiles(128, 256, 128, stages=3),
    mosaic.Tiles(128, 256, 128, stages=3, swap_ab=True),
    mosaic.Tiles(128, 256, 128, stages=3, swap_ab=True, word_decode=True),
    mosaic.Tiles(128, 256, 128, stages=3, swap_ab=True, word_decode=True, cluster_n=2),
    # 64-row tiles decoding the weight in the kernel, for experts of 33-127 rows.
    mosaic.Tiles(64, 256, 128, stages=3, swap_ab=True, word_decode=True),
    # Scaled 8-bit inputs multiplied out to bf16 first, MXFP4 decoded on the 16-bit product.
    mosaic.Tiles(128, 256, 128, stages=3, swap_ab=True, word_decode=True, cluster_n=2, dequantize_input=True),
    mosaic_fp8.Tiles(64, 256, stages=4),
    mosaic_fp8.Tiles(64, 256, stages=4, group_m=1),
    mosaic_fp8.Tiles(128, 128, stages=4),
    mosaic_fp8.Tiles(64, 256, stages=4, swap_ab=True),
    mosaic_fp8.Tiles(128, 128, stages=4, swap_ab=True),
)


# The 16-bit Mosaic kernel's decoding swap tile sized to the experts' rows (the heuristic's rule).
# Experts past this many rows span several row tiles, each decoding the expert's weight
# tile again: the tallest swap tiles cut that count (1024 rows: seven of 160, six of 176).
TALL_TILES_MIN_ROWS = 512
TALL_TILES = (  # 176 rows leave shared memory for two stages only
    mosaic.Tiles(160, 256, 128, stages=3, swap_ab=True, word_decode=True, cluster_n=2),
    mosaic.Tiles(176, 256, 128, stages=2, swap_ab=True, word_decode=True, cluster_n=2),
)


def expert_sized(rows_per_expert: int) -> tuple:
    """The prefill swap tiles (bf16 inputs, and scaled inputs multiplied out)
    with :func:`expert_sized_rows` rows, where that is not the table's 128; the
    bf16 one 16 rows taller too (up to ``DECODE_ROWS_MAX``, three stages); past
    :data:`TALL_TILES_MIN_ROWS` rows an expert the :data:`TALL_TILES`."""
    rows = expert_sized_rows(rows_per_expert)
    tall = TALL_TILES if rows_per_expert > TALL_TILES_MIN_ROWS else ()
    # With few experts one row tile more than the SMs take is a second wave: a taller
    # tile keeps the largest expert's rows in as many tiles as the mean's.
    taller = (decode_tile_of(rows + 16),) if rows + 16 <= DECODE_ROWS_MAX else ()
    taller = tuple(t for t in taller if t not in tall)
    if rows == 128:
        return taller + tall
    swap = decode_tile_of(rows)
    return (swap, dataclasses.replace(swap, dequantize_input=True)) + taller + tall


def candidates_for(rows_per_expert: int) -> tuple:
    """The sweep for a range whose representative M gives ``rows_per_expert``
    (M / E): decode tiles (and 64-row ones from 17 rows), else prefill tiles
    (and the swap tiles sized to the experts' rows, :func:`expert_sized`).
    A kernel refuses the candidates it cannot take (its ``supports``)."""
    if rows_per_expert > DECODE_MAX_ROWS:
        return PREFILL + expert_sized(rows_per_expert)
    decode = tuple(c for c in DECODE if getattr(c, "split_k", 1) == 1 or rows_per_expert <= SPLIT_MAX_ROWS)
    return decode + MID if rows_per_expert > 16 else decode
