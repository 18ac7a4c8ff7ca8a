"""Expert activations (DESIGN §3.3), computed in float32.

Gated forms take ``[M, N]`` with gate = first half and up = second half
(SWIGLUOAI: interleaved ``[g0, u0, g1, u1, ...]``) and return ``[M, N/2]``;
with ``gate_up_block`` c the halves are interleaved by blocks of c columns
(``[g_0..g_{c-1}, u_0..u_{c-1}, g_c, ...]``: the order a GEMM tile of ``2c``
columns needs to apply the activation in its epilogue, see
:func:`humming_jax.formats.interleave_gate_up`). The ``_NO_MUL`` forms act on
the whole row and return ``[M, N]``.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp


class Activation(enum.StrEnum):
    """The activations of vLLM's fused MoE, by their vLLM names.

    Attributes:
        SILU, GELU, GELU_TANH: gated, ``act(gate) · up`` (an ``[M, 2I]`` input
            gives ``[M, I]``).
        SWIGLUOAI: gpt-oss's clamped gated SiLU with ``alpha``, ``beta``.
        SWIGLUSTEP: the clamped gated SiLU with a step limit.
        SILU_NO_MUL, GELU_NO_MUL, GELU_TANH_NO_MUL, RELU2_NO_MUL: not gated,
            the activation alone (``[M, I]`` gives ``[M, I]``).
    """

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    SWIGLUOAI = "swigluoai"
    SWIGLUSTEP = "swiglustep"
    SILU_NO_MUL = "silu_no_mul"
    GELU_NO_MUL = "gelu_no_mul"
    GELU_TANH_NO_MUL = "gelu_tanh_no_mul"
    RELU2_NO_MUL = "relu2_no_mul"

    @property
    def is_gated(self) -> bool:
        return not self.value.endswith("_no_mul")


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """An activation with its constants.

    Attributes:
        kind: the :class:`Activation` (a name is converted).
        clamp_limit: SILU: ``min(g, L)`` and ``clamp(u, ±L)``; SWIGLUOAI and
            SWIGLUSTEP: their limit (default 7); None: no clamp.
        alpha: SWIGLUOAI's sigmoid scale (default 1.702).
        beta: SWIGLUOAI's offset on ``u`` (default 1).
        gate_up_block: 0: gate = the first half of the input, up = the second
            (SWIGLUOAI: pairs); c > 0 (gated kinds but SWIGLUOAI): gate and up
            interleaved by blocks of c columns, as w13's rows are stored by
            :func:`humming_jax.formats.interleave_gate_up`.
    """

    kind: Activation = Activation.SILU
    clamp_limit: float | None = None
    alpha: float = 1.702
    beta: float = 1.0
    gate_up_block: int = 0

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", Activation(self.kind))
        except ValueError:
            allowed = ", ".join(repr(a.value) for a in Activation)
            raise ValueError(f"ActivationSpec.kind: got {self.kind!r}, expected one of {allowed}") from None
        if self.kind == Activation.SWIGLUOAI and self.clamp_limit is None:
            object.__setattr__(self, "clamp_limit", 7.0)
        if self.kind == Activation.SWIGLUSTEP and self.clamp_limit is None:
            object.__setattr__(self, "clamp_limit", 7.0)
        block = self.gate_up_block
        if not isinstance(block, int) or isinstance(block, bool) or block < 0:
            raise ValueError(f"ActivationSpec.gate_up_block: expected a non-negative int, got {block!r}")
        if block and not self.interleaves:
            raise ValueError(
                f"ActivationSpec.gate_up_block: {self.kind.value!r} reads its input in its own order "
                f"(blocks of gate and up columns are for silu, gelu, gelu_tanh and swiglustep), got {block}"
            )
        if self.clamp_limit is not None:
            if self.kind not in (Activation.SILU, Activation.SWIGLUOAI, Activation.SWIGLUSTEP):
                raise ValueError(
                    f"ActivationSpec.clamp_limit: only silu, swigluoai and swiglustep take a clamp, "
                    f"not {self.kind.value!r}"
                )
            if not (self.clamp_limit > 0 and math.isfinite(self.clamp_limit)):
                raise ValueError(
                    f"ActivationSpec.clamp_limit: expected a positive finite limit, got {self.clamp_limit}"
                )

    @property
    def is_gated(self) -> bool:
        return self.kind.is_gated

    @property
    def interleaves(self) -> bool:
        """Whether the kind may read gate and up interleaved by blocks (``gate_up_block``)."""
        return self.is_gated and self.kind != Activation.SWIGLUOAI

    def output_width(self, n: int) -> int:
        """Width of the activation output for an ``[M, n]`` gate/up input."""
        if self.is_gated:
            if n % 2:
                raise ValueError(f"activation {self.kind.value!r}: gated input width must be even, got {n}")
            if self.gate_up_block and n % (2 * self.gate_up_block):
                raise ValueError(
                    f"activation {self.kind.value!r}: an input of {n} columns is not a whole number of "
                    f"gate/up block pairs (gate_up_block={self.gate_up_block})"
                )
            return n // 2
        return n


def get_activation(activation: str | Activation | ActivationSpec | None) -> ActivationSpec | None:
    """The :class:`ActivationSpec` of a name, an :class:`Activation` or a spec.

    Args:
        activation: a name (``"silu"``), an :class:`Activation`, a spec or None.

    Returns:
        The spec with default constants, or None for None.
    """
    if activation is None or isinstance(activation, ActivationSpec):
        return activation
    return ActivationSpec(activation)


def split_gate_up(x: jax.Array, spec: ActivationSpec) -> tuple[jax.Array, jax.Array]:
    """(gate, up), each ``[..., N/2]``, of a gated activation's input ``x [..., N]``
    in ``spec``'s order (halves, SWIGLUOAI's pairs, or blocks of ``gate_up_block``)."""
    if spec.kind == Activation.SWIGLUOAI:
        return x[..., 0::2], x[..., 1::2]
    block = spec.gate_up_block
    if block:
        pairs = x.reshape(*x.shape[:-1], x.shape[-1] // (2 * block), 2, block)
        half = (*x.shape[:-1], x.shape[-1] // 2)
        return pairs[..., 0, :].reshape(half), pairs[..., 1, :].reshape(half)
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def apply_activation(x: jax.Array, activation: ActivationSpec | str | Activation) -> jax.Array:
    """Apply an activation in float32.

    Args:
        x: ``[..., N]``; gated activations read the gate and up columns in
            the spec's order (:func:`split_gate_up`).
        activation: a name, an :class:`Activation` or an :class:`ActivationSpec`.

    Returns:
        float32 ``[..., N/2]`` (gated) or ``[..., N]`` (``*_no_mul``).
    """
    spec = get_activation(activation)
    spec.output_width(x.shape[-1])
    x = x.astype(jnp.float32)
    kind = spec.kind
    if kind == Activation.SILU_NO_MUL:
        return jax.nn.silu(x)
    if kind == Activation.GELU_NO_MUL:
        return jax.nn.gelu(x, approximate=False)
    if kind == Activation.GELU_TANH_NO_MUL:
        return jax.nn.gelu(x, approximate=True)
    if kind == Activation.RELU2_NO_MUL:
        return jnp.square(jax.nn.relu(x))

    gate, up = split_gate_up(x, spec)
    limit = spec.clamp_limit
    if kind == Activation.SILU:
        if limit is not None:
            gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return jax.nn.silu(gate) * up
    if kind == Activation.GELU:
        return jax.nn.gelu(gate, approximate=False) * up
    if kind == Activation.GELU_TANH:
        return jax.nn.gelu(gate, approximate=True) * up
    if kind == Activation.SWIGLUOAI:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(spec.alpha * gate) * (up + spec.beta)
    # SWIGLUSTEP
    return jnp.minimum(jax.nn.silu(gate), limit) * jnp.clip(up, -limit, limit)
