"""``MoEBlock``: router + experts (+ optional shared expert), to drop into a Flax model."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from humming_jax import checkpoints, routing
from humming_jax.configs import is_count
from humming_jax.experts import check_num_valid_tokens, estimate_valid_shape_m
from humming_jax.nn.experts import (
    BatchedHummingGroupedExperts,
    ExpertParallelExperts,
    HummingGroupedExperts,
    MoonEPExperts,
)

SCORING = ("softmax", "sigmoid")


def check_routing(
    num_experts: int, top_k: int, scoring: str, num_groups: int, topk_groups: int | None, op: str = "route"
) -> int:
    """Check routing arguments (as :func:`route` takes them).

    Args:
        num_experts: E, global.
        top_k: experts per token.
        scoring: ``"softmax"`` or ``"sigmoid"``.
        num_groups: expert groups (a divisor of E).
        topk_groups: groups a token may choose from; None: all.
        op: the caller's name, for the message.

    Returns:
        ``topk_groups`` (all groups when None).

    Raises:
        ValueError: naming ``op``, the argument and what was expected.
    """
    if scoring not in SCORING:
        raise ValueError(f"{op}: scoring: expected one of {SCORING}, got {scoring!r}")
    topk_groups = num_groups if topk_groups is None else topk_groups
    if not is_count(top_k, 1) or top_k > num_experts:
        raise ValueError(f"{op}: top_k: expected 1..{num_experts} (the experts), got {top_k!r}")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"{op}: num_groups: expected a divisor of the {num_experts} experts, got {num_groups}")
    if not 1 <= topk_groups <= num_groups or top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(
            f"{op}: topk_groups: expected 1..{num_groups} groups holding at least top_k={top_k} experts, "
            f"got {topk_groups}"
        )
    return topk_groups


def route(
    logits: jax.Array,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: jax.Array | None = None,
    num_groups: int = 1,
    topk_groups: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of ``logits [T, E]`` (f32): ``(topk_weights [T, k] f32, topk_ids [T, k] int32)``.

    Args:
        logits: router outputs ``[T, E]``.
        top_k: experts per token.
        scoring: ``softmax`` (Mixtral, Qwen3, gpt-oss) or ``sigmoid`` (DeepSeek-V3) scores.
        renormalize: make the k weights of a token sum to one.
        correction_bias: ``[E]``, shifts the choice but not the weights
            (DeepSeek-V3's aux-loss-free balancing).
        num_groups, topk_groups: group-limited choice (DeepSeek-V3's ``n_group``,
            ``topk_group``): the experts split into ``num_groups`` equal groups,
            each scored by its best expert (the sum of its best two when there
            is a correction bias, as vLLM and transformers do); the token picks
            its experts inside its ``topk_groups`` best groups only.
        routed_scaling_factor: multiplies the final weights (DeepSeek-V3: 2.5).

    Returns:
        ``(topk_weights [T, k] f32, topk_ids [T, k] int32)``.
    """
    num_experts = logits.shape[-1]
    topk_groups = check_routing(num_experts, top_k, scoring, num_groups, topk_groups)
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if topk_groups < num_groups:
        grouped = choice.reshape(*choice.shape[:-1], num_groups, num_experts // num_groups)
        best = jax.lax.top_k(grouped, 2)[0].sum(-1) if correction_bias is not None else grouped.max(-1)
        _, kept = jax.lax.top_k(best, topk_groups)
        in_kept = jnp.any(jnp.arange(num_groups)[None, :, None] == kept[:, None, :], axis=-1)  # [T, groups]
        choice = jnp.where(jnp.repeat(in_kept, num_experts // num_groups, axis=-1), choice, -jnp.inf)
    _, topk_ids = jax.lax.top_k(choice, top_k)
    topk_weights = jnp.take_along_axis(scores, topk_ids, axis=-1)
    if renormalize:
        topk_weights = topk_weights / jnp.maximum(topk_weights.sum(-1, keepdims=True), 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * jnp.float32(routed_scaling_factor)
    return topk_weights, topk_ids.astype(jnp.int32)


class SharedExpert(nnx.Module):
    """A gated SiLU MLP applied to every token (DeepSeek/Qwen2-MoE shared expert).

    Args:
        hidden_size: H.
        intermediate_size: the MLP's width.
        rngs: its random weights.
        dtype: the weights' and the computation's dtype.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)  # noqa: E731
        self.gate = linear(hidden_size, intermediate_size)
        self.up = linear(hidden_size, intermediate_size)
        self.down = linear(intermediate_size, hidden_size)

    def __call__(self, x):
        """Apply the MLP.

        Args:
            x: ``[..., H]``.

        Returns:
            ``[..., H]``.
        """
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def _batched_experts(experts: BatchedHummingGroupedExperts, tokens, topk_weights, topk_ids):
    """Dispatch tokens into ``[E, max_tokens, H]``, run, and do the weighted top-k reduce."""
    num_experts = experts.config.num_experts
    capacity = experts.max_num_tokens * experts.num_dispatchers
    if tokens.shape[0] > capacity:
        raise ValueError(f"MoEBlock: {tokens.shape[0]} tokens exceed the batched experts' capacity {capacity}")
    offsets, scatter_idx = routing.moe_prepare_scatter(topk_ids, num_experts)
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    safe_ids = jnp.where(valid, topk_ids, 0)
    position = scatter_idx - offsets[safe_ids]  # row inside its expert
    expert = jnp.where(valid, topk_ids, num_experts)  # out of range: dropped by the scatter
    rows = jnp.broadcast_to(tokens[:, None], (*topk_ids.shape, tokens.shape[1]))
    batch = (
        jnp.zeros((num_experts, capacity, tokens.shape[1]), tokens.dtype).at[expert, position].set(rows, mode="drop")
    )
    # The tiles of the routed rows (vLLM's estimate), not of the buffer's worst case.
    valid_m = max(1, estimate_valid_shape_m(*topk_ids.shape, experts.config))
    out = experts(batch, offsets[1:] - offsets[:-1], valid_shape_m=valid_m)
    picked = out[safe_ids, jnp.clip(position, 0, capacity - 1)].astype(jnp.float32)
    return jnp.einsum("tk,tkh->th", jnp.where(valid, topk_weights, 0.0), picked).astype(tokens.dtype)


def _moonep_experts(experts: MoonEPExperts, tokens, topk_weights, topk_ids):
    """Lay tokens out in expert segments (redundant rows empty), run, reduce back."""
    permuted = routing.moe_permute(tokens, topk_ids, experts.num_experts)
    offsets = permuted.expert_first_token_offset
    cu_seqlens = jnp.concatenate([offsets[1:], jnp.broadcast_to(offsets[-1:], (experts.num_redundant,))])
    route_weights = topk_weights.reshape(-1)[permuted.permuted_idx]
    out = experts(permuted.permuted_hidden_states, cu_seqlens, route_weights)
    return routing.moe_unpermute(out, jnp.ones_like(topk_weights), permuted.inv_permuted_idx, offsets)


class MoEBlock(nnx.Module):
    """A MoE block: router, one of the expert modules, optional shared expert.
    The router is a linear ``[H, E_global]`` in f32; :func:`route` gives the
    routing (DeepSeek-V3: ``scoring="sigmoid", correction_bias=True,
    num_groups=8, topk_groups=4, routed_scaling_factor=2.5``).

    Args:
        experts: any expert module: the grouped and indexed ones take the
            routing directly; for the batched one the block dispatches the
            tokens into ``[E, max_tokens, H]`` and does the weighted reduce
            (vLLM's delegate); for MoonEP it lays the tokens out in expert segments;
            the expert-parallel one splits the tokens over its mesh (their count a
            multiple of its ranks: pad them and give ``num_valid_tokens``).
        rngs: the router's (and the shared expert's) random weights.
        scoring: ``"softmax"`` (Mixtral, Qwen3, gpt-oss) or ``"sigmoid"`` (DeepSeek-V3).
        renormalize: make a token's k weights sum to one.
        shared_intermediate_size: a shared expert of this width; None: none.
        correction_bias: a learned ``[E]`` bias that shifts the choice, not the weights.
        top_k: experts per token (required with MoonEP; default the config's).
        router_bias: the router has a bias (gpt-oss).
        num_groups: expert groups of the group-limited choice.
        topk_groups: groups a token may choose from; None: all.
        routed_scaling_factor: multiplies the final weights.
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
        top_k: int | None = None,
        router_bias: bool = False,
        num_groups: int = 1,
        topk_groups: int | None = None,
        routed_scaling_factor: float = 1.0,
    ):
        if isinstance(experts, MoonEPExperts):
            if top_k is None:
                raise ValueError("MoEBlock: top_k is required with MoonEPExperts (it has no experts config)")
            hidden, num_experts, dtype = experts.hidden_size, experts.num_experts, "bfloat16"
        else:
            config = experts.config
            hidden, num_experts, dtype = config.hidden_size, config.global_num_experts, config.compute_dtype
            top_k = config.top_k if top_k is None else top_k
        self.experts = experts
        self.scoring, self.renormalize, self.top_k = scoring, renormalize, top_k
        self.num_groups, self.topk_groups, self.routed_scaling_factor = num_groups, topk_groups, routed_scaling_factor
        check_routing(num_experts, top_k, scoring, num_groups, topk_groups, "MoEBlock")
        self.router = nnx.Linear(hidden, num_experts, use_bias=router_bias, param_dtype=jnp.float32, rngs=rngs)
        self.correction_bias = nnx.Param(jnp.zeros(num_experts, jnp.float32)) if correction_bias else None
        self.shared = (
            SharedExpert(hidden, shared_intermediate_size, rngs=rngs, dtype=jnp.dtype(dtype))
            if shared_intermediate_size
            else None
        )

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike,
        layer: int,
        *,
        experts: type = HummingGroupedExperts,
        backend: str | None = None,
        weight_format: str | None = None,
        **experts_kwargs,
    ) -> MoEBlock:
        """One MoE layer of a Hugging Face checkpoint folder, in one call: its
        ``config.json`` gives the layer's config and layout
        (:func:`~humming_jax.checkpoints.from_hf_config`), its safetensors the
        experts (read lazily, one layer's bytes) and the router and shared
        expert, placed in the Flax layout (PyTorch's ``[out, in]`` linear
        weights transposed to NNX's ``[in, out]`` kernels).

        Args:
            path: the checkpoint folder (``config.json``, ``*.safetensors``,
                optionally ``model.safetensors.index.json``).
            layer: the decoder layer's index.
            experts: the expert module class (the grouped, indexed or batched one).
            backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.
            weight_format: a float checkpoint's experts quantized on load to this
                format (e.g. ``"int4_g128"``); None: bf16. A quantized checkpoint
                keeps its own format.
            **experts_kwargs: to the expert module (``max_num_tokens`` for the batched one).

        Returns:
            The :class:`MoEBlock`.
        """
        hf = checkpoints.from_hf_config(os.path.join(path, "config.json"))
        if weight_format is not None:
            hf = checkpoints.with_weight_format(hf, weight_format)
        tensors = checkpoints.SafetensorsCheckpoint(path)
        weights = checkpoints.load_experts(tensors, hf.prefix.format(layer=layer), hf.experts, hf.layout, hf.names)
        module = experts(hf.experts, weights=weights, backend=backend, **experts_kwargs)
        block = cls(module, rngs=nnx.Rngs(0), **hf.block)
        router = checkpoints.load_router(tensors, hf, layer)
        block.router.kernel.set_value(jnp.asarray(router.weight.T))
        if router.bias is not None:
            block.router.bias.set_value(jnp.asarray(router.bias))
        if router.correction_bias is not None:
            block.correction_bias.set_value(jnp.asarray(router.correction_bias))
        if router.shared is not None:
            for linear, weight in zip(
                (block.shared.gate, block.shared.up, block.shared.down), router.shared, strict=True
            ):
                linear.kernel.set_value(jnp.asarray(weight.T, linear.kernel.get_value().dtype))
        return block

    def __call__(
        self, x: jax.Array, expert_map: jax.Array | None = None, num_valid_tokens: jax.Array | None = None
    ) -> jax.Array:
        """Route and run the experts.

        Args:
            x: ``[..., H]`` activations.
            expert_map: optional int32 ``[E_global]`` → local expert or −1
                (the grouped and indexed expert modules; the others place
                their experts themselves and refuse one).
            num_valid_tokens: optional int32 ``[1]``, the real rows of a padded
                batch (over ``x``'s rows flattened): the rows past it reach no
                expert and come out zero.

        Returns:
            ``[..., H]`` in ``x``'s dtype.
        """
        shape = x.shape
        hidden = self.router.in_features
        if x.ndim < 1 or shape[-1] != hidden:
            raise ValueError(f"MoEBlock: x: expected [..., H={hidden}], got {list(shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"MoEBlock: x: expected float activations, got {x.dtype}")
        tokens = x.reshape(-1, shape[-1])
        own_placement = isinstance(self.experts, (BatchedHummingGroupedExperts, MoonEPExperts, ExpertParallelExperts))
        if expert_map is not None and own_placement:
            raise ValueError(
                f"MoEBlock: expert_map: the {type(self.experts).__name__} module places its experts itself "
                "(the grouped and indexed modules take a map)"
            )
        check_num_valid_tokens(num_valid_tokens, "MoEBlock")
        valid = None
        if num_valid_tokens is not None:
            valid = jnp.arange(tokens.shape[0]) < num_valid_tokens.reshape(-1)[0]
        bias = None if self.correction_bias is None else self.correction_bias.get_value()
        topk_weights, topk_ids = route(
            self.router(tokens.astype(jnp.float32)),
            self.top_k,
            self.scoring,
            self.renormalize,
            bias,
            self.num_groups,
            self.topk_groups,
            self.routed_scaling_factor,
        )
        if own_placement and valid is not None:  # a padded row's slots: outside [0, E), no expert's
            topk_ids = jnp.where(valid[:, None], topk_ids, self.router.out_features)
        if isinstance(self.experts, BatchedHummingGroupedExperts):
            out = _batched_experts(self.experts, tokens, topk_weights, topk_ids)
        elif isinstance(self.experts, MoonEPExperts):
            out = _moonep_experts(self.experts, tokens.astype(jnp.bfloat16), topk_weights, topk_ids)
        elif isinstance(self.experts, ExpertParallelExperts):
            out = self.experts(tokens, topk_weights, topk_ids)
        else:
            out = self.experts(tokens, topk_weights, topk_ids, expert_map=expert_map, num_valid_tokens=num_valid_tokens)
        if self.shared is not None:
            out = out + self.shared(tokens).astype(out.dtype)
        if valid is not None:
            out = jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))
        return out.reshape(shape).astype(x.dtype)
