"""Experimental: ``process_input``'s Hadamard rotation + fp8 per-token
quantization of bf16 rows on Mosaic GPU (Hopper), the own-rings form. No op
reaches it: the pipelines never produce its case (see below).

Every compute warpgroup streams its share of each 64-token tile's Hadamard
blocks (64 or 128 columns) through a ring of shared memory it fills itself by
TMA, takes the row max of its blocks (products by H_64 on wgmma, butterflies
for 128), combines the maxima through shared memory a tile at a time, then
takes the products again, scales and stores e4m3 through output slots.
Arithmetic: the Triton kernel's (``pallas_kernels.process_input``).

To promote it: a pipeline that calls ``process_input`` on rows of its case
(bf16, no activation, Hadamard + fp8 per token, the normal layout, 16384+
rows, K <= 768) and gains on the H200 against the Triton kernel; today the
only such call is a bare ``process_input`` (benchmarks/notes/process_input.md).
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

from pallas_kernels import codecs
from pallas_kernels.gemm.mosaic import persistent_programs, swizzled
from pallas_kernels.process_input import FLOAT8_E4M3_MAX, butterflies

ROWS = 64  # tokens a tile: one wgmma's M
SUB = 64  # columns of one product: H_64, a 128-byte swizzled bf16 row
SMEM_LIMIT = 227 * 1024  # shared memory a Hopper program may take


@dataclasses.dataclass(frozen=True)
class MosaicRotation:
    """Static description of one launch: rows of ``k`` bf16 columns rotated
    in Hadamard blocks of ``hadamard`` (64 or 128) and quantized to e4m3 per
    token by ``warpgroups`` compute warpgroups (1 to 4), each with a ring of
    its own. ``profile_ranges``: ranges a warpgroup the on-device profiler
    may record (0: off; its buffer takes shared memory, the rings shrink)."""

    k: int
    hadamard: int
    warpgroups: int = 2
    profile_ranges: int = 0

    @property
    def parts(self) -> int:
        """64-column products of a Hadamard block."""
        return self.hadamard // SUB

    @property
    def longest_share(self) -> int:
        """The most Hadamard blocks of a tile one warpgroup takes (:meth:`block_ranges`)."""
        return max(last - first for first, last in self.block_ranges())

    @property
    def blocks(self) -> int:
        return self.k // self.hadamard

    def block_ranges(self) -> list[tuple[int, int]]:
        """Each warpgroup's Hadamard blocks ``[first, last)``, as even as they divide."""
        cuts = [w * self.blocks // self.warpgroups for w in range(self.warpgroups + 1)]
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def fixed_bytes(self, slots: int) -> int:
        """Shared memory besides the rings: ``slots`` output slots a warpgroup
        (a Hadamard block each), H_64, the scale and row-max slots, the
        compiler's reduction scratch (2 KB) and the barriers."""
        outputs = self.warpgroups * slots * ROWS * SUB * self.parts
        maxima = 2 * ROWS * 4 * self.warpgroups
        profile = self.profile_ranges * 16 * (self.warpgroups + 1)
        return outputs + SUB * SUB * 2 + ROWS * 4 + maxima + 3072 + profile

    @property
    def block_bytes(self) -> int:
        """One Hadamard block of a tile, bf16: a ring's item."""
        return ROWS * self.hadamard * 2

    def own_ring(self, slots: int | None = None) -> int:
        """A warpgroup's ring in Hadamard blocks: up to two tiles' share of its
        blocks (one held for both passes, one loading)."""
        items = (SMEM_LIMIT - self.fixed_bytes(slots or self.slots)) // self.block_bytes
        return min(2 * self.longest_share, items // self.warpgroups)

    @property
    def slots(self) -> int:
        """Output slots a warpgroup: 2 (a block converts while the last one's copy
        reads) where the rings still hold a tile's share, else 1."""
        return 2 if self.own_ring(2) >= self.longest_share else 1


def refusal(cfg: MosaicRotation) -> str | None:
    """Why the kernel cannot take ``cfg`` (None if it can)."""
    if cfg.hadamard not in (SUB, 2 * SUB):
        return f"Hadamard blocks of {SUB} or {2 * SUB} columns, got {cfg.hadamard}"
    if cfg.k % cfg.hadamard:
        return f"rows of whole Hadamard blocks, got K={cfg.k} with blocks of {cfg.hadamard}"
    if cfg.warpgroups not in (1, 2, 3, 4):
        return f"1 to 4 compute warpgroups, got {cfg.warpgroups}"
    if cfg.blocks < cfg.warpgroups:
        return f"a Hadamard block for each of {cfg.warpgroups} warpgroups, got K={cfg.k} (blocks of {cfg.hadamard})"
    if cfg.own_ring() < cfg.longest_share:
        return f"a ring of a tile's share of Hadamard blocks for each warpgroup in {SMEM_LIMIT} bytes, got K={cfg.k}"
    return None


def tile_scaling(tile, amax, num_valid):
    """Row tile ``tile``'s scales from its row max ``amax [ROWS]`` f32 (rows past
    ``num_valid`` 0), their reciprocals broadcast over a part ``[ROWS, SUB]`` (0
    past the valid tokens), the valid rows as a mask ``[ROWS, SUB]`` and whether
    the tile has invalid rows."""
    scale = codecs.floor_fp8_token_scale(amax / FLOAT8_E4M3_MAX, FLOAT8_E4M3_MAX)
    inverse = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    first_row = tile * ROWS
    kept = first_row + lax.broadcasted_iota(jnp.int32, (ROWS,), 0) < num_valid
    inverse_rows = jnp.broadcast_to(jnp.where(kept, inverse, 0.0)[:, None], (ROWS, SUB))
    kept_rows = jnp.broadcast_to(kept[:, None], (ROWS, SUB))
    return jnp.where(kept, scale, 0.0), inverse_rows, kept_rows


def store_tile_scales(s_smem, scale_gmem, tile, scales) -> None:
    """``scales [ROWS]`` to the tile's rows of ``scale_gmem`` through ``s_smem``
    (after the last tile's copy has read it)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    s_smem[...] = scales
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, scale_gmem.at[pl.ds(tile * ROWS, ROWS)])


def write_part(values, kept_rows, slot) -> None:
    """A part's scaled values ``[ROWS, SUB]`` f32 as e4m3 into the output
    ``slot``, rows past the valid tokens +0 (one select store, no branches)."""
    slot[...] = jnp.where(kept_rows, values, 0.0).astype(jnp.float8_e4m3fn)


def block_magnitudes(products: list) -> list:
    """Elementwise ``max |y|`` over the rotation pairs of ``products`` (1 or 2
    ``[ROWS, SUB]`` f32): for two, ``max(|a + b|, |a - b|) = |a| + |b|``, also
    rounded (round to nearest is symmetric and monotonic) — one add, no butterfly."""
    if len(products) == 1:
        return [jnp.abs(products[0])]
    if len(products) == 2:
        return [jnp.abs(products[0]) + jnp.abs(products[1])]
    return [jnp.abs(y) for y in butterflies(products)]


def write_blocks(cfg: MosaicRotation, blocks: list[int], take, out_slots, rows_gmem, row_factors, kept_rows) -> None:
    """The quantizing pass over a warpgroup's Hadamard ``blocks`` of a row tile:
    ``take(i)`` waits for the i-th block's operands and returns its products
    (refilling its ring slot); each part scaled by ``row_factors`` (``[ROWS,
    SUB]``: ``1/sqrt(b)`` times the row's reciprocal scale) into an output slot
    of ``out_slots`` (``[slots, parts, ROWS, SUB]`` e4m3), then copied to the
    tile's rows ``rows_gmem`` (``[ROWS, K]``), one fence and copy group a block."""
    for index, block in enumerate(blocks):
        out = out_slots.at[index % cfg.slots]
        ys = take(index)
        with jax.named_scope("quantize_waits_slot"):  # the slot's last copies have read it
            plgpu.wait_smem_to_gmem(cfg.slots - 1, wait_read_only=True)
        with jax.named_scope("quantize_writes"):  # scale, e4m3, slot stores
            for part, y in enumerate(butterflies(ys)):
                write_part(y * row_factors, kept_rows, out.at[part])
        with jax.named_scope("quantize_copies"):  # fence and copies, one group a block
            plgpu.commit_smem()
            for part in range(cfg.parts):
                plgpu.copy_smem_to_gmem(
                    out.at[part],
                    rows_gmem.at[:, pl.ds(block * cfg.hadamard + part * SUB, SUB)],
                    commit_group=part == cfg.parts - 1,
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
            (cfg.warpgroups, cfg.slots, cfg.parts, ROWS, SUB),
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
            scales, inverse_rows, kept_rows = tile_scaling(tile, amax, num_valid)
            if w == 0:
                store_tile_scales(s_smem, scale_gmem, tile, scales)

            def take(index: int):
                with jax.named_scope("quantize_products"):
                    ys = products(index)
                refill_slot(fetch(w), slot_of(index), share, s, index, ring, tiles_here, tile_of)
                return ys

            # 1/sqrt(b) folded into the row's reciprocal scale, as in the re-read form.
            rows_gmem = values_gmem.at[pl.ds(tile * ROWS, ROWS)]
            write_blocks(cfg, share, take, o_smem.at[w], rows_gmem, inverse_rows * factor, kept_rows)
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
            _own_rings_kernel,
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
        num_threads=cfg.warpgroups,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            # Its own mbarriers and fences order every shared-memory reuse: no thread reads a
            # region it writes, and every slot is rewritten after a wait that carries a barrier.
            unsafe_no_auto_barriers=True,
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
