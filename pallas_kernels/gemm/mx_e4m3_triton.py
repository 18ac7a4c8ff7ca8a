"""MXFP4's e4m3 copy (W4A8 prefill) as a Triton-lowered elementwise pass:
the bytes of :func:`mx_e4m3.decoded_weight` — each code e2m1 x 2**(6 - gap),
gap the column's largest e8m0 byte less its group's (clamped at
``mx_e4m3.MAX_GAP``), rounded once to e4m3 — from plain vector loads and
stores instead of a TMA pipeline.

A program takes :data:`BLOCK_ROWS` weight columns and up to
:data:`BLOCK_UNITS` 32-column units of K. The planar codes' half h of a unit
holds column h + 8 j at position j, so the output is written as ``[..., unit,
j, h]``: four stores of 8 contiguous bytes, no shuffle. Notes:
benchmarks/notes/quantized_input.md (the forty-seventh session).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import codecs, word_decode
from pallas_kernels.gemm import mx_e4m3

BLOCK_ROWS = 32  # weight columns (N) a program
BLOCK_UNITS = 16  # 32-column units (K) a program at most: a power of two dividing K / 32
NUM_WARPS = 4
HALVES = 8  # 16-bit halves a unit (4 codes each)
POSITIONS = 4
# A placed code (sign to the f16 sign, e1 e0 m under the lowest exponent bit) is
# e2m1 x 2**-14 as an f16: times 2**(14 + E2M1_EXPONENT - gap) it is the decoded value.
PLACED_EXPONENT = 14


def _units_per_program(units: int) -> int:
    size = BLOCK_UNITS
    while units % size:
        size //= 2
    return size


def _decode_kernel(codes_ref, raw_ref, top_ref, out_ref, *, bits: tuple):
    halves = codes_ref[0]  # uint16 [rows, units, 8]
    gap = top_ref[0][:, None] - raw_ref[0].astype(jnp.int32).T  # [rows, units]
    gap = jnp.minimum(gap, mx_e4m3.MAX_GAP)
    factor = codecs.pow2(PLACED_EXPONENT + mx_e4m3.E2M1_EXPONENT - gap, jnp.float32, normal_only=True)
    for position in range(POSITIONS):
        code = word_decode.half_code(halves, position, bits)
        placed = lax.bitcast_convert_type(((code & 8) << 12) | ((code & 7) << 9), jnp.float16)
        value = placed.astype(jnp.float32) * factor[:, :, None]
        out_ref[0, :, :, position, :] = value.astype(jnp.float8_e4m3fn)


def decoded_weight(codes: jax.Array, raw: jax.Array, top: jax.Array, half_bits: bool, interpret: bool) -> jax.Array:
    """:func:`mx_e4m3.decoded_weight`'s result from the same operands (codes
    ``uint16 [E, N, K/4]``, e8m0 bytes ``uint8 [E, K/32, N]``, each column's
    largest byte ``int32 [E, N]``): e4m3 ``[E, N, K]`` in K order, the
    column's ``2**(largest - 133)`` left to the product's epilogue."""
    num_experts, n, k4 = codes.shape
    units = 4 * k4 // mx_e4m3.MX_GROUP
    if n % BLOCK_ROWS or (4 * k4) % mx_e4m3.MX_GROUP:
        raise ValueError(
            f"mx_e4m3_triton.decoded_weight: N={n} (a multiple of {BLOCK_ROWS}) and K={4 * k4} "
            f"(a multiple of {mx_e4m3.MX_GROUP}) expected"
        )
    block_units = _units_per_program(units)
    bits = word_decode.E2M1_HALF_BITS if half_bits else word_decode.NIBBLE_BITS
    out = pl.pallas_call(
        functools.partial(_decode_kernel, bits=bits),
        grid=(num_experts, n // BLOCK_ROWS, units // block_units),
        in_specs=[
            pl.BlockSpec((1, BLOCK_ROWS, block_units, HALVES), lambda e, i, u: (e, i, u, 0)),
            pl.BlockSpec((1, block_units, BLOCK_ROWS), lambda e, i, u: (e, u, i)),
            pl.BlockSpec((1, BLOCK_ROWS), lambda e, i, u: (e, i)),
        ],
        out_specs=pl.BlockSpec((1, BLOCK_ROWS, block_units, POSITIONS, HALVES), lambda e, i, u: (e, i, u, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_experts, n, units, POSITIONS, HALVES), jnp.float8_e4m3fn),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="moe_mxfp4_to_e4m3_triton",
    )(codes.reshape(num_experts, n, units, HALVES), raw, top)
    return out.reshape(num_experts, n, 4 * k4)
