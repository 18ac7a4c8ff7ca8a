"""Workspace planning as static shape arithmetic (DESIGN §3.8).

vLLM sizes two flat workspaces by walking the buffer chain
``quanted_gate_up_input -> gate_up_output -> quanted_down_input ->
down_output [-> output]`` in reverse and alternating them, so that neighbours
never alias. XLA owns allocation in JAX; what remains is this pure function of
Python ints: every intermediate's ``ShapeDtypeStruct``, which workspace vLLM
would put it in, and the bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from humming_jax import input_quant as Q
from humming_jax.activations import ActivationSpec, get_activation
from humming_jax.configs import ExpertsConfig

PIPELINES = ("grouped", "indexed", "batched", "ep")
CHAIN = ("quanted_gate_up_input", "gate_up_output", "quanted_down_input", "down_output", "output")


@dataclasses.dataclass(frozen=True)
class WorkspacePlan:
    """The static buffers of one expert pipeline call (:func:`plan_workspace`).

    Attributes:
        buffers: each intermediate's shape and dtype, by vLLM's name
            (``quanted_gate_up_input``, ``gate_up_output``, ``quanted_down_input``,
            ``down_output``, ``output``).
        required: the chain's buffers in order (batched stops at ``down_output``).
        workspace_of: 1 or 2 for each buffer, vLLM's alternation of two workspaces.
        workspace1_bytes: the largest buffer of workspace 1.
        workspace2_bytes: the largest buffer of workspace 2.
    """

    buffers: dict[str, jax.ShapeDtypeStruct]
    required: tuple[str, ...]  # the chain in order; batched stops at down_output
    workspace_of: dict[str, int]  # 1 or 2, vLLM's alternation
    workspace1_bytes: int
    workspace2_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Both workspaces alive at once: the most the chain needs."""
        return self.workspace1_bytes + self.workspace2_bytes

    def nbytes(self, name: str) -> int:
        buffer = self.buffers[name]
        return math.prod(buffer.shape) * jnp.dtype(buffer.dtype).itemsize


def activation_dtype(spec: Q.InputQuantSpec, compute_dtype: str):
    """The dtype of a GEMM input buffer.

    Args:
        spec: the input's :class:`InputQuantSpec`.
        compute_dtype: the unquantized input's dtype name (``"bfloat16"``).

    Returns:
        ``compute_dtype`` for unquantized inputs, else the quantized storage
        dtype (4-bit values are stored as uint8 pairs).
    """
    return jnp.dtype(compute_dtype) if not spec.is_quantized else jnp.dtype(spec.dtype.storage_dtype)


@functools.lru_cache(maxsize=1024)  # a pure function of hashable arguments, asked on every module call
def plan_workspace(
    config: ExpertsConfig,
    num_tokens: int,
    top_k: int,
    pipeline: str,
    activation: ActivationSpec | str | None = None,
    max_num_tokens: int | None = None,
    num_dispatchers: int | None = None,
    num_ranks: int | None = None,
    redundant: int = 0,
    capacity: int | None = None,
) -> WorkspacePlan:
    """Static shapes of every intermediate of an expert pipeline (vLLM's
    ``workspace_shapes``): gated activations halve the intermediate width,
    4-bit inputs halve the last dim (which must be even).

    Args:
        config: the layer's :class:`ExpertsConfig`.
        num_tokens: M, the tokens of a call.
        top_k: the slots per token.
        pipeline: ``"grouped"`` (w13 reads the permuted ``[M·k, H]``),
            ``"indexed"`` (w13 reads the unexpanded ``[M, H]``), ``"batched"``
            (``[E, max_num_tokens·num_dispatchers, H]``) or ``"ep"`` (one rank of
            :func:`~humming_jax.parallel.ep_experts`: ``config`` and ``num_tokens``
            the global layer's; the exchange's buffers, then the grouped
            pipeline over the NvS received rows, one slot each).
        activation: overrides ``config.activation``.
        max_num_tokens: batched: the rows an expert holds.
        num_dispatchers: batched: the ranks dispatching into one buffer.
        num_ranks: ep: R, the ranks of the mesh axis.
        redundant: ep: B, the expert copies a rank holds.
        capacity: ep: the rows a rank receives; None: the worst case R·S·k.

    Returns:
        The :class:`WorkspacePlan`.
    """
    if pipeline not in PIPELINES:
        raise ValueError(f"plan_workspace: pipeline: expected one of {PIPELINES}, got {pipeline!r}")
    if pipeline == "ep":
        if num_ranks is None:
            raise ValueError("plan_workspace: the ep pipeline needs num_ranks")
        return _plan_ep_workspace(config, num_tokens, top_k, activation, num_ranks, redundant, capacity)
    # num_tokens may be 0 (an idle rank's empty batch: every buffer has no rows).
    for name, value, least in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            kind = "non-negative" if least == 0 else "positive"
            raise ValueError(f"plan_workspace: {name}: expected a {kind} int, got {value!r}")
    activation = get_activation(activation) or config.activation
    w13, w2 = config.w13, config.w2
    gate_up_dim, intermediate_dim, hidden = w13.real_n, w2.real_k, w13.real_k
    if activation.output_width(gate_up_dim) != intermediate_dim:
        raise ValueError(
            f"plan_workspace: activation {activation.kind.value!r} maps the w13 width {gate_up_dim} to "
            f"{activation.output_width(gate_up_dim)}, but w2 takes K={intermediate_dim}"
        )
    batched = pipeline == "batched"
    if batched:
        if max_num_tokens is None or num_dispatchers is None:
            raise ValueError("plan_workspace: the batched pipeline needs max_num_tokens and num_dispatchers")
        real_m = input_m = config.num_experts * max_num_tokens * num_dispatchers
        output_shape = (config.num_experts, max_num_tokens * num_dispatchers, hidden)
    else:
        real_m = num_tokens * top_k
        input_m = num_tokens if pipeline == "indexed" else real_m
        output_shape = (num_tokens, hidden)
    compute = jnp.dtype(config.compute_dtype)
    specs = {"quanted_gate_up_input": w13.input_quant, "quanted_down_input": w2.input_quant}
    shapes = {
        "quanted_gate_up_input": (input_m, hidden),
        "gate_up_output": (real_m, gate_up_dim),
        "quanted_down_input": (real_m, intermediate_dim),
        "down_output": output_shape if batched else (real_m, hidden),
        "output": output_shape,
    }
    buffers = {}
    for name, shape in shapes.items():
        dtype = activation_dtype(specs[name], config.compute_dtype) if name in specs else compute
        if name in specs and specs[name].packs_k == 2:
            if shape[-1] % 2:
                raise ValueError(
                    f"plan_workspace: 4-bit packing needs an even last dimension, got {shape[-1]} for '{name}'"
                )
            shape = (*shape[:-1], shape[-1] // 2)
        buffers[name] = jax.ShapeDtypeStruct(shape, dtype)
    required = CHAIN[:-1] if batched else CHAIN
    workspace_of, sizes = {}, [0, 0]
    for index, name in enumerate(reversed(required)):
        slot = index % 2
        workspace_of[name] = slot + 1
        sizes[slot] = max(sizes[slot], math.prod(buffers[name].shape) * buffers[name].dtype.itemsize)
    return WorkspacePlan(buffers, tuple(required), workspace_of, sizes[0], sizes[1])


def _plan_ep_workspace(config, num_tokens, top_k, activation, num_ranks, redundant, capacity) -> WorkspacePlan:
    """One rank's buffers of an expert-parallel step: the slots' rows sorted
    for the send (quantized first when their scales belong to the row), the
    NvS rows and weight-row ids received, the grouped pipeline over them (one
    slot each), the rows returned by the combine and the rank's output."""
    from humming_jax import parallel  # (parallel builds on the pipelines; the sizes are its plan's)

    if top_k != config.top_k:
        raise ValueError(f"plan_workspace: top_k: the ep pipeline routes config.top_k={config.top_k}, got {top_k}")
    plan = parallel.plan_ep(config, num_tokens, num_ranks, capacity, redundant)
    rows = plan.weight_rows
    local = dataclasses.replace(config, num_experts=rows, top_k=1, global_num_experts=rows)
    inner = plan_workspace(local, plan.receive_rows, 1, "grouped", activation)
    hidden = config.hidden_size
    quant = config.input_quant
    sent = quant if parallel.sends_quantized(config) else None
    row_dtype = activation_dtype(sent, config.compute_dtype) if sent else jnp.dtype(config.compute_dtype)
    row_width = hidden // sent.packs_k if sent else hidden
    exchange = {
        "dispatch_rows": jax.ShapeDtypeStruct((plan.slots_per_rank, row_width), row_dtype),
        "received_rows": jax.ShapeDtypeStruct((plan.receive_rows, row_width), row_dtype),
        "received_ids": jax.ShapeDtypeStruct((plan.receive_rows,), jnp.int32),
        "returned_rows": jax.ShapeDtypeStruct((plan.slots_per_rank, hidden), jnp.dtype(config.compute_dtype)),
    }
    buffers = {**exchange, **inner.buffers, "expert_output": inner.buffers["output"]}
    buffers["output"] = jax.ShapeDtypeStruct((plan.tokens_per_rank, hidden), jnp.dtype(config.compute_dtype))
    return dataclasses.replace(inner, buffers=buffers)
