"""Expert parallelism over a device mesh axis, with optional balancing
(B copies of the most loaded experts a rank).

Each of the R ranks of ``axis_name`` holds ``E / R`` experts (rank r: global
experts ``[r·E/R, (r+1)·E/R)``) and ``S = T / R`` tokens. A step:

1. **dispatch** — each rank sorts its ``S·k`` routed slots by destination
   rank (then weight row) and sends every slot's row and weight-row id to the
   rank holding that expert (or its copy) with ``jax.lax.ragged_all_to_all``, into a static
   receive buffer of ``NvS = R·S·k`` rows (the worst case: every slot of every
   rank routed to one rank, so no routing can overflow it; with
   :func:`ep_experts_capped` fewer, and the slots that do not fit are counted
   and returned); rows arrive grouped by source rank;
2. **experts** — the rank runs its weight rows (its E/R experts, then its B
   copies, :func:`balance_plan`) on the received rows with the grouped
   pipeline (each slot is sent with its row's id; unused rows carry −1, an
   invalid slot, and give zeros);
3. **combine** — the reverse ``ragged_all_to_all`` returns each row to the
   slot it came from; the source rank applies the top-k weights and sums.

XLA's CPU backend has no ``ragged-all-to-all``: there (``backend`` other than
``"pallas"``) the same exchange runs as :func:`ragged_all_to_all_gathered`,
an ``all_gather`` of every rank's rows from which each rank takes its own —
the same result, R times the traffic (for tests on simulated devices). On
GPUs start the process with ``XLA_FLAGS=`` :data:`RAGGED_DECOMPOSER_FLAG`
(without it XLA's exchange is far slower; a warning says so once).
Inputs whose scales belong to their row (dynamic per token or per group:
fp8 per token, DeepSeek-V3's fp8 per 128) are quantized before the send and
travel as their 8-bit values with their scales (half a bf16 row's bytes);
other inputs travel as they are and are quantized on the receiving rank.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from humming_jax import experts as X
from humming_jax import input_quant as Q
from humming_jax.backend import resolve_backend
from humming_jax.configs import ExpertsConfig
from humming_jax.process_input import process_input

__all__ = [
    "RAGGED_DECOMPOSER_FLAG",
    "EPPlan",
    "balance_plan",
    "ep_experts",
    "ep_experts_capped",
    "ep_stages",
    "plan_ep",
    "ragged_all_to_all_gathered",
    "rank_loads",
    "shard_weights",
    "weight_specs",
]

# Without this pass XLA's GPU ragged-all-to-all is slow (notes/layer.md v2);
# XLA reads its flags at start-up, so the user sets it.
RAGGED_DECOMPOSER_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"

# Input modes whose scales belong to their row: quantized before the send.
ROW_SCALED_MODES = (Q.InputQuantMode.DYNAMIC_TOKEN, Q.InputQuantMode.DYNAMIC_GROUP)


def sends_quantized(config: ExpertsConfig) -> bool:
    """Whether the dispatch sends w13's input quantized (its scales belong to the row)."""
    return config.input_quant.is_quantized and config.input_quant.mode in ROW_SCALED_MODES


@dataclasses.dataclass(frozen=True)
class EPPlan:
    """Static sizes of one expert-parallel step (Python ints; :func:`plan_ep`).

    Attributes:
        num_ranks: R, the ranks of the axis.
        local_experts: E / R.
        tokens_per_rank: S = T / R.
        slots_per_rank: S·k.
        receive_rows: NvS, the rows a rank receives: R·S·k (the worst case) unless capped.
        redundant: B, the copy rows a rank holds.
    """

    num_ranks: int
    local_experts: int  # E / R
    tokens_per_rank: int  # S
    slots_per_rank: int  # S·k
    receive_rows: int  # NvS: R·S·k (every slot of every rank, the worst case) unless capped
    redundant: int = 0  # B: weight rows a rank holds for copies of other ranks' experts

    @property
    def weight_rows(self) -> int:
        """Expert rows a rank runs: its own E/R, then its B copies."""
        return self.local_experts + self.redundant

    @property
    def local(self) -> bool:
        """One rank holding every expert and receiving every slot: no exchange."""
        return self.num_ranks == 1 and self.receive_rows >= self.slots_per_rank


def plan_ep(
    config: ExpertsConfig, num_tokens: int, num_ranks: int, capacity: int | None = None, redundant: int = 0
) -> EPPlan:
    """The static sizes of an expert-parallel step.

    Args:
        config: the global layer's :class:`ExpertsConfig`.
        num_tokens: T, over every rank.
        num_ranks: R.
        capacity: rows a rank receives; None: the worst case, which no routing exceeds.
        redundant: B, the expert copies a rank may hold (:func:`balance_plan`).

    Returns:
        The :class:`EPPlan`.

    Raises:
        ValueError: the experts or the tokens do not divide over the ranks, or a bad capacity.
    """
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"plan_ep: num_ranks: expected a positive int, got {num_ranks!r}")
    if not isinstance(redundant, int) or isinstance(redundant, bool) or redundant < 0:
        raise ValueError(f"plan_ep: redundant: expected an int >= 0 (copies a rank holds), got {redundant!r}")
    if config.num_experts % num_ranks:
        raise ValueError(f"plan_ep: {config.num_experts} experts do not divide over {num_ranks} ranks")
    if num_tokens % num_ranks:
        raise ValueError(f"plan_ep: hidden_states: {num_tokens} tokens do not divide over {num_ranks} ranks")
    tokens = num_tokens // num_ranks
    slots = tokens * config.top_k
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
        raise ValueError(f"plan_ep: capacity: expected a positive int (rows a rank receives), got {capacity!r}")
    rows = num_ranks * slots if capacity is None else min(capacity, num_ranks * slots)
    return EPPlan(num_ranks, config.num_experts // num_ranks, tokens, slots, rows, redundant)


def balance_plan(counts: jax.Array, num_ranks: int, redundant: int) -> tuple[jax.Array, jax.Array]:
    """Which experts each rank copies (expert e lives on rank ``e // (E/R)``).

    R·B greedy steps, the same on every rank (a pure function of the counts):
    the most loaded rank gives its most loaded expert (the slots still served
    at home) to the least loaded rank with a free copy row, with a quota that
    brings neither past the target ``ceil(slots / R)`` (at most what stays at
    home). When the copy rows suffice every rank ends at most at the target,
    within one row of the average.

    Args:
        counts: int ``[E]``, the global slot count of every expert.
        num_ranks: R.
        redundant: B, the copy rows a rank holds.

    Returns:
        ``(copies [R, B] int32: the expert in each copy row, −1 unused;
        quota [R, B] int32: the slots each copy serves)``.
    """
    e = counts.shape[0]
    local = e // num_ranks
    home = counts.astype(jnp.int32)  # slots each expert still serves at home
    load = home.reshape(num_ranks, local).sum(axis=1)
    target = (jnp.sum(load) + num_ranks - 1) // num_ranks
    copies = jnp.full((num_ranks, redundant), -1, jnp.int32)
    quota = jnp.zeros((num_ranks, redundant), jnp.int32)
    used = jnp.zeros(num_ranks, jnp.int32)
    experts = jnp.arange(e, dtype=jnp.int32)
    for _ in range(num_ranks * redundant):
        donor = jnp.argmax(load)
        expert = jnp.argmax(jnp.where(experts // local == donor, home, -1)).astype(jnp.int32)
        free = used < redundant
        receiver = jnp.argmin(jnp.where(free, load, jnp.iinfo(jnp.int32).max))
        give = jnp.minimum(home[expert], jnp.minimum(load[donor] - target, target - load[receiver]))
        ok = free[receiver] & (give > 0)
        give = jnp.where(ok, give, 0)
        row = jnp.minimum(used[receiver], redundant - 1)
        copies = copies.at[receiver, row].set(jnp.where(ok, expert, copies[receiver, row]))
        quota = quota.at[receiver, row].set(jnp.where(ok, give, quota[receiver, row]))
        used = used.at[receiver].add(ok.astype(jnp.int32))
        load = load.at[donor].add(-give).at[receiver].add(give)
        home = home.at[expert].add(-give)
    return copies, quota


def rank_loads(counts, num_ranks: int, copies=None, quota=None) -> jax.Array:
    """The slots each rank serves: its experts' slots, less what their copies
    serve, plus what its own copies serve.

    Args:
        counts: int ``[E]``, the global slot count of every expert.
        num_ranks: R.
        copies: ``[R, B]`` of :func:`balance_plan`; None: no copies.
        quota: ``[R, B]`` of :func:`balance_plan`.

    Returns:
        int32 ``[R]``.
    """
    counts = jnp.asarray(counts, jnp.int32)
    local = counts.shape[0] // num_ranks
    loads = counts.reshape(num_ranks, local).sum(axis=1)
    if copies is None:
        return loads
    used = copies >= 0
    served = jnp.where(used, quota, 0)
    given = jnp.zeros(num_ranks, jnp.int32).at[jnp.where(used, copies // local, 0).reshape(-1)].add(served.reshape(-1))
    return loads + served.sum(axis=1) - given


def _slot_rows(ids, valid, base, copies, quota, local: int):
    """(rank, weight row) of each slot: an expert's slots in global order
    (``base``: the expert's slots on lower source ranks, then slot order here)
    fill its copies' quotas in copy order, the rest stay at home."""
    num_ranks, redundant = copies.shape
    e_of = jnp.where(valid, ids, 0)
    key = jnp.where(valid, ids, num_ranks * local)  # invalid slots last
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    # Each group's first position in the sorted order, from the keys' counts (a binary search
    # would be a loop of launches on the GPU).
    counts = jnp.zeros(num_ranks * local + 1, jnp.int32).at[key].add(1)
    first = (jnp.cumsum(counts) - counts)[sorted_key]
    occurrence = jnp.zeros_like(ids).at[order].set(jnp.arange(ids.shape[0], dtype=jnp.int32) - first)
    index = base[e_of] + occurrence  # the slot's place among its expert's slots, over every rank
    flat = copies.reshape(-1)
    mine = flat[None, :] == e_of[:, None]  # [slots, R·B]
    covered = jnp.cumsum(jnp.where(mine, quota.reshape(-1)[None, :], 0), axis=1)
    takes = mine & (index[:, None] < covered)
    has_copy = jnp.any(takes, axis=1) & valid
    j = jnp.argmax(takes, axis=1)
    rank = jnp.where(has_copy, j // max(redundant, 1), e_of // local)
    row = jnp.where(has_copy, local + j % max(redundant, 1), e_of % local)
    return jnp.where(valid, rank, num_ranks), jnp.where(valid, row, -1)


def ragged_all_to_all_gathered(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s result computed with ``all_gather``
    (for backends without the collective, such as XLA's CPU): every rank's rows
    and offsets are gathered and each rank writes the blocks addressed to it.

    Args:
        operand: the rank's rows ``[rows, ...]``.
        output: the receive buffer ``[out_rows, ...]`` (its other rows kept).
        input_offsets: int32 ``[R]``, where each destination's block starts in ``operand``.
        send_sizes: int32 ``[R]``, each block's rows.
        output_offsets: int32 ``[R]``, where each block lands on its destination.
        recv_sizes: int32 ``[R]`` (implied by the senders' sizes; unused).
        axis_name: the mesh axis (inside ``shard_map``).

    Returns:
        ``output`` with the blocks addressed to this rank written.
    """
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


def _per_expert(weights: X.ExpertWeights, config: ExpertsConfig):
    """A bool per array of ``weights``: whether it is per expert (``[E, …]``)."""
    return jax.tree.map(lambda a: a.shape[:1] == (config.num_experts,), weights)


def weight_specs(weights: X.ExpertWeights, config: ExpertsConfig, axis_name: str = "expert"):
    """How expert parallelism places a layer's weights.

    Args:
        weights: the global layer's :class:`ExpertWeights`.
        config: its :class:`ExpertsConfig`.
        axis_name: the mesh axis.

    Returns:
        A ``PartitionSpec`` per array of ``weights`` (a pytree of them):
        per-expert arrays (``[E, …]``) split by experts over ``axis_name``,
        per-tensor ones (static input scales) on every rank.
    """
    return jax.tree.map(lambda split: P(axis_name) if split else P(), _per_expert(weights, config))


def shard_weights(
    weights: X.ExpertWeights, config: ExpertsConfig, mesh: jax.sharding.Mesh, axis_name: str = "expert"
) -> X.ExpertWeights:
    """Place a layer's weights on ``mesh`` as :func:`ep_experts` reads them.

    Args:
        weights: the global layer's :class:`ExpertWeights`.
        config: its :class:`ExpertsConfig`.
        mesh: the device mesh.
        axis_name: the axis the experts split over.

    Returns:
        The weights, each rank holding its experts' arrays (:func:`weight_specs`).
    """
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


def _with_copies(weights: X.ExpertWeights, per_expert, copies, plan: EPPlan, me, axis_name: str, exchange):
    """The rank's weights with its B copy rows appended (``[E/R + B, …]`` for
    each per-expert array, as ``per_expert`` marks them): each copied expert's arrays sent by its home rank with one
    ragged exchange per array — copy rows in (receiver, row) order on the
    sender, by (home rank, row) on the receiver, then put in row order."""
    r, el, b = plan.num_ranks, plan.local_experts, plan.redundant
    flat = copies.reshape(-1)  # [R·B]: copy j is row j % B of rank j // B
    home = jnp.where(flat >= 0, flat // el, r)
    receiver = jnp.arange(r * b, dtype=jnp.int32) // b
    served = home == me  # the copies this rank sends, already in (receiver, row) order
    send_order = jnp.argsort(jnp.where(served, 0, 1), stable=True)
    sources = jnp.clip(flat[send_order] % el, 0, el - 1)
    send_sizes = jnp.sum((receiver[None, :] == jnp.arange(r)[:, None]) & served[None, :], axis=1).astype(jnp.int32)
    input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    mine = home.reshape(r, b)[me]  # my copy rows' home ranks
    recv_sizes = jnp.sum(mine[None, :] == jnp.arange(r)[:, None], axis=1).astype(jnp.int32)
    everyone = home.reshape(r, b)
    # Where sender h's block lands on receiver q: after q's copies homed on lower ranks.
    output_offsets = jnp.sum(everyone < me, axis=1).astype(jnp.int32)
    arrival = jnp.argsort(mine, stable=True)  # received position p holds copy row arrival[p]

    def move(a):
        operand = jnp.take(a, sources, axis=0)
        out = exchange(
            operand,
            jnp.zeros((b, *a.shape[1:]), a.dtype),
            input_offsets,
            send_sizes,
            output_offsets,
            recv_sizes,
            axis_name=axis_name,
        )
        return jnp.concatenate([a, jnp.zeros_like(out).at[arrival].set(out)], axis=0)

    return jax.tree.map(lambda a, split: move(a) if split else a, weights, per_expert)


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """What every per-rank part of a step needs (static)."""

    config: ExpertsConfig
    plan: EPPlan
    axis_name: str
    backend: str
    exchange: object
    per_expert: object  # a bool per weight array: per expert (split over the ranks)


def _dispatch(s: dict, ctx: _Ctx) -> dict:
    """One rank's dispatch (inside ``shard_map``): the copies planned and
    fetched (B > 0), its slots sorted by destination and sent; adds the
    received rows (``recv_rows``, ``recv_ids``, ``a1q_scale``), the weights
    with their copies and what the combine needs."""
    config, plan, axis_name, exchange = ctx.config, ctx.plan, ctx.axis_name, ctx.exchange
    r, el, k, rows = plan.num_ranks, plan.local_experts, config.top_k, plan.weight_rows
    me = jax.lax.axis_index(axis_name)
    ids = s["topk_ids"].reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < config.num_experts)
    weights = s["weights"]
    if plan.redundant:  # every rank plans the same copies from the gathered counts
        mine = jnp.zeros(config.num_experts, jnp.int32).at[jnp.where(valid, ids, 0)].add(valid.astype(jnp.int32))
        counts = jax.lax.all_gather(mine, axis_name)  # [source, expert]
        copies, quota = balance_plan(jnp.sum(counts, axis=0), r, plan.redundant)
        base = (jnp.cumsum(counts, axis=0) - counts)[me]
        dest, row = _slot_rows(ids, valid, base, copies, quota, el)
        weights = _with_copies(weights, ctx.per_expert, copies, plan, me, axis_name, exchange)
    else:
        dest, row = jnp.where(valid, ids // el, r), jnp.where(valid, ids % el, -1)  # invalid slots: no rank
    order = jnp.argsort(dest * rows + jnp.where(valid, row, 0), stable=True)
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

    def dispatch(operand, fill):
        """``operand``'s sorted rows to their ranks' receive buffers (``fill`` elsewhere)."""
        out = jnp.full((plan.receive_rows, *operand.shape[1:]), fill, operand.dtype)
        return exchange(operand, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)

    hidden_states = s["hidden_states"]
    out = dict(recv_ids=dispatch(row[order], -1))  # each slot's weight row on its destination
    if sends_quantized(config):
        # Quantized on the source (the same rows the receiver would make), sent as bytes with their scales.
        q = process_input(
            hidden_states,
            config.input_quant,
            hadamard_block_size=config.hadamard_block_size,
            compute_dtype=jnp.dtype(config.compute_dtype),
            backend=ctx.backend,
        )
        values = jax.lax.bitcast_convert_type(jnp.take(q.values, order // k, axis=0), jnp.uint8)
        out["recv_rows"] = jax.lax.bitcast_convert_type(dispatch(values, 0), q.values.dtype)
        out["a1q_scale"] = dispatch(jnp.take(q.scale, order // k, axis=0), 0)
    else:  # in the dtype the receivers compute in: a float32 input travels at half the bytes
        rows = jnp.take(hidden_states.astype(config.compute_dtype), order // k, axis=0)
        out["recv_rows"] = dispatch(rows, 0)
    return dict(
        out,
        copied_weights=weights,
        order=order,
        valid=valid,
        send_sizes=send_sizes,
        recv_sizes=recv_sizes,
        back_offsets=(jnp.cumsum(all_wanted, axis=1) - all_wanted)[:, me],  # where my block sat in each source
        dropped=jnp.sum(wanted - send_sizes).reshape(1),
    )


def _run_experts(s: dict, ctx: _Ctx) -> dict:
    """One rank's weight rows on its received rows (the grouped pipeline)."""
    rows = ctx.plan.weight_rows
    local_config = dataclasses.replace(ctx.config, num_experts=rows, top_k=1, global_num_experts=rows)
    out_rows = X.humming_grouped_experts(
        s["recv_rows"],
        _local_weights(s["copied_weights"], rows),
        jnp.ones((ctx.plan.receive_rows, 1), jnp.float32),
        s["recv_ids"][:, None],
        local_config,
        a1q_scale=s.get("a1q_scale"),
        backend=ctx.backend,
    )
    return dict(out_rows=out_rows)


def _combine(s: dict, ctx: _Ctx) -> dict:
    """Each receiver returns a source's block to where the source sent it
    from; the source weights its slots and sums them per token."""
    out_rows, k = s["out_rows"], ctx.config.top_k
    recv_sizes = s["recv_sizes"]
    returned = ctx.exchange(
        out_rows,
        jnp.zeros((ctx.plan.slots_per_rank, out_rows.shape[1]), out_rows.dtype),
        (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32),
        recv_sizes,
        s["back_offsets"],
        s["send_sizes"],
        axis_name=ctx.axis_name,
    )
    slots = jnp.zeros_like(returned).at[s["order"]].set(returned)  # back to slot order
    weighted = (
        slots.astype(jnp.float32).reshape(-1, k, slots.shape[1]) * s["topk_weights"].astype(jnp.float32)[..., None]
    )
    weighted = jnp.where(s["valid"].reshape(-1, k)[..., None], weighted, 0.0)
    # Rounded as the one-device layer's combine rounds, then in the input's dtype (as it returns).
    out = jnp.sum(weighted, axis=1).astype(ctx.config.compute_dtype)
    return dict(out=out.astype(s["hidden_states"].dtype))


EP_STAGES = (("dispatch", _dispatch), ("experts", _run_experts), ("combine", _combine))


def _rank_stages(ctx: _Ctx) -> tuple[X.Stage, ...]:
    """A rank's parts of the step as stages (run inside ``shard_map``)."""
    return tuple(X.Stage(name, functools.partial(part, ctx=ctx)) for name, part in EP_STAGES)


def _step(hidden_states, weights, topk_weights, topk_ids, *, ctx: _Ctx):
    """One rank's part of the layer (inside ``shard_map``)."""
    state = dict(hidden_states=hidden_states, weights=weights, topk_weights=topk_weights, topk_ids=topk_ids)
    state = X.run_stages(_rank_stages(ctx), state)
    return state["out"], state["dropped"]


@functools.cache
def _warn_without_decomposer() -> None:
    """Once a process: the exchange is slow unless XLA decomposes it."""
    if RAGGED_DECOMPOSER_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        warnings.warn(
            f"ep_experts: XLA's GPU ragged-all-to-all is slow without its decomposer; start the "
            f"process with XLA_FLAGS={RAGGED_DECOMPOSER_FLAG}",
            stacklevel=4,
        )


def _local_step(hidden_states, weights, topk_weights, topk_ids, *, config, backend):
    """One rank with every expert (inside ``shard_map``): the grouped pipeline."""
    out = X.humming_grouped_experts(hidden_states, weights, topk_weights, topk_ids, config, backend=backend)
    return out, jnp.zeros(1, jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "axis_name", "redundant_experts", "backend"))
def ep_experts(
    hidden_states: jax.Array,
    weights: X.ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    config: ExpertsConfig,
    mesh: jax.sharding.Mesh,
    axis_name: str = "expert",
    redundant_experts: int = 0,
    backend: str | None = None,
) -> jax.Array:
    """The expert layer over ``mesh``'s ``axis_name`` (see the module
    docstring). The receive buffers hold the worst case: no slot is ever
    dropped. On one rank the grouped pipeline runs (no exchange).

    Args:
        hidden_states: ``[T, H]``, sharded (or shardable) over the axis by tokens.
        weights: the global layer's :class:`ExpertWeights` (``[E, …]``), sharded
            over the axis by experts (:func:`shard_weights`).
        topk_weights: float ``[T, k]``, sharded by tokens.
        topk_ids: int32 ``[T, k]`` global ids (outside ``[0, E)``: nothing).
        config: the global layer's :class:`ExpertsConfig`.
        mesh: the device mesh.
        axis_name: the axis the experts and the tokens split over.
        redundant_experts: B > 0: each rank also holds B copies of other
            ranks' most loaded experts, planned every step from the routing
            (:func:`balance_plan`) and sent by their home ranks (B experts'
            weight bytes a rank a step), so the ranks' loads even out.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``[T, H]`` sharded by tokens.
    """
    args = (config, mesh, axis_name, backend, None, redundant_experts)
    out, _ = _ep(hidden_states, weights, topk_weights, topk_ids, *args)
    return out


@functools.partial(jax.jit, static_argnames=("config", "mesh", "capacity", "axis_name", "redundant_experts", "backend"))
def ep_experts_capped(
    hidden_states: jax.Array,
    weights: X.ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    config: ExpertsConfig,
    mesh: jax.sharding.Mesh,
    capacity: int,
    axis_name: str = "expert",
    redundant_experts: int = 0,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`ep_experts` with receive buffers of ``capacity`` rows a rank
    (less memory and a smaller local GEMM than the worst case R·S·k). A rank
    full at capacity takes the blocks of lower source ranks first, and of a
    block its first rows (lower experts); the slots it cannot take contribute
    nothing to their token.

    Args:
        hidden_states: ``[T, H]``, sharded by tokens.
        weights: the global layer's :class:`ExpertWeights`, sharded by experts.
        topk_weights: float ``[T, k]``.
        topk_ids: int32 ``[T, k]`` global ids.
        config: the global layer's :class:`ExpertsConfig`.
        mesh: the device mesh.
        capacity: the rows a rank receives.
        axis_name: the axis the experts and the tokens split over.
        redundant_experts: B, copies of the most loaded experts a rank holds.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``(out [T, H], dropped [R] int32)``: the slots each source rank could
        not deliver — the caller sees every drop.
    """
    args = (config, mesh, axis_name, backend, capacity, redundant_experts)
    return _ep(hidden_states, weights, topk_weights, topk_ids, *args)


def _ep(hidden_states, weights, topk_weights, topk_ids, config, mesh, axis_name, backend, capacity, redundant):
    X.check_weights(weights, config)
    X.check_routing_inputs(hidden_states, topk_weights, topk_ids, config, "ep_experts")
    num_tokens = hidden_states.shape[0]
    if axis_name not in mesh.shape:
        raise ValueError(f"ep_experts: axis_name: {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    plan = plan_ep(config, num_tokens, mesh.shape[axis_name], capacity, redundant)
    backend = resolve_backend(backend, "ep_experts")
    if backend == "pallas" and plan.num_ranks > 1:
        _warn_without_decomposer()
    ctx = _Ctx(config, plan, axis_name, backend, _exchange(backend == "pallas"), _per_expert(weights, config))
    step = functools.partial(_step, ctx=ctx)
    if plan.local:
        # One rank holds every expert and receives every slot: the exchange is a
        # reordering, the copies are its own experts — the local layer, the same result.
        step = functools.partial(_local_step, config=config, backend=backend)
    tokens = P(axis_name)
    specs = (tokens, weight_specs(weights, config, axis_name), tokens, tokens)
    mapped = jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(tokens, tokens), check_vma=False)
    return mapped(*_place((hidden_states, weights, topk_weights, topk_ids), specs, mesh, axis_name))


def _place(args, specs, mesh: jax.sharding.Mesh, axis_name: str):
    """``args`` laid out as ``specs`` say (an Explicit axis is resharded, an Auto one constrained)."""
    explicit = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis_name] == jax.sharding.AxisType.Explicit
    place = jax.reshard if explicit else jax.lax.with_sharding_constraint

    def along(spec, subtree):  # a spec applies to every array of its subtree (a prefix)
        return jax.tree.map(lambda a: place(a, NamedSharding(mesh, spec)), subtree)

    return jax.tree.map(along, specs, args, is_leaf=lambda x: isinstance(x, P))


def ep_stages(
    config: ExpertsConfig,
    mesh: jax.sharding.Mesh,
    weights: X.ExpertWeights,
    num_tokens: int,
    axis_name: str = "expert",
    redundant_experts: int = 0,
    backend: str | None = None,
) -> tuple[X.Stage, ...]:
    """:func:`ep_experts` as stages (``dispatch``, ``experts``, ``combine``; on
    one rank the grouped pipeline's) over the state ``hidden_states``,
    ``weights``, ``topk_weights``, ``topk_ids`` (as
    :func:`humming_jax.experts.grouped_stages`; the last adds ``out``), for
    timing each apart. Every entry a stage adds is a per-rank array laid end to
    end over the ranks.

    Args:
        config: the global layer's :class:`ExpertsConfig`.
        mesh: the device mesh.
        weights: the global layer's :class:`ExpertWeights` (for their specs).
        num_tokens: T, over every rank.
        axis_name: the axis the experts and the tokens split over.
        redundant_experts: B, copies of the most loaded experts a rank holds.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        A tuple of :class:`~humming_jax.experts.Stage`.
    """
    backend = resolve_backend(backend, "ep_experts")
    plan = plan_ep(config, num_tokens, mesh.shape[axis_name], None, redundant_experts)
    ctx = _Ctx(config, plan, axis_name, backend, _exchange(backend == "pallas"), _per_expert(weights, config))
    given = weight_specs(weights, config, axis_name)

    def mapped(rank_stage: X.Stage) -> X.Stage:
        def run(state):
            specs = {key: given if key == "weights" else P(axis_name) for key in state if state[key] is not None}
            # The grouped stages read these as None (an EP step takes neither).
            absent = {"expert_map": None, "a1q_scale": None} | {key: None for key in state if state[key] is None}

            def on_rank(arrays):
                return rank_stage.run({**arrays, **absent})

            step = jax.shard_map(on_rank, mesh=mesh, in_specs=(specs,), out_specs=P(axis_name), check_vma=False)
            return step(_place({key: state[key] for key in specs}, specs, mesh, axis_name))

        return X.Stage(rank_stage.name, run)

    if plan.local:  # as ep_experts: the local layer
        return tuple(mapped(stage) for stage in X.grouped_stages(config, backend))
    return tuple(mapped(stage) for stage in _rank_stages(ctx))
