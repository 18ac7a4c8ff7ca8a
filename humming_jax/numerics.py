"""Low-level numeric codecs shared by weight and activation quantization.

Everything here is elementwise `jnp` and safe inside `jit` and Pallas kernels.

Storage conventions (documented once, used everywhere):

* **4-bit packing.** Two 4-bit codes per ``uint8`` along the last axis:
  byte ``j`` holds element ``2j`` in its low nibble and element ``2j+1`` in its
  high nibble. A packed array's last dimension is half the logical one.
* **int4 codes** are stored *biased*: the nibble is ``q + 8`` for ``q`` in
  ``[-8, 7]`` (so a nibble read as unsigned is ``q + 8``; GPTQ uses the same
  offset). ``uint4`` codes are stored as they are (``0..15``).
* **float4 e2m1 codes**: bit 3 is the sign, bits 2-1 the exponent (bias 1),
  bit 0 the mantissa; magnitudes ``0, .5, 1, 1.5, 2, 3, 4, 6``.
* **e8m0 scales** are stored as their raw biased-exponent byte (``uint8``):
  byte ``b`` means ``2**(b - 127)``; 255 (NaN) is never produced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT8_E4M3_MAX = 448.0
FLOAT8_E5M2_MAX = 57344.0
FLOAT4_E2M1_MAX = 6.0
INT8_MAX = 127.0
INT4_MAX = 7.0
E8M0_BIAS = 127

# Magnitudes of the eight non-negative e2m1 codes, in code order.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# Midpoints between neighbouring magnitudes. Crossing midpoint i moves the code
# from i to i+1; on an exact tie round-to-nearest-even keeps the even code.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Pack 4-bit codes ``uint8 [..., K]`` (values 0..15) into ``uint8 [..., K/2]``.

    K must be even. Low nibble = element 2j, high nibble = element 2j+1.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: the last dimension must be even for 4-bit packing, got {codes.shape[-1]}")
    codes = codes.astype(jnp.uint8)
    low = codes[..., 0::2] & 0xF
    high = codes[..., 1::2] & 0xF
    return low | (high << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: ``uint8 [..., K/2]`` -> ``uint8 [..., K]``."""
    packed = packed.astype(jnp.uint8)
    low = packed & 0xF
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def round_half_even(x: jax.Array) -> jax.Array:
    """Round to the nearest integer, ties to even (what the hardware cvt.rni does)."""
    return jnp.round(x)


def e2m1_encode(x: jax.Array) -> jax.Array:
    """Round float32 ``x`` to the nearest e2m1 value (ties to even, saturating at
    ±6) and return its 4-bit code as ``uint8``."""
    x = x.astype(jnp.float32)
    magnitude = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.uint8)
    for i, midpoint in enumerate(_E2M1_MIDPOINTS):
        # Odd i: the upper neighbour i+1 is even, so a tie goes up.
        crossed = magnitude >= midpoint if i % 2 else magnitude > midpoint
        code = code + crossed.astype(jnp.uint8)
    sign = jnp.where(x < 0, jnp.uint8(8), jnp.uint8(0))
    return code | sign


def e2m1_decode(code: jax.Array) -> jax.Array:
    """Decode 4-bit e2m1 codes (``uint8``, 0..15) to float32."""
    code = code.astype(jnp.int32)
    magnitude = jnp.asarray(E2M1_MAGNITUDES)[code & 7]
    return jnp.where(code >= 8, -magnitude, magnitude)


def e8m0_decode(byte: jax.Array) -> jax.Array:
    """Decode e8m0 scale bytes to float32 exactly: ``2**(byte - 127)``.

    Built from the bits (the byte is the f32 exponent field) rather than with
    ``exp2``, which is approximate on some backends. Byte 0 is the f32
    subnormal 2**-127 (bit pattern 0x00400000)."""
    bits = byte.astype(jnp.uint32) << 23
    bits = jnp.where(bits == 0, jnp.uint32(0x00400000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def e8m0_from_amax(amax: jax.Array, element_max: float) -> jax.Array:
    """The smallest power-of-two scale ``s`` with ``amax / s <= element_max``, as an
    e8m0 byte. A zero ``amax`` gives the smallest scale (byte 0)."""
    amax = amax.astype(jnp.float32)
    safe = jnp.where(amax > 0, amax, 1.0)
    exponent = jnp.ceil(jnp.log2(safe / element_max))
    # log2 can land a hair under an exact power of two: fix up so amax/s <= max.
    exponent = jnp.where(safe / jnp.exp2(exponent) > element_max, exponent + 1, exponent)
    exponent = jnp.where(amax > 0, exponent, -E8M0_BIAS)
    exponent = jnp.clip(exponent, -E8M0_BIAS, E8M0_BIAS)
    return (exponent + E8M0_BIAS).astype(jnp.uint8)


def cast_float8_saturating(x: jax.Array, dtype) -> jax.Array:
    """Round float32 to a float8 dtype (round-to-nearest-even), saturating at its
    largest finite value instead of overflowing to NaN."""
    finite_max = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32), -finite_max, finite_max).astype(dtype)


def safe_reciprocal(scale: jax.Array) -> jax.Array:
    """``1/scale`` where ``scale > 0``, else 0: a zero scale quantizes to zero
    instead of producing NaN or Inf."""
    scale = scale.astype(jnp.float32)
    return jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)


def block_broadcast(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Expand a blockwise array to ``shape`` by repeating each entry over its block.

    ``scale.shape[i]`` entries cover ``shape[i]`` elements in equal blocks of
    ``ceil(shape[i] / scale.shape[i])`` (the last block may be partial).
    """
    if scale.ndim != len(shape):
        raise ValueError(f"block_broadcast: rank {scale.ndim} scale for a rank {len(shape)} array")
    out = scale
    for axis, (n_blocks, n) in enumerate(zip(scale.shape, shape, strict=True)):
        if n_blocks == n:
            continue
        block = -(-n // n_blocks)
        out = jnp.repeat(out, block, axis=axis, total_repeat_length=n_blocks * block)
        out = jax.lax.slice_in_dim(out, 0, n, axis=axis)
    return out
