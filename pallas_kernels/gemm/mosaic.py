"""The Mosaic GPU expert GEMM (Hopper, sm_90): TMA loads into swizzled shared
memory, warp-specialized wgmma, a persistent loop over output tiles.

The prefill member of the family: 16-bit weights, and planar 4-bit integer
weights (int4, uint4 with integer zero points; 128-column groups or per-channel
scales) decoded in the compute warpgroups' registers each K step
(:class:`NibbleDecode`: ``magic | q`` is the float ``magic + q``, minus the
offset, times the scale: one rounding). Other quantized weights take it after
one dequantize pass (``Tiles.dequantize_first``). Layouts ``dense``,
``grouped_contiguous`` and ``grouped_masked``: the launcher cuts each
expert's rows into row tiles (``row_tile_table``) and a tile stores only its
own rows; ``indexed``: TMA cannot gather, so x's rows are gathered in block
order first (``block_order``), a tile is a block, and the results are
gathered to their slots (``to_slots``). Tiling: :class:`Tiles`; what it cannot take:
:func:`supports`. The same body runs :mod:`mosaic_mid`'s kernel (one warpgroup a
program, a program per output tile): it reads the structure from the tiles' type
(``Tiles.warp_specialized``). Design and measurements: docs/DESIGN.md,
benchmarks/notes/gemm.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, vector

from pallas_kernels import activation, codecs, word_decode
from pallas_kernels.gemm import row_tiles as table_kernel
from pallas_kernels.gemm.spec import EpilogueActivation, GemmCall, LayoutSpec, WeightSpec, check_positive, tile_order

# Folded e2m1 weights are the true ones times 2**-E2M1_FOLDED_EXPONENT, the sum multiplied back.
from pallas_kernels.gemm.triton import E2M1_FOLDED_EXPONENT
from pallas_kernels.word_decode import MAGIC  # (pattern, base): pattern | q is the float base + q

# Compute warpgroups of a program. Not 4: JAX 0.11.2's warp-specialized pipeline then
# raises each to (512 - 40) / 4 -> 112 registers a thread, but a 640-thread program
# launches with 96 (65536 / 640, in steps of 8), and the 40 the memory warpgroup gives
# back do not cover 4 x 16: setmaxnreg.inc waits for ever (it hangs).
COMPUTE_WGS = 2
# The output quantization an epilogue applies (w2's fp8 group-128 input): a group is a tile's
# 128 activated outputs a row, scaled to e4m3's largest value.
OUT_QUANT = "fp8_dynamic_group128"
EPILOGUE_COLUMNS = 64  # output columns per shared-memory store slot
# A compute warpgroup's f32 accumulator: 176 registers a thread of the 232 the warp-specialized
# pipeline gives it (a 176-row swap tile of 128 columns; 128 x 128 in the other form).
ACCUMULATOR_ELEMENTS = 176 * 128
TMA_BOX_MAX = 256  # elements a TMA box may span along each dimension
H100_SMS = 132  # H100 / H200: programs of the persistent grid when the device does not say


@dataclasses.dataclass(frozen=True)
class Tiles:
    """``block_m`` rows by ``block_n`` columns per output tile (each of the two
    compute warpgroups takes ``block_n / 2``), ``block_k`` per pipeline step,
    ``stages`` steps in flight, programs ordered in bands of ``group_m`` row
    tiles."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    group_m: int = 8
    # 4-bit path: each decoded piece is the wgmma's A operand straight from
    # registers (no staging), the accumulator out.T ([wg_n, block_m]), stored
    # transposed; x's rows are the wgmma's N, so block_m may be any multiple of 8 to
    # 256 (sized to an expert's rows). GPU only: the 0.11 interpreter cannot run a
    # register operand.
    swap_ab: bool = False
    # 4-bit path: each nibble taken from the 32-bit registers of the WGMMA layout
    # (two neighbouring codes each: a shift, a mask and an or per pair) rather than
    # from 16-bit lanes, whose shifts LLVM unpacks per lane. Compiled only: the
    # interpreter runs the 16-bit form, which computes the same values.
    word_decode: bool = False
    # Programs in clusters of ``cluster_n`` (1 or 2) on adjacent column tiles of one row
    # tile: x's tiles are multicast to both by TMA (each fetches half from L2, in 8-row
    # pieces: block_m a multiple of 16 with a pair).
    cluster_n: int = 1
    # A quantized weight is dequantized to the compute dtype by one pass before the
    # kernel runs its 16-bit path (formats it does not decode itself; prefill only:
    # the pass reads every expert's weight).
    dequantize_first: bool = False
    # A scaled 8-bit input is multiplied out to bf16 by the op before this kernel
    # (one rounding an element), which then runs its 16-bit product: the decoded
    # MXFP4 weight on bf16 wgmma instead of the fp8 kernel's staged one.
    dequantize_input: bool = False
    # The kernel's structure, fixed by its type (mosaic_mid.Tiles: False): two compute
    # warpgroups beside a memory warpgroup on a persistent grid, or one warpgroup that
    # issues its own loads, a program per output tile.
    warp_specialized: ClassVar[bool] = True

    def __post_init__(self):
        check_positive(self, ("block_m", "block_n", "block_k", "stages", "group_m"))
        if self.cluster_n not in (1, 2):
            raise ValueError(f"mosaic.Tiles.cluster_n: 1 or 2, got {self.cluster_n!r}")

    @property
    def wg_m(self) -> int:
        """Rows of a compute warpgroup's accumulator."""
        return self.block_m

    @property
    def compute_wgs(self) -> int:
        """Warpgroups of a program that run the products."""
        return COMPUTE_WGS if self.warp_specialized else 1

    @property
    def wg_n(self) -> int:
        """Columns of a compute warpgroup's accumulator."""
        return self.block_n // self.compute_wgs


UNIT = 128  # columns of one planar unit: a K step of the 4-bit path
PIECES = 4  # a unit's 16-bit half h holds columns h + 32 j at bits 4j..4j+3
PIECE = UNIT // PIECES
E2M1_UNIT = 32  # planar unit of e2m1 codes with group-32 scales: a decoded piece
STAGE_SLOTS = 2  # staged 4-bit path: decoded pieces in shared memory per compute warpgroup
# e2m1: a step's factors made from its bytes once a warpgroup into one of these slots (each thread
# makes 4 and reads back the 16 its rows need): alternate steps write alternate slots, so a
# step's writes never meet the previous step's reads, and one barrier a step suffices. With an odd
# step count (K = 2880) a tile's last step and the next tile's first share a slot: the epilogue's
# barrier (store_tile's commit_smem) lies between them.
FACTOR_SLOTS = 2


@dataclasses.dataclass(frozen=True)
class NibbleDecode:
    """4-bit integer weights the kernel decodes: codes ``uint16 [E, N, K/4]``
    (the planar order of 128-column units: bits ``4j..4j+3`` of half ``h``
    hold column ``32 j + h``), scales ``[E, G, N]`` in the compute dtype (G =
    K/128 groups; per-channel scales repeated G times: a pipelined input
    follows the K step), and either a constant code offset
    (``code_offset``: int4's 8) or per-group zero points ``[E, G, N]`` in the
    compute dtype (``zero_points``: uint4). ``e2m1``: MXFP4 codes instead
    (planar units of 32 columns, one group each; ``half_bits``: the pair
    decoder's bit order), each unit times its factor ``2**(s - 183)`` made in
    the kernel from its e8m0 byte ``s`` (``uint8 [E, K/32, N]``,
    :func:`e2m1_factor`; the weight times ``2**-E2M1_FOLDED_EXPONENT``, the
    sum multiplied back)."""

    groups: int
    code_offset: int = 8
    zero_points: bool = False
    e2m1: bool = False
    half_bits: bool = False

    @property
    def group_columns(self) -> int:
        return E2M1_UNIT if self.e2m1 else UNIT


def columns_refusal(tiles) -> str | None:
    """Why a Mosaic kernel's (this one's or the fp8 one's) ``tiles`` cannot have
    their ``block_n`` columns: whole store slots a warpgroup, and a weight box
    (and scale rows) TMA can load — at most 256 elements a dimension."""
    if tiles.wg_n % EPILOGUE_COLUMNS:
        return f"block_n={tiles.block_n} (a multiple of {tiles.block_n // tiles.wg_n * EPILOGUE_COLUMNS})"
    if tiles.block_n > TMA_BOX_MAX:
        return f"block_n={tiles.block_n} (at most {TMA_BOX_MAX}: the weight's TMA box spans the tile's columns)"
    return None


def tiles_refusal(
    tiles: Tiles, n: int, k: int, dtype, decode: NibbleDecode | None = None, partial: bool = False
) -> str | None:
    """Why the kernel's static TMA boxes and wgmma tiles cannot take these
    shapes with ``tiles`` (None if they can). ``partial``: the last column
    tile may reach past N, and with e2m1 codes the last K step past K
    (:func:`k_tail_refusal`) — compiled only: TMA fills the boxes' reads past
    the arrays with zeros and drops the stores past them, which the
    interpreter does not model."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize != 2:
        return f"{jnp.dtype(dtype)} operands (16-bit inputs and weights)"
    # x's rows are the wgmma's M (multiples of 64), or with swap_ab its N: any multiple of 8
    # up to 256, so that a tile can be sized to an expert's rows (fewer padded rows, and in
    # this form fewer decodes of each weight tile).
    if tiles.swap_ab and (tiles.wg_m % ROW_ALIGN or tiles.wg_m > 256):
        return f"block_m={tiles.block_m} (with swap_ab a multiple of {ROW_ALIGN}, at most 256)"
    if not tiles.swap_ab and tiles.wg_m not in (64, 128):
        return f"block_m={tiles.block_m} (64 or 128)"
    reason = columns_refusal(tiles)
    if reason:
        return reason
    if tiles.wg_m * tiles.wg_n > ACCUMULATOR_ELEMENTS:
        return f"a warpgroup accumulator of {tiles.wg_m} x {tiles.wg_n} (at most {ACCUMULATOR_ELEMENTS} elements)"
    if not tiles.warp_specialized and tiles.cluster_n != 1:
        return f"cluster_n={tiles.cluster_n} (a program per output tile loads its own x: no cluster)"
    # The cluster's multicast splits x's box in 8-row pieces between its programs.
    if tiles.block_m % (ROW_ALIGN * tiles.cluster_n):
        return f"block_m={tiles.block_m} with cluster_n={tiles.cluster_n} (a multiple of {ROW_ALIGN * tiles.cluster_n})"
    if decode is None and tiles.block_k * itemsize not in (32, 64, 128):
        return f"block_k={tiles.block_k} with 16-bit weights (16, 32 or 64)"
    if n % tiles.block_n and not partial:
        return f"N={n}, not a multiple of block_n={tiles.block_n}"
    # A partial tile's boxes still fit the arrays' extents; its store slots lie wholly inside N or past
    # it (store_tile issues none past it: TMA's clipping of a store past N is not relied on).
    if n % tiles.block_n and (n < tiles.block_n or n % EPILOGUE_COLUMNS):
        return (
            f"N={n} with block_n={tiles.block_n} (a partial column tile needs N >= block_n, "
            f"a multiple of {EPILOGUE_COLUMNS})"
        )
    if k % tiles.block_k:
        reason = k_tail_refusal(tiles, k, decode, partial)
        if reason:
            return reason
    if tiles.swap_ab and decode is None:
        return "swap_ab with 16-bit weights (the form is for decoded 4-bit weights)"
    # Compiled, an odd count of column tiles pairs its last with a tile past N (zeros, no stores).
    if not partial and (n // tiles.block_n) % tiles.cluster_n:
        return f"cluster_n={tiles.cluster_n} with N={n} (pairs of column tiles: a multiple of {2 * tiles.block_n})"
    if tiles.word_decode and decode is None:
        return "word_decode with 16-bit weights (the codes' 32-bit registers)"
    if decode is not None:
        if tiles.block_k != UNIT:
            return f"block_k={tiles.block_k} with 4-bit weights (one planar unit: {UNIT})"
        if jnp.dtype(dtype).name not in MAGIC:
            return f"{jnp.dtype(dtype)} inputs with 4-bit weights (bf16 or f16)"
        if decode.groups != k // decode.group_columns:
            return f"{decode.groups} scale groups over K={k} (a scale per {decode.group_columns} columns)"
        if decode.e2m1 and jnp.dtype(dtype) != jnp.bfloat16:
            return f"{jnp.dtype(dtype)} inputs with e2m1 weights (bf16: the folded weight's exponent range)"
    return None


# Shared memory a program may opt into on the H100 / H200; the buffers after the pipeline's
# steps start on a swizzle's 1024-byte boundary; the barriers take a few bytes beyond.
SHARED_MEMORY_BYTES = 232_448
SHARED_MEMORY_ALIGN = 1024
SHARED_MEMORY_SLACK = 256


def pipeline_bytes(stages: int, step: int) -> int:
    """The pipeline's ``stages`` buffers of ``step`` bytes each, up to the next buffer's alignment."""
    return -(-stages * step // SHARED_MEMORY_ALIGN) * SHARED_MEMORY_ALIGN


def shared_memory_bytes(
    tiles: Tiles, dtype, out_dtype, decode: NibbleDecode | None = None, slots: int = 1, exchange: bool = False
) -> int:
    """Bytes of the buffers a program allocates in shared memory (compiled):
    ``stages`` pipeline steps of x's box and the weight's (codes and the step's
    scale rows when decoding), the epilogue's store slots (``slots`` a
    warpgroup), for the staged 4-bit path its decoded pieces' slots and, with
    ``exchange``, the row maxima two warpgroups exchange (a quantized output's
    groups split between them) and their barriers."""
    itemsize = jnp.dtype(dtype).itemsize
    if decode is None:
        step = (tiles.block_m + tiles.block_n) * tiles.block_k * itemsize
    else:  # x's unit, the unit's uint16 codes, its scale (and zero point) rows or e2m1 bytes
        quant = PIECES * tiles.block_n if decode.e2m1 else (2 if decode.zero_points else 1) * tiles.block_n * itemsize
        step = tiles.block_m * UNIT * itemsize + quant + tiles.block_n * PIECE * 2
    scratch = slots * tiles.compute_wgs * tiles.wg_m * EPILOGUE_COLUMNS * jnp.dtype(out_dtype).itemsize
    if decode is not None and not tiles.swap_ab:
        scratch += tiles.compute_wgs * STAGE_SLOTS * tiles.wg_n * PIECE * itemsize
    if decode is not None and decode.e2m1:  # the step's bf16 factors, made once a warpgroup
        scratch += tiles.compute_wgs * FACTOR_SLOTS * PIECES * tiles.wg_n * 2
    if exchange and tiles.compute_wgs > 1:  # with swap_ab a third barrier: the two maxima in turn
        scratch += 4 * tiles.compute_wgs * tiles.wg_m + (3 if tiles.swap_ab else 2) * 8
    return pipeline_bytes(tiles.stages, step) + scratch


def split_slot(tiles: Tiles, dtype, out_dtype, decode: NibbleDecode | None = None, exchange: bool = False) -> bool:
    """Whether a warpgroup's one output slot is used as two halves of its rows in
    turn (:func:`store_tile`): the tall tiles with no room for a second slot, so that
    one half is written while the other's copy still reads it, in the same shared
    memory; 16-bit outputs, halves the wgmma layout can slice (the swap form's rows
    in 8-row pieces, else 64-row ones)."""
    if jnp.dtype(out_dtype).itemsize > 2 or tiles.wg_m % (2 * (ROW_ALIGN if tiles.swap_ab else 64)):
        return False
    return shared_memory_refusal(shared_memory_bytes(tiles, dtype, out_dtype, decode, 2, exchange), tiles) is not None


def shared_memory_refusal(need: int, tiles) -> str | None:
    """Why ``need`` bytes of buffers (a kernel's ``shared_memory_bytes``) for a
    Mosaic kernel's ``tiles`` do not fit a program (None if they do)."""
    if need + SHARED_MEMORY_SLACK > SHARED_MEMORY_BYTES:
        named = f"block_m={tiles.block_m}, block_n={tiles.block_n}, stages={tiles.stages}"
        return (
            f"{named}: {need:,} bytes of shared-memory buffers (the pipeline's stages and the "
            f"epilogue's slots), past the {SHARED_MEMORY_BYTES:,} a program has (fewer stages or rows)"
        )
    return None


# A partial last K step: e2m1 codes in 64-column halves of the 128-column step (the codes' K/4
# then a multiple of the 16-wide tiles their boxes take, K_TAIL_CODES).
K_TAIL_COLUMNS = 64
K_TAIL_CODES = 16


def k_tail_refusal(tiles: Tiles, k: int, decode: NibbleDecode | None, partial: bool) -> str | None:
    """Why the kernel cannot end K with a partial step (None if it can): e2m1
    codes only (compiled: TMA fills x, the codes and the factors past K with
    zeros, and a zero code decodes to zero), K a multiple of 64, one whole step at least."""
    tail_ok = partial and decode is not None and decode.e2m1 and k % K_TAIL_COLUMNS == 0 and k >= tiles.block_k
    return None if tail_ok else f"K={k}, not a multiple of block_k={tiles.block_k}"


def _codes_transforms(k: int) -> tuple:
    """The codes' box transforms: Mosaic's own unless K ends with a partial step."""
    return swizzled(K_TAIL_CODES, jnp.uint16) if k % UNIT else ()


def check_tiles(tiles: Tiles, n: int, k: int, dtype, decode: NibbleDecode | None = None, partial: bool = False) -> None:
    """Raise ``ValueError`` with :func:`tiles_refusal`'s reason."""
    reason = tiles_refusal(tiles, n, k, dtype, decode, partial)
    if reason:
        raise ValueError(f"mosaic GEMM: {reason}")


def swap_ab_refusal(out_dtype, interpret: bool) -> str | None:
    """Why the ``swap_ab`` form cannot run a call (None if it can)."""
    if interpret:
        return "swap_ab runs compiled only (the Mosaic GPU interpreter of jax 0.11 cannot take a register operand)"
    if jnp.dtype(out_dtype).itemsize != 2:
        return f"swap_ab with out_dtype={jnp.dtype(out_dtype)} (out.T is stored through a 16-bit transposed view)"
    return None


def decode_refusal(w: WeightSpec, x_dtype: str) -> str | None:
    """Why the kernel cannot decode this quantized weight itself (None if it can)."""
    name = f"{w.value_type} weights"
    if w.value_type == "float4_e2m1":
        return e2m1_refusal(w, x_dtype)
    if w.value_type not in ("int4", "uint4") or w.zero_point == "float":
        return f"{name} (int4, or uint4 with integer zero points; others through dequantize_first)"
    if not (w.scale == "channel" or (w.scale == "group" and w.group_size == UNIT)) or w.global_scale != "none":
        return f"{name} with {w.scale} scales ({UNIT}-column groups or per-channel scales)"
    if w.nibble_unit != UNIT or w.half_bits:
        return f"{name} in K order (the planar order of {UNIT}-column units: to_planar)"
    if w.scale_type != x_dtype:
        return f"{w.scale_type} scales with {x_dtype} inputs (scales in the input dtype)"
    if w.has_group_index:
        return "a group index (act order)"
    return None


def e2m1_refusal(w: WeightSpec, x_dtype: str) -> str | None:
    """Why the kernel cannot decode this e2m1 weight (None if it can: MXFP4,
    planar, with bf16 inputs)."""
    if (w.scale, w.scale_type, w.group_size) != ("group", "e8m0", E2M1_UNIT) or w.global_scale != "none":
        return f"e2m1 weights with {w.scale} {w.scale_type} scales of {w.group_size} (MXFP4: e8m0 per {E2M1_UNIT})"
    if w.nibble_unit != E2M1_UNIT:
        return f"MXFP4 codes in K order (the planar order of {E2M1_UNIT}-column units: to_planar)"
    if x_dtype != "bfloat16":
        return f"MXFP4 weights with {x_dtype} inputs (bf16)"
    return None


def hopper_gpu() -> bool:
    """Whether the default device is a Hopper GPU (sm_90: TMA and wgmma; the
    Blackwell generation has no wgmma)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def supports(tiles: Tiles, call: GemmCall) -> str | None:
    """Why this kernel cannot run ``call`` with ``tiles`` (None if it can)."""
    if tiles.dequantize_input:
        if call.input_quant == "none":
            return "dequantize_input with an unquantized input (nothing to dequantize)"
        call = call.with_dequantized_input()
    w, layout = call.weight, call.layout
    if call.input_quant != "none":
        return f"quantized inputs ({call.input_quant}): the kernel takes 16-bit float inputs (or dequantize_input)"
    if not call.interpret and not hopper_gpu():
        return f"this device ({jax.devices()[0].device_kind}: the kernel needs a Hopper GPU, sm_90)"
    if layout.kind == "indexed" and layout.block_size != tiles.block_m:
        # Rows are gathered in block order first (TMA cannot gather them): a tile is a block.
        return f"an indexed block_size of {layout.block_size} with block_m={tiles.block_m} (a tile is a block)"
    if call.use_f16_accum:
        return "f16 accumulation"
    if call.activation is not None:
        reason = activation_refusal(tiles, call.activation, w.n)
        if reason:
            return reason
    if call.out_quant != "none":
        reason = quantized_output_refusal(tiles, call.activation, call.out_quant, call.out_dequantized)
        reason = reason or busy_rows_refusal(tiles, layout, w.num_experts)
        if reason:
            return reason
    decode = None
    if tiles.dequantize_first and w.quantized:
        w = w.dequantized(call.x_dtype)
    elif w.quantized:
        reason = decode_refusal(w, call.x_dtype)
        if reason:
            return reason
        e2m1 = w.value_type == "float4_e2m1"
        decode = NibbleDecode(w.k // (E2M1_UNIT if e2m1 else UNIT), e2m1=e2m1, half_bits=w.half_bits)
    elif w.value_type != call.x_dtype:
        return f"{w.value_type} weights with {call.x_dtype} inputs (the same 16-bit dtype)"
    if tiles.dequantize_first and not call.weight.quantized:
        return "dequantize_first with a 16-bit weight (nothing to dequantize)"
    reason = tiles_refusal(tiles, w.n, w.k, call.x_dtype, decode, partial=not call.interpret)
    if reason:
        return reason
    if tiles.swap_ab:
        reason = swap_ab_refusal(call.out_dtype, call.interpret)
        if reason:
            return reason
    exchange = call.out_quant != "none"
    return shared_memory_refusal(shared_memory_bytes(tiles, call.x_dtype, call.out_dtype, decode, 1, exchange), tiles)


def activation_refusal(tiles: Tiles, act: EpilogueActivation, n: int | None = None) -> str | None:
    """Why the tiling cannot apply ``act`` in its epilogue (None if it can): a
    warpgroup's gate and up sums must lie in column slices of its own
    accumulator, and its outputs fill whole store slots (with ``n`` weight
    rows that end in a partial column tile, whole slots of the output's too)."""
    if not act.gated:
        return None
    if not act.pair_block:
        return f"the activation {act.kind!r} on gate and up halves (no tile holds both halves of its outputs)"
    if act.pair_block == 1:
        return f"the activation {act.kind!r} on pairs of adjacent columns (a strided slice of the accumulator)"
    if tiles.swap_ab and act.pair_block % 64:
        # out.T's rows: a thread holds rows r and r + 64, so a gate row's up row must be 64k rows on.
        return (
            f"the activation {act.kind!r} with swap_ab on blocks of {act.pair_block} (gate and up in different warps)"
        )
    if tiles.wg_n % (2 * act.pair_block) or (tiles.wg_n // 2) % EPILOGUE_COLUMNS:
        return (
            f"the activation {act.kind!r}: a warpgroup's {tiles.wg_n} columns are not whole gate/up pairs of "
            f"{act.pair_block} with {EPILOGUE_COLUMNS}-column output slots"
        )
    if n is not None and n % tiles.block_n and act.out_n(n) % EPILOGUE_COLUMNS:
        return f"the activation {act.kind!r} with N={n} in a partial column tile (N/2 a multiple of {EPILOGUE_COLUMNS})"
    return None


def fp8_group_values(out, scale, rows_axis: int):
    """``out`` over its rows' group ``scale`` (``[rows]``; a zero scale gives
    zeros), clipped to e4m3's range: the values a group stores as e4m3. The
    rows lie along ``rows_axis`` of ``out`` (1 in a swapped tile's out.T)."""
    inverse = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    per_row = inverse[:, None] if rows_axis == 0 else inverse[None, :]
    return jnp.clip(out * per_row, -codecs.FLOAT8_E4M3_MAX, codecs.FLOAT8_E4M3_MAX)


def exchanged_row_max(own, wg, amax_smem, exchanged, row_layout):
    """The larger of this warpgroup's row maxima ``own [rows]`` and the other
    compute warpgroup's, through ``amax_smem [2, rows]`` at ``exchanged`` (a
    barrier of two). The caller keeps the slots from the next tile's maxima
    until both have read them."""
    amax_smem.at[wg][...] = own
    plgpu.barrier_arrive(exchanged)
    plgpu.barrier_wait(exchanged)
    return jnp.maximum(own, plgpu.load(amax_smem.at[1 - wg], layout=row_layout, optimized=False))


def quantized_output_refusal(
    tiles: Tiles, act: EpilogueActivation | None, out_quant: str, dequantized: bool
) -> str | None:
    """Why the tiling cannot quantize its activated outputs as ``out_quant``
    and multiply them back out (``dequantized``; None if it can): a row's
    outputs of a tile must be one group of 128 — one warpgroup's, or half
    from each of the two, whose row maxima they exchange."""
    if out_quant != OUT_QUANT:
        return f"a {out_quant} output ({OUT_QUANT} only)"
    if not dequantized:
        return f"a {out_quant} output in e4m3 (the fp8 kernel's; this one multiplies the values back out)"
    if act is None or not act.gated:
        return f"a {out_quant} output without a gated activation"
    if act.out_n(tiles.block_n) != 128:
        return f"a {out_quant} output on block_n={tiles.block_n} (a tile's row outputs one group: 256)"
    return None


def rows_an_expert(layout: LayoutSpec, num_experts: int) -> int:
    """The rows an expert's product takes on average (a masked layout: its capacity)."""
    if layout.kind == "grouped_masked":
        return layout.max_tokens
    if layout.kind == "dense":
        return layout.m_out
    return -(-layout.m_out // num_experts)


def busy_rows_refusal(tiles: Tiles, layout: LayoutSpec, num_experts: int) -> str | None:
    """Why the tiling leaves a quantized output to the pass after it (None if it
    takes it): with more than one row tile an expert the products bound the
    kernel, and the epilogue's exchange and conversions delay the next tile's;
    with one, it streams the expert's weights and the epilogue hides under that."""
    rows = rows_an_expert(layout, num_experts)
    if rows > tiles.block_m:
        return f"a quantized output at {rows} rows an expert (more than one block_m={tiles.block_m} tile)"
    return None


def epilogue_activation(acc, act: EpilogueActivation, swap: bool = False):
    """``act`` of a warpgroup's f32 sums ``acc [wg_m, wg_n]`` (``swap``: ``[wg_n,
    wg_m]``): ``[wg_m, wg_n/2]`` for a gated kind (gate and up in blocks of
    ``act.pair_block`` weight rows), else the same shape."""
    if not act.gated:
        return activation.ungated(act.kind, acc)
    block, axis = act.pair_block, 0 if swap else 1

    def rows(start):  # weight rows [start, start + block) of the accumulator
        return acc[start : start + block] if swap else acc[:, start : start + block]

    outputs = [
        activation.gated(act.kind, rows(start), rows(start + block), act.clamp_limit, act.alpha, act.beta)
        for start in range(0, acc.shape[axis], 2 * block)
    ]
    return jnp.concatenate(outputs, axis=axis) if len(outputs) > 1 else outputs[0]


def max_row_tiles(ranges: int, m: int, block_m: int) -> int:
    """Static bound on the row tiles of ``m`` rows cut per range, each range's
    tiles starting up to 7 rows before its first row: at most min(ranges, m)
    ranges hold rows, each one tile plus one per further block_m rows (the
    7 rows in front add at most one tile per range)."""
    busy = min(ranges, m)
    return max(1, 2 * busy + m // block_m)


ROW_ALIGN = table_kernel.ROW_ALIGN  # a TMA box into 8-row tiled shared memory starts on a multiple of 8 rows


def grouped_ranges(offsets: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Row ranges ``(starts, ends)`` of a grouped-contiguous layout: expert e's
    rows ``[offsets[e], offsets[e+1])``, then the rows no expert owns (before
    ``offsets[0]``, from ``offsets[E]`` to ``m``)."""
    offsets = jnp.clip(offsets.astype(jnp.int32), 0, m)
    starts = jnp.concatenate([offsets[:-1], jnp.zeros((1,), jnp.int32), offsets[-1:]])
    ends = jnp.concatenate([offsets[1:], offsets[:1], jnp.full((1,), m, jnp.int32)])
    return starts, ends


def masked_ranges(counts: jax.Array, max_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Row ranges ``(starts, ends)`` of a grouped-masked layout: expert e's
    first ``counts[e]`` rows of its ``max_tokens``, then the rest of each
    expert's rows (written as zeros)."""
    starts = jnp.arange(counts.shape[0], dtype=jnp.int32) * max_tokens
    ends = starts + jnp.clip(counts.astype(jnp.int32), 0, max_tokens)
    return jnp.concatenate([starts, ends]), jnp.concatenate([ends, starts + max_tokens])


def layout_ranges(
    offsets: jax.Array | None, counts: jax.Array | None, m: int, num_experts: int
) -> tuple[jax.Array, table_kernel.Ranges]:
    """The array a call's row ranges come from and how they do: grouped-masked
    with ``counts``, else grouped-contiguous with ``offsets`` (None: dense, one range)."""
    if counts is not None:
        if m % num_experts:
            raise ValueError(f"mosaic GEMM: the grouped-masked x needs E*max_tokens rows (E={num_experts}), got {m}")
        return counts, table_kernel.Ranges(counts.shape[0], m, masked=True, max_tokens=m // num_experts)
    source = jnp.asarray([0, m], jnp.int32) if offsets is None else offsets
    return source, table_kernel.Ranges(source.shape[0] - 1, m)


def row_ranges(offsets: jax.Array | None, counts: jax.Array | None, m: int, num_experts: int):
    """``(starts, ends)`` of a call's layout (:func:`layout_ranges`)."""
    source, spec = layout_ranges(offsets, counts, m, num_experts)
    return masked_ranges(source, spec.max_tokens) if spec.masked else grouped_ranges(source, m)


def tile_table(
    offsets: jax.Array | None, counts: jax.Array | None, m: int, num_experts: int, block_m: int, interpret: bool = False
) -> jax.Array:
    """:func:`row_tile_table` of :func:`row_ranges`'s ranges (the same
    arguments), built by one Triton launch (:mod:`pallas_kernels.gemm.row_tiles`)
    rather than their XLA ops."""
    source, spec = layout_ranges(offsets, counts, m, num_experts)
    return table_kernel.row_tile_table(
        source,
        spec,
        num_experts,
        block_m,
        num_tiles=max_row_tiles(spec.count, m, block_m),
        load_max=padded_rows(m, block_m) - block_m,
        interpret=interpret,
    )


def row_tile_table(starts: jax.Array, ends: jax.Array, num_experts: int, m: int, block_m: int) -> jax.Array:
    """``[tiles, 4]`` int32 ``(group, load row, first row, rows)`` per row
    tile: the row ranges ``[starts[i], ends[i])`` (the first ``num_experts``
    are the experts', the others rows stored as zeros, group E), cut into
    tiles of ``block_m`` from the multiple of 8 at or below each range's
    first row. A tile loads ``block_m`` rows of x from its load row (a
    multiple of 8, inside ``padded_rows(m, block_m)``) and stores ``rows``
    rows from its first row; tiles past the last have 0 rows."""
    ranges = starts.shape[0]
    starts = jnp.clip(starts.astype(jnp.int32), 0, m)
    ends = jnp.maximum(jnp.clip(ends.astype(jnp.int32), 0, m), starts)
    aligned = starts - starts % ROW_ALIGN
    per_range = jnp.where(ends > starts, (ends - aligned + block_m - 1) // block_m, 0)
    tile_ends = jnp.cumsum(per_range)
    tile = jnp.arange(max_row_tiles(ranges, m, block_m), dtype=jnp.int32)
    # One comparison of every tile with every range end: the default binary search is a loop
    # whose steps XLA launches one by one on the GPU (a few ranges, a few thousand tiles).
    found = jnp.searchsorted(tile_ends, tile, side="right", method="compare_all")
    index = jnp.minimum(found, ranges - 1).astype(jnp.int32)
    group = jnp.minimum(index, num_experts)  # every zero range is group E
    tile_start = aligned[index] + (tile - (tile_ends[index] - per_range[index])) * block_m
    first = jnp.maximum(tile_start, starts[index])
    rows = jnp.clip(jnp.minimum(tile_start + block_m, ends[index]) - first, 0, block_m)
    rows = jnp.where(tile < tile_ends[-1], rows, 0)
    load = jnp.clip(tile_start, 0, padded_rows(m, block_m) - block_m)
    return jnp.stack([group, load, first, rows], axis=1)


def block_table(expert_ids: jax.Array, num_tokens_padded: jax.Array, num_experts: int, block_size: int) -> jax.Array:
    """The row tiles (:func:`row_tile_table`'s form) of an indexed layout's
    blocks gathered in order (one tile a block: ``(expert, b * block_size,
    b * block_size, block_size)``); a block past ``num_tokens_padded`` or of
    no expert (−1, or past E) is no tile (group E, 0 rows: nothing computed or
    stored; :func:`block_order` sends its slots to zeros)."""
    blocks = expert_ids.shape[0]
    start = jnp.arange(blocks, dtype=jnp.int32) * block_size
    expert = expert_ids.astype(jnp.int32)
    live = (start < num_tokens_padded.reshape(-1)[0]) & (expert >= 0) & (expert < num_experts)
    rows = jnp.where(live, block_size, 0).astype(jnp.int32)
    return jnp.stack([jnp.where(live, expert, num_experts), start, start, rows], axis=1)


def block_order(layout, route_arrays, num_experts: int, m_in: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An indexed layout (``route_arrays``: sorted_ids, expert_ids,
    num_tokens_padded) in block order: ``(rows, slots, table)`` — for each of
    the ``blocks × block_size`` positions the input row it reads (slot
    ``s // top_k``; padding reads the last row) and its slot (``layout.m_out``
    for padding and for every position of a dead block: no row of the result
    is read from a tile not computed, the slots it lists read zeros), and
    :func:`block_table`'s tiles."""
    sorted_ids, expert_ids, num_tokens_padded = route_arrays
    length = expert_ids.shape[0] * layout.block_size
    slots = jnp.pad(sorted_ids.astype(jnp.int32), (0, length - sorted_ids.shape[0]), constant_values=layout.m_out)
    table = block_table(expert_ids, num_tokens_padded, num_experts, layout.block_size)
    slots = jnp.where(jnp.repeat(table[:, 3] > 0, layout.block_size), slots, layout.m_out)
    rows = jnp.clip(slots // layout.top_k, 0, m_in - 1)
    return rows, slots, table


def routed(layout, route_arrays, num_experts: int, *row_arrays: jax.Array):
    """How a Mosaic kernel takes ``layout``: ``(row_arrays, offsets, routing,
    slots)`` — ``offsets`` for grouped-contiguous, ``routing`` the launcher's
    keyword (``counts`` for grouped-masked, the block ``table`` for indexed),
    and for an indexed layout ``row_arrays`` (x and any per-row array) gathered
    in block order with ``slots`` for :func:`to_slots` (else None)."""
    offsets = route_arrays[0] if layout.kind == "grouped_contiguous" else None
    if layout.kind == "grouped_masked":
        return row_arrays, offsets, dict(counts=route_arrays[0]), None
    if layout.kind != "indexed":
        return row_arrays, offsets, {}, None
    rows, slots, table = block_order(layout, route_arrays, num_experts, row_arrays[0].shape[0])
    return tuple(jnp.take(a, rows, axis=0) for a in row_arrays), offsets, dict(table=table), slots


def to_slots(block_rows: jax.Array, slots: jax.Array, m_out: int) -> jax.Array:
    """``[m_out, N]``: row s is the block-order row whose slot is s
    (``block_rows [L, N]``, ``slots [L]``, a slot past ``m_out`` is padding);
    slots no row names are zero."""
    length = block_rows.shape[0]
    source = jnp.full((m_out,), length, jnp.int32).at[slots].set(jnp.arange(length, dtype=jnp.int32), mode="drop")
    return jnp.take(block_rows, source, axis=0, mode="fill", fill_value=0)


def padded_rows(m: int, block_m: int) -> int:
    """Rows of x the kernel reads: at least one tile, a multiple of 8."""
    return -(-max(m, block_m) // ROW_ALIGN) * ROW_ALIGN


def store_rows(o_smem, o_gmem_cols, first_row, offset, rows, block_m: int, one_group: bool = False):
    """Rows ``[offset, offset + rows)`` of the shared tile ``o_smem`` to
    gmem rows ``[first_row, first_row + rows)`` as a sum of power-of-two
    slices (static TMA boxes, dynamic starts); ``one_group``: the slices'
    copies committed as one bulk group (else a group each)."""
    done = jnp.int32(0)
    size = 1 << (block_m.bit_length() - 1)  # rows <= block_m: its bits from the largest power of two
    while size:

        @pl.when(rows & size != 0)
        def _(size=size, done=done):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(offset + done, size)],
                o_gmem_cols.at[pl.ds(first_row + done, size)],
                commit_group=not one_group,
            )

        done = done + (rows & size)
        size //= 2
    if one_group:
        plgpu.commit_smem_to_gmem_group()


def store_tile(acc, slot, o_gmem, first_col, row_span, transposed: bool = False):
    """A compute warpgroup's ``[wg_m, wg_n]`` result (``transposed``: given as
    ``[wg_n, wg_m]``) into ``o_gmem``'s columns from ``first_col`` through its
    ``[wg_m, EPILOGUE_COLUMNS]`` shared slot, a chunk of columns at a time;
    ``row_span = (first_row, offset, rows)``: its own rows only (store_rows).
    A ``[2, wg_m / 2, EPILOGUE_COLUMNS]`` split slot (:func:`split_slot`) takes
    each chunk's two row halves in turn, one bulk group a half."""
    first_row, offset, rows = row_span
    wg_m, wg_n = (acc.shape[1], acc.shape[0]) if transposed else acc.shape
    split = len(slot.shape) == 3
    half = wg_m // 2
    for chunk in range(wg_n // EPILOGUE_COLUMNS):
        start = first_col + chunk * EPILOGUE_COLUMNS
        columns = slice(chunk * EPILOGUE_COLUMNS, (chunk + 1) * EPILOGUE_COLUMNS)

        # A partial last column tile's slots past the output's columns are not stored (tiles_refusal:
        # N a multiple of the slot, so each slot lies wholly inside or past them).
        @pl.when(start < o_gmem.shape[1])
        def _(start=start, columns=columns):
            cols = o_gmem.at[:, pl.ds(start, EPILOGUE_COLUMNS)]
            if split:  # rows [h * half, (h + 1) * half) of the chunk through half h
                for h in range(2):
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this half's last copy has read it
                    own = slice(h * half, (h + 1) * half)
                    if transposed:
                        slot.at[h].transpose((1, 0))[...] = acc[columns, own]
                    else:
                        slot.at[h][...] = acc[own, columns]
                    plgpu.commit_smem()
                    lo = jnp.clip(offset, h * half, (h + 1) * half)  # the tile's own rows in this half
                    hi = jnp.clip(offset + rows, h * half, (h + 1) * half)
                    store_rows(slot.at[h], cols, first_row + lo - offset, lo - h * half, hi - lo, half, one_group=True)
                return
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's last copies have read it
            if transposed:  # stored through a transposed view of the slot
                slot.transpose((1, 0))[...] = acc[columns]
            else:
                slot[...] = acc[:, columns]
            plgpu.commit_smem()
            store_rows(slot, cols, first_row, offset, rows, wg_m)

        if split:  # a chunk past N commits empty groups, one a half, as the waits count them

            @pl.when(start >= o_gmem.shape[1])
            def _():
                for _ in range(2):
                    plgpu.commit_smem_to_gmem_group()


def k_pipeline(step, context, *, steps: int, in_specs, stages: int):
    """The warp-specialized pipeline over ``steps`` K steps: the memory
    warpgroup's TMA loads of ``in_specs``, ``stages`` in flight, ``step`` run by
    the compute warpgroups with the carry ``context`` sets up."""
    return plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(steps,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=COMPUTE_WGS,
        max_concurrent_steps=stages,
        compute_context=context,
    )


def run_k_pipeline(step, context, gmem_refs, *, steps: int, in_specs, stages: int):
    """The K loop of one output tile in a program's one warpgroup (no warp
    specialization): ``stages`` steps' TMA loads in flight, each slot refilled
    once its step has run; ``step(indices, *refs, acc_ref)`` inside the
    accumulator ``context(run)`` sets up."""

    def run(acc_ref):
        def step_with_acc(indices, *refs):
            step(indices, *refs, acc_ref)

        plgpu.emit_pipeline(step_with_acc, grid=(steps,), in_specs=in_specs, max_concurrent_steps=stages)(*gmem_refs)

    context(run)


def persistent_programs(interpret: bool) -> int:
    """Programs of a persistent grid: one per SM (a few when interpreted: the
    loop over tiles covers every tile either way)."""
    return 4 if interpret else getattr(jax.devices()[0], "core_count", None) or H100_SMS


def swizzled(columns: int, dtype) -> tuple:
    """Tiling + swizzle transforms of a ``[rows, columns]`` shared-memory tile
    (a 16- or 8-bit wgmma operand)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(columns * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _nibble_floats(codes, piece: int, dtype, words: bool):
    """``magic + q`` in ``dtype`` for nibble ``piece`` of each ``uint16`` code
    ``[rows, 32]``. ``words``: on the 32-bit registers of the WGMMA layout
    (two neighbouring codes each) — a shift, a mask and an or per pair, where
    the same ops on 16-bit lanes leave LLVM a shift per lane to unpack and
    repack; compiled only (the interpreter cannot run Mosaic GPU code)."""
    magic, _ = MAGIC[jnp.dtype(dtype).name]
    if not words:
        bits = ((codes >> (4 * piece)) & 0xF) | magic
        return lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(codes.shape, dtype, layout=layout))
    def nibble_floats(_, array):
        word = ir.VectorType.get((1,), ir.IntegerType.get_signless(32))

        def splat(value: int):
            return arith.constant(
                word, ir.DenseElementsAttr.get_splat(word, ir.IntegerAttr.get(word.element_type, value))
            )

        pair = ir.VectorType.get((2,), mgpu.utils.dtype_to_ir_type(jnp.dtype(dtype)))
        i32 = ir.IntegerType.get_signless(32)
        # (bits & mask) | high as one lop3: ptxas does not fuse an and and an or that
        # take two immediates (a LOP3 encodes one), so written apart they issue twice.
        mask_or_high = f"lop3.b32 $0, $1, 0x000F000F, {magic | magic << 16:#010x}, 0xea;"

        def decode(register):
            bits = vector.bitcast(word, register)
            if piece:
                bits = arith.shrui(bits, splat(4 * piece))
            fused = mgpu.utils.inline_ptx(mask_or_high, mgpu.utils.bitcast(bits, i32), result_types=i32)
            return mgpu.utils.bitcast(fused, pair)

        registers = np.vectorize(decode, otypes=[object])(array.registers)
        return mgpu.FragmentedArray(_registers=registers, _layout=array.layout, _is_signed=None)

    return nibble_floats(codes)


def _decode_piece(codes, piece: int, offset, scale, dtype, words: bool = False):
    """Columns ``[32 piece, 32 piece + 32)`` of a unit from its codes
    ``uint16 [rows, 32]``: ``(magic + q - offset) * scale`` in ``dtype`` (the
    subtraction exact, the product rounded once)."""
    return (_nibble_floats(codes, piece, dtype, words) - offset) * scale


# A unit's factor is 2**(s - 127) (the e8m0 byte s as a bf16 exponent field) times this.
E2M1_FACTOR_SHIFT = 2.0 ** (6 - E2M1_FOLDED_EXPONENT)
# The smallest byte whose factor 2**(s - 183) is a normal bf16; smaller ones give zero.
E2M1_FACTOR_MIN_BYTE = 183 - 126


def e2m1_factor(raw: jax.Array) -> jax.Array:
    """A unit's bf16 factor ``2**(s - 127 - E2M1_FOLDED_EXPONENT) / 2**-6`` =
    ``2**(s - 183)`` from its e8m0 bytes ``s`` (uint8, any shape): NaN for
    byte 255, zero under :data:`E2M1_FACTOR_MIN_BYTE` (weights under 2**-70,
    whose folded values bf16 cannot hold). ``s`` shifted into bf16's exponent
    field is ``2**(s - 127)`` (255's NaN bit set from s + 1), times one
    constant; integer operations and one multiply, no select."""
    s = raw.astype(jnp.int32)
    bits = (s << 7) | (((s + 1) >> 2) & 0x40)
    bits = bits * ((s + (256 - E2M1_FACTOR_MIN_BYTE)) >> 8)  # 0 under the smallest byte, else 1
    exponent = lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)
    return exponent * jnp.asarray(E2M1_FACTOR_SHIFT, jnp.bfloat16)


def e2m1_piece(codes, unit: int, bits: tuple, dtype, interpret: bool):
    """Unit ``unit`` (columns ``[32 unit, 32 unit + 32)``) of a K step's planar
    e2m1 codes ``uint16 [rows, 32]`` (half h of a unit holds column ``h + 8 j``
    at position j, its bits where ``bits`` says) as e2m1 x 2**-6: compiled,
    in ``dtype`` (f16 / bf16), by ``word_decode.e2m1_program`` on the WGMMA
    layout's 32-bit registers (halves 2t and 2t+1 of the unit in one; each
    result half depends on its own half only); interpreted, in f32. Position
    j of the unit's 8 halves is its 8-column tile j: joined in order."""
    halves = codes[:, E2M1_UNIT // 4 * unit : E2M1_UNIT // 4 * (unit + 1)]
    if interpret:  # f16 bits e2m1 x 2**-14, exact in f32
        placed = []
        for j in range(4):
            code = word_decode.half_code(halves, j, bits)
            placed.append(((code & 8) << 12) | ((code & 7) << 9))
        values = lax.bitcast_convert_type(jnp.concatenate(placed, axis=1).astype(jnp.uint16), jnp.float16)
        return values.astype(jnp.float32) * 2.0**8
    program = word_decode.e2m1_program(jnp.dtype(dtype).name, normalized=True, bits=bits)
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(codes.shape, dtype, layout=layout))
    def decode(_, array):
        word = ir.VectorType.get((1,), ir.IntegerType.get_signless(32))
        pair = ir.VectorType.get((2,), mgpu.utils.dtype_to_ir_type(jnp.dtype(dtype)))

        def splat(value: int):
            attr = ir.IntegerAttr.get(word.element_type, value - (1 << 32) if value >= 1 << 31 else value)
            return arith.constant(word, ir.DenseElementsAttr.get_splat(word, attr))

        def run(register, output: str):
            regs = {word_decode.WORD: vector.bitcast(word, register)}

            def val(x):
                return regs[x] if isinstance(x, str) else splat(x)

            for op in word_decode.needed_ops(program, output):
                a, b = val(op.a), val(op.b)
                if op.op == "shl":
                    regs[op.dst] = arith.shli(a, b)
                elif op.op == "shr":
                    regs[op.dst] = arith.shrui(a, b)
                elif op.op == "and":
                    regs[op.dst] = arith.andi(a, b)
                elif op.op == "or_and":
                    regs[op.dst] = arith.ori(arith.andi(a, b), val(op.c))
                elif op.op == "mul2":
                    product = arith.mulf(vector.bitcast(pair, a), vector.bitcast(pair, b))
                    regs[op.dst] = vector.bitcast(word, product)
                else:
                    raise NotImplementedError(f"e2m1 decoder op {op.op}")
            return vector.bitcast(pair, regs[output])

        source = array.registers[:, unit]
        registers = np.empty_like(array.registers)
        for j, output in enumerate(program.outputs):
            registers[:, j] = np.vectorize(lambda r, output=output: run(r, output), otypes=[object])(source)
        return mgpu.FragmentedArray(_registers=registers, _layout=array.layout, _is_signed=None)

    return decode(codes)


def join_columns(arrays, interpret: bool):
    """``[rows, c]`` arrays side by side: ``[rows, c * len(arrays)]`` (compiled:
    their WGMMA-layout column tiles' registers in order)."""
    if interpret:
        return jnp.concatenate(arrays, axis=1)
    layout = plgpu.Layout.WGMMA
    rows, columns = arrays[0].shape
    out = plgpu.ShapeDtypeStruct((rows, columns * len(arrays)), arrays[0].dtype, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout,) * len(arrays), return_type=out)
    def join(_, *parts):
        registers = np.concatenate([part.registers for part in parts], axis=1)
        return mgpu.FragmentedArray(_registers=registers, _layout=parts[0].layout, _is_signed=None)

    return join(*arrays)


def eight_bit_fragments(array):
    """An 8-bit ``[rows, cols]`` array in the WGMMA layout as the same values in
    the 8-bit WGMMA layout (an 8-bit wgmma's register operand), when each
    thread's column tiles 2T and 2T + 1 hold the four consecutive columns the
    8-bit layout gives it in tile T (``mosaic_fp8.fragment_column``): the
    registers regrouped in pairs, no value moves between threads. Compiled only."""
    rows, columns = array.shape
    out = plgpu.ShapeDtypeStruct((rows, columns), array.dtype, layout=plgpu.Layout.WGMMA_8BIT)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out)
    def regroup(_, pairs):
        registers = pairs.registers
        tiles = registers.shape[1]
        quads = np.empty((registers.shape[0], tiles // 2, *registers.shape[2:]), dtype=object)
        for index in np.ndindex(quads.shape):
            low, high = (registers[(index[0], 2 * index[1] + i, *index[2:])] for i in range(2))
            quads[index] = mgpu.utils.vector_concat([low, high])
        return mgpu.FragmentedArray(_registers=quads, _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return regroup(array)


def _kernel(
    table_ref,
    x_gmem,
    w_gmem,
    *rest,
    tiles: Tiles,
    num_experts: int,
    row_tiles: int,
    decode: NibbleDecode | None,
    has_bias: bool,
    interpret: bool,
    act: EpilogueActivation | None = None,
    quantize_out: bool = False,
):
    # Scales [E, G, N] (and zero points) when decoding, the bias [E, N], the output.
    bias_gmem = rest[-2] if has_bias else None
    quant_gmem, o_gmem = rest[: len(rest) - 1 - has_bias], rest[-1]
    m, k = x_gmem.shape
    n = w_gmem.shape[1]
    dtype = x_gmem.dtype
    bm, bk, wg_m, wg_n = tiles.block_m, tiles.block_k, tiles.wg_m, tiles.wg_n
    col_tiles = pl.cdiv(n, tiles.block_n)  # the last may reach past N (compiled only: tiles_refusal)
    words = tiles.word_decode and not interpret  # nibbles from 32-bit registers (see Tiles)
    # A cluster's programs share the row tile: x's tiles are multicast to both.
    shared_x = ("cluster",) if tiles.cluster_n > 1 else ()
    if decode is None:
        in_specs = [
            plgpu.BlockSpec(
                (bm, bk),
                lambda i: (0, i),
                transforms=swizzled(bk, dtype),
                collective_axes=shared_x,
            ),
            plgpu.BlockSpec((tiles.block_n, bk), lambda i: (0, i), transforms=swizzled(bk, dtype)),
        ]
    else:  # x as the unit's 4 pieces, the unit's codes, its group's scales (and zero points)
        in_specs = [
            *(
                plgpu.BlockSpec(
                    (bm, PIECE),
                    lambda i, j=j: (0, PIECES * i + j),
                    transforms=swizzled(PIECE, dtype),
                    collective_axes=shared_x,
                )
                for j in range(PIECES)
            ),
            # A partial last K step (k_tail_refusal) tiles the codes 16 wide: their K/4 is then no
            # multiple of the 32-wide tile Mosaic gives them otherwise.
            plgpu.BlockSpec((tiles.block_n, PIECE), lambda i: (0, i), transforms=_codes_transforms(k)),
            # a step's scale (and zero point) row, or its 4 units' e2m1 factor rows
            *(plgpu.BlockSpec((PIECES if decode.e2m1 else 1, tiles.block_n), lambda i: (i, 0)) for _ in quant_gmem),
        ]

    pipelined = dict(steps=pl.cdiv(k, bk), in_specs=in_specs, stages=tiles.stages)
    pipeline = functools.partial(k_pipeline, **pipelined)
    specialized = tiles.warp_specialized

    def operands(group, col_tile, load_row):
        """The pipeline's gmem inputs for one output tile."""
        cols = pl.ds(col_tile * tiles.block_n, tiles.block_n)
        rows = x_gmem.at[pl.ds(load_row, bm)]
        if decode is None:
            return rows, w_gmem.at[group, cols]
        return (*(rows for _ in range(PIECES)), w_gmem.at[group, cols], *(q.at[group, :, cols] for q in quant_gmem))

    unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)
    # The decoded pieces wait in shared memory for the wgmma in STAGE_SLOTS slots per
    # warpgroup (the interpreter cannot store through a swizzle: there they are plain).
    stage_transforms = () if interpret else swizzled(PIECE, dtype)
    stage_shape = (tiles.compute_wgs, STAGE_SLOTS, wg_n, PIECE)
    decoding = decode is not None
    staged = decoding and not tiles.swap_ab  # swap_ab feeds the decoded pieces from registers
    e2m1 = decoding and decode.e2m1
    # The split slot: the same bytes as one slot, as two row halves.
    slot_shape = (2, wg_m // 2) if split_slot(tiles, dtype, o_gmem.dtype, decode, quantize_out) else (wg_m,)
    exchange = quantize_out and tiles.compute_wgs > 1  # a row's output group: half each warpgroup's
    scratch = dict(
        o_smem=plgpu.SMEM((tiles.compute_wgs, *slot_shape, EPILOGUE_COLUMNS), o_gmem.dtype),
        stage=plgpu.SMEM(stage_shape, dtype, transforms=stage_transforms) if staged else None,
        factors=plgpu.SMEM((tiles.compute_wgs, FACTOR_SLOTS, PIECES, wg_n), jnp.bfloat16) if e2m1 else None,
        amax_smem=plgpu.SMEM((tiles.compute_wgs, wg_m), jnp.float32) if exchange else None,
        exchanged=plgpu.Barrier(num_arrivals=tiles.compute_wgs) if exchange else None,
        read=plgpu.Barrier(num_arrivals=tiles.compute_wgs) if exchange else None,
        turn=plgpu.Barrier(num_arrivals=1) if exchange and tiles.swap_ab else None,
    )
    if specialized:  # the pipeline's buffers, shared by the memory and compute warpgroups
        scratch["allocations"] = pipeline(unused, unused).get_allocations(*operands(0, 0, 0))

    @functools.partial(
        pl.run_scoped,
        **{name: shape for name, shape in scratch.items() if shape is not None},
        **(dict(collective_axes="wg") if specialized else {}),
    )
    def _(o_smem, stage=None, factors=None, amax_smem=None, exchanged=None, read=None, turn=None, allocations=None):
        wg = lax.axis_index("wg") if specialized else jnp.int32(0)
        wg_slice = pl.ds(pl.multiple_of(wg * wg_n, wg_n), wg_n)  # the warpgroup's columns of the weight tile
        cn = tiles.cluster_n

        @plgpu.nd_loop((row_tiles * pl.cdiv(col_tiles, cn),), collective_axes="sm")
        def _(loop):
            (item,) = loop.index
            row_tile, col_tile = tile_order(item, row_tiles, pl.cdiv(col_tiles, cn), tiles.group_m)
            if cn > 1:  # the cluster's programs: adjacent column tiles of one row tile
                col_tile = col_tile * cn + lax.axis_index("cluster")
            group, load_row = table_ref[row_tile, 0], pl.multiple_of(table_ref[row_tile, 1], ROW_ALIGN)
            first_row, rows = table_ref[row_tile, 2], table_ref[row_tile, 3]
            offset = first_row - load_row  # the tile's own rows in the loaded box (the others are not stored)
            wg_cols = col_tile * tiles.block_n + wg * wg_n
            # A gated activation stores half the columns: the warpgroup's outputs start at wg_cols / 2.
            out_wg_n = wg_n // 2 if act is not None and act.gated else wg_n
            out_cols = col_tile * (tiles.block_n * out_wg_n // wg_n) + wg * out_wg_n

            def store(acc, transposed: bool = False):
                store_tile(acc, o_smem.at[wg], o_gmem, out_cols, (first_row, offset, rows), transposed)

            swap = tiles.swap_ab
            acc_shape = (wg_n, wg_m) if swap else (wg_m, wg_n)

            def context(run):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(acc_shape, jnp.float32))
                def _(acc_ref):
                    run(acc_ref)
                    acc = acc_ref[...]
                    if decoding and decode.e2m1:  # the folded weight's factor
                        acc = acc * 2.0**E2M1_FOLDED_EXPONENT
                    if has_bias:  # the expert's [wg_n] bias, broadcast over the rows
                        bias_ref = bias_gmem.at[group, pl.ds(wg_cols, wg_n)]
                        layout = plgpu.Layout.WGMMA.reduce(1 if swap else 0)
                        bias = plgpu.load(bias_ref, layout=layout, optimized=False).astype(jnp.float32)
                        acc = acc + (bias[:, None] if swap else bias[None, :])
                    if act is not None:
                        acc = epilogue_activation(acc, act, swap)
                    if quantize_out:
                        acc = quantized_and_back(acc)
                    store(acc.astype(o_gmem.dtype), transposed=swap)

            def quantized_and_back(out):
                """The activated ``out`` (``[wg_m, 64 | 128]``, swapped ``[64 | 128, wg_m]``)
                quantized as w2's fp8 group-128 input and multiplied back by its scales (the
                quantizing pass with ``dequantize``): a row's group is the tile's 128 outputs,
                with two warpgroups half each — they exchange their row maxima."""
                rows_axis = 1 if swap else 0
                if turn is not None:  # out.T's columns span the warps: the max goes through one shared scratch
                    pl.when(wg == 1)(lambda: plgpu.barrier_wait(turn))  # that both warpgroups use, in turn
                amax = jnp.max(jnp.abs(out), axis=1 - rows_axis)
                if turn is not None:
                    pl.when(wg == 0)(lambda: plgpu.barrier_arrive(turn))
                if exchange:
                    row_layout = plgpu.Layout.WGMMA.reduce(1 - rows_axis)
                    amax = exchanged_row_max(amax, wg, amax_smem, exchanged, row_layout)
                    plgpu.barrier_arrive(read)  # (the next tile's maxima overwrite these)
                    plgpu.barrier_wait(read)
                scale = amax / codecs.FLOAT8_E4M3_MAX
                codes = fp8_group_values(out, scale, rows_axis).astype(jnp.float8_e4m3fn)
                per_row = scale[None, :] if swap else scale[:, None]
                return codes.astype(jnp.float32) * per_row

            def step(indices, x_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, x_smem, w_smem.at[wg_slice].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            def decode_step(indices, *refs):
                x_pieces, codes_smem, quant, acc_ref = refs[:PIECES], refs[PIECES], refs[PIECES + 1 : -1], refs[-1]
                codes = codes_smem[wg_slice]
                if decode.e2m1:
                    bits = word_decode.E2M1_HALF_BITS if decode.half_bits else word_decode.NIBBLE_BITS
                    # The warpgroup's [PIECES, wg_n] factors from their bytes, 4 a thread, then read
                    # back in the rows' layout: a quarter of the conversions each thread would make alone.
                    factor_slot = factors.at[wg, indices[0] % FACTOR_SLOTS]
                    factor_slot[...] = e2m1_factor(quant[0][:, wg_slice])
                    plgpu.commit_smem()

                    def piece_values(piece):  # unit `piece`: e2m1 x 2**-6 times its factor
                        factor = factor_slot[piece][:, None]
                        if interpret:  # exact in f32, rounded once (the factors are powers of two)
                            return (e2m1_piece(codes, piece, bits, dtype, True) * factor.astype(jnp.float32)).astype(
                                dtype
                            )
                        return e2m1_piece(codes, piece, bits, dtype, False) * factor

                else:
                    scale = quant[0][0, wg_slice][:, None]
                    if decode.zero_points:
                        code_offset = quant[1][0, wg_slice][:, None]
                    else:
                        code_offset = jnp.asarray(MAGIC[jnp.dtype(dtype).name][1] + decode.code_offset, dtype)

                    def piece_values(piece):
                        return _decode_piece(codes, piece, code_offset, scale, dtype, words)

                if swap:  # out.T += w_piece @ x_piece.T, the decoded piece as the register operand
                    for piece in range(PIECES):
                        plgpu.wgmma(acc_ref, piece_values(piece), x_pieces[piece].transpose((1, 0)))
                        if piece < PIECES - 1:
                            # The product before this one is done: its register operand is free.
                            # Four pieces' operands beside the accumulator outgrow the 232
                            # registers a thread, and ptxas then serializes every wgmma.
                            plgpu.wgmma_wait(1)
                    plgpu.wgmma_wait(0)
                    return acc_ref
                for piece in range(PIECES):
                    slot = stage.at[wg, piece % STAGE_SLOTS]
                    if piece >= STAGE_SLOTS:
                        plgpu.wgmma_wait(1)  # the product that read this slot (piece - 2) is done
                    slot[...] = piece_values(piece)
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, x_pieces[piece], slot.transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            @pl.when((rows > 0) & (group < num_experts))
            def _():
                body = step if decode is None else decode_step
                gmem_refs = operands(group, col_tile, load_row)
                if specialized:
                    pipeline(body, context)(*gmem_refs, allocations=allocations)
                else:
                    run_k_pipeline(body, context, gmem_refs, **pipelined)

            @pl.when((rows > 0) & (group >= num_experts) & (wg < tiles.compute_wgs))
            def _():  # rows no expert owns: zeros
                store(jnp.zeros((wg_m, out_wg_n), o_gmem.dtype))

    plgpu.wait_smem_to_gmem(0)


def expert_gemm_mosaic(
    x: jax.Array,
    weight: jax.Array,
    offsets: jax.Array | None,
    tiles: Tiles,
    *,
    out_dtype,
    counts: jax.Array | None = None,
    bias: jax.Array | None = None,
    decode: NibbleDecode | None = None,
    scales: jax.Array | None = None,
    zero_points: jax.Array | None = None,
    interpret: bool = False,
    table: jax.Array | None = None,
    act: EpilogueActivation | None = None,
    out_quant: str = "none",
) -> jax.Array:
    """``x [M, K]`` (bf16/f16) times ``weight``: row ``r`` of the ``[M, N]``
    result (``out_dtype``) uses the expert whose range ``[offsets[e],
    offsets[e+1])`` holds it (``offsets`` None: the one expert of a dense
    layout; with ``counts [E]``, the grouped-masked layout: expert e's first
    ``counts[e]`` of its ``M / E`` rows); rows outside every range are zero.
    ``bias [E, N]`` (any float dtype) is added in f32 to the expert's rows.
    ``weight`` is ``[E, N, K]`` in
    x's dtype, or with ``decode`` the 4-bit codes ``uint16 [E, N, K/4]`` with
    ``scales`` (and ``zero_points``) ``[E, G, N]`` in x's dtype (see
    :class:`NibbleDecode`). ``table``: the row tiles given
    (:func:`block_table`) in place of the ranges. ``act``: applied to the
    f32 sums in the epilogue (gated kinds: ``[M, N/2]``,
    :func:`activation_refusal` says where); ``out_quant`` (:data:`OUT_QUANT`):
    the activated rows quantized there and multiplied back by their scales
    (:func:`quantized_output_refusal`)."""
    m, k = x.shape
    num_experts, n = weight.shape[:2]
    check_tiles(tiles, n, k, x.dtype, decode, partial=not interpret)
    refusal = swap_ab_refusal(out_dtype, interpret) if tiles.swap_ab else None
    if refusal:
        raise ValueError(f"mosaic GEMM: {refusal}; the staged form (swap_ab=False) computes the same")
    quantized = out_quant != "none"
    refusal = shared_memory_refusal(shared_memory_bytes(tiles, x.dtype, out_dtype, decode, 1, quantized), tiles)
    if refusal:
        raise ValueError(f"mosaic GEMM: {refusal}")
    refusal = activation_refusal(tiles, act, n) if act is not None else None
    refusal = refusal or (quantized_output_refusal(tiles, act, out_quant, True) if quantized else None)
    if refusal:
        raise ValueError(f"mosaic GEMM: {refusal}")
    quant = ()
    if decode is not None:
        want = (num_experts, decode.groups, n)
        quant = (scales,) + ((zero_points,) if decode.zero_points else ())
        if decode.e2m1 and decode.zero_points:
            raise ValueError("mosaic GEMM: e2m1 codes take no zero points")
        if weight.shape != (num_experts, n, k // PIECES) or weight.dtype != jnp.uint16:
            raise ValueError(
                f"mosaic GEMM: 4-bit codes must be uint16 {(num_experts, n, k // PIECES)}, got "
                f"{weight.dtype} {weight.shape}"
            )
        quant_dtype = jnp.dtype(jnp.uint8 if decode.e2m1 else x.dtype)  # e2m1: the e8m0 bytes
        for name, array in zip(("scales", "zero_points")[: len(quant)], quant, strict=True):
            if array is None or array.shape != want or array.dtype != quant_dtype:
                got = None if array is None else f"{array.dtype} {array.shape}"
                raise ValueError(f"mosaic GEMM: {name} must be {quant_dtype} {want}, got {got}")
    padded = padded_rows(m, tiles.block_m)  # a row tile's box fits inside x
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    if table is None:
        table = tile_table(offsets, counts, m, num_experts, tiles.block_m, interpret)
    row_tiles = table.shape[0]
    if bias is not None and bias.shape != (num_experts, n):
        raise ValueError(f"mosaic GEMM: bias must be [E, N] = {(num_experts, n)}, got {bias.shape}")
    if bias is not None and n % tiles.block_n:  # the epilogue loads a warpgroup's whole columns
        bias = jnp.pad(bias, ((0, 0), (0, pl.cdiv(n, tiles.block_n) * tiles.block_n - n)))
    extra = (bias,) if bias is not None else ()
    body = functools.partial(
        _kernel,
        tiles=tiles,
        num_experts=num_experts,
        row_tiles=row_tiles,
        decode=decode,
        has_bias=bias is not None,
        interpret=interpret,
        act=act,
        quantize_out=quantized,
    )
    cluster = tiles.cluster_n  # programs a cluster (1 or 2)
    out_n = n if act is None else act.out_n(n)
    if tiles.warp_specialized:  # a persistent grid: a program an SM, each loops over its share of the tiles
        programs = persistent_programs(interpret) // cluster
        structure = dict(num_threads=COMPUTE_WGS + 1, thread_name="wg", kernel_name="moe_gemm_mosaic")
    else:  # a program an output tile: the hardware runs as many an SM as fit
        programs = row_tiles * pl.cdiv(n, tiles.block_n)
        structure = dict(kernel_name="moe_gemm_mosaic_mid")
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, out_n), out_dtype),
        grid=(programs,),
        grid_names=("sm",),
        **(dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}),
        **structure,  # kernel_name: what profilers show
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        # Interpreted, fresh memory reads as NaN: a row the kernel failed to store shows.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    return kernel(table, x, weight, *quant, *extra)


def planar_words(values: jax.Array) -> jax.Array:
    """Packed planar 4-bit codes ``uint8 [E, N, K/2]`` as the 16-bit halves the
    kernels decode: ``uint16 [E, N, K/4]``."""
    e, n, half_k = values.shape
    return lax.bitcast_convert_type(values.reshape(e, n, half_k // 2, 2), jnp.uint16)


def _nibble_operands(w: WeightSpec, weight_arrays: tuple[jax.Array, ...], dtype):
    """A planar 4-bit weight's stored parts (packed codes ``uint8 [E, N, K/2]``,
    scales ``[E, N, G]`` or ``[E, N, 1]`` — ``[E, G, N]`` with
    ``w.k_major_scales`` —, packed integer zero points) as the
    kernel reads them: codes ``uint16 [E, N, K/4]``, scales (and code offsets
    ``magic + zero``) ``[E, K/128, N]`` in ``dtype`` — MXFP4: its e8m0 bytes
    ``uint8 [E, K/32, N]`` as stored (the kernel makes the factors:
    :func:`e2m1_factor`) —, and the decode spec."""
    values, scale = weight_arrays[:2]
    e, n, k = w.num_experts, w.n, w.k
    codes = planar_words(values)
    if not w.k_major_scales:  # stored [E, N, G]: the call transposes them
        scale = jnp.swapaxes(scale, 1, 2)
    if w.value_type == "float4_e2m1":
        return codes, scale, None, NibbleDecode(k // E2M1_UNIT, e2m1=True, half_bits=w.half_bits)
    groups = k // UNIT
    scales = jnp.broadcast_to(scale, (e, groups, n)).astype(dtype)
    zero_points = None
    if w.zero_point == "int":  # byte j holds group 2j in its low nibble, 2j + 1 in its high one
        packed = weight_arrays[2].astype(jnp.uint8)
        nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(e, n, -1)[..., :groups]
        magic_value = MAGIC[jnp.dtype(dtype).name][1]
        zero_points = (jnp.swapaxes(nibbles, 1, 2).astype(jnp.float32) + magic_value).astype(dtype)
    code_offset = 8 if w.value_type == "int4" else 0
    decode = NibbleDecode(groups, code_offset=code_offset, zero_points=zero_points is not None)
    return codes, scales, zero_points, decode


def expert_gemm(
    call: GemmCall, tiles: Tiles, x: jax.Array, weight_arrays, bias, route_arrays, x_scale: jax.Array | None = None
) -> jax.Array:
    """The family's entry point (as ``triton.expert_gemm``): ``[M, N]`` in
    ``call.out_dtype`` for a 16-bit weight (``weight_arrays = (values,)``) or
    a planar 4-bit one (values, scale, and for uint4 the packed zero point);
    ``route_arrays``: the layout's (offsets | counts | none). A weight
    ``dequantize_first`` applies to arrives here already dequantized. The
    input is unscaled 16-bit floats (``x_scale`` None)."""
    if x_scale is not None:
        raise ValueError("mosaic.expert_gemm: x_scale: the kernel takes unscaled 16-bit inputs")
    w, layout = call.weight, call.layout
    run = functools.partial(
        expert_gemm_mosaic,
        tiles=tiles,
        out_dtype=jnp.dtype(call.out_dtype),
        bias=bias,
        interpret=call.interpret,
        act=call.activation,
        out_quant=call.out_quant,
    )
    (x,), offsets, routing, slots = routed(layout, route_arrays, w.num_experts, x)
    if not w.quantized:
        out = run(x, weight_arrays[0], offsets, **routing)
    else:
        codes, scales, zero_points, decode = _nibble_operands(w, weight_arrays, x.dtype)
        out = run(x, codes, offsets, decode=decode, scales=scales, zero_points=zero_points, **routing)
    return out if slots is None else to_slots(out, slots, layout.m_out)
