"""The Mosaic GPU expert GEMM on the fp8 tensor cores (Hopper, sm_90): e4m3 or
e5m2 inputs times e4m3 weights — or MXFP4 weights decoded to e4m3 in the
compute warpgroups (W4A8) —, wgmma with 8-bit operands and f32 sums, TMA
loads into swizzled shared memory, warp-specialized, persistent.

Scales: a weight block's (128 columns of K by 128 or 64 rows: a w13 whose
gate and up rows interleave by 64 stores a scale a 64-row block) and a row's
128-column input group's multiply each K step's product — a fresh accumulator a step, added to the
running f32 sum times the product of the two (the promotion of the CUDA fp8
libraries); per-channel or per-tensor weight scales and per-row or per-tensor
input scales multiply the sum. MXFP4 (W4A8, :mod:`mx_e4m3`): each K step's
codes decoded to e4m3 in the compute warpgroups, the sum times each column's
power of two in the epilogue — a step's promotion is then the
input's alone, as for e4m3 weights. Layouts ``dense``,
``grouped_contiguous`` and ``grouped_masked``, cut into row tiles as the
16-bit kernel's (:func:`mosaic.row_tile_table`); ``indexed`` through its rows
gathered in block order, one tile a block, each result row stored to its
slot. Tiling :class:`Tiles`; what it cannot take :func:`supports`. Notes:
benchmarks/notes/quantized_input.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import codecs
from pallas_kernels.gemm import mosaic, mx_e4m3
from pallas_kernels.gemm.spec import EpilogueActivation, GemmCall, WeightSpec, check_positive, tile_order

BLOCK_K = mx_e4m3.BLOCK_K  # a K step: one 128-byte swizzled row of 8-bit values, one scale group
FP8_INPUTS = ("float8_e4m3fn", "float8_e5m2")
WEIGHT_SCALES = ("tensor", "channel", "block")
INPUT_SCALES = ("tensor", "token", "group")
BLOCK_ROWS = (64, 128)  # weight rows a block scale covers: a warpgroup's 64 or 128 columns take one or two
OUT_QUANT = mosaic.OUT_QUANT  # the output quantization the epilogue applies (W8A8's w2 input)


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
    # MXFP4 (W4A8): the decoded step is the wgmma's A operand straight from registers
    # (out.T = w @ x.T, stored transposed): no shared-memory stores of the decoded
    # weight. A thread's decoded codes land in its 8-bit WGMMA fragment in another
    # column order within each 32-column unit; x's columns are permuted to match
    # (fragment_columns: a pass over x, not over every expert's codes).
    # Compiled only: the interpreter runs the product from shared memory.
    swap_ab: bool = False
    # MXFP4 (W4A8): every code decoded once a call into an e4m3 copy of the weight
    # (mx_e4m3.decoded_weight: the bytes the in-kernel decoders make), then the e4m3
    # product with one scale per column — the loop W8A8 runs, the decode off the
    # product's chain for many rows an expert, at the cost of the copy's bytes.
    dequantize_first: bool = False

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
    f32), ``w`` tensor / channel / block (128 x 128, f32) / mx (MXFP4 codes
    decoded in the kernel, a scale per column); ``half_bits``: mx
    codes in the pair decoder's bit order (``word_decode.E2M1_HALF_BITS``);
    ``k_major_scales``: mx scales stored ``[E, K/32, N]``; ``block_rows``:
    the weight's rows a block scale covers."""

    x: str
    w: str
    half_bits: bool = False
    k_major_scales: bool = False
    block_rows: int = BLOCK_K

    @property
    def per_step(self) -> bool:
        """A scale changes along K: each step's product is scaled on its own."""
        return self.x == "group" or self.w in ("block", "mx")

    @property
    def mx(self) -> bool:
        return self.w == "mx"


def tiles_refusal(tiles: Tiles, n: int, k: int, scaling: Scaling) -> str | None:
    """Why the static TMA boxes and wgmma tiles cannot take these shapes (None if they can)."""
    if tiles.wg_m not in (64, 128):
        return f"block_m={tiles.block_m} (64 or 128: the wgmma's rows)"
    reason = mosaic.columns_refusal(tiles)
    if reason:
        return reason
    # A thread holds the accumulator in registers (128 f32 at most), per step twice
    # (then a warpgroup's columns, at most 128, lie in one 128-column weight block).
    most = 64 * 128 if scaling.per_step else 128 * 128
    if tiles.wg_m * tiles.wg_n > most:
        twice = " twice" if scaling.per_step else ""
        return f"a warpgroup accumulator of {tiles.wg_m} x {tiles.wg_n} (at most {most} values{twice})"
    if tiles.swap_ab and not scaling.mx:
        return "swap_ab with e4m3 weights (the decoded MXFP4 step only)"
    if tiles.dequantize_first and not scaling.mx:
        return "dequantize_first with e4m3 weights (nothing to decode)"
    if tiles.dequantize_first and tiles.swap_ab:
        return "dequantize_first with swap_ab (the decoded copy is read from shared memory)"
    if tiles.swap_ab and tiles.wg_n % 64:
        return f"swap_ab with block_n={tiles.block_n} (a warpgroup's columns are the wgmma's rows: multiples of 64)"
    if n % tiles.block_n:
        return f"N={n}, not a multiple of block_n={tiles.block_n}"
    if k % BLOCK_K:
        return f"K={k}, not a multiple of {BLOCK_K}"
    return None


def quantized_output_refusal(
    tiles: Tiles, act: EpilogueActivation | None, out_quant: str, dequantized: bool = False
) -> str | None:
    """Why the tiling cannot quantize its activated outputs as ``out_quant``
    (None if it can): a row's outputs of a tile must be one group of
    :data:`BLOCK_K` — half from each compute warpgroup's gate/up pairs, whose
    row maxima the two exchange."""
    if out_quant != OUT_QUANT:
        return f"a {out_quant} output ({OUT_QUANT} only)"
    if dequantized:
        return f"a {out_quant} output multiplied back out (this kernel stores the e4m3 values and their scales)"
    if act is None or not act.gated:
        return f"a {out_quant} output without a gated activation"
    if tiles.swap_ab:
        return f"a {out_quant} output with swap_ab"
    if act.out_n(tiles.block_n) != BLOCK_K:
        return f"a {out_quant} output on block_n={tiles.block_n} (a tile's row outputs one group: {2 * BLOCK_K})"
    return None


def shared_memory_bytes(tiles: Tiles, scaling: Scaling, out_dtype, quantized: bool = False) -> int:
    """Bytes of the buffers a program allocates in shared memory (compiled):
    ``stages`` pipeline steps of x's box (e4m3 bytes), the weight's (e4m3
    bytes, or MXFP4's uint16 codes and scale bytes) and x's group scales (f32),
    the epilogue's store slots (``quantized``: one e4m3 slot of a group a row,
    the warpgroups' row maxima, the tile's row scales and two barriers) and
    the staged MXFP4 decode's slots."""
    mx = scaling.mx and not tiles.dequantize_first  # a decoded copy runs W8A8's loop
    weight = tiles.block_n * (BLOCK_K // 4 * 2 + mx_e4m3.PIECES) if mx else tiles.block_n * BLOCK_K
    step = tiles.block_m * BLOCK_K + weight + (4 * tiles.block_m if scaling.x == "group" else 0)
    if quantized:
        scratch = tiles.wg_m * BLOCK_K + 4 * (mosaic.COMPUTE_WGS + 1) * tiles.wg_m + 2 * 8
    else:
        scratch = mosaic.COMPUTE_WGS * tiles.wg_m * mosaic.EPILOGUE_COLUMNS * jnp.dtype(out_dtype).itemsize
    if mx and not tiles.swap_ab:
        scratch += mosaic.COMPUTE_WGS * tiles.wg_n * BLOCK_K
    return mosaic.pipeline_bytes(tiles.stages, step) + scratch


def scaling_refusal(call: GemmCall) -> str | None:
    """Why the call's weight and input are not e4m3 x fp8 with scales this kernel applies."""
    w, xs = call.weight, call.x_scale
    if call.x_dtype not in FP8_INPUTS or xs.mode not in INPUT_SCALES:
        return f"{call.x_dtype} inputs ({call.input_quant}): e4m3/e5m2 values with a scale"
    if xs.mode == "group" and (xs.group_size != BLOCK_K or xs.scale_type != "float32"):
        return f"input groups of {xs.group_size} {xs.scale_type} scales (f32 per {BLOCK_K} columns)"
    if w.value_type == "float4_e2m1":
        return mx_refusal(w)
    if w.value_type != "float8_e4m3" or w.scale not in WEIGHT_SCALES or w.scale_type != "float32":
        return (
            f"{w.value_type} weights with {w.scale} {w.scale_type} scales "
            "(e4m3, f32 per tensor, channel or block; or MXFP4)"
        )
    if w.scale == "block" and (w.group_size != BLOCK_K or w.block_n not in BLOCK_ROWS):
        return f"{w.block_n} x {w.group_size} weight blocks ({' or '.join(map(str, BLOCK_ROWS))} x {BLOCK_K})"
    if w.zero_point != "none" or w.global_scale != "none" or w.has_group_index:
        return "weights with zero points, a global scale or a group index"
    return None


def mx_refusal(w: WeightSpec) -> str | None:
    """Why an e2m1 weight is not MXFP4 in the planar order this kernel decodes."""
    if (w.scale, w.scale_type, w.group_size) != ("group", "e8m0", mx_e4m3.MX_GROUP):
        return (
            f"e2m1 weights with {w.scale} {w.scale_type} scales of {w.group_size} (MXFP4: e8m0 per {mx_e4m3.MX_GROUP})"
        )
    if w.zero_point != "none" or w.global_scale != "none" or w.has_group_index:
        return "e2m1 weights with zero points, a global scale or a group index"
    if w.nibble_unit != mx_e4m3.MX_GROUP:
        return f"MXFP4 codes in K order (the planar order of {mx_e4m3.MX_GROUP}-column units: to_planar)"
    return None


def scaling_of(call: GemmCall) -> Scaling:
    """How the kernel applies the call's scales."""
    w = call.weight
    mode = "mx" if w.value_type == "float4_e2m1" else w.scale
    rows = w.block_n if mode == "block" else BLOCK_K
    return Scaling(call.x_scale.mode, mode, w.half_bits, w.k_major_scales and mode == "mx", rows)


def supports(tiles: Tiles, call: GemmCall) -> str | None:
    """Why this kernel cannot run ``call`` with ``tiles`` (None if it can)."""
    reason = scaling_refusal(call)
    if reason:
        return reason
    if not call.interpret and not mosaic.hopper_gpu():
        return f"this device ({jax.devices()[0].device_kind}: the kernel needs a Hopper GPU, sm_90)"
    if call.layout.kind == "indexed" and call.layout.block_size != tiles.block_m:
        return f"an indexed block_size of {call.layout.block_size} with block_m={tiles.block_m} (a tile is a block)"
    if call.use_f16_accum:
        return "f16 accumulation"
    if call.activation is not None:
        reason = mosaic.activation_refusal(tiles, call.activation)
        if reason:
            return reason
    quantized = call.out_quant != "none"
    if quantized:
        reason = quantized_output_refusal(tiles, call.activation, call.out_quant, call.out_dequantized)
        if reason:
            return reason
    if call.out_dtype not in ("bfloat16", "float16", "float32"):
        return f"out_dtype={call.out_dtype}"
    if tiles.swap_ab and jnp.dtype(call.out_dtype).itemsize != 2:
        return f"swap_ab with out_dtype={call.out_dtype} (out.T is stored through a 16-bit transposed view)"
    scaling = scaling_of(call)
    reason = tiles_refusal(tiles, call.weight.n, call.weight.k, scaling)
    if reason:
        return reason
    return mosaic.shared_memory_refusal(shared_memory_bytes(tiles, scaling, call.out_dtype, quantized), tiles)


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
    has_bias: bool,
    interpret: bool,
    act: EpilogueActivation | None = None,
    quantized: bool = False,
):
    # mx: w_gmem holds the codes uint16 [E, N, K/4], w_scale_gmem the column scales
    # [E, N], rest the e8m0 bytes [E, K/32, N] and each column's largest int32 [E, N]
    # (mx_operands): a piece's factor is made from its byte in the step.
    # Outputs last: the values (and, quantized, each tile's row scales [col tiles, row tiles, wg_m]).
    byte_gmem, top_gmem = rest[:2] if scaling.mx else (None, None)
    outputs = 2 if quantized else 1
    bias_gmem = rest[-1 - outputs] if has_bias else None
    o_gmem, s_gmem = (rest[-2], rest[-1]) if quantized else (rest[-1], None)
    k = x_gmem.shape[1]
    n = w_gmem.shape[1]
    bm, wg_m, wg_n = tiles.block_m, tiles.wg_m, tiles.wg_n
    col_tiles = n // tiles.block_n
    swap = tiles.swap_ab  # accumulators out.T [wg_n, wg_m]: x's rows along their columns
    acc_shape = (wg_n, wg_m) if swap else (wg_m, wg_n)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    m_layout, n_layout = (col_layout, row_layout) if swap else (row_layout, col_layout)

    def per_m(acc, values):  # values [wg_m] (x's rows) times the accumulator
        return acc * (values[None, :] if swap else values[:, None])

    def per_n(acc, values):  # values [wg_n] (the weight's columns)
        return acc * (values[:, None] if swap else values[None, :])

    # The register form multiplies a step a 32-column piece at a time: x in 32-byte swizzled tiles.
    x_columns = mx_e4m3.MX_GROUP if (scaling.mx and swap and not interpret) else BLOCK_K
    in_specs = [plgpu.BlockSpec((bm, BLOCK_K), lambda i: (0, i), transforms=mosaic.swizzled(x_columns, x_gmem.dtype))]
    if scaling.mx:  # the step's codes and its pieces' scale bytes
        in_specs += [
            plgpu.BlockSpec((tiles.block_n, BLOCK_K // 4), lambda i: (0, i)),
            plgpu.BlockSpec((mx_e4m3.PIECES, tiles.block_n), lambda i: (i, 0)),
        ]
    else:
        in_specs.append(
            plgpu.BlockSpec(
                (tiles.block_n, BLOCK_K), lambda i: (0, i), transforms=mosaic.swizzled(BLOCK_K, w_gmem.dtype)
            )
        )
    if scaling.x == "group":  # the step's scale of each row: x_scale transposed, [K / 128, rows]
        in_specs.append(plgpu.BlockSpec((1, bm), lambda i: (i, 0)))

    pipeline = functools.partial(mosaic.k_pipeline, steps=k // BLOCK_K, in_specs=in_specs, stages=tiles.stages)

    def operands(group, col_tile, load_row):
        cols = pl.ds(col_tile * tiles.block_n, tiles.block_n)
        rows = x_gmem.at[pl.ds(load_row, bm)]
        found = [rows, w_gmem.at[group, cols]]
        if scaling.mx:
            found.append(byte_gmem.at[group, :, cols])
        if scaling.x == "group":
            found.append(x_scale_gmem.at[:, pl.ds(load_row, bm)])
        return found

    unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)
    scratch = dict(o_smem=plgpu.SMEM((mosaic.COMPUTE_WGS, wg_m, mosaic.EPILOGUE_COLUMNS), o_gmem.dtype))
    if quantized:  # one slot of 128-byte rows (TMA's rule) both warpgroups fill, their row maxima, the row scales
        scratch = dict(
            o_smem=plgpu.SMEM((wg_m, BLOCK_K), o_gmem.dtype),
            amax_smem=plgpu.SMEM((mosaic.COMPUTE_WGS, wg_m), jnp.float32),
            s_smem=plgpu.SMEM((wg_m,), jnp.float32),
            exchanged=plgpu.Barrier(num_arrivals=mosaic.COMPUTE_WGS),
            written=plgpu.Barrier(num_arrivals=mosaic.COMPUTE_WGS),
        )
    if scaling.mx and not (swap and not interpret):  # the decoded step (interpreted: unswizzled)
        transforms = () if interpret else mosaic.swizzled(BLOCK_K, jnp.float8_e4m3fn)
        shape = (mosaic.COMPUTE_WGS, wg_n, BLOCK_K)
        scratch["stage"] = plgpu.SMEM(shape, jnp.float8_e4m3fn, transforms=transforms)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(*operands(0, 0, 0)),
        **scratch,
        collective_axes="wg",
    )
    def _(allocations, o_smem, stage=None, amax_smem=None, s_smem=None, exchanged=None, written=None):
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
            # A gated activation stores half the columns: the warpgroup's outputs start at wg_cols / 2.
            out_wg_n = wg_n // 2 if act is not None and act.gated else wg_n
            out_cols = col_tile * (tiles.block_n * out_wg_n // wg_n) + wg * out_wg_n

            def store(acc, transposed=False):
                span = (first_row, offset, rows)
                mosaic.store_tile(acc, o_smem.at[wg], o_gmem, out_cols, span, transposed=transposed)

            def epilogue(acc):
                """The sum times the scales that do not change along K, plus the bias."""
                if scaling.x == "token":
                    row_scale = plgpu.load(x_scale_gmem.at[pl.ds(load_row, bm)], layout=m_layout, optimized=False)
                    acc = per_m(acc, row_scale)
                elif scaling.x == "tensor":
                    acc = acc * x_scale_gmem[0]
                if scaling.w == "channel" or scaling.mx:
                    col_scale = w_scale_gmem.at[group, pl.ds(wg_cols, wg_n)]
                    acc = per_n(acc, plgpu.load(col_scale, layout=n_layout, optimized=False))
                elif scaling.w == "tensor":
                    acc = acc * w_scale_gmem[group]
                if bias_gmem is not None:
                    bias = plgpu.load(bias_gmem.at[group, pl.ds(wg_cols, wg_n)], layout=n_layout, optimized=False)
                    bias = bias.astype(jnp.float32)
                    acc = acc + (bias[:, None] if swap else bias[None, :])
                if act is not None:
                    acc = mosaic.epilogue_activation(acc, act, swap)
                if quantized:
                    store_quantized(acc)
                else:
                    store(acc.astype(o_gmem.dtype), transposed=swap)

            def store_quantized(out):
                """``out [wg_m, 64]``, this warpgroup's half of each row's output group,
                quantized with the row's scale over both halves (e4m3 max at the group's
                largest |value|) into its half of the shared slot; the first warpgroup
                stores the slot's rows and the tile's row scales."""

                @pl.when(wg == 0)
                def _():  # the slot and the scales: read by the last tile's copies
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                # (`written` below keeps the slots from the next tile's maxima until both have read them)
                amax = mosaic.exchanged_row_max(jnp.max(jnp.abs(out), axis=1), wg, amax_smem, exchanged, row_layout)
                scale = amax / codecs.FLOAT8_E4M3_MAX
                values = mosaic.fp8_group_values(out, scale, rows_axis=0)
                half = out.shape[1]
                o_smem.at[:, pl.ds(pl.multiple_of(wg * half, half), half)][...] = values.astype(o_gmem.dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(written)
                plgpu.barrier_wait(written)

                @pl.when(wg == 0)
                def _():
                    s_smem[...] = scale
                    plgpu.commit_smem()
                    cols = o_gmem.at[:, pl.ds(col_tile * BLOCK_K, BLOCK_K)]
                    mosaic.store_rows(o_smem, cols, first_row, offset, rows, wg_m)
                    plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[col_tile, row_tile])

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
                zeros = jnp.zeros(acc_shape, jnp.float32)
                if not scaling.mx:
                    epilogue(run(zeros))
                    return
                # Each column's largest byte, along the codes' rows (the weight's columns):
                # loaded once a tile, carried unchanged through its steps.
                top_ref = top_gmem.at[group, pl.ds(wg_cols, wg_n)]
                top = plgpu.load(top_ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                epilogue(run((zeros, top))[0])

            def promoted_step(indices, *refs):
                (step,) = indices
                total, top = refs[-1] if scaling.mx else (refs[-1], None)
                x_scale_smem = refs[-2] if scaling.x == "group" else None
                x_smem, w_smem = refs[:2]
                byte_smem = refs[2] if scaling.mx else None

                def product(acc_ref):
                    if not scaling.mx:
                        plgpu.wgmma(acc_ref, x_smem, w_smem.at[wg_slice].transpose((1, 0)))
                        return acc_ref[...]
                    codes = w_smem[wg_slice]
                    scales = (byte_smem, top)
                    if swap and not interpret:  # the decoded step as the register operand
                        # a piece (32 columns: one wgmma's K) at a time, so that the next piece's
                        # decode runs while the tensor cores multiply this one
                        for piece in range(mx_e4m3.PIECES):
                            decoded = mx_e4m3.decode_piece(codes, scales, wg_slice, piece, scaling.half_bits)
                            columns = pl.ds(piece * mx_e4m3.MX_GROUP, mx_e4m3.MX_GROUP)
                            plgpu.wgmma(acc_ref, decoded, x_smem.at[:, columns].transpose((1, 0)))
                        return acc_ref[...]
                    # The last step's wgmma read the slot before its product was read back.
                    slot = stage.at[wg]
                    slot[...] = mx_e4m3.decode_step(codes, scales, wg_slice, scaling.half_bits, interpret)
                    plgpu.commit_smem()
                    if swap:
                        plgpu.wgmma(acc_ref, slot, x_smem.transpose((1, 0)))
                    else:
                        plgpu.wgmma(acc_ref, x_smem, slot.transpose((1, 0)))
                    return acc_ref[...]

                part = pl.run_scoped(product, plgpu.ACC(acc_shape, jnp.float32))
                row_scale = None
                if scaling.x == "group":
                    row_scale = plgpu.load(x_scale_smem.at[0], layout=m_layout, optimized=False)
                if scaling.w == "block":
                    total = total + block_scaled(part, row_scale, step)
                else:
                    total = total + (part if row_scale is None else per_m(part, row_scale))
                return (total, top) if scaling.mx else total

            def block_scaled(part, row_scale, step):
                """A step's product times its weight blocks' scales (and the rows' group
                scales): one block a warpgroup, or one a slice of its columns."""
                rows = scaling.block_rows
                blocks = max(1, wg_n // rows)
                pieces = []
                for b in range(blocks):
                    w_scale = w_scale_gmem[group, wg_cols // rows + b, step]
                    piece = part if blocks == 1 else part[:, b * rows : (b + 1) * rows]
                    pieces.append(piece * w_scale if row_scale is None else per_m(piece, row_scale * w_scale))
                return pieces[0] if blocks == 1 else jnp.concatenate(pieces, axis=1)

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
                if quantized:  # (in the layout a product has: the row maxima are exchanged as a tile's are)
                    store_quantized(plgpu.layout_cast(jnp.zeros((wg_m, out_wg_n), jnp.float32), plgpu.Layout.WGMMA))
                else:
                    store(jnp.zeros((wg_m, out_wg_n), o_gmem.dtype))

    plgpu.wait_smem_to_gmem(0)


def _flat_scales(scaling: Scaling, x_scale: jax.Array, w_scale: jax.Array, rows: int, m: int, k: int):
    """The scales as the kernel reads them: a row's per-step scales ``[K/128,
    rows]`` (``rows`` >= M, zero-padded), per-row ``[rows]`` or one ``[1]``;
    weight blocks ``[E, N/block_rows, K/128]``, channels ``[E, N]`` or ``[E]`` (mx: as
    :func:`mx_e4m3.mx_operands` gives them)."""
    x_scale = x_scale.astype(jnp.float32)
    if scaling.x == "group":
        x_scale = jnp.pad(x_scale.reshape(m, k // BLOCK_K).T, ((0, 0), (0, rows - m)))
    elif scaling.x == "token":
        x_scale = jnp.pad(x_scale.reshape(m), (0, rows - m))
    else:
        x_scale = x_scale.reshape(1)
    if scaling.mx:
        return x_scale, w_scale
    w_scale = w_scale.astype(jnp.float32)
    if scaling.w == "channel":
        w_scale = w_scale.reshape(w_scale.shape[:2])
    elif scaling.w == "tensor":
        w_scale = w_scale.reshape(-1)
    return x_scale, w_scale


def fragment_column(half: int, position: int) -> int:
    """The column (0-31) of a unit's code at ``position`` of half ``half`` in
    the fragment order: thread q of a row's quad holds halves 2q and 2q + 1 (the
    16-bit WGMMA layout), whose positions j hold columns 16 (j // 2) + 4q +
    2 (j % 2) + (half % 2) — the four consecutive columns of each 16-column
    tile the 8-bit WGMMA layout gives thread q, two a decoded pair."""
    return 16 * (position // 2) + 4 * (half // 2) + 2 * (position % 2) + half % 2


def fragment_columns(x: jax.Array) -> jax.Array:
    """``x [M, K]`` with the columns of each 32-column unit permuted so that
    column :func:`fragment_column` (h, j) holds the planar column ``h + 8 j``
    (half h, position j): the register operand's product of planar codes
    with it is the planar product. In bits, column (j1 h2 h1 j0 h0) takes
    column (j1 j0 h2 h1 h0)."""
    m, k = x.shape
    units = x.reshape(m, k // mx_e4m3.MX_GROUP, 2, 2, 2, 2, 2)  # j1, j0, h2, h1, h0
    return units.transpose(0, 1, 2, 4, 5, 3, 6).reshape(m, k)


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
    table: jax.Array | None = None,
    act: EpilogueActivation | None = None,
    out_quant: str = "none",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``x [M, K]`` (e4m3 / e5m2) times ``x_scale`` (``[M, K/128]``, ``[M, 1]``
    or ``[1]`` f32, as ``scaling.x``) by the e4m3 ``weight [E, N, K]`` times
    ``w_scale`` (``[E, N/scaling.block_rows, K/128]``, ``[E, N, 1]`` or ``[E, 1, 1]`` f32) —
    with ``scaling.mx``, ``weight`` MXFP4's planar codes ``uint8 [E, N, K/2]``
    and ``w_scale`` its e8m0 bytes ``[E, N, K/32]`` (``[E, K/32, N]`` with
    ``scaling.k_major_scales``) —: ``[M, N]`` in
    ``out_dtype``, row ``r`` through the expert whose range
    ``[offsets[e], offsets[e+1])`` holds it (``offsets`` None: dense; with
    ``counts [E]``: grouped-masked, expert e's first ``counts[e]`` of its
    ``M / E`` rows); rows outside every range are zero. ``bias [E, N]`` is
    added in f32. ``table``: the row tiles given (:func:`mosaic.block_table`) in
    place of the ranges. ``act``: applied to the sums in the epilogue
    (gated kinds: ``[M, N/2]``; :func:`mosaic.activation_refusal` says where);
    ``out_quant`` (:data:`OUT_QUANT`): the activated rows quantized there too —
    ``(e4m3 values [M, N/2], f32 scales [M, N/256])`` (:func:`quantized_output_refusal`)."""
    m, k = x.shape
    num_experts, n = weight.shape[:2]
    quantized = out_quant != "none"
    reason = tiles_refusal(tiles, n, k, scaling) or mosaic.shared_memory_refusal(
        shared_memory_bytes(tiles, scaling, out_dtype, quantized), tiles
    )
    reason = reason or (mosaic.activation_refusal(tiles, act) if act is not None else None)
    reason = reason or (quantized_output_refusal(tiles, act, out_quant) if quantized else None)
    if reason:
        raise ValueError(f"mosaic_fp8 GEMM: {reason}")
    want_w = (jnp.uint8, (num_experts, n, k // 2)) if scaling.mx else (jnp.float8_e4m3fn, (num_experts, n, k))
    if x.dtype.name not in FP8_INPUTS or weight.dtype != want_w[0] or weight.shape != want_w[1]:
        raise ValueError(
            f"mosaic_fp8 GEMM: x e4m3/e5m2 [M, K], weight {jnp.dtype(want_w[0]).name} {want_w[1]}; "
            f"got {x.dtype} {x.shape}, {weight.dtype} {weight.shape}"
        )
    extra = ()
    if scaling.mx:
        want, named = (
            ((num_experts, k // mx_e4m3.MX_GROUP, n), "[E, K/32, N]")
            if scaling.k_major_scales
            else ((num_experts, n, k // mx_e4m3.MX_GROUP), "[E, N, K/32]")
        )
        if w_scale.shape != want:
            raise ValueError(f"mosaic_fp8 GEMM: MXFP4 scales must be {named}, got {w_scale.shape}")
        weight, raw, top, w_scale = mx_e4m3.mx_operands(weight, w_scale, scaling.k_major_scales)
        extra = (raw, top)
        if tiles.dequantize_first:
            weight, extra = mx_e4m3.decoded_weight(weight, raw, top, scaling.half_bits, interpret), ()
            scaling = Scaling(scaling.x, "channel")
        if tiles.swap_ab and not interpret:  # the register operand's column order
            x = fragment_columns(x)
    padded = mosaic.padded_rows(m, tiles.block_m)
    x_scale, w_scale = _flat_scales(scaling, x_scale, w_scale, padded, m, k)
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    if table is None:
        table = mosaic.tile_table(offsets, counts, m, num_experts, tiles.block_m, interpret)
    if bias is not None and bias.shape != (num_experts, n):
        raise ValueError(f"mosaic_fp8 GEMM: bias must be [E, N] = {(num_experts, n)}, got {bias.shape}")
    body = functools.partial(
        _kernel,
        tiles=tiles,
        scaling=scaling,
        num_experts=num_experts,
        row_tiles=table.shape[0],
        has_bias=bias is not None,
        interpret=interpret,
        act=act,
        quantized=quantized,
    )
    out_n = n if act is None else act.out_n(n)
    out_type = jax.ShapeDtypeStruct((m, out_n), out_dtype)
    if quantized:
        tile_scales = jax.ShapeDtypeStruct((n // tiles.block_n, table.shape[0], tiles.wg_m), jnp.float32)
        out_type = (jax.ShapeDtypeStruct((m, out_n), jnp.float8_e4m3fn), tile_scales)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(mosaic.persistent_programs(interpret),),
        grid_names=("sm",),
        num_threads=mosaic.COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name="moe_gemm_mosaic_fp8",  # what profilers show
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    result = kernel(table, x, weight, x_scale, w_scale, *extra, *(() if bias is None else (bias,)))
    if not quantized:
        return result
    values, tile_scales = result
    return values, row_scales(tile_scales, table, m)


def row_scales(tile_scales: jax.Array, table: jax.Array, m: int) -> jax.Array:
    """``[M, G]`` f32: row r's scale of output group g, from the tile that owns
    r (``tile_scales [G, row tiles, wg_m]`` by the tiles' boxes; ``table``'s
    rows: group, first row of the box, first own row, own rows); 0 where no
    tile owns a row."""
    groups, row_tiles, wg_m = tile_scales.shape
    load_row, first_row, rows = table[:, 1:2], table[:, 2:3], table[:, 3:4]
    box_rows = load_row + jnp.arange(wg_m, dtype=jnp.int32)[None, :]
    own = (box_rows >= first_row) & (box_rows < first_row + rows)
    # Each box row goes to its own row (the others past M: dropped), as slots take their block rows.
    per_box_row = tile_scales.reshape(groups, row_tiles * wg_m).T
    return mosaic.to_slots(per_box_row, jnp.where(own, box_rows, m).reshape(-1), m)


def expert_gemm(
    call: GemmCall, tiles: Tiles, x: jax.Array, weight_arrays, bias, route_arrays, x_scale: jax.Array | None = None
) -> jax.Array:
    """The family's entry point (as ``triton.expert_gemm``): ``[m_out, N]`` in
    ``call.out_dtype``; ``weight_arrays = (e4m3 values, f32 scale)`` or
    MXFP4's (planar codes, e8m0 scales), ``route_arrays`` the layout's
    (offsets | counts | sorted_ids, expert_ids, num_tokens_padded | none)."""
    if x_scale is None:
        raise ValueError("mosaic_fp8.expert_gemm: x_scale: the kernel takes scaled 8-bit inputs")
    layout, scaling = call.layout, scaling_of(call)
    per_row = (x,) if scaling.x == "tensor" else (x, x_scale)  # an indexed layout gathers a row's scale with it
    (x, *row_scale), offsets, routing, slots = mosaic.routed(layout, route_arrays, call.weight.num_experts, *per_row)
    x_scale = row_scale[0] if row_scale else x_scale
    out = expert_gemm_fp8(
        x,
        x_scale,
        weight_arrays[0],
        weight_arrays[1],
        offsets,
        tiles,
        scaling,
        out_dtype=jnp.dtype(call.out_dtype),
        bias=bias,
        interpret=call.interpret,
        act=call.activation,
        out_quant=call.out_quant,
        **routing,
    )
    if call.out_quant != "none":  # (values, scales): the GEMM's output quantized, as w2's input
        return tuple(a if slots is None else mosaic.to_slots(a, slots, layout.m_out) for a in out)
    return out if slots is None else mosaic.to_slots(out, slots, layout.m_out)
