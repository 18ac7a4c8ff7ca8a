"""Pallas expert GEMM: one kernel family for the four layouts and every weight
format (16-bit activations).

``out[r] = x[r_in] @ dequant(w[e]).T (+ bias[e])`` on ``block_m x block_n``
output tiles. The layout decides which rows a tile covers and which expert
it multiplies (``_tile_rows``). The weight format decides how a weight tile
enters the product: its raw values (minus the zero point) are exact in the
compute dtype, so they go into the dot as they are, and the per-column scale
(channel, group or block, times the global scale) multiplies the
``[block_m, block_n]`` partial product of each span of K columns that share
it (``scale_span``): fewer multiplies than scaling the weight tile, and no
bf16 rounding of scaled weights. Accumulation is f32 (or f16). The grid
is a static upper bound on the tiles (no host sync, no recompilation when the
routing changes): tiles past the live ones exit at once.

Layouts:

* ``dense`` — tile t covers rows ``[t*bm, (t+1)*bm)``, expert 0.
* ``grouped_contiguous`` — tiles are laid out group by group
  (``ceil(count_e / bm)`` tiles for expert e), so a tile never straddles two
  experts; the grid has ``ceil(M / bm) + E`` tiles.
* ``grouped_masked`` — ``ceil(max_tokens / bm)`` tiles per expert.
* ``indexed`` — tile b is block b of ``sorted_ids`` (``bm == block_size``);
  entry ``idx`` reads row ``idx // top_k`` and writes row ``idx``.

Rows no tile writes must read as zero: the caller passes a zeroed output that
the kernel updates in place (``input_output_aliases``). With ``split_k > 1``
each split writes its own f32 partial ``[split_k, M, N]``; the caller sums
the partials in a fixed order (deterministic).

Kernels only: validation, tuning and the backend choice live in ``humming_jax``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import codecs


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """Static description of a quantized weight ``[E, N, K]`` (see humming_jax.formats)."""

    num_experts: int
    n: int
    k: int
    value_type: str  # bfloat16 float16 int8 int4 uint4 float8_e4m3 float4_e2m1
    scale: str = "none"  # none tensor channel group block
    scale_type: str | None = None  # float32 bfloat16 float16 e8m0 float8_e4m3
    group_size: int = 0
    block_n: int = 0
    zero_point: str = "none"  # none int float
    global_scale: str = "none"  # none tensor expert
    has_bias: bool = False
    has_group_index: bool = False  # act-order: column k uses group group_index[e, k]

    @property
    def packed(self) -> bool:
        return self.value_type in ("int4", "uint4", "float4_e2m1")


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    kind: str  # dense grouped_contiguous grouped_masked indexed
    m_in: int
    m_out: int
    top_k: int = 1
    num_blocks: int = 0  # indexed: len(expert_ids)
    max_tokens: int = 0  # grouped_masked


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def num_row_tiles(layout: LayoutSpec, num_experts: int, block_m: int) -> int:
    """Static upper bound on the row tiles of a layout."""
    if layout.kind == "dense":
        return pl.cdiv(layout.m_in, block_m)
    if layout.kind == "grouped_contiguous":
        return pl.cdiv(layout.m_in, block_m) + num_experts
    if layout.kind == "grouped_masked":
        return num_experts * pl.cdiv(layout.max_tokens, block_m)
    return layout.num_blocks


def _tile_rows(route_refs, layout: LayoutSpec, num_experts: int, block_m: int):
    """(rows_in [bm], rows_out [bm], row_mask [bm], expert, live) of this program's tile."""
    tile = pl.program_id(0)
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
        (counts_ref,) = route_refs
        per_expert = pl.cdiv(layout.max_tokens, block_m)
        expert = tile // per_expert
        local = (tile % per_expert) * block_m + lane
        count = jnp.clip(counts_ref[expert], 0, layout.max_tokens)
        rows = expert * layout.max_tokens + local
        return rows, rows, local < count, expert, (tile % per_expert) * block_m < count
    sorted_ref, experts_ref, padded_ref = route_refs
    positions = tile * block_m + lane
    entries = plgpu.load(sorted_ref.at[positions], mask=positions < sorted_ref.shape[0], other=layout.m_out)
    expert = experts_ref[tile]
    mask = entries < layout.m_out
    live = (tile * block_m < padded_ref[0]) & (expert >= 0) & (expert < num_experts)
    return entries // layout.top_k, entries, mask, jnp.clip(expert, 0, num_experts - 1), live


def _decode_e2m1(code):
    """e2m1 codes (int32) to f32 without a table: 0, .5, 1, 1.5, 2, 3, 4, 6."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).astype(jnp.float32)
    power = jnp.left_shift(1, jnp.maximum(exponent - 1, 0)).astype(jnp.float32)
    magnitude = jnp.where(exponent == 0, 0.5 * mantissa, power * (1.0 + 0.5 * mantissa))
    return jnp.where((code & 8) != 0, -magnitude, magnitude)


def _decode_scale(raw, scale_type: str):
    if scale_type == "e8m0":
        return codecs.e8m0_decode(raw)
    return raw.astype(jnp.float32)


def scale_span(w: WeightSpec, block_k: int) -> int:
    """Columns of K that share one scale (and zero point) inside a K tile: the
    sub-product width. Scales apply to the ``[bm, bn]`` partial product of each
    span, so the weight values enter the dot raw."""
    if w.scale in ("group", "block") and not w.has_group_index:
        return min(block_k, w.group_size)
    return block_k


def _weight_parts(weight_refs, w: WeightSpec):
    refs = list(weight_refs)
    values_ref = refs.pop(0)
    scale_ref = refs.pop(0) if w.scale != "none" else None
    zero_ref = refs.pop(0) if w.zero_point != "none" else None
    global_ref = refs.pop(0) if w.global_scale != "none" else None
    group_ref = refs.pop(0) if w.has_group_index else None
    return values_ref, scale_ref, zero_ref, global_ref, group_ref


def _act_order_weight(values, scale_ref, zero_ref, group_ref, w: WeightSpec, expert, n_idx, k_start, span: int):
    """Act-order (``group_index``): every column has its own group, so the scale
    and zero point are gathered per element and applied before the product."""
    k_idx = k_start + jnp.arange(span, dtype=jnp.int32)
    group = plgpu.load(group_ref.at[expert, k_idx], mask=k_idx < w.k, other=0)[None, :]
    n_col = n_idx[:, None]
    mask = (n_col < w.n) & (k_idx < w.k)[None, :]
    if w.zero_point == "int":
        byte = plgpu.load(zero_ref.at[expert, n_col, group // 2], mask=mask, other=0).astype(jnp.int32)
        values = values - ((byte >> (4 * (group % 2))) & 0xF).astype(jnp.float32)
    elif w.zero_point == "float":
        values = values - plgpu.load(zero_ref.at[expert, n_col, group], mask=mask, other=0).astype(jnp.float32)
    return values * _decode_scale(plgpu.load(scale_ref.at[expert, n_col, group], mask=mask, other=0), w.scale_type)


def _raw_weight(
    values_ref,
    zero_ref,
    w: WeightSpec,
    expert,
    n_idx,
    k_start,
    span: int,
    compute_dtype,
    scale_ref=None,
    group_ref=None,
):
    """Weight values of columns ``k_start + [0, span)`` minus their zero point, as
    ``[bn, span]`` in the compute dtype. Every quantized value type (int8,
    int4/uint4 minus a zero point, e4m3, e2m1) is exact in bf16 and f16, so no
    rounding happens here; the scales come after the product."""
    n_col = n_idx[:, None]
    if w.packed:  # byte j holds columns 2j (low nibble) and 2j+1 (high nibble)
        pair = k_start // 2 + jnp.arange(span // 2, dtype=jnp.int32)
        packed = plgpu.load(
            values_ref.at[expert, n_col, pair[None, :]], mask=(n_col < w.n) & (pair[None, :] < w.k // 2), other=0
        ).astype(jnp.int32)
        codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], span)
        if w.value_type == "float4_e2m1":
            values = _decode_e2m1(codes)
        else:
            values = (codes - 8 if w.value_type == "int4" else codes).astype(jnp.float32)
    else:
        k_row = (k_start + jnp.arange(span, dtype=jnp.int32))[None, :]
        values = plgpu.load(values_ref.at[expert, n_col, k_row], mask=(n_col < w.n) & (k_row < w.k), other=0)
        if w.zero_point == "none" and not w.has_group_index:
            return values.astype(compute_dtype)
        values = values.astype(jnp.float32)
    if w.has_group_index:
        return _act_order_weight(values, scale_ref, zero_ref, group_ref, w, expert, n_idx, k_start, span).astype(
            compute_dtype
        )
    if w.zero_point == "int":  # integer zero points: q - z is a small integer, exact
        group = k_start // w.group_size
        byte = plgpu.load(zero_ref.at[expert, n_idx, group // 2], mask=n_idx < w.n, other=0).astype(jnp.int32)
        values = values - ((byte >> (4 * (group % 2))) & 0xF).astype(jnp.float32)[:, None]
    return values.astype(compute_dtype)


def _float_zero(zero_ref, w: WeightSpec, expert, n_idx, k_start):
    """Float zero points ``[bn]`` of the span at ``k_start`` (not exact in bf16:
    they are subtracted after the product as ``z * sum_k x``)."""
    return plgpu.load(zero_ref.at[expert, n_idx, k_start // w.group_size], mask=n_idx < w.n, other=0).astype(
        jnp.float32
    )


def _column_scale(scale_ref, global_ref, w: WeightSpec, expert, n_idx, k_start):
    """The f32 scale of each output column for columns starting at ``k_start``
    (``[bn]``, or a scalar for per-tensor scales), times the global scale."""
    if w.scale == "none" or w.has_group_index:  # act-order scales were applied per element
        return None
    mask = n_idx < w.n
    if w.scale == "tensor":
        scale = _decode_scale(scale_ref[expert, 0, 0], w.scale_type)
    elif w.scale == "channel":
        scale = _decode_scale(plgpu.load(scale_ref.at[expert, n_idx, 0], mask=mask, other=0), w.scale_type)
    elif w.scale == "group":
        raw = plgpu.load(scale_ref.at[expert, n_idx, k_start // w.group_size], mask=mask, other=0)
        scale = _decode_scale(raw, w.scale_type)
    else:  # block
        raw = plgpu.load(scale_ref.at[expert, n_idx // w.block_n, k_start // w.group_size], mask=mask, other=0)
        scale = _decode_scale(raw, w.scale_type)
    if w.global_scale == "expert":
        scale = scale * global_ref[expert]
    elif w.global_scale == "tensor":
        scale = scale * global_ref[0]
    return scale


def _gemm_kernel(
    *refs, w: WeightSpec, layout: LayoutSpec, tiles: Tiles, compute_dtype, accum_dtype, num_route: int, num_weight: int
):
    x_ref = refs[0]
    route_refs = refs[1 : 1 + num_route]
    values_ref, scale_ref, zero_ref, global_ref, group_ref = _weight_parts(
        refs[1 + num_route : 1 + num_route + num_weight], w
    )
    rest = refs[1 + num_route + num_weight :]
    bias_ref = rest[0] if w.has_bias else None
    out_ref = rest[-1]  # aliased to the zeroed output input
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    span = scale_span(w, bk)
    rows_in, rows_out, row_mask, expert, live = _tile_rows(route_refs, layout, w.num_experts, bm)
    n_idx = pl.program_id(1) * bn + jnp.arange(bn, dtype=jnp.int32)
    split = pl.program_id(2)
    k_tiles = pl.cdiv(w.k, bk)
    per_split = pl.cdiv(k_tiles, tiles.split_k)

    @pl.when(live)
    def _():
        def step(i, acc):
            k_tile = (split * per_split + i) * bk
            for j in range(bk // span):  # one product per span of columns sharing a scale
                k_start = k_tile + j * span
                k_idx = k_start + jnp.arange(span, dtype=jnp.int32)
                x = plgpu.load(
                    x_ref.at[rows_in[:, None], k_idx[None, :]], mask=row_mask[:, None] & (k_idx < w.k)[None, :], other=0
                ).astype(compute_dtype)
                weight = _raw_weight(
                    values_ref, zero_ref, w, expert, n_idx, k_start, span, compute_dtype, scale_ref, group_ref
                )
                part = jax.lax.dot_general(x, weight, (((1,), (1,)), ((), ())), preferred_element_type=accum_dtype)
                if w.zero_point == "float" and not w.has_group_index:
                    row_sum = jnp.sum(x.astype(jnp.float32), axis=1)
                    zero = _float_zero(zero_ref, w, expert, n_idx, k_start)
                    part = (part.astype(jnp.float32) - row_sum[:, None] * zero[None, :]).astype(accum_dtype)
                scale = _column_scale(scale_ref, global_ref, w, expert, n_idx, k_start)
                if scale is not None:
                    part = (part.astype(jnp.float32) * scale).astype(accum_dtype)
                acc = acc + part
            return acc

        steps = jnp.clip(k_tiles - split * per_split, 0, per_split)
        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), accum_dtype)).astype(jnp.float32)
        if bias_ref is not None:
            bias = plgpu.load(bias_ref.at[expert, n_idx], mask=n_idx < w.n, other=0).astype(jnp.float32)
            acc = acc + jnp.where(split == 0, bias, 0.0)[None, :]
        mask = row_mask[:, None] & (n_idx < w.n)[None, :]
        out_rows = codecs.scatter_index(rows_out, row_mask, layout.m_out)
        if tiles.split_k > 1:
            plgpu.store(out_ref.at[split, out_rows[:, None], n_idx[None, :]], acc, mask=mask)
        else:
            plgpu.store(out_ref.at[out_rows[:, None], n_idx[None, :]], acc.astype(out_ref.dtype), mask=mask)


def expert_gemm(
    x: jax.Array,
    weight_arrays: tuple[jax.Array, ...],
    bias: jax.Array | None,
    route_arrays: tuple[jax.Array, ...],
    w: WeightSpec,
    layout: LayoutSpec,
    tiles: Tiles,
    *,
    out_dtype,
    use_f16_accum: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """``[m_out, N]`` in ``out_dtype``. ``weight_arrays`` are the stored parts in
    order (values, scale, zero point, global scale, group index), only those the weight has;
    ``route_arrays`` the layout's (offsets | counts | sorted_ids, expert_ids,
    num_tokens_padded)."""
    compute_dtype = jnp.dtype(x.dtype)
    accum_dtype = jnp.float16 if use_f16_accum else jnp.float32
    grid = (num_row_tiles(layout, w.num_experts, tiles.block_m), pl.cdiv(w.n, tiles.block_n), tiles.split_k)
    if tiles.split_k > 1:
        out = jnp.zeros((tiles.split_k, layout.m_out, w.n), jnp.float32)
    else:
        out = jnp.zeros((layout.m_out, w.n), out_dtype)
    inputs = [x, *route_arrays, *weight_arrays] + ([bias] if bias is not None else []) + [out]
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
        ),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"moe_gemm_{layout.kind}_{w.value_type}",
    )(*inputs)
    if tiles.split_k > 1:
        # Fixed-order sum over the splits: deterministic.
        result = functools.reduce(jnp.add, [result[s] for s in range(tiles.split_k)]).astype(out_dtype)
    return result
