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
from humming_jax.configs import ExpertsConfig, is_count
from humming_jax.formats import QuantizedWeight
from humming_jax.workspace import WorkspacePlan, plan_workspace


class ExpertWeight(nnx.Variable):
    """An ``nnx.Variable`` holding one projection's :class:`QuantizedWeight`
    (a pytree: ``nnx.split`` / ``nnx.state`` see its arrays).

    Args:
        value: the :class:`QuantizedWeight`.
    """


class InputScale(nnx.Variable):
    """An ``nnx.Variable`` holding a static input (activation) scale.

    Args:
        value: f32 ``[1]``.
    """


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
        """The module with float weights quantized into the config's formats.

        Args:
            config: the layer's :class:`ExpertsConfig`.
            w13: float ``[E, N13, H]``.
            w2: float ``[E, H, I]``.
            **kwargs: ``w13_bias``, ``w2_bias``, ``w13_input_scale``,
                ``w2_input_scale`` (as :func:`quantize_experts`), the rest to the constructor.

        Returns:
            The module.
        """
        weight_kwargs = {
            k: kwargs.pop(k) for k in ("w13_bias", "w2_bias", "w13_input_scale", "w2_input_scale") if k in kwargs
        }
        return cls(config, weights=E.quantize_experts(w13, w2, config, **weight_kwargs), **kwargs)

    @classmethod
    def from_quantized(cls, config: ExpertsConfig, weights: E.ExpertWeights, **kwargs):
        """The module over quantized weights.

        Args:
            config: the layer's :class:`ExpertsConfig`.
            weights: its :class:`ExpertWeights`.
            **kwargs: to the constructor (``backend``, …).

        Returns:
            The module.
        """
        return cls(config, weights=weights, **kwargs)

    @property
    def weights(self) -> E.ExpertWeights:
        scale = lambda v: None if v is None else v.get_value()  # noqa: E731
        w13: QuantizedWeight = self.w13.get_value()
        return E.ExpertWeights(w13, self.w2.get_value(), scale(self.w13_input_scale), scale(self.w2_input_scale))

    def workspace(self, num_tokens: int, **kwargs) -> WorkspacePlan:
        """The static buffers of a call (:func:`plan_workspace`).

        Args:
            num_tokens: the tokens of a call.
            **kwargs: to :func:`plan_workspace`.

        Returns:
            The :class:`WorkspacePlan`.
        """
        return plan_workspace(self.config, num_tokens, self.config.top_k, self.pipeline, **kwargs)

    def _checked(self, out: jax.Array, num_tokens: int, **kwargs) -> jax.Array:
        expected = self.workspace(num_tokens, **kwargs).buffers[
            "output" if self.pipeline != "batched" else "down_output"
        ]
        if out.shape != expected.shape or out.dtype != expected.dtype:
            raise AssertionError(f"{type(self).__name__}: output {out.shape} {out.dtype} != planned {expected}")
        return out


class HummingGroupedExperts(_HummingExperts):
    """The expert layer as an NNX module on the grouped pipeline
    (:func:`humming_grouped_experts`).

    Args:
        config: the layer's :class:`ExpertsConfig`.
        rngs: random weights (drawn in float, quantized to the config's formats)
            when ``weights`` is None.
        weights: the layer's :class:`ExpertWeights` (repacked to the kernels' order).
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.
    """

    pipeline = "grouped"

    def __call__(self, hidden_states, topk_weights, topk_ids, expert_map=None, a1q_scale=None, num_valid_tokens=None):
        """Run the layer.

        Args:
            hidden_states: ``[T, H]`` activations (or pre-quantized values with ``a1q_scale``).
            topk_weights: float ``[T, k]`` router weights.
            topk_ids: int32 ``[T, k]`` expert ids (outside ``[0, E)``: nothing).
            expert_map: optional int32 ``[global E]`` → local expert or −1.
            a1q_scale: the scales of pre-quantized ``hidden_states``.
            num_valid_tokens: optional int32 ``[1]``, the real tokens of a padded batch.

        Returns:
            ``[T, H]`` in ``hidden_states``' dtype.
        """
        out = E.humming_grouped_experts(
            hidden_states,
            self.weights,
            topk_weights,
            topk_ids,
            self.config,
            expert_map=expert_map,
            a1q_scale=a1q_scale,
            backend=self.backend,
            num_valid_tokens=num_valid_tokens,
        )
        return self._checked(out, topk_ids.shape[0])


class HummingIndexedExperts(_HummingExperts):
    """The expert layer as an NNX module on the indexed pipeline
    (:func:`humming_indexed_experts`); the grouped module's call.

    Args:
        config, rngs, weights, backend: as :class:`HummingGroupedExperts`.
        block_size: rows of an aligned block; None: the w13 tile's rows.
        w2_block_size: the same for w2; None: ``block_size``.
    """

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
        """Run the layer.

        Args:
            hidden_states, topk_weights, topk_ids, expert_map, a1q_scale: as
                :meth:`HummingGroupedExperts.__call__`.
            num_valid_tokens: optional int32 ``[1]``, the real tokens of a padded batch.

        Returns:
            ``[T, H]`` in ``hidden_states``' dtype.
        """
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
    the tokens split over it at each call.

    Args:
        config, rngs, weights, backend: as :class:`HummingGroupedExperts`.
        mesh: the device mesh.
        axis_name: the axis the experts (and each call's tokens) split over.
        redundant_experts: B, copies of the most loaded experts each rank takes every step.
    """

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
        """Run the layer.

        Args:
            hidden_states: ``[T, H]``, T a multiple of the axis' ranks.
            topk_weights: float ``[T, k]``.
            topk_ids: int32 ``[T, k]`` global expert ids.

        Returns:
            ``[T, H]``, sharded by tokens over the axis.
        """
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
    """The experts as an NNX module on the batched (grouped-masked) pipeline
    (:func:`batched_humming_grouped_experts`); the weighted top-k reduce is the caller's.

    Args:
        config, rngs, weights, backend: as :class:`HummingGroupedExperts`.
        max_num_tokens: the rows an expert holds from one dispatcher.
        num_dispatchers: the dispatchers writing into one buffer.
    """

    pipeline = "batched"

    def __init__(self, config: ExpertsConfig, *, max_num_tokens: int, num_dispatchers: int = 1, **kwargs):
        for name, value in (("max_num_tokens", max_num_tokens), ("num_dispatchers", num_dispatchers)):
            if not is_count(value, 1):
                raise ValueError(f"BatchedHummingGroupedExperts: {name}: expected a positive int, got {value!r}")
        super().__init__(config, **kwargs)
        self.max_num_tokens = max_num_tokens
        self.num_dispatchers = num_dispatchers

    def workspace(self, num_tokens: int | None = None, **kwargs) -> WorkspacePlan:
        return super().workspace(
            num_tokens or self.max_num_tokens, max_num_tokens=self.max_num_tokens, num_dispatchers=self.num_dispatchers
        )

    def __call__(self, hidden_states, expert_num_tokens, a1q_scale=None, valid_shape_m: int | None = None):
        """Run the experts.

        Args:
            hidden_states: ``[E, max_num_tokens·num_dispatchers, H]``.
            expert_num_tokens: int32 ``[E]``, the rows of each expert.
            a1q_scale: the scales of pre-quantized ``hidden_states``.
            valid_shape_m: the rows expected in all, for the tiling (static;
                e.g. :func:`~humming_jax.estimate_valid_shape_m` of the
                routed tokens); None: every buffer row.

        Returns:
            ``[E, max_num_tokens·num_dispatchers, H]``; rows past each count are zero.
        """
        if hidden_states.shape[1] != self.max_num_tokens * self.num_dispatchers:
            raise ValueError(
                f"BatchedHummingGroupedExperts: hidden_states must be [E, max_num_tokens*num_dispatchers="
                f"{self.max_num_tokens * self.num_dispatchers}, H], got {hidden_states.shape}"
            )
        out = E.batched_humming_grouped_experts(
            hidden_states,
            expert_num_tokens,
            self.weights,
            self.config,
            a1q_scale=a1q_scale,
            backend=self.backend,
            valid_shape_m=valid_shape_m,
        )
        return self._checked(out, self.max_num_tokens)


class MoonEPExperts(nnx.Module):
    """MoonEP's grouped experts as an NNX module: G = ``num_experts`` expert
    rows plus ``num_redundant`` prefetch rows, bf16. Given MoonEP's gate and
    up weights, it holds them as one ``w13`` (:func:`moonep_w13`: gate and
    up rows interleaved) and runs :func:`moonep_interleaved_experts` — one
    GEMM whose tiles apply the activation — with ``w_down``.

    Args:
        num_experts: E.
        hidden_size: H.
        intermediate_size: I.
        num_redundant: B, the redundant rows.
        rngs: random weights when ``w_gate`` is None.
        w_gate: ``[G, I, H]``.
        w_up: ``[G, I, H]``.
        w_down: ``[G, H, I]``.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.
    """

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
        for name, value, least in (("num_experts", num_experts, 1), ("num_redundant", num_redundant, 0)):
            if not is_count(value, least):
                raise ValueError(f"MoonEPExperts: {name}: expected an int of at least {least}, got {value!r}")
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
        self.num_experts, self.num_redundant, self.hidden_size = num_experts, num_redundant, hidden_size
        self.backend = backend
        self.w13 = ExpertWeight(E.moonep_w13(jnp.asarray(w_gate, jnp.bfloat16), jnp.asarray(w_up, jnp.bfloat16)))
        self.w_down = nnx.Param(jnp.asarray(w_down, jnp.bfloat16))

    def __call__(self, hidden_states, cu_seqlens, route_weights, apply_router_weight_on_input: bool = False):
        """Run the experts.

        Args:
            hidden_states: ``[NvS, H]`` rows in segment order.
            cu_seqlens: int32 ``[G]``, cumulative segment end offsets.
            route_weights: float ``[NvS]``.
            apply_router_weight_on_input: skip the route multiply.

        Returns:
            ``[NvS, H]`` bf16; rows past ``cu_seqlens[-1]`` are zero.
        """
        return E.moonep_interleaved_experts(
            hidden_states.astype(jnp.bfloat16),
            self.w13.get_value(),
            self.w_down.get_value(),
            cu_seqlens,
            route_weights,
            apply_router_weight_on_input,
            backend=self.backend,
        )
