"""Routing references against Python-loop NumPy implementations, with
hypothesis over random routings (empty experts, one hot expert, T=1, ids
outside [0, E), expert_map with -1 entries)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import humming_jax as hj
from humming_jax.routing import align_length
from humming_jax.tiles_text import from_text, to_text
from pallas_kernels.routing import RowTiles

import np_ref
from sweep import examples, sweep

# Every routing kernel's loads and stores checked against their buffers (see bounds).
pytestmark = pytest.mark.bounds

# The Pallas kernels: compiled on a GPU, in interpret mode on the CPU.
KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
BACKENDS = ["reference", KERNEL_BACKEND]


@st.composite
def routings(draw):
    """(topk_ids, num_experts, expert_map or None, num_local_experts)."""
    num_experts = draw(st.sampled_from([1, 8, 64, 256]))
    top_k = draw(st.sampled_from([1, 2, 8]))
    num_tokens = draw(st.sampled_from([1, 3, 16, 40, 300]))
    shape = draw(st.sampled_from(["uniform", "hot", "few", "out_of_range"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if shape == "hot":  # every slot on one expert
        ids = np.full((num_tokens, top_k), rng.integers(num_experts))
    elif shape == "few":  # most experts empty
        ids = rng.choice(rng.integers(0, num_experts, size=2), size=(num_tokens, top_k))
    else:
        ids = rng.integers(0, num_experts, size=(num_tokens, top_k))
    if shape == "out_of_range":
        bad = rng.random(ids.shape) < 0.2
        ids = np.where(bad, rng.choice([-1, num_experts, num_experts + 7, -100], size=ids.shape), ids)
    expert_map, num_local = None, num_experts
    if draw(st.booleans()):
        local = rng.random(num_experts) < 0.5
        num_local = max(int(local.sum()), 1)
        expert_map = np.full(num_experts, -1)
        expert_map[np.flatnonzero(local)] = np.arange(int(local.sum()))
    return ids.astype(np.int32), num_experts, expert_map, num_local


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(3, 2))  # up to three interpreted grouping kernels an example (x 2 backends)
@given(routings(), st.sampled_from([16, 32, 64, 128]), st.booleans())
def test_align_matches_loop(backend, routing, block_size, ignore_invalid):
    ids, num_experts, expert_map, num_local = routing
    sorted_ids, expert_ids, post_pad = hj.moe_align_block_size(
        jnp.asarray(ids),
        block_size,
        num_experts,
        expert_map=None if expert_map is None else jnp.asarray(expert_map, jnp.int32),
        ignore_invalid_experts=ignore_invalid,
        num_local_experts=num_local,
        backend=backend,
    )
    exp_sorted, exp_experts, exp_total = np_ref.align(
        ids, block_size, num_experts, expert_map, ignore_invalid, num_local
    )
    np.testing.assert_array_equal(np.asarray(sorted_ids), exp_sorted)
    np.testing.assert_array_equal(np.asarray(expert_ids), exp_experts)
    assert np.asarray(post_pad).tolist() == [exp_total]
    # Invariants, stated directly.
    length = align_length(ids.size, num_experts, block_size)
    assert sorted_ids.shape == (length,) and expert_ids.shape == (-(-length // block_size),)
    assert exp_total % block_size == 0 and exp_total <= length
    real = np.asarray(sorted_ids)[np.asarray(sorted_ids) < ids.size]
    assert len(set(real.tolist())) == len(real), "a slot appears twice"
    for b in range(exp_total // block_size):  # ascending slots inside each block
        block = np.asarray(sorted_ids)[b * block_size : (b + 1) * block_size]
        block = block[block < ids.size]
        assert np.all(np.diff(block) > 0)
    # Past the padded groups: each slot no group holds once, ascending, then the sentinel.
    held = set(np.asarray(sorted_ids)[:exp_total].tolist())
    dropped = [s for s in range(ids.size) if s not in held]
    tail = np.asarray(sorted_ids)[exp_total:]
    np.testing.assert_array_equal(tail[: len(dropped)], dropped)
    assert np.all(tail[len(dropped) :] == ids.size)


@pytest.mark.parametrize("block_size", [24, 384])
def test_align_to_a_block_size_that_is_no_power_of_two(block_size, rng):
    """Blocks of 24 (10 per 256 fill positions) and 384 (past a fill program's
    positions): every position and every block label written, as the loop says."""
    ids = rng.integers(-1, 9, size=(300, 2)).astype(np.int32)  # E=8: -1 and 8 are invalid
    got = hj.moe_align_block_size(jnp.asarray(ids), block_size, 8, backend=KERNEL_BACKEND)
    want = np_ref.align(ids, block_size, 8, None, False, None)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_align_example_by_hand(backend):
    ids = jnp.asarray([[2, 0], [2, 9], [0, 2]], jnp.int32)  # 9 is out of range for E=4
    sorted_ids, expert_ids, post_pad = hj.moe_align_block_size(ids, 4, 4, backend=backend)
    assert align_length(6, 4, 4) == 6 + 4 * 3
    # Slot 3 (id 9) is dropped: it follows the padded groups.
    np.testing.assert_array_equal(np.asarray(sorted_ids), [1, 4, 6, 6, 0, 2, 5, 6, 3] + [6] * 9)
    np.testing.assert_array_equal(np.asarray(expert_ids), [0, 2, -1, -1, -1])
    assert int(post_pad[0]) == 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_align_caps_length_when_few_slots(backend):
    sorted_ids, expert_ids, _ = hj.moe_align_block_size(jnp.asarray([[3]], jnp.int32), 16, 256, backend=backend)
    assert sorted_ids.shape == (16,) and expert_ids.shape == (1,)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(3, 2))  # five routing ops an example, interpreted
@given(routings())
def test_prepare_scatter_and_permute_round_trip(backend, routing):
    ids, num_experts, expert_map, num_local = routing
    emap = None if expert_map is None else jnp.asarray(expert_map, jnp.int32)
    offsets, scatter_idx = hj.moe_prepare_scatter(jnp.asarray(ids), num_experts, emap, num_local, backend=backend)
    exp_offsets, exp_dest = np_ref.prepare_scatter(ids, num_experts, expert_map, num_local)
    np.testing.assert_array_equal(np.asarray(offsets), exp_offsets)
    np.testing.assert_array_equal(np.asarray(scatter_idx), exp_dest)
    assert sorted(np.asarray(scatter_idx).reshape(-1).tolist()) == list(range(ids.size))  # a permutation

    rng = np.random.default_rng(ids.size)
    hidden = rng.normal(size=(ids.shape[0], 24)).astype(np.float32)
    scale = rng.random((ids.shape[0], 3)).astype(np.float32) + 0.5
    result = hj.moe_permute(
        jnp.asarray(hidden),
        jnp.asarray(ids),
        num_experts,
        emap,
        num_local,
        a1q_scale=jnp.asarray(scale),
        backend=backend,
    )
    np.testing.assert_array_equal(np.asarray(result.expert_first_token_offset), exp_offsets)
    np.testing.assert_array_equal(np.asarray(result.inv_permuted_idx), exp_dest.reshape(-1))
    permuted = np.asarray(result.permuted_hidden_states)
    permuted_scale = np.asarray(result.permuted_scale)
    top_k = ids.shape[1]
    for slot, row in enumerate(exp_dest.reshape(-1)):
        assert result.permuted_idx[row] == slot  # inverse permutation
        if row < exp_offsets[-1]:
            np.testing.assert_array_equal(permuted[row], hidden[slot // top_k])
            np.testing.assert_array_equal(permuted_scale[row], scale[slot // top_k])
    assert np.all(permuted[exp_offsets[-1] :] == 0) and np.all(permuted_scale[exp_offsets[-1] :] == 0)
    # One per-tensor scale [1] (fp8 static inputs): returned as it is, the rows moved as before.
    tensor_scale = jnp.asarray([0.75], jnp.float32)
    alone = hj.moe_permute(
        jnp.asarray(hidden), jnp.asarray(ids), num_experts, emap, num_local, a1q_scale=tensor_scale, backend=backend
    )
    np.testing.assert_array_equal(np.asarray(alone.permuted_scale), [0.75])
    np.testing.assert_array_equal(np.asarray(alone.permuted_hidden_states), permuted)

    # Unpermute with weights: weighted sum over valid slots, float64 check. The rows
    # past the last offset are poisoned: a workspace may hold anything there.
    weights = rng.random(ids.shape).astype(np.float32)
    poisoned = result.permuted_hidden_states.at[int(exp_offsets[-1]) :].set(np.nan)
    out = np.asarray(
        hj.moe_unpermute(
            poisoned,
            jnp.asarray(weights),
            result.inv_permuted_idx,
            result.expert_first_token_offset,
            backend=backend,
        )
    )
    valid = np.asarray(np_ref.slot_local_expert(ids, num_experts, expert_map)).reshape(ids.shape)
    valid = (valid >= 0) & (valid < num_local)
    expected = np.einsum("tj,th->th", np.where(valid, weights, 0).astype(np.float64), hidden.astype(np.float64))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@given(routings(), st.booleans())
def test_fused_mul_sum(backend, routing, bound_rows):
    ids, num_experts, expert_map, _ = routing
    rng = np.random.default_rng(ids.size + 1)
    t, k = ids.shape
    x = rng.normal(size=(t, k, 20)).astype(np.float32)
    weights = rng.random((t, k)).astype(np.float32)
    num_valid = rng.integers(0, t + 1) if bound_rows else None
    out = np.asarray(
        hj.moe_fused_mul_sum(
            jnp.asarray(x),
            jnp.asarray(weights),
            jnp.asarray(ids),
            num_experts,
            None if expert_map is None else jnp.asarray(expert_map, jnp.int32),
            None if num_valid is None else jnp.asarray([num_valid], jnp.int32),
            backend=backend,
        )
    )
    expected = np.zeros((t, 20))
    local = np.asarray(np_ref.slot_local_expert(ids, num_experts, expert_map)).reshape(t, k)
    for i in range(t if num_valid is None else num_valid):
        for j in range(k):
            if local[i, j] >= 0:
                expected[i] += float(weights[i, j]) * x[i, j].astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_map", [False, True])
def test_fused_mul_sum_keeps_what_it_drops_out(backend, with_map):
    """Slots that contribute nothing — ids outside [0, E), mapped to -1, tokens
    past ``num_valid_tokens`` — may hold NaN rows and NaN weights: the sum of
    the others stays finite and exact (they are selected away, not multiplied by 0)."""
    rng = np.random.default_rng(3)
    t, k, e = 5, 3, 4
    ids = np.array([[0, 1, 9], [2, -1, 3], [1, 1, 0], [3, 2, 1], [0, 0, 0]], np.int32)
    emap = np.array([0, -1, 1, 2], np.int32) if with_map else None
    x = rng.normal(size=(t, k, 32)).astype(np.float32)
    weights = rng.random((t, k)).astype(np.float32)
    local = np.asarray(np_ref.slot_local_expert(ids, e, emap)).reshape(t, k) >= 0
    local[4:] = False  # past num_valid_tokens
    x[~local], weights[~local] = np.nan, np.nan
    out = hj.moe_fused_mul_sum(
        jnp.asarray(x),
        jnp.asarray(weights),
        jnp.asarray(ids),
        e,
        None if emap is None else jnp.asarray(emap),
        jnp.asarray([4], jnp.int32),
        backend=backend,
    )
    expected = np.einsum("tj,tjh->th", np.where(local, weights, 0.0), np.where(local[..., None], x, 0.0))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_align_with_expert_map_marks_nonlocal_blocks(backend):
    ids = jnp.asarray([[0, 1], [1, 2]], jnp.int32)
    emap = jnp.asarray([-1, 0, -1], jnp.int32)
    _, expert_ids, post_pad = hj.moe_align_block_size(ids, 2, 3, expert_map=emap, backend=backend)
    np.testing.assert_array_equal(np.asarray(expert_ids)[: int(post_pad[0]) // 2], [-1, 0, -1])
    sorted_ids, expert_ids, post_pad = hj.moe_align_block_size(ids, 2, 3, emap, True, 1, backend=backend)
    np.testing.assert_array_equal(np.asarray(sorted_ids)[:4], [1, 2, 0, 3])  # slots 0 and 3 dropped
    assert int(post_pad[0]) == 2 and np.asarray(expert_ids).tolist() == [0, -1, -1, -1]


def test_routing_bad_input_raises():
    with pytest.raises(ValueError, match=r"topk_ids must be \[T, k\]"):
        hj.moe_align_block_size(jnp.zeros(4, jnp.int32), 16, 8)
    with pytest.raises(TypeError, match="topk_ids must be an integer"):
        hj.moe_prepare_scatter(jnp.zeros((4, 2)), 8)
    with pytest.raises(ValueError, match="expert_map must be"):
        hj.moe_prepare_scatter(jnp.zeros((4, 2), jnp.int32), 8, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="block_size"):
        hj.moe_align_block_size(jnp.zeros((4, 2), jnp.int32), 0, 8)
    with pytest.raises(ValueError, match="hidden_states must be"):
        hj.moe_permute(jnp.zeros((3, 8)), jnp.zeros((4, 2), jnp.int32), 8)
    with pytest.raises(ValueError, match=r"a1q_scale must be \[T, S\] with T=4 or \[1\], got shape \(2,\)"):
        hj.moe_permute(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), 8, a1q_scale=jnp.ones(2))
    with pytest.raises(ValueError, match="inv_permuted_idx"):
        hj.moe_unpermute(jnp.zeros((8, 4)), jnp.zeros((4, 2)), jnp.zeros(7, jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="inputs must be"):
        hj.moe_fused_mul_sum(jnp.zeros((4, 3, 8)), jnp.zeros((4, 2)), jnp.zeros((4, 2), jnp.int32), 8)
    ids = jnp.zeros((4, 2), jnp.int32)  # the ids passed as the weights
    with pytest.raises(TypeError, match="moe_unpermute: topk_weights must be a float array"):
        hj.moe_unpermute(jnp.zeros((8, 4)), ids, jnp.zeros(8, jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="moe_fused_mul_sum: topk_weights must be a float array"):
        hj.moe_fused_mul_sum(jnp.zeros((4, 2, 8)), ids, ids, 8)


# ---- kernel tilings (the op layer picks one; these pin down the others) ----------


# 256 experts: counts written by each bin's last slot; make test: each chunk size once.
@pytest.mark.parametrize(
    "chunk,num_experts",
    sweep([(c, e) for c in (128, 256, 512) for e in (64, 256)], [(128, 256), (256, 64), (512, 256)]),
)
def test_grouping_chunk_sizes_agree(chunk, num_experts, rng):
    """``group_slots`` with chunks of one to four pairwise-ranked sub-tiles: the
    aligned layout equals the NumPy loop (stable order, padding, invalid ids)."""
    from pallas_kernels import routing as kernels

    block_size = 16
    ids = rng.integers(-2, num_experts + 2, size=(300, 8)).astype(np.int32)
    ids[:40] = 5  # a hot expert spanning sub-tiles and chunks
    grouping = kernels.Grouping(ids.size, num_experts, num_experts, block_size=block_size)
    got = kernels.group_slots(
        jnp.asarray(ids),
        None,
        grouping,
        outputs="sorted",
        length=align_length(ids.size, num_experts, block_size),
        tiles=kernels.GroupingTiles(chunk=chunk),
        interpret=KERNEL_BACKEND == "interpret",
    )
    expected = np_ref.align(ids, block_size, num_experts, None, True, num_experts)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(g).reshape(-1), np.asarray(e).reshape(-1))


# Few slots: (T, k, E, block, expert map, routing); make test: a chosen case of each kind.
ONE_LAUNCH_CASES = [
    (1, 8, 256, 16, False, "uniform"),  # T=1
    (16, 8, 128, 16, True, "uniform"),  # qwen3 decode: 128 slots (the most one program takes), map with -1
    (16, 8, 128, 64, False, "hot"),  # one hot expert, every other empty
    (40, 2, 8, 24, True, "out_of_range"),  # a block that is no power of two; ids outside [0, E)
    (3, 2, 64, 384, False, "out_of_range"),  # one block past a fill program's positions
    (5, 1, 1, 16, False, "uniform"),  # one expert
]


ONE_LAUNCH_KERNELS = ("routing_slot_space", "routing_one_launch")


# make test: the map with -1 on both kernels; the hot expert and ids out of range on one each.
@pytest.mark.parametrize(
    "kernel_name,tokens,top_k,num_experts,block_size,with_map,shape",
    sweep(
        [(k, *case) for case in ONE_LAUNCH_CASES for k in ONE_LAUNCH_KERNELS],
        [(ONE_LAUNCH_KERNELS[i % 2], *case) for i, case in enumerate(ONE_LAUNCH_CASES[1:4])]
        + [(ONE_LAUNCH_KERNELS[1], *ONE_LAUNCH_CASES[1])],
    ),
)
def test_one_launch_grouping(kernel_name, tokens, top_k, num_experts, block_size, with_map, shape, rng):
    """Both one-launch groupings of at most 128 slots (what decode runs): the
    aligned layout, with the expert map grouping local ids or labelling
    blocks, equals the NumPy loop; the scatter destinations are the stable
    order by bin, invalid slots in the bin after the last."""
    import importlib

    from pallas_kernels import routing as kernels

    one_launch = importlib.import_module(f"pallas_kernels.{kernel_name}")

    ids = rng.integers(0, num_experts, size=(tokens, top_k))
    if shape == "hot":
        ids[:] = 5
    elif shape == "out_of_range":
        ids = np.where(rng.random(ids.shape) < 0.25, rng.choice([-1, num_experts, -100], size=ids.shape), ids)
    ids = ids.astype(np.int32)
    expert_map, num_local = None, num_experts
    if with_map:
        local = rng.random(num_experts) < 0.5
        local[ids.reshape(-1)[0] % num_experts] = True
        num_local = int(local.sum())
        expert_map = np.full(num_experts, -1, np.int32)
        expert_map[np.flatnonzero(local)] = np.arange(num_local)
    interpret = KERNEL_BACKEND == "interpret"
    maps = None if expert_map is None else jnp.asarray(expert_map)
    length = align_length(ids.size, num_experts, block_size)
    for map_groups in (False, True) if with_map else (False,):
        grouping = kernels.Grouping(
            ids.size,
            num_experts,
            num_local if map_groups else num_experts,
            has_map=with_map,
            map_groups=map_groups,
            block_size=block_size,
        )
        assert one_launch.supports(grouping) is None
        got = one_launch.group_slots(
            jnp.asarray(ids), maps, grouping, outputs="sorted", length=length, interpret=interpret
        )
        expected = np_ref.align(ids, block_size, num_experts, expert_map, map_groups, num_local)
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(g).reshape(-1), np.asarray(e).reshape(-1))

    grouping = kernels.Grouping(
        ids.size, num_experts, num_local, has_map=with_map, map_groups=with_map, invalid_bin=True
    )
    dest, inverse, starts = one_launch.group_slots(
        jnp.asarray(ids), maps, grouping, outputs="dest", interpret=interpret
    )
    flat = ids.reshape(-1)
    in_range = (flat >= 0) & (flat < num_experts)
    key = np.where(in_range, flat, num_experts)
    if with_map:
        key = np.where(in_range, expert_map[np.where(in_range, flat, 0)], -1)
        key = np.where(key >= 0, key, num_local)
    order = np.argsort(key, kind="stable")  # row r holds slot order[r]
    np.testing.assert_array_equal(np.asarray(inverse), order)
    np.testing.assert_array_equal(np.asarray(dest)[order], np.arange(flat.size))
    counts = np.bincount(key, minlength=num_local + 1)
    np.testing.assert_array_equal(np.asarray(starts)[: num_local + 2], np.concatenate([[0], np.cumsum(counts)]))


@pytest.mark.parametrize("kernel_name", ["routing_slot_space", "routing_one_launch"])
def test_one_launch_grouping_refuses_many_slots(kernel_name):
    import importlib

    from pallas_kernels import routing as kernels

    one_launch = importlib.import_module(f"pallas_kernels.{kernel_name}")
    assert one_launch.supports(kernels.Grouping(129, 8, 8, block_size=16)) == "129 slots: one program ranks at most 128"
    with pytest.raises(ValueError, match=f"{kernel_name}.group_slots: 129 slots"):
        one_launch.group_slots(jnp.zeros((129, 1), jnp.int32), None, kernels.Grouping(129, 8, 8), outputs="dest")


@pytest.mark.parametrize(
    "tokens,top_k,num_experts,outputs,expected",
    [
        (1, 8, 128, "sorted", "routing_slot_space"),  # qwen3 T=1: 8 slots against 128 bins
        (1, 8, 128, "dest", "routing_slot_space"),
        (16, 8, 128, "sorted", "routing_slot_space"),  # qwen3 T=16: 128 slots, 128 bins
        (16, 8, 128, "dest", "routing_one_launch"),  # the scatter: 129 bins (the invalid one), not twice 128
        (16, 8, 256, "dest", "routing_slot_space"),  # deepseek-v3 T=16: 128 slots, 257 bins
        (16, 2, 8, "dest", "routing_slot_space"),  # 32 slots: few whatever the bins
        (64, 2, 8, "sorted", "routing_one_launch"),  # mixtral T=64: 128 slots against 8 bins
        (65, 2, 8, "sorted", "routing"),  # 130 slots: the general kernel
    ],
)
def test_the_op_picks_the_grouping_kernel(tokens, top_k, num_experts, outputs, expected):
    """Each measured case (routing.md, v3 measured) to its faster kernel."""
    from humming_jax import routing as R
    from pallas_kernels import routing as kernels

    dest = outputs == "dest"
    grouping = kernels.Grouping(tokens * top_k, num_experts, num_experts, block_size=16, invalid_bin=dest)
    assert R._grouping_kernel(grouping, outputs).__module__ == f"pallas_kernels.{expected}"


@pytest.mark.parametrize("with_map", [False, True])
def test_scatter_lists_invalid_slots_after_the_bins(with_map, rng):
    """``moe_prepare_scatter`` on the general grouping kernel (600 slots over
    128 experts, ids outside ``[0, E)``, an ``expert_map`` with −1 and local
    ids): the invalid slots follow every expert's rows in slot order with no
    bin of their own, equal to the NumPy loop."""
    num_experts, num_local = 128, 96
    ids = rng.integers(-3, num_experts + 3, size=(75, 8)).astype(np.int32)
    ids[:6] = 7  # a hot expert over two chunks' first rows
    expert_map = None
    if with_map:
        expert_map = np.full(num_experts, -1, np.int32)
        expert_map[rng.permutation(num_experts)[:num_local]] = np.arange(num_local, dtype=np.int32)
    emap = None if expert_map is None else jnp.asarray(expert_map)
    local = num_local if with_map else None
    offsets, dest = hj.moe_prepare_scatter(jnp.asarray(ids), num_experts, emap, local, backend=KERNEL_BACKEND)
    want_offsets, want_dest = np_ref.prepare_scatter(ids, num_experts, expert_map, local or num_experts)
    np.testing.assert_array_equal(np.asarray(offsets), want_offsets)
    np.testing.assert_array_equal(np.asarray(dest), want_dest)


# make test: each output, bin count, expert count and prefix form twice.
@pytest.mark.parametrize(
    "prefix_bins,outputs,num_experts,unrolled_steps",
    sweep(
        [(b, o, e, u) for b in (16, 32) for o in ("sorted", "dest") for e in (64, 60) for u in (1, 16)],
        [(16, "sorted", 64, 16), (16, "dest", 60, 1), (32, "sorted", 60, 1), (32, "dest", 64, 16)],
    ),
)
def test_grouping_parallel_bin_prefix(outputs, prefix_bins, num_experts, unrolled_steps, rng):
    """A bin prefix spread over programs of 16 or 32 bins with a bin-starts
    launch after it (many chunks: 19 here, 4 per scan, 5 scans a bin tile),
    its steps unrolled with their loads issued 4 at a time or looped, for
    both layouts: the aligned layout equals the NumPy loop, and the scatter
    destinations are the stable order by expert (invalid ids in the bin
    after the last)."""
    from pallas_kernels import routing as kernels

    block_size = 16
    ids = rng.integers(-2, num_experts + 2, size=(300, 8)).astype(np.int32)
    ids[:40] = 5
    dest = outputs == "dest"  # moe_prepare_scatter's grouping: invalid ids in a bin after the last, no padding
    grouping = kernels.Grouping(
        ids.size, num_experts, num_experts, invalid_bin=dest, block_size=1 if dest else block_size
    )
    tiles = kernels.GroupingTiles(chunk_tile=4, prefix_bins=prefix_bins, unrolled_steps=unrolled_steps)
    length = align_length(ids.size, num_experts, block_size)
    got = kernels.group_slots(
        jnp.asarray(ids),
        None,
        grouping,
        outputs=outputs,
        length=length if outputs == "sorted" else 0,
        tiles=tiles,
        interpret=KERNEL_BACKEND == "interpret",
    )
    if outputs == "sorted":
        expected = np_ref.align(ids, block_size, num_experts, None, True, num_experts)
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(g).reshape(-1), np.asarray(e).reshape(-1))
        return
    flat = ids.reshape(-1)
    key = np.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = np.argsort(key, kind="stable")  # row r holds slot order[r]
    np.testing.assert_array_equal(np.asarray(got[1]), order)
    np.testing.assert_array_equal(np.asarray(got[0])[order], np.arange(flat.size))


def test_row_tiles_shrink_for_small_grids():
    from pallas_kernels import routing as kernels

    default = kernels.RowTiles()  # the H200 sweep's winner (4 tokens x 256 columns x 4 warps)
    assert (default.block_tokens, default.block_cols, default.num_warps) == (4, 256, 4)
    tiles = kernels.RowTiles(block_tokens=16, block_cols=512)
    assert tiles.fit(7168).block_tokens == 16  # no token count: unchanged
    assert tiles.fit(7168, 16384).block_tokens == 16  # 1024 x 14 programs
    assert tiles.fit(7168, 512).block_tokens == 4  # 128 x 14 programs at most
    assert tiles.fit(100, 3).block_cols == 128 and tiles.fit(100, 3).block_tokens == 4


@pytest.mark.parametrize("block_tokens", [4, 16])
def test_row_ops_with_either_token_tile(block_tokens, rng):
    """scatter_rows and both weighted_gather modes with 4- and 16-token tiles
    against float64 NumPy (ragged last tile: 37 tokens)."""
    from pallas_kernels import routing as kernels

    interpret = KERNEL_BACKEND == "interpret"
    tiles = kernels.RowTiles(block_tokens=block_tokens, block_cols=128, min_block_tokens=block_tokens)
    tokens, top_k, cols = 37, 2, 200
    x = rng.normal(size=(tokens, cols)).astype(np.float32)
    dest = rng.permutation(tokens * top_k).astype(np.int32)
    end = tokens * top_k - 5  # the last 5 destinations are not local: zeros
    out = np.asarray(
        kernels.scatter_rows(
            jnp.asarray(x), jnp.asarray(dest), jnp.asarray([end]), top_k, tiles=tiles, interpret=interpret
        )
    )
    expected = np.zeros((tokens * top_k, cols))
    for slot, row in enumerate(dest):
        if row < end:
            expected[row] = x[slot // top_k]
    np.testing.assert_array_equal(out, expected)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    poisoned = out.copy()
    poisoned[end:] = np.nan  # rows past the bound are never read
    gathered = np.asarray(
        kernels.weighted_gather(
            jnp.asarray(poisoned),
            jnp.asarray(dest),
            jnp.asarray(weights),
            jnp.asarray([end]),
            tokens,
            top_k,
            mode="unpermute",
            tiles=tiles,
            interpret=interpret,
        )
    )
    valid = (dest < end).reshape(tokens, top_k)
    want = np.einsum("tj,th->th", np.where(valid, weights, 0).astype(np.float64), x.astype(np.float64))
    np.testing.assert_allclose(gathered, want, rtol=1e-6, atol=1e-6)
    per_slot = rng.normal(size=(tokens, top_k, cols)).astype(np.float32)
    experts = rng.integers(-1, 5, size=(tokens, top_k)).astype(np.int32)
    fused = np.asarray(
        kernels.weighted_gather(
            jnp.asarray(per_slot),
            jnp.asarray(experts),
            jnp.asarray(weights),
            jnp.asarray([30]),
            tokens,
            top_k,
            mode="fused_mul_sum",
            num_experts=4,
            tiles=tiles,
            interpret=interpret,
        )
    )
    live = (experts >= 0) & (experts < 4) & (np.arange(tokens)[:, None] < 30)
    want = np.einsum("tj,tjh->th", np.where(live, weights, 0).astype(np.float64), per_slot.astype(np.float64))
    np.testing.assert_allclose(fused, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "row_tiles", ["block_tokens=2,block_cols=2048,num_warps=8", "block_tokens=8,block_cols=64,num_warps=2"]
)
def test_row_ops_take_row_tiles(row_tiles, rng):
    """``row_tiles`` changes only the tiling: permute, unpermute and
    fused_mul_sum equal the reference exactly (38 tokens, E=8, k=2, H=192)."""
    tiles = from_text(RowTiles, row_tiles)
    tokens, experts, top_k, hidden = 38, 8, 2, 192
    ids = jnp.asarray(rng.integers(-1, experts + 2, size=(tokens, top_k)), jnp.int32)  # some ids out of range
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    got = hj.moe_permute(x, ids, experts, row_tiles=tiles, backend=KERNEL_BACKEND)
    ref = hj.moe_permute(x, ids, experts, backend="reference")
    np.testing.assert_array_equal(np.asarray(got.permuted_hidden_states), np.asarray(ref.permuted_hidden_states))
    args = (ref.permuted_hidden_states, weights, ref.inv_permuted_idx, ref.expert_first_token_offset)
    np.testing.assert_allclose(
        np.asarray(hj.moe_unpermute(*args, row_tiles=tiles, backend=KERNEL_BACKEND)),
        np.asarray(hj.moe_unpermute(*args, backend="reference")),
        rtol=1e-6,
        atol=1e-6,
    )
    per_slot = jnp.asarray(rng.normal(size=(tokens, top_k, hidden)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(hj.moe_fused_mul_sum(per_slot, weights, ids, experts, row_tiles=tiles, backend=KERNEL_BACKEND)),
        np.asarray(hj.moe_fused_mul_sum(per_slot, weights, ids, experts, backend="reference")),
        rtol=1e-6,
        atol=1e-6,
    )


def test_row_tiles_config_rejects_bad_tiles():
    with pytest.raises(ValueError, match="block_cols"):
        RowTiles(16, 8, 4)
    with pytest.raises(ValueError, match="block_tokens"):
        RowTiles(12, 512, 4)
    with pytest.raises(ValueError, match="name=value"):
        from_text(RowTiles, "16x512")
    assert to_text(from_text(RowTiles, "block_tokens=8,block_cols=1024,num_warps=8")) == (
        "block_tokens=8,block_cols=1024,num_warps=8"
    )


def test_slot_blocks_against_numpy(rng):
    """``moe_slot_blocks``: slot s first in block s, the sentinel T·k after it,
    the ids as the blocks' experts (invalid ones included: the GEMM finds their
    blocks dead), every entry in use; T=0 gives empty arrays; bad arguments
    name themselves."""
    ids = rng.integers(-2, 10, size=(3, 4)).astype(np.int32)
    sorted_ids, expert_ids, padded = hj.moe_slot_blocks(jnp.asarray(ids), 16)
    want = np.full((12, 16), 12, np.int32)
    want[:, 0] = np.arange(12)
    np.testing.assert_array_equal(np.asarray(sorted_ids), want.reshape(-1))
    np.testing.assert_array_equal(np.asarray(expert_ids), ids.reshape(-1))
    np.testing.assert_array_equal(np.asarray(padded), [12 * 16])
    empty = hj.moe_slot_blocks(jnp.zeros((0, 4), jnp.int32), 16)
    assert [a.shape for a in empty] == [(0,), (0,), (1,)] and int(empty[2][0]) == 0
    with pytest.raises(ValueError, match=r"moe_slot_blocks: topk_ids must be \[T, k\]"):
        hj.moe_slot_blocks(jnp.zeros(4, jnp.int32), 16)
    with pytest.raises(TypeError, match="moe_slot_blocks: topk_ids must be an integer array"):
        hj.moe_slot_blocks(jnp.zeros((1, 4), jnp.float32), 16)
    with pytest.raises(ValueError, match="moe_slot_blocks: block_size must be a positive int"):
        hj.moe_slot_blocks(jnp.zeros((1, 4), jnp.int32), 0)
