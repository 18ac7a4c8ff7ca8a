"""``process_input``'s Hadamard rotation + fp8 per-token quantization on Mosaic
GPU (Hopper): TMA loads of whole row tiles into shared memory, the rotation
on the tensor cores, TMA stores.

The Triton kernel (:mod:`pallas_kernels.process_input`) holds a row block's
rotated values in registers until the row's max is known; at narrow rows
(K=768) the compiler's schedule leaves it latency-bound at ~0.6 of the copy
bandwidth whatever the tiling. Here a memory warpgroup streams tiles of
``ROWS`` tokens × K columns into shared memory (``stages`` tiles in flight,
each as K/64 swizzled ``[ROWS, 64]`` boxes) while one compute warpgroup
(or two, each on half the tile's Hadamard blocks, the row max combined
through shared memory) takes two passes over the tile in shared memory: the
first multiplies each
64-column piece by the ±1 matrix H_64 (``wgmma``, f32 accumulators),
combines the pieces of a Hadamard block by butterflies (H_b = H_{b/64} ⊗
H_64) and keeps the elementwise max of ``|y|``; the second takes the same
products again (the operands are still in shared memory; the tensor cores
are otherwise idle), scales by ``1/sqrt(b)`` and the row's ``448 / amax``,
converts to e4m3 and stores each Hadamard block through a shared-memory
slot. No rotated value is held across the row, so the registers do not grow
with K, and the compute never waits on a load it could have issued earlier.

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


@dataclasses.dataclass(frozen=True)
class MosaicRotation:
    """Static description of one launch: rows of ``k`` bf16 columns rotated
    in Hadamard blocks of ``hadamard`` (64 or 128) and quantized to e4m3 per
    token; ``stages`` row tiles in flight; ``warpgroups`` compute warpgroups
    (1 to 3) sharing each tile's Hadamard blocks (with more than one, the row
    max is combined through shared memory); ``ahead``: the next block's
    products are issued before this block's are read (two accumulator sets),
    so the tensor cores work while the butterflies and stores run."""

    k: int
    hadamard: int
    stages: int = 2
    warpgroups: int = 1
    ahead: bool = False

    @property
    def parts(self) -> int:
        """64-column products of a Hadamard block."""
        return self.hadamard // SUB

    @property
    def blocks(self) -> int:
        return self.k // self.hadamard

    def block_ranges(self) -> list[tuple[int, int]]:
        """Each compute warpgroup's Hadamard blocks ``[first, last)``, as even as they divide."""
        cuts = [w * self.blocks // self.warpgroups for w in range(self.warpgroups + 1)]
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def smem_bytes_with(self, slots: int) -> int:
        """Input stages, ``slots`` output slots a warpgroup, H_64, the scale and row-max
        slots, the compiler's reduction scratch (2 KB) and its barriers."""
        outputs = self.warpgroups * slots * ROWS * SUB
        return self.stages * ROWS * self.k * 2 + outputs + SUB * SUB * 2 + ROWS * 4 * (1 + 2 * self.warpgroups) + 3072

    @property
    def slots(self) -> int:
        """Output slots a warpgroup: 2 (a part converts while the last one's copy reads)
        where they fit, else 1."""
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
    if cfg.warpgroups not in (1, 2, 3):
        # Four would launch 640 threads with 96 registers each (61440 of the 65536) while the
        # pipeline raises the compute warpgroups to (512 - 40) / 4 -> 112: setmaxnreg waits forever.
        return f"1 to 3 compute warpgroups, got {cfg.warpgroups}"
    if cfg.blocks < cfg.warpgroups:
        return f"a Hadamard block for each of {cfg.warpgroups} warpgroups, got K={cfg.k} (blocks of {cfg.hadamard})"
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
            compute_context=context,
        )

    unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(*(x_gmem for _ in range(pieces))),
        h_smem=plgpu.SMEM((SUB, SUB), jnp.bfloat16, transforms=swizzled(SUB, jnp.bfloat16)),
        # Output slots a warpgroup, swizzled: rows of 64 bytes in a plain tile put 8 rows on
        # one bank (the interpreter cannot store through a swizzle).
        o_smem=plgpu.SMEM(
            (cfg.warpgroups, cfg.slots, ROWS, SUB),
            jnp.float8_e4m3fn,
            transforms=() if interpret else swizzled(SUB, jnp.float8_e4m3fn),
        ),
        s_smem=plgpu.SMEM((ROWS,), jnp.float32),
        # Two warpgroups: each one's row max of the tile (by step parity: a slot is rewritten two
        # tiles later, after both passed the next tile's barrier).
        m_smem=plgpu.SMEM((2, cfg.warpgroups, ROWS), jnp.float32) if cfg.warpgroups > 1 else None,
        max_barrier=plgpu.Barrier(num_arrivals=cfg.warpgroups) if cfg.warpgroups > 1 else None,
        h_barrier=plgpu.Barrier(num_arrivals=1),
        collective_axes="wg",
    )
    def _(allocations, h_smem, o_smem, s_smem, h_barrier, m_smem=None, max_barrier=None):
        num_valid = valid_gmem[0]
        wg = lax.axis_index("wg")

        def each_block(x_pieces, blocks: range, consume, carry=None):
            """Folds ``carry = consume(block, ys, carry)`` over ``blocks`` in order (``ys``:
            the block's ``parts`` rotated tiles ``[ROWS, SUB]`` f32, unscaled) and returns
            the last carry. With ``cfg.ahead`` the next block's products are in flight (in
            the next accumulators) while ``consume`` runs; every product is its own wgmma
            group. Each block's accumulators are fresh (zero) ones in a scope nested in
            the last block's; values leave a scope only as its result."""

            def with_products(n: int, then):
                def body(*acc_refs):
                    for part, acc_ref in enumerate(acc_refs):
                        plgpu.wgmma(acc_ref, x_pieces[blocks[n] * cfg.parts + part], h_smem.transpose((1, 0)))
                    return then(acc_refs)

                return pl.run_scoped(body, *[plgpu.ACC((ROWS, SUB), jnp.float32) for _ in range(cfg.parts)])

            def visit(n: int, acc_refs, carry):
                """Block n's products issued: read and consume them, and go on."""

                def read_and_consume(in_flight: int):
                    ys = [plgpu.wgmma_accumulator_load(acc_refs[0], wait_n=in_flight)]
                    ys += [plgpu.wgmma_accumulator_load(acc_ref, wait_n=None) for acc_ref in acc_refs[1:]]
                    return consume(blocks[n], butterflies(ys), carry)

                if n + 1 == len(blocks):
                    return read_and_consume(0)
                if cfg.ahead:
                    return with_products(n + 1, lambda next_refs: visit(n + 1, next_refs, read_and_consume(cfg.parts)))
                carry = read_and_consume(0)
                return with_products(n + 1, lambda next_refs: visit(n + 1, next_refs, carry))

            return with_products(0, lambda acc_refs: visit(0, acc_refs, carry))

        def row_max(x_pieces, blocks, parity, w: int):
            """max |y| of each row over the tile (warpgroup ``w``'s blocks, combined with the others')."""

            def consume(block, ys, largest):
                for y in ys:
                    largest = jnp.abs(y) if largest is None else jnp.maximum(largest, jnp.abs(y))
                return largest

            own = each_block(x_pieces, blocks, consume).max(axis=1)
            if cfg.warpgroups == 1:
                return own
            m_smem.at[parity, w][...] = own
            plgpu.commit_smem()  # every thread's store done before the warpgroup arrives (as the GEMM's stage)
            plgpu.barrier_arrive(max_barrier)
            plgpu.barrier_wait(max_barrier)
            layout = plgpu.Layout.WGMMA.reduce(1)
            for other in range(cfg.warpgroups):
                if other != w:
                    own = jnp.maximum(own, plgpu.load(m_smem.at[parity, other], layout=layout, optimized=False))
            return own

        def process(tile, parity, x_pieces, w: int, blocks: range):
            """Warpgroup ``w``'s Hadamard blocks of the tile (and with ``w`` = 0 the scales)."""
            first_row = tile * ROWS
            amax = row_max(x_pieces, blocks, parity, w) * factor  # = max |y · factor| (rounding is monotonic)
            scale = amax / FLOAT8_E4M3_MAX
            inverse = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
            row_ids = first_row + lax.broadcasted_iota(jnp.int32, (ROWS,), 0)
            kept = row_ids < num_valid
            inverse_rows = jnp.broadcast_to(jnp.where(kept, inverse, 0.0)[:, None], (ROWS, SUB))
            partial = first_row + ROWS > num_valid
            kept_rows = jnp.broadcast_to(kept[:, None], (ROWS, SUB))

            # Each copy is its own group. The last tile's copies have had the first pass to read
            # their slots; within the tile, one copy in flight leaves the other slot free.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            count = [0]  # parts stored so far (a Python count: the loop is unrolled)

            def consume(block, ys, _):
                for part, y in enumerate(ys):
                    values = (y * factor) * inverse_rows
                    slot = o_smem.at[w, count[0] % cfg.slots]
                    if count[0]:  # the slot's last copy has read it
                        plgpu.wait_smem_to_gmem(cfg.slots - 1, wait_read_only=True)
                    count[0] += 1

                    @pl.when(partial)
                    def _(values=values, slot=slot):  # rows past the valid tokens: +0, not -0
                        slot[...] = jnp.where(kept_rows, values, 0.0).astype(jnp.float8_e4m3fn)

                    @pl.when(~partial)
                    def _(values=values, slot=slot):
                        slot[...] = values.astype(jnp.float8_e4m3fn)

                    plgpu.commit_smem()
                    columns = pl.ds(block * cfg.hadamard + part * SUB, SUB)
                    plgpu.copy_smem_to_gmem(slot, values_gmem.at[pl.ds(first_row, ROWS), columns])

            each_block(x_pieces, blocks, consume)
            if w == 0:
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the last tile's scale copy has read
                s_smem[...] = jnp.where(kept, scale, 0.0)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(s_smem, scale_gmem.at[pl.ds(first_row, ROWS)])

        def step(indices, *refs):
            x_pieces, carry = refs[:-1], refs[-1]
            tile = indices[0] * programs + sm

            parity = lax.rem(indices[0], 2)
            for w, (first, last) in enumerate(cfg.block_ranges()):

                @pl.when((tile < row_tiles) & (wg == w))
                def _(w=w, blocks=range(first, last)):
                    process(tile, parity, x_pieces, w, blocks)

            return carry

        def context(run):
            @pl.when(wg == 0)  # one copy of H_64 for every compute warpgroup
            def _():
                plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_barrier)

            plgpu.barrier_wait(h_barrier)
            run(jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        pipeline(step, context)(*(x_gmem for _ in range(pieces)), allocations=allocations)


def rotate_quantize(
    x: jax.Array, h: jax.Array, num_valid_tokens: jax.Array, cfg: MosaicRotation, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``x [M, K]`` bf16 rotated by Hadamard blocks (``h``: the ``[64, 64]``
    ±1 matrix, bf16) and quantized per token: ``(values [M, K]
    float8_e4m3fn, scale [M, 1] f32)``, rows at or past ``num_valid_tokens``
    (``int32 [1]``) zero."""
    why = refusal(cfg)
    if why:
        raise ValueError(f"mosaic process_input: {why}")
    m = x.shape[0]
    padded = -(-max(m, 1) // ROWS) * ROWS
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    row_tiles = padded // ROWS
    sms = persistent_programs(interpret)
    steps = -(-row_tiles // sms)
    programs = -(-row_tiles // steps)  # every program takes `steps` tiles, the last ones fewer
    kernel = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, steps=steps, programs=programs, interpret=interpret),
        out_type=(
            jax.ShapeDtypeStruct((padded, cfg.k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((padded,), jnp.float32),
        ),
        grid=(programs,),
        grid_names=("sm",),
        num_threads=cfg.warpgroups + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        # Interpreted, fresh memory reads as NaN: a row the kernel failed to store shows.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    values, scale = kernel(num_valid_tokens.reshape(-1)[:1].astype(jnp.int32), x, h)
    return values[:m], scale[:m, None]
