"""``process_input``'s Hadamard rotation + fp8 per-token quantization on Mosaic
GPU (Hopper): TMA loads of whole row tiles into shared memory, the rotation
on the tensor cores, TMA stores.

The Triton kernel (:mod:`pallas_kernels.process_input`) holds a row block's
rotated values in registers until the row's max is known; at narrow rows
(K=768) the compiler's schedule leaves it latency-bound at ~0.6 of the copy
bandwidth whatever the tiling. Here a memory warpgroup streams tiles of
``ROWS`` tokens × K columns into shared memory (``stages`` tiles in flight,
each as K/64 swizzled ``[ROWS, 64]`` pieces, each piece with barriers of its
own: it is processed as soon as it lands and refilled with the next tile's
as soon as every compute warpgroup is done with it). The tile is taken in
two passes from shared memory: the first multiplies each 64-column piece by
the ±1 matrix H_64 (``wgmma``, f32 accumulators), combines the pieces of a
Hadamard block by butterflies (H_b = H_{b/64} ⊗ H_64) and keeps the
elementwise max of ``|y|``; the second takes the same products again (the
operands are still in shared memory; the tensor cores are otherwise idle),
scales by ``1/sqrt(b)`` and the row's ``448 / amax``, converts to e4m3 and
stores each part through a shared-memory slot. No rotated value is held
across the row, so the registers do not grow with K.

Two ways to share a tile between 1 to 3 compute warpgroups: each takes its
share of the Hadamard blocks through both passes (the row max combined
through shared memory behind a barrier), or (``max_warpgroup``) the first
takes the first pass over all blocks, a tile ahead of the others, which
take the second pass over their share: the row max of a tile is found while
the last tile's stores stream.

The re-read form (``reread``, :func:`_reread_kernel`) keeps no tile: the
memory warpgroup streams each tile twice, Hadamard block by Hadamard block,
into one ring a consumer — once
from DRAM for the max warpgroup, once more (from L2, a step later) for the
quantizing ones — so shared memory bounds the blocks in flight, not the
tiles, and up to 4 compute warpgroups fit (their registers raised only by
what the memory warpgroup gives back). Its max pass takes ``|a| + |b|`` for a
128-block's pair ``(a + b, a - b)`` (the same f32 max, one add) and its
quantizing pass multiplies by ``(1/sqrt(b)) · (1/scale)`` once (one rounding
less than the Triton kernel: a rare code one e4m3 step apart). With
``self_loads`` the compute warpgroups fill their own rings (no memory
warpgroup).

The own-rings form (``own_rings``, :func:`_own_rings_kernel`) has neither a
max nor a memory warpgroup: each compute warpgroup streams its share of each
tile's Hadamard blocks through a ring it fills itself and takes both passes
from it, the row max combined through shared memory a tile at a time — no
pass waits for another warpgroup's earlier tile, so a program has no
pipeline fill or drain (a fifth of the re-read form's time at 4 tiles a
program). With 2 warpgroups (rings of 5 blocks of 128 for a share of 3) it
is the default for its case from 16384 rows: at K=768, T=4096 30.4 µs
against the re-read form's 31.9 on the H200; its speed follows how many of
its shares a ring holds (one share at 4 warpgroups: 39.5 µs).

The arithmetic is the Triton kernel's with 64-column products (the
reference's up to f32 summation order): ``y = butterflies(x_p · H_64) ·
(1/sqrt(b))``, ``scale = max|y| / 448`` (the max taken before the
``1/sqrt(b)`` factor, which is exact: rounding is monotonic), values
``e4m3(y · (1/scale))`` saturating, rows at or past ``num_valid_tokens``
zero (values and scale).

Kernels only: validation and the backend choice live in ``humming_jax``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_mosaic import persistent_programs, swizzled
from pallas_kernels.process_input import FLOAT8_E4M3_MAX, butterflies

ROWS = 64  # tokens a tile: one wgmma's M
SUB = 64  # columns of one product: H_64, a 128-byte swizzled bf16 row
SMEM_LIMIT = 227 * 1024  # shared memory a Hopper program may take
MAX_RING_BYTES = 48 * 1024  # the re-read form's max-warpgroup ring: 3 blocks of 128 (measured best at K=768)


@dataclasses.dataclass(frozen=True)
class MosaicRotation:
    """Static description of one launch: rows of ``k`` bf16 columns rotated
    in Hadamard blocks of ``hadamard`` (64 or 128) and quantized to e4m3 per
    token; ``stages`` row tiles in flight; ``warpgroups`` compute warpgroups
    (1 to 3; up to 4 with ``reread``). Without ``max_warpgroup`` they share
    each tile's Hadamard blocks, each taking the row max of its blocks
    (combined through shared memory) and then quantizing them. With
    ``max_warpgroup`` the first takes each tile's row max over all its blocks
    and the scales, a step ahead of the others, which quantize the blocks of
    the tile before: the first pass runs while the second's stores stream.
    ``reread`` (with ``max_warpgroup``): no tile is held — rings of Hadamard
    blocks a consumer instead of ``stages`` (see :func:`_reread_kernel`)."""

    k: int
    hadamard: int
    stages: int = 2
    warpgroups: int = 1
    max_warpgroup: bool = False
    # The second pass re-reads its tile from L2 through rings of Hadamard blocks
    # of its own (see _reread_kernel) instead of holding whole tiles.
    reread: bool = False
    # Output slots a quantizing warpgroup (0: 2 where they fit, else 1).
    output_slots: int = 0
    # The re-read form's Hadamard blocks an output slot holds: one fence (and one
    # wait for the slot) for this many blocks, their copies one group.
    blocks_per_slot: int = 1
    # Write every part with the select for rows past the valid tokens, instead of
    # a branch for tiles that have such rows and one for tiles that do not.
    select_store: bool = False
    # The compiler's warpgroup barriers around every shared-memory load and store
    # (False: the re-read form's own synchronization only — safe there: no thread
    # reads a region it writes, and every slot is rewritten after a wait that
    # carries a warpgroup barrier: commit_smem, wait_smem_to_gmem, an mbarrier).
    auto_barriers: bool = True
    # The re-read form without a memory warpgroup: each compute warpgroup issues
    # its own ring's loads, a slot refilled as soon as its products are taken
    # (no free barriers; a wait for one consumer's slot cannot hold back the
    # others' loads; 4 warpgroups launch with 128 registers a thread).
    self_loads: bool = False
    # Neither a max nor a memory warpgroup: each compute warpgroup streams its
    # share of each tile's Hadamard blocks through a ring of its own and takes
    # both passes from it (the row max combined through shared memory), no
    # pipeline fill or drain (see _own_rings_kernel).
    own_rings: bool = False
    # The re-read form's max-warpgroup ring in Hadamard blocks (0: MAX_RING_BYTES,
    # up to a tile); the quantizing warpgroups' rings share the rest.
    first_ring: int = 0
    # Ranges a warpgroup the on-device profiler may record (0: off): its buffer
    # takes shared memory (16 bytes a range and warpgroup), the rings shrink.
    profile_ranges: int = 0

    @property
    def parts(self) -> int:
        """64-column products of a Hadamard block."""
        return self.hadamard // SUB

    @property
    def longest_share(self) -> int:
        """The most Hadamard blocks of a tile one quantizing warpgroup takes (:meth:`block_ranges`)."""
        return max(last - first for first, last in self.block_ranges())

    @property
    def blocks(self) -> int:
        return self.k // self.hadamard

    @property
    def quantizers(self) -> int:
        """Warpgroups that quantize (and store values)."""
        return self.warpgroups - self.max_warpgroup

    def block_ranges(self) -> list[tuple[int, int]]:
        """Each quantizing warpgroup's Hadamard blocks ``[first, last)``, as even as they divide."""
        cuts = [w * self.blocks // self.quantizers for w in range(self.quantizers + 1)]
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def fixed_bytes(self, slots: int) -> int:
        """Shared memory besides the inputs: ``slots`` output slots a quantizing
        warpgroup, H_64, the scale and row-max slots, the compiler's reduction
        scratch (2 KB) and the barriers."""
        # The re-read form's output slots hold a whole Hadamard block (one fence and one copy group a block).
        slot_parts = self.parts * self.blocks_per_slot if self.reread or self.own_rings else 1
        outputs = self.quantizers * slots * ROWS * SUB * slot_parts
        maxima = 2 * ROWS * 4 * (1 if self.max_warpgroup else self.warpgroups)
        profile = self.profile_ranges * 16 * (self.warpgroups + 1)
        return outputs + SUB * SUB * 2 + ROWS * 4 + maxima + 3072 + profile

    @property
    def block_bytes(self) -> int:
        """One Hadamard block of a tile, bf16: the re-read form's ring item."""
        return ROWS * self.hadamard * 2

    def blocks_of(self, q: int) -> range:
        """The re-read form's quantizing warpgroup ``q``: every ``quantizers``-th
        block (interleaved, so that the loads of both passes alternate)."""
        return range(q, self.blocks, self.quantizers)

    def rings(self, slots: int | None = None) -> tuple[int, int]:
        """The re-read form's ring lengths in Hadamard blocks: the max warpgroup's
        (``first_ring``, else ``MAX_RING_BYTES`` up to a tile: the first pass's
        lookahead) and each quantizing warpgroup's (the rest, up to two tiles'
        share: a larger ring lets the memory warpgroup issue a tile's re-reads
        without waiting on the quantizing warpgroups, which would hold back the
        max warpgroup's loads queued behind them)."""
        items = (SMEM_LIMIT - self.fixed_bytes(slots or self.slots)) // self.block_bytes
        first = self.first_ring or min(self.blocks, -(-MAX_RING_BYTES // self.block_bytes), items // 2)
        share = len(self.blocks_of(0))
        return first, min(2 * share, (items - first) // max(self.quantizers, 1))

    def own_ring(self, slots: int | None = None) -> int:
        """The own-rings form's ring a warpgroup, in Hadamard blocks: up to two
        tiles' share of its blocks (one held for both passes, one loading)."""
        items = (SMEM_LIMIT - self.fixed_bytes(slots or self.slots)) // self.block_bytes
        return min(2 * self.longest_share, items // self.warpgroups)

    def smem_bytes_with(self, slots: int) -> int:
        """Input stages (or rings) and the rest (:meth:`fixed_bytes`)."""
        if self.own_rings:
            return self.warpgroups * self.own_ring(slots) * self.block_bytes + self.fixed_bytes(slots)
        if self.reread:
            first, second = self.rings(slots)
            inputs = (first + self.quantizers * second) * self.block_bytes
        else:
            inputs = self.stages * ROWS * self.k * 2
        return inputs + self.fixed_bytes(slots)

    @property
    def slots(self) -> int:
        """Output slots a warpgroup: 2 (a part converts while the last one's copy reads)
        where they fit, else 1."""
        if self.output_slots:
            return self.output_slots
        if self.own_rings:  # two slots where the rings still hold a tile's share
            return 2 if self.own_ring(2) >= self.longest_share else 1
        return 2 if self.smem_bytes_with(2) <= SMEM_LIMIT else 1

    @property
    def smem_bytes(self) -> int:
        return self.smem_bytes_with(self.slots)


def refusal(cfg: MosaicRotation) -> str | None:
    """Why the kernel cannot take ``cfg`` (None if it can)."""
    if cfg.hadamard not in (SUB, 2 * SUB):
        return f"Hadamard blocks of {SUB} or {2 * SUB} columns, got {cfg.hadamard}"
    if cfg.k % cfg.hadamard:
        return f"rows of whole Hadamard blocks, got K={cfg.k} with blocks of {cfg.hadamard}"
    if cfg.warpgroups not in ((1, 2, 3, 4) if cfg.reread or cfg.own_rings else (1, 2, 3)):
        # Four in the Pallas pipeline would launch 640 threads with 96 registers each (61440 of the
        # 65536) while it raises the compute warpgroups to (512 - 40) / 4 -> 112: setmaxnreg waits
        # forever. The re-read form raises them only by what the memory warpgroup gives back;
        # the own-rings form has no memory warpgroup.
        return f"1 to 3 compute warpgroups (4 in the re-read and own-rings forms), got {cfg.warpgroups}"
    if cfg.max_warpgroup and cfg.warpgroups < 2:
        return f"a warpgroup for the row max and one or more to quantize, got {cfg.warpgroups} warpgroups"
    if not (cfg.auto_barriers or cfg.reread or cfg.own_rings):
        return (
            "the compiler's barriers (auto_barriers) in the pipelined form; only the re-read and own-rings forms go "
            "without"
        )
    if cfg.blocks_per_slot < 1 or (cfg.blocks_per_slot > 1 and not (cfg.reread or cfg.own_rings)):
        return (
            f"one or more Hadamard blocks an output slot, more only in the re-read and own-rings forms, got "
            f"{cfg.blocks_per_slot}"
        )
    if cfg.own_rings and (cfg.reread or cfg.max_warpgroup or cfg.self_loads):
        return "own rings (own_rings) without a max warpgroup, the re-read form or self_loads: a form of its own"
    if cfg.self_loads and not cfg.reread:
        return "its own loads (self_loads) in the re-read form only"
    if cfg.reread and not cfg.max_warpgroup:
        return "the re-read form with a max warpgroup (max_warpgroup)"
    if cfg.reread and min(cfg.rings(cfg.slots)) < 1:
        return f"a ring of Hadamard blocks for each warpgroup in {SMEM_LIMIT} bytes of shared memory, got K={cfg.k}"
    if cfg.blocks < cfg.quantizers:
        return f"a Hadamard block for each of {cfg.quantizers} warpgroups, got K={cfg.k} (blocks of {cfg.hadamard})"
    if cfg.own_rings and cfg.own_ring() < cfg.longest_share:
        return f"a ring of a tile's share of Hadamard blocks for each warpgroup in {SMEM_LIMIT} bytes, got K={cfg.k}"
    if cfg.stages < 2:
        return f"at least 2 stages (a tile loads while the last is processed), got {cfg.stages}"
    if cfg.smem_bytes > SMEM_LIMIT:
        widest = cfg.hadamard
        while dataclasses.replace(cfg, k=widest + cfg.hadamard).smem_bytes <= SMEM_LIMIT:
            widest += cfg.hadamard
        return (
            f"{cfg.stages} tiles of {ROWS} x {cfg.k} bf16 in shared memory ({cfg.smem_bytes} bytes) exceed "
            f"{SMEM_LIMIT}: K up to {widest} here"
        )
    return None


def tile_scaling(tile, amax, num_valid):
    """Row tile ``tile``'s scales from its row max ``amax [ROWS]`` f32 (rows past
    ``num_valid`` 0), their reciprocals broadcast over a part ``[ROWS, SUB]`` (0
    past the valid tokens), the valid rows as a mask ``[ROWS, SUB]`` and whether
    the tile has invalid rows."""
    scale = amax / FLOAT8_E4M3_MAX
    inverse = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    first_row = tile * ROWS
    kept = first_row + lax.broadcasted_iota(jnp.int32, (ROWS,), 0) < num_valid
    inverse_rows = jnp.broadcast_to(jnp.where(kept, inverse, 0.0)[:, None], (ROWS, SUB))
    kept_rows = jnp.broadcast_to(kept[:, None], (ROWS, SUB))
    return jnp.where(kept, scale, 0.0), inverse_rows, kept_rows, first_row + ROWS > num_valid


def store_tile_scales(s_smem, scale_gmem, tile, scales) -> None:
    """``scales [ROWS]`` to the tile's rows of ``scale_gmem`` through ``s_smem``
    (after the last tile's copy has read it)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    s_smem[...] = scales
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, scale_gmem.at[pl.ds(tile * ROWS, ROWS)])


def write_part(values, kept_rows, partial, slot, *, always_select: bool = False) -> None:
    """A part's scaled values ``[ROWS, SUB]`` f32 as e4m3 into the output
    ``slot`` (rows past the valid tokens +0, not -0): selected in tiles that
    have such rows (``partial``), or in every tile (``always_select``: one
    store instead of two branches)."""
    if always_select:
        slot[...] = jnp.where(kept_rows, values, 0.0).astype(jnp.float8_e4m3fn)
        return

    @pl.when(partial)
    def _():
        slot[...] = jnp.where(kept_rows, values, 0.0).astype(jnp.float8_e4m3fn)

    @pl.when(~partial)
    def _():
        slot[...] = values.astype(jnp.float8_e4m3fn)


def store_part(values, kept_rows, partial, slot, destination) -> None:
    """:func:`write_part` and the slot's copy to ``destination``."""
    write_part(values, kept_rows, partial, slot)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slot, destination)


def block_magnitudes(products: list) -> list:
    """Elementwise ``max |y|`` over the rotation pairs of ``products`` (1 or 2
    ``[ROWS, SUB]`` f32): for two, ``max(|a + b|, |a - b|) = |a| + |b|``, also
    rounded (round to nearest is symmetric and monotonic) — one add, no butterfly."""
    if len(products) == 1:
        return [jnp.abs(products[0])]
    if len(products) == 2:
        return [jnp.abs(products[0]) + jnp.abs(products[1])]
    return [jnp.abs(y) for y in butterflies(products)]


def write_blocks(cfg: MosaicRotation, blocks: list[int], take, out_slots, rows_gmem, row_factors, kept_rows,
                 partial) -> None:  # fmt: skip
    """The quantizing pass over a warpgroup's Hadamard ``blocks`` of a row tile:
    ``take(i)`` waits for the i-th block's operands and returns its products
    (releasing or refilling its ring slot); each part scaled by ``row_factors``
    (``[ROWS, SUB]``: ``1/sqrt(b)`` times the row's reciprocal scale) into the
    output slots ``out_slots`` (``[slots, parts * blocks_per_slot, ROWS, SUB]``
    e4m3) as e4m3, then copied to the tile's rows ``rows_gmem`` (``[ROWS, K]``),
    one fence and copy group a slot."""
    for first_index in range(0, len(blocks), cfg.blocks_per_slot):
        group = blocks[first_index : first_index + cfg.blocks_per_slot]
        out = out_slots.at[first_index // cfg.blocks_per_slot % cfg.slots]
        for position, index in enumerate(range(first_index, first_index + len(group))):
            ys = take(index)
            if not position:
                with jax.named_scope("quantize_waits_slot"):  # the slot's last copies have read it
                    plgpu.wait_smem_to_gmem(cfg.slots - 1, wait_read_only=True)
            with jax.named_scope("quantize_writes"):  # scale, e4m3, slot stores
                for part, y in enumerate(butterflies(ys)):
                    piece = out.at[position * cfg.parts + part]
                    write_part(y * row_factors, kept_rows, partial, piece, always_select=cfg.select_store)
        with jax.named_scope("quantize_copies"):  # fence and copies, one group a slot
            plgpu.commit_smem()
            for position, block in enumerate(group):
                for part in range(cfg.parts):
                    plgpu.copy_smem_to_gmem(
                        out.at[position * cfg.parts + part],
                        rows_gmem.at[:, pl.ds(block * cfg.hadamard + part * SUB, SUB)],
                        commit_group=position == len(group) - 1 and part == cfg.parts - 1,
                    )


def block_products(item, h_smem, parts: int) -> list:
    """The ``parts`` products ``[ROWS, SUB]`` f32 of a block's pieces ``item``
    (``parts`` swizzled ``[ROWS, SUB]`` bf16 tiles) by H_64, read from the
    accumulators (the tensor cores are then done with ``item``)."""

    def products(*acc_refs):
        for part, acc_ref in enumerate(acc_refs):
            plgpu.wgmma(acc_ref, item(part), h_smem.transpose((1, 0)))
        return [acc_ref[...] for acc_ref in acc_refs]

    return pl.run_scoped(products, *[plgpu.ACC((ROWS, SUB), jnp.float32) for _ in range(parts)])


def _kernel(
    valid_gmem,
    x_gmem,
    h_gmem,
    values_gmem,
    scale_gmem,
    *,
    cfg: MosaicRotation,
    steps: int,
    programs: int,
    interpret: bool,
):
    m = x_gmem.shape[0]  # a multiple of ROWS (the launcher pads)
    row_tiles = m // ROWS
    pieces = cfg.k // SUB
    factor = 1.0 / math.sqrt(cfg.hadamard)
    sm = lax.axis_index("sm")

    def tile_of(i):
        """Step i's row tile (the last tile again past the end: loaded, not processed)."""
        return jnp.minimum(i * programs + sm, row_tiles - 1)

    in_specs = [
        plgpu.BlockSpec((ROWS, SUB), lambda i, j=j: (tile_of(i), j), transforms=swizzled(SUB, jnp.bfloat16))
        for j in range(pieces)
    ]

    def pipeline(step, context):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(steps,),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=cfg.warpgroups,
            max_concurrent_steps=cfg.stages,
            # A barrier a 64-column piece each way: a piece is processed as soon as it lands,
            # and refilled with the next tile's as soon as every warpgroup is done with it.
            manual_produced_barriers=True,
            manual_consumed_barriers=True,
            compute_context=context,
        )

    unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(*(x_gmem for _ in range(pieces))),
        h_smem=swizzled_pieces((SUB, SUB)),
        # Output slots a quantizing warpgroup, swizzled: rows of 64 bytes in a plain tile put 8
        # rows on one bank (the interpreter cannot store through a swizzle).
        o_smem=plgpu.SMEM(
            (cfg.quantizers, cfg.slots, ROWS, SUB),
            jnp.float8_e4m3fn,
            transforms=() if interpret else swizzled(SUB, jnp.float8_e4m3fn),
        ),
        s_smem=plgpu.SMEM((ROWS,), jnp.float32),
        # By step parity (a slot is rewritten two tiles later, after its readers passed the next
        # tile): the row max of each warpgroup's blocks, or the max warpgroup's row max of the tile.
        m_smem=plgpu.SMEM((2, 1 if cfg.max_warpgroup else cfg.warpgroups, ROWS), jnp.float32),
        max_barrier=plgpu.Barrier(num_arrivals=1 if cfg.max_warpgroup else cfg.warpgroups, num_barriers=2),
        h_barrier=plgpu.Barrier(num_arrivals=1),
        collective_axes="wg",
    )
    def _(allocations, h_smem, o_smem, s_smem, m_smem, max_barrier, h_barrier):
        num_valid = valid_gmem[0]
        wg = lax.axis_index("wg")
        max_layout = plgpu.Layout.WGMMA.reduce(1)

        def block_pieces(block: int) -> range:
            return range(block * cfg.parts, (block + 1) * cfg.parts)

        def rotated(tile_refs, block: int, *, first_use: bool, last_use: bool):
            """Block ``block``'s ``parts`` tiles ``[ROWS, SUB]``, unscaled, f32.
            ``first_use``: the warpgroup's first read of the block's pieces this step
            (their loads awaited); ``last_use``: its last (released once the products are
            read: the tensor cores are done with them)."""
            x_pieces, produced, consumed = tile_refs
            if first_use:
                for piece in block_pieces(block):
                    plgpu.barrier_wait(produced[piece])

            ys = block_products(lambda part: x_pieces[block * cfg.parts + part], h_smem, cfg.parts)
            if last_use:
                for piece in block_pieces(block):
                    plgpu.barrier_arrive(consumed[piece])
            return butterflies(ys)

        def pass_by(tile_refs, pieces):
            """Pieces this warpgroup does not read this step: awaited (every warpgroup sees
            each load, so that its barrier phases stay in step) and released."""
            _, produced, consumed = tile_refs
            for piece in pieces:
                plgpu.barrier_wait(produced[piece])
                plgpu.barrier_arrive(consumed[piece])

        def blocks_max(tile_refs, blocks: range, *, last_use: bool):
            """max |y| of each row over ``blocks`` (unscaled), ``[ROWS]`` f32."""
            largest = None
            for block in blocks:
                for y in rotated(tile_refs, block, first_use=True, last_use=last_use):
                    largest = jnp.abs(y) if largest is None else jnp.maximum(largest, jnp.abs(y))
            return largest.max(axis=1)

        def publish(value, parity, slot: int):
            """``value`` to ``m_smem[parity, slot]`` and an arrival on the parity's barrier."""
            m_smem.at[parity, slot][...] = value
            plgpu.commit_smem()  # every thread's store done before the warpgroup arrives (as the GEMM's stage)
            plgpu.barrier_arrive(max_barrier.at[parity])

        def read_maxima(parity, slots):
            plgpu.barrier_wait(max_barrier.at[parity])
            return [plgpu.load(m_smem.at[parity, slot], layout=max_layout, optimized=False) for slot in slots]

        def scaling(tile, amax):
            return tile_scaling(tile, amax, num_valid)

        def store_scales(tile, scales):
            store_tile_scales(s_smem, scale_gmem, tile, scales)

        def quantize(tile, tile_refs, q: int, blocks: range, inverse_rows, kept_rows, partial):
            """Warpgroup ``q``'s Hadamard blocks of the tile rotated again, scaled and stored
            as e4m3 through its output slots. Each copy is its own group: the last tile's
            copies have had the first pass to read their slots; within the tile, a slot is
            rewritten once its last copy has read it."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            count = 0
            for block in blocks:
                ys = rotated(tile_refs, block, first_use=cfg.max_warpgroup, last_use=True)
                for part, y in enumerate(ys):
                    values = (y * factor) * inverse_rows
                    slot = o_smem.at[q, count % cfg.slots]
                    if count:
                        plgpu.wait_smem_to_gmem(cfg.slots - 1, wait_read_only=True)
                    count += 1

                    columns = pl.ds(block * cfg.hadamard + part * SUB, SUB)
                    store_part(values, kept_rows, partial, slot, values_gmem.at[pl.ds(tile * ROWS, ROWS), columns])

        def shared_step(tile, parity, tile_refs, w: int, blocks: range, others: list[int]):
            """Without a max warpgroup: warpgroup ``w``'s blocks (with ``w`` = 0 the scales);
            ``others``: the pieces of the other warpgroups' blocks."""
            pass_by(tile_refs, others)
            amax = blocks_max(tile_refs, blocks, last_use=False)
            if cfg.warpgroups > 1:
                publish(amax, parity, w)
                for other in read_maxima(parity, [o for o in range(cfg.warpgroups) if o != w]):
                    amax = jnp.maximum(amax, other)
            scales, inverse_rows, kept_rows, partial = scaling(tile, amax * factor)  # rounding is monotonic
            quantize(tile, tile_refs, w, blocks, inverse_rows, kept_rows, partial)
            if w == 0:
                store_scales(tile, scales)

        def max_step(tile, parity, tile_refs):
            """The max warpgroup: the tile's row max for the others, and its scales."""
            amax = blocks_max(tile_refs, range(cfg.blocks), last_use=True) * factor  # rounding is monotonic
            publish(amax, parity, 0)
            store_scales(tile, scaling(tile, amax)[0])

        def quantize_step(tile, parity, tile_refs, q: int, blocks: range, others: list[int]):
            """A quantizing warpgroup: its blocks of the tile with the max warpgroup's row max."""
            (amax,) = read_maxima(parity, [0])  # before any release: the slot is rewritten two tiles on
            pass_by(tile_refs, others)
            _, inverse_rows, kept_rows, partial = scaling(tile, amax)
            quantize(tile, tile_refs, q, blocks, inverse_rows, kept_rows, partial)

        def step(indices, *refs):
            x_pieces, produced, consumed = (refs[i * pieces : (i + 1) * pieces] for i in range(3))
            tile_refs = (x_pieces, produced, consumed)
            carry = refs[-1]
            tile = indices[0] * programs + sm
            parity = lax.rem(indices[0], 2)
            live = tile < row_tiles

            @pl.when(~live)  # past the last tile: every warpgroup sees the loads and releases them
            def _():
                pass_by(tile_refs, range(pieces))

            if cfg.max_warpgroup:

                @pl.when(live & (wg == 0))
                def _():
                    max_step(tile, parity, tile_refs)

            for q, (first, last) in enumerate(cfg.block_ranges()):
                w = q + cfg.max_warpgroup
                others = [p for p in range(pieces) if not first * cfg.parts <= p < last * cfg.parts]

                @pl.when(live & (wg == w))
                def _(q=q, w=w, blocks=range(first, last), others=others):
                    if cfg.max_warpgroup:
                        quantize_step(tile, parity, tile_refs, q, blocks, others)
                    else:
                        shared_step(tile, parity, tile_refs, w, blocks, others)

            return carry

        def context(run):
            @pl.when(wg == 0)  # one copy of H_64 for every compute warpgroup
            def _():
                plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_barrier)

            plgpu.barrier_wait(h_barrier)
            run(jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        pipeline(step, context)(*(x_gmem for _ in range(pieces)), allocations=allocations)


def named(name: str, body):
    """``body`` inside a named region (a profiler range when profiling is on)."""

    def run(*args):
        with jax.named_scope(name):
            return body(*args)

    return run


def program_tiles(m: int, steps: int, programs: int):
    """This program's row tiles of ``m`` rows (a multiple of ROWS: the launcher
    pads) in a persistent grid of ``programs`` taking ``steps`` tiles each at
    most: (how many it has, ``tile_of(step)`` — its step's tile)."""
    sm = lax.axis_index("sm")
    tiles_here = jnp.clip((m // ROWS - sm + programs - 1) // programs, 0, steps)
    return tiles_here, lambda s: s * programs + sm


def swizzled_pieces(shape: tuple[int, ...]):
    """Shared memory for ``shape`` bf16 of 64-column rows (``[ROWS, SUB]`` pieces, H_64), swizzled as wgmma operands."""
    return plgpu.SMEM(shape, jnp.bfloat16, transforms=swizzled(SUB, jnp.bfloat16))


def fetch_block(x_gmem, item, loaded, tile, block: int, parts: int) -> None:
    """Hadamard block ``block`` of row tile ``tile`` of ``x_gmem`` into the ring
    slot ``item`` (``parts`` swizzled ``[ROWS, SUB]`` pieces), one barrier."""
    for part in range(parts):
        columns = pl.ds((block * parts + part) * SUB, SUB)
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(tile * ROWS, ROWS), columns], item.at[part], loaded)


def fill_ring(fetch, order: list[int], length: int, tiles_here, tile_of) -> None:
    """A self-fed ring's first ``length`` blocks: its consumer's blocks a tile
    ``order``, tile 0 on; ``fetch(slot, tile, block)`` loads one."""
    for count in range(length):
        tile, index = divmod(count, len(order))

        @pl.when(tile < tiles_here)
        def _(count=count, tile=tile, index=index):
            fetch(count, tile_of(tile), order[index])


def refill_slot(fetch, slot, order: list[int], s, index: int, length: int, tiles_here, tile_of) -> None:
    """A self-fed ring after its consumer has taken the products of its
    ``index``-th block of step ``s`` (in ``slot``): the block ``length`` further
    on into the same slot, if the program has it. The warpgroup barrier first:
    every warp's share of the wgmmas has read the slot."""
    ahead = index + length
    tile = s + ahead // len(order)

    @pl.when(tile < tiles_here)
    def _():
        plgpu.commit_smem()
        fetch(slot, tile_of(tile), order[ahead % len(order)])


def await_last_handovers(max_free, tiles_here) -> None:
    """The row-max slots' last two releases, read but never awaited by a later
    write (every barrier phase is observed before the barriers go)."""
    for back in (2, 1):

        @pl.when(tiles_here >= back)
        def _(back=back):
            plgpu.barrier_wait(max_free.at[lax.rem(tiles_here - back, 2)])


def _registers(warpgroups: int, memory_registers: int = 40) -> tuple[int, int]:
    """(memory, compute) registers a thread after ``setmaxnreg``: the launch gives
    every thread of the ``warpgroups`` + 1 warpgroups the same share of the 64K
    register file (a multiple of 8); the compute warpgroups take what the memory
    one gives back (at most 248)."""
    launch = 65536 // (128 * (warpgroups + 1)) // 8 * 8
    memory = min(memory_registers, launch)
    return memory, min(248, (launch + (launch - memory) // warpgroups) // 8 * 8)


def _reread_kernel(
    valid_gmem,
    x_gmem,
    h_gmem,
    values_gmem,
    scale_gmem,
    *,
    cfg: MosaicRotation,
    steps: int,
    programs: int,
    interpret: bool,
):
    """The re-read form: each pass streams its own copy of the tile. Warpgroup
    ``cfg.warpgroups`` (the memory one) loads Hadamard blocks (``[ROWS, b]``
    as ``b/64`` swizzled pieces) into one ring a consumer: the max warpgroup's
    ring gets tile s (from DRAM), each quantizing warpgroup's ring its blocks
    of tile s - 1 again (from L2: the tile was read a step before), the loads
    of both passes alternating. A ring slot has a barrier each way (loaded,
    released by its one consumer), so shared memory bounds the blocks in
    flight, not the tiles, and the row max of tile s runs while tile s - 1
    is quantized. The max warpgroup hands the row max over through a slot a
    step parity (``max_ready``; ``max_free`` once every quantizing warpgroup
    has read it) and stores the scales."""
    factor = 1.0 / math.sqrt(cfg.hadamard)
    first_ring, second_ring = cfg.rings()
    shares = [cfg.blocks_of(q) for q in range(cfg.quantizers)]
    tiles_here, tile_of = program_tiles(x_gmem.shape[0], steps, programs)

    @functools.partial(
        pl.run_scoped,
        first=swizzled_pieces((first_ring, cfg.parts, ROWS, SUB)),
        second=swizzled_pieces((cfg.quantizers, second_ring, cfg.parts, ROWS, SUB)),
        first_loaded=plgpu.Barrier(num_arrivals=cfg.parts, num_barriers=first_ring),
        first_free=plgpu.Barrier(num_arrivals=1, num_barriers=first_ring),
        second_loaded=plgpu.Barrier(num_arrivals=cfg.parts, num_barriers=cfg.quantizers * second_ring),
        second_free=plgpu.Barrier(num_arrivals=1, num_barriers=cfg.quantizers * second_ring),
        h_smem=swizzled_pieces((SUB, SUB)),
        o_smem=plgpu.SMEM(
            (cfg.quantizers, cfg.slots, cfg.parts * cfg.blocks_per_slot, ROWS, SUB),
            jnp.float8_e4m3fn,
            transforms=() if interpret else swizzled(SUB, jnp.float8_e4m3fn),
        ),
        s_smem=plgpu.SMEM((ROWS,), jnp.float32),
        m_smem=plgpu.SMEM((2, ROWS), jnp.float32),
        max_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        max_free=plgpu.Barrier(num_arrivals=cfg.quantizers, num_barriers=2),
        h_barrier=plgpu.Barrier(num_arrivals=1),
        collective_axes="wg",
    )
    def _(first, second, first_loaded, first_free, second_loaded, second_free, h_smem, o_smem, s_smem, m_smem,
          max_ready, max_free, h_barrier):  # fmt: skip
        num_valid = valid_gmem[0]
        wg = lax.axis_index("wg")

        def second_slot(q: int, count):
            """Quantizing warpgroup ``q``'s ring slot for its ``count``-th block: (ring index, barrier index)."""
            slot = lax.rem(count, second_ring)
            return slot, q * second_ring + slot

        def first_fetch(slot, tile, block: int):
            """Block ``block`` of row tile ``tile`` into the max warpgroup's ring slot."""
            fetch_block(x_gmem, first.at[slot], first_loaded.at[slot], tile, block, cfg.parts)

        def second_fetch(q: int):
            """Quantizing warpgroup ``q``'s :func:`first_fetch`."""
            return lambda slot, tile, block: fetch_block(
                x_gmem, second.at[q, slot], second_loaded.at[q * second_ring + slot], tile, block, cfg.parts
            )

        def load(ring_item, loaded, free, count, length: int, tile, block: int):
            """:func:`fetch_block`, once the slot's last block is released."""

            @pl.when(count >= length)
            def _():
                with jax.named_scope("load_waits_free"):
                    plgpu.barrier_wait(free)

            fetch_block(x_gmem, ring_item, loaded, tile, block, cfg.parts)

        def memory_step(s, carry):
            """Tile s's blocks for the row max, tile s - 1's for the values, alternating."""
            for block in range(cfg.blocks):

                @pl.when(s < tiles_here)
                def _(block=block):
                    count = s * cfg.blocks + block
                    slot = lax.rem(count, first_ring)
                    load(
                        first.at[slot], first_loaded.at[slot], first_free.at[slot], count, first_ring, tile_of(s), block
                    )

                q = block % cfg.quantizers

                @pl.when(s >= 1)
                def _(block=block, q=q):
                    count = (s - 1) * len(shares[q]) + shares[q].index(block)
                    slot, barrier = second_slot(q, count)
                    item = second.at[q, slot]
                    load(item, second_loaded.at[barrier], second_free.at[barrier], count, second_ring, tile_of(s - 1),
                         block)  # fmt: skip

            return carry

        def max_step(s, carry):
            """Tile s's row max: handed over (slot s % 2) and its scales stored."""
            largest = None
            for block in range(cfg.blocks):
                slot = lax.rem(s * cfg.blocks + block, first_ring)
                with jax.named_scope("max_waits_load"):
                    plgpu.barrier_wait(first_loaded.at[slot])
                with jax.named_scope("max_products"):  # the products and their wait
                    ys = block_products(lambda part, slot=slot: first.at[slot, part], h_smem, cfg.parts)
                if cfg.self_loads:
                    order = list(range(cfg.blocks))
                    refill_slot(first_fetch, slot, order, s, block, first_ring, tiles_here, tile_of)
                else:
                    plgpu.barrier_arrive(first_free.at[slot])
                for y in block_magnitudes(ys):
                    largest = y if largest is None else jnp.maximum(largest, y)
            amax = largest.max(axis=1) * factor  # rounding is monotonic
            parity = lax.rem(s, 2)

            @pl.when(s >= 2)  # the quantizing warpgroups have read tile s - 2's
            def _():
                with jax.named_scope("max_waits_handover"):
                    plgpu.barrier_wait(max_free.at[parity])

            m_smem.at[parity][...] = amax
            plgpu.commit_smem()  # every thread's store done before the warpgroup arrives
            plgpu.barrier_arrive(max_ready.at[parity])
            store_tile_scales(s_smem, scale_gmem, tile_of(s), tile_scaling(tile_of(s), amax, num_valid)[0])
            return carry

        def quantize_step(q: int, s, carry):
            """Quantizing warpgroup ``q``'s blocks of tile s, re-read, scaled and stored."""
            parity = lax.rem(s, 2)
            with jax.named_scope("quantize_waits_max"):
                plgpu.barrier_wait(max_ready.at[parity])
            amax = plgpu.load(m_smem.at[parity], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            plgpu.barrier_arrive(max_free.at[parity])
            tile = tile_of(s)
            _, inverse_rows, kept_rows, partial = tile_scaling(tile, amax, num_valid)
            # 1/sqrt(b) folded into the row's reciprocal scale: one multiply an element
            # (a rounding less than the Triton kernel's: a rare code one step apart).
            row_factors = inverse_rows * factor
            share = list(shares[q])

            def take(index: int):
                slot, barrier = second_slot(q, s * len(share) + index)
                with jax.named_scope("quantize_waits_load"):
                    plgpu.barrier_wait(second_loaded.at[barrier])
                with jax.named_scope("quantize_products"):  # the products and their wait
                    ys = block_products(lambda part: second.at[q, slot, part], h_smem, cfg.parts)
                if cfg.self_loads:
                    refill_slot(second_fetch(q), slot, share, s, index, second_ring, tiles_here, tile_of)
                else:
                    plgpu.barrier_arrive(second_free.at[barrier])
                return ys

            write_blocks(cfg, share, take, o_smem.at[q], values_gmem.at[pl.ds(tile * ROWS, ROWS)], row_factors,
                         kept_rows, partial)  # fmt: skip
            return carry

        def quiesce(free, slots: int, loaded_count, offset: int = 0):
            """The last release of each used slot, which no load waited for (every
            barrier phase is observed before the barriers go)."""
            for slot in range(slots):

                @pl.when(slot < loaded_count)
                def _(slot=slot):
                    plgpu.barrier_wait(free.at[offset + slot])

        if not cfg.self_loads:

            @pl.when(wg == cfg.warpgroups)
            def _():
                plgpu.set_max_registers(_registers(cfg.warpgroups)[0], action="decrease")
                lax.fori_loop(0, tiles_here + 1, named("load_step", memory_step), None)
                quiesce(first_free, first_ring, tiles_here * cfg.blocks)
                for q, share in enumerate(shares):
                    quiesce(second_free, second_ring, tiles_here * len(share), q * second_ring)

        @pl.when(wg < cfg.warpgroups)
        def _():
            if not cfg.self_loads:
                plgpu.set_max_registers(_registers(cfg.warpgroups)[1], action="increase")

            @pl.when(wg == 0)  # one copy of H_64 for every compute warpgroup
            def _():
                plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_barrier)
                if cfg.self_loads:
                    fill_ring(first_fetch, list(range(cfg.blocks)), first_ring, tiles_here, tile_of)

            if cfg.self_loads:  # the rings fill while H_64 lands
                for q in range(cfg.quantizers):

                    @pl.when(wg == q + 1)
                    def _(q=q):
                        fill_ring(second_fetch(q), list(shares[q]), second_ring, tiles_here, tile_of)

            plgpu.barrier_wait(h_barrier)

            @pl.when(wg == 0)
            def _():
                lax.fori_loop(0, tiles_here, named("max_step", max_step), None)
                await_last_handovers(max_free, tiles_here)

            for q in range(cfg.quantizers):

                @pl.when(wg == q + 1)
                def _(q=q):
                    lax.fori_loop(0, tiles_here, named("quantize_step", functools.partial(quantize_step, q)), None)

            plgpu.wait_smem_to_gmem(0)


def _own_rings_kernel(
    valid_gmem,
    x_gmem,
    h_gmem,
    values_gmem,
    scale_gmem,
    *,
    cfg: MosaicRotation,
    steps: int,
    programs: int,
    interpret: bool,
):
    """The own-rings form: compute warpgroup w takes its Hadamard blocks
    ``cfg.block_ranges()[w]`` of every tile through both passes, from a ring
    of its own that it fills itself (its blocks of tile after tile; a slot
    refilled as soon as the second pass has taken its products). Per tile:
    the row max of its blocks, published in a slot of ``m_smem`` for the
    step's parity (``max_ready``: every warpgroup's is in; ``max_free``: every
    warpgroup has read them all), the combined max, then its blocks again,
    scaled and stored; warpgroup 0 stores the scales. Every warpgroup works on
    every tile: no pass waits for another warpgroup's earlier tile, so the
    program has no pipeline fill or drain."""
    factor = 1.0 / math.sqrt(cfg.hadamard)
    ring = cfg.own_ring()
    shares = [list(range(first, last)) for first, last in cfg.block_ranges()]
    tiles_here, tile_of = program_tiles(x_gmem.shape[0], steps, programs)

    @functools.partial(
        pl.run_scoped,
        rings=swizzled_pieces((cfg.warpgroups, ring, cfg.parts, ROWS, SUB)),
        loaded=plgpu.Barrier(num_arrivals=cfg.parts, num_barriers=cfg.warpgroups * ring),
        h_smem=swizzled_pieces((SUB, SUB)),
        o_smem=plgpu.SMEM(
            (cfg.warpgroups, cfg.slots, cfg.parts * cfg.blocks_per_slot, ROWS, SUB),
            jnp.float8_e4m3fn,
            transforms=() if interpret else swizzled(SUB, jnp.float8_e4m3fn),
        ),
        s_smem=plgpu.SMEM((ROWS,), jnp.float32),
        m_smem=plgpu.SMEM((2, cfg.warpgroups, ROWS), jnp.float32),
        max_ready=plgpu.Barrier(num_arrivals=cfg.warpgroups, num_barriers=2),
        max_free=plgpu.Barrier(num_arrivals=cfg.warpgroups, num_barriers=2),
        h_barrier=plgpu.Barrier(num_arrivals=1),
        collective_axes="wg",
    )
    def _(rings, loaded, h_smem, o_smem, s_smem, m_smem, max_ready, max_free, h_barrier):
        num_valid = valid_gmem[0]
        wg = lax.axis_index("wg")

        def fetch(w: int):
            """Warpgroup ``w``'s ``fetch(slot, tile, block)``: a block into its ring slot."""
            return lambda slot, tile, block: fetch_block(
                x_gmem, rings.at[w, slot], loaded.at[w * ring + slot], tile, block, cfg.parts
            )

        def step(w: int, s, carry):
            """Warpgroup ``w``'s blocks of tile s: the row max (combined), then the values."""
            share = shares[w]
            parity = lax.rem(s, 2)

            def slot_of(index: int):
                return lax.rem(s * len(share) + index, ring)

            def products(index: int) -> list:
                slot = slot_of(index)
                return block_products(lambda part: rings.at[w, slot, part], h_smem, cfg.parts)

            largest = None
            for index in range(len(share)):
                with jax.named_scope("max_waits_load"):
                    plgpu.barrier_wait(loaded.at[w * ring + slot_of(index)])
                with jax.named_scope("max_products"):  # the products and their wait
                    ys = products(index)
                for y in block_magnitudes(ys):
                    largest = y if largest is None else jnp.maximum(largest, y)

            @pl.when(s >= 2)  # every warpgroup has read tile s - 2's maxima
            def _():
                with jax.named_scope("max_waits_handover"):
                    plgpu.barrier_wait(max_free.at[parity])

            # Published with the factor (rounding is monotonic: the max of the rounded
            # is the rounded max), so that the scale follows from a loaded max as in the re-read form.
            m_smem.at[parity, w][...] = largest.max(axis=1) * factor
            plgpu.commit_smem()  # every thread's store done before the warpgroup arrives
            plgpu.barrier_arrive(max_ready.at[parity])
            with jax.named_scope("max_waits_others"):
                plgpu.barrier_wait(max_ready.at[parity])
            layout = plgpu.Layout.WGMMA.reduce(1)
            maxima = [plgpu.load(m_smem.at[parity, j], layout=layout, optimized=False) for j in range(cfg.warpgroups)]
            plgpu.barrier_arrive(max_free.at[parity])
            amax = functools.reduce(jnp.maximum, maxima)
            tile = tile_of(s)
            scales, inverse_rows, kept_rows, partial = tile_scaling(tile, amax, num_valid)
            if w == 0:
                store_tile_scales(s_smem, scale_gmem, tile, scales)

            def take(index: int):
                with jax.named_scope("quantize_products"):
                    ys = products(index)
                refill_slot(fetch(w), slot_of(index), share, s, index, ring, tiles_here, tile_of)
                return ys

            # 1/sqrt(b) folded into the row's reciprocal scale, as in the re-read form.
            write_blocks(cfg, share, take, o_smem.at[w], values_gmem.at[pl.ds(tile * ROWS, ROWS)],
                         inverse_rows * factor, kept_rows, partial)  # fmt: skip
            return carry

        @pl.when(wg == 0)  # one copy of H_64 for every warpgroup
        def _():
            plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_barrier)

        for w in range(cfg.warpgroups):

            @pl.when(wg == w)
            def _(w=w):
                fill_ring(fetch(w), shares[w], ring, tiles_here, tile_of)  # while H_64 lands
                plgpu.barrier_wait(h_barrier)
                lax.fori_loop(0, tiles_here, named("own_step", functools.partial(step, w)), None)
                await_last_handovers(max_free, tiles_here)

                plgpu.wait_smem_to_gmem(0)


def rotate_quantize(
    x: jax.Array,
    h: jax.Array,
    num_valid_tokens: jax.Array,
    cfg: MosaicRotation,
    *,
    interpret: bool = False,
    profile_dir: str = "",
) -> tuple[jax.Array, jax.Array]:
    """``x [M, K]`` bf16 rotated by Hadamard blocks (``h``: the ``[64, 64]``
    ±1 matrix, bf16) and quantized per token: ``(values [M, K]
    float8_e4m3fn, scale [M, 1] f32)``, rows at or past ``num_valid_tokens``
    (``int32 [1]``) zero. ``profile_dir`` (with ``cfg.profile_ranges``): where
    the on-device profiler writes each launch's trace of named regions.
    Interpreted, each warpgroup's blocking waits take a worker thread of the
    CPU client: on a machine with fewer cores than warpgroups + 1 set
    ``PJRT_NPROC`` (e.g. 16) before JAX starts, or the warpgroups may starve."""
    why = refusal(cfg)
    if why:
        raise ValueError(f"mosaic process_input: {why}")
    if bool(cfg.profile_ranges) != bool(profile_dir):
        raise ValueError("mosaic process_input: profile_dir and cfg.profile_ranges go together (both or neither)")
    m = x.shape[0]
    padded = -(-max(m, 1) // ROWS) * ROWS
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    row_tiles = padded // ROWS
    sms = persistent_programs(interpret)
    steps = -(-row_tiles // sms)
    programs = -(-row_tiles // steps)  # every program takes `steps` tiles, the last ones fewer
    kernel = plgpu.kernel(
        functools.partial(
            _own_rings_kernel if cfg.own_rings else _reread_kernel if cfg.reread else _kernel,
            cfg=cfg,
            steps=steps,
            programs=programs,
            interpret=interpret,
        ),
        out_type=(
            jax.ShapeDtypeStruct((padded, cfg.k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((padded,), jnp.float32),
        ),
        grid=(programs,),
        grid_names=("sm",),
        num_threads=cfg.warpgroups + (not (cfg.own_rings or (cfg.reread and cfg.self_loads))),
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            unsafe_no_auto_barriers=not cfg.auto_barriers,
            **(
                dict(profile_space=cfg.profile_ranges, profile_dir=profile_dir, profile_bounds_check=True)
                if cfg.profile_ranges
                else {}
            ),
        ),
        # Interpreted, fresh memory reads as NaN: a row the kernel failed to store shows.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    values, scale = kernel(num_valid_tokens.reshape(-1)[:1].astype(jnp.int32), x, h)
    return values[:m], scale[:m, None]
