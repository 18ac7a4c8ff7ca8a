"""W8A8 on the fp8 tensor cores with the two compute warpgroups in ping-pong
(Hopper, sm_90): each warpgroup owns whole output tiles — the program's even
tiles and its odd ones — fed by its own ring of ``stages`` shared-memory
steps, and the two take turns on the tensor cores a tile at a time, so one's
epilogue (scale, convert, store) runs under the other's products. The
cooperative kernel (:mod:`mosaic_fp8`) runs both warpgroups on one tile and
leaves the tensor cores idle through every tile's epilogue: on short K (qwen3's
w2, K = 768: six steps a tile) that is a large share of the time.

e4m3/e5m2 inputs with a scale a row and 128 columns times e4m3 weights with a
scale a 128 x 128 block (the block-scaled W8A8 of the anchor table), a fresh
accumulator a step scaled into the f32 sum; or MXFP4 weights decoded first to
an e4m3 copy (``dequantize_first``: W4A8's path from many rows an expert, as
:mod:`mosaic_fp8`'s), its scale a column on the sum. Layouts as
:mod:`mosaic_fp8`'s (grouped through the row-tile table, indexed in block
order). Tiling :class:`Tiles`; what it cannot take :func:`supports`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm import mosaic, mosaic_fp8, mx_e4m3
from pallas_kernels.gemm.spec import GemmCall, check_positive, tile_order

BLOCK_K = mosaic_fp8.BLOCK_K
COMPUTE_WGS = 2  # the ping-pong pair; the memory warpgroup is the third
MEMORY_REGISTERS, COMPUTE_REGISTERS = 40, 232  # setmaxnreg: 40 + 2 x 232 <= 512 a thread slot


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A warpgroup's output tile of ``block_m`` rows by ``block_n`` columns,
    ``stages`` K steps of 128 in flight in each warpgroup's ring, programs
    ordered in bands of ``group_m`` row tiles."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 4
    group_m: int = 8
    # MXFP4 (W4A8): every code decoded once a call into an e4m3 copy of the weight
    # (mx_e4m3.decoded_weight), then the loop above with a scale a column.
    dequantize_first: bool = False

    def __post_init__(self):
        check_positive(self, ("block_m", "block_n", "stages", "group_m"))


def shared_memory_bytes(tiles: Tiles, out_dtype) -> int:
    """Bytes a program allocates: two rings of ``stages`` steps (x's e4m3 box,
    the weight's, x's step scales), two epilogue slots and the barriers (8
    bytes each: three a step filled, one a step consumed, two turns)."""
    step = (tiles.block_m + tiles.block_n) * BLOCK_K + 4 * tiles.block_m
    slots = COMPUTE_WGS * tiles.block_m * mosaic.EPILOGUE_COLUMNS * jnp.dtype(out_dtype).itemsize
    barriers = 8 * (4 * COMPUTE_WGS * tiles.stages + COMPUTE_WGS)
    return mosaic.pipeline_bytes(COMPUTE_WGS * tiles.stages, step) + slots + barriers


def tiles_refusal(tiles: Tiles, n: int, k: int) -> str | None:
    """Why the TMA boxes and wgmma tiles cannot take these shapes (None if they can)."""
    if tiles.block_m not in (64, 128):
        return f"block_m={tiles.block_m} (64 or 128: the wgmma's rows)"
    if tiles.block_n % mosaic.EPILOGUE_COLUMNS or tiles.block_n > 256:
        return f"block_n={tiles.block_n} (a multiple of {mosaic.EPILOGUE_COLUMNS}, at most 256)"
    # the running sum and a step's fresh product, both in registers
    if tiles.block_m * tiles.block_n > 64 * 128:
        return f"a warpgroup tile of {tiles.block_m} x {tiles.block_n} (at most {64 * 128} values twice)"
    if n % tiles.block_n:
        return f"N={n}, not a multiple of block_n={tiles.block_n}"
    if k % BLOCK_K:
        return f"K={k}, not a multiple of {BLOCK_K}"
    return None


def supports(tiles: Tiles, call: GemmCall) -> str | None:
    """Why this kernel cannot run ``call`` with ``tiles`` (None if it can)."""
    reason = mosaic_fp8.scaling_refusal(call)
    if reason:
        return reason
    scaling = mosaic_fp8.scaling_of(call)
    if scaling.x != "group" or scaling.w not in ("block", "mx"):
        return f"{scaling.x} input and {scaling.w} weight scales (group-scaled inputs; block-scaled weights or MXFP4)"
    if scaling.mx != tiles.dequantize_first:
        return "MXFP4 weights without dequantize_first, or dequantize_first with e4m3 weights (nothing to decode)"
    if not call.interpret and not mosaic.hopper_gpu():
        return f"this device ({jax.devices()[0].device_kind}: the kernel needs a Hopper GPU, sm_90)"
    if call.layout.kind == "indexed" and call.layout.block_size != tiles.block_m:
        return f"an indexed block_size of {call.layout.block_size} with block_m={tiles.block_m} (a tile is a block)"
    if call.use_f16_accum:
        return "f16 accumulation"
    if call.out_dtype not in ("bfloat16", "float16", "float32"):
        return f"out_dtype={call.out_dtype}"
    reason = tiles_refusal(tiles, call.weight.n, call.weight.k)
    if reason:
        return reason
    return mosaic.shared_memory_refusal(shared_memory_bytes(tiles, call.out_dtype), tiles)


def _kernel(
    table_ref,
    x_gmem,
    w_gmem,
    x_scale_gmem,
    w_scale_gmem,
    o_gmem,
    x_smem,
    w_smem,
    s_smem,
    full,
    empty,
    turn,
    o_smem,
    *,
    tiles: Tiles,
    num_experts: int,
    row_tiles: int,
    per_column: bool,
):
    k, n = x_gmem.shape[1], w_gmem.shape[1]
    bm, bn, stages = tiles.block_m, tiles.block_n, tiles.stages
    steps, col_tiles = k // BLOCK_K, n // bn
    total = row_tiles * col_tiles
    sm, programs = lax.axis_index("sm"), lax.axis_size("sm")
    mine = lax.div(total - sm + programs - 1, programs)  # this program's tiles: sm, sm + programs, ...
    wg = lax.axis_index("wg")
    row_layout, column_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def tile_of(j):
        """(group, load row, first row, rows, first column) of the program's j-th tile."""
        row_tile, col_tile = tile_order(sm + j * programs, row_tiles, col_tiles, tiles.group_m)
        load_row = pl.multiple_of(table_ref[row_tile, 1], mosaic.ROW_ALIGN)
        return table_ref[row_tile, 0], load_row, table_ref[row_tile, 2], table_ref[row_tile, 3], col_tile * bn

    def multiplied(group, rows):
        return (rows > 0) & (group < num_experts)

    @pl.when(wg == COMPUTE_WGS)
    def _():  # the memory warpgroup: every multiplied tile's steps into its warpgroup's ring, in order
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        def tile_loads(j, issued):  # issued: steps each ring has been given so far
            group, load_row, _, rows, first_col = tile_of(j)
            ring = j % COMPUTE_WGS
            done = jnp.where(ring == 0, issued[0], issued[1])

            @pl.when(multiplied(group, rows))
            def _():
                @pl.loop(0, steps)
                def _(step):
                    count = done + step
                    slot = lax.rem(count, stages)
                    barrier = ring * stages + slot

                    @pl.when(count >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[barrier])

                    columns = pl.ds(step * BLOCK_K, BLOCK_K)
                    x_box = x_gmem.at[pl.ds(load_row, bm), columns]
                    plgpu.copy_gmem_to_smem(x_box, x_smem.at[ring, slot], full.at[3 * barrier])
                    w_box = w_gmem.at[group, pl.ds(first_col, bn), columns]
                    plgpu.copy_gmem_to_smem(w_box, w_smem.at[ring, slot], full.at[3 * barrier + 1])
                    s_box = x_scale_gmem.at[pl.ds(step, 1), pl.ds(load_row, bm)]
                    plgpu.copy_gmem_to_smem(s_box, s_smem.at[ring, slot], full.at[3 * barrier + 2])

            more = jnp.where(multiplied(group, rows), steps, 0)
            return (issued[0] + jnp.where(ring == 0, more, 0), issued[1] + jnp.where(ring == 1, more, 0))

        issued = lax.fori_loop(0, mine, tile_loads, (jnp.int32(0), jnp.int32(0)))
        for ring in range(COMPUTE_WGS):  # the last steps' consumption, before the buffers go

            @pl.loop(jnp.maximum(issued[ring] - stages, 0), issued[ring])
            def _(count, ring=ring):
                plgpu.barrier_wait(empty.at[ring * stages + lax.rem(count, stages)])

    @pl.when(wg < COMPUTE_WGS)
    def _():  # a compute warpgroup: its tiles (j = wg, wg + 2, ...), a turn on the tensor cores each
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

        def own_tile(i, consumed):
            j = wg + COMPUTE_WGS * i
            group, load_row, first_row, rows, first_col = tile_of(j)

            @pl.when(j > 0)
            def _():  # the other warpgroup's products of tile j - 1 are issued and done
                plgpu.barrier_wait(turn.at[wg])

            def step_product(step, carry):
                count = consumed + step
                slot = lax.rem(count, stages)
                barrier = wg * stages + slot
                for part in range(3):
                    plgpu.barrier_wait(full.at[3 * barrier + part])

                def product(acc_ref):
                    plgpu.wgmma(acc_ref, x_smem.at[wg, slot], w_smem.at[wg, slot].transpose((1, 0)))
                    return acc_ref[...]

                part = pl.run_scoped(product, plgpu.ACC((bm, bn), jnp.float32))
                row_scale = plgpu.load(s_smem.at[wg, slot, 0], layout=row_layout, optimized=False)
                plgpu.barrier_arrive(empty.at[barrier])
                if not per_column:  # the weight block's scale, this step's
                    row_scale = row_scale * w_scale_gmem[group, first_col // BLOCK_K, step]
                return carry + part * row_scale[:, None]

            is_multiplied = multiplied(group, rows)
            zeros = plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA)
            acc = lax.fori_loop(0, jnp.where(is_multiplied, steps, 0), step_product, zeros)

            @pl.when(j + 1 < mine)
            def _():  # the next tile's warpgroup may multiply
                plgpu.barrier_arrive(turn.at[1 - wg])

            span = (first_row, first_row - load_row, rows)

            @pl.when(is_multiplied)
            def _():
                out = acc
                if per_column:  # the e4m3 copy's scale a column
                    column = w_scale_gmem.at[group, pl.ds(first_col, bn)]
                    out = out * plgpu.load(column, layout=column_layout, optimized=False)[None, :]
                mosaic.store_tile(out.astype(o_gmem.dtype), o_smem.at[wg], o_gmem, first_col, span)

            @pl.when((rows > 0) & ~is_multiplied)
            def _():  # rows no expert owns: the zeros they hold
                mosaic.store_tile(acc.astype(o_gmem.dtype), o_smem.at[wg], o_gmem, first_col, span)

            return consumed + jnp.where(is_multiplied, steps, 0)

        own = lax.div(mine - wg + COMPUTE_WGS - 1, COMPUTE_WGS)
        lax.fori_loop(0, own, own_tile, jnp.int32(0))

    plgpu.wait_smem_to_gmem(0)


def expert_gemm_fp8_pingpong(
    x: jax.Array,
    x_scale: jax.Array,
    weight: jax.Array,
    w_scale: jax.Array,
    offsets: jax.Array | None,
    tiles: Tiles,
    *,
    out_dtype,
    counts: jax.Array | None = None,
    interpret: bool = False,
    table: jax.Array | None = None,
    half_bits: bool = True,
    k_major_scales: bool = True,
) -> jax.Array:
    """``x [M, K]`` e4m3/e5m2 with ``x_scale [M, K/128]`` (f32) times ``weight
    [E, N, K]`` e4m3 with ``w_scale [E, N/128, K/128]`` (f32) — with
    ``tiles.dequantize_first``, MXFP4's planar codes ``uint8 [E, N, K/2]``
    (``half_bits``: the pair decoder's bit order) with e8m0 ``w_scale [E,
    K/32, N]`` (``[E, N, K/32]`` unless ``k_major_scales``) —: ``[M, N]`` in
    ``out_dtype``, rows through their experts as :func:`mosaic_fp8.expert_gemm_fp8`'s."""
    m, k = x.shape
    num_experts, n = weight.shape[:2]
    reason = tiles_refusal(tiles, n, k) or mosaic.shared_memory_refusal(shared_memory_bytes(tiles, out_dtype), tiles)
    if reason:
        raise ValueError(f"mosaic_fp8_pingpong GEMM: {reason}")
    if x.dtype.name not in mosaic_fp8.FP8_INPUTS:
        raise ValueError(f"mosaic_fp8_pingpong GEMM: x e4m3/e5m2; got {x.dtype}")
    if tiles.dequantize_first:  # MXFP4 (planar codes uint8 [E, N, K/2], e8m0 scales) to an e4m3 copy
        codes, raw, top, w_scale = mx_e4m3.mx_operands(weight, w_scale, k_major_scales)
        weight = mx_e4m3.decoded_weight(codes, raw, top, half_bits, interpret)
        scaling = mosaic_fp8.Scaling("group", "channel")
    elif weight.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"mosaic_fp8_pingpong GEMM: weight e4m3 (or MXFP4 with dequantize_first); got {weight.dtype}")
    else:
        scaling = mosaic_fp8.Scaling("group", "block")
    padded = mosaic.padded_rows(m, tiles.block_m)
    x_scale, w_scale = mosaic_fp8._flat_scales(scaling, x_scale, w_scale, padded, m, k)
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    if table is None:
        starts, ends = mosaic.row_ranges(offsets, counts, m, num_experts)
        table = mosaic.row_tile_table(starts, ends, num_experts, m, tiles.block_m)
    ring = (COMPUTE_WGS, tiles.stages)
    scratch = dict(
        x_smem=plgpu.SMEM((*ring, tiles.block_m, BLOCK_K), x.dtype, transforms=mosaic.swizzled(BLOCK_K, x.dtype)),
        w_smem=plgpu.SMEM(
            (*ring, tiles.block_n, BLOCK_K), weight.dtype, transforms=mosaic.swizzled(BLOCK_K, weight.dtype)
        ),
        s_smem=plgpu.SMEM((*ring, 1, tiles.block_m), jnp.float32),
        full=plgpu.Barrier(num_barriers=3 * COMPUTE_WGS * tiles.stages),  # x, weight and scales a step
        empty=plgpu.Barrier(num_barriers=COMPUTE_WGS * tiles.stages),
        turn=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        o_smem=plgpu.SMEM((COMPUTE_WGS, tiles.block_m, mosaic.EPILOGUE_COLUMNS), jnp.dtype(out_dtype)),
    )
    body = functools.partial(
        _kernel, tiles=tiles, num_experts=num_experts, row_tiles=table.shape[0], per_column=scaling.w == "channel"
    )
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        scratch_types=scratch,
        grid=(mosaic.persistent_programs(interpret),),
        grid_names=("sm",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name="moe_gemm_mosaic_fp8_pingpong",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    return kernel(table, x, weight, x_scale, w_scale)


def expert_gemm(
    call: GemmCall, tiles: Tiles, x: jax.Array, weight_arrays, bias, route_arrays, x_scale: jax.Array | None = None
) -> jax.Array:
    """The family's entry point (as :func:`mosaic_fp8.expert_gemm`)."""
    if x_scale is None:
        raise ValueError("mosaic_fp8_pingpong.expert_gemm: x_scale: the kernel takes scaled 8-bit inputs")
    if bias is not None:
        raise ValueError("mosaic_fp8_pingpong.expert_gemm: bias: not taken (the experiment's case has none)")
    layout, scaling = call.layout, mosaic_fp8.scaling_of(call)
    (x, x_scale), offsets, routing, slots = mosaic.routed(layout, route_arrays, call.weight.num_experts, x, x_scale)
    out = expert_gemm_fp8_pingpong(
        x,
        x_scale,
        weight_arrays[0],
        weight_arrays[1],
        offsets,
        tiles,
        out_dtype=jnp.dtype(call.out_dtype),
        interpret=call.interpret,
        half_bits=scaling.half_bits,
        k_major_scales=scaling.k_major_scales,
        **routing,
    )
    return out if slots is None else mosaic.to_slots(out, slots, layout.m_out)
