"""Pallas kernels for routing and data movement of the expert path.

Grouping slots by expert (``moe_align_block_size``, ``moe_prepare_scatter``)
runs as three or four launches with no atomics — ``chunk_counts`` (each
slot's rank in its bin within a chunk), ``bin_prefix`` (and ``bin_starts``:
prefix sums over chunks and bins), ``place_slots`` (each slot to its place;
the aligned layout's padding and block experts) — so the result is
deterministic and exact in interpret mode (docs/DESIGN.md, appendix C). Row
movement (permute, unpermute, fused weighted sum) is a grid over
``block_tokens x block_cols`` tiles (:class:`RowTiles`) that gathers or
scatters whole rows. Notes: benchmarks/notes/routing.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import codecs

SUB_TILE = 128  # slots compared pairwise at a time


@dataclasses.dataclass(frozen=True)
class Grouping:
    """How slots map to bins. ``num_bins`` real bins; with ``invalid_bin`` the
    invalid slots form one more bin after them (``moe_prepare_scatter``), else
    they are dropped. ``map_groups``: bins are ``expert_map[id]`` (local ids);
    ``map_labels``: bins are global ids, block labels are ``expert_map[bin]``."""

    num_slots: int
    num_experts: int
    num_bins: int
    has_map: bool = False
    map_groups: bool = False
    invalid_bin: bool = False
    block_size: int = 1

    @property
    def total_bins(self) -> int:
        return self.num_bins + int(self.invalid_bin)

    @property
    def bins_padded(self) -> int:
        return max(16, pl.next_power_of_2(self.total_bins))


@dataclasses.dataclass(frozen=True)
class GroupingTiles:
    # Slots per program of chunk_counts / place_slots: one sub-tile (a chunk of
    # 512 costs 10 pairwise [128, 128] compares, a program's latency at decode).
    chunk: int = 128
    bin_tile: int = 128  # bins handled at a time
    chunk_tile: int = 64  # chunks handled at a time by bin_prefix
    # Bins per bin_prefix program: the prefix over chunks runs in parallel over
    # bin tiles (one program walking chunks x bins serialized the large cases).
    prefix_bins: int = 32
    # Count tiles a bin_prefix program loads before it scans any: their loads' latencies overlap
    # (a scan waits on its tile's load, and the next load issues only after the scan).
    held_tiles: int = 4
    unrolled_steps: int = 16  # (bin tile, chunk tile) steps a program unrolls; more run in a loop
    fill_positions: int = 256  # sorted_ids positions per fill program
    # Bins compared with the fill's positions at a time: [256, 128] compares
    # ran out of registers.
    fill_bin_tile: int = 32
    num_warps: int = 4

    def for_slots(self, num_slots: int) -> GroupingTiles:
        chunk = min(self.chunk, max(SUB_TILE, pl.next_power_of_2(num_slots)))
        return dataclasses.replace(self, chunk=chunk)


def slot_groups(ids_ref, map_ref, start, g: Grouping, width: int = SUB_TILE):
    """Bins of the slots ``[start, start + width)``: (group, valid), int32/bool."""
    slots = start + jnp.arange(width, dtype=jnp.int32)
    in_slots = slots < g.num_slots
    ids = plgpu.load(ids_ref.at[pl.ds(start, width)], mask=in_slots, other=-1)
    valid = in_slots & (ids >= 0) & (ids < g.num_experts)
    group = jnp.where(valid, ids, 0)
    if g.map_groups:
        local = plgpu.load(map_ref.at[group], mask=valid, other=-1)
        valid = valid & (local >= 0) & (local < g.num_bins)
        group = jnp.where(valid, local, 0)
    if g.invalid_bin:
        group = jnp.where(valid, group, g.num_bins)
        valid = in_slots
    return group, valid


def _counts_by_scatter(g: Grouping, tiles: GroupingTiles) -> bool:
    """Many bins: each bin's count is written by its last slot in the chunk
    (from the same pairwise compares as the ranks) into a zeroed row, instead
    of comparing every bin with every slot (bins x slots per chunk)."""
    return g.bins_padded > tiles.bin_tile


def _chunk_counts_kernel(ids_ref, *refs, g: Grouping, tiles: GroupingTiles):
    map_ref = refs[0] if g.has_map else None
    counts_ref, rank_ref = refs[-2:]
    chunk = pl.program_id(0)
    base = chunk * tiles.chunk
    subtiles = [slot_groups(ids_ref, map_ref, base + i * SUB_TILE, g) for i in range(tiles.chunk // SUB_TILE)]
    lane = jnp.arange(SUB_TILE, dtype=jnp.int32)
    scatter = _counts_by_scatter(g, tiles)
    for i, (group_i, valid_i) in enumerate(subtiles):
        rank = jnp.zeros(SUB_TILE, jnp.int32)
        later = jnp.zeros(SUB_TILE, jnp.int32)  # same-bin slots after this one (scatter only)
        for j, (group_j, valid_j) in enumerate(subtiles):
            if j > i and not scatter:
                break
            same = (group_i[:, None] == group_j[None, :]) & valid_j[None, :]
            if j <= i:
                rank += jnp.sum((same & (lane[None, :] < lane[:, None]) if j == i else same).astype(jnp.int32), axis=1)
            if scatter and j >= i:
                later += jnp.sum((same & (lane[None, :] > lane[:, None]) if j == i else same).astype(jnp.int32), axis=1)
        start = base + i * SUB_TILE
        plgpu.store(rank_ref.at[pl.ds(start, SUB_TILE)], rank, mask=start + lane < g.num_slots)
        if scatter:  # one writer per bin present in the chunk; absent bins keep the zeros
            last = valid_i & (later == 0)
            plgpu.store(counts_ref.at[chunk, codecs.scatter_index(group_i, last, g.bins_padded)], rank + 1, mask=last)
    if scatter:
        return
    width = min(tiles.bin_tile, g.bins_padded)
    for t in range(g.bins_padded // width):
        bins = t * width + jnp.arange(width, dtype=jnp.int32)
        count = jnp.zeros(width, jnp.int32)
        for group_i, valid_i in subtiles:
            count += jnp.sum(((bins[:, None] == group_i[None, :]) & valid_i[None, :]).astype(jnp.int32), axis=1)
        counts_ref[chunk, pl.ds(t * width, width)] = count


def _bin_prefix_kernel(
    counts_ref, base_ref, count_ref, *start_refs, g: Grouping, tiles: GroupingTiles, num_chunks: int, per_program: int
):
    """Program p: bin tiles ``p * per_program ...`` of ``prefix_bins`` bins —
    each chunk's base inside its bin (exclusive prefix over chunks) and each
    bin's count. With ``start_refs`` (a single program) also the bin starts."""
    width = _prefix_width(g, tiles)
    rows = tiles.chunk_tile
    steps = pl.cdiv(num_chunks, rows)
    firsts = [(pl.program_id(0) * per_program + local) * width for local in range(per_program)]
    # A traced start even when a tile's index is static: the last tile's masked rows reach past the
    # array, which a static start's bounds check refuses.
    zero = 0 * pl.program_id(0)

    def block(first, i):
        """The (index, mask) of chunk tile ``i`` of the bin tile from ``first``."""
        start = i * rows + zero
        chunk_ids = start + jnp.arange(rows, dtype=jnp.int32)
        bin_mask = first + jnp.arange(width, dtype=jnp.int32) < g.total_bins
        return (pl.ds(start, rows), pl.ds(first, width)), (chunk_ids < num_chunks)[:, None] & bin_mask[None, :]

    def scan(index, mask, tile, carry):
        inclusive = jnp.cumsum(tile, axis=0)
        plgpu.store(base_ref.at[index], inclusive - tile + carry[None, :], mask=mask)
        return carry + jnp.sum(tile, axis=0)

    per_tile = []
    if per_program * steps <= tiles.unrolled_steps:
        todo = [(t, i) for t in range(per_program) for i in range(steps)]
        carries = [jnp.zeros(width, jnp.int32) for _ in firsts]
        for group in range(0, len(todo), tiles.held_tiles):
            held = todo[group : group + tiles.held_tiles]
            blocks = [block(firsts[t], i) for t, i in held]
            loaded = [plgpu.load(counts_ref.at[index], mask=mask, other=0) for index, mask in blocks]
            for (t, _), (index, mask), tile in zip(held, blocks, loaded, strict=True):
                carries[t] = scan(index, mask, tile, carries[t])
        per_tile = carries
    else:
        for first in firsts:

            def over_chunks(i, carry, first=first):
                index, mask = block(first, i)
                return scan(index, mask, plgpu.load(counts_ref.at[index], mask=mask, other=0), carry)

            per_tile.append(jax.lax.fori_loop(0, steps, over_chunks, jnp.zeros(width, jnp.int32)))
    for first, totals in zip(firsts, per_tile, strict=True):
        count_ref[pl.ds(first, width)] = totals
    if start_refs:  # from the totals in registers (a reload of count_ref could race its stores)
        _write_starts(per_tile, *start_refs, g=g)


def _write_starts(per_tile: list, start_ref, post_pad_ref, *, g: Grouping):
    """Each bin's start (its count rounded up to the block size, prefix over
    bins; bins past the last get the total) and the padded total, from the
    bin counts in equal tiles ``per_tile``."""
    running = jnp.int32(0)
    for t, totals in enumerate(per_tile):
        width = totals.shape[0]
        padded = (totals + g.block_size - 1) // g.block_size * g.block_size
        start_ref[pl.ds(t * width, width)] = running + jnp.cumsum(padded) - padded
        running = running + jnp.sum(padded)
    start_ref[g.bins_padded] = running
    post_pad_ref[0] = running


def _bin_starts_kernel(count_ref, start_ref, post_pad_ref, *, g: Grouping, tiles: GroupingTiles):
    width = min(tiles.bin_tile, g.bins_padded)
    per_tile = [count_ref[pl.ds(t * width, width)] for t in range(g.bins_padded // width)]
    _write_starts(per_tile, start_ref, post_pad_ref, g=g)


def _prefix_width(g: Grouping, tiles: GroupingTiles) -> int:
    return min(tiles.prefix_bins, g.bins_padded)


def _bin_of_positions(start_ref, positions, g: Grouping, width: int):
    """The bin whose padded range holds each position (the last bin starting at or before it)."""
    found = jnp.zeros(positions.shape, jnp.int32)
    for t in range(g.bins_padded // width):
        bins = t * width + jnp.arange(width, dtype=jnp.int32)
        starts = plgpu.load(start_ref.at[pl.ds(t * width, width)], mask=bins < g.total_bins, other=2**30)
        found += jnp.sum((starts[None, :] <= positions[:, None]).astype(jnp.int32), axis=1)
    return jnp.maximum(found - 1, 0)


def _place_slots_kernel(ids_ref, *refs, g: Grouping, tiles: GroupingTiles, num_chunks: int, length: int, outputs: str):
    n_in = 5 + int(g.has_map)
    map_ref = refs[0] if g.has_map else None
    rank_ref, base_ref, start_ref, count_ref = refs[n_in - 5 : n_in - 1]
    outs = refs[n_in - 1 :]
    program = pl.program_id(0)
    lane = jnp.arange(SUB_TILE, dtype=jnp.int32)

    @pl.when(program < num_chunks)
    def _scatter():
        # The dropped slots of the chunks before this one follow the (padded) bins, in slot order.
        bins = jnp.arange(g.bins_padded, dtype=jnp.int32)
        valid_before = jnp.sum(plgpu.load(base_ref.at[program, bins], mask=bins < g.total_bins, other=0))
        dropped = start_ref[g.bins_padded] + program * tiles.chunk - valid_before
        for i in range(tiles.chunk // SUB_TILE):
            start = program * tiles.chunk + i * SUB_TILE
            group, valid = slot_groups(ids_ref, map_ref, start, g)
            slots = start + lane
            in_slots = slots < g.num_slots
            rank = plgpu.load(rank_ref.at[pl.ds(start, SUB_TILE)], mask=in_slots, other=0)
            chunk_base = plgpu.load(base_ref.at[program, group], mask=valid, other=0)
            dest = plgpu.load(start_ref.at[group], mask=valid, other=0) + chunk_base + rank
            lost = in_slots & ~valid
            order = dropped + jnp.cumsum(lost.astype(jnp.int32)) - 1
            dropped = dropped + jnp.sum(lost.astype(jnp.int32))
            if outputs == "sorted":
                plgpu.store(outs[0].at[codecs.scatter_index(dest, valid, length)], slots, mask=valid)
                plgpu.store(outs[0].at[codecs.scatter_index(order, lost, length)], slots, mask=lost)
            else:
                dest = jnp.where(valid, dest, order)
                plgpu.store(outs[0].at[pl.ds(start, SUB_TILE)], dest, mask=in_slots)
                plgpu.store(outs[1].at[codecs.scatter_index(dest, in_slots, g.num_slots)], slots, mask=in_slots)

    if outputs == "sorted":
        sorted_ref, expert_ids_ref = outs
        width = min(tiles.fill_bin_tile, g.bins_padded)
        per_program, blocks_per_program = tiles.fill_positions, fill_blocks(tiles.fill_positions, g.block_size)

        @pl.when(program >= num_chunks)
        def _fill():
            first = (program - num_chunks) * per_program
            positions = first + jnp.arange(per_program, dtype=jnp.int32)
            total = start_ref[g.bins_padded]
            group = _bin_of_positions(start_ref, positions, g, width)
            offset = positions - plgpu.load(start_ref.at[group])
            bins = jnp.arange(g.bins_padded, dtype=jnp.int32)
            valid = jnp.sum(plgpu.load(count_ref.at[bins], mask=bins < g.total_bins, other=0))
            listed = (positions >= total) & (positions < total + g.num_slots - valid)  # the dropped slots
            padding = ((offset >= plgpu.load(count_ref.at[group])) | (positions >= total)) & ~listed
            plgpu.store(
                sorted_ref.at[pl.ds(first, per_program)],
                jnp.full(per_program, g.num_slots, jnp.int32),
                mask=padding & (positions < length),
            )
            first_block = (program - num_chunks) * blocks_per_program
            block = first_block + jnp.arange(blocks_per_program, dtype=jnp.int32)
            block_start = block * g.block_size
            block_group = _bin_of_positions(start_ref, block_start, g, width)
            label = block_group
            if g.has_map and not g.map_groups:
                label = plgpu.load(map_ref.at[block_group])
            label = jnp.where(block_start < total, label, -1)
            plgpu.store(
                expert_ids_ref.at[pl.ds(first_block, blocks_per_program)],
                label,
                mask=block < pl.cdiv(length, g.block_size),
            )


def fill_blocks(fill_positions: int, block_size: int) -> int:
    """Blocks labelled per fill program: a power of two (a Triton vector), about
    as many as its ``fill_positions`` span — apart from the positions, so that a
    block size that is no power of two (24) leaves both vectors powers of two."""
    return pl.next_power_of_2(max(1, fill_positions // block_size))


def place_listed(sorted_ref, post_pad_ref, lane, dest, valid, lost, total, length: int) -> None:
    """A one-launch grouping's listing (program 0): each valid slot ``lane`` at
    its position ``dest``, the dropped ones in slot order after the ``total``
    padded-bin rows, and ``num_tokens_post_pad = total``."""
    plgpu.store(sorted_ref.at[codecs.scatter_index(dest, valid, length)], lane, mask=valid)
    order = total + jnp.cumsum(lost.astype(jnp.int32)) - 1
    plgpu.store(sorted_ref.at[codecs.scatter_index(order, lost, length)], lane, mask=lost)
    post_pad_ref[0] = total


def launch_one(kernel, name: str, topk_ids, expert_map, g: Grouping, outputs: str, length: int, tiles, interpret: bool):
    """A one-launch grouping kernel (``routing_one_launch``, ``routing_slot_space``)
    over the flattened ids: ``kernel(ids_ref, [map_ref], *outs, g, tiles,
    length, outputs)`` on a grid of fill programs (``sorted``) or one program
    (``dest``); the outputs of :func:`group_slots`. ``tiles`` has
    ``fill_positions`` and ``num_warps``."""
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    maps = [expert_map.astype(jnp.int32)] if g.has_map else []
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    if outputs == "sorted":
        num_blocks = pl.cdiv(length, g.block_size)
        blocks = fill_blocks(tiles.fill_positions, g.block_size)
        grid = max(1, pl.cdiv(length, tiles.fill_positions), pl.cdiv(num_blocks, blocks))
        out_shape = (i32((length,)), i32((num_blocks,)), i32((1,)))
    else:
        grid = 1
        out_shape = (i32((g.num_slots,)), i32((g.num_slots,)), i32((g.bins_padded + 1,)))
    return pl.pallas_call(
        functools.partial(kernel, g=g, tiles=tiles, length=length, outputs=outputs),
        grid=(grid,),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(ids, *maps)


def group_slots(
    topk_ids: jax.Array,
    expert_map: jax.Array | None,
    g: Grouping,
    *,
    outputs: str,
    length: int = 0,
    tiles: GroupingTiles = GroupingTiles(),
    interpret: bool = False,
):
    """Group the flattened slots of ``topk_ids`` into bins.

    ``outputs="sorted"``: returns ``sorted_ids [length]``, ``expert_ids
    [ceil(length/block_size)]``, ``num_tokens_post_pad [1]`` (the aligned
    layout; the dropped slots follow the padded bins in slot order).
    ``outputs="dest"``: returns ``dest [num_slots]`` (each slot's row; the
    invalid slots after every bin's rows, in slot order), ``inverse
    [num_slots]`` (each row's slot) and ``bin_start [bins_padded+1]`` (the
    bins' starts, then the count of valid slots).
    """
    # The invalid slots are listed after the bins, as the dropped ones of the aligned layout, with no
    # bin of their own: a bin more would double the padded bins at 128 or 256 experts.
    g = dataclasses.replace(g, invalid_bin=False)
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    tiles = tiles.for_slots(g.num_slots)
    num_chunks = pl.cdiv(g.num_slots, tiles.chunk)
    maps = [expert_map.astype(jnp.int32)] if g.has_map else []
    params = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)

    counts_inputs, aliases = [], {}
    if _counts_by_scatter(g, tiles):  # the counts start as zeros (bins absent from a chunk)
        counts_inputs, aliases = [jnp.zeros((num_chunks, g.bins_padded), jnp.int32)], {1 + len(maps): 0}
    counts, rank = pl.pallas_call(
        functools.partial(_chunk_counts_kernel, g=g, tiles=tiles),
        grid=(num_chunks,),
        out_shape=(i32((num_chunks, g.bins_padded)), i32((g.num_slots,))),
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="moe_chunk_counts",
    )(ids, *maps, *counts_inputs)
    bin_tiles = g.bins_padded // _prefix_width(g, tiles)
    prefix_shapes = (i32((num_chunks, g.bins_padded)), i32((g.bins_padded,)))
    starts_shapes = (i32((g.bins_padded + 1,)), i32((1,)))
    prefix = functools.partial(_bin_prefix_kernel, g=g, tiles=tiles, num_chunks=num_chunks)
    if num_chunks <= tiles.chunk_tile or bin_tiles == 1:
        # Little to walk: one program (no fourth launch) writes the starts too.
        chunk_base, bin_count, bin_start, post_pad = pl.pallas_call(
            functools.partial(prefix, per_program=bin_tiles),
            grid=(1,),
            out_shape=prefix_shapes + starts_shapes,
            compiler_params=params,
            interpret=interpret,
            name="moe_bin_prefix",
        )(counts)
    else:
        chunk_base, bin_count = pl.pallas_call(
            functools.partial(prefix, per_program=1),
            grid=(bin_tiles,),
            out_shape=prefix_shapes,
            compiler_params=params,
            interpret=interpret,
            name="moe_bin_prefix",
        )(counts)
        bin_start, post_pad = pl.pallas_call(
            functools.partial(_bin_starts_kernel, g=g, tiles=tiles),
            grid=(1,),
            out_shape=starts_shapes,
            compiler_params=params,
            interpret=interpret,
            name="moe_bin_starts",
        )(bin_count)
    if outputs == "sorted":
        blocks = fill_blocks(tiles.fill_positions, g.block_size)
        fills = max(pl.cdiv(length, tiles.fill_positions), pl.cdiv(pl.cdiv(length, g.block_size), blocks))
        grid = num_chunks + fills
        out_shape = (i32((length,)), i32((pl.cdiv(length, g.block_size),)))
    else:
        grid = num_chunks
        out_shape = (i32((g.num_slots,)), i32((g.num_slots,)))
    placed = pl.pallas_call(
        functools.partial(_place_slots_kernel, g=g, tiles=tiles, num_chunks=num_chunks, length=length, outputs=outputs),
        grid=(grid,),
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="moe_place_slots",
    )(ids, *maps, rank, chunk_base, bin_start, bin_count)
    if outputs == "sorted":
        return placed[0], placed[1], post_pad
    return placed[0], placed[1], bin_start


# ---------------------------------------------------------------------------
# row movement
# ---------------------------------------------------------------------------


MIN_ROW_PROGRAMS = 1024  # ~8 per SM: enough row gathers in flight to hide their latency


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """Tiling of the row-moving kernels (``scatter_rows``, ``gather_rows``,
    ``fused_mul_sum``): ``block_tokens`` token rows by ``block_cols`` columns
    a program on ``num_warps`` warps (powers of two); with few tokens
    :meth:`fit` halves ``block_tokens`` down to ``min_block_tokens``. These
    kernels take every call: a bad tiling raises when it is built."""

    block_tokens: int = 4
    block_cols: int = 256
    num_warps: int = 4
    min_block_tokens: int = 4

    def __post_init__(self):
        for name in ("block_tokens", "block_cols", "num_warps", "min_block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValueError(f"RowTiles.{name}: expected a power of two, got {value!r}")
        if self.block_cols < 16:
            raise ValueError(f"RowTiles.block_cols: expected at least 16, got {self.block_cols}")
        if self.num_warps > 32:
            raise ValueError(f"RowTiles.num_warps: expected at most 32, got {self.num_warps}")

    def fit(self, cols: int, tokens: int | None = None) -> RowTiles:
        """Columns capped to the row width; with ``tokens``, fewer token rows
        per program (down to ``min_block_tokens``) until the grid has
        ``MIN_ROW_PROGRAMS`` programs (small T: the row ops are latency-bound)."""
        block_cols = min(self.block_cols, max(16, pl.next_power_of_2(cols)))
        block_tokens = self.block_tokens
        if tokens is not None:
            col_tiles = pl.cdiv(cols, block_cols)
            while block_tokens > self.min_block_tokens and pl.cdiv(tokens, block_tokens) * col_tiles < MIN_ROW_PROGRAMS:
                block_tokens //= 2
        return dataclasses.replace(self, block_cols=block_cols, block_tokens=block_tokens)


def _tile_rows_cols(tiles: RowTiles, num_rows: int, num_cols: int):
    """Token rows ``[BT]`` and columns ``[1, BC]`` of this program, with masks. Rows
    and columns are both index arrays (not slices) so that one indexer can mix
    a gathered row with a column range (interpret mode takes no mixed indexers)."""
    rows = pl.program_id(0) * tiles.block_tokens + jnp.arange(tiles.block_tokens, dtype=jnp.int32)
    cols = pl.program_id(1) * tiles.block_cols + jnp.arange(tiles.block_cols, dtype=jnp.int32)
    return rows, cols[None, :], rows < num_rows, (cols < num_cols)[None, :]


def _scatter_rows_kernel(x_ref, dest_ref, end_ref, out_ref, *, tiles: RowTiles, top_k: int):
    num_tokens, num_cols = x_ref.shape
    tokens, cols, token_mask, col_mask = _tile_rows_cols(tiles, num_tokens, num_cols)
    mask = token_mask[:, None] & col_mask
    x = plgpu.load(x_ref.at[tokens[:, None], cols], mask=mask, other=0)
    end = end_ref[0]
    for j in range(top_k):
        dest = plgpu.load(dest_ref.at[tokens * top_k + j], mask=token_mask, other=0)
        row = jnp.where((dest < end)[:, None], x, jnp.zeros_like(x))
        dest = codecs.scatter_index(dest, token_mask, out_ref.shape[0])
        plgpu.store(out_ref.at[dest[:, None], cols], row, mask=mask)


def scatter_rows(
    x: jax.Array, dest: jax.Array, end: jax.Array, top_k: int, *, tiles: RowTiles = RowTiles(), interpret: bool = False
) -> jax.Array:
    """``out[dest[t*k + j]] = x[t]`` for rows ``dest < end[0]``, zeros for the
    other destinations. ``dest`` must be a permutation of ``[0, T*k)``."""
    num_tokens, num_cols = x.shape
    tiles = tiles.fit(num_cols, num_tokens)
    bits = _as_bits(x)
    moved = pl.pallas_call(
        functools.partial(_scatter_rows_kernel, tiles=tiles, top_k=top_k),
        grid=(pl.cdiv(num_tokens, tiles.block_tokens), pl.cdiv(num_cols, tiles.block_cols)),
        out_shape=jax.ShapeDtypeStruct((num_tokens * top_k, num_cols), bits.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="moe_scatter_rows",
    )(bits, dest, end)
    return jax.lax.bitcast_convert_type(moved, x.dtype)


def _as_bits(x: jax.Array) -> jax.Array:
    """``x`` viewed as unsigned integers of its width: the scatter moves bits, and
    Triton's masked load cannot make its fill value in an fp8 type."""
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _weighted_gather_kernel(
    x_ref,
    index_ref,
    weight_ref,
    bound_ref,
    *refs,
    tiles: RowTiles,
    top_k: int,
    mode: str,
    num_experts: int,
    has_map: bool,
):
    map_ref = refs[0] if has_map else None
    out_ref = refs[-1]
    num_tokens, num_cols = out_ref.shape
    tokens, cols, token_mask, col_mask = _tile_rows_cols(tiles, num_tokens, num_cols)
    bound = bound_ref[0]
    acc = jnp.zeros((tiles.block_tokens, tiles.block_cols), jnp.float32)
    for j in range(top_k):
        slot = tokens * top_k + j
        index = plgpu.load(index_ref.at[slot], mask=token_mask, other=-1)
        weight = plgpu.load(weight_ref.at[slot], mask=token_mask, other=0).astype(jnp.float32)
        if mode == "unpermute":  # index is the permuted row; rows past bound are not local
            valid = token_mask & (index >= 0) & (index < bound)
            source = x_ref.at[jnp.where(valid, index, 0)[:, None], cols]
            rows = plgpu.load(source, mask=valid[:, None] & col_mask, other=0).astype(jnp.float32)
            acc += rows * jnp.where(valid, weight, 0.0)[:, None]
            continue
        # index is the expert id; bound limits the token rows. Without a map
        # nearly every slot is valid: its row is loaded whatever its id (the
        # address does not depend on it, so the loads of the ids and of the rows
        # overlap) and selected, not multiplied, away (an invalid slot's row may
        # hold anything, NaN included). With one, most slots may be another
        # rank's: their rows are not read.
        source = x_ref.at[tokens[:, None], j, cols]
        valid = token_mask & (index >= 0) & (index < num_experts) & (tokens < bound)
        if has_map:
            local = plgpu.load(map_ref.at[jnp.where(valid, index, 0)], mask=valid, other=-1)
            valid = valid & (local >= 0)
            rows = plgpu.load(source, mask=valid[:, None] & col_mask, other=0)
        else:
            rows = plgpu.load(source, mask=token_mask[:, None] & col_mask, other=0)
        acc += jnp.where(valid[:, None], rows.astype(jnp.float32) * weight[:, None], 0.0)
    plgpu.store(out_ref.at[tokens[:, None], cols], acc.astype(out_ref.dtype), mask=token_mask[:, None] & col_mask)


def weighted_gather(
    x: jax.Array,
    index: jax.Array,
    weights: jax.Array,
    bound: jax.Array,
    num_tokens: int,
    top_k: int,
    *,
    mode: str,
    num_experts: int = 0,
    expert_map: jax.Array | None = None,
    tiles: RowTiles = RowTiles(),
    interpret: bool = False,
) -> jax.Array:
    """Weighted top-k reduce, fp32 accumulation, output ``[T, N]`` in ``x``'s dtype.

    ``mode="unpermute"``: ``x [M, N]``, ``index [T*k]`` permuted rows; slots
    whose row is ``>= bound[0]`` contribute zero.
    ``mode="fused_mul_sum"``: ``x [T, k, N]``, ``index [T*k]`` expert ids; slots
    with ids outside ``[0, num_experts)`` or mapped to -1 contribute zero, and
    token rows ``>= bound[0]`` are zero.
    """
    num_cols = x.shape[-1]
    tiles = tiles.fit(num_cols, num_tokens)
    maps = [expert_map.astype(jnp.int32)] if expert_map is not None else []
    return pl.pallas_call(
        functools.partial(
            _weighted_gather_kernel,
            tiles=tiles,
            top_k=top_k,
            mode=mode,
            num_experts=num_experts,
            has_map=expert_map is not None,
        ),
        grid=(pl.cdiv(num_tokens, tiles.block_tokens), pl.cdiv(num_cols, tiles.block_cols)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_cols), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name=f"moe_{mode}",
    )(x, index.reshape(-1).astype(jnp.int32), weights.reshape(-1), bound.reshape(-1)[:1].astype(jnp.int32), *maps)
