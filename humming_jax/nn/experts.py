"""Flax NNX expert modules (DESIGN §3.7). Modules hold parameters and static
config only; all math is in the pure pipelines of ``humming_jax.experts``.

Each module takes its static config at construction (random float weights
quantized on construction, or ``from_float`` / ``from_quantized``) and the
routing at call time; calls are ``jax.jit``/``nnx.jit``-able and compile once
for a given set of shapes, whatever the routing values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from humming_jax import experts as E
from humming_jax import parallel
from humming_jax.configs import ExpertsConfig
from humming_jax.formats import QuantizedWeight
from humming_jax.workspace import WorkspacePlan, plan_workspace


class ExpertWeight(nnx.Variable):
    """A (possibly quantized) expert weight: holds a :class:`QuantizedWeight`."""


class InputScale(nnx.Variable):
    """A static f32 input (activation) scale ``[1]``."""


def _random_float_weights(config: ExpertsConfig, rngs: nnx.Rngs):
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    w13 = jax.random.normal(rngs.params(), (e, config.w13_n, h), jnp.float32) / math.sqrt(h)
    w2 = jax.random.normal(rngs.params(), (e, h, i), jnp.float32) / math.sqrt(i)
    return w13, w2


class _HummingExperts(nnx.Module):
    pipeline = "grouped"

    def __init__(
        self,
        config: ExpertsConfig,
        *,
        rngs: nnx.Rngs | None = None,
        weights: E.ExpertWeights | None = None,
        backend: str | None = None,
    ):
        if weights is None:
            if rngs is None:
                raise ValueError(f"{type(self).__name__}: give rngs (random weights) or weights")
            w13, w2 = _random_float_weights(config, rngs)
            biases = {  # formats with a bias start with zeros
                f"{name}_bias": jnp.zeros(w.shape[:2], jnp.float32)
                for name, w, fmt in (("w13", w13, config.weight_format), ("w2", w2, config.w2_weight_format))
                if fmt.has_bias
            }
            weights = E.quantize_experts(w13, w2, config, **biases)
        E.check_weights(weights, config)
        self.config = config
        self.backend = backend
        weights = E.to_kernel_order(weights, config)  # weights a caller built in K order: repacked once, here
        self.w13 = ExpertWeight(weights.w13)
        self.w2 = ExpertWeight(weights.w2)
        self.w13_input_scale = None if weights.w13_input_scale is None else InputScale(weights.w13_input_scale)
        self.w2_input_scale = None if weights.w2_input_scale is None else InputScale(weights.w2_input_scale)

    @classmethod
    def from_float(cls, config: ExpertsConfig, w13: jax.Array, w2: jax.Array, **kwargs):
        """Quantize float ``w13 [E, N13, H]`` / ``w2 [E, H, I]`` (and optional
        ``w13_bias``, ``w2_bias``, static input scales) into the config's formats."""
        weight_kwargs = {
            k: kwargs.pop(k) for k in ("w13_bias", "w2_bias", "w13_input_scale", "w2_input_scale") if k in kwargs
        }
        return cls(config, weights=E.quantize_experts(w13, w2, config, **weight_kwargs), **kwargs)

    @classmethod
    def from_quantized(cls, config: ExpertsConfig, weights: E.ExpertWeights, **kwargs):
        return cls(config, weights=weights, **kwargs)

    @property
    def weights(self) -> E.ExpertWeights:
        scale = lambda v: None if v is None else v.get_value()  # noqa: E731
        w13: QuantizedWeight = self.w13.get_value()
        return E.ExpertWeights(w13, self.w2.get_value(), scale(self.w13_input_scale), scale(self.w2_input_scale))

    def workspace(self, num_tokens: int, **kwargs) -> WorkspacePlan:
        """Static shapes and dtypes of every intermediate for ``num_tokens`` tokens."""
        return plan_workspace(self.config, num_tokens, self.config.top_k, self.pipeline, **kwargs)

    def _checked(self, out: jax.Array, num_tokens: int, **kwargs) -> jax.Array:
        expected = self.workspace(num_tokens, **kwargs).buffers[
            "output" if self.pipeline != "batched" else "down_output"
        ]
        if out.shape != expected.shape or out.dtype != expected.dtype:
            raise AssertionError(f"{type(self).__name__}: output {out.shape} {out.dtype} != planned {expected}")
        return out


class HummingGroupedExperts(_HummingExperts):
    """Grouped-contiguous experts: ``(hidden_states [T, H], topk_weights [T, k],
    topk_ids [T, k], expert_map=None, a1q_scale=None) -> [T, H]``."""

    pipeline = "grouped"

    def __call__(self, hidden_states, topk_weights, topk_ids, expert_map=None, a1q_scale=None):
        out = E.humming_grouped_experts(
            hidden_states,
            self.weights,
            topk_weights,
            topk_ids,
            self.config,
            expert_map=expert_map,
            a1q_scale=a1q_scale,
            backend=self.backend,
        )
        return self._checked(out, topk_ids.shape[0])


class HummingIndexedExperts(_HummingExperts):
    """Indexed experts (align -> w13 top_k=k -> w2 top_k=1 -> fused sum); same call as the grouped one."""

    pipeline = "indexed"

    def __init__(
        self,
        config: ExpertsConfig,
        *,
        block_size: int | None = None,
        w2_block_size: int | None = None,
        **kwargs,
    ):
        super().__init__(config, **kwargs)
        self.block_size = block_size
        self.w2_block_size = w2_block_size

    def __call__(self, hidden_states, topk_weights, topk_ids, expert_map=None, a1q_scale=None, num_valid_tokens=None):
        out = E.humming_indexed_experts(
            hidden_states,
            self.weights,
            topk_weights,
            topk_ids,
            self.config,
            expert_map=expert_map,
            a1q_scale=a1q_scale,
            block_size=self.block_size,
            w2_block_size=self.w2_block_size,
            num_valid_tokens=num_valid_tokens,
            backend=self.backend,
        )
        return self._checked(out, topk_ids.shape[0])


class ExpertParallelExperts(_HummingExperts):
    """The expert layer over a device mesh axis (:func:`humming_jax.parallel.ep_experts`):
    the global layer's weights split by experts over ``mesh``'s ``axis_name``,
    the tokens split over it at each call; the grouped module's call.
    ``redundant_experts``: copies of the most loaded experts each rank takes
    every step (``ep_experts``)."""

    pipeline = "grouped"

    def __init__(
        self,
        config: ExpertsConfig,
        *,
        mesh: jax.sharding.Mesh,
        axis_name: str = "expert",
        redundant_experts: int = 0,
        **kwargs,
    ):
        super().__init__(config, **kwargs)
        if axis_name not in mesh.shape:
            raise ValueError(f"ExpertParallelExperts: axis_name: {axis_name!r} is not an axis of {dict(mesh.shape)}")
        ranks = mesh.shape[axis_name]
        # The experts divide over the ranks (the tokens: each call).
        parallel.plan_ep(config, ranks, ranks, redundant=redundant_experts)
        self.mesh, self.axis_name, self.redundant_experts = mesh, axis_name, redundant_experts
        placed = parallel.shard_weights(self.weights, config, mesh, axis_name)
        self.w13 = ExpertWeight(placed.w13)
        self.w2 = ExpertWeight(placed.w2)

    def __call__(self, hidden_states, topk_weights, topk_ids):
        out = parallel.ep_experts(
            hidden_states,
            self.weights,
            topk_weights,
            topk_ids,
            self.config,
            self.mesh,
            axis_name=self.axis_name,
            redundant_experts=self.redundant_experts,
            backend=self.backend,
        )
        return self._checked(out, topk_ids.shape[0])


class BatchedHummingGroupedExperts(_HummingExperts):
    """Batched (grouped-masked) experts: ``([E, max_tokens, H], expert_num_tokens [E])
    -> [E, max_tokens, H]``; the weighted top-k reduce is the caller's."""

    pipeline = "batched"

    def __init__(self, config: ExpertsConfig, *, max_num_tokens: int, num_dispatchers: int = 1, **kwargs):
        super().__init__(config, **kwargs)
        self.max_num_tokens = max_num_tokens
        self.num_dispatchers = num_dispatchers

    def workspace(self, num_tokens: int | None = None, **kwargs) -> WorkspacePlan:
        return super().workspace(
            num_tokens or self.max_num_tokens, max_num_tokens=self.max_num_tokens, num_dispatchers=self.num_dispatchers
        )

    def __call__(self, hidden_states, expert_num_tokens, a1q_scale=None):
        if hidden_states.shape[1] != self.max_num_tokens * self.num_dispatchers:
            raise ValueError(
                f"BatchedHummingGroupedExperts: hidden_states must be [E, max_num_tokens*num_dispatchers="
                f"{self.max_num_tokens * self.num_dispatchers}, H], got {hidden_states.shape}"
            )
        out = E.batched_humming_grouped_experts(
            hidden_states, expert_num_tokens, self.weights, self.config, a1q_scale=a1q_scale, backend=self.backend
        )
        return self._checked(out, self.max_num_tokens)


class MoonEPExperts(nnx.Module):
    """MoonEP experts over ``num_experts`` expert rows plus ``num_redundant``
    prefetch rows, with separate bf16 gate/up ``[G, I, H]`` and down ``[G, H, I]``.
    Call: ``(hidden_states [NvS, H], cu_seqlens [G], route_weights [NvS],
    apply_router_weight_on_input=False) -> [NvS, H]`` (rows past
    ``cu_seqlens[-1]`` are zero)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_redundant: int = 0,
        rngs: nnx.Rngs | None = None,
        w_gate=None,
        w_up=None,
        w_down=None,
        backend: str | None = None,
    ):
        rows = num_experts + num_redundant
        if w_gate is None:
            if rngs is None:
                raise ValueError("MoonEPExperts: give rngs (random weights) or w_gate, w_up, w_down")
            h, i = hidden_size, intermediate_size
            w_gate = jax.random.normal(rngs.params(), (rows, i, h), jnp.float32) / math.sqrt(h)
            w_up = jax.random.normal(rngs.params(), (rows, i, h), jnp.float32) / math.sqrt(h)
            w_down = jax.random.normal(rngs.params(), (rows, h, i), jnp.float32) / math.sqrt(i)
        expected = {
            "w_gate": (rows, intermediate_size, hidden_size),
            "w_up": (rows, intermediate_size, hidden_size),
            "w_down": (rows, hidden_size, intermediate_size),
        }
        for name, array in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
            if tuple(array.shape) != expected[name]:
                raise ValueError(f"MoonEPExperts: {name} must be {list(expected[name])}, got {list(array.shape)}")
        self.num_experts, self.num_redundant = num_experts, num_redundant
        self.backend = backend
        self.w_gate = nnx.Param(jnp.asarray(w_gate, jnp.bfloat16))
        self.w_up = nnx.Param(jnp.asarray(w_up, jnp.bfloat16))
        self.w_down = nnx.Param(jnp.asarray(w_down, jnp.bfloat16))

    def __call__(self, hidden_states, cu_seqlens, route_weights, apply_router_weight_on_input: bool = False):
        return E.moonep_experts(
            hidden_states.astype(jnp.bfloat16),
            self.w_gate.get_value(),
            self.w_up.get_value(),
            self.w_down.get_value(),
            cu_seqlens,
            route_weights,
            apply_router_weight_on_input,
            backend=self.backend,
        )
