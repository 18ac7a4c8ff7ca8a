"""Grouped expert GEMM on Mosaic GPU (Hopper): TMA loads into swizzled shared
memory, warp-specialized wgmma, a persistent loop over output tiles.

The Triton-lowered family in :mod:`pallas_kernels.gemm` covers every weight
format and layout; this kernel is its 16-bit prefill member, where the
cp.async-pipelined Triton tile stops at ~510 TFLOP/s (mixtral w13). One
warpgroup issues the TMA copies of each K step, two compute warpgroups run
the products of one ``[block_m, block_n]`` output tile, each on half its
columns (``wgmma``: x from shared memory, the weight tile ``[block_n/2, bk]``
transposed in place as the B operand).

Rows: TMA cannot gather, so a row tile is ``block_m`` consecutive rows of x.
The launcher turns the layout into a table of row tiles — ``(group, load
row, first row, rows)`` each: an expert's rows cut into tiles from the
multiple of 8 at or below its first row (a TMA box into 8-row tiled shared
memory starts on that grid), the rows no expert owns as a group of zeros —
so no tile mixes experts. A tile loads ``block_m`` rows from its load row
(inside x; the rows that are not its own are read and ignored) and stores
only its own rows, as a sum of power-of-two row slices (TMA boxes are
static; their starts are not).

Layouts: ``dense`` (one expert) and ``grouped_contiguous`` (``offsets [E+1]``).
Weights: bf16/f16 ``[E, N, K]`` (K contiguous), no bias.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm import tile_order

COMPUTE_WARPGROUPS = 2
EPILOGUE_COLUMNS = 64  # output columns per shared-memory store slot
H100_SMS = 132  # H100 / H200: programs of the persistent grid when the device does not say


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """``block_m`` rows by ``block_n`` columns per output tile (each compute
    warpgroup takes ``block_n / 2``), ``block_k`` per pipeline step, ``stages``
    steps in flight, programs ordered in bands of ``group_m`` row tiles."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    group_m: int = 8

    @property
    def wg_n(self) -> int:
        return self.block_n // COMPUTE_WARPGROUPS


def check_tiles(tiles: MosaicTiles, n: int, k: int, dtype) -> None:
    """The shapes the kernel's static TMA boxes and wgmma tiles need."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize != 2:
        raise ValueError(f"mosaic GEMM: 16-bit inputs and weights, got {jnp.dtype(dtype)}")
    if tiles.block_m not in (64, 128):
        raise ValueError(f"mosaic GEMM: block_m must be 64 or 128, got {tiles.block_m}")
    if tiles.wg_n % EPILOGUE_COLUMNS or tiles.wg_n > 256:
        raise ValueError(
            f"mosaic GEMM: block_n must be a multiple of {COMPUTE_WARPGROUPS * EPILOGUE_COLUMNS} "
            f"and at most 512, got {tiles.block_n}"
        )
    if tiles.block_m * tiles.wg_n > 128 * 128:  # 128 f32 registers a thread for the accumulator
        raise ValueError(
            f"mosaic GEMM: block_m * block_n / 2 must be at most 128 * 128, got {tiles.block_m} x {tiles.block_n}"
        )
    if tiles.block_k * itemsize not in (32, 64, 128):
        raise ValueError(f"mosaic GEMM: block_k must be 16, 32 or 64 for 16-bit operands, got {tiles.block_k}")
    if n % tiles.block_n:
        raise ValueError(f"mosaic GEMM: N={n} must be a multiple of block_n={tiles.block_n}")
    if k % tiles.block_k:
        raise ValueError(f"mosaic GEMM: K={k} must be a multiple of block_k={tiles.block_k}")


def max_row_tiles(groups: int, m: int, block_m: int) -> int:
    """Static bound on the row tiles of ``m`` rows cut per group, each group's
    tiles starting up to 7 rows before its first row: at most min(groups, m)
    groups hold rows, each one tile plus one per further block_m rows (the
    7 rows in front add at most one tile per group)."""
    busy = min(groups, m)
    return max(1, 2 * busy + m // block_m)


ROW_ALIGN = 8  # a TMA box into 8-row tiled shared memory starts on a multiple of 8 rows


def row_tile_table(offsets: jax.Array, m: int, block_m: int) -> jax.Array:
    """``[tiles, 4]`` int32 ``(group, load row, first row, rows)`` per row
    tile: the rows ``offsets [E+1]`` give each expert, and the rows outside
    them (before ``offsets[0]``, from ``offsets[E]`` to ``m``) as group E
    (stored as zeros), cut into tiles of
    ``block_m`` from the multiple of 8 at or below the group's first row. A
    tile loads ``block_m`` rows of x from its load row (a multiple of 8,
    inside ``padded_rows(m, block_m)``) and stores ``rows`` rows from its first
    row; tiles past the last have 0 rows."""
    num_experts = offsets.shape[0] - 1
    offsets = jnp.clip(offsets.astype(jnp.int32), 0, m)
    # The experts' ranges, then the rows before the first and after the last (zeros).
    starts = jnp.concatenate([offsets[:-1], jnp.zeros((1,), jnp.int32), offsets[-1:]])
    ends = jnp.concatenate([offsets[1:], offsets[:1], jnp.full((1,), m, jnp.int32)])
    ends = jnp.maximum(ends, starts)
    aligned = starts - starts % ROW_ALIGN
    per_group = jnp.where(ends > starts, (ends - aligned + block_m - 1) // block_m, 0)
    tile_ends = jnp.cumsum(per_group)
    tile = jnp.arange(max_row_tiles(num_experts + 2, m, block_m), dtype=jnp.int32)
    index = jnp.minimum(jnp.searchsorted(tile_ends, tile, side="right"), num_experts + 1).astype(jnp.int32)
    group = jnp.minimum(index, num_experts)  # both zero ranges are group E
    tile_start = aligned[index] + (tile - (tile_ends[index] - per_group[index])) * block_m
    first = jnp.maximum(tile_start, starts[index])
    rows = jnp.clip(jnp.minimum(tile_start + block_m, ends[index]) - first, 0, block_m)
    rows = jnp.where(tile < tile_ends[-1], rows, 0)
    load = jnp.clip(tile_start, 0, padded_rows(m, block_m) - block_m)
    return jnp.stack([group, load, first, rows], axis=1)


def padded_rows(m: int, block_m: int) -> int:
    """Rows of x the kernel reads: at least one tile, a multiple of 8."""
    return -(-max(m, block_m) // ROW_ALIGN) * ROW_ALIGN


def _store_rows(o_smem, o_gmem_cols, first_row, offset, rows, block_m: int):
    """Rows ``[offset, offset + rows)`` of the shared tile ``o_smem`` to
    gmem rows ``[first_row, first_row + rows)`` as a sum of power-of-two
    slices (static TMA boxes, dynamic starts)."""
    done = jnp.int32(0)
    size = block_m
    while size:

        @pl.when(rows & size != 0)
        def _(size=size, done=done):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(offset + done, size)], o_gmem_cols.at[pl.ds(first_row + done, size)]
            )

        done = done + (rows & size)
        size //= 2


def _kernel(table_ref, x_gmem, w_gmem, o_gmem, *, tiles: MosaicTiles, num_experts: int, row_tiles: int):
    m, k = x_gmem.shape
    n = w_gmem.shape[1]
    bm, bk, wg_n = tiles.block_m, tiles.block_k, tiles.wg_n
    col_tiles = n // tiles.block_n
    swizzle = plgpu.find_swizzle(bk * jnp.dtype(x_gmem.dtype).itemsize * 8)
    transforms = (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(x_gmem.dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )

    def pipeline(step, context):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k // bk,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda i: (0, i), transforms=transforms),
                plgpu.BlockSpec((tiles.block_n, bk), lambda i: (0, i), transforms=transforms),
            ],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WARPGROUPS,
            max_concurrent_steps=tiles.stages,
            compute_context=context,
        )

    unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(x_gmem, w_gmem.at[0]),
        o_smem=plgpu.SMEM((COMPUTE_WARPGROUPS, bm, EPILOGUE_COLUMNS), o_gmem.dtype),
        collective_axes="wg",
    )
    def _(allocations, o_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((row_tiles * col_tiles,), collective_axes="sm")
        def _(loop):
            (item,) = loop.index
            row_tile, col_tile = tile_order(item, row_tiles, col_tiles, tiles.group_m)
            group, load_row = table_ref[row_tile, 0], pl.multiple_of(table_ref[row_tile, 1], ROW_ALIGN)
            first_row, rows = table_ref[row_tile, 2], table_ref[row_tile, 3]
            offset = first_row - load_row  # the tile's own rows in the loaded box (the others are not stored)
            wg_cols = col_tile * tiles.block_n + wg * wg_n

            def store(acc):
                """The compute warpgroup's ``[bm, wg_n]`` result, its own rows only."""
                for chunk in range(wg_n // EPILOGUE_COLUMNS):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's last copy has read it
                    o_smem[wg] = acc[:, chunk * EPILOGUE_COLUMNS : (chunk + 1) * EPILOGUE_COLUMNS]
                    plgpu.commit_smem()
                    cols = o_gmem.at[:, pl.ds(wg_cols + chunk * EPILOGUE_COLUMNS, EPILOGUE_COLUMNS)]
                    _store_rows(o_smem.at[wg], cols, first_row, offset, rows, bm)

            def context(run):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, wg_n), jnp.float32))
                def _(acc_ref):
                    run(acc_ref)
                    store(acc_ref[...].astype(o_gmem.dtype))

            def step(_, x_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, x_smem, w_smem.at[pl.ds(pl.multiple_of(wg * wg_n, wg_n), wg_n)].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            @pl.when((rows > 0) & (group < num_experts))
            def _():
                pipeline(step, context)(
                    x_gmem.at[pl.ds(load_row, bm)],
                    w_gmem.at[group, pl.ds(col_tile * tiles.block_n, tiles.block_n)],
                    allocations=allocations,
                )

            @pl.when((rows > 0) & (group >= num_experts) & (wg < COMPUTE_WARPGROUPS))
            def _():  # rows no expert owns: zeros
                store(jnp.zeros((bm, wg_n), o_gmem.dtype))

    plgpu.wait_smem_to_gmem(0)


def expert_gemm_mosaic(
    x: jax.Array,
    weight: jax.Array,
    offsets: jax.Array | None,
    tiles: MosaicTiles,
    *,
    out_dtype,
    interpret: bool = False,
) -> jax.Array:
    """``x [M, K]`` (bf16/f16) times the 16-bit ``weight [E, N, K]``: row
    ``r`` of the ``[M, N]`` result (``out_dtype``) uses the expert whose range
    ``[offsets[e], offsets[e+1])`` holds it (``offsets`` None: the one expert
    of a dense layout); rows outside every range are zero."""
    m, k = x.shape
    num_experts, n, _ = weight.shape
    check_tiles(tiles, n, k, x.dtype)
    if offsets is None:
        offsets = jnp.asarray([0, m], jnp.int32)
    padded = padded_rows(m, tiles.block_m)  # a row tile's box fits inside x
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    table = row_tile_table(offsets.astype(jnp.int32), m, tiles.block_m)
    row_tiles = table.shape[0]
    # One persistent program per SM (a few when interpreted: the loop covers every tile either way).
    sms = 4 if interpret else getattr(jax.devices()[0], "core_count", None) or H100_SMS
    kernel = plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, num_experts=num_experts, row_tiles=row_tiles),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(sms,),
        grid_names=("sm",),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        # Interpreted, fresh memory reads as NaN: a row the kernel failed to store shows.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    return kernel(table, x, weight)
