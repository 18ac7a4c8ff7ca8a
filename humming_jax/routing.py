"""Routing and data movement of the expert path: block alignment,
scatter/permute, unpermute and the fused weighted top-k sum (kernels:
``pallas_kernels/routing.py``, and ``routing_slot_space.py`` or
``routing_one_launch.py`` for T·k ≤ 128; notes: ``benchmarks/notes/routing.md``).

Conventions. ``topk_ids [T, k]`` holds global expert ids; the flattened slot
index is ``s = t*k + j``. A slot is *valid* when its id is in ``[0, E)`` and,
with an ``expert_map`` (global -> local id, -1 = not on this rank), maps to a
local expert. Invalid slots are never read out of bounds and contribute zero.
All integer outputs are int32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from humming_jax.backend import reference_gradient, resolve_backend
from pallas_kernels import routing as kernels
from pallas_kernels import routing_one_launch as one_launch
from pallas_kernels import routing_slot_space as slot_space


def align_length(num_slots: int, num_experts: int, block_size: int) -> int:
    """The static length of :func:`moe_align_block_size`'s ``sorted_ids`` (vLLM's rule).

    Args:
        num_slots: T·k.
        num_experts: E.
        block_size: the rows of a block.

    Returns:
        ``T·k + E·(block_size − 1)``, capped at ``T·k·block_size`` when ``T·k < E``.
    """
    length = num_slots + num_experts * (block_size - 1)
    if num_slots < num_experts:
        length = min(length, num_slots * block_size)
    return length


def _empty_or(chosen: str, size: int) -> str:
    """An empty batch (T=0: idle expert-parallel ranks, dynamic batching) has
    nothing to compute: its outputs are empty or zeros, which the reference
    builds from the static shapes (a kernel's grid would have no program)."""
    return "reference" if size == 0 else chosen


def _check_ids(topk_ids: jax.Array, op: str) -> None:
    if topk_ids.ndim != 2:
        raise ValueError(f"{op}: topk_ids must be [T, k], got shape {topk_ids.shape}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"{op}: topk_ids must be an integer array, got {topk_ids.dtype}")


def check_topk_weights(topk_weights: jax.Array, op: str) -> None:
    """Raise, naming ``op``, unless ``topk_weights`` are floats (router
    probabilities: integer weights are most likely the ids passed twice)."""
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"{op}: topk_weights must be a float array (the routed weights), got {topk_weights.dtype}")


def _check_routing(topk_ids: jax.Array, num_experts: int, expert_map: jax.Array | None, op: str) -> None:
    _check_ids(topk_ids, op)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if expert_map is not None:
        if expert_map.shape != (num_experts,):
            raise ValueError(f"{op}: expert_map must be [num_experts]=[{num_experts}], got shape {expert_map.shape}")
        if not jnp.issubdtype(expert_map.dtype, jnp.integer):
            raise TypeError(f"{op}: expert_map must be an integer array, got {expert_map.dtype}")


def _local_ids(topk_ids, num_experts, expert_map, num_local_experts):
    """Flattened per-slot local expert id and validity mask."""
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    in_range = (ids >= 0) & (ids < num_experts)
    if expert_map is None:
        return jnp.where(in_range, ids, 0), in_range
    local = jnp.where(in_range, expert_map.astype(jnp.int32)[jnp.where(in_range, ids, 0)], -1)
    valid = (local >= 0) & (local < num_local_experts)
    return jnp.where(valid, local, 0), valid


def _group_positions(group: jax.Array, valid: jax.Array, num_groups: int):
    """Per-group counts and each valid slot's stable rank inside its group."""
    counts = jnp.zeros(num_groups, jnp.int32).at[group].add(valid.astype(jnp.int32))
    # Stable sort by group, invalid slots last; a slot's rank is its position
    # in the sorted order minus the start of its group.
    order = jnp.argsort(jnp.where(valid, group, num_groups), stable=True)
    starts = jnp.cumsum(counts) - counts
    position_in_order = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    rank = position_in_order - starts[group]
    return counts, rank.astype(jnp.int32)


def _align_reference(topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts, num_local_experts):
    num_slots = topk_ids.size
    length = align_length(num_slots, num_experts, block_size)
    num_blocks = -(-length // block_size)
    if expert_map is not None and not ignore_invalid_experts:
        # Group by global id; blocks of non-local experts get expert -1 below.
        group, valid = _local_ids(topk_ids, num_experts, None, num_experts)
        num_groups = num_experts
    else:
        num_groups = num_local_experts if expert_map is not None else num_experts
        group, valid = _local_ids(topk_ids, num_experts, expert_map, num_groups)
    counts, rank = _group_positions(group, valid, num_groups)
    padded = (counts + block_size - 1) // block_size * block_size
    padded_starts = jnp.cumsum(padded) - padded
    # Dropped slots follow the padded groups, in slot order.
    dropped = jnp.sum(padded) + jnp.cumsum(~valid) - 1
    destination = jnp.where(valid, padded_starts[group] + rank, dropped)
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    sorted_ids = jnp.full(length, num_slots, jnp.int32).at[destination].set(slots, mode="drop")

    block_ends = jnp.cumsum(padded // block_size)
    blocks = jnp.arange(num_blocks, dtype=jnp.int32)
    block_group = jnp.searchsorted(block_ends, blocks, side="right").astype(jnp.int32)
    in_use = blocks < block_ends[-1]
    block_group = jnp.minimum(block_group, num_groups - 1)
    if expert_map is not None and not ignore_invalid_experts:
        block_expert = expert_map.astype(jnp.int32)[block_group]
    else:
        block_expert = block_group
    expert_ids = jnp.where(in_use, block_expert, -1)
    num_tokens_post_pad = jnp.sum(padded).reshape(1).astype(jnp.int32)
    return sorted_ids, expert_ids, num_tokens_post_pad


@functools.partial(
    jax.jit,
    static_argnames=("block_size", "num_experts", "ignore_invalid_experts", "num_local_experts", "backend"),
)
def moe_align_block_size(
    topk_ids: jax.Array,
    block_size: int,
    num_experts: int,
    expert_map: jax.Array | None = None,
    ignore_invalid_experts: bool = False,
    num_local_experts: int | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Group the slots of ``topk_ids`` by expert, each group padded to
    ``block_size`` (vLLM's ``moe_align_block_size``).

    Args:
        topk_ids: int ``[T, k]`` expert ids.
        block_size: the rows of a block (a GEMM tile's rows).
        num_experts: E, global.
        expert_map: optional int32 ``[E]`` → local expert or −1.
        ignore_invalid_experts: with ``expert_map``, drop non-local slots (see below).
        num_local_experts: the local experts (default ``num_experts``).
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``sorted_ids [L]`` int32 (slot indices grouped by expert, ascending
        inside an expert, each group padded to a multiple of ``block_size``
        with the sentinel ``T·k``), ``expert_ids [ceil(L/block_size)]`` int32
        (the expert of each block, −1 past the last used block) and
        ``num_tokens_post_pad [1]`` int32; ``L = align_length(T·k, E, block_size)``.

    Past ``num_tokens_post_pad``
    come the dropped slots in slot order, then the sentinel (vLLM leaves only
    sentinels there; its consumers read no further than
    ``num_tokens_post_pad``): a GEMM over ``Indexed(..., lists_dropped=True)``
    finds the rows to zero there instead of zero-filling its output first.
    There is room: the padded groups take at most ``L`` minus the dropped
    slots.

    Without ``expert_map`` groups are global ids. With one and
    ``ignore_invalid_experts=False`` slots are grouped by global id and blocks
    of non-local experts get expert -1; with ``ignore_invalid_experts=True``
    non-local slots are dropped and groups are local ids in
    ``[0, num_local_experts)`` (default ``num_experts``). Ids outside
    ``[0, num_experts)`` are always dropped.
    """
    _check_routing(topk_ids, num_experts, expert_map, "moe_align_block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"moe_align_block_size: block_size must be a positive int, got {block_size!r}")
    num_local = num_experts if num_local_experts is None else num_local_experts
    chosen = _empty_or(resolve_backend(backend, "moe_align_block_size"), topk_ids.size)
    if chosen == "reference":
        return _align_reference(topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts, num_local)
    map_groups = expert_map is not None and ignore_invalid_experts
    grouping = kernels.Grouping(
        num_slots=topk_ids.size,
        num_experts=num_experts,
        num_bins=num_local if map_groups else num_experts,
        has_map=expert_map is not None,
        map_groups=map_groups,
        block_size=block_size,
    )
    return _grouping_kernel(grouping, "sorted")(
        topk_ids,
        expert_map,
        grouping,
        outputs="sorted",
        length=align_length(topk_ids.size, num_experts, block_size),
        interpret=chosen == "interpret",
    )


# The slot-space kernel's work grows with slots², the bin-space one's with the bins.
SLOT_SPACE_MAX_SLOTS = 32  # slots it takes whatever the bins; beyond, while the slots are no more than the bins
# (half the bins for the scatter's destinations)


def moe_slot_blocks(topk_ids: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each slot its own block, in slot order: the arrays of an indexed layout
    that needs no grouping (decode, where a token's top-k experts differ, so
    grouping would find one slot an expert anyway). No grouping: the ids
    become the blocks' experts as they are (a GEMM finds a block whose expert
    is outside ``[0, E)`` dead and zeroes its row); the other two arrays follow
    from the shape, and a GEMM over ``slot_order=True`` on the Triton tile
    does not read them.

    Args:
        topk_ids: int ``[T, k]`` expert ids.
        block_size: the rows of a block (a GEMM tile's rows).

    Returns:
        ``sorted_ids [T·k·block_size]`` int32 (slot ``s`` first in block ``s``,
        the sentinel ``T·k`` after it), ``expert_ids [T·k]`` int32 (the ids)
        and ``num_tokens_post_pad [1]`` int32 ``= T·k·block_size``: the
        arguments of ``Indexed(..., lists_dropped=True, slot_order=True)``, as
        :func:`moe_align_block_size`'s are.
    """
    _check_ids(topk_ids, "moe_slot_blocks")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"moe_slot_blocks: block_size must be a positive int, got {block_size!r}")
    slots = topk_ids.size
    # From an iota, not a NumPy constant: a pipeline under custom partitioning may close
    # over no constant. (XLA does not fold iotas; the Triton tile does not read these two.)
    position = jnp.arange(slots * block_size, dtype=jnp.int32)
    sorted_ids = jnp.where(position % block_size == 0, position // block_size, slots)
    return sorted_ids, topk_ids.reshape(-1).astype(jnp.int32), jnp.full((1,), slots * block_size, jnp.int32)


def _grouping_kernel(grouping: kernels.Grouping, outputs: str):
    """The grouping kernel for these slots: one launch for few slots (decode) —
    in slot space when the slots are few against the bins, else counting every
    bin — else the three- or four-launch kernel (takes every call). The
    scatter's ``dest`` outputs add every bin's start to the slot-space work:
    there it needs twice the bins."""
    bins = grouping.total_bins // (2 if outputs == "dest" else 1)
    few = grouping.num_slots <= max(SLOT_SPACE_MAX_SLOTS, bins)
    if few and slot_space.supports(grouping) is None:
        return slot_space.group_slots
    return one_launch.group_slots if one_launch.supports(grouping) is None else kernels.group_slots


def _scatter_reference(topk_ids, num_experts, expert_map, num_local_experts):
    group, valid = _local_ids(topk_ids, num_experts, expert_map, num_local_experts)
    counts, rank = _group_positions(group, valid, num_local_experts)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    # Invalid slots follow all local ones, in slot order.
    invalid_rank = jnp.cumsum(~valid) - 1
    destination = jnp.where(valid, offsets[group] + rank, offsets[-1] + invalid_rank).astype(jnp.int32)
    return offsets, destination.reshape(topk_ids.shape)


def _scatter_kernel(topk_ids, num_experts, expert_map, num_local_experts, interpret):
    """Kernel path of the grouped-contiguous layout: (offsets, dest [T*k], inverse [T*k])."""
    grouping = kernels.Grouping(
        num_slots=topk_ids.size,
        num_experts=num_experts,
        num_bins=num_local_experts,
        has_map=expert_map is not None,
        map_groups=expert_map is not None,
        invalid_bin=True,
    )
    group_slots = _grouping_kernel(grouping, "dest")
    dest, inverse, bin_start = group_slots(topk_ids, expert_map, grouping, outputs="dest", interpret=interpret)
    return bin_start[: num_local_experts + 1], dest, inverse


@functools.partial(jax.jit, static_argnames=("num_experts", "num_local_experts", "backend"))
def moe_prepare_scatter(
    topk_ids: jax.Array,
    num_experts: int,
    expert_map: jax.Array | None = None,
    num_local_experts: int | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Offsets and destinations of the grouped-contiguous layout, moving no data.
    Local slots are grouped by local expert in slot order; invalid slots take
    the rows ``[off[-1], T·k)`` in slot order, so ``scatter_idx`` is a
    permutation of ``[0, T·k)``.

    Args:
        topk_ids: int ``[T, k]`` expert ids.
        num_experts: E, global.
        expert_map: optional int32 ``[E]`` → local expert or −1.
        num_local_experts: the local experts (default ``num_experts``).
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``(expert_first_token_offset [E_local+1], scatter_idx [T, k])``, int32:
        the rows of local expert e are ``[off[e], off[e+1])``; the row each slot goes to.
    """
    _check_routing(topk_ids, num_experts, expert_map, "moe_prepare_scatter")
    num_local = num_experts if num_local_experts is None else num_local_experts
    chosen = _empty_or(resolve_backend(backend, "moe_prepare_scatter"), topk_ids.size)
    if chosen == "reference":
        return _scatter_reference(topk_ids, num_experts, expert_map, num_local)
    offsets, dest, _ = _scatter_kernel(topk_ids, num_experts, expert_map, num_local, chosen == "interpret")
    return offsets, dest.reshape(topk_ids.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PermuteResult:
    """Output of :func:`moe_permute`.

    Attributes:
        permuted_hidden_states: ``[T·k, H]``; rows ``>= offsets[-1]`` are zero.
        permuted_scale: ``[T·k, S]`` (the carried input scale) or None.
        expert_first_token_offset: int32 ``[E_local+1]``.
        inv_permuted_idx: int32 ``[T·k]``, the row of slot s.
        permuted_idx: int32 ``[T·k]``, the slot of row r.
    """

    permuted_hidden_states: jax.Array  # [T*k, H]; rows >= offsets[-1] are zero
    permuted_scale: jax.Array | None  # [T*k, S] or None
    expert_first_token_offset: jax.Array  # [E_local+1]
    inv_permuted_idx: jax.Array  # [T*k]: row of slot s
    permuted_idx: jax.Array  # [T*k]: slot of row r


@functools.partial(jax.jit, static_argnames=("num_experts", "num_local_experts", "row_tiles", "backend"))
@reference_gradient(("num_experts", "num_local_experts", "row_tiles", "backend"))
def moe_permute(
    hidden_states: jax.Array,
    topk_ids: jax.Array,
    num_experts: int,
    expert_map: jax.Array | None = None,
    num_local_experts: int | None = None,
    a1q_scale: jax.Array | None = None,
    row_tiles: kernels.RowTiles | None = None,
    backend: str | None = None,
) -> PermuteResult:
    """Gather tokens into the grouped-contiguous layout (row ``scatter_idx[t, j]``
    holds token t), carrying an optional per-token input scale along.

    Args:
        hidden_states: ``[T, H]``, any dtype.
        topk_ids: int ``[T, k]`` expert ids.
        num_experts: E, global.
        expert_map: optional int32 ``[E]`` → local expert or −1.
        num_local_experts: the local experts (default ``num_experts``).
        a1q_scale: optional ``[T, S]`` scales (e.g. block-FP8 ``[T, H/128]``), moved
            with their rows, or one per-tensor scale ``[1]``, returned as it is.
        row_tiles: the kernel's tiling (``pallas_kernels.routing.RowTiles``); None: chosen.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        A :class:`PermuteResult`; rows of invalid slots (``>= offsets[-1]``) are zero.
    """
    _check_routing(topk_ids, num_experts, expert_map, "moe_permute")
    if hidden_states.ndim != 2 or hidden_states.shape[0] != topk_ids.shape[0]:
        raise ValueError(
            f"moe_permute: hidden_states must be [T, H] with T={topk_ids.shape[0]} (from topk_ids), "
            f"got shape {hidden_states.shape}"
        )
    per_tensor = a1q_scale is not None and a1q_scale.shape == (1,)
    if a1q_scale is not None and not per_tensor and (a1q_scale.ndim != 2 or a1q_scale.shape[0] != topk_ids.shape[0]):
        raise ValueError(
            f"moe_permute: a1q_scale must be [T, S] with T={topk_ids.shape[0]} or [1], got shape {a1q_scale.shape}"
        )
    num_local = num_experts if num_local_experts is None else num_local_experts
    chosen = _empty_or(resolve_backend(backend, "moe_permute"), topk_ids.size)
    top_k = topk_ids.shape[1]
    if chosen != "reference":
        interpret = chosen == "interpret"
        offsets, dest, inverse = _scatter_kernel(topk_ids, num_experts, expert_map, num_local, interpret)
        end = offsets[-1:]
        move = functools.partial(
            kernels.scatter_rows,
            dest=dest,
            end=end,
            top_k=top_k,
            tiles=row_tiles or kernels.RowTiles(),
            interpret=interpret,
        )
        scale = a1q_scale if a1q_scale is None or per_tensor else move(a1q_scale)
        return PermuteResult(move(hidden_states), scale, offsets, dest, inverse)
    offsets, scatter_idx = _scatter_reference(topk_ids, num_experts, expert_map, num_local)
    inv = scatter_idx.reshape(-1)
    slots = jnp.arange(inv.shape[0], dtype=jnp.int32)
    permuted_idx = jnp.zeros_like(inv).at[inv].set(slots)
    row_valid = (slots < offsets[-1])[:, None]

    def gather(rows: jax.Array) -> jax.Array:
        return jnp.where(row_valid, rows[permuted_idx // top_k], jnp.zeros((), rows.dtype))

    scale = a1q_scale if a1q_scale is None or per_tensor else gather(a1q_scale)
    return PermuteResult(gather(hidden_states), scale, offsets, inv, permuted_idx)


@functools.partial(jax.jit, static_argnames=("row_tiles", "backend"))
@reference_gradient(("row_tiles", "backend"))
def moe_unpermute(
    permuted_hidden_states: jax.Array,
    topk_weights: jax.Array,
    inv_permuted_idx: jax.Array,
    expert_first_token_offset: jax.Array,
    row_tiles: kernels.RowTiles | None = None,
    backend: str | None = None,
) -> jax.Array:
    """Weighted gather-reduce back to token order:
    ``out[t] = Σ_j w[t, j] · permuted[inv[t·k + j]]`` over slots whose row is
    below ``expert_first_token_offset[-1]`` (others contribute zero), f32 accumulation.

    Args:
        permuted_hidden_states: ``[T·k, H]`` rows in the grouped layout.
        topk_weights: float ``[T, k]``.
        inv_permuted_idx: int32 ``[T·k]``, the row of each slot.
        expert_first_token_offset: int32 ``[E_local+1]``.
        row_tiles: the kernel's tiling (``pallas_kernels.routing.RowTiles``); None: chosen.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``[T, H]`` in the dtype of ``permuted_hidden_states``.
    """
    if permuted_hidden_states.ndim != 2:
        raise ValueError(f"moe_unpermute: permuted_hidden_states must be [M, H], got {permuted_hidden_states.shape}")
    if topk_weights.ndim != 2:
        raise ValueError(f"moe_unpermute: topk_weights must be [T, k], got shape {topk_weights.shape}")
    check_topk_weights(topk_weights, "moe_unpermute")
    t, k = topk_weights.shape
    if inv_permuted_idx.shape != (t * k,):
        raise ValueError(f"moe_unpermute: inv_permuted_idx must be [T*k]=[{t * k}], got {inv_permuted_idx.shape}")
    if expert_first_token_offset.ndim != 1:
        raise ValueError(
            f"moe_unpermute: expert_first_token_offset must be [E+1], got shape {expert_first_token_offset.shape}"
        )
    chosen = _empty_or(resolve_backend(backend, "moe_unpermute"), inv_permuted_idx.size)
    if chosen != "reference":
        return kernels.weighted_gather(
            permuted_hidden_states,
            inv_permuted_idx,
            topk_weights,
            expert_first_token_offset[-1:],
            t,
            k,
            mode="unpermute",
            tiles=row_tiles or kernels.RowTiles(),
            interpret=chosen == "interpret",
        )
    m = permuted_hidden_states.shape[0]
    inv = inv_permuted_idx.astype(jnp.int32)
    valid = (inv >= 0) & (inv < jnp.minimum(expert_first_token_offset[-1], m))
    rows = permuted_hidden_states[jnp.where(valid, inv, 0)].astype(jnp.float32)
    weights = jnp.where(valid, topk_weights.reshape(-1).astype(jnp.float32), 0.0)
    rows = jnp.where(valid[:, None], rows, 0.0) * weights[:, None]
    return rows.reshape(t, k, permuted_hidden_states.shape[1]).sum(axis=1).astype(permuted_hidden_states.dtype)


@functools.partial(jax.jit, static_argnames=("num_experts", "row_tiles", "backend"))
@reference_gradient(("num_experts", "row_tiles", "backend"))
def moe_fused_mul_sum(
    inputs: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    num_experts: int,
    expert_map: jax.Array | None = None,
    num_valid_tokens: jax.Array | None = None,
    row_tiles: kernels.RowTiles | None = None,
    backend: str | None = None,
) -> jax.Array:
    """The weighted top-k sum ``out[t] = Σ_j w[t, j] · inputs[t, j]`` over
    valid slots, f32 accumulation: slots whose id is outside ``[0, E)`` or maps
    to −1 contribute zero.

    Args:
        inputs: ``[T, k, N]``, each slot's expert output.
        topk_weights: float ``[T, k]``.
        topk_ids: int ``[T, k]`` expert ids.
        num_experts: E, global.
        expert_map: optional int32 ``[E]`` → local expert or −1.
        num_valid_tokens: optional int32 ``[1]``; rows ``t >= num_valid_tokens[0]`` are zero.
        row_tiles: the kernel's tiling (``pallas_kernels.routing.RowTiles``); None: chosen.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``[T, N]`` in the dtype of ``inputs``.
    """
    _check_routing(topk_ids, num_experts, expert_map, "moe_fused_mul_sum")
    if inputs.ndim != 3 or inputs.shape[:2] != topk_ids.shape:
        raise ValueError(
            f"moe_fused_mul_sum: inputs must be [T, k, N] with [T, k]={topk_ids.shape}, got {inputs.shape}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moe_fused_mul_sum: topk_weights must be {topk_ids.shape}, got {topk_weights.shape}")
    check_topk_weights(topk_weights, "moe_fused_mul_sum")
    chosen = _empty_or(resolve_backend(backend, "moe_fused_mul_sum"), inputs.size)
    if chosen != "reference":
        num_tokens, top_k = topk_ids.shape
        bound = jnp.full((1,), num_tokens, jnp.int32) if num_valid_tokens is None else num_valid_tokens
        return kernels.weighted_gather(
            inputs,
            topk_ids,
            topk_weights,
            bound,
            num_tokens,
            top_k,
            mode="fused_mul_sum",
            num_experts=num_experts,
            expert_map=expert_map,
            tiles=row_tiles or kernels.RowTiles(),
            interpret=chosen == "interpret",
        )
    _, valid = _local_ids(topk_ids, num_experts, expert_map, num_experts)
    valid = valid.reshape(topk_ids.shape)
    if num_valid_tokens is not None:
        rows = jnp.arange(topk_ids.shape[0])[:, None]
        valid = valid & (rows < num_valid_tokens.reshape(-1)[0])
    weights = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
    products = jnp.where(valid[..., None], inputs.astype(jnp.float32), 0.0) * weights[..., None]
    return products.sum(axis=1).astype(inputs.dtype)
