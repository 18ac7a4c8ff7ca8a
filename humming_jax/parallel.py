"""Expert parallelism over a device mesh axis (first step: no redundant
experts, B = 0).

Each of the R ranks of ``axis_name`` holds ``E / R`` experts (rank r: global
experts ``[r·E/R, (r+1)·E/R)``) and ``S = T / R`` tokens. A step:

1. **dispatch** — each rank sorts its ``S·k`` routed slots by destination
   rank (then expert) and sends every slot's row and global expert id to the
   rank holding that expert with ``jax.lax.ragged_all_to_all``, into a static
   receive buffer of ``NvS = R·S·k`` rows (the worst case: every slot of every
   rank routed to one rank, so no routing can overflow it; with
   :func:`ep_experts_capped` fewer, and the slots that do not fit are counted
   and returned); rows arrive grouped by source rank;
2. **experts** — the rank runs its local experts on the received rows with the
   grouped pipeline (``expert_map`` maps the global ids to its own; unused rows
   carry id −1, an invalid slot, and give zeros);
3. **combine** — the reverse ``ragged_all_to_all`` returns each row to the
   slot it came from; the source rank applies the top-k weights and sums.

XLA's CPU backend has no ``ragged-all-to-all``: there (``backend`` other than
``"pallas"``) the same exchange runs as :func:`ragged_all_to_all_gathered`,
an ``all_gather`` of every rank's rows from which each rank takes its own —
the same result, R times the traffic (for tests on simulated devices).
Inputs whose scales belong to their row (dynamic per token or per group:
fp8 per token, DeepSeek-V3's fp8 per 128) are quantized before the send and
travel as their 8-bit values with their scales (half a bf16 row's bytes);
other inputs travel as they are and are quantized on the receiving rank.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from humming_jax import experts as X
from humming_jax import input_quant as Q
from humming_jax.backend import resolve_backend
from humming_jax.configs import ExpertsConfig
from humming_jax.process_input import process_input

# Input modes whose scales belong to their row: quantized before the send.
ROW_SCALED_MODES = (Q.InputQuantMode.DYNAMIC_TOKEN, Q.InputQuantMode.DYNAMIC_GROUP)


@dataclasses.dataclass(frozen=True)
class EPPlan:
    """Static sizes of one expert-parallel step (Python ints)."""

    num_ranks: int
    local_experts: int  # E / R
    tokens_per_rank: int  # S
    slots_per_rank: int  # S·k
    receive_rows: int  # NvS: R·S·k (every slot of every rank, the worst case) unless capped

    @property
    def worst_case_rows(self) -> int:
        return self.num_ranks * self.slots_per_rank


def plan_ep(config: ExpertsConfig, num_tokens: int, num_ranks: int, capacity: int | None = None) -> EPPlan:
    """The static sizes for ``num_tokens`` tokens over ``num_ranks`` ranks;
    raises unless both the experts and the tokens divide evenly. ``capacity``:
    rows a rank receives (default the worst case, which no routing exceeds)."""
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"plan_ep: num_ranks: expected a positive int, got {num_ranks!r}")
    if config.num_experts % num_ranks:
        raise ValueError(f"plan_ep: {config.num_experts} experts do not divide over {num_ranks} ranks")
    if num_tokens % num_ranks:
        raise ValueError(f"plan_ep: hidden_states: {num_tokens} tokens do not divide over {num_ranks} ranks")
    tokens = num_tokens // num_ranks
    slots = tokens * config.top_k
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
        raise ValueError(f"plan_ep: capacity: expected a positive int (rows a rank receives), got {capacity!r}")
    rows = num_ranks * slots if capacity is None else min(capacity, num_ranks * slots)
    return EPPlan(num_ranks, config.num_experts // num_ranks, tokens, slots, rows)


def ragged_all_to_all_gathered(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s result computed with ``all_gather``
    (for backends without the collective): every rank's rows and offsets are
    gathered and each rank writes the blocks addressed to it."""
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis_name)
    rows = jax.lax.all_gather(operand, axis_name)  # [R, rows, ...]
    starts, sizes, targets = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    along = jnp.arange(operand.shape[0], dtype=jnp.int32)
    for source in range(rows.shape[0]):
        start, size, target = starts[source, me], sizes[source, me], targets[source, me]
        block = jnp.take(rows[source], jnp.clip(start + along, 0, operand.shape[0] - 1), axis=0)
        positions = jnp.where(along < size, target + along, output.shape[0])  # past the end: dropped
        output = output.at[positions].set(block, mode="drop")
    return output


def weight_specs(weights: X.ExpertWeights, config: ExpertsConfig, axis_name: str = "expert"):
    """A ``PartitionSpec`` per array of ``weights``: per-expert arrays (``[E, …]``)
    split by experts over ``axis_name``, per-tensor ones (static input scales)
    on every rank."""
    return jax.tree.map(lambda a: P(axis_name) if a.shape[:1] == (config.num_experts,) else P(), weights)


def shard_weights(
    weights: X.ExpertWeights, config: ExpertsConfig, mesh: jax.sharding.Mesh, axis_name: str = "expert"
) -> X.ExpertWeights:
    """``weights`` placed on ``mesh``: each rank holds its experts' arrays
    (:func:`weight_specs`), as :func:`ep_experts` reads them."""
    specs = weight_specs(weights, config, axis_name)
    return jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)), weights, specs)


def _exchange(kernel_collective: bool):
    if kernel_collective:
        return jax.lax.ragged_all_to_all
    return ragged_all_to_all_gathered


def _local_weights(weights: X.ExpertWeights, local_experts: int) -> X.ExpertWeights:
    """Inside the mapped function: the weight pytrees hold the rank's experts
    but still carry the global shape; give them their local one."""

    def local(w):
        return dataclasses.replace(w, shape=(local_experts, *w.shape[1:]))

    return dataclasses.replace(weights, w13=local(weights.w13), w2=local(weights.w2))


def _step(hidden_states, weights, topk_weights, topk_ids, *, config, plan, axis_name, backend, exchange):
    """One rank's part of the layer (inside ``shard_map``)."""
    r, el, k = plan.num_ranks, plan.local_experts, config.top_k
    me = jax.lax.axis_index(axis_name)
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < config.num_experts)
    dest = jnp.where(valid, ids // el, r)  # invalid slots: no rank
    order = jnp.argsort(dest * config.num_experts + jnp.where(valid, ids, 0), stable=True)
    sorted_dest = dest[order]
    wanted = jnp.sum(sorted_dest[None, :] == jnp.arange(r, dtype=jnp.int32)[:, None], axis=1).astype(jnp.int32)
    input_offsets = (jnp.cumsum(wanted) - wanted).astype(jnp.int32)
    # Where each sender's block lands on each receiver: after the blocks of lower
    # ranks; a receiver full at capacity takes the first rows of a block only.
    all_wanted = jax.lax.all_gather(wanted, axis_name)  # [source, destination]
    before = jnp.cumsum(all_wanted, axis=0) - all_wanted
    accepted = jnp.clip(plan.receive_rows - before, 0, all_wanted).astype(jnp.int32)
    send_sizes = accepted[me]
    output_offsets = jnp.minimum(before[me], plan.receive_rows).astype(jnp.int32)
    recv_sizes = accepted[:, me]
    dropped = jnp.sum(wanted - send_sizes)

    sent_ids = ids[order]

    def dispatch(operand, fill):
        """``operand``'s sorted rows to their ranks' receive buffers (``fill`` elsewhere)."""
        out = jnp.full((plan.receive_rows, *operand.shape[1:]), fill, operand.dtype)
        return exchange(operand, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)

    recv_ids = dispatch(sent_ids, -1)
    if config.input_quant.is_quantized and config.input_quant.mode in ROW_SCALED_MODES:
        # Quantized on the source (the same rows the receiver would make), sent as bytes with their scales.
        q = process_input(
            hidden_states,
            config.input_quant,
            hadamard_block_size=config.hadamard_block_size,
            compute_dtype=jnp.dtype(config.compute_dtype),
            backend=backend,
        )
        values = jax.lax.bitcast_convert_type(jnp.take(q.values, order // k, axis=0), jnp.uint8)
        recv_rows = jax.lax.bitcast_convert_type(dispatch(values, 0), q.values.dtype)
        a1q_scale = dispatch(jnp.take(q.scale, order // k, axis=0), 0)
    else:
        recv_rows, a1q_scale = dispatch(jnp.take(hidden_states, order // k, axis=0), 0), None

    local_config = dataclasses.replace(config, num_experts=el, top_k=1, global_num_experts=config.num_experts)
    expert_map = jnp.where(jnp.arange(config.num_experts) // el == me, jnp.arange(config.num_experts) % el, -1).astype(
        jnp.int32
    )
    out_rows = X.humming_grouped_experts(
        recv_rows,
        _local_weights(weights, el),
        jnp.ones((plan.receive_rows, 1), jnp.float32),
        recv_ids[:, None],
        local_config,
        expert_map=expert_map,
        a1q_scale=a1q_scale,
        backend=backend,
    )

    # Combine: each receiver returns a source's block to where the source sent it from.
    recv_offsets = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    back_offsets = (jnp.cumsum(all_wanted, axis=1) - all_wanted)[:, me]  # where my block sat in each source
    returned = exchange(
        out_rows,
        jnp.zeros((plan.slots_per_rank, out_rows.shape[1]), out_rows.dtype),
        recv_offsets,
        recv_sizes,
        back_offsets,
        send_sizes,
        axis_name=axis_name,
    )
    slots = jnp.zeros_like(returned).at[order].set(returned)  # back to slot order
    weighted = slots.astype(jnp.float32).reshape(-1, k, slots.shape[1]) * topk_weights.astype(jnp.float32)[..., None]
    weighted = jnp.where(valid.reshape(-1, k)[..., None], weighted, 0.0)
    return jnp.sum(weighted, axis=1).astype(hidden_states.dtype), dropped.reshape(1)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "axis_name", "backend"))
def ep_experts(
    hidden_states: jax.Array,
    weights: X.ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    config: ExpertsConfig,
    mesh: jax.sharding.Mesh,
    axis_name: str = "expert",
    backend: str | None = None,
) -> jax.Array:
    """The expert layer over ``mesh``'s ``axis_name`` (see the module docstring).

    ``hidden_states [T, H]``, ``topk_weights`` / ``topk_ids [T, k]`` sharded
    (or shardable) over the axis by tokens; ``weights`` the global layer's
    (``[E, …]``), sharded over the axis by experts; ``config`` the global
    layer's. Returns ``[T, H]`` sharded by tokens: on one rank, the grouped
    pipeline's result; slots with ids outside ``[0, E)`` contribute nothing.
    The receive buffers hold the worst case: no slot is ever dropped.
    """
    out, _ = _ep(hidden_states, weights, topk_weights, topk_ids, config, mesh, axis_name, backend, None)
    return out


@functools.partial(jax.jit, static_argnames=("config", "mesh", "capacity", "axis_name", "backend"))
def ep_experts_capped(
    hidden_states: jax.Array,
    weights: X.ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    config: ExpertsConfig,
    mesh: jax.sharding.Mesh,
    capacity: int,
    axis_name: str = "expert",
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`ep_experts` with receive buffers of ``capacity`` rows a rank
    (less memory and a smaller local GEMM than the worst case R·S·k). A rank
    full at capacity takes the blocks of lower source ranks first, and of a
    block its first rows (lower experts); the slots it cannot take contribute
    nothing to their token. Returns ``(out [T, H], dropped [R])``: the slots
    each source rank could not deliver — the caller sees every drop."""
    return _ep(hidden_states, weights, topk_weights, topk_ids, config, mesh, axis_name, backend, capacity)


def _ep(hidden_states, weights, topk_weights, topk_ids, config, mesh, axis_name, backend, capacity):
    X.check_weights(weights, config)
    num_tokens = hidden_states.shape[0]
    if topk_ids.shape != (num_tokens, config.top_k) or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"ep_experts: topk_ids and topk_weights must be [T, top_k]=[{num_tokens}, {config.top_k}], "
            f"got {topk_ids.shape} and {topk_weights.shape}"
        )
    if axis_name not in mesh.shape:
        raise ValueError(f"ep_experts: axis_name: {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    plan = plan_ep(config, num_tokens, mesh.shape[axis_name], capacity)
    backend = resolve_backend(backend, "ep_experts")
    step = functools.partial(
        _step,
        config=config,
        plan=plan,
        axis_name=axis_name,
        backend=backend,
        exchange=_exchange(backend == "pallas"),
    )
    tokens = P(axis_name)
    specs = (tokens, weight_specs(weights, config, axis_name), tokens, tokens)
    mapped = jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(tokens, tokens), check_vma=False)
    explicit = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis_name] == jax.sharding.AxisType.Explicit
    place = jax.reshard if explicit else jax.lax.with_sharding_constraint  # (an Auto axis is a constraint)
    args = (hidden_states, weights, topk_weights, topk_ids)
    placed = jax.tree.map(lambda a, spec: place(a, NamedSharding(mesh, spec)), args, specs)
    return mapped(*placed)
