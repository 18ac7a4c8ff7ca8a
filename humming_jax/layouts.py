"""GEMM layouts (DESIGN §3.6) as data: pytrees whose leaves are the routing
arrays and whose static part is what shapes depend on.

* :class:`GroupedContiguous` — rows ``[off[e], off[e+1])`` of ``x [M, K]``
  belong to expert e; rows outside every group come out zero.
* :class:`GroupedMasked` — ``x [E*max_tokens, K]``; expert e owns rows
  ``[e*max_tokens, e*max_tokens + count[e])``; other rows come out zero.
* :class:`Indexed` — block b of ``sorted_ids`` multiplies expert
  ``expert_ids[b]``; entry ``idx`` reads input row ``idx // top_k`` and
  writes output row ``idx``. Sentinels and blocks past ``num_tokens_padded``
  are skipped; output rows nobody writes are zero. Output has
  ``M_in * top_k`` rows. ``lists_dropped=True`` says the rows no live block
  writes are all listed (past ``num_tokens_padded`` or in blocks of expert
  -1), as :func:`humming_jax.moe_align_block_size` lists them;
  ``slot_order=True`` that the arrays are :func:`humming_jax.moe_slot_blocks`'s
  (slot s alone in block s), so a kernel may take each block's slot from its
  index instead of reading ``sorted_ids``; ``tile_by_expert=k`` (decode's
  few tokens, each with ``k`` slots) that a kernel may instead take one row
  tile an expert, a row a token, finding the slots from ``expert_ids``.
* :class:`Dense` — ``x [M, K] @ w[0].T`` (a weight with one expert).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from humming_jax.configs import GemmLayout


def _static(**default):
    return dataclasses.field(metadata=dict(static=True), **default)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedContiguous:
    """Each expert's rows contiguous: expert e owns rows ``[off[e], off[e+1])``
    of the offsets as read clipped to ``[0, M]`` and non-decreasing; rows no
    expert owns give zeros.

    Attributes:
        expert_offsets: int32 ``[E+1]``.
        normalized: the offsets are already in ``[0, M]`` and non-decreasing,
            as :func:`humming_jax.moe_prepare_scatter` and :func:`humming_jax.moe_permute`
            return them: read as they are (no clip and running maximum on the
            device). Offsets that break it give undefined rows.
    """

    expert_offsets: jax.Array  # int32 [E+1]
    normalized: bool = _static(default=False)
    kind = GemmLayout.GROUPED_CONTIGUOUS

    def output_rows(self, m_in: int) -> int:
        return m_in

    def owned_offsets(self, m_in: int) -> jax.Array:
        """The offsets as every backend reads them: clipped to ``[0, M]`` and
        made non-decreasing by a running maximum, so expert ``e`` owns rows
        ``[owned[e], owned[e+1])`` — none when its end precedes its start —
        and no row has two owners (a caller's or a dispatcher's offsets may be
        anything an int32 holds)."""
        offsets = self.expert_offsets.astype(jnp.int32)
        return offsets if self.normalized else jax.lax.cummax(jnp.clip(offsets, 0, m_in))

    def validate(self, m_in: int, num_experts: int) -> None:
        if self.expert_offsets.shape != (num_experts + 1,):
            raise ValueError(
                f"layout.expert_offsets: expected shape [E+1]=[{num_experts + 1}] for a weight with "
                f"{num_experts} experts, got {self.expert_offsets.shape}"
            )
        _check_int("layout.expert_offsets", self.expert_offsets)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedMasked:
    """``[E·max_tokens]`` rows, expert e's block the first ``counts[e]`` of its
    ``max_tokens`` (clipped); the other rows give zeros.

    Attributes:
        expert_num_tokens: int32 ``[E]``.
    """

    expert_num_tokens: jax.Array  # int32 [E]
    kind = GemmLayout.GROUPED_MASKED

    def output_rows(self, m_in: int) -> int:
        return m_in

    def validate(self, m_in: int, num_experts: int) -> None:
        if self.expert_num_tokens.shape != (num_experts,):
            raise ValueError(
                f"layout.expert_num_tokens: expected shape [E]=[{num_experts}], got {self.expert_num_tokens.shape}"
            )
        _check_int("layout.expert_num_tokens", self.expert_num_tokens)
        if m_in % num_experts:
            raise ValueError(f"x: grouped_masked input must have E*max_tokens rows (E={num_experts}), got {m_in}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Indexed:
    """Rows read and written by index (vLLM's indexed GEMM over
    :func:`moe_align_block_size`'s output): slot ``s`` of block ``b`` reads
    input row ``s // top_k`` and writes output row ``s`` through expert
    ``expert_ids[b]``; the output has ``M·top_k`` rows.

    Attributes:
        sorted_ids: int32 ``[L]``, slots grouped by expert.
        expert_ids: int32 ``[ceil(L / block_size)]``, each block's expert (−1: none).
        num_tokens_padded: int32 ``[1]``, the entries of ``sorted_ids`` in use.
        top_k: the slots per input row (static).
        block_size: the rows of a block (static).
        lists_dropped: the slots no live block holds are listed past
            ``num_tokens_padded`` (static; the GEMM then skips its zero fill).
        slot_order: the arrays are :func:`humming_jax.moe_slot_blocks`'s —
            block ``s`` holds slot ``s`` alone (static; a kernel may skip
            ``sorted_ids``; other arrays under it are a wrong answer).
        tile_by_expert: 0, or ``k``: the slot-ordered arrays are those of
            ``T = M·top_k / k`` tokens of ``k`` slots each, at most
            ``block_size`` of them (static). A kernel may then tile the rows
            by expert — row tile e holds every token's slots on expert e, a
            row a token — finding them in ``expert_ids`` (the ids ``[T, k]``
            flattened) with no grouping launched before it; the arrays stay a
            valid slot-ordered layout for any other reader.
    """

    sorted_ids: jax.Array  # int32 [L]
    expert_ids: jax.Array  # int32 [ceil(L / block_size)]
    num_tokens_padded: jax.Array  # int32 [1]
    top_k: int = _static()
    block_size: int = _static()
    # True when every slot that no live block holds is listed past
    # num_tokens_padded or in a block of expert -1 (moe_align_block_size's
    # layout): the GEMM then finds every row to zero and skips the zero fill.
    lists_dropped: bool = _static(default=False)
    slot_order: bool = _static(default=False)
    tile_by_expert: int = _static(default=0)
    kind = GemmLayout.INDEXED

    def output_rows(self, m_in: int) -> int:
        return m_in * self.top_k

    def validate(self, m_in: int, num_experts: int) -> None:
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"layout.top_k: expected a positive int, got {self.top_k!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"layout.block_size: expected a positive int, got {self.block_size!r}")
        if self.sorted_ids.ndim != 1:
            raise ValueError(f"layout.sorted_ids: expected a 1-D array, got shape {self.sorted_ids.shape}")
        blocks = -(-self.sorted_ids.shape[0] // self.block_size)
        if self.expert_ids.shape != (blocks,):
            raise ValueError(
                f"layout.expert_ids: expected shape [ceil(L/block_size)]=[{blocks}], got {self.expert_ids.shape}"
            )
        if not isinstance(self.lists_dropped, bool):
            raise ValueError(f"layout.lists_dropped: expected a bool, got {self.lists_dropped!r}")
        if not isinstance(self.slot_order, bool):
            raise ValueError(f"layout.slot_order: expected a bool, got {self.slot_order!r}")
        if self.slot_order and self.expert_ids.shape != (m_in * self.top_k,):
            raise ValueError(
                f"layout.expert_ids: slot_order puts each of the M·top_k={m_in * self.top_k} slots in its own "
                f"block, got shape {self.expert_ids.shape}"
            )
        if self.slot_order and not self.lists_dropped:
            raise ValueError("layout.lists_dropped: slot_order lists every slot in a block; expected True")
        self._validate_tile_by_expert(m_in)
        if self.num_tokens_padded.size != 1:
            raise ValueError(
                f"layout.num_tokens_padded: expected one element, got shape {self.num_tokens_padded.shape}"
            )
        for name in ("sorted_ids", "expert_ids", "num_tokens_padded"):
            _check_int(f"layout.{name}", getattr(self, name))

    def _validate_tile_by_expert(self, m_in: int) -> None:
        k = self.tile_by_expert
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"layout.tile_by_expert: expected 0 or the slots a token has, got {k!r}")
        if not k:
            return
        if not self.slot_order:
            raise ValueError("layout.tile_by_expert: tiles slot blocks (moe_slot_blocks); expected slot_order")
        slots = m_in * self.top_k
        if slots % k or slots // k > self.block_size:
            raise ValueError(
                f"layout.tile_by_expert: M·top_k={slots} slots are not whole tokens of {k} slots, at most "
                f"block_size={self.block_size} of them"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dense:
    """Every row through the one weight (``E = 1``)."""

    kind = GemmLayout.DENSE

    def output_rows(self, m_in: int) -> int:
        return m_in

    def validate(self, m_in: int, num_experts: int) -> None:
        if num_experts != 1:
            raise ValueError(f"weight: the dense layout takes a weight with one expert, got {num_experts}")


Layout = GroupedContiguous | GroupedMasked | Indexed | Dense


def _check_int(name: str, array: jax.Array) -> None:
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer array, got {array.dtype}")


def row_experts(layout: Layout, m_in: int) -> tuple[jax.Array, jax.Array]:
    """For the grouped and dense layouts: the expert of each input/output row
    and whether the row belongs to any group (``[M]`` int32 and bool)."""
    rows = jnp.arange(m_in, dtype=jnp.int32)
    if isinstance(layout, Dense):
        return jnp.zeros(m_in, jnp.int32), jnp.ones(m_in, bool)
    if isinstance(layout, GroupedContiguous):
        offsets = layout.owned_offsets(m_in)
        expert = jnp.sum(rows[:, None] >= offsets[None, 1:], axis=1).astype(jnp.int32)
        valid = (rows >= offsets[0]) & (rows < offsets[-1])
        return jnp.minimum(expert, offsets.shape[0] - 2), valid
    if isinstance(layout, GroupedMasked):
        num_experts = layout.expert_num_tokens.shape[0]
        max_tokens = m_in // num_experts
        expert = rows // max_tokens
        count = jnp.clip(layout.expert_num_tokens.astype(jnp.int32), 0, max_tokens)
        return expert, (rows % max_tokens) < count[expert]
    raise TypeError(f"row_experts: not a row-wise layout: {type(layout).__name__}")


def indexed_entries(layout: Indexed, m_in: int, num_experts: int):
    """For :class:`Indexed`: per entry of ``sorted_ids``, the input row, the
    output row, the expert, and whether the entry is live."""
    length = layout.sorted_ids.shape[0]
    position = jnp.arange(length, dtype=jnp.int32)
    idx = layout.sorted_ids.astype(jnp.int32)
    expert = layout.expert_ids.astype(jnp.int32)[position // layout.block_size]
    m_out = m_in * layout.top_k
    live = (
        (position < layout.num_tokens_padded.reshape(-1)[0])
        & (idx >= 0)
        & (idx < m_out)
        & (expert >= 0)
        & (expert < num_experts)
    )
    return jnp.where(live, idx // layout.top_k, 0), jnp.where(live, idx, m_out), jnp.where(live, expert, 0), live
