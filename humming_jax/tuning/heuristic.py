"""The tiling a call gets when the table has no entry for it (or its kernel
refuses the entry): thin row tiles with long K steps where experts hold few
rows (the weight's bytes bound the time), large tiles where they hold many
(the tensor cores do). The shapes are the H200 sweeps' winners
(benchmarks/notes/gemm.md)."""

from __future__ import annotations

import dataclasses
import math

from humming_jax import formats as F
from humming_jax.tuning.table import format_class
from pallas_kernels.gemm import mosaic, mosaic_fp8, mosaic_mid, triton

LARGE_EXPERT_BYTES = 16 * 2**20
# Rows an expert needs before a dequantize pass over every expert's weight pays
# for the Mosaic kernel's 16-bit product (weights it cannot decode itself).
DEQUANTIZE_MIN_ROWS = 512
# Rows an expert from which e4m3 weights with fp8 inputs take the fp8 Mosaic
# kernel (TMA-fed 8-bit wgmma) rather than the Triton tile; where the Triton
# kernel reads the weight as byte pairs (triton.reads_byte_pairs), from
# BYTE_PAIRS_MOSAIC_MIN_M rows in all (fewer fill too few of the Mosaic tiles).
FP8_MOSAIC_MIN_ROWS = 128
BYTE_PAIRS_MOSAIC_MIN_M = 128
# MXFP4 weights with fp8 inputs (W4A8): the fp8 Mosaic kernel decodes the codes to e4m3
# from this many rows an expert (64-row tiles, the decoded step as the register operand:
# MX_FP8_SWAP; the staged form where a call refuses it), grouped and indexed; from
# DECODE_MOSAIC_MIN_ROWS the input is multiplied out to bf16 and the 16-bit Mosaic
# kernel decodes the codes (DECODE_MOSAIC).
MX_MOSAIC_MIN_ROWS = 32
MX_FP8_SWAP = mosaic_fp8.Tiles(64, 256, stages=4, group_m=8, swap_ab=True)
# MXFP4 with fp8 inputs from this many rows an expert: the codes decoded once a call into an
# e4m3 copy, then W8A8's loop with a scale per column (mosaic_fp8.Tiles.dequantize_first),
# while the copy (E x N x K bytes, a transient of the call) stays under E4M3_COPY_MAX_BYTES.
# Indexed layouts from E4M3_COPY_MIN_ROWS_INDEXED (their block is the copy's 64 rows): the
# block-order gather and scatter of rows leave the copy behind at fewer.
E4M3_COPY_MIN_ROWS = 256
E4M3_COPY_MIN_ROWS_INDEXED = 512
E4M3_COPY_MAX_BYTES = 4 * 2**30
E4M3_COPY = mosaic_fp8.Tiles(64, 256, stages=4, group_m=8, dequantize_first=True)
# Indexed layouts on the fp8 Mosaic kernel (rows gathered in block order): W8A8, whose
# Triton tile is faster at short K, where K is long — or where Triton reads byte pairs.
FP8_INDEXED_MIN_ROWS = 128
FP8_INDEXED_MIN_K = 4096
# Planar 4-bit weights (int4 g128, MXFP4) with bf16 inputs: the 16-bit Mosaic kernel decodes
# the codes itself (every problem's tuned prefill tile is this form) from this many rows an
# expert, indexed layouts included; weights it cannot decode fall through to the next tiling.
DECODE_MOSAIC_MIN_ROWS = 128
DECODE_MOSAIC = mosaic.Tiles(128, 256, 128, stages=3, group_m=8, swap_ab=True, word_decode=True, cluster_n=2)
# Its row tile holds an expert's rows in as few tiles as they need, an eighth over for the
# spread of the counts (x's rows are the wgmma's N: any multiple of 8), at most
# DECODE_ROWS_MAX rows (three stages' shared memory); a tile of 128 rows at 128 rows an
# expert would leave about half the experts a second, nearly empty tile.
EXPERT_ROWS_HEADROOM = 1.125
EXPERT_ROWS_MAX = 176  # the accumulator's limit at 128 columns a warpgroup
DECODE_ROWS_MAX = 160
# The fewest rows that sizing gives from DECODE_MOSAIC_MIN_ROWS rows an expert (an expert
# of 192 in two tiles): an indexed block of DECODE_ROWS_MIN to DECODE_ROWS_MAX rows, a
# multiple of 8, is a decoding tile's, so a layout aligned to the first candidate's rows
# is taken by that candidate.
DECODE_ROWS_MIN = 96
# Below that, from MID_MIN_ROWS rows an expert where experts are many (at least
# MID_MIN_EXPERTS): one warpgroup a program decoding the codes, several programs an SM
# (mosaic_mid), on one row tile an expert, 48 or 64 rows; past 64 rows an expert two such
# tiles would decode each weight tile twice, and the 128-row DECODE_MOSAIC runs. With few
# experts the tiles are too few to fill the SMs that way and the K loop decides: up to 48
# rows an expert the warp-specialized 48-row pair (PAIR_48, mixtral's entries), else Triton.
MID_MIN_ROWS = 32
MID_MIN_EXPERTS = 64
MID_48 = mosaic_mid.Tiles(48, 256, 128, stages=3, swap_ab=True, word_decode=True)
MID_64 = mosaic_mid.Tiles(64, 256, 128, stages=3, swap_ab=True, word_decode=True)
PAIR_48 = mosaic.Tiles(48, 256, 128, stages=3, swap_ab=True, word_decode=True, cluster_n=2)


def expert_sized_rows(rows_per_expert: int, most: int = EXPERT_ROWS_MAX) -> int:
    """Rows of a swap tile sized to experts of ``rows_per_expert`` rows: each
    expert in ``round(rows / 128)`` tiles (at least one, and enough for the
    mean's rows at ``most`` a tile), :data:`EXPERT_ROWS_HEADROOM` over where
    that fits ``most``, a multiple of 8."""
    wanted = rows_per_expert * EXPERT_ROWS_HEADROOM
    tiles = max(1, round(rows_per_expert / 128), math.ceil(rows_per_expert / most))
    return min(most, max(8, -(-int(wanted / tiles) // 8) * 8))


def decode_tile_of(block_m: int) -> mosaic.Tiles:
    """:data:`DECODE_MOSAIC` on ``block_m``-row tiles."""
    # a cluster pair halves x's box in 8-row pieces: an odd count of them runs alone
    return dataclasses.replace(DECODE_MOSAIC, block_m=block_m, cluster_n=2 if block_m % 16 == 0 else 1)


def decode_block_tile(block_size: int) -> mosaic.Tiles | None:
    """The decoding tile whose rows are an indexed layout's ``block_size`` (a tile
    is one block), or None if no sized tile has that many rows."""
    if block_size % 8 or not DECODE_ROWS_MIN <= block_size <= DECODE_ROWS_MAX:
        return None
    return decode_tile_of(block_size)


def decode_tiles(rows: int, num_experts: int) -> mosaic.Tiles:
    """:data:`DECODE_MOSAIC` on row tiles sized to experts of ``rows`` rows
    (:func:`expert_sized_rows`). With few experts (under :data:`MID_MIN_EXPERTS`)
    that fit one tile, 16 rows more: there one tile more than the SMs take is a
    second wave, and the largest expert's count is well past the mean's eighth.
    One weight (the dense layout) has no spread of counts: the 128-row tile."""
    if num_experts == 1:
        return DECODE_MOSAIC
    block_m = expert_sized_rows(rows, DECODE_ROWS_MAX)
    if num_experts < MID_MIN_EXPERTS and rows * EXPERT_ROWS_HEADROOM <= block_m:
        block_m = min(DECODE_ROWS_MAX, block_m + 16)
    return decode_tile_of(block_m)


def rows_per_expert(layout: str, valid_shape_m: int, num_experts: int) -> int:
    return max(1, valid_shape_m if layout == "dense" else valid_shape_m // max(num_experts, 1))


def _pow2_at_most(value: int, cap: int) -> int:
    size = 16
    while size * 2 <= min(value, cap):
        size *= 2
    return size


def _caps(n: int, k: int) -> tuple[int, int]:
    """The largest tile sizes worth taking along N and K: their powers of two at or above."""
    return max(16, 1 << (max(n, 16) - 1).bit_length()), max(16, 1 << (max(k, 16) - 1).bit_length())


def _four_bit_tiles(block_m: int, cap_n: int, cap_k: int, group_m: int, fmt_class: str) -> triton.Tiles:
    """Words decoded as nibble pairs with the scales folded into the decoded
    tile; up to 32 rows: 256 columns of K a step; 64 and 128 rows: the decoded
    weight as the MMA's A operand (``swap_ab``), e2m1 on 128 rows with 256
    columns (its costlier decode pays for twice the reuse of x)."""
    pairs = dict(word_decode=True, fold_scales=True, pair_decode=True)
    if block_m <= 32:
        return triton.Tiles(block_m, min(128, cap_n), min(256, cap_k), 4, 3, **pairs)
    warps = 8 if block_m == 128 else 4
    block_n = min(256 if block_m == 128 and fmt_class == "fp4" else 128, cap_n)
    return triton.Tiles(block_m, block_n, min(128, cap_k), warps, 3, swap_ab=True, group_m=group_m, **pairs)


def triton_tiles(rows: int, n: int, k: int, fmt_class: str = "16bit") -> triton.Tiles:
    """The Triton tile for experts of ``rows`` rows."""
    block_m = _pow2_at_most(max(rows, 16), 128)
    cap_n, cap_k = _caps(n, k)
    # An expert whose weight outgrows L2 and whose rows span several row tiles
    # is read once per row tile unless the programs run in bands.
    weight_bytes = n * k * {"16bit": 2.0, "8bit": 1.0}.get(fmt_class, 0.5)
    group_m = 8 if weight_bytes > LARGE_EXPERT_BYTES and rows > 2 * block_m else 1
    if fmt_class in ("4bit", "fp4"):
        return _four_bit_tiles(block_m, cap_n, cap_k, group_m, fmt_class)
    if block_m == 128:
        return triton.Tiles(128, min(256, cap_n), min(64, cap_k), num_warps=8, num_stages=4, group_m=group_m)
    block_n = min(64 if block_m <= 32 else 128, cap_n)
    block_k = min(128 if block_m <= 32 else 64, cap_k)
    return triton.Tiles(block_m, block_n, block_k, num_warps=4, num_stages=3)


def quantized_input_tiles(rows: int, n: int, k: int, fmt_class: str) -> triton.Tiles:
    """The Triton tile for inputs quantized with a scale (W8A8, W4A8, …): a
    scale that multiplies each span's product keeps a second accumulator live,
    so prefill takes 64-row tiles; 8-bit weights at decode take 256 columns of
    K a step, and from 32 rows per expert the 64-row tile (a warpgroup MMA
    reads 64 rows: half-empty, it still beats two 32-row tiles). 4-bit weights
    at decode take the weight-only tile; from 32 rows per expert, with e4m3 /
    e5m2 inputs, integer codes keep their scales out of the tile so that the
    product runs on the input's 8-bit operands (folded scales put it on 16-bit
    ones); with int8 inputs (whose integer products lose to the folded 16-bit
    ones) and for e2m1 codes (read as nibble pairs, which fold) the folded tile
    — e2m1 codes at 32 rows with e4m3 / e5m2 inputs multiplied out too."""
    block_m = _pow2_at_most(max(rows, 16), 64)
    cap_n, cap_k = _caps(n, k)
    weight_class = fmt_class.split("-")[0]
    four_bit = weight_class in ("4bit", "fp4")
    float_product = fmt_class == "4bit-a8"  # integer codes x e4m3/e5m2 on 8-bit operands
    if four_bit and block_m < (32 if float_product else 64):
        tiles = _four_bit_tiles(block_m, cap_n, cap_k, 1, weight_class)
        # e4m3/e5m2 inputs (16 rows; e2m1 codes 32 too): the input multiplied out to bf16 first,
        # then the weight-only product, with no promotion per input-scale span.
        return dataclasses.replace(tiles, dequantize_input=True) if fmt_class.endswith("-a8") else tiles
    if block_m < 32:
        return triton.Tiles(block_m, min(64, cap_n), min(256, cap_k), 4, 3)
    pairs = dict(word_decode=True, pair_decode=True)
    if float_product:
        return triton.Tiles(64, min(128, cap_n), min(128, cap_k), 4, 3, swap_ab=True, **pairs)
    if four_bit:
        return triton.Tiles(block_m, min(128, cap_n), min(128, cap_k), 4, 3, swap_ab=True, fold_scales=True, **pairs)
    return triton.Tiles(64, min(128, cap_n), min(128, cap_k), 4, 4)


def for_block(tiles: triton.Tiles, block_size: int) -> triton.Tiles:
    """A tile of an indexed layout is one alignment block; blocks under 16 rows
    take f32 multiply-adds (an MMA would mostly multiply padding), with the
    scales applied after the product (exact). A block no tile can be (not a
    power of two) leaves the tile as it is, for the kernel to refuse."""
    if block_size < 1 or block_size & (block_size - 1):
        return tiles
    small = block_size < 16
    return dataclasses.replace(
        tiles,
        block_m=block_size,
        swap_ab=tiles.swap_ab and not small,
        fold_scales=tiles.fold_scales and not small,
        use_mma=not small,
        pair_decode=tiles.pair_decode and not small,
    )


def indexed_fp8_tiles(fmt_class: str, rows: int, k: int, block_size: int | None, byte_pairs: bool) -> list:
    """The fp8 Mosaic kernel's tiling for an indexed layout (a tile is one
    block: ``block_size`` rows, None: its choice), or none: W8A8 from
    :data:`FP8_INDEXED_MIN_ROWS` with K of at least :data:`FP8_INDEXED_MIN_K`,
    or where the Triton tile would read the weight as ``byte_pairs`` (64-row
    blocks); W4A8 from :data:`MX_MOSAIC_MIN_ROWS` below
    :data:`DECODE_MOSAIC_MIN_ROWS` (:data:`MX_FP8_SWAP`), and above it where
    the caller's block is 64 rows (:data:`DECODE_MOSAIC`'s tile is 128)."""
    if fmt_class == "fp4-a8" and MX_MOSAIC_MIN_ROWS <= rows < DECODE_MOSAIC_MIN_ROWS and block_size in (None, 64):
        return [MX_FP8_SWAP]
    if fmt_class == "fp4-a8" and rows >= DECODE_MOSAIC_MIN_ROWS and block_size == 64:
        return [mosaic_fp8.Tiles(64, 256, stages=4, group_m=8)]
    long_k = rows >= FP8_INDEXED_MIN_ROWS and k >= FP8_INDEXED_MIN_K
    if fmt_class == "8bit-a8" and (long_k or byte_pairs) and block_size in (None, 64):
        return [mosaic_fp8.Tiles(64, 256, stages=4, group_m=8)]
    return []


def heuristic_candidates(
    rows: int,
    n: int,
    k: int,
    fmt: F.WeightFormat,
    block_size: int | None = None,
    half_bits: bool = False,
    input_dtype: str | None = None,
    num_experts: int = 1,
    indexed: bool = False,
    total_rows: int | None = None,
) -> list:
    """In order: the 16-bit Mosaic kernel decoding planar 4-bit codes
    (:data:`DECODE_MOSAIC`, from :data:`DECODE_MOSAIC_MIN_ROWS` rows an expert;
    below, grouped, :data:`MID_48` / :data:`MID_64` with many experts, :data:`PAIR_48` with few),
    then for 4-bit integer weights it does not decode itself (K order, float zero
    points, other groups: its ``supports`` refuses them) the same kernel after a
    dequantize pass (at least :data:`DEQUANTIZE_MIN_ROWS` rows an expert), or the fp8 Mosaic kernel (8-bit
    weights with e4m3/e5m2 inputs, :data:`FP8_MOSAIC_MIN_ROWS`; planar MXFP4
    weights with them, :data:`MX_MOSAIC_MIN_ROWS`, behind :data:`MID_48` / :data:`MID_64`
    on the input multiplied out where experts are many; indexed layouts:
    :func:`indexed_fp8_tiles`), or for W4A8 the 16-bit Mosaic kernel decoding
    MXFP4 (:data:`DECODE_MOSAIC_MIN_ROWS`), its input
    multiplied out, indexed layouts included — ahead of it, from
    :data:`E4M3_COPY_MIN_ROWS` (indexed: :data:`E4M3_COPY_MIN_ROWS_INDEXED`),
    W4A8 through an e4m3 copy of the weight, :data:`E4M3_COPY`), then the
    Triton tile (which takes every call). ``block_size``: an indexed layout's block (None with
    ``indexed``: the block is to be chosen from the first candidate).
    ``half_bits``: weights the Triton decoder reads as nibble pairs only.
    ``input_dtype``: a quantized input's values (:func:`quantized_input_tiles`).
    ``num_experts``: the weight's experts (its size); ``total_rows``: the
    call's rows in all (None: ``rows`` times ``num_experts``)."""
    fmt_class = format_class(fmt, input_dtype)
    indexed = indexed or block_size is not None
    found = []
    # an indexed layout's given block is the tile's rows; else the rows fit the experts'
    decode = decode_tiles(rows, num_experts) if block_size is None else decode_block_tile(block_size)
    decode_mosaic = rows >= DECODE_MOSAIC_MIN_ROWS and decode is not None
    if fmt_class in ("4bit", "fp4") and decode_mosaic:
        found.append(decode)
    # one mid tile an expert where it holds the rows (many experts), else the 128-row one
    mid = next((t for t in (MID_48, MID_64) if rows <= t.block_m), None) if num_experts >= MID_MIN_EXPERTS else None
    mid_rows = fmt_class in ("4bit", "fp4") and not indexed and MID_MIN_ROWS <= rows < DECODE_MOSAIC_MIN_ROWS
    if mid_rows and num_experts >= MID_MIN_EXPERTS:
        found.append(mid or DECODE_MOSAIC)
    elif mid_rows and num_experts > 1 and rows <= PAIR_48.block_m:
        found.append(PAIR_48)
    if fmt_class == "4bit" and rows >= DEQUANTIZE_MIN_ROWS and not indexed:
        found.append(mosaic.Tiles(128, 256, 64, stages=3, group_m=8, dequantize_first=True))
    total_rows = rows * num_experts if total_rows is None else total_rows
    byte_pairs = triton.offsets_wrap(num_experts * n * k, 1) and total_rows >= BYTE_PAIRS_MOSAIC_MIN_M
    if fmt_class == "8bit-a8" and (rows >= FP8_MOSAIC_MIN_ROWS or byte_pairs) and not indexed:
        found.append(mosaic_fp8.Tiles(64, 256, stages=4, group_m=8))
    copy_fits = num_experts * n * k <= E4M3_COPY_MAX_BYTES
    copy_rows = E4M3_COPY_MIN_ROWS_INDEXED if indexed else E4M3_COPY_MIN_ROWS
    copy_block = block_size in (None, E4M3_COPY.block_m)
    if fmt_class == "fp4-a8" and rows >= copy_rows and copy_block and copy_fits:
        found.append(E4M3_COPY)
    if fmt_class == "fp4-a8" and decode_mosaic:
        found.append(dataclasses.replace(decode, dequantize_input=True))
    elif fmt_class == "fp4-a8" and rows >= MX_MOSAIC_MIN_ROWS and not indexed:
        # many experts of up to 64 rows: the W4A16 mid tile on the input multiplied out (qwen3's entries)
        if mid is not None:
            found.append(dataclasses.replace(mid, dequantize_input=True))
        found += [MX_FP8_SWAP, dataclasses.replace(MX_FP8_SWAP, swap_ab=False)]
    if indexed:
        found += indexed_fp8_tiles(fmt_class, rows, k, block_size, byte_pairs)
    if input_dtype is None:
        tiles = triton_tiles(rows, n, k, fmt_class)
    else:
        tiles = quantized_input_tiles(rows, n, k, fmt_class)
    if half_bits:  # the pair decoder reads whole 128-column units
        tiles = dataclasses.replace(
            tiles, block_k=max(128, tiles.block_k), word_decode=True, fold_scales=True, pair_decode=True
        )
    found.append(for_block(tiles, block_size) if block_size is not None else tiles)
    return found
