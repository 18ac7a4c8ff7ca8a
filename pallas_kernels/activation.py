"""The expert activations in f32 as kernel code (Triton-lowerable ``jnp``):
the math ``process_input``'s kernel and the GEMM tiles that apply the
activation in their epilogue share. The definitions: ``humming_jax.activations``."""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import codecs


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def gelu(x):
    return 0.5 * x * (1.0 + codecs.erf(x * (1.0 / math.sqrt(2.0))))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


UNGATED = {
    "silu_no_mul": lambda v: v * sigmoid(v),
    "gelu_no_mul": gelu,
    "gelu_tanh_no_mul": gelu_tanh,
    "relu2_no_mul": lambda v: jnp.square(jnp.maximum(v, 0.0)),
}


def ungated(kind: str, x):
    """``act(x)`` of a ``*_no_mul`` kind, f32."""
    return UNGATED[kind](x)


def gated(kind: str, gate, up, limit: float | None, alpha: float, beta: float):
    """``act(gate) · up`` of a gated kind (``limit``, ``alpha``, ``beta``: the
    :class:`~humming_jax.activations.ActivationSpec`'s constants), f32."""
    if kind == "swigluoai":
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * sigmoid(alpha * gate) * (up + beta)
    if kind == "silu":
        if limit is not None:
            gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * sigmoid(gate) * up
    if kind == "gelu":
        return gelu(gate) * up
    if kind == "gelu_tanh":
        return gelu_tanh(gate) * up
    if kind == "swiglustep":
        return jnp.minimum(gate * sigmoid(gate), limit) * jnp.clip(up, -limit, limit)
    raise ValueError(f"unknown activation {kind!r}")
