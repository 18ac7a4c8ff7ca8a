"""The activations' element-wise math as the kernels compute it (in f32):
shared by ``process_input``'s kernel and the GEMM
kernel that applies the activation to its input as it loads it, so that both
give the same bits."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels import codecs


@dataclasses.dataclass(frozen=True)
class Activation:
    """Static description of an activation (``humming_jax.activations``'
    kinds by name): gated ones read a gate and an up column per output column,
    ``*_no_mul`` ones one column; ``swigluoai`` interleaves them
    (``[g0, u0, g1, u1, ...]``), the others take the gate from the first half."""

    kind: str
    clamp_limit: float | None = None
    alpha: float = 1.702
    beta: float = 1.0

    @property
    def gated(self) -> bool:
        return not self.kind.endswith("_no_mul")

    @property
    def interleaved(self) -> bool:
        return self.kind == "swigluoai"


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def gelu(x):
    return 0.5 * x * (1.0 + codecs.erf(x * (1.0 / math.sqrt(2.0))))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def ungated(x, act: Activation):
    """A ``*_no_mul`` activation of f32 ``x``."""
    return {
        "silu_no_mul": lambda v: v * sigmoid(v),
        "gelu_no_mul": gelu,
        "gelu_tanh_no_mul": gelu_tanh,
        "relu2_no_mul": lambda v: jnp.square(jnp.maximum(v, 0.0)),
    }[act.kind](x)


def gated(gate, up, act: Activation):
    """A gated activation of f32 ``gate`` and ``up`` (same shape); zero where both are zero."""
    kind, limit = act.kind, act.clamp_limit
    if kind == "swigluoai":
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * sigmoid(act.alpha * gate) * (up + act.beta)
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
