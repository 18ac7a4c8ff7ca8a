"""MXFP4 (e2m1 codes, e8m0 scales per 32 columns, planar units of 32) as e4m3
for the fp8 tensor cores (W4A8): each group's e2m1 x 2**(6 - gap), gap the
column's largest scale byte less the group's (exact up to a gap of 14;
groups further below round towards zero, as Humming's load-time clip at 11
does), the column's 2**(largest - 133) left to the product's epilogue.

Two users of one decode: the fp8 Mosaic kernel's compute warpgroups decode a
K step in the loop (:func:`decode_step`, ``mosaic_fp8``), and for many rows
an expert a pass decodes the whole weight once a call into an e4m3 copy
(:func:`decoded_weight`, a Mosaic kernel of its own) that the fp8 kernel
then multiplies as W8A8 with a scale per column (``mosaic_fp8.Tiles.
dequantize_first``). Notes: benchmarks/notes/quantized_input.md (v47).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import codecs, word_decode
from pallas_kernels.gemm import mosaic

BLOCK_K = 128  # the fp8 kernel's K step: one 128-byte swizzled row of e4m3
MX_GROUP = 32  # MXFP4's scale group and planar unit: one decoded piece (a factor each)
PIECES = BLOCK_K // MX_GROUP
# Decoded e2m1 values are e2m1 x 2**(E2M1_EXPONENT - gap): the largest (6 x 64 = 384)
# under e4m3's 448, the smallest of a gap of 14 (0.5 x 2**-8) e4m3's smallest subnormal.
E2M1_EXPONENT = 6
MAX_GAP = 24  # larger gaps are clamped here (their values round to zero in e4m3 either way)
E8M0_NAN = 255


def step_factor(raw, top):
    """A piece's f16 factor ``2**(12 - gap)`` from its e8m0 bytes and its
    columns' largest (int32), made from the f16 bits (the gap clamped at
    :data:`MAX_GAP`: never subnormal)."""
    gap = jnp.minimum(top - raw.astype(jnp.int32), MAX_GAP)
    return codecs.pow2(2 * E2M1_EXPONENT - gap, jnp.float16, normal_only=True)


def _piece_values(codes, scales, wg_slice, piece: int, half_bits: bool, interpret: bool):
    """Unit ``piece`` of a K step's MXFP4 codes as e2m1 x 2**-6
    (:func:`mosaic.e2m1_piece`) times its factor (:func:`step_factor` of
    ``scales``: the step's bytes ``[4, block_n]`` in shared memory and the
    columns' largest ``[rows]``), before its rounding to e4m3."""
    byte_smem, top = scales
    bits = word_decode.E2M1_HALF_BITS if half_bits else word_decode.NIBBLE_BITS
    factor = step_factor(byte_smem[piece, wg_slice], top)[:, None]
    # Interpreted in f32: XLA's CPU code misrounds some f16 products to e4m3.
    factor = factor.astype(jnp.float32) if interpret else factor
    return mosaic.e2m1_piece(codes, piece, bits, jnp.float16, interpret) * factor


def decode_step(codes, scales, wg_slice, half_bits: bool, interpret: bool):
    """A K step's columns from its MXFP4 codes ``uint16 [rows, 32]`` as e4m3
    ``[rows, 128]``: each unit's values (:func:`_piece_values`), the units
    joined in column order."""
    pieces = [_piece_values(codes, scales, wg_slice, piece, half_bits, interpret) for piece in range(PIECES)]
    return mosaic.join_columns(pieces, interpret).astype(jnp.float8_e4m3fn)


def decode_piece(codes, scales, wg_slice, piece: int, half_bits: bool):
    """Piece ``piece`` (columns ``[32 piece, 32 piece + 32)``) of a K step's
    MXFP4 codes as :func:`decode_step` decodes it, in the 8-bit WGMMA layout
    (one fp8 wgmma's register operand; a unit's code at half h, position j in
    column ``mosaic_fp8.fragment_column(h, j)``). Compiled only."""
    decoded = _piece_values(codes, scales, wg_slice, piece, half_bits, False).astype(jnp.float8_e4m3fn)
    return mosaic.eight_bit_fragments(decoded)


def mx_operands(values: jax.Array, scale: jax.Array, k_major: bool = False) -> tuple[jax.Array, ...]:
    """MXFP4's stored parts (planar codes ``uint8 [E, N, K/2]``, e8m0 bytes
    ``[E, N, K/32]``, or ``[E, K/32, N]`` when ``k_major``) as the kernel reads
    them: codes ``uint16 [E, N, K/4]``; the bytes ``[E, K/32, N]`` (each
    piece's factor :func:`step_factor` is made from them in the kernel); each
    column's largest byte, int32 ``[E, N]``; per column f32 ``2**(largest -
    133)`` ``[E, N]`` (NaN where a byte is 255). Per call only a reduction
    over the bytes (and, for ``[E, N, K/32]`` bytes, their transpose)."""
    codes = mosaic.planar_words(values)
    raw = scale if k_major else jnp.swapaxes(scale, 1, 2)
    top = jnp.max(raw, axis=1).astype(jnp.int32)
    columns = codecs.pow2(top - 127 - E2M1_EXPONENT, jnp.float32)
    columns = jnp.where(top == E8M0_NAN, jnp.nan, columns)
    return codes, raw, top, columns


DECODE_ROWS = 64  # decoded_weight's rows a program: the WGMMA layout's rows of one warpgroup
DECODE_STAGES = 3  # its loads in flight, and its decoded steps being stored
DECODE_STEPS = 4  # the 128-column K steps one load brings (longer runs of each row's bytes)


def decode_steps(k: int) -> int:
    """K steps a load of ``decoded_weight`` brings for K = ``k``: the largest
    power of two dividing ``k / 128``, up to :data:`DECODE_STEPS` (three-step
    loads ran slower than two-step ones)."""
    steps = 1
    while steps * 2 <= DECODE_STEPS and (k // BLOCK_K) % (steps * 2) == 0:
        steps *= 2
    return steps


def _decode_kernel(codes_gmem, byte_gmem, top_gmem, out_gmem, *, steps: int, half_bits: bool, interpret: bool):
    expert, chunk = lax.axis_index("expert"), lax.axis_index("chunk")
    rows = pl.ds(pl.multiple_of(chunk * DECODE_ROWS, DECODE_ROWS), DECODE_ROWS)
    top = plgpu.load(top_gmem.at[expert, rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    transforms = () if interpret else mosaic.swizzled(BLOCK_K, jnp.float8_e4m3fn)
    slots = plgpu.SMEM((DECODE_STAGES, DECODE_ROWS, BLOCK_K), jnp.float8_e4m3fn, transforms=transforms)

    @functools.partial(pl.run_scoped, out_slots=slots)
    def _(out_slots):
        def step(indices, codes_smem, byte_smem):
            (load,) = indices
            for j in range(steps):  # the load's K steps, each decoded into a slot and stored
                k_step = load * steps + j
                slot = out_slots.at[lax.rem(k_step, DECODE_STAGES)]
                plgpu.wait_smem_to_gmem(DECODE_STAGES - 1, wait_read_only=True)  # the slot's last copy has read it
                codes = codes_smem[:, pl.ds(j * (BLOCK_K // 4), BLOCK_K // 4)]
                scales = (byte_smem.at[pl.ds(j * PIECES, PIECES)], top)
                slot[...] = decode_step(codes, scales, pl.ds(0, DECODE_ROWS), half_bits, interpret)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(slot, out_gmem.at[expert, rows, pl.ds(k_step * BLOCK_K, BLOCK_K)])

        plgpu.emit_pipeline(
            step,
            grid=(codes_gmem.shape[2] // (steps * BLOCK_K // 4),),
            in_specs=[
                plgpu.BlockSpec((DECODE_ROWS, steps * BLOCK_K // 4), lambda i: (0, i)),
                plgpu.BlockSpec((steps * PIECES, DECODE_ROWS), lambda i: (i, 0)),
            ],
            max_concurrent_steps=DECODE_STAGES,
        )(codes_gmem.at[expert, rows], byte_gmem.at[expert, :, rows])
        plgpu.wait_smem_to_gmem(0)


def decoded_weight(codes: jax.Array, raw: jax.Array, top: jax.Array, half_bits: bool, interpret: bool) -> jax.Array:
    """MXFP4 as :func:`mx_operands` gives it (codes ``uint16 [E, N, K/4]``, e8m0
    bytes ``[E, K/32, N]``, each column's largest int32 ``[E, N]``) decoded
    to e4m3 ``[E, N, K]`` in K order: each group's e2m1 x 2**(6 - gap), the
    bytes the in-kernel decoders make (:func:`decode_step`); the column's
    ``2**(largest - 133)`` is left to the product's epilogue. One Mosaic
    kernel, :data:`DECODE_ROWS` columns a program, pipelined along K
    (:func:`decode_steps` K steps a load)."""
    num_experts, n, k4 = codes.shape
    if n % DECODE_ROWS:
        raise ValueError(f"mx_e4m3.decoded_weight: N={n}, not a multiple of {DECODE_ROWS}")
    kernel = plgpu.kernel(
        functools.partial(_decode_kernel, steps=decode_steps(4 * k4), half_bits=half_bits, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((num_experts, n, 4 * k4), jnp.float8_e4m3fn),
        grid=(num_experts, n // DECODE_ROWS),
        grid_names=("expert", "chunk"),
        kernel_name="moe_mxfp4_to_e4m3",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    return kernel(codes, raw, top)
