"""The Mosaic GPU expert GEMM on the fp8 tensor cores (Hopper, sm_90): e4m3 or
e5m2 inputs times e4m3 weights, wgmma with 8-bit operands and f32 sums, TMA
loads into 128-byte swizzled shared memory, warp-specialized, persistent.

Scales: a 128 x 128 weight block's and a row's 128-column input group's
multiply each K step's product — a fresh accumulator a step, added to the
running f32 sum times the product of the two (the promotion of the CUDA fp8
libraries); per-channel or per-tensor weight scales and per-row or per-tensor
input scales multiply the sum. Layouts ``dense``, ``grouped_contiguous`` and
``grouped_masked``, cut into row tiles as the 16-bit kernel's
(:func:`mosaic.row_tile_table`). Tiling :class:`Tiles`; what it cannot take
:func:`supports`. Notes: benchmarks/notes/quantized_input.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm import mosaic
from pallas_kernels.gemm.spec import GemmCall, check_positive, tile_order

BLOCK_K = 128  # a K step: one 128-byte swizzled row of 8-bit values, one scale group
FP8_INPUTS = ("float8_e4m3fn", "float8_e5m2")
WEIGHT_SCALES = ("tensor", "channel", "block")
INPUT_SCALES = ("tensor", "token", "group")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """``block_m`` rows by ``block_n`` columns per output tile (each of the two
    compute warpgroups takes ``block_n / 2``), one K step of :data:`BLOCK_K`,
    ``stages`` steps in flight, programs ordered in bands of ``group_m`` row
    tiles."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 4
    group_m: int = 8

    def __post_init__(self):
        check_positive(self, ("block_m", "block_n", "stages", "group_m"))

    @property
    def wg_m(self) -> int:
        return self.block_m

    @property
    def wg_n(self) -> int:
        return self.block_n // mosaic.COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How the call's scales apply: ``x`` tensor / token / group (128 columns,
    f32), ``w`` tensor / channel / block (128 x 128, f32)."""

    x: str
    w: str

    @property
    def per_step(self) -> bool:
        """A scale changes along K: each step's product is scaled on its own."""
        return self.x == "group" or self.w == "block"


def tiles_refusal(tiles: Tiles, n: int, k: int, scaling: Scaling) -> str | None:
    """Why the static TMA boxes and wgmma tiles cannot take these shapes (None if they can)."""
    if tiles.wg_m not in (64, 128):
        return f"block_m={tiles.block_m} (64 or 128: the wgmma's rows)"
    if tiles.wg_n % mosaic.EPILOGUE_COLUMNS or tiles.wg_n > 256:
        return f"block_n={tiles.block_n} (a multiple of {mosaic.COMPUTE_WGS * mosaic.EPILOGUE_COLUMNS}, at most 512)"
    # A thread holds the accumulator in registers (128 f32 at most), per step twice
    # (then a warpgroup's columns, at most 128, lie in one 128-column weight block).
    most = 64 * 128 if scaling.per_step else 128 * 128
    if tiles.wg_m * tiles.wg_n > most:
        twice = " twice" if scaling.per_step else ""
        return f"a warpgroup accumulator of {tiles.wg_m} x {tiles.wg_n} (at most {most} values{twice})"
    if n % tiles.block_n:
        return f"N={n}, not a multiple of block_n={tiles.block_n}"
    if k % BLOCK_K:
        return f"K={k}, not a multiple of {BLOCK_K}"
    return None


def scaling_refusal(call: GemmCall) -> str | None:
    """Why the call's weight and input are not e4m3 x fp8 with scales this kernel applies."""
    w, xs = call.weight, call.x_scale
    if call.x_dtype not in FP8_INPUTS or xs.mode not in INPUT_SCALES:
        return f"{call.x_dtype} inputs ({call.input_quant}): e4m3/e5m2 values with a scale"
    if xs.mode == "group" and (xs.group_size != BLOCK_K or xs.scale_type != "float32"):
        return f"input groups of {xs.group_size} {xs.scale_type} scales (f32 per {BLOCK_K} columns)"
    if w.value_type != "float8_e4m3" or w.scale not in WEIGHT_SCALES or w.scale_type != "float32":
        return f"{w.value_type} weights with {w.scale} {w.scale_type} scales (e4m3, f32 per tensor, channel or block)"
    if w.scale == "block" and (w.group_size, w.block_n) != (BLOCK_K, BLOCK_K):
        return f"{w.block_n} x {w.group_size} weight blocks ({BLOCK_K} x {BLOCK_K})"
    if w.zero_point != "none" or w.global_scale != "none" or w.has_group_index:
        return "weights with zero points, a global scale or a group index"
    return None


def supports(tiles: Tiles, call: GemmCall) -> str | None:
    """Why this kernel cannot run ``call`` with ``tiles`` (None if it can)."""
    reason = scaling_refusal(call)
    if reason:
        return reason
    if not call.interpret and not mosaic.hopper_gpu():
        return f"this device ({jax.devices()[0].device_kind}: the kernel needs a Hopper GPU, sm_90)"
    if call.layout.kind == "indexed":
        return "the indexed layout (TMA cannot gather rows)"
    if call.use_f16_accum:
        return "f16 accumulation"
    if call.out_dtype not in ("bfloat16", "float16", "float32"):
        return f"out_dtype={call.out_dtype}"
    return tiles_refusal(tiles, call.weight.n, call.weight.k, Scaling(call.x_scale.mode, call.weight.scale))


def _kernel(
    table_ref,
    x_gmem,
    w_gmem,
    x_scale_gmem,
    w_scale_gmem,
    *rest,
    tiles: Tiles,
    scaling: Scaling,
    num_experts: int,
    row_tiles: int,
):
    bias_gmem, o_gmem = rest if len(rest) == 2 else (None, rest[0])
    k = x_gmem.shape[1]
    n = w_gmem.shape[1]
    bm, wg_m, wg_n = tiles.block_m, tiles.wg_m, tiles.wg_n
    col_tiles = n // tiles.block_n
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    in_specs = [
        plgpu.BlockSpec((bm, BLOCK_K), lambda i: (0, i), transforms=mosaic.swizzled(BLOCK_K, x_gmem.dtype)),
        plgpu.BlockSpec((tiles.block_n, BLOCK_K), lambda i: (0, i), transforms=mosaic.swizzled(BLOCK_K, w_gmem.dtype)),
    ]
    if scaling.x == "group":  # the step's scale of each row: x_scale transposed, [K / 128, rows]
        in_specs.append(plgpu.BlockSpec((1, bm), lambda i: (i, 0)))

    pipeline = functools.partial(mosaic.k_pipeline, steps=k // BLOCK_K, in_specs=in_specs, stages=tiles.stages)

    def operands(group, col_tile, load_row):
        cols = pl.ds(col_tile * tiles.block_n, tiles.block_n)
        found = [x_gmem.at[pl.ds(load_row, bm)], w_gmem.at[group, cols]]
        if scaling.x == "group":
            found.append(x_scale_gmem.at[:, pl.ds(load_row, bm)])
        return found

    unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(*operands(0, 0, 0)),
        o_smem=plgpu.SMEM((mosaic.COMPUTE_WGS, wg_m, mosaic.EPILOGUE_COLUMNS), o_gmem.dtype),
        collective_axes="wg",
    )
    def _(allocations, o_smem):
        wg = lax.axis_index("wg")
        wg_slice = pl.ds(pl.multiple_of(wg * wg_n, wg_n), wg_n)

        @plgpu.nd_loop((row_tiles * col_tiles,), collective_axes="sm")
        def _(loop):
            (item,) = loop.index
            row_tile, col_tile = tile_order(item, row_tiles, col_tiles, tiles.group_m)
            group, load_row = table_ref[row_tile, 0], pl.multiple_of(table_ref[row_tile, 1], mosaic.ROW_ALIGN)
            first_row, rows = table_ref[row_tile, 2], table_ref[row_tile, 3]
            offset = first_row - load_row
            wg_cols = col_tile * tiles.block_n + wg * wg_n

            def store(acc):
                mosaic.store_tile(acc, o_smem.at[wg], o_gmem, wg_cols, (first_row, offset, rows))

            def epilogue(acc):
                """The sum times the scales that do not change along K, plus the bias."""
                if scaling.x == "token":
                    row_scale = plgpu.load(x_scale_gmem.at[pl.ds(load_row, bm)], layout=row_layout, optimized=False)
                    acc = acc * row_scale[:, None]
                elif scaling.x == "tensor":
                    acc = acc * x_scale_gmem[0]
                if scaling.w == "channel":
                    col_scale = plgpu.load(
                        w_scale_gmem.at[group, pl.ds(wg_cols, wg_n)], layout=col_layout, optimized=False
                    )
                    acc = acc * col_scale[None, :]
                elif scaling.w == "tensor":
                    acc = acc * w_scale_gmem[group]
                if bias_gmem is not None:
                    bias_ref = bias_gmem.at[group, pl.ds(wg_cols, wg_n)]
                    acc = acc + plgpu.load(bias_ref, layout=col_layout, optimized=False).astype(jnp.float32)[None, :]
                store(acc.astype(o_gmem.dtype))

            def summed_context(run):  # every scale on the sum: one accumulator through K
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wg_m, wg_n), jnp.float32))
                def _(acc_ref):
                    run(acc_ref)
                    epilogue(acc_ref[...])

            def summed_step(indices, x_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, x_smem, w_smem.at[wg_slice].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            def promoted_context(run):
                epilogue(run(jnp.zeros((wg_m, wg_n), jnp.float32)))

            def promoted_step(indices, x_smem, w_smem, *rest):
                *x_scale_smem, total = rest
                (step,) = indices

                def product(acc_ref):
                    plgpu.wgmma(acc_ref, x_smem, w_smem.at[wg_slice].transpose((1, 0)))
                    return acc_ref[...]

                part = pl.run_scoped(product, plgpu.ACC((wg_m, wg_n), jnp.float32))
                if scaling.w == "block":
                    w_scale = w_scale_gmem[group, wg_cols // BLOCK_K, step]
                if scaling.x == "group":
                    row_scale = plgpu.load(x_scale_smem[0].at[0], layout=row_layout, optimized=False)
                    if scaling.w == "block":
                        row_scale = row_scale * w_scale
                    return total + part * row_scale[:, None]
                return total + part * w_scale

            @pl.when((rows > 0) & (group < num_experts))
            def _():
                if scaling.per_step:
                    pipeline(promoted_step, promoted_context)(
                        *operands(group, col_tile, load_row), allocations=allocations
                    )
                else:
                    pipeline(summed_step, summed_context)(*operands(group, col_tile, load_row), allocations=allocations)

            @pl.when((rows > 0) & (group >= num_experts) & (wg < mosaic.COMPUTE_WGS))
            def _():  # rows no expert owns: zeros
                store(jnp.zeros((wg_m, wg_n), o_gmem.dtype))

    plgpu.wait_smem_to_gmem(0)


def _flat_scales(scaling: Scaling, x_scale: jax.Array, w_scale: jax.Array, rows: int, m: int, k: int):
    """The scales as the kernel reads them: a row's per-step scales ``[K/128,
    rows]`` (``rows`` >= M, zero-padded), per-row ``[rows]`` or one ``[1]``;
    weight blocks ``[E, N/128, K/128]``, channels ``[E, N]`` or ``[E]``."""
    x_scale = x_scale.astype(jnp.float32)
    if scaling.x == "group":
        x_scale = jnp.pad(x_scale.reshape(m, k // BLOCK_K).T, ((0, 0), (0, rows - m)))
    elif scaling.x == "token":
        x_scale = jnp.pad(x_scale.reshape(m), (0, rows - m))
    else:
        x_scale = x_scale.reshape(1)
    w_scale = w_scale.astype(jnp.float32)
    if scaling.w == "channel":
        w_scale = w_scale.reshape(w_scale.shape[:2])
    elif scaling.w == "tensor":
        w_scale = w_scale.reshape(-1)
    return x_scale, w_scale


def expert_gemm_fp8(
    x: jax.Array,
    x_scale: jax.Array,
    weight: jax.Array,
    w_scale: jax.Array,
    offsets: jax.Array | None,
    tiles: Tiles,
    scaling: Scaling,
    *,
    out_dtype,
    counts: jax.Array | None = None,
    bias: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x [M, K]`` (e4m3 / e5m2) times ``x_scale`` (``[M, K/128]``, ``[M, 1]``
    or ``[1]`` f32, as ``scaling.x``) by the e4m3 ``weight [E, N, K]`` times
    ``w_scale`` (``[E, N/128, K/128]``, ``[E, N, 1]`` or ``[E, 1, 1]`` f32):
    ``[M, N]`` in ``out_dtype``, row ``r`` through the expert whose range
    ``[offsets[e], offsets[e+1])`` holds it (``offsets`` None: dense; with
    ``counts [E]``: grouped-masked, expert e's first ``counts[e]`` of its
    ``M / E`` rows); rows outside every range are zero. ``bias [E, N]`` is
    added in f32."""
    m, k = x.shape
    num_experts, n = weight.shape[:2]
    reason = tiles_refusal(tiles, n, k, scaling)
    if reason:
        raise ValueError(f"mosaic_fp8 GEMM: {reason}")
    if x.dtype.name not in FP8_INPUTS or weight.dtype != jnp.float8_e4m3fn or weight.shape[2] != k:
        raise ValueError(
            "mosaic_fp8 GEMM: x e4m3/e5m2 [M, K], weight e4m3 [E, N, K]; "
            f"got {x.dtype} {x.shape}, {weight.dtype} {weight.shape}"
        )
    starts, ends = mosaic.row_ranges(offsets, counts, m, num_experts)
    padded = mosaic.padded_rows(m, tiles.block_m)
    x_scale, w_scale = _flat_scales(scaling, x_scale, w_scale, padded, m, k)
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    table = mosaic.row_tile_table(starts, ends, num_experts, m, tiles.block_m)
    if bias is not None and bias.shape != (num_experts, n):
        raise ValueError(f"mosaic_fp8 GEMM: bias must be [E, N] = {(num_experts, n)}, got {bias.shape}")
    body = functools.partial(_kernel, tiles=tiles, scaling=scaling, num_experts=num_experts, row_tiles=table.shape[0])
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(mosaic.persistent_programs(interpret),),
        grid_names=("sm",),
        num_threads=mosaic.COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    return kernel(table, x, weight, x_scale, w_scale, *(() if bias is None else (bias,)))


def expert_gemm(
    call: GemmCall, tiles: Tiles, x: jax.Array, weight_arrays, bias, route_arrays, x_scale: jax.Array | None = None
) -> jax.Array:
    """The family's entry point (as ``triton.expert_gemm``): ``[M, N]`` in
    ``call.out_dtype``; ``weight_arrays = (e4m3 values, f32 scale)``,
    ``route_arrays`` the layout's (offsets | counts | none)."""
    if x_scale is None:
        raise ValueError("mosaic_fp8.expert_gemm: x_scale: the kernel takes scaled 8-bit inputs")
    layout = call.layout
    offsets = route_arrays[0] if layout.kind == "grouped_contiguous" else None
    counts = route_arrays[0] if layout.kind == "grouped_masked" else None
    return expert_gemm_fp8(
        x,
        x_scale,
        weight_arrays[0],
        weight_arrays[1],
        offsets,
        tiles,
        Scaling(call.x_scale.mode, call.weight.scale),
        out_dtype=jnp.dtype(call.out_dtype),
        counts=counts,
        bias=bias,
        interpret=call.interpret,
    )
