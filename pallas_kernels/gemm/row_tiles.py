"""The Mosaic GEMMs' row-tile table in one Triton launch.

:func:`mosaic.row_tile_table <pallas_kernels.gemm.mosaic.row_tile_table>` over
:func:`mosaic.row_ranges <pallas_kernels.gemm.mosaic.row_ranges>` (the
reference) is XLA array code: on the GPU several small fusions and a scan,
launched one after another before every grouped or masked Mosaic GEMM. Here
each program takes a block of tiles: it derives every row range from the
layout's offsets or counts, counts each range's tiles and their prefix sum
(all ranges fit one block), finds each tile's range by comparing the tile
with every range end, and derives that range again from its index. Same
table, bit for bit. Notes: benchmarks/notes/layer.md (v28).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.indexing import nonneg_div, nonneg_rem

ROW_ALIGN = 8  # a tile's load row is a multiple of 8 (the Mosaic kernels' 8-row tiled x boxes)
FIELDS = 4  # (group, load row, first row, rows)
MAX_RANGES = 4096  # a program compares its tiles with every range end: [tiles, ranges] in registers


@dataclasses.dataclass(frozen=True)
class TableTiles:
    """``block_tiles`` table rows a program (a power of two; fewer where the
    ranges are many: the comparison block stays ``block_tiles x 256``) on
    ``num_warps`` warps."""

    block_tiles: int = 32
    num_warps: int = 4

    def __post_init__(self):
        if self.block_tiles < 1 or self.block_tiles & (self.block_tiles - 1):
            raise ValueError(f"TableTiles.block_tiles: expected a power of two, got {self.block_tiles!r}")


@dataclasses.dataclass(frozen=True)
class Ranges:
    """Where the row ranges come from: ``masked`` False, a grouped-contiguous
    layout's ``offsets [experts + 1]`` (expert e's rows, then the rows before
    the first offset and from the last to ``m``: ``experts + 2`` ranges);
    ``masked``, a grouped-masked layout's ``counts [experts]`` over
    ``max_tokens`` rows an expert (each expert's counted rows, then the rest
    of each: ``2 · experts`` ranges)."""

    experts: int
    m: int
    masked: bool = False
    max_tokens: int = 0

    @property
    def count(self) -> int:
        return 2 * self.experts if self.masked else self.experts + 2


def supports(ranges: int) -> str | None:
    """Why the kernel cannot build a table of ``ranges`` row ranges (None if it can)."""
    if not 1 <= ranges <= MAX_RANGES:
        return f"{ranges} row ranges (1 to {MAX_RANGES}: two an expert at most, so up to {MAX_RANGES // 2} experts)"
    return None


def _ranges(source_ref, r, spec: Ranges):
    """``(starts, ends)`` of the ranges numbered ``r`` (int32 vector; past the
    last: empty), as :func:`mosaic.row_ranges` makes them and
    :func:`mosaic.row_tile_table` clips them."""
    e, m = spec.experts, spec.m
    if spec.masked:
        group = jnp.where(r < e, r, r - e)
        counts = jnp.clip(plgpu.load(source_ref.at[jnp.clip(group, 0, e - 1)]), 0, spec.max_tokens)
        base = group * spec.max_tokens
        starts = jnp.where(r < e, base, base + counts)
        ends = jnp.where(r < e, base + counts, base + spec.max_tokens)
    else:

        def offset(i):
            return jnp.clip(plgpu.load(source_ref.at[jnp.clip(i, 0, e)]), 0, m)

        starts = jnp.where(r < e, offset(r), jnp.where(r == e, 0, offset(jnp.full_like(r, e))))
        ends = jnp.where(r < e, offset(r + 1), jnp.where(r == e, offset(jnp.zeros_like(r)), m))
    live = r < spec.count
    starts = jnp.where(live, jnp.clip(starts, 0, m), 0)
    return starts, jnp.where(live, jnp.maximum(jnp.clip(ends, 0, m), starts), 0)


def _tiles_of(starts, ends, block_m: int):
    """Each range's first load row (the multiple of 8 at or below its first row) and tile count."""
    aligned = starts - nonneg_rem(starts, ROW_ALIGN)
    return aligned, jnp.where(ends > starts, nonneg_div(ends - aligned + block_m - 1, block_m), 0)


def _kernel(
    source_ref, out_ref, *, spec: Ranges, width: int, num_experts: int, block_m: int, load_max: int, num_tiles: int
):
    _, per_range = _tiles_of(*_ranges(source_ref, jnp.arange(width, dtype=jnp.int32), spec), block_m)
    tile_ends = jnp.cumsum(per_range)
    total = jnp.sum(per_range)
    block = out_ref.shape[0]
    tile = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    before = tile_ends[None, :] <= tile[:, None]
    # searchsorted(tile_ends, tile, side="right"): the empty ranges padded at the end count
    # only for tiles past the last, whose index is clamped as the reference clamps it.
    index = jnp.minimum(jnp.sum(before.astype(jnp.int32), axis=1), spec.count - 1)
    starts, ends = _ranges(source_ref, index, spec)
    aligned, tiles_in = _tiles_of(starts, ends, block_m)
    # The range's first tile: the largest tile end at or below the tile (range ends do not
    # decrease); past the last tile, the last range's (the index was clamped to it).
    first_tile = jnp.where(tile < total, jnp.max(jnp.where(before, tile_ends[None, :], 0), axis=1), total - tiles_in)
    tile_start = aligned + (tile - first_tile) * block_m
    first = jnp.maximum(tile_start, starts)
    rows = jnp.clip(jnp.minimum(tile_start + block_m, ends) - first, 0, block_m)
    fields = (
        jnp.minimum(index, num_experts),
        jnp.clip(tile_start, 0, load_max),
        first,
        jnp.where(tile < total, rows, 0),
    )
    live = tile < num_tiles  # the last program's block reaches past the table
    for column, value in enumerate(fields):
        plgpu.store(out_ref.at[:, pl.ds(column, 1)], value[:, None], mask=live[:, None])


def row_tile_table(
    source: jax.Array,
    spec: Ranges,
    num_experts: int,
    block_m: int,
    *,
    num_tiles: int,
    load_max: int,
    tiles: TableTiles = TableTiles(),
    interpret: bool = False,
) -> jax.Array:
    """``[num_tiles, 4]`` int32, :func:`mosaic.row_tile_table
    <pallas_kernels.gemm.mosaic.row_tile_table>`'s table of the row ranges
    ``spec`` reads from ``source`` (int32 offsets or counts) cut into
    ``block_m``-row tiles; ``num_tiles`` its static bound on the tiles,
    ``load_max`` the largest load row."""
    reason = supports(spec.count)
    if reason:
        raise ValueError(f"row_tile_table: {reason}")
    width = pl.next_power_of_2(spec.count)
    block = max(1, min(tiles.block_tiles, tiles.block_tiles * 256 // width, pl.next_power_of_2(num_tiles)))
    kernel = functools.partial(
        _kernel,
        spec=spec,
        width=width,
        num_experts=num_experts,
        block_m=block_m,
        load_max=load_max,
        num_tiles=num_tiles,
    )
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tiles, block),),
        out_specs=pl.BlockSpec((block, FIELDS), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((num_tiles, FIELDS), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="moe_row_tile_table",
    )(source.astype(jnp.int32))
