"""Elementwise helpers usable inside Pallas kernels (Triton lowering) and
in plain ``jnp`` alike — number codecs and masked-scatter indices: no gathers from values, no ``round``/``erf``
primitives (the Triton lowering has neither), powers of two built from bits.

Bit layouts are documented in ``humming_jax.numerics``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

E8M0_BIAS = 127
FLOAT8_E4M3_MAX = 448.0  # e4m3fn's largest finite value: a group's scale is its largest |value| over it
# Adding and subtracting 1.5 * 2**23 rounds an f32 of magnitude below 2**22 to
# the nearest integer, ties to even (the rounding of the addition itself).
_ROUND_MAGIC = 12582912.0
# Midpoints between neighbouring e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def round_half_even(x: jax.Array) -> jax.Array:
    """Round f32 values of magnitude below 2**22 to integers, ties to even."""
    x = x.astype(jnp.float32)
    magic = jnp.where(x < 0, -_ROUND_MAGIC, _ROUND_MAGIC).astype(jnp.float32)
    return (x + magic) - magic


def e2m1_encode(x: jax.Array) -> jax.Array:
    """Nearest e2m1 value of f32 ``x`` (ties to even, saturating at ±6) as a
    4-bit code in ``uint8``: sign in bit 3, magnitude code in bits 0-2; zero
    is always code 0 (never -0)."""
    x = x.astype(jnp.float32)
    magnitude = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.int32)
    for i, midpoint in enumerate(_E2M1_MIDPOINTS):
        # Odd i: the upper neighbour i+1 has an even code, so a tie goes up.
        crossed = magnitude >= midpoint if i % 2 else magnitude > midpoint
        code = code + crossed.astype(jnp.int32)
    # A value that rounds to zero gets code 0 whatever its sign: one zero code.
    return (code + jnp.where((x < 0) & (code > 0), 8, 0)).astype(jnp.uint8)


def pack_pairs(low: jax.Array, high: jax.Array) -> jax.Array:
    """Two arrays of 4-bit codes -> one byte each: ``low | high << 4``."""
    return (low.astype(jnp.int32) | (high.astype(jnp.int32) << 4)).astype(jnp.uint8)


def pow2(exponent: jax.Array, dtype=jnp.float32, normal_only: bool = False) -> jax.Array:
    """``2**exponent`` (int32) in ``dtype`` (f32, bf16 or f16) from its bits:
    exact down to the smallest subnormal, zero below it. ``normal_only``: the
    caller keeps ``exponent`` in the normal range (one shift, no compare and
    select: for the kernels' per-value factors)."""
    info = jnp.finfo(dtype)
    mantissa, bias = int(info.nmant), -int(info.minexp) + 1
    exponent = exponent.astype(jnp.int32)
    if normal_only:
        bits = (exponent + bias) << mantissa
    else:
        subnormal = exponent + bias - 1 + mantissa
        bits = jnp.where(
            exponent >= 1 - bias,
            (exponent + bias) << mantissa,
            jnp.where(subnormal >= 0, 1 << jnp.maximum(subnormal, 0), 0),
        )
    int_type = jnp.int16 if jnp.dtype(dtype).itemsize == 2 else jnp.int32
    return jax.lax.bitcast_convert_type(bits.astype(int_type), dtype)


E8M0_NAN = 255  # the OCP MX encoding of a NaN scale


def e8m0_decode(byte: jax.Array, exponent: int = 0, nan: bool = True) -> jax.Array:
    """Decode e8m0 scale bytes to f32 exactly: ``2**(byte - 127 + exponent)``
    (``exponent``: a power of two the caller folds in); byte 255 is NaN unless
    ``nan`` is False (for bytes the caller has bounded: no compare and select)."""
    byte = byte.astype(jnp.int32)
    value = pow2(byte + (exponent - E8M0_BIAS))
    return jnp.where(byte == E8M0_NAN, jnp.float32(jnp.nan), value) if nan else value


def e8m0_from_amax(amax: jax.Array, element_max: float) -> jax.Array:
    """The smallest power-of-two scale ``s`` with ``amax / s <= element_max``, as
    an e8m0 byte, computed exactly from the exponent and mantissa bits. A zero
    (or subnormal) ``amax`` gives the smallest scale, byte 0; a NaN one the NaN
    scale, byte 255."""
    max_exponent = math.floor(math.log2(element_max))
    max_mantissa = round((element_max / 2**max_exponent - 1) * 2**23)
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    amax_exponent = ((bits >> 23) & 0xFF) - E8M0_BIAS
    # amax = 2^a * m_a and max = 2^b * m_b with m in [1, 2): amax <= max * 2^(a-b)
    # exactly when m_a <= m_b, else one more power of two is needed.
    exponent = amax_exponent - max_exponent + ((bits & 0x7FFFFF) > max_mantissa).astype(jnp.int32)
    exponent = jnp.where(((bits >> 23) & 0xFF) > 0, exponent, -E8M0_BIAS)
    byte = jnp.clip(exponent, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    is_nan = (((bits >> 23) & 0xFF) == 0xFF) & ((bits & 0x7FFFFF) != 0)
    return jnp.where(is_nan, E8M0_NAN, byte).astype(jnp.uint8)


def cast_float8_saturating(x: jax.Array, dtype, on_gpu: bool = False) -> jax.Array:
    """Round f32 to a float8 dtype (nearest, ties to even), saturating at its
    largest finite value instead of overflowing to NaN. Inside a compiled GPU
    kernel (``on_gpu``) the conversion itself saturates (Triton emits
    ``cvt.rn.satfinite``, NaN kept NaN), so the clamp — two instructions per
    element — is left out; elsewhere (interpret mode, XLA) it is needed, and
    keeps a NaN NaN (a kernel's min/max would return the other operand)."""
    x = x.astype(jnp.float32)
    if on_gpu:
        return x.astype(dtype)
    finite_max = float(jnp.finfo(dtype).max)
    return jnp.where(x != x, x, jnp.clip(x, -finite_max, finite_max)).astype(dtype)


def fp8_token_scale_floor(element_max: float) -> float:
    """The smallest per-token fp8 scale, ``1 / (element_max * 512)`` in f32, as
    vLLM's dynamic per-token fp8 quantization clamps it (``min_scaling_factor``):
    a row whose amax is under ``1/512`` gets this scale, not ``amax / max``."""
    return float(np.float32(1.0) / np.float32(element_max * 512.0))


def floor_fp8_token_scale(scale: jax.Array, element_max: float) -> jax.Array:
    """``scale`` (f32 per-token fp8 scales) at least :func:`fp8_token_scale_floor`;
    a NaN scale stays NaN (a kernel's max would return the floor)."""
    floor = jnp.float32(fp8_token_scale_floor(element_max))
    return jnp.where(scale != scale, scale, jnp.maximum(scale, floor))


def divide(x: jax.Array, y, exact_on_gpu: bool = False) -> jax.Array:
    """``x / y`` in f32, correctly rounded. Triton lowers an f32 ``/`` to the
    approximate ``div.full.f32``; inside a compiled GPU kernel pass
    ``exact_on_gpu=True`` to emit ``div.rn.f32`` instead, so that scales and
    quantized values match the reference bit for bit."""
    x = jnp.asarray(x, jnp.float32)
    y = jnp.broadcast_to(jnp.asarray(y, jnp.float32), x.shape)
    if not exact_on_gpu:
        return divide_rn(x, y)
    (quotient,) = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, y],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return quotient


# Jitted: its two branches (the integer one 26 steps unrolled) are traced once a shape, not at every call.
@jax.jit
def divide_rn(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x / y`` in f32, correctly rounded (nearest, ties to even) whatever the
    compiler does with ``/``: XLA's f32 division on the GPU is not correctly
    rounded, so a reference there would differ from a kernel's ``div.rn`` by an
    ulp. Zeros, infinities, NaN and quotients outside the normal range take
    the plain ``/``. On the CPU, whose division is IEEE's for normal operands,
    subnormal operands are made normal first (XLA's CPU code treats them as
    zeros); elsewhere the significands are divided in integers."""
    x = jnp.asarray(x, jnp.float32)
    y = jnp.broadcast_to(jnp.asarray(y, jnp.float32), x.shape)
    # One branch is lowered for the platform compiled for (interpret-mode kernels: the CPU's).
    return jax.lax.platform_dependent(x, y, cpu=_divide_normalized, default=_divide_in_integers)


_NORMALIZE = 64  # subnormal operands are scaled by 2**64 (exact) before the division


def _normalized(v: jax.Array):
    """(v times 2**64 if subnormal else v, whether it was): the scaling built
    from the bits, since the CPU's arithmetic reads a subnormal as zero."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    mantissa = bits & 0x7FFFFF
    subnormal = ((bits >> 23) & 0xFF == 0) & (mantissa != 0)
    # A subnormal is mantissa * 2**-149; times 2**64 that is mantissa * 2**-85 (normal, exact).
    scaled = mantissa.astype(jnp.float32) * np.float32(2.0 ** (-149 + _NORMALIZE))
    return jnp.where(subnormal, jnp.where(bits < 0, -scaled, scaled), v), subnormal


def _divide_normalized(x: jax.Array, y: jax.Array) -> jax.Array:
    """Correctly rounded ``x / y`` on an IEEE division that flushes subnormals
    (XLA's CPU code): with the operands normal, the quotient rounds once, and
    the power of two that undoes their scaling is exact while it stays normal."""
    xs, x_scaled = _normalized(x)
    ys, y_scaled = _normalized(y)
    shift = (y_scaled.astype(jnp.int32) - x_scaled.astype(jnp.int32)) * _NORMALIZE  # -64, 0 or 64
    factor = jax.lax.bitcast_convert_type((shift + 127) << 23, jnp.float32)
    # The barrier hides a constant divisor: XLA would multiply by its rounded reciprocal instead.
    quotient = (xs / jax.lax.optimization_barrier(ys)) * factor
    normal = (jnp.abs(quotient) >= np.float32(2.0**-126)) & (jnp.abs(quotient) < jnp.inf)
    finite = (jnp.abs(x) < jnp.inf) & (jnp.abs(y) < jnp.inf) & (x != 0) & (y != 0)
    return jnp.where(finite & normal, quotient, x / y)


def _divide_in_integers(x: jax.Array, y: jax.Array) -> jax.Array:
    """Correctly rounded ``x / y`` from integer operations only: the
    significands divided in int32 (26 quotient bits by shifts and
    subtractions, then the remainder as the sticky bit)."""
    bx, by = (jax.lax.bitcast_convert_type(v, jnp.int32) for v in (x, y))

    def significand(bits):  # (significand with bit 23 set, unbiased exponent), subnormals normalized
        exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        mantissa = jnp.where(exponent > 0, mantissa | 0x800000, mantissa)
        shift = jnp.maximum(jax.lax.clz(mantissa) - 8, 0)
        return mantissa << shift, jnp.maximum(exponent, 1) - shift

    mx, ex = significand(bx)
    my, ey = significand(by)

    def step(_, carry):  # one quotient bit: quotient = floor(mx / my * 2**25) after 26 (25 or 26 bits)
        quotient, remainder = carry
        bit = remainder >= my
        return (quotient << 1) | bit.astype(jnp.int32), jnp.where(bit, remainder - my, remainder) << 1

    # Unrolled as the Python loop was (the same program), but its body traced once, not 26 times.
    quotient, remainder = jax.lax.fori_loop(0, 26, step, (jnp.zeros_like(mx), mx), unroll=True)
    top = quotient >= 1 << 25  # mx >= my: the quotient is in [1, 2)
    mantissa = jnp.where(top, quotient >> 2, quotient >> 1)  # 24 bits
    half = jnp.where(top, (quotient >> 1) & 1, quotient & 1)
    sticky = (remainder != 0) | (top & ((quotient & 1) == 1))
    mantissa = mantissa + (half & (sticky | ((mantissa & 1) == 1)).astype(jnp.int32))
    exponent = ex - ey + jnp.where(top, 127, 126) + (mantissa >> 24)
    mantissa = jnp.where(mantissa >> 24 > 0, mantissa >> 1, mantissa)
    sign = (bx ^ by) & jnp.int32(-(2**31))
    bits = sign | (exponent << 23) | (mantissa & 0x7FFFFF)
    exact = jax.lax.bitcast_convert_type(bits, jnp.float32)
    finite = (jnp.abs(x) < jnp.inf) & (jnp.abs(y) < jnp.inf) & (x != 0) & (y != 0)
    return jnp.where(finite & (exponent >= 1) & (exponent <= 254), exact, x / y)


def safe_reciprocal(scale: jax.Array, exact_on_gpu: bool = False) -> jax.Array:
    """``1/scale`` where ``scale > 0``, else 0: a zero scale quantizes to zero."""
    scale = scale.astype(jnp.float32)
    positive = scale > 0
    return jnp.where(positive, divide(jnp.ones_like(scale), jnp.where(positive, scale, 1.0), exact_on_gpu), 0.0)


def scatter_index(index: jax.Array, mask: jax.Array, size: int) -> jax.Array:
    """Indices for a masked scatter store: masked-out lanes point past the end.
    On the GPU the mask keeps them from touching memory; in interpret mode (a
    scatter that writes the old value back on masked lanes) an out-of-bounds
    index is dropped instead of racing with a real lane on the same address."""
    return jnp.where(mask, index, size)


def erf(x: jax.Array) -> jax.Array:
    """erf in f32 (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7): the Triton
    lowering has no erf primitive."""
    x = x.astype(jnp.float32)
    sign = jnp.where(x < 0, -1.0, 1.0)
    a = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return sign * (1.0 - poly * jnp.exp(-a * a))
