"""The Triton-lowered expert GEMM: every weight format, the four layouts,
16-bit float inputs and 8-bit quantized ones (e4m3, e5m2, int8 values with a
tensor, row or row-and-group scale).

``out[r] = x[r_in] @ dequant(w[e]).T (+ bias[e])`` on ``block_m x block_n``
output tiles. The layout decides which rows a tile covers and which expert it
multiplies (``_tile_rows``; slot blocks marked ``tile_by_expert``: a tile an
expert, its rows found in the ids by each program); the weight format how a
weight tile enters the product (``_weight_pieces``: raw values exact in the
compute dtype, 4-bit codes decoded one nibble position a piece, scales on
each span of K that shares one, or folded into the weight with
``fold_scales``). The grid is a static bound on
the tiles (no host sync when the routing changes); rows no expert owns are
written as zeros by the kernel itself. ``split_k > 1`` writes f32 partials
that are summed in a fixed order. Quantized inputs meet the weight on the fp8
tensor cores where both operands are exact in e4m3 (:func:`operand_dtype`),
else as exact bf16/f16 values; a group scale multiplies each span's product,
a row or tensor scale the sum. Tiling: :class:`Tiles`; what it cannot take:
:func:`supports`. Design and measurements: docs/DESIGN.md, benchmarks/notes/gemm.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import activation, codecs, word_decode
from pallas_kernels.gemm.fp8_dot import fp8_dot
from pallas_kernels.gemm.spec import EpilogueActivation, GemmCall, LayoutSpec, WeightSpec, XScale, tile_order
from pallas_kernels.indexing import nonneg_div, nonneg_rem


def _power_of_two(value, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
        raise ValueError(f"triton.Tiles.{name}: expected a power of two, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The Triton-lowered kernel's tiling: ``block_m x block_n`` output tiles
    over ``block_k`` steps (powers of two, at least 16 — one MMA — except
    ``block_m`` without MMAs), ``num_warps``, ``num_stages`` (cp.async
    pipeline depth), ``split_k`` partial sums over K."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    swap_ab: bool = False  # out.T = w @ x.T: the decoded weight tile is the MMA's A operand
    group_m: int = 1  # row tiles per band of the program order (tile_order)
    word_decode: bool = False  # packed weights read as uint32 words of 8 codes (nibbles_per_unit)
    # Scales multiply the decoded weight tile before the product (one MMA chain a K tile);
    # integer formats then round (q - z) * s once to the compute dtype, as Marlin does.
    fold_scales: bool = False
    use_mma: bool = True  # False: f32 multiply-adds on the CUDA cores (row tiles of 1-8 rows)
    # Word-decoded pieces pair nibbles j and j+4 of a word as consecutive K (4
    # pieces of span/4 columns): each decoded register is an MMA k-pair as it is.
    pair_decode: bool = False
    # A scaled input (fp8, int8, fp4 values with their scales) is multiplied out to bf16
    # (one rounding an element) by the op before this kernel, which then runs the
    # weight-only product: at decode, no promotion per input-scale span.
    dequantize_input: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps", "split_k"):
            _power_of_two(getattr(self, name), name)
        for name in ("num_stages", "group_m"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"triton.Tiles.{name}: expected a positive int, got {value!r}")
        for name in ("block_m", "block_n", "block_k") if self.use_mma else ("block_n", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"triton.Tiles.{name}: expected at least 16, got {getattr(self, name)}")
        if not self.use_mma and (self.block_m > 8 or self.swap_ab):
            raise ValueError(
                "triton.Tiles.use_mma: False is for row tiles of at most 8 rows without swap_ab, "
                f"got block_m={self.block_m}, swap_ab={self.swap_ab}"
            )
        if self.num_warps > 32:
            raise ValueError(f"triton.Tiles.num_warps: expected at most 32, got {self.num_warps}")
        if self.pair_decode and not self.word_decode:
            raise ValueError("triton.Tiles.pair_decode: pairs the nibbles of decoded words, needs word_decode=True")


FLOAT_INPUTS = ("bfloat16", "float16")
QUANTIZED_INPUTS = ("float8_e4m3fn", "float8_e5m2", "int8")  # stored values of a scaled input
# Weight values exact in e4m3 (e2m1 times 2**-6, int4 codes minus 8).
FP8_EXACT_WEIGHTS = ("float8_e4m3", "float4_e2m1", "int4")
INT8_EXACT_WEIGHTS = ("int8", "int4")  # int4 codes minus 8
FP8_MIN_K = 32  # the K of one 8-bit MMA
X_SHIFT = {"float8_e4m3fn": 8, "float8_e5m2": 15, "int8": 7}  # shifted, each dtype's values stay under 2


def supports(tiles: Tiles, call: GemmCall) -> str | None:
    """Why this kernel cannot run ``call`` with ``tiles`` (None if it can)."""
    if tiles.dequantize_input:
        if call.input_quant == "none":
            return "dequantize_input with an unquantized input (nothing to dequantize)"
        call = call.with_dequantized_input()
    w, layout, xs = call.weight, call.layout, call.x_scale
    if call.x_dtype not in FLOAT_INPUTS + QUANTIZED_INPUTS:
        return f"{call.x_dtype} inputs (bfloat16, float16, or e4m3/e5m2/int8 values with a scale)"
    if call.x_dtype in QUANTIZED_INPUTS and xs.mode == "none":
        return f"{call.x_dtype} inputs without a scale ({call.input_quant})"
    if xs.mode not in ("none", "tensor", "token", "group") or xs.scale_type not in ("float32", "e8m0"):
        return f"an input scale {xs} (tensor, token or group; float32 or e8m0)"
    if xs.mode == "group":
        if xs.group_size < 16 or xs.group_size & (xs.group_size - 1):
            return f"input groups of {xs.group_size} (a power of two, at least 16: one MMA)"
        operand = operand_dtype(call, tiles)
        span = scale_span(w, tiles, operand, xs.group_size)
        pieces = _pieces_per_span(w, tiles, operand, xs.group_size)
        if span // pieces < 16:
            return f"input groups of {xs.group_size}: spans of {span} columns in {pieces} pieces (16+ a product)"
    if layout.kind == "indexed":
        if layout.block_size & (layout.block_size - 1):
            return f"an indexed block_size of {layout.block_size} (a power of two)"
        if tiles.block_m != layout.block_size:
            return f"block_m={tiles.block_m} on an indexed layout of block_size {layout.block_size} (a tile is a block)"
        if layout.block_size < 16 and (tiles.use_mma or tiles.swap_ab or tiles.fold_scales or tiles.pair_decode):
            return "blocks under 16 rows: use_mma, swap_ab, fold_scales and pair_decode off (f32 multiply-adds)"
    if call.batch_invariant and tiles.split_k > 1:
        return f"split_k={tiles.split_k} with batch_invariant (a fixed K order needs split_k=1)"
    if w.half_bits and not (tiles.word_decode and tiles.pair_decode and tiles.fold_scales and tiles.block_k >= 128):
        return "half-bits e2m1 weights (read as nibble pairs: word_decode, pair_decode, fold_scales, block_k >= 128)"
    if w.half_bits and xs.mode == "group" and xs.group_size < 128:
        return f"half-bits e2m1 weights with input groups of {xs.group_size} (read in spans of 128+ columns)"
    if call.x_dtype in QUANTIZED_INPUTS and offsets_wrap(layout.m_in * w.k, 1):
        return f"8-bit inputs of {layout.m_in} x {w.k} (over 2**31 bytes: the lowering's 32-bit offsets wrap)"
    ways = nibbles_per_unit(w, tiles, operand_dtype(call, tiles), xs.group_size if xs.mode == "group" else 0)
    if w.packed and ways == 2 and offsets_wrap(w.num_experts * w.n * w.k // 2, 1):
        return "4-bit codes read as bytes from over 2**31 of them (the lowering's 32-bit offsets wrap): word_decode"
    if reads_byte_pairs(w) and w.k % 2:
        return f"8-bit weights of over 2**31 values with an odd K={w.k} (read as byte pairs)"
    return activation_refusal(tiles, call) if call.activation is not None else None


def activation_refusal(tiles: Tiles, call: GemmCall) -> str | None:
    """Why a tile cannot apply ``call.activation`` in its epilogue (None if it can)."""
    act = call.activation
    if call.out_quant != "none":
        return f"a {call.out_quant} output (a tile holds a fraction of an output group)"
    if tiles.split_k > 1:
        return f"the activation {act.kind!r} with split_k={tiles.split_k} (it applies to whole sums)"
    if act.gated and not act.pair_block:
        return (
            f"the activation {act.kind!r} on gate and up halves (a tile holds both halves of its outputs "
            "only when the weight interleaves them: formats.interleave_gate_up)"
        )
    pair = 2 * act.pair_block
    if act.gated and tiles.block_n % pair and pair % tiles.block_n:
        return f"the activation {act.kind!r}: block_n={tiles.block_n} cuts gate/up blocks of {act.pair_block} rows"
    return None


def gate_up_split(act: EpilogueActivation, block_n: int) -> int:
    """Columns of each gate (then up) run in a tile of ``block_n`` columns: the
    weight's block, or half the tile where a tile holds half a block pair (the
    program then reads its gate rows and the up rows ``pair_block`` further)."""
    return min(act.pair_block, block_n // 2)


def _sixteen_bits(call: GemmCall):
    """The 16-bit operand dtype of a call: the input's, or for a quantized
    input f16 when the output is f16, else bf16 (8-bit values are exact in both)."""
    if call.x_dtype in FLOAT_INPUTS:
        return jnp.dtype(call.x_dtype)
    return jnp.dtype(jnp.float16 if call.out_dtype == "float16" else jnp.bfloat16)


def operand_dtype(call: GemmCall, tiles: Tiles):
    """The dtype both MMA operands take: e4m3 (the fp8 tensor cores, f32
    promotions: :mod:`fp8_dot`) for e4m3 inputs with weights whose values are
    exact in e4m3, int8 (int32 sums) for int8 inputs with int8 or int4
    weights — scaled after the product in spans of at least one 8-bit MMA;
    else 16 bits (:func:`_sixteen_bits`), every quantized value converted
    exactly."""
    w = call.weight
    eight_bit = {"float8_e4m3fn": (jnp.float8_e4m3fn, FP8_EXACT_WEIGHTS), "int8": (jnp.int8, INT8_EXACT_WEIGHTS)}
    if call.x_dtype not in eight_bit or w.zero_point != "none":
        return _sixteen_bits(call)
    operand, exact_weights = eight_bit[call.x_dtype]
    operand = jnp.dtype(operand)
    if w.value_type not in exact_weights or not tiles.use_mma or call.use_f16_accum:
        return _sixteen_bits(call)
    if shifts_e2m1(w, tiles, operand):
        return operand
    if scales_in_weights(w, tiles, operand):
        return _sixteen_bits(call)
    x_group = call.x_scale.group_size if call.x_scale.mode == "group" else 0
    span = scale_span(w, tiles, operand, x_group)
    if span // _pieces_per_span(w, tiles, operand, x_group) < FP8_MIN_K:
        return _sixteen_bits(call)
    return operand


# JAX 0.11's Triton lowering indexes an array of at most 2**32 bytes with signed
# 32-bit element offsets: past 2**31 elements (8-bit arrays of 2-4 GiB) they wrap.
WRAPPING_ELEMENTS = 2**31


def offsets_wrap(elements: int, itemsize: int) -> bool:
    """Whether the lowering's element offsets into an array of ``elements``
    items of ``itemsize`` bytes wrap (see :data:`WRAPPING_ELEMENTS`)."""
    return elements > WRAPPING_ELEMENTS and elements * itemsize <= 2**32


def reads_byte_pairs(w: WeightSpec) -> bool:
    """Whether unpacked 8-bit weight values are read as uint16 pairs (their
    offsets wrap as bytes): the even and odd columns of a span are two pieces."""
    return not w.packed and w.quantized and offsets_wrap(w.num_experts * w.n * w.k, 1)


def _pieces_per_span(w: WeightSpec, tiles: Tiles, compute_dtype, x_group: int = 0) -> int:
    """Weight pieces (products) per span: one unpacked (two read as byte
    pairs), else one per nibble position (pairs: per pair of positions)."""
    if not w.packed:
        return 2 if reads_byte_pairs(w) else 1
    ways = nibbles_per_unit(w, tiles, compute_dtype, x_group)
    return ways // 2 if decodes_pairs(w, tiles, compute_dtype, x_group) else ways


def num_col_groups(n: int, tiles: Tiles) -> int:
    """Programs along N."""
    return pl.cdiv(n, tiles.block_n)


def num_row_tiles(layout: LayoutSpec, num_experts: int, block_m: int) -> int:
    """Static upper bound on the row tiles of a layout."""
    if layout.kind == "dense":
        return pl.cdiv(layout.m_in, block_m)
    if layout.kind == "grouped_contiguous":
        # At most min(E, M) experts hold rows; each takes one tile plus one per
        # further block_m rows (T=1 on 128 experts: 8 row tiles, not 129).
        # One more than the work can take: as many row tiles as chunks of
        # the rows outside every group (at most cdiv(M, bm) + 1), each zeroed
        # by its row tile (_zero_gap_chunk).
        busy = min(num_experts, layout.m_in)
        return busy + (layout.m_in - busy) // block_m + 1
    if layout.kind == "grouped_masked":
        return num_experts * pl.cdiv(layout.max_tokens, block_m)
    if layout.tile_by_expert:  # one an expert and level, then one zeroing the invalid slots' rows
        return num_experts * expert_levels(layout) + 1
    return layout.num_blocks


def gap_chunk_rows(first: jax.Array, last: jax.Array, m_out: int, block_m: int, chunk):
    """(rows [bm], keep [bm]) of chunk ``chunk`` of the rows outside every group,
    ``[0, first)`` then ``[last, m_out)``, in chunks of ``block_m`` (a chunk
    never spans both ranges)."""
    lane = jnp.arange(block_m, dtype=jnp.int32)
    head_chunks = (first + block_m - 1) // block_m
    in_head = chunk < head_chunks
    start = jnp.where(in_head, chunk * block_m, last + (chunk - head_chunks) * block_m)
    rows = start + lane
    return rows, rows < jnp.where(in_head, first, m_out)


def _masked_tile_rows(counts_ref, layout: LayoutSpec, num_experts: int, block_m: int, tile, lane):
    """:func:`_tile_rows` of the grouped-masked layout: the row tiles that hold
    rows first (each expert's in turn), then those past every count, which
    only store zeros — so the programs with work start in the grid's first
    waves, not spread among the empty experts' (a decode step fills a few
    experts of many)."""
    per_expert = pl.cdiv(layout.max_tokens, block_m)
    width = max(16, pl.next_power_of_2(num_experts))
    experts = jnp.arange(width, dtype=jnp.int32)
    in_range = experts < num_experts
    counts = jnp.clip(plgpu.load(counts_ref.at[experts], mask=in_range, other=0), 0, layout.max_tokens)
    busy = jnp.where(in_range, (counts + block_m - 1) // block_m, 0)
    busy_total = jnp.sum(busy)
    is_busy = tile < busy_total
    lengths = jnp.where(is_busy, busy, jnp.where(in_range, per_expert - busy, 0))
    index = jnp.where(is_busy, tile, tile - busy_total)
    ends = jnp.cumsum(lengths)
    expert = jnp.minimum(jnp.sum((ends <= index).astype(jnp.int32)), num_experts - 1)
    mine = experts == expert
    local_tile = index - jnp.sum(jnp.where(mine, ends - lengths, 0))
    local_tile += jnp.where(is_busy, 0, jnp.sum(jnp.where(mine, busy, 0)))
    count = jnp.sum(jnp.where(mine, counts, 0))
    local = local_tile * block_m + lane
    rows = expert * layout.max_tokens + local
    return rows, rows, local < count, expert, local_tile * block_m < count


def _tile_rows(route_refs, layout: LayoutSpec, num_experts: int, block_m: int, tile):
    """(rows_in [bm], rows_out [bm], row_mask [bm], expert, live) of row tile ``tile``."""
    lane = jnp.arange(block_m, dtype=jnp.int32)
    if layout.kind == "dense":
        rows = tile * block_m + lane
        return rows, rows, rows < layout.m_in, jnp.int32(0), tile >= 0
    if layout.kind == "grouped_contiguous":
        (offsets_ref,) = route_refs
        width = max(16, pl.next_power_of_2(num_experts))
        experts = jnp.arange(width, dtype=jnp.int32)
        in_range = experts < num_experts
        starts = plgpu.load(offsets_ref.at[experts], mask=in_range, other=0)
        ends = plgpu.load(offsets_ref.at[experts + 1], mask=in_range, other=0)
        tiles = jnp.where(in_range, (ends - starts + block_m - 1) // block_m, 0)
        tile_ends = jnp.cumsum(tiles)
        expert = jnp.minimum(jnp.sum((tile_ends <= tile).astype(jnp.int32)), num_experts - 1)
        mine = experts == expert
        first_tile = jnp.sum(jnp.where(mine, tile_ends - tiles, 0))
        row_start = jnp.sum(jnp.where(mine, starts, 0))
        row_end = jnp.sum(jnp.where(mine, ends, 0))
        rows = row_start + (tile - first_tile) * block_m + lane
        live = tile < jnp.sum(tiles)
        return rows, rows, rows < row_end, expert, live
    if layout.kind == "grouped_masked":
        return _masked_tile_rows(route_refs[0], layout, num_experts, block_m, tile, lane)
    if layout.slot_order:  # block b holds slot b alone
        (experts_ref,) = route_refs
        expert = experts_ref[tile]
        entries = jnp.where(lane == 0, tile, layout.m_out)
        live = (expert >= 0) & (expert < num_experts)
        return entries // layout.top_k, entries, lane == 0, jnp.clip(expert, 0, num_experts - 1), live
    sorted_ref, experts_ref, padded_ref = route_refs
    positions = tile * block_m + lane
    entries = plgpu.load(sorted_ref.at[positions], mask=positions < sorted_ref.shape[0], other=layout.m_out)
    expert = experts_ref[tile]
    mask = (entries >= 0) & (entries < layout.m_out)
    live = (tile * block_m < padded_ref[0]) & (expert >= 0) & (expert < num_experts)
    return entries // layout.top_k, entries, mask, jnp.clip(expert, 0, num_experts - 1), live


def expert_levels(layout: LayoutSpec) -> int:
    """Row tiles an expert of a ``tile_by_expert`` layout: one where a token's
    slots read one input row (w13's ``top_k = k``: a row computed once, stored
    to each of the token's slots on the expert), else ``k`` — level d holds
    each token's d-th slot on the expert (past level 0 only where a token
    lists an expert twice)."""
    return 1 if layout.top_k == layout.tile_by_expert else layout.tile_by_expert


def _token_slot_ids(experts_ref, layout: LayoutSpec, block_m: int) -> list:
    """Each slot j's expert id ``[bm]`` of the tokens ``lane`` (j < k; −1 past
    the tokens) of a ``tile_by_expert`` layout, whose expert_ids are the ids
    ``[T, k]`` flattened."""
    k = layout.tile_by_expert
    lane = jnp.arange(block_m, dtype=jnp.int32)
    is_token = lane < layout.m_out // k
    return [plgpu.load(experts_ref.at[lane * k + j], mask=is_token, other=-1) for j in range(k)]


def _by_expert_rows(ids: list, layout: LayoutSpec, num_experts: int, tile):
    """(rows_in, the outputs — ``(rows_out, mask)`` pairs —, row_mask,
    expert, live) of row tile ``tile = d · E + e`` of a ``tile_by_expert``
    layout (``ids``: :func:`_token_slot_ids`): level d of expert e
    (:func:`expert_levels`); tiles past the levels are never live."""
    k = len(ids)
    lane = jnp.arange(ids[0].shape[0], dtype=jnp.int32)
    expert = nonneg_rem(tile, num_experts)
    if expert_levels(layout) == 1:  # the token's row once, stored to each of its slots on the expert
        on = [i == expert for i in ids]
        row_mask = functools.reduce(jnp.logical_or, on)
        rows_in, outs = lane, tuple((lane * k + j, m) for j, m in enumerate(on))
    else:
        rows_in, rows_out, row_mask = _expert_level_rows(ids, expert, nonneg_div(tile, num_experts), layout)
        outs = ((rows_out, row_mask),)
    live = (tile < num_experts * expert_levels(layout)) & (jnp.max(row_mask.astype(jnp.int32)) > 0)
    return rows_in, outs, row_mask, expert, live


def _invalid_slot_rows(ids: list, layout: LayoutSpec, num_experts: int) -> list:
    """``(rows, keep)`` ``[bm]`` pairs of a ``tile_by_expert`` layout's slots
    (``ids``: :func:`_token_slot_ids`) whose ids are outside ``[0, E)``: the
    rows no expert's tile writes."""
    lane = jnp.arange(ids[0].shape[0], dtype=jnp.int32)
    is_token = lane < layout.m_out // len(ids)
    return [(lane * len(ids) + j, is_token & ((i < 0) | (i >= num_experts))) for j, i in enumerate(ids)]


def _expert_level_rows(ids: list, expert, level, layout: LayoutSpec):
    """(rows_in, rows_out, row_mask) ``[bm]`` of ``level`` of expert
    ``expert``'s row tile on a ``tile_by_expert`` layout: each token's
    ``level``-th slot on the expert (level 0 but for a token that lists the
    expert twice), read from input row ``slot // top_k``."""
    k = len(ids)
    block_m = ids[0].shape[0]
    lane = jnp.arange(block_m, dtype=jnp.int32)
    seen = jnp.zeros(block_m, jnp.int32)
    column = jnp.zeros(block_m, jnp.int32)
    for j in range(k):
        on_expert = ids[j] == expert
        column = jnp.where(on_expert & (seen == level), j, column)
        seen += on_expert.astype(jnp.int32)
    row_mask = seen > level
    slots = jnp.where(row_mask, lane * k + column, layout.m_out)
    return slots // layout.top_k, slots, row_mask


# e2m1 code bits placed in an e4m3 byte decode (in hardware, subnormals
# included) to the e2m1 value times 2**-6, as the word decoder's do; the 2**6
# joins the scale.
E2M1_DECODE_FACTOR = 1.0 / word_decode.E2M1_FACTOR
# With the scales folded into bf16 e2m1 weights, the folded weight is the true
# one times 2**-E2M1_FOLDED_EXPONENT and the sum is multiplied back once (the
# exponent offset split between main loop and epilogue, as Humming does): on
# the GPU the word decoder then needs no normalizing multiply (its raw values
# times 2**64 in the scale). Exact for scales up to 2**63 (MXFP4 e8m0 bytes
# up to 190, checked when a weight is loaded) and products down to bf16's
# normal range.
E2M1_FOLDED_EXPONENT = 62


def _storage_bits(raw, dtype):
    """Loaded uint8 storage of an 8-bit float (fp8 arrays travel as uint8: the
    lowering cannot fill masked fp8 lanes) back to its float type."""
    return jax.lax.bitcast_convert_type(raw, dtype)


def _decode_scale(raw, scale_type: str, exponent: int = 0, nan: bool = True):
    """Stored scales as f32, times ``2**exponent`` (e8m0: by the exponent alone;
    byte 255 is NaN unless ``nan`` is False)."""
    if scale_type == "e8m0":
        return codecs.e8m0_decode(raw, exponent, nan)
    if scale_type == "float8_e4m3":
        scale = _storage_bits(raw, jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        scale = raw.astype(jnp.float32)
    return scale if exponent == 0 else scale * jnp.float32(2.0**exponent)


def scales_in_weights(w: WeightSpec, tiles: Tiles, compute_dtype) -> bool:
    """Whether the scales multiply the weight elements before the product
    (instead of the ``[bm, bn]`` partial product of each scale span):

    * act-order (``group_index``): every column has its own group;
    * groups narrower than one MMA (NVFP4's 16 would make products of K=8);
    * MX and NV formats in bf16 on row tiles of 64+: an e2m1/e4m3 value times
      an e8m0/e4m3 scale has at most 7 significant bits, so the scaled weight
      is exact in bf16, and one product per K tile keeps the MMAs chained
      (decode tiles are cheaper scaling the partial products);
    * ``tiles.fold_scales``: any scaled format (integer ones round once).
    Except for the narrow groups and folded scales of integer formats,
    nothing rounds.
    """
    if w.has_group_index:
        return True
    if w.scale == "none":
        return False
    if tiles.fold_scales:
        return True
    exact = (
        w.value_type in ("float4_e2m1", "float8_e4m3")
        and w.scale_type in ("e8m0", "float8_e4m3")
        and jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16)
    )
    narrow = w.scale in ("group", "block") and min(tiles.block_k, w.group_size) < (32 if w.packed else 16)
    return narrow or (exact and tiles.block_m >= 64)


def scale_span(w: WeightSpec, tiles: Tiles, compute_dtype, x_group: int = 0) -> int:
    """Columns of K that share one scale (and zero point) inside a K tile: the
    width of one product, whose ``[bm, bn]`` result the scale multiplies
    (``x_group``: the input's scale groups, 0 if it has none)."""
    span = tiles.block_k
    if w.scale in ("group", "block") and not scales_in_weights(w, tiles, compute_dtype):
        span = min(span, w.group_size)
    return min(span, x_group) if x_group else span


def folds_e2m1(w: WeightSpec, tiles: Tiles, compute_dtype) -> bool:
    """Whether e2m1 weights are multiplied by their scales in bf16 before the
    product (the shared scale tile of folded scales), so the sum carries
    ``2**-E2M1_FOLDED_EXPONENT`` (see there)."""
    return (
        w.value_type == "float4_e2m1"
        and jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16)
        and scales_in_weights(w, tiles, compute_dtype)
        and _scales_exact_in(w, compute_dtype)
        and tiles.use_mma
    )


# Shifted e2m1 (see shifts_e2m1): group g of a span decodes to the e4m3 bytes of
# e2m1 x 2**(s_g - s_max + E2M1_SHIFT_EXPONENT); the exponent keeps the largest
# value (6 x 2**6 = 384) under e4m3's 448 and gaps of up to 14 exact (2**-9,
# the smallest e4m3 subnormal, is 0.5 x 2**(6 - 14)). Larger gaps round to nearest.
E2M1_SHIFT_EXPONENT = 6
E2M1_SHIFT_MIN_GAP = -24  # gaps clamped here keep the f16 factor normal (all such values round to 0 in e4m3)


def shifts_e2m1(w: WeightSpec, tiles: Tiles, compute_dtype) -> bool:
    """Whether MXFP4 weights (e2m1, e8m0 group scales) meet e4m3 operands with
    their scales folded relative to the span: each span's largest group scale
    ``2**s_max`` multiplies its product (as a block scale does), and the codes
    of group g enter the fp8 product as e2m1 x 2**(s_g - s_max) (times
    2**E2M1_SHIFT_EXPONENT, taken off the sum) — exact while the gap
    ``s_max - s_g`` is at most 14, else rounded to the nearest e4m3 value (an
    error under 2**-10 of the span's largest scale). Folded tiles of nibble
    pairs (``fold_scales``, ``word_decode``, ``pair_decode``) over whole groups,
    of 32+ rows: on fewer the weight's decode bounds the tile, and the e4m3
    one costs more instructions than the bf16 one."""
    return (
        jnp.dtype(compute_dtype) == jnp.dtype(jnp.float8_e4m3fn)
        and w.value_type == "float4_e2m1"
        and w.scale == "group"
        and w.scale_type == "e8m0"
        and w.zero_point == "none"
        and w.global_scale == "none"
        and not w.has_group_index
        and tiles.fold_scales
        and tiles.word_decode
        and tiles.pair_decode
        and tiles.use_mma
        and tiles.block_m >= 32
        and tiles.block_k >= 128
        and 128 % w.group_size == 0
    )


def value_factor(w: WeightSpec, folded_e2m1: bool = False, e4m3_codes: bool = False, shifted: bool = False) -> float:
    """The factor between the decoded (and, when folded, scaled) weight values
    and the stored ones (``e4m3_codes``: see :func:`decodes_e4m3_codes`;
    ``shifted``: :func:`shifts_e2m1`, the span's scale applied apart)."""
    if folded_e2m1:
        return 2.0**E2M1_FOLDED_EXPONENT
    if e4m3_codes:
        return 1.0 / word_decode.INT4_E4M3_FACTOR
    if shifted:
        return 2.0**-E2M1_SHIFT_EXPONENT
    return E2M1_DECODE_FACTOR if w.value_type == "float4_e2m1" else 1.0


def _weight_parts(weight_refs, w: WeightSpec):
    refs = list(weight_refs)
    values_ref = refs.pop(0)
    scale_ref = refs.pop(0) if w.scale != "none" else None
    zero_ref = refs.pop(0) if w.zero_point != "none" else None
    global_ref = refs.pop(0) if w.global_scale != "none" else None
    group_ref = refs.pop(0) if w.has_group_index else None
    return values_ref, scale_ref, zero_ref, global_ref, group_ref


def _all(*masks):
    """The conjunction of the masks that are not None (None: nothing to mask)."""
    masks = [m for m in masks if m is not None]
    return None if not masks else functools.reduce(jnp.logical_and, masks)


def _load(ref_at, mask):
    return plgpu.load(ref_at) if mask is None else plgpu.load(ref_at, mask=mask, other=0)


def _int_zero(zero_ref, expert, n_idx, group, n_mask):
    """Integer zero points (int32) of the given groups (two groups per byte)."""
    byte = _load(zero_ref.at[expert, n_idx, group // 2], n_mask).astype(jnp.int32)
    return (byte >> (4 * (group % 2))) & 0xF


def _scales_exact_in(w: WeightSpec, compute_dtype) -> bool:
    """Group scales (no zero point, no act-order) whose stored type converts
    exactly to the compute dtype (e8m0 and e4m3 to bf16, bf16 to bf16, …)."""
    exact = {"bfloat16": ("bfloat16", "e8m0", "float8_e4m3"), "float16": ("float16", "float8_e4m3")}
    return (
        w.scale == "group"
        and w.zero_point == "none"
        and not w.has_group_index
        and w.scale_type in exact.get(jnp.dtype(compute_dtype).name, ())
    )


def _group_runs(w: WeightSpec, k_start, width: int, ways: int, n_mask, k_masked: bool):
    """The groups of a piece of ``width`` columns of the span at ``k_start``:
    its columns fall in runs of ``run`` per group (the same runs for every
    piece of the span). Returns (groups ``[1, width // run]``, run, load mask)."""
    run = min(width, max(1, w.group_size // ways))
    groups = _floor_div(k_start, w.group_size) + jnp.arange(width // run, dtype=jnp.int32)
    group_mask = (groups < w.k // w.group_size)[None, :] if k_masked else None
    return groups[None, :], run, _all(None if n_mask is None else n_mask[:, None], group_mask)


def _along_runs(per_group, width: int, run: int):
    """``[bn, width // run]`` (one value per run) broadcast to ``[bn, width]``."""
    return jnp.broadcast_to(per_group[:, :, None], (per_group.shape[0], width // run, run)).reshape(-1, width)


def _group_scale_at(scale_ref, w: WeightSpec, expert, n, group):
    """The group scales of rows ``n`` and groups ``group`` (index arrays,
    broadcast together), in either stored order (``w.k_major_scales``)."""
    return scale_ref.at[expert, group, n] if w.k_major_scales else scale_ref.at[expert, n, group]


def _group_scale_tile(
    scale_ref, w: WeightSpec, expert, n_idx, k_start, width: int, ways: int, n_mask, k_masked, exponent: int = 0
):
    """Group scales (f32 ``[bn, width]``, times ``2**exponent``) of a piece: one
    load per run of columns."""
    groups, run, mask = _group_runs(w, k_start, width, ways, n_mask, k_masked)
    raw = _load(_group_scale_at(scale_ref, w, expert, n_idx[:, None], groups), mask)
    # Folded e2m1 scales are bounded where the weight is loaded (formats.E8M0_FOLD_MAX):
    # no byte 255 (NaN) reaches them, so they skip its compare and select.
    return _along_runs(_decode_scale(raw, w.scale_type, exponent, nan=exponent == 0), width, run)


def _span_top(scale_ref, w: WeightSpec, expert, n_idx, k_start, span: int, n_mask, k_masked):
    """The largest e8m0 group-scale byte of each row over the span at
    ``k_start`` (int32 ``[bn]``; groups past K read as byte 0)."""
    groups = _floor_div(k_start, w.group_size) + jnp.arange(span // w.group_size, dtype=jnp.int32)
    group_mask = (groups < w.k // w.group_size)[None, :] if k_masked else None
    mask = _all(None if n_mask is None else n_mask[:, None], group_mask)
    raw = _load(_group_scale_at(scale_ref, w, expert, n_idx[:, None], groups[None, :]), mask)
    return jnp.max(raw.astype(jnp.int32), axis=1)


def _shift_tile(scale_ref, w: WeightSpec, expert, n_idx, k_start, width: int, ways: int, n_mask, k_masked, top):
    """f16 ``2**(s_g - s_max + 2 * E2M1_SHIFT_EXPONENT)`` per element of a piece
    (``[bn, width]``): decoded e2m1 values (times 2**-6) times it are the
    shifted values of :func:`shifts_e2m1`; the factor is built from its bits."""
    groups, run, mask = _group_runs(w, k_start, width, ways, n_mask, k_masked)
    raw = _load(_group_scale_at(scale_ref, w, expert, n_idx[:, None], groups), mask).astype(jnp.int32)
    gap = jnp.clip(raw - top[:, None], E2M1_SHIFT_MIN_GAP, 0)
    return _along_runs(codecs.pow2(gap + 2 * E2M1_SHIFT_EXPONENT, jnp.float16, normal_only=True), width, run)


def _f16_to_e4m3(values, on_gpu: bool):
    """f16 values to e4m3, rounded to nearest even (on the GPU one ``cvt`` for
    two values; Triton's own cast goes through f32, three instructions)."""
    if not on_gpu:
        return values.astype(jnp.float8_e4m3fn)
    (bits,) = plgpu.elementwise_inline_asm(
        "cvt.rn.satfinite.e4m3x2.f16x2 $0, $1;",
        args=[values],
        constraints="=h,r",
        pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(values.shape, jnp.int8)],
    )
    return _storage_bits(bits, jnp.float8_e4m3fn)


def _group_zero_tile(zero_ref, w: WeightSpec, expert, n_idx, k_start, width: int, ways: int, n_mask, k_masked):
    """Zero points (f32 ``[bn, width]``) of a piece: one load per run of columns."""
    groups, run, mask = _group_runs(w, k_start, width, ways, n_mask, k_masked)
    if w.zero_point == "int":
        zero = _int_zero(zero_ref, expert, n_idx[:, None], groups, mask)
    else:
        zero = _load(zero_ref.at[expert, n_idx[:, None], groups], mask)
    return _along_runs(zero.astype(jnp.float32), width, run)


def _scaled_elements(values, refs, w: WeightSpec, expert, n_idx, k_start, cols, masks, ways: int):
    """``(values - zero) * scale`` per element (f32 ``[bn, len(cols)]``), the
    group of column k being ``group_index[e, k]`` (act-order) or ``k // group``."""
    scale_ref, zero_ref, group_ref = refs
    n_mask, k_mask = masks
    width, k_masked = cols.shape[0], k_mask is not None
    if not w.has_group_index:  # groups of consecutive columns: one load per run of a group
        if w.zero_point != "none":
            values = values - _group_zero_tile(zero_ref, w, expert, n_idx, k_start, width, ways, n_mask, k_masked)
        if w.scale == "group":
            tile = _group_scale_tile(scale_ref, w, expert, n_idx, k_start, width, ways, n_mask, k_masked)
            return values * tile.astype(values.dtype)
    n_col = n_idx[:, None]
    n_mask2 = None if n_mask is None else n_mask[:, None]
    mask = _all(n_mask2, None if k_mask is None else k_mask[None, :])
    if w.has_group_index:  # act-order: each column's own group
        group = _load(group_ref.at[expert, cols], k_mask)[None, :]
        if w.zero_point == "int":
            values = values - _int_zero(zero_ref, expert, n_col, group, mask).astype(jnp.float32)
        elif w.zero_point == "float":
            values = values - _load(zero_ref.at[expert, n_col, group], mask).astype(jnp.float32)
    else:
        group = (cols // max(w.group_size, 1))[None, :]
    if w.scale == "tensor":
        raw = scale_ref[expert, 0, 0]
    elif w.scale == "channel":
        raw = _load(scale_ref.at[expert, n_col, 0], None if n_mask is None else n_mask[:, None])
    elif w.scale == "block":
        raw = _load(scale_ref.at[expert, n_col // w.block_n, group], mask)
    else:
        raw = _load(_group_scale_at(scale_ref, w, expert, n_col, group), mask)
    return values * _decode_scale(raw, w.scale_type)


def _nibbles_to_values(codes, w: WeightSpec, compute_dtype, zero=None):
    """4-bit codes (uint8, low nibble) to exact compute-dtype values (e2m1: times
    2**-6; int4 to e4m3: times 2**-9, the bytes of ``int4_e4m3_program``);
    ``zero`` ([bn] int32) is subtracted from uint4 codes."""
    if jnp.dtype(compute_dtype) == jnp.dtype(jnp.float8_e4m3fn) and w.value_type == "int4":
        bits = jnp.where(codes >= 8, codes - 8, 0x88 - codes).astype(jnp.uint8)
        return _storage_bits(bits, jnp.float8_e4m3fn)
    if w.value_type == "float4_e2m1":
        bits = ((codes & 8) << 4) | ((codes & 7) << 2)
        return _storage_bits(bits, jnp.float8_e4m3fn).astype(compute_dtype)
    # int4/uint4 codes become exact values with an OR and a subtraction (no int-to-float).
    magic, base = word_decode.MAGIC[jnp.dtype(compute_dtype).name]
    values = jax.lax.bitcast_convert_type(codes.astype(jnp.int16) | magic, compute_dtype)
    offset = base + 8.0 if w.value_type == "int4" else base
    if zero is not None:
        return values - (zero.astype(jnp.float32) + offset).astype(compute_dtype)[:, None]
    return values - jnp.asarray(offset, compute_dtype)


@dataclasses.dataclass(frozen=True)
class _Piece:
    cols: jax.Array  # [c] weight columns (global K index)
    x_cols: jax.Array  # [c] the columns of x holding them (x may be stored split, see expert_gemm)
    values: jax.Array  # [bn, c] compute dtype


def nibbles_per_unit(w: WeightSpec, tiles: Tiles, compute_dtype, x_group: int = 0) -> int:
    """4-bit codes per loaded unit of a packed weight: 2 (uint8) or, with
    ``tiles.word_decode`` and spans of 128+ (so every piece keeps K >= 16), 8
    (uint32 words). The codes at position j of their unit form piece j."""
    if not w.packed:
        return 1
    if tiles.word_decode and scale_span(w, tiles, compute_dtype, x_group) % 128 == 0 and w.k % 8 == 0:
        return 8
    return 2


def decodes_pairs(w: WeightSpec, tiles: Tiles, compute_dtype, x_group: int = 0) -> bool:
    """Whether word-decoded pieces pair nibble positions j and j+4 (``tiles.pair_decode``)."""
    return tiles.pair_decode and nibbles_per_unit(w, tiles, compute_dtype, x_group) == 8


def decodes_e4m3_codes(w: WeightSpec, tiles: Tiles, compute_dtype, x_group: int = 0) -> bool:
    """Whether int4 codes read as nibble pairs decode straight to e4m3 bytes
    (``word_decode.int4_e4m3_program``, integer ops only): e4m3 operands. The
    values are q x 2**-9, the 2**9 joins the span's scale."""
    return (
        jnp.dtype(compute_dtype) == jnp.dtype(jnp.float8_e4m3fn)
        and w.value_type == "int4"
        and decodes_pairs(w, tiles, compute_dtype, x_group)
    )


def _decode_units(units, w: WeightSpec, ways: int, pairs: bool, compute_dtype, zero, on_gpu: bool, raw: bool = False):
    """The pieces (values ``[bn, c]``) of packed units ``[bn, c]``, one at a
    time (a generator: each piece is decoded just before its product, so only
    one decoded piece is live): piece j holds the codes at nibble position j
    of every unit. With ``pairs`` the units are 16-bit halves of words
    (element 2u: nibbles 0-3 of word u, 2u+1: nibbles 4-7) and piece j (0-3)
    holds nibble j of each half: nibbles j and j + 4 of word u. On the GPU,
    words (or halves) are decoded by inline PTX (``word_decode``); ``raw``:
    e2m1 values without the normalizing multiply (see E2M1_FOLDED_EXPONENT)."""
    if w.half_bits and ways != 8:
        raise ValueError("gemm: e2m1 weights in the decoder's bit order (half_bits) are read as words or halves only")
    if ways == 8 and on_gpu:
        dtype = jnp.dtype(compute_dtype).name
        if dtype == "float8_e4m3fn":  # int4 codes as e4m3 bytes (times 2**-9), four halves a call
            program = word_decode.int4_e4m3_program()
            for j in range(4):
                yield word_decode.decode_e4m3_quads(units, program, j)
            return
        if w.value_type == "float4_e2m1":  # values times 2**-6, as _nibbles_to_values (raw: 2**-126)
            bits = word_decode.E2M1_HALF_BITS if w.half_bits else word_decode.NIBBLE_BITS
            program = word_decode.e2m1_program(dtype, normalized=not raw, bits=bits)
        else:
            program = word_decode.int4_program(dtype, 8.0 if w.value_type == "int4" else 0.0)
        zero_values = None if zero is None else zero.astype(jnp.float32).astype(compute_dtype)[:, None]
        for j in range(4 if pairs else 8):
            if pairs:
                values = word_decode.decode_word_pairs(units, program, j)
            else:
                values = word_decode.decode_word_position(units, program, j)
            yield values if zero_values is None else values - zero_values
        return
    for j in range(ways // 2 if pairs else ways):
        if w.half_bits:  # code j % 4 of half j // 4 (pairs: of each half), in the decoder's bit order
            half = units if pairs else (units >> (16 * (j // 4))) & 0xFFFF
            codes = word_decode.half_code(half, j % 4)
        else:
            codes = (units >> (4 * j)) & 0xF
        yield _nibbles_to_values(codes.astype(jnp.uint8), w, compute_dtype, zero)


@dataclasses.dataclass(frozen=True)
class _SpanPlan:
    """How a span of K columns is decoded and multiplied (static)."""

    span: int
    ways: int  # nibbles per load unit of a packed weight
    in_weights: bool  # scales multiply the weight elements
    x_split: bool  # x is stored with each span's columns grouped by piece
    compute_dtype: object
    on_gpu: bool
    # Scales in the weights multiply in the compute dtype (see _scales_exact_in).
    # Only for MMA tiles: the multiply-add tiles widen the weights to f32 right
    # away, and interpreted XLA then drops the bf16 rounding in between (excess
    # precision), which the f32 multiply and cast keep.
    scale_in_compute: bool = False
    pairs: bool = False  # word pieces pair nibbles j and j+4 (Tiles.pair_decode)
    byte_pairs: bool = False  # unpacked 8-bit values read as uint16 pairs (reads_byte_pairs)
    folded_e2m1: bool = False  # see folds_e2m1
    e4m3_codes: bool = False  # see decodes_e4m3_codes
    shifted_e2m1: bool = False  # see shifts_e2m1

    @property
    def raw_e2m1(self) -> bool:
        """Folded e2m1 words decoded on the GPU without the normalizing multiply."""
        return self.folded_e2m1 and self.on_gpu and self.ways == 8

    @property
    def scale_exponent(self) -> int:
        """The power of two the folded scales carry: decoded value x scale is
        the true weight times ``2**-E2M1_FOLDED_EXPONENT``."""
        if not self.folded_e2m1:
            return 0
        decoded = word_decode.E2M1_RAW_FACTOR if self.raw_e2m1 else word_decode.E2M1_FACTOR
        return -E2M1_FOLDED_EXPONENT - round(math.log2(decoded))

    @property
    def decode_dtype(self):
        """The dtype 4-bit codes decode to: the compute dtype (e4m3 for int4
        codes read as pairs: ``e4m3_codes``), or a 16-bit float for 8-bit
        operands (then converted, exactly): f16 for e4m3 (one conversion a pair
        of values), bf16 for int8."""
        if self.e4m3_codes:
            return jnp.dtype(jnp.float8_e4m3fn)
        if jnp.dtype(self.compute_dtype) == jnp.dtype(jnp.float8_e4m3fn):
            return jnp.dtype(jnp.float16)
        if jnp.dtype(self.compute_dtype) == jnp.dtype(jnp.int8):
            return jnp.dtype(jnp.bfloat16)
        return jnp.dtype(self.compute_dtype)

    @property
    def pieces(self) -> int:
        """Pieces per span: one per nibble position of the loaded elements
        (words or bytes; pairs load the words as 16-bit halves, 4 positions),
        so also the nibbles per loaded element; byte pairs: 2)."""
        if self.byte_pairs:
            return 2
        return self.ways // 2 if self.pairs else self.ways


def _piece_columns(k_start, along, j: int, per_element: int, unit: int, span: int, div=nonneg_div, rem=nonneg_rem):
    """The K columns of piece ``j`` of the span at ``k_start``: its element a
    (a loaded unit of ``per_element`` nibbles) holds stored nibble
    ``k_start + per_element * a + j``. In K order that is the column; in the
    planar order (``unit`` > 0) nibble i of a unit holds column
    ``i // 4 + (unit / 4) * (i % 4)``. In the kernel, written with truncating
    divisions and remainders by constants (``div``, ``rem``; not jnp's floor
    forms, whose sign fix-ups hide them) so the compiler sees the runs of
    consecutive columns (a pair piece: unit/4 per unit) and vectorizes the x
    loads; NumPy's work too (:func:`piece_column_order`)."""
    if not unit:
        return k_start + per_element * along + j
    quarter = unit // 4
    per_unit = unit // per_element  # elements of a piece in one unit
    a = rem(along, per_unit) if span > unit else along  # the element's place in its unit
    if per_element == 4:  # halves (pairs): nibble j of half a
        within = a + quarter * j
    elif per_element == 8:  # words: position j of word a is nibble j % 4 of its half 2a + j // 4
        within = 2 * a + (j // 4 + quarter * (j % 4))
    else:  # bytes: byte 2h holds nibbles 0, 1 of half h, byte 2h + 1 nibbles 2, 3
        within = div(a, 2) + quarter * (2 * rem(a, 2) + j)
    if span >= unit:  # whole units: the span starts a unit
        return k_start + unit * div(along, per_unit) + within
    start = rem(k_start, unit)  # part of one unit (a multiple of the span)
    return k_start - start + div(start, 4) + within


def piece_column_order(k: int, span: int, pieces: int, unit: int) -> np.ndarray:
    """``[K rounded up to spans]``: the column each position of the split
    copy of x holds — span by span, piece by piece, the columns of the
    piece's elements (for planar weights whose pieces are not runs of
    consecutive columns: word and byte decoding)."""
    width = span // pieces
    along = np.arange(width)
    order = [
        _piece_columns(k_start, along, j, pieces, unit, span, np.floor_divide, np.remainder)
        for k_start in range(0, pl.cdiv(k, span) * span, span)
        for j in range(pieces)
    ]
    return np.concatenate(order)


def _floor_div(value, divisor: int):
    """``value // divisor`` for a non-negative ``value`` (a K offset): a shift
    (or a truncating division), not jnp's floor division, whose sign fix-up
    hides from the compiler that the result stays aligned (the weight words
    then load 4 bytes at a time instead of 16)."""
    if divisor & (divisor - 1) == 0:
        return jax.lax.shift_right_logical(value, jnp.int32(divisor.bit_length() - 1))
    return nonneg_div(value, divisor)


def _weight_pieces(refs, w: WeightSpec, expert, n_idx, k_start, plan: _SpanPlan, masks, top=None):
    """The weight columns ``k_start + [0, span)`` as pieces (yielded one at a
    time, see _decode_units) whose products with
    ``x[:, piece.x_cols]`` sum to the span's product: the values minus their
    zero point, times their scales when ``plan.in_weights``. Every quantized
    value type (int8, int4/uint4 minus an integer zero point, e4m3, e2m1) is
    exact in bf16 and f16, so otherwise nothing rounds here and the scales come
    after the product. Packed 4-bit weights give one piece per nibble position
    of their load unit (``plan.ways``): piece j holds columns j, j+ways, ...
    of the span, so no interleave is needed; with ``plan.pairs`` one piece per
    pair of positions j, j+4 (columns j, j+4, j+8, j+12, ...). ``top``: the
    span's largest scale bytes ``[bn]`` of shifted e2m1 (:func:`shifts_e2m1`)."""
    values_ref, scale_ref, zero_ref, group_ref = refs
    n_mask, k_limit = masks
    span, ways, compute_dtype = plan.span, plan.ways, plan.compute_dtype
    n_col = n_idx[:, None]
    n_mask2 = None if n_mask is None else n_mask[:, None]

    # Scales exact in the compute dtype multiply in it (one bf16x2 multiply per
    # two weights): the product of two bf16 values is exact in f32, so rounding
    # it once gives what the f32 multiply and a cast give.
    shared_scale = None  # the span's group-scale tile, the same for each of its pieces

    def finish(piece: _Piece) -> _Piece:
        nonlocal shared_scale
        if not plan.in_weights:
            return piece
        if plan.shifted_e2m1:  # f16 values times exact powers of two, then e4m3 (exact but large gaps)
            if shared_scale is None:
                width = piece.cols.shape[0]
                args = (width, plan.pieces, n_mask, k_limit is not None, top)
                shared_scale = _shift_tile(scale_ref, w, expert, n_idx, k_start, *args)
            return dataclasses.replace(piece, values=_f16_to_e4m3(piece.values * shared_scale, plan.on_gpu))
        if plan.scale_in_compute and w.packed:
            if shared_scale is None:
                width = piece.cols.shape[0]
                tile = _group_scale_tile(
                    scale_ref,
                    w,
                    expert,
                    n_idx,
                    k_start,
                    width,
                    plan.pieces,
                    n_mask,
                    k_limit is not None,
                    plan.scale_exponent,
                )
                shared_scale = tile.astype(compute_dtype)
            return dataclasses.replace(piece, values=piece.values * shared_scale)
        scaled = _scaled_elements(
            piece.values if plan.scale_in_compute else piece.values.astype(jnp.float32),
            (scale_ref, zero_ref, group_ref),
            w,
            expert,
            n_idx,
            k_start,
            piece.cols,
            (n_mask, None if k_limit is None else piece.cols < k_limit),
            plan.pieces,
        )
        return dataclasses.replace(piece, values=scaled.astype(compute_dtype))

    if w.packed:
        width = span // plan.pieces  # columns per piece
        along = jnp.arange(width, dtype=jnp.int32)
        per_unit = plan.pieces  # nibbles per loaded element
        unit = _floor_div(k_start, per_unit) + jnp.arange(width, dtype=jnp.int32)
        unit_mask = None if k_limit is None else (unit < pl.cdiv(k_limit, per_unit))[None, :]
        units = _load(values_ref.at[expert, n_col, unit[None, :]], _all(n_mask2, unit_mask))
        zero = None
        if w.zero_point == "int" and not plan.in_weights:
            zero = _int_zero(zero_ref, expert, n_idx, _floor_div(k_start, w.group_size), n_mask)
        for j, values in enumerate(
            _decode_units(units, w, ways, plan.pairs, plan.decode_dtype, zero, plan.on_gpu, plan.raw_e2m1)
        ):
            cols = _piece_columns(k_start, along, j, per_unit, w.nibble_unit, span)
            x_cols = k_start + j * width + along if plan.x_split else cols
            yield finish(_Piece(cols, x_cols, values if plan.shifted_e2m1 else values.astype(compute_dtype)))
        return
    if plan.byte_pairs:  # byte j of pair a holds column k_start + 2a + j
        along = jnp.arange(span // 2, dtype=jnp.int32)
        pair = _floor_div(k_start, 2) + along
        pair_mask = None if k_limit is None else (pair < pl.cdiv(k_limit, 2))[None, :]
        pairs = _load(values_ref.at[expert, n_col, pair[None, :]], _all(n_mask2, pair_mask))
        for j in range(2):
            raw = ((pairs >> (8 * j)) & 0xFF).astype(jnp.uint8)
            piece = _byte_piece(raw, k_start + 2 * along + j, w, expert, n_idx, k_start, plan, refs, n_mask)
            if plan.x_split:  # x's span stored even columns first
                piece = dataclasses.replace(piece, x_cols=k_start + j * (span // 2) + along)
            yield finish(piece)
        return
    cols = k_start + jnp.arange(span, dtype=jnp.int32)
    k_mask = None if k_limit is None else (cols < k_limit)[None, :]
    raw = _load(values_ref.at[expert, n_col, cols[None, :]], _all(n_mask2, k_mask))
    yield finish(_byte_piece(raw, cols, w, expert, n_idx, k_start, plan, refs, n_mask))


def _byte_piece(raw, cols, w: WeightSpec, expert, n_idx, k_start, plan: _SpanPlan, refs, n_mask) -> _Piece:
    """The piece of unpacked values ``raw [bn, len(cols)]`` (8-bit bits or
    16-bit floats) of columns ``cols``, less an integer zero point."""
    if w.value_type == "float8_e4m3" and raw.dtype == jnp.uint8:
        raw = _storage_bits(raw, jnp.float8_e4m3fn)
    elif w.value_type == "int8" and raw.dtype == jnp.uint8:
        raw = jax.lax.bitcast_convert_type(raw, jnp.int8)
    values = raw.astype(plan.compute_dtype)
    if w.zero_point == "int" and not plan.in_weights:  # q - z is a small integer, exact
        zero = _int_zero(refs[2], expert, n_idx, _floor_div(k_start, w.group_size), n_mask)
        values = (raw.astype(jnp.float32) - zero.astype(jnp.float32)[:, None]).astype(plan.compute_dtype)
    return _Piece(cols, cols, values)


def _span_group(w: WeightSpec, k_start):
    """The weight's scale group of the span at ``k_start``: a partial last
    tile's spans past K multiply masked zeros, so theirs is the last group (in
    bounds; past it lies memory of another array, maybe not finite)."""
    return jnp.minimum(_floor_div(k_start, w.group_size), pl.cdiv(w.k, w.group_size) - 1)


def _float_zero(zero_ref, w: WeightSpec, expert, n_idx, k_start, n_mask):
    """Float zero points ``[bn]`` of the span at ``k_start`` (not exact in bf16:
    they are subtracted after the product as ``z * sum_k x``)."""
    return _load(zero_ref.at[expert, n_idx, _span_group(w, k_start)], n_mask).astype(jnp.float32)


def _column_scale(scale_ref, global_ref, w: WeightSpec, expert, n_idx, k_start, in_weights, n_mask, factor, n_start):
    """The f32 factor of each output column for columns starting at ``k_start``
    (``[bn]``, or a scalar when one scale covers the tile's columns ``n_start
    + [0, bn)``; ``n_start`` None: the tile's columns are not one run): scale
    (unless applied in the weights) x global scale x ``factor``, or None when it is 1."""
    if w.scale == "none" or in_weights:
        scale = None
    elif w.scale == "tensor":
        scale = _decode_scale(scale_ref[expert, 0, 0], w.scale_type)
    elif w.scale == "channel":
        scale = _decode_scale(_load(scale_ref.at[expert, n_idx, 0], n_mask), w.scale_type)
    elif w.scale == "group":
        group = _span_group(w, k_start)
        scale = _decode_scale(_load(_group_scale_at(scale_ref, w, expert, n_idx, group), n_mask), w.scale_type)
    elif n_start is not None and w.block_n % n_idx.shape[0] == 0:  # block: the tile inside one block of rows
        scale = _decode_scale(scale_ref[expert, n_start // w.block_n, _span_group(w, k_start)], w.scale_type)
    else:  # block
        raw = _load(scale_ref.at[expert, n_idx // w.block_n, _span_group(w, k_start)], n_mask)
        scale = _decode_scale(raw, w.scale_type)
    if w.global_scale != "none":
        global_scale = global_ref[expert] if w.global_scale == "expert" else global_ref[0]
        scale = global_scale if scale is None else scale * global_scale
    if factor != 1.0:
        scale = jnp.float32(factor) if scale is None else scale * factor
    return scale


def _gemm_kernel(
    *refs,
    w: WeightSpec,
    layout: LayoutSpec,
    tiles: Tiles,
    compute_dtype,
    accum_dtype,
    num_route: int,
    num_weight: int,
    x_split: bool,
    on_gpu: bool,
    x_scale: XScale,
    x_float8=None,
    act: EpilogueActivation | None = None,
):
    x_ref = refs[0]
    x_scale_ref = refs[1] if x_scale.mode != "none" else None
    refs = refs[1:] if x_scale_ref is not None else refs
    route_refs = refs[1 : 1 + num_route]
    values_ref, scale_ref, zero_ref, global_ref, group_ref = _weight_parts(
        refs[1 + num_route : 1 + num_route + num_weight], w
    )
    rest = refs[1 + num_route + num_weight :]
    bias_ref = rest[0] if w.has_bias else None
    out_ref = rest[-1]  # the output (aliased to a zeroed input when layout.zero_filled)
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    x_group = x_scale.group_size if x_scale.mode == "group" else 0
    in_weights = scales_in_weights(w, tiles, compute_dtype)
    span = scale_span(w, tiles, compute_dtype, x_group)
    plan = _SpanPlan(
        span,
        nibbles_per_unit(w, tiles, compute_dtype, x_group),
        in_weights,
        x_split,
        compute_dtype,
        on_gpu,
        scale_in_compute=_scales_exact_in(w, compute_dtype) and tiles.use_mma,
        pairs=decodes_pairs(w, tiles, compute_dtype, x_group),
        byte_pairs=reads_byte_pairs(w),
        folded_e2m1=folds_e2m1(w, tiles, compute_dtype),
        e4m3_codes=decodes_e4m3_codes(w, tiles, compute_dtype, x_group),
        shifted_e2m1=shifts_e2m1(w, tiles, compute_dtype),
    )
    row_tile, col_group = tile_order(
        pl.program_id(0), num_row_tiles(layout, w.num_experts, bm), num_col_groups(w.n, tiles), tiles.group_m
    )
    by_expert = layout.tile_by_expert > 0
    if by_expert:  # a tile an expert and level; the last, the invalid slots (see the end)
        slot_ids = _token_slot_ids(route_refs[0], layout, bm)
        rows_in, outs, row_mask, expert, live = _by_expert_rows(slot_ids, layout, w.num_experts, row_tile)
    else:
        rows_in, rows_out, row_mask, expert, live = _tile_rows(route_refs, layout, w.num_experts, bm, row_tile)
        outs = ((rows_out, row_mask),)
    tile_rows = (rows_in, outs, row_mask)
    columns_masked = w.n % bn != 0  # static: no column mask when the tiles divide N
    # The tile holds half a gate/up block pair: its rows are its outputs' gate rows, then their up rows.
    half_pair = act is not None and act.gated and bn < 2 * act.pair_block

    def columns(c):
        """(n_idx [bn], n_mask [bn] or None) of the program's column tile ``c``."""
        n_idx = (col_group + c) * bn + jnp.arange(bn, dtype=jnp.int32)
        if half_pair:
            half, block = bn // 2, act.pair_block
            first = (col_group + c) * half  # the tile's first output
            j = jnp.arange(bn, dtype=jnp.int32)
            base = (first // block) * (2 * block) + first % block
            n_idx = base + j % half + jnp.where(j < half, 0, block)
        return n_idx, (n_idx < w.n if columns_masked else None)

    out_bn = bn if act is None else act.out_n(bn)  # a gated activation stores half the columns

    def out_columns():
        """(the output columns [out_bn], their mask or None) of the program's tile."""
        if act is None:
            return columns(0)
        out_idx = col_group * out_bn + jnp.arange(out_bn, dtype=jnp.int32)
        # A partial last tile ends on a pair: N is a whole number of gate/up pairs.
        return out_idx, (out_idx < act.out_n(w.n) if columns_masked else None)

    k_limit = None if w.k % bk == 0 else w.k
    split = pl.program_id(1)
    k_tiles = pl.cdiv(w.k, bk)
    per_split = pl.cdiv(k_tiles, tiles.split_k)
    # swap_ab computes out.T = w @ x.T: the weight tile (decoded in registers)
    # is the MMA's A operand and the few rows of a decode tile its narrow N.
    swap = tiles.swap_ab
    acc_shape = (bn, bm) if swap else (bm, bn)
    float_zero = w.zero_point == "float" and not in_weights

    def along_n(column):  # a [bn] vector broadcast against the accumulator
        return column[:, None] if swap else column[None, :]

    def along_m(row):  # a [bm] vector broadcast against the accumulator
        return row[None, :] if swap else row[:, None]

    def product(piece, k_limit, rows, acc=None):
        """(``acc`` + the piece's product, or the product alone; the piece's row sums)
        for the tile's ``rows`` (rows_in, the outputs, row_mask)."""
        rows_in, _, row_mask = rows
        k_mask = None if k_limit is None else (piece.cols < k_limit)[None, :]
        x = _load(x_ref.at[rows_in[:, None], piece.x_cols[None, :]], _all(row_mask[:, None], k_mask))
        if x_float8 is not None:  # 8-bit floats travel as uint8 (see _storage_bits)
            x = _storage_bits(x, x_float8)
        x = x.astype(compute_dtype)
        if x_shift:
            x = x * jnp.asarray(2.0**-x_shift, compute_dtype)
        row_sum = jnp.sum(x.astype(jnp.float32), axis=1) if float_zero else None
        operands = (piece.values, x) if swap else (x, piece.values)
        if tiles.use_mma and jnp.dtype(compute_dtype) == jnp.dtype(jnp.float8_e4m3fn):
            return fp8_dot(*operands, acc), row_sum  # (accumulates in f32)
        if not tiles.use_mma:  # [bm, 1, c] x [1, bn, c] summed over c, in f32
            products = x.astype(jnp.float32)[:, None, :] * piece.values.astype(jnp.float32)[None, :, :]
            dot = jnp.sum(products, axis=2).astype(accum_dtype)
        else:
            integer = jnp.dtype(compute_dtype) == jnp.dtype(jnp.int8)  # int8 MMAs sum exactly in int32
            dot = jax.lax.dot_general(
                *operands, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32 if integer else accum_dtype
            ).astype(accum_dtype)
        return (dot if acc is None else acc + dot), row_sum

    def k_tile_step(k_limit, n_idx, n_mask, rows):
        """One K tile's products of column tile ``n_idx`` for ``rows`` added to ``acc``;
        ``k_limit`` masks the columns at and past K (only a partial tile needs it)."""
        n_start = None if half_pair else col_group * bn  # two runs of rows: maybe two scale blocks
        rows_in, _, row_mask = rows

        def step(i, acc):
            k_tile = (split * per_split + i) * bk
            for j in range(bk // span):  # one product per span of columns sharing a scale
                k_start = k_tile + j * span
                top = None
                if plan.shifted_e2m1:
                    top = _span_top(scale_ref, w, expert, n_idx, k_start, span, n_mask, k_limit is not None)
                pieces = _weight_pieces(
                    (values_ref, scale_ref, zero_ref, group_ref),
                    w,
                    expert,
                    n_idx,
                    k_start,
                    plan,
                    (n_mask, k_limit),
                    top,
                )
                scale = _column_scale(
                    scale_ref, global_ref, w, expert, n_idx, k_start, in_weights, n_mask, span_factor, n_start
                )
                if top is not None:  # the span's largest group scale multiplies its product
                    top_scale = _decode_scale(top, "e8m0")
                    scale = top_scale if scale is None else scale * top_scale
                row_scale = None
                if x_group:  # the input's scales of this span's group, one per row
                    in_k = row_mask if k_limit is None else row_mask & (k_start < k_limit)
                    raw = _load(x_scale_ref.at[rows_in, _floor_div(k_start, x_group)], in_k)
                    row_scale = _decode_scale(raw, x_scale.scale_type)
                    if scale is not None and jnp.ndim(scale) == 0:  # one multiply-add per element, not two
                        row_scale, scale = row_scale * scale, None
                if scale is None and row_scale is None and not float_zero:  # straight into acc (one MMA chain)
                    for piece in pieces:
                        acc = product(piece, k_limit, rows, acc)[0]
                    continue
                part, row_sum = None, None
                for piece in pieces:
                    part, sums = product(piece, k_limit, rows, part)
                    row_sum = sums if row_sum is None else row_sum + sums
                part = part.astype(jnp.float32)
                if float_zero:
                    zero = _float_zero(zero_ref, w, expert, n_idx, k_start, n_mask)
                    part = part - along_m(row_sum) * along_n(zero)
                if scale is not None:
                    part = part * (along_n(scale) if jnp.ndim(scale) else scale)
                if row_scale is not None:
                    part = part * along_m(row_scale)
                acc = acc + part.astype(accum_dtype)
            return acc

        return step

    # A constant factor left once scales are in the weights (e2m1's 2**6) is
    # applied to the sum, so the K loop stays one accumulation chain.
    factor = value_factor(w, plan.folded_e2m1, plan.e4m3_codes, plan.shifted_e2m1)
    end_factor = factor if in_weights and w.global_scale == "none" else 1.0
    # An f16 accumulator would overflow on raw 8-bit input values (e4m3 up to
    # 448, e5m2 57344): they enter the product times a power of two (exact but
    # for e5m2 values under 2**-9), multiplied back on the sum.
    x_stored = x_ref.dtype if x_float8 is None else x_float8
    x_shift = X_SHIFT.get(jnp.dtype(x_stored).name, 0) if accum_dtype == jnp.float16 else 0
    span_factor = factor / end_factor

    def finish(acc, n_idx, n_mask, rows):
        """The epilogue of one column tile of ``rows``: end factor, bias, store."""
        rows_in, outs, row_mask = rows
        acc = acc.astype(jnp.float32)
        if end_factor != 1.0:
            acc = acc * end_factor
        if x_shift:
            acc = acc * 2.0**x_shift
        if x_scale.mode == "token":
            acc = acc * along_m(_load(x_scale_ref.at[rows_in], row_mask).astype(jnp.float32))
        elif x_scale.mode == "tensor":
            acc = acc * x_scale_ref[0]
        if bias_ref is not None:
            bias = _load(bias_ref.at[expert, n_idx], n_mask).astype(jnp.float32)
            acc = acc + along_n(jnp.where(split == 0, bias, 0.0))
        if act is not None:
            acc = epilogue_activation(acc, act, swap)
            n_idx, n_mask = out_columns()
        for rows_out, keep in outs:  # (more than one: a token's row to each of its slots on the expert)
            mask = _all(along_m(keep), None if n_mask is None else along_n(n_mask))
            store_out(along_m(codecs.scatter_index(rows_out, keep, layout.m_out)), along_n(n_idx), acc, mask)

    def store_out(out_rows, cols, values, mask):
        """``values`` into output rows and columns (broadcast index arrays): this split's partial with split K."""
        at = (split, out_rows, cols) if tiles.split_k > 1 else (out_rows, cols)
        plgpu.store(out_ref.at[at], values.astype(out_ref.dtype), mask=mask)

    zeros = jnp.zeros(acc_shape, accum_dtype)

    def store_zeros(rows, keep):
        """Zeros into the program's columns of output rows ``rows [bm]`` where ``keep``."""
        index = codecs.scatter_index(rows, keep, layout.m_out)[:, None]
        n_idx, n_mask = out_columns()
        mask = _all(keep[:, None], None if n_mask is None else n_mask[None, :])
        store_out(index, n_idx[None, :], jnp.zeros((bm, out_bn), out_ref.dtype), mask)

    if layout.kind == "grouped_contiguous":
        _zero_gap_chunk(route_refs[0], w.num_experts, layout, bm, row_tile, store_zeros)
    elif layout.kind == "grouped_masked":  # the expert's rows of the tile past its count (all when it has none)
        store_zeros(rows_out, (rows_out < (expert + 1) * layout.max_tokens) & ~row_mask)
    elif layout.kind == "indexed" and not by_expert:  # the slots listed in a dead block (vLLM zeroes expert -1's)
        store_zeros(rows_out, row_mask & ~live)

    def one_column_tile(rows):
        n_idx, n_mask = columns(0)
        first = split * per_split
        # Whole K tiles run unmasked; a partial last tile (gpt-oss: K=2880) runs
        # once after them, in the split that owns it, with the column mask.
        full_steps = jnp.clip(w.k // bk - first, 0, per_split)
        acc = jax.lax.fori_loop(0, full_steps, k_tile_step(None, n_idx, n_mask, rows), zeros)
        if k_limit is not None:
            tail = functools.partial(k_tile_step(k_limit, n_idx, n_mask, rows), w.k // bk - first)
            if tiles.split_k == 1:
                acc = tail(acc)
            else:
                owns_tail = (first <= w.k // bk) & (w.k // bk < first + per_split)
                acc = jax.lax.cond(owns_tail, tail, lambda a: a, acc)
        finish(acc, n_idx, n_mask, rows)

    if by_expert:

        @pl.when(row_tile == num_row_tiles(layout, w.num_experts, bm) - 1)
        def _zero_invalid_slots():  # (the ids outside [0, E): no expert's tile writes their rows)
            for rows, keep in _invalid_slot_rows(slot_ids, layout, w.num_experts):
                store_zeros(rows, keep)

    pl.when(live)(functools.partial(one_column_tile, tile_rows))


def epilogue_activation(acc, act: EpilogueActivation, swap: bool):
    """The activation of a tile's f32 sums ``acc [bm, bn]`` (``swap``: ``[bn,
    bm]``): ``[bm, bn/2]`` for a gated kind, its gate and up columns in runs
    of :func:`gate_up_split` (a run of gate sums, then the same outputs' up
    sums), else ``[bm, bn]``."""
    if not act.gated:
        return activation.ungated(act.kind, acc)
    block = gate_up_split(act, acc.shape[0] if swap else acc.shape[1])
    if swap:
        bn, bm = acc.shape
        gate, up = jnp.split(acc.reshape(bn // (2 * block), 2, block, bm), 2, axis=1)
        half = (bn // 2, bm)
    else:
        bm, bn = acc.shape
        gate, up = jnp.split(acc.reshape(bm, bn // (2 * block), 2, block), 2, axis=2)
        half = (bm, bn // 2)
    return activation.gated(act.kind, gate.reshape(half), up.reshape(half), act.clamp_limit, act.alpha, act.beta)


def _zero_gap_chunk(offsets_ref, num_experts: int, layout: LayoutSpec, block_m: int, row_tile, store_zeros):
    """Row tile t stores zeros in chunk t of the rows outside every group
    (:func:`gap_chunk_rows`), if there is one: a masked store, not a branch."""
    first, last = offsets_ref[0], offsets_ref[num_experts]
    head_chunks = (first + block_m - 1) // block_m
    chunks = head_chunks + (jnp.maximum(layout.m_out - last, 0) + block_m - 1) // block_m
    rows, keep = gap_chunk_rows(first, last, layout.m_out, block_m, row_tile)
    store_zeros(rows, keep & (row_tile < chunks))


def split_packed_columns(x: jax.Array, span: int, ways: int = 2, pairs: bool = False) -> jax.Array:
    """``x [M, K]`` with the columns of each span of ``span`` grouped by their
    position modulo ``ways`` (zero-padded to a whole number of spans): the
    pieces of packed weights (nibble position j: columns j, j+ways, ...) then
    meet contiguous columns of x. With ``pairs`` piece j takes positions j and
    j + ways/2 of each unit in turn (columns j, j+4, j+8, j+12, ... for words)."""
    m, k = x.shape
    padded = pl.cdiv(k, span) * span
    x = jnp.pad(x, ((0, 0), (0, padded - k)))
    if pairs:  # [.., unit, half, j] -> [.., j, unit, half]
        blocks = x.reshape(m, padded // span, span // ways, 2, ways // 2)
        return blocks.transpose(0, 1, 4, 2, 3).reshape(m, padded)
    return x.reshape(m, padded // span, span // ways, ways).swapaxes(2, 3).reshape(m, padded)


def _as_units(values: jax.Array, ways: int) -> jax.Array:
    """Packed bytes ``[E, N, K/2]`` as load units of ``ways`` nibbles (uint32
    words for 8, uint16 halves for 4; little-endian: byte 0 holds nibble
    positions 0 and 1)."""
    if ways == 2:
        return values
    e, n, half = values.shape
    per = ways // 2  # bytes per unit
    dtype = {2: jnp.uint16, 4: jnp.uint32}[per]
    return jax.lax.bitcast_convert_type(values.reshape(e, n, half // per, per), dtype)


def splits_x(w: WeightSpec, tiles: Tiles, compute_dtype, x_group: int = 0) -> bool:
    """Large row tiles read x once per column tile, and word-decoded tiles would
    gather every 8th column: both get the split copy of x (contiguous loads).
    Small
    byte-decoded tiles gather the even/odd columns. Pair-decoded planar
    weights (``nibble_unit``) need no split: each piece meets a run of
    consecutive columns of x as it is."""
    if w.nibble_unit and decodes_pairs(w, tiles, compute_dtype, x_group):
        return False
    if reads_byte_pairs(w):  # the even and odd columns: as bytes of 4-bit codes
        return tiles.block_m >= 64
    return w.packed and (tiles.block_m >= 64 or tiles.word_decode)


def expert_gemm(
    call: GemmCall, tiles: Tiles, x: jax.Array, weight_arrays, bias, route_arrays, x_scale: jax.Array | None = None
) -> jax.Array:
    """``[m_out, N]`` (``call.activation``'s output width) in ``call.out_dtype`` for ``x [M, K]`` (16-bit floats,
    or 8-bit values times ``x_scale`` as ``call.x_scale`` says: f32 ``[1]``,
    ``[M, 1]``, or ``[M, K / group]`` f32 or e8m0 bytes). ``weight_arrays``
    are the stored parts in order (values, scale, zero point, global scale,
    group index), only those the weight has; ``bias [E, N]`` or None;
    ``route_arrays`` the layout's (offsets | counts | sorted_ids, expert_ids,
    num_tokens_padded; of a slot-ordered layout the kernel reads expert_ids alone)."""
    w, layout, out_dtype, interpret = call.weight, call.layout, jnp.dtype(call.out_dtype), call.interpret
    use_f16_accum = call.use_f16_accum
    compute_dtype = operand_dtype(call, tiles)
    xs = call.x_scale
    x_group = xs.group_size if xs.mode == "group" else 0
    if (x_scale is None) != (xs.mode == "none"):
        raise ValueError(f"expert_gemm: x_scale: the call's input scale is {xs.mode!r}, got {x_scale!r}")
    x_float8 = x.dtype if x.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2) else None
    if x_float8 is not None:
        x = jax.lax.bitcast_convert_type(x, jnp.uint8)
    accum_dtype = jnp.float16 if use_f16_accum else jnp.float32
    grid = (num_col_groups(w.n, tiles) * num_row_tiles(layout, w.num_experts, tiles.block_m), tiles.split_k)
    # 8-bit floats travel as their uint8 bits (see _storage_bits), but for e4m3
    # weight values read by fp8 MMAs with no mask: loaded as they are, they go
    # straight to shared memory for the MMA.
    direct = jnp.dtype(compute_dtype) == jnp.dtype(jnp.float8_e4m3fn) and w.k % tiles.block_k == 0
    direct = direct and w.n % tiles.block_n == 0 and not reads_byte_pairs(w)
    weight_arrays = tuple(
        jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype == jnp.float8_e4m3fn and not (direct and i == 0) else a
        for i, a in enumerate(weight_arrays)
    )
    if reads_byte_pairs(w):  # little-endian: byte 0 of pair a is column 2a
        values = jax.lax.bitcast_convert_type(weight_arrays[0], jnp.uint8).reshape(w.num_experts, w.n, w.k // 2, 2)
        weight_arrays = (jax.lax.bitcast_convert_type(values, jnp.uint16), *weight_arrays[1:])
    out_n = w.n if call.activation is None else call.activation.out_n(w.n)
    out_shape = (tiles.split_k, layout.m_out, out_n) if tiles.split_k > 1 else (layout.m_out, out_n)
    out_type = jnp.float32 if tiles.split_k > 1 else out_dtype
    zero_filled = layout.zero_filled  # (see the module docstring)
    ways = nibbles_per_unit(w, tiles, compute_dtype, x_group)
    span, pairs = scale_span(w, tiles, compute_dtype, x_group), decodes_pairs(w, tiles, compute_dtype, x_group)
    if w.packed:  # pairs read words as their 16-bit halves
        weight_arrays = (_as_units(weight_arrays[0], ways // 2 if pairs else ways), *weight_arrays[1:])
    x_split = splits_x(w, tiles, compute_dtype, x_group)
    if x_split and w.nibble_unit:  # planar words or bytes (never pairs): gather each piece's columns
        order = piece_column_order(w.k, span, ways, w.nibble_unit)
        x = jnp.pad(x, ((0, 0), (0, len(order) - w.k)))[:, order]
    elif x_split:
        x = split_packed_columns(x, span, 2 if reads_byte_pairs(w) else ways, pairs)
    scales = [] if x_scale is None else [x_scale.reshape(-1) if xs.mode in ("tensor", "token") else x_scale]
    if layout.slot_order:  # expert_ids alone (see _tile_rows, _token_slot_ids)
        route_arrays = route_arrays[1:2]
    inputs = [x, *scales, *route_arrays, *weight_arrays] + ([bias] if bias is not None else [])
    if zero_filled:
        inputs.append(jnp.zeros(out_shape, out_type))
    result = pl.pallas_call(
        functools.partial(
            _gemm_kernel,
            w=w,
            layout=layout,
            tiles=tiles,
            compute_dtype=compute_dtype,
            accum_dtype=accum_dtype,
            num_route=len(route_arrays),
            num_weight=len(weight_arrays),
            x_split=x_split,
            on_gpu=not interpret,
            x_scale=xs,
            x_float8=x_float8,
            act=call.activation,
        ),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_type),
        input_output_aliases={len(inputs) - 1: 0} if zero_filled else {},
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"moe_gemm_{layout.kind}_{w.value_type}",
    )(*inputs)
    if tiles.split_k > 1:
        # Fixed-order sum over the splits: deterministic.
        result = functools.reduce(jnp.add, [result[s] for s in range(tiles.split_k)]).astype(out_dtype)
    return result
