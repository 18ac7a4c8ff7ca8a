"""Index arithmetic for Triton-lowered kernels.

jnp's floor division and remainder add sign fix-up selects; on index vectors
those hide from Triton's analysis that runs of indices stay contiguous and
aligned, and the loads they address fall from 16-byte vectors to scalars.
Offsets and columns are never negative, so truncated division is the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def nonneg_div(value, by: int):
    """``value // by`` for non-negative ``value`` (int32), without the sign fix-up."""
    return jax.lax.div(value, jnp.int32(by))


def nonneg_rem(value, by: int):
    """``value % by`` for non-negative ``value`` (int32), without the sign fix-up."""
    return jax.lax.rem(value, jnp.int32(by))
