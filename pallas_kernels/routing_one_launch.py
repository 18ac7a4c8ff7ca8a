"""Grouping of few slots (T·k ≤ 128) in one launch.

The same results as :func:`pallas_kernels.routing.group_slots` (the aligned
layout or each slot's destination, deterministic, no atomics) for the decode
case, where the three launches of the general kernel cost more than their
work: every program ranks all slots by one pairwise compare and counts the
bins itself, so no prefix pass is needed between launches. Program 0 places
the slots; the programs share the aligned layout's padding and block labels.
Notes: benchmarks/notes/routing.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import codecs
from pallas_kernels.routing import SUB_TILE, Grouping, fill_blocks, launch_one, place_listed, slot_groups

MAX_SLOTS = SUB_TILE  # one pairwise-compared tile of slots


@dataclasses.dataclass(frozen=True)
class Tiles:
    """``bin_tile`` bins compared with the slots (or fill positions) at a time;
    ``fill_positions`` aligned positions per program (powers of two)."""

    bin_tile: int = 32
    fill_positions: int = 256
    num_warps: int = 8


def supports(g: Grouping, tiles: Tiles = Tiles()) -> str | None:
    """None when one launch groups these slots, else why not."""
    if g.num_slots > MAX_SLOTS:
        return f"{g.num_slots} slots: one program ranks at most {MAX_SLOTS}"
    for name in ("bin_tile", "fill_positions", "num_warps"):
        value = getattr(tiles, name)
        if value < 1 or value & (value - 1):
            return f"Tiles.{name}={value}: expected a power of two"
    return None


def _bin_tiles(g: Grouping, tiles: Tiles):
    width = min(tiles.bin_tile, g.bins_padded)
    return [t * width + jnp.arange(width, dtype=jnp.int32) for t in range(g.bins_padded // width)]


def _kernel(ids_ref, *refs, g: Grouping, tiles: Tiles, length: int, outputs: str):
    map_ref = refs[0] if g.has_map else None
    outs = refs[int(g.has_map) :]
    lane = jnp.arange(SUB_TILE, dtype=jnp.int32)
    in_slots = lane < g.num_slots
    group, valid = slot_groups(ids_ref, map_ref, 0, g)
    # Every compare is [bins or earlier slots, slots] and reduced over axis 0, so that the
    # per-slot and per-position results share one layout (no conversion between bin tiles).
    earlier = (group[:, None] == group[None, :]) & valid[:, None] & (lane[:, None] < lane[None, :])
    rank = jnp.sum(earlier.astype(jnp.int32), axis=0)

    # Each bin's count and padded start; each slot's row = the padded rows of the bins before its own + its rank.
    bins_starts_counts = []
    below = jnp.zeros(SUB_TILE, jnp.int32)
    total = jnp.int32(0)
    for bins in _bin_tiles(g, tiles):
        count = jnp.sum(((bins[:, None] == group[None, :]) & valid[None, :]).astype(jnp.int32), axis=1)
        padded = (count + g.block_size - 1) // g.block_size * g.block_size
        start = total + jnp.cumsum(padded) - padded
        below += jnp.sum(jnp.where(bins[:, None] < group[None, :], padded[:, None], 0), axis=0)
        total = total + jnp.sum(padded)
        bins_starts_counts.append((bins, start, count))
    dest = below + rank
    program = pl.program_id(0)

    if outputs == "dest":
        dest_ref, inverse_ref, start_ref = outs
        plgpu.store(dest_ref.at[pl.ds(0, SUB_TILE)], dest, mask=in_slots)
        plgpu.store(inverse_ref.at[codecs.scatter_index(dest, in_slots, g.num_slots)], lane, mask=in_slots)
        for t, (bins, start, _) in enumerate(bins_starts_counts):
            start_ref[pl.ds(t * bins.shape[0], bins.shape[0])] = start
        start_ref[g.bins_padded] = total
        return

    sorted_ref, expert_ids_ref, post_pad_ref = outs
    lost = in_slots & ~valid  # dropped slots: listed in slot order after the padded bins
    num_lost = jnp.sum(lost.astype(jnp.int32))

    @pl.when(program == 0)
    def _place():
        place_listed(sorted_ref, post_pad_ref, lane, dest, valid, lost, total, length)

    # Padding: positions no bin's slots fill and past the listed dropped slots.
    positions = program * tiles.fill_positions + jnp.arange(tiles.fill_positions, dtype=jnp.int32)
    held = (positions >= total) & (positions < total + num_lost)
    for _, start, count in bins_starts_counts:
        inside = (start[:, None] <= positions[None, :]) & (positions[None, :] < (start + count)[:, None])
        held = held | (jnp.sum(inside.astype(jnp.int32), axis=0) > 0)
    plgpu.store(
        sorted_ref.at[pl.ds(program * tiles.fill_positions, tiles.fill_positions)],
        jnp.full(tiles.fill_positions, g.num_slots, jnp.int32),
        mask=~held & (positions < length),
    )

    # Each block's label: the last bin starting at or before it (empty bins start where the next does).
    per_program = fill_blocks(tiles.fill_positions, g.block_size)
    blocks = program * per_program + jnp.arange(per_program, dtype=jnp.int32)
    block_start = blocks * g.block_size
    found = jnp.zeros(per_program, jnp.int32)
    for bins, start, _ in bins_starts_counts:
        before = (start[:, None] <= block_start[None, :]) & (bins < g.total_bins)[:, None]
        found += jnp.sum(before.astype(jnp.int32), axis=0)
    label = jnp.maximum(found - 1, 0)
    in_use = block_start < total
    if g.has_map and not g.map_groups:
        label = plgpu.load(map_ref.at[label], mask=in_use, other=-1)
    plgpu.store(
        expert_ids_ref.at[pl.ds(program * per_program, per_program)],
        jnp.where(in_use, label, -1),
        mask=blocks < pl.cdiv(length, g.block_size),
    )


def group_slots(
    topk_ids: jax.Array,
    expert_map: jax.Array | None,
    g: Grouping,
    *,
    outputs: str,
    length: int = 0,
    tiles: Tiles = Tiles(),
    interpret: bool = False,
):
    """:func:`pallas_kernels.routing.group_slots` in one launch for at most
    ``MAX_SLOTS`` slots (see :func:`supports`); the same outputs."""
    reason = supports(g, tiles)
    if reason is not None:
        raise ValueError(f"routing_one_launch.group_slots: {reason}")
    return launch_one(_kernel, "moe_group_slots_one_launch", topk_ids, expert_map, g, outputs, length, tiles, interpret)
