"""Grouped expert GEMM on Mosaic GPU (Hopper): TMA loads into swizzled shared
memory, warp-specialized wgmma, a persistent loop over output tiles.

The Triton-lowered family in :mod:`pallas_kernels.gemm` covers every weight
format and layout; this kernel is its prefill member for 16-bit and planar
4-bit integer weights, where the cp.async-pipelined Triton tile stops at
~510 TFLOP/s (mixtral w13). One
warpgroup issues the TMA copies of each K step, two compute
warpgroups run the products of one ``[block_m, block_n]`` output tile, each
on its share of the columns (``wgmma``: x from shared memory, the weight
tile's ``[block_n / 2, bk]`` slice transposed in place as the B operand) — or, with
``split_rows``, each on its share of the rows with the whole weight tile.

Rows: TMA cannot gather, so a row tile is ``block_m`` consecutive rows of x.
The launcher turns the layout into a table of row tiles — ``(group, load
row, first row, rows)`` each: an expert's rows cut into tiles from the
multiple of 8 at or below its first row (a TMA box into 8-row tiled shared
memory starts on that grid), the rows no expert owns as a group of zeros —
so no tile mixes experts. A tile loads ``block_m`` rows from its load row
(inside x; the rows that are not its own are read and ignored) and stores
only its own rows, as a sum of power-of-two row slices (TMA boxes are
static; their starts are not).

Layouts: ``dense`` (one expert), ``grouped_contiguous`` (``offsets [E+1]``)
and ``grouped_masked`` (``counts [E]`` of each expert's ``M / E`` rows; the
rest zeros). Weights: bf16/f16 ``[E, N, K]`` (K contiguous) with an optional
bias ``[E, N]``; or 4-bit integer codes in the planar order of 128-column
units (:class:`NibbleDecode`),
decoded in the compute warpgroups' registers each K step: a code's 16-bit
pattern ``magic | q`` is the float ``magic + q`` exactly, minus the offset
(``magic`` plus the zero point), times the scale — one rounding, as the
dequantized weight has — then staged in shared memory as the wgmma's B
operand, one 32-column piece at a time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, vector

from pallas_kernels.gemm import tile_order
from pallas_kernels.word_decode import MAGIC  # (pattern, base): pattern | q is the float base + q

# Compute warpgroups of a program. Not 4: JAX 0.11.2's warp-specialized pipeline then
# raises each to (512 - 40) / 4 -> 112 registers a thread, but a 640-thread program
# launches with 96 (65536 / 640, in steps of 8), and the 40 the memory warpgroup gives
# back do not cover 4 x 16: setmaxnreg.inc waits for ever (it hung on the H200).
COMPUTE_WGS = 2
EPILOGUE_COLUMNS = 64  # output columns per shared-memory store slot
H100_SMS = 132  # H100 / H200: programs of the persistent grid when the device does not say


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """``block_m`` rows by ``block_n`` columns per output tile (each of the
    two compute warpgroups takes ``block_n / 2`` — or
    with ``split_rows`` ``block_m / 2`` rows and every column, both
    sharing each weight tile: 4-bit codes are then decoded a share by each),
    ``block_k`` per pipeline step, ``stages`` steps in flight, programs
    ordered in bands of ``group_m`` row tiles."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    group_m: int = 8
    stage_slots: int = 2  # 4-bit path: decoded pieces in shared memory per compute warpgroup (2 or 4)
    split_rows: bool = False
    # 4-bit path: each decoded piece is the wgmma's A operand straight from
    # registers (no staging), the accumulator out.T ([wg_n, block_m]), stored
    # transposed. GPU only: the 0.11 interpreter cannot run a register operand.
    swap_ab: bool = False
    # 1: a step's wgmma stays in flight while the next step's is issued, its
    # shared-memory slot released a step late (16-bit weights and swap_ab: the
    # staged pieces would need a wait of their own).
    delay_release: int = 0
    # 4-bit path: each nibble taken from the 32-bit registers of the WGMMA layout
    # (two neighbouring codes each: a shift, a mask and an or per pair) rather than
    # from 16-bit lanes, whose shifts LLVM unpacks per lane. Compiled only: the
    # interpreter runs the 16-bit form, which computes the same values.
    word_decode: bool = False
    # Shared-memory slots a warpgroup's epilogue stores through (1 or 2): with 2, the
    # next 64-column chunk is written while the last one's TMA store still reads its slot.
    epilogue_slots: int = 1
    # Programs in clusters of ``cluster_n`` (1 or 2) on adjacent column tiles of one row
    # tile: x's tiles are multicast to both by TMA (each fetches half from L2).
    cluster_n: int = 1
    # Programs in clusters of ``cluster_m`` (1 or 2) on a pair of row tiles of one expert
    # (each expert's tiles padded to an even count) and one column tile: the weight's
    # tiles are multicast to both (a pad tile runs the pipeline and stores nothing).
    cluster_m: int = 1

    @property
    def wg_m(self) -> int:
        """Rows of a compute warpgroup's accumulator."""
        return self.block_m // COMPUTE_WGS if self.split_rows else self.block_m

    @property
    def wg_n(self) -> int:
        """Columns of a compute warpgroup's accumulator."""
        return self.block_n if self.split_rows else self.block_n // COMPUTE_WGS


UNIT = 128  # columns of one planar unit: a K step of the 4-bit path
PIECES = 4  # a unit's 16-bit half h holds columns h + 32 j at bits 4j..4j+3
PIECE = UNIT // PIECES


@dataclasses.dataclass(frozen=True)
class NibbleDecode:
    """4-bit integer weights the kernel decodes: codes ``uint16 [E, N, K/4]``
    (the planar order of 128-column units: bits ``4j..4j+3`` of half ``h``
    hold column ``32 j + h``), scales ``[E, G, N]`` in the compute dtype (G =
    K/128 groups; per-channel scales repeated G times: a pipelined input
    follows the K step), and either a constant code offset
    (``code_offset``: int4's 8) or per-group zero points ``[E, G, N]`` in the
    compute dtype (``zero_points``: uint4)."""

    groups: int
    code_offset: int = 8
    zero_points: bool = False


def check_tiles(tiles: MosaicTiles, n: int, k: int, dtype, decode: NibbleDecode | None = None) -> None:
    """The shapes the kernel's static TMA boxes and wgmma tiles need."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize != 2:
        raise ValueError(f"mosaic GEMM: 16-bit inputs and weights, got {jnp.dtype(dtype)}")
    # x's rows are the wgmma's M (multiples of 64), or with swap_ab its N (decode-sized tiles).
    row_choices = (16, 32, 64, 128) if tiles.swap_ab else (64, 128)
    if tiles.wg_m not in row_choices:
        allowed = (
            f"{64 * COMPUTE_WGS} or {128 * COMPUTE_WGS} with split_rows"
            if tiles.split_rows
            else " or ".join(map(str, row_choices))
        )
        raise ValueError(f"mosaic GEMM: block_m must be {allowed}, got {tiles.block_m}")
    if tiles.wg_n % EPILOGUE_COLUMNS or tiles.wg_n > 256:
        ways = 1 if tiles.split_rows else COMPUTE_WGS
        raise ValueError(
            f"mosaic GEMM: block_n must be a multiple of {ways * EPILOGUE_COLUMNS} "
            f"and at most {ways * 256}, got {tiles.block_n}"
        )
    if tiles.wg_m * tiles.wg_n > 128 * 128:  # 128 f32 registers a thread for the accumulator
        raise ValueError(
            f"mosaic GEMM: a warpgroup's accumulator (block_m x block_n / 2, or block_m / 2 "
            f"x block_n with split_rows) must be at most 128 x 128, got block_m={tiles.block_m}, "
            f"block_n={tiles.block_n}"
        )
    if decode is None and tiles.block_k * itemsize not in (32, 64, 128):
        raise ValueError(f"mosaic GEMM: block_k must be 16, 32 or 64 for 16-bit operands, got {tiles.block_k}")
    if n % tiles.block_n:
        raise ValueError(f"mosaic GEMM: N={n} must be a multiple of block_n={tiles.block_n}")
    if k % tiles.block_k:
        raise ValueError(f"mosaic GEMM: K={k} must be a multiple of block_k={tiles.block_k}")
    if tiles.stage_slots not in (2, PIECES):
        raise ValueError(f"mosaic GEMM: stage_slots must be 2 or {PIECES}, got {tiles.stage_slots}")
    if tiles.swap_ab and (decode is None or tiles.split_rows):
        raise ValueError(
            "mosaic GEMM: swap_ab (decoded weights as the register operand) is for 4-bit weights without split_rows"
        )
    if tiles.delay_release not in (0, 1) or tiles.stages <= tiles.delay_release:
        raise ValueError(
            f"mosaic GEMM: delay_release must be 0 or 1 and below stages, got {tiles.delay_release} "
            f"with {tiles.stages} stages"
        )
    if tiles.delay_release and k // tiles.block_k < 2:
        raise ValueError(
            f"mosaic GEMM: delay_release needs at least 2 K steps (the last step's slot is released by "
            f"waiting at the last step), got K={k} with block_k={tiles.block_k}"
        )
    if tiles.delay_release and decode is not None and not tiles.swap_ab:
        raise ValueError(
            "mosaic GEMM: delay_release is for 16-bit weights and the swap_ab form (staged 4-bit pieces are "
            "rewritten each step)"
        )
    if tiles.epilogue_slots not in (1, 2):
        raise ValueError(f"mosaic GEMM: epilogue_slots must be 1 or 2, got {tiles.epilogue_slots}")
    if tiles.cluster_n not in (1, 2) or tiles.cluster_m not in (1, 2) or tiles.cluster_n * tiles.cluster_m > 2:
        raise ValueError(
            f"mosaic GEMM: clusters of two programs at most: cluster_n and cluster_m 1 or 2, not both 2, "
            f"got cluster_n={tiles.cluster_n}, cluster_m={tiles.cluster_m}"
        )
    if (n // tiles.block_n) % tiles.cluster_n:
        raise ValueError(
            f"mosaic GEMM: cluster_n={tiles.cluster_n} pairs column tiles: N={n} must be a multiple of "
            f"{tiles.cluster_n * tiles.block_n}"
        )
    if tiles.word_decode and decode is None:
        raise ValueError("mosaic GEMM: word_decode is for 4-bit weights (the codes' 32-bit registers)")
    if decode is not None:
        if tiles.block_k != UNIT:
            raise ValueError(f"mosaic GEMM: 4-bit weights take block_k={UNIT} (one planar unit), got {tiles.block_k}")
        if jnp.dtype(dtype).name not in MAGIC:
            raise ValueError(f"mosaic GEMM: 4-bit weights take bf16 or f16 inputs, got {jnp.dtype(dtype)}")
        if decode.groups != k // UNIT:
            raise ValueError(
                f"mosaic GEMM: 4-bit weights take a scale per {UNIT} columns (per-channel ones repeated), "
                f"got {decode.groups} groups over K={k}"
            )


def swap_ab_refusal(out_dtype, interpret: bool) -> str | None:
    """Why the ``swap_ab`` form cannot run a call (None if it can)."""
    if interpret:
        return (
            "swap_ab runs compiled only (the Mosaic GPU interpreter of jax 0.11 cannot take a register wgmma operand)"
        )
    if jnp.dtype(out_dtype).itemsize != 2:
        return (
            f"swap_ab stores out.T through a transposed shared-memory view, which takes 16-bit outputs, "
            f"got out_dtype={jnp.dtype(out_dtype)}"
        )
    return None


def max_row_tiles(ranges: int, m: int, block_m: int, pairs: int = 1) -> int:
    """Static bound on the row tiles of ``m`` rows cut per range, each range's
    tiles starting up to 7 rows before its first row: at most min(ranges, m)
    ranges hold rows, each one tile plus one per further block_m rows (the
    7 rows in front add at most one tile per range); with ``pairs`` = 2 each
    range may add a tile to make its count even, and the total is even."""
    busy = min(ranges, m)
    bound = max(1, 2 * busy + m // block_m + (busy if pairs > 1 else 0))
    return -(-bound // pairs) * pairs


ROW_ALIGN = 8  # a TMA box into 8-row tiled shared memory starts on a multiple of 8 rows


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


def row_tile_table(
    starts: jax.Array, ends: jax.Array, num_experts: int, m: int, block_m: int, pairs: int = 1
) -> jax.Array:
    """``[tiles, 4]`` int32 ``(group, load row, first row, rows)`` per row
    tile: the row ranges ``[starts[i], ends[i])`` (the first ``num_experts``
    are the experts', the others rows stored as zeros, group E), cut into
    tiles of ``block_m`` from the multiple of 8 at or below each range's
    first row. A tile loads ``block_m`` rows of x from its load row (a
    multiple of 8, inside ``padded_rows(m, block_m)``) and stores ``rows``
    rows from its first row; tiles past the last have 0 rows. ``pairs`` = 2:
    each range's tile count is made even (a 0-row tile after its last), so
    tiles 2p and 2p+1 always share a group (a cluster's row-tile pair)."""
    ranges = starts.shape[0]
    starts = jnp.clip(starts.astype(jnp.int32), 0, m)
    ends = jnp.maximum(jnp.clip(ends.astype(jnp.int32), 0, m), starts)
    aligned = starts - starts % ROW_ALIGN
    per_range = jnp.where(ends > starts, (ends - aligned + block_m - 1) // block_m, 0)
    per_range = per_range + (-per_range) % pairs
    tile_ends = jnp.cumsum(per_range)
    tile = jnp.arange(max_row_tiles(ranges, m, block_m, pairs), dtype=jnp.int32)
    index = jnp.minimum(jnp.searchsorted(tile_ends, tile, side="right"), ranges - 1).astype(jnp.int32)
    group = jnp.minimum(index, num_experts)  # every zero range is group E
    tile_start = aligned[index] + (tile - (tile_ends[index] - per_range[index])) * block_m
    first = jnp.maximum(tile_start, starts[index])
    rows = jnp.clip(jnp.minimum(tile_start + block_m, ends[index]) - first, 0, block_m)
    rows = jnp.where(tile < tile_ends[-1], rows, 0)
    load = jnp.clip(tile_start, 0, padded_rows(m, block_m) - block_m)
    return jnp.stack([group, load, first, rows], axis=1)


def padded_rows(m: int, block_m: int) -> int:
    """Rows of x the kernel reads: at least one tile, a multiple of 8."""
    return -(-max(m, block_m) // ROW_ALIGN) * ROW_ALIGN


def _store_copies(rows, block_m: int):
    """How many TMA copies :func:`_store_rows` issues for ``rows`` rows (one a set bit)."""
    count = jnp.int32(0)
    size = block_m
    while size:
        count = count + ((rows & size) != 0).astype(jnp.int32)
        size //= 2
    return count


def _wait_stores_but(pending, block_m: int) -> None:
    """Wait until at most ``pending`` (dynamic, up to one copy a power of two
    up to ``block_m``) of the issued shared-to-global copies still read."""
    for allowed in range(block_m.bit_length() + 1):

        @pl.when(pending == allowed)
        def _(allowed=allowed):
            plgpu.wait_smem_to_gmem(allowed, wait_read_only=True)


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


def persistent_programs(interpret: bool) -> int:
    """Programs of a persistent grid: one per SM (a few when interpreted: the
    loop over tiles covers every tile either way)."""
    return 4 if interpret else getattr(jax.devices()[0], "core_count", None) or H100_SMS


def swizzled(columns: int, dtype) -> tuple:
    """Tiling + swizzle transforms of a ``[rows, columns]`` shared-memory tile
    (a 16-bit wgmma operand; also 8-bit output slots, see process_input_mosaic)."""
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
        mask, high = splat(0x000F000F), splat(magic | magic << 16)

        def decode(register):
            bits = vector.bitcast(word, register)
            if piece:
                bits = arith.shrui(bits, splat(4 * piece))
            return vector.bitcast(pair, arith.ori(arith.andi(bits, mask), high))

        registers = np.vectorize(decode, otypes=[object])(array.registers)
        return mgpu.FragmentedArray(_registers=registers, _layout=array.layout, _is_signed=None)

    return nibble_floats(codes)


def _decode_piece(codes, piece: int, offset, scale, dtype, words: bool = False):
    """Columns ``[32 piece, 32 piece + 32)`` of a unit from its codes
    ``uint16 [rows, 32]``: ``(magic + q - offset) * scale`` in ``dtype`` (the
    subtraction exact, the product rounded once)."""
    return (_nibble_floats(codes, piece, dtype, words) - offset) * scale


def _kernel(
    table_ref,
    x_gmem,
    w_gmem,
    *rest,
    tiles: MosaicTiles,
    num_experts: int,
    row_tiles: int,
    decode: NibbleDecode | None,
    has_bias: bool,
    interpret: bool,
):
    # Scales [E, G, N] (and zero points) when decoding, the bias [E, N], the output.
    bias_gmem = rest[-2] if has_bias else None
    quant_gmem, o_gmem = rest[: len(rest) - 1 - has_bias], rest[-1]
    m, k = x_gmem.shape
    n = w_gmem.shape[1]
    dtype = x_gmem.dtype
    bm, bk, wg_m, wg_n = tiles.block_m, tiles.block_k, tiles.wg_m, tiles.wg_n
    col_tiles = n // tiles.block_n
    shared = tiles.split_rows  # the warpgroups split the rows and share the weight tile
    delay = tiles.delay_release  # steps a slot is held past its product's issue
    words = tiles.word_decode and not interpret  # nibbles from 32-bit registers (see MosaicTiles)
    # A cluster's programs share the row tile (x's tiles multicast to both) or the
    # column tile of one expert (the weight's tiles multicast).
    shared_x = ("cluster",) if tiles.cluster_n > 1 else ()
    shared_w = ("cluster",) if tiles.cluster_m > 1 else ()
    if decode is None:
        in_specs = [
            plgpu.BlockSpec(
                (bm, bk),
                lambda i: (0, i),
                transforms=swizzled(bk, dtype),
                delay_release=delay,
                collective_axes=shared_x,
            ),
            plgpu.BlockSpec(
                (tiles.block_n, bk),
                lambda i: (0, i),
                transforms=swizzled(bk, dtype),
                delay_release=delay,
                collective_axes=shared_w,
            ),
        ]
    else:  # x as the unit's 4 pieces, the unit's codes, its group's scales (and zero points)
        in_specs = [
            *(
                plgpu.BlockSpec(
                    (bm, PIECE),
                    lambda i, j=j: (0, PIECES * i + j),
                    transforms=swizzled(PIECE, dtype),
                    delay_release=delay,
                    collective_axes=shared_x,
                )
                for j in range(PIECES)
            ),
            plgpu.BlockSpec((tiles.block_n, PIECE), lambda i: (0, i), delay_release=delay, collective_axes=shared_w),
            *(
                plgpu.BlockSpec((1, tiles.block_n), lambda i: (i, 0), delay_release=delay, collective_axes=shared_w)
                for _ in quant_gmem
            ),
        ]

    def pipeline(step, context):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k // bk,),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=tiles.stages,
            compute_context=context,
        )

    def operands(group, col_tile, load_row):
        """The pipeline's gmem inputs for one output tile."""
        cols = pl.ds(col_tile * tiles.block_n, tiles.block_n)
        rows = x_gmem.at[pl.ds(load_row, bm)]
        if decode is None:
            return rows, w_gmem.at[group, cols]
        return (*(rows for _ in range(PIECES)), w_gmem.at[group, cols], *(q.at[group, :, cols] for q in quant_gmem))

    unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)
    # The decoded pieces wait in shared memory for the wgmma: slots per warpgroup, or
    # with split_rows the unit's 4 pieces shared by all, behind two barriers a step
    # (the interpreter cannot store through a swizzle: there they are plain).
    stage_transforms = () if interpret else swizzled(PIECE, dtype)
    stage_shape = (PIECES, tiles.block_n, PIECE) if shared else (COMPUTE_WGS, tiles.stage_slots, wg_n, PIECE)
    decoding = decode is not None
    staged = decoding and not tiles.swap_ab  # swap_ab feeds the decoded pieces from registers
    scratch = dict(
        o_smem=plgpu.SMEM((COMPUTE_WGS, tiles.epilogue_slots, wg_m, EPILOGUE_COLUMNS), o_gmem.dtype),
        stage=plgpu.SMEM(stage_shape, dtype, transforms=stage_transforms) if staged else None,
        # [0]: every warpgroup's pieces are in shared memory; [1]: every product has read them.
        sync=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2) if decoding and shared else None,
    )

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(*operands(0, 0, 0)),
        **{name: shape for name, shape in scratch.items() if shape is not None},
        collective_axes="wg",
    )
    def _(allocations, o_smem, stage=None, sync=None):
        wg = lax.axis_index("wg")
        # The warpgroup's rows of the tile and its columns of the weight tile.
        wg_rows = pl.ds(pl.multiple_of(wg * wg_m, wg_m), wg_m) if shared else slice(None)
        wg_slice = slice(None) if shared else pl.ds(pl.multiple_of(wg * wg_n, wg_n), wg_n)

        cm, cn = tiles.cluster_m, tiles.cluster_n

        @plgpu.nd_loop((row_tiles // cm * col_tiles // cn,), collective_axes="sm")
        def _(loop):
            (item,) = loop.index
            row_tile, col_tile = tile_order(item, row_tiles // cm, col_tiles // cn, tiles.group_m)
            if cn > 1:  # the cluster's programs: adjacent column tiles of one row tile
                col_tile = col_tile * cn + lax.axis_index("cluster")
            if cm > 1:  # the cluster's programs: a pair of row tiles of one expert (row_tile_table's pairs)
                row_tile = row_tile * cm + lax.axis_index("cluster")
            group, load_row = table_ref[row_tile, 0], pl.multiple_of(table_ref[row_tile, 1], ROW_ALIGN)
            first_row, rows = table_ref[row_tile, 2], table_ref[row_tile, 3]
            offset = first_row - load_row  # the tile's own rows in the loaded box (the others are not stored)
            wg_cols = col_tile * tiles.block_n + (0 if shared else wg * wg_n)
            # The tile's own rows [offset, offset + rows) within this warpgroup's rows.
            wg_first = wg * wg_m if shared else 0
            own_start = jnp.maximum(offset, wg_first)
            own_rows = jnp.clip(jnp.minimum(offset + rows, wg_first + wg_m) - own_start, 0, wg_m)

            def store(acc, transposed: bool = False):
                """The compute warpgroup's ``[wg_m, wg_n]`` result (``transposed``:
                given as ``[wg_n, wg_m]``), its own rows only."""
                gmem_first = first_row + own_start - offset
                slots = tiles.epilogue_slots
                for chunk in range(wg_n // EPILOGUE_COLUMNS):
                    if slots == 1 or chunk == 0:  # (a tile's first: the last tile's stores are long done)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's last copies have read it
                    else:  # the previous chunk's copies may still read the other slot
                        _wait_stores_but(_store_copies(own_rows, wg_m), wg_m)
                    slot = o_smem.at[wg, chunk % slots]
                    columns = slice(chunk * EPILOGUE_COLUMNS, (chunk + 1) * EPILOGUE_COLUMNS)
                    if transposed:  # stored through a transposed view of the slot
                        slot.transpose((1, 0))[...] = acc[columns]
                    else:
                        slot[...] = acc[:, columns]
                    plgpu.commit_smem()
                    cols = o_gmem.at[:, pl.ds(wg_cols + chunk * EPILOGUE_COLUMNS, EPILOGUE_COLUMNS)]
                    _store_rows(slot, cols, gmem_first, own_start - wg_first, own_rows, wg_m)

            swap = tiles.swap_ab
            acc_shape = (wg_n, wg_m) if swap else (wg_m, wg_n)

            def context(run):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(acc_shape, jnp.float32))
                def _(acc_ref):
                    run(acc_ref)
                    acc = acc_ref[...]
                    if has_bias:  # the expert's [wg_n] bias, broadcast over the rows
                        bias_ref = bias_gmem.at[group, pl.ds(wg_cols, wg_n)]
                        layout = plgpu.Layout.WGMMA.reduce(1 if swap else 0)
                        bias = plgpu.load(bias_ref, layout=layout, optimized=False).astype(jnp.float32)
                        acc = acc + (bias[:, None] if swap else bias[None, :])
                    store(acc.astype(o_gmem.dtype), transposed=swap)

            def wait_products(indices, in_flight: int):
                """Wait for the products issued before this step's (``in_flight`` of
                them, delay_release) — at the last step for all: the pipeline releases
                the previous step's slot after this returns, and the memory warpgroup
                refills the slots for the next tile once it sees that release, so the
                last product must be done by then."""
                if not delay:
                    plgpu.wgmma_wait(0)
                    return
                last = indices[0] == k // bk - 1

                @pl.when(last)
                def _():
                    plgpu.wgmma_wait(0)

                @pl.when(~last)
                def _():
                    plgpu.wgmma_wait(in_flight)

            def step(indices, x_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_smem.at[wg_slice].transpose((1, 0)))
                wait_products(indices, 1)
                return acc_ref

            def decode_step(indices, *refs):
                x_pieces, codes_smem, quant, acc_ref = refs[:PIECES], refs[PIECES], refs[PIECES + 1 : -1], refs[-1]
                codes = codes_smem[wg_slice]
                scale = quant[0][0, wg_slice][:, None]
                if decode.zero_points:
                    code_offset = quant[1][0, wg_slice][:, None]
                else:
                    code_offset = jnp.asarray(MAGIC[jnp.dtype(dtype).name][1] + decode.code_offset, dtype)
                if shared:
                    return shared_decode_step(x_pieces, codes, code_offset, scale, acc_ref)
                if swap:  # out.T += w_piece @ x_piece.T, the decoded piece as the register operand
                    for piece in range(PIECES):
                        w_piece = _decode_piece(codes, piece, code_offset, scale, dtype, words)
                        plgpu.wgmma(acc_ref, w_piece, x_pieces[piece].transpose((1, 0)))
                    wait_products(indices, PIECES)  # a product per piece
                    return acc_ref
                slots = tiles.stage_slots
                for piece in range(PIECES):
                    slot = stage.at[wg, piece % slots]
                    if piece >= slots:
                        plgpu.wgmma_wait(1)  # the product that read this slot (piece - slots) is done
                    slot[...] = _decode_piece(codes, piece, code_offset, scale, dtype, words)
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, x_pieces[piece], slot.transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            def shared_decode_step(x_pieces, codes, code_offset, scale, acc_ref):
                """Split rows: each warpgroup decodes its share of the unit's pieces into
                the shared stage, then all multiply their rows by all four."""
                share = PIECES // COMPUTE_WGS
                for owner in range(COMPUTE_WGS):

                    @pl.when(wg == owner)
                    def _(owner=owner):
                        for piece in range(owner * share, owner * share + share):
                            stage[piece] = _decode_piece(codes, piece, code_offset, scale, dtype, words)

                plgpu.commit_smem()
                plgpu.barrier_arrive(sync.at[0])
                plgpu.barrier_wait(sync.at[0])
                for piece in range(PIECES):
                    plgpu.wgmma(acc_ref, x_pieces[piece].at[wg_rows], stage.at[piece].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(sync.at[1])  # the next step may overwrite the stage
                plgpu.barrier_wait(sync.at[1])
                return acc_ref

            # A row-tile pair runs the pipeline together (the multicast needs both), a 0-row
            # pad tile included: it stores nothing.
            busy = rows > 0 if cm == 1 else (rows > 0) | (table_ref[row_tile ^ 1, 3] > 0)  # ^ 1: its partner

            @pl.when(busy & (group < num_experts))
            def _():
                body = step if decode is None else decode_step
                pipeline(body, context)(*operands(group, col_tile, load_row), allocations=allocations)

            @pl.when((rows > 0) & (group >= num_experts) & (wg < COMPUTE_WGS))
            def _():  # rows no expert owns: zeros
                store(jnp.zeros((wg_m, wg_n), o_gmem.dtype))

    plgpu.wait_smem_to_gmem(0)


def expert_gemm_mosaic(
    x: jax.Array,
    weight: jax.Array,
    offsets: jax.Array | None,
    tiles: MosaicTiles,
    *,
    out_dtype,
    counts: jax.Array | None = None,
    bias: jax.Array | None = None,
    decode: NibbleDecode | None = None,
    scales: jax.Array | None = None,
    zero_points: jax.Array | None = None,
    interpret: bool = False,
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
    :class:`NibbleDecode`)."""
    m, k = x.shape
    num_experts, n = weight.shape[:2]
    check_tiles(tiles, n, k, x.dtype, decode)
    refusal = swap_ab_refusal(out_dtype, interpret) if tiles.swap_ab else None
    if refusal:
        raise ValueError(f"mosaic GEMM: {refusal}; the staged form (swap_ab=False) computes the same")
    quant = ()
    if decode is not None:
        want = (num_experts, decode.groups, n)
        quant = (scales,) + ((zero_points,) if decode.zero_points else ())
        if weight.shape != (num_experts, n, k // PIECES) or weight.dtype != jnp.uint16:
            raise ValueError(
                f"mosaic GEMM: 4-bit codes must be uint16 {(num_experts, n, k // PIECES)}, got "
                f"{weight.dtype} {weight.shape}"
            )
        for name, array in zip(("scales", "zero_points")[: len(quant)], quant, strict=True):
            if array is None or array.shape != want or array.dtype != x.dtype:
                got = None if array is None else f"{array.dtype} {array.shape}"
                raise ValueError(f"mosaic GEMM: {name} must be {x.dtype} {want}, got {got}")
    if counts is not None:
        if m % num_experts:
            raise ValueError(f"mosaic GEMM: the grouped-masked x needs E*max_tokens rows (E={num_experts}), got {m}")
        starts, ends = masked_ranges(counts, m // num_experts)
    else:
        starts, ends = grouped_ranges(jnp.asarray([0, m], jnp.int32) if offsets is None else offsets, m)
    padded = padded_rows(m, tiles.block_m)  # a row tile's box fits inside x
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    table = row_tile_table(starts, ends, num_experts, m, tiles.block_m, pairs=tiles.cluster_m)
    row_tiles = table.shape[0]
    sms = persistent_programs(interpret)
    if bias is not None and bias.shape != (num_experts, n):
        raise ValueError(f"mosaic GEMM: bias must be [E, N] = {(num_experts, n)}, got {bias.shape}")
    extra = (bias,) if bias is not None else ()
    body = functools.partial(
        _kernel,
        tiles=tiles,
        num_experts=num_experts,
        row_tiles=row_tiles,
        decode=decode,
        has_bias=bias is not None,
        interpret=interpret,
    )
    cluster = tiles.cluster_n * tiles.cluster_m  # programs a cluster (1 or 2)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(sms // cluster,),
        grid_names=("sm",),
        **(dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        # Interpreted, fresh memory reads as NaN: a row the kernel failed to store shows.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    return kernel(table, x, weight, *quant, *extra)
