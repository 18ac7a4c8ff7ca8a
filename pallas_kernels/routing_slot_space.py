"""Grouping of few slots (T·k ≤ 128) in one launch, reckoned in slot space.

The same results as :func:`pallas_kernels.routing.group_slots` (the aligned
layout or each slot's destination, deterministic, no atomics) for the decode
case, where the three launches of the general kernel cost more than their
work. :mod:`pallas_kernels.routing_one_launch` counts every bin (work in
bins); this kernel works in slots² and wins where the slots are few against
the bins (the op picks). One pairwise compare of the slots (padded to a power
of two, not to 128) gives each slot's rank in its bin and its bin's count; a
bin's padded rows sit on its first slot, so the rows of the bins below a slot
are one more masked sum — a few reductions in all, where counting every bin
takes a chain of them per tile of bins. The bins' padding and block labels
are then stores from the bins' first slots; the tail past the used rows is a
plain fill, spread over the programs.
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
MIN_SLOT_TILE = 16  # the smallest Triton vector of slots compared
PAD_TILE = 128  # padding rows a bin's first slot stores at a time
BIN_TILE_LANES = 4096  # bins x slots compared at a time for the scatter's bin starts


@dataclasses.dataclass(frozen=True)
class Tiles:
    """``fill_positions`` aligned positions each program fills past the used
    rows (a power of two)."""

    fill_positions: int = 1024
    num_warps: int = 8


def supports(g: Grouping, tiles: Tiles = Tiles()) -> str | None:
    """None when one launch groups these slots, else why not."""
    if g.num_slots > MAX_SLOTS:
        return f"{g.num_slots} slots: one program ranks at most {MAX_SLOTS}"
    for name in ("fill_positions", "num_warps"):
        value = getattr(tiles, name)
        if value < 1 or value & (value - 1):
            return f"Tiles.{name}={value}: expected a power of two"
    return None


def slot_tile(g: Grouping) -> int:
    """Slots compared pairwise: the slots padded to a power of two."""
    return max(MIN_SLOT_TILE, pl.next_power_of_2(g.num_slots))


def _bins_of_slots(ids_ref, map_ref, g: Grouping):
    """Each slot's bin, whether it is grouped, its rank among its bin's earlier
    slots, and on each bin's first slot the bin's count and padded rows (0
    elsewhere); each slot's row (the padded rows of the bins below + rank);
    the padded rows of all bins. Vectors of :func:`slot_tile` lanes."""
    width = slot_tile(g)
    lane = jnp.arange(width, dtype=jnp.int32)
    group, valid = slot_groups(ids_ref, map_ref, 0, g, width=width)
    # Compares are [other slot j, slot i], reduced over j: every per-slot vector shares one layout.
    same = (group[:, None] == group[None, :]) & valid[:, None]
    rank = jnp.sum((same & (lane[:, None] < lane[None, :])).astype(jnp.int32), axis=0)
    count = jnp.sum(same.astype(jnp.int32), axis=0)
    first = valid & (rank == 0)
    count = jnp.where(first, count, 0)
    padded = (count + g.block_size - 1) // g.block_size * g.block_size
    below = jnp.sum(jnp.where(group[:, None] < group[None, :], padded[:, None], 0), axis=0)
    return group, valid, rank, first, count, padded, below + rank, jnp.sum(padded)


def _kernel(ids_ref, *refs, g: Grouping, tiles: Tiles, length: int, outputs: str):
    map_ref = refs[0] if g.has_map else None
    outs = refs[int(g.has_map) :]
    width = slot_tile(g)
    lane = jnp.arange(width, dtype=jnp.int32)
    in_slots = lane < g.num_slots
    group, valid, rank, first, count, padded, dest, total = _bins_of_slots(ids_ref, map_ref, g)
    below = dest - rank  # each slot's bin's first row
    program = pl.program_id(0)

    if outputs == "dest":
        dest_ref, inverse_ref, start_ref = outs
        plgpu.store(dest_ref.at[pl.ds(0, width)], dest, mask=in_slots)
        plgpu.store(inverse_ref.at[codecs.scatter_index(dest, in_slots, g.num_slots)], lane, mask=in_slots)
        # Each bin's start: the padded rows of the bins below it (empty bins too).
        bin_tile = min(g.bins_padded, max(16, BIN_TILE_LANES // width))
        for t in range(g.bins_padded // bin_tile):
            bins = t * bin_tile + jnp.arange(bin_tile, dtype=jnp.int32)
            start = jnp.sum(jnp.where(group[None, :] < bins[:, None], padded[None, :], 0), axis=1)
            start_ref[pl.ds(t * bin_tile, bin_tile)] = start
        start_ref[g.bins_padded] = total
        return

    sorted_ref, expert_ids_ref, post_pad_ref = outs
    lost = in_slots & ~valid  # dropped slots: listed in slot order after the padded bins
    num_lost = jnp.sum(lost.astype(jnp.int32))
    sentinel = g.num_slots
    block = g.block_size

    @pl.when(program == 0)
    def _place():
        place_listed(sorted_ref, post_pad_ref, lane, dest, valid, lost, total, length)
        # Each bin's padding (at most block - 1 rows after its slots), stored by its first slot.
        pads = padded - count
        for r0 in range(0, pl.next_power_of_2(block), PAD_TILE):
            r = r0 + jnp.arange(min(PAD_TILE, pl.next_power_of_2(block)), dtype=jnp.int32)
            mask = first[:, None] & (r[None, :] < pads[:, None])
            at = (below + count)[:, None] + r[None, :]
            plgpu.store(
                sorted_ref.at[codecs.scatter_index(at, mask, length)],
                jnp.full(at.shape, sentinel, jnp.int32),
                mask=mask,
            )
        # Each bin's blocks labelled by its first slot.
        label = group
        if g.has_map and not g.map_groups:
            label = plgpu.load(map_ref.at[group], mask=first, other=-1)
        per_bin = jnp.arange(pl.next_power_of_2(pl.cdiv(width, block)), dtype=jnp.int32)
        mask = first[:, None] & (per_bin[None, :] < (padded // block)[:, None])
        at = (below // block)[:, None] + per_bin[None, :]
        num_blocks = pl.cdiv(length, block)
        plgpu.store(
            expert_ids_ref.at[codecs.scatter_index(at, mask, num_blocks)],
            jnp.broadcast_to(label[:, None], at.shape),
            mask=mask,
        )

    # Past the padded bins and the dropped slots: the sentinel, and blocks of no expert.
    positions = program * tiles.fill_positions + jnp.arange(tiles.fill_positions, dtype=jnp.int32)
    plgpu.store(
        sorted_ref.at[pl.ds(program * tiles.fill_positions, tiles.fill_positions)],
        jnp.full(tiles.fill_positions, sentinel, jnp.int32),
        mask=(positions >= total + num_lost) & (positions < length),
    )
    per_program = fill_blocks(tiles.fill_positions, block)
    blocks = program * per_program + jnp.arange(per_program, dtype=jnp.int32)
    plgpu.store(
        expert_ids_ref.at[pl.ds(program * per_program, per_program)],
        jnp.full(per_program, -1, jnp.int32),
        mask=(blocks * block >= total) & (blocks < pl.cdiv(length, block)),
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
        raise ValueError(f"routing_slot_space.group_slots: {reason}")
    return launch_one(_kernel, "moe_group_slots_slot_space", topk_ids, expert_map, g, outputs, length, tiles, interpret)
