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
  byte ``b`` means ``2**(b - 127)``; 255 is NaN (the scale of a group holding a NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The elementwise codecs are shared with the kernels, which cannot import this package.
from pallas_kernels.codecs import (  # noqa: F401  (re-exported)
    divide_rn,
    e2m1_encode,
    e8m0_decode,
    e8m0_from_amax,
    floor_fp8_token_scale,
    pow2,
    round_half_even,
    safe_reciprocal,
)

FLOAT8_E4M3_MAX = 448.0
FLOAT8_E5M2_MAX = 57344.0
FLOAT4_E2M1_MAX = 6.0
INT8_MAX = 127.0
INT4_MAX = 7.0
E8M0_BIAS = 127


# How each float8 dtype rounds in f32: reduce_precision's (exponent_bits,
# mantissa_bits) for its normal range, the smallest normal, and the subnormal step.
_FLOAT8_GRIDS = {
    # e4m3fn has no infinities, so its top binade (256..448) lies past the IEEE-like
    # 4-bit-exponent range: its normal values round as with 5 exponent bits.
    jnp.dtype(jnp.float8_e4m3fn): (5, 3, 2.0**-6, 2.0**-9),
    jnp.dtype(jnp.float8_e5m2): (6, 2, 2.0**-14, 2.0**-16),
}


def round_to_float8(x: jax.Array, dtype) -> jax.Array:
    """f32 ``x`` rounded to the nearest value of a float8 dtype (ties to even,
    saturating at its largest finite value), still in f32.

    Rounded with ``reduce_precision``, not an f32 -> float8 -> f32 round trip:
    XLA may drop such a pair of converts inside a fusion (it allows excess
    precision; the GPU compiler does), which would keep the unrounded value.
    Normal values round with one more exponent bit than the dtype has (the
    same mantissa); subnormal ones, which ``reduce_precision`` would flush, to
    the nearest multiple of the subnormal step."""
    dtype = jnp.dtype(dtype)
    if dtype not in _FLOAT8_GRIDS:
        raise ValueError(f"round_to_float8: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    exponent_bits, mantissa_bits, smallest_normal, step = _FLOAT8_GRIDS[dtype]
    finite_max = float(jnp.finfo(dtype).max)
    x = jnp.clip(x.astype(jnp.float32), -finite_max, finite_max)
    normal = jax.lax.reduce_precision(x, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits)
    subnormal = jnp.copysign(round_half_even(x / step) * step, x)  # exact scalings; keeps the sign of zero
    return jnp.where(jnp.abs(x) < smallest_normal, subnormal, normal)


def cast_float8_saturating(x: jax.Array, dtype) -> jax.Array:
    """Round f32 to a float8 dtype (nearest, ties to even), saturating at its
    largest finite value instead of overflowing to NaN. The same numbers as the
    kernels' ``codecs.cast_float8_saturating``, but safe to convert back to f32
    inside one XLA computation (see :func:`round_to_float8`)."""
    return round_to_float8(x, dtype).astype(dtype)


# Magnitudes of the eight non-negative e2m1 codes, in code order.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


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


def e2m1_decode(code: jax.Array) -> jax.Array:
    """Decode 4-bit e2m1 codes (``uint8``, 0..15) to float32."""
    code = code.astype(jnp.int32)
    magnitude = jnp.asarray(E2M1_MAGNITUDES)[code & 7]
    return jnp.where(code >= 8, -magnitude, magnitude)


def block_broadcast(scale: jax.Array, shape: tuple[int, ...], blocks: tuple[int, ...] | None = None) -> jax.Array:
    """Expand a blockwise array to ``shape`` by repeating each entry over its block.

    ``scale.shape[i]`` entries cover ``shape[i]`` elements in blocks of
    ``blocks[i]`` (default ``ceil(shape[i] / scale.shape[i])``); the last block
    may be partial.
    """
    if scale.ndim != len(shape):
        raise ValueError(f"block_broadcast: rank {scale.ndim} scale for a rank {len(shape)} array")
    out = scale
    for axis, (n_blocks, n) in enumerate(zip(scale.shape, shape, strict=True)):
        if n_blocks == n and (blocks is None or blocks[axis] == 1):
            continue
        block = -(-n // n_blocks) if blocks is None else blocks[axis]
        if -(-n // block) != n_blocks:
            raise ValueError(f"block_broadcast: {n_blocks} blocks of {block} along axis {axis} for {n} elements")
        out = jnp.repeat(out, block, axis=axis, total_repeat_length=n_blocks * block)
        out = jax.lax.slice_in_dim(out, 0, n, axis=axis)
    return out
