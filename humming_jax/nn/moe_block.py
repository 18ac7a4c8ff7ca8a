"""``MoEBlock``: router + experts (+ optional shared expert), to drop into a Flax model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

SCORING = ("softmax", "sigmoid")


def route(
    logits: jax.Array,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of ``logits [T, E]`` (f32): ``(topk_weights [T, k] f32, topk_ids [T, k] int32)``.

    ``softmax`` (Mixtral, Qwen3) or ``sigmoid`` (DeepSeek-V3) scores; an
    optional ``correction_bias [E]`` shifts the choice but not the weights
    (DeepSeek-V3's aux-loss-free balancing); ``renormalize`` makes the k
    weights of a token sum to one.
    """
    if scoring not in SCORING:
        raise ValueError(f"route: scoring: expected one of {SCORING}, got {scoring!r}")
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    _, topk_ids = jax.lax.top_k(choice, top_k)
    topk_weights = jnp.take_along_axis(scores, topk_ids, axis=-1)
    if renormalize:
        topk_weights = topk_weights / jnp.maximum(topk_weights.sum(-1, keepdims=True), 1e-20)
    return topk_weights, topk_ids.astype(jnp.int32)


class SharedExpert(nnx.Module):
    """A gated SiLU MLP applied to every token (DeepSeek/Qwen2-MoE shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)  # noqa: E731
        self.gate = linear(hidden_size, intermediate_size)
        self.up = linear(hidden_size, intermediate_size)
        self.down = linear(intermediate_size, hidden_size)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class MoEBlock(nnx.Module):
    """Router + one of the Humming expert modules + optional shared expert.

    ``experts`` is a ``HummingGroupedExperts`` or ``HummingIndexedExperts``;
    the router is a bias-free linear ``[H, E_global]`` in f32. Input ``[..., H]``
    -> output of the same shape and dtype.
    """

    def __init__(
        self,
        experts: nnx.Module,
        *,
        rngs: nnx.Rngs,
        scoring: str = "softmax",
        renormalize: bool = True,
        shared_intermediate_size: int | None = None,
        correction_bias: bool = False,
    ):
        config = experts.config
        if scoring not in SCORING:
            raise ValueError(f"MoEBlock: scoring: expected one of {SCORING}, got {scoring!r}")
        self.experts = experts
        self.scoring, self.renormalize, self.top_k = scoring, renormalize, config.top_k
        self.router = nnx.Linear(
            config.hidden_size, config.global_num_experts, use_bias=False, param_dtype=jnp.float32, rngs=rngs
        )
        self.correction_bias = nnx.Param(jnp.zeros(config.global_num_experts, jnp.float32)) if correction_bias else None
        self.shared = (
            SharedExpert(config.hidden_size, shared_intermediate_size, rngs=rngs, dtype=jnp.dtype(config.compute_dtype))
            if shared_intermediate_size
            else None
        )

    def __call__(self, x: jax.Array, expert_map: jax.Array | None = None) -> jax.Array:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        bias = None if self.correction_bias is None else self.correction_bias.get_value()
        topk_weights, topk_ids = route(
            self.router(tokens.astype(jnp.float32)), self.top_k, self.scoring, self.renormalize, bias
        )
        out = self.experts(tokens, topk_weights, topk_ids, expert_map=expert_map)
        if self.shared is not None:
            out = out + self.shared(tokens).astype(out.dtype)
        return out.reshape(shape).astype(x.dtype)
