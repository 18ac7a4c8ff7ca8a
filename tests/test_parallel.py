"""Expert parallelism over simulated CPU devices (tests/conftest.py asks XLA
for eight): the EP layer equals the single-device grouped layer — same
weights and routing — bit for bit, on 1, 2, 4 and 8 ranks; a capped receive
buffer drops exactly the slots its rule says and counts them."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import experts as X
from humming_jax import parallel
from humming_jax.configs import ExpertsConfig

from sweep import FULL

E, H, INTER, TOP_K, T = 8, 64, 32, 2, 16


def _layer(rng, fmt, input_quant="none"):
    config = ExpertsConfig(E, H, INTER, TOP_K, weight_format=fmt, input_quant=input_quant)
    w13 = jnp.asarray(rng.normal(size=(E, 2 * INTER, H)) / 8, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(E, H, INTER)) / 6, jnp.float32)
    return config, X.quantize_experts(w13, w2, config)


def _routing(rng, skewed: bool):
    ids = rng.integers(0, E, (T, TOP_K)).astype(np.int32)
    if skewed:  # one expert takes most slots: one rank receives most rows
        ids[: T - 2, 0] = 5
    ids[3, 1] = E + 1  # an id outside [0, E): an invalid slot, no contribution
    weights = rng.random((T, TOP_K)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(weights)


def _mesh(ranks: int):
    """A mesh of ``ranks`` devices. The CPU has eight simulated ones (conftest);
    a GPU machine has what it has: more ranks than GPUs is the multi-GPU issue's run."""
    if jax.device_count() < ranks:
        if jax.default_backend() == "cpu":
            pytest.fail(f"needs {ranks} devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (conftest)")
        pytest.skip(f"needs {ranks} GPUs, this machine has {jax.device_count()}")
    return jax.make_mesh((ranks,), ("expert",), devices=jax.devices()[:ranks])


@pytest.mark.parametrize(
    "ranks,fmt,input_quant",
    [
        (1, "bf16", "none"),
        (2, "bf16", "none"),
        # (make test: int4 weights on four ranks in the balanced test below)
        pytest.param(8, "int4_g32", "none", marks=FULL),
        (4, "fp8_channel", "fp8_dynamic_token"),
    ],
)
def test_ep_layer_equals_the_single_device_layer(ranks, fmt, input_quant, rng):
    mesh = _mesh(ranks)
    config, weights = _layer(rng, fmt, input_quant)
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    for skewed in (False, True):
        ids, topk_weights = _routing(rng, skewed)
        want = X.humming_grouped_experts(x, weights, topk_weights, ids, config, backend="reference")
        got = parallel.ep_experts(x, weights, topk_weights, ids, config, mesh, backend="reference")
        assert got.shape == (T, H) and got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(
    "fmt,input_quant",
    [
        ("bf16", "none"),
        pytest.param("int4_g32", "none", marks=FULL),
        pytest.param("fp8_channel", "fp8_dynamic_token", marks=FULL),
    ],
)
def test_ep_layer_over_every_device(fmt, input_quant, rng):
    """The multi-GPU run's check (issue 34) over every device the machine has
    (the CPU: its eight simulated ones): the EP layer, uniform and skewed
    routing, with and without a copy of the hot expert a rank, equals the
    single-device layer — bit for bit on the reference; on a GPU also with
    the kernels compiled and the rows crossing its links, within a bf16
    rounding of the single-device kernels (their tilings may differ)."""
    ranks = max(r for r in range(1, jax.device_count() + 1) if E % r == 0 and T % r == 0)
    mesh = _mesh(ranks)
    config, weights = _layer(rng, fmt, input_quant)
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    backends = ("reference", None) if jax.default_backend() == "gpu" else ("reference",)
    for skewed in (False, True):
        ids, topk_weights = _routing(rng, skewed)
        for backend in backends:
            want = np.asarray(
                X.humming_grouped_experts(x, weights, topk_weights, ids, config, backend=backend), np.float64
            )
            for redundant in (0, 1):
                got = parallel.ep_experts(
                    x, weights, topk_weights, ids, config, mesh, redundant_experts=redundant, backend=backend
                )
                got = np.asarray(got, np.float64)
                if backend == "reference":
                    np.testing.assert_array_equal(got, want)
                else:
                    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want), (fmt, skewed, redundant)


def test_ep_layer_on_the_kernels_compiles_once(rng):
    """The default backend (the kernels: interpreted with the all_gather
    exchange on the CPU, compiled with ``ragged_all_to_all`` on a GPU) and one
    compilation across routings, uniform and skewed."""
    config, weights = _layer(rng, "int4_g32")
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    mesh = _mesh(min(2, jax.device_count()))
    parallel.ep_experts.clear_cache()
    for skewed in (False, True):
        ids, topk_weights = _routing(rng, skewed)
        want = X.humming_grouped_experts(x, weights, topk_weights, ids, config)
        got = parallel.ep_experts(x, weights, topk_weights, ids, config, mesh)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert parallel.ep_experts._cache_size() == 1


def test_gathered_exchange_is_ragged_all_to_all():
    """The all_gather form of the exchange (backends without the collective):
    rank m's buffer holds each source's block for m at the sender's offset."""
    ranks = 4
    mesh = _mesh(ranks)
    sizes = np.array([[2, 1, 1, 0], [0, 0, 0, 0], [0, 2, 1, 2], [1, 1, 2, 2]], np.int32)  # [source, dest]
    rows = 6

    def step(x, send):
        send = send.reshape(ranks)
        me = jax.lax.axis_index("expert")
        every = jax.lax.all_gather(send, "expert")
        out_off = jnp.sum(jnp.where(jnp.arange(ranks)[:, None] < me, every, 0), axis=0).astype(jnp.int32)
        in_off = (jnp.cumsum(send) - send).astype(jnp.int32)
        out = jnp.full((rows * ranks,), -1.0)
        return parallel.ragged_all_to_all_gathered(x, out, in_off, send, out_off, every[:, me], axis_name="expert")

    x = jnp.arange(ranks * rows, dtype=jnp.float32)
    spec = jax.sharding.PartitionSpec("expert")
    placed = [jax.reshard(a, jax.sharding.NamedSharding(mesh, spec)) for a in (x, jnp.asarray(sizes.reshape(-1)))]
    got = np.asarray(jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(*placed))
    got = got.reshape(ranks, rows * ranks)
    for dest in range(ranks):
        want = []
        for source in range(ranks):
            start = sizes[source, :dest].sum()
            want += list(range(source * rows + start, source * rows + start + sizes[source, dest]))
        np.testing.assert_array_equal(got[dest, : len(want)], want)
        assert np.all(got[dest, len(want) :] == -1)


def test_plan_and_bad_arguments(rng):
    config, weights = _layer(rng, "bf16")
    plan = parallel.plan_ep(config, T, 4)
    assert (plan.local_experts, plan.tokens_per_rank, plan.slots_per_rank, plan.receive_rows) == (2, 4, 8, 32)
    with pytest.raises(ValueError, match="experts do not divide"):
        parallel.plan_ep(config, T, 3)
    with pytest.raises(ValueError, match="tokens do not divide"):
        parallel.plan_ep(config, 6, 4)
    assert parallel.plan_ep(config, T, 4, redundant=2).weight_rows == 4
    with pytest.raises(ValueError, match="redundant"):
        parallel.plan_ep(config, T, 4, redundant=-1)
    x = jnp.zeros((T, H), jnp.bfloat16)
    ids, topk_weights = _routing(rng, False)
    with pytest.raises(ValueError, match="axis_name"):
        parallel.ep_experts(x, weights, topk_weights, ids, config, _mesh(2), axis_name="data")
    with pytest.raises(ValueError, match="ep_experts: topk_ids"):
        parallel.ep_experts(x, weights, topk_weights[:, :1], ids[:, :1], config, _mesh(2))
    # The layer's own arguments named, not a rank's share of them.
    with pytest.raises(ValueError, match=r"ep_experts: hidden_states must be \[T, H=64\], got \(16, 32\)"):
        parallel.ep_experts(x[:, :32], weights, topk_weights, ids, config, _mesh(2))
    with pytest.raises(ValueError, match="ep_experts: hidden_states: int8 values"):
        parallel.ep_experts(x.astype(jnp.int8), weights, topk_weights, ids, config, _mesh(2))
    # A float32 input comes back float32: the bf16 input's values, cast.
    values = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    want = parallel.ep_experts(values, weights, topk_weights, ids, config, _mesh(2))
    got = parallel.ep_experts(values.astype(jnp.float32), weights, topk_weights, ids, config, _mesh(2))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.float32)))


def _expected_drops(ids: np.ndarray, ranks: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids with the slots a capped exchange drops set to -1, drops per source
    rank), by the documented rule: a receiver takes the sources in rank order
    and of each block (sorted by expert) its first rows."""
    tokens = ids.shape[0] // ranks
    local = E // ranks
    kept = ids.copy()
    filled = np.zeros(ranks, np.int64)
    drops = np.zeros(ranks, np.int64)
    for source in range(ranks):
        flat = ids[source * tokens : (source + 1) * tokens].reshape(-1)
        valid = (flat >= 0) & (flat < E)
        dest = np.where(valid, flat // local, ranks)
        order = np.argsort(dest * E + np.where(valid, flat, 0), kind="stable")
        for dest_rank in range(ranks):
            slots = [slot for slot in order if dest[slot] == dest_rank]
            room = max(0, capacity - filled[dest_rank])
            filled[dest_rank] += len(slots)
            for slot in slots[room:]:
                kept[source * tokens + slot // TOP_K, slot % TOP_K] = -1
                drops[source] += 1
    return kept, drops


@pytest.mark.parametrize("capacity", [9])
def test_capped_exchange_counts_and_drops_exactly_the_slots_past_capacity(capacity, rng):
    """``ep_experts_capped``: the output is the single-device layer without the
    slots the documented rule drops, and ``dropped`` counts them per rank."""
    ranks = 4
    config, weights = _layer(rng, "bf16")
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    ids, topk_weights = _routing(rng, skewed=True)
    kept, drops = _expected_drops(np.asarray(ids), ranks, capacity)
    out, dropped = parallel.ep_experts_capped(
        x, weights, topk_weights, ids, config, _mesh(ranks), capacity, backend="reference"
    )
    want = X.humming_grouped_experts(x, weights, topk_weights, jnp.asarray(kept), config, backend="reference")
    np.testing.assert_array_equal(np.asarray(dropped), drops)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    assert drops.sum() > 0  # the skewed rank receives 14+ of the 32 slots
    out, dropped = parallel.ep_experts_capped(
        x, weights, topk_weights, ids, config, _mesh(ranks), 32, backend="reference"
    )
    assert int(np.asarray(dropped).sum()) == 0  # the worst case: nothing dropped


def _loads(counts: np.ndarray, copies: np.ndarray, quota: np.ndarray, ranks: int) -> np.ndarray:
    """Slots each rank serves under a plan (independent of the library's routing)."""
    local = len(counts) // ranks
    loads = counts.reshape(ranks, local).sum(axis=1).astype(np.int64)
    for rank in range(ranks):
        for expert, served in zip(copies[rank], quota[rank], strict=True):
            if expert >= 0:
                loads[rank] += served
                loads[expert // local] -= served
    return loads


def test_balanced_layer_equals_the_single_device_layer(rng):
    """With B copies a rank (``redundant_experts``) the layer is still the
    single-device one bit for bit (int4 weights, a skewed routing)."""
    config, weights = _layer(rng, "int4_g32")
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    ids, topk_weights = _routing(rng, skewed=True)
    want = X.humming_grouped_experts(x, weights, topk_weights, ids, config, backend="reference")
    got = parallel.ep_experts(x, weights, topk_weights, ids, config, _mesh(4), redundant_experts=2, backend="reference")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(
    "ranks,redundant", [pytest.param(2, 1, marks=FULL), (4, 1), pytest.param(4, 2, marks=FULL), (8, 1)]
)
def test_balance_plan_evens_out_a_skewed_routing(ranks, redundant, rng):
    """The plan copies the hot expert onto other ranks (never its own), within
    its count, and brings every rank to at most ceil(slots / R) when one
    expert takes most slots (loads counted here, independently of the library)."""
    flat = np.asarray(_routing(rng, skewed=True)[0]).reshape(-1)
    counts = np.bincount(flat[(flat >= 0) & (flat < E)], minlength=E)
    copies, quota = (np.asarray(a) for a in parallel.balance_plan(jnp.asarray(counts), ranks, redundant))
    assert copies.shape == quota.shape == (ranks, redundant)
    local = E // ranks
    for expert in range(E):
        mine = copies == expert
        assert quota[mine].sum() <= counts[expert] and not mine[expert // local].any()
    assert np.all(quota[copies < 0] == 0) and 5 in copies  # the hot expert (5) is copied
    before, after = counts.reshape(ranks, local).sum(axis=1), _loads(counts, copies, quota, ranks)
    assert after.sum() == before.sum() and after.min() >= 0
    assert after.max() <= -(-counts.sum() // ranks) < before.max(), (before, after)
    np.testing.assert_array_equal(parallel.rank_loads(counts, ranks, copies, quota), after)


@pytest.mark.parametrize("ranks,redundant", [(4, 2), (8, 1)])
def test_slots_fill_each_copy_to_its_quota(ranks, redundant, rng):
    """Each source rank's slots placed as its dispatch places them: every copy
    receives exactly its quota of its expert's slots, the home rank the rest,
    so each rank's rows are the plan's load (counted here slot by slot)."""
    flat = np.asarray(_routing(rng, skewed=True)[0]).reshape(-1)
    valid = (flat >= 0) & (flat < E)
    counts = np.bincount(flat[valid], minlength=E)
    copies, quota = parallel.balance_plan(jnp.asarray(counts), ranks, redundant)
    local, per_source = E // ranks, -(-flat.size // ranks)
    received = np.zeros((ranks, local + redundant), np.int64)
    before = np.zeros(E, np.int32)  # the expert's slots on lower source ranks
    for source in range(ranks):
        part = slice(source * per_source, (source + 1) * per_source)
        ids, ok = flat[part], valid[part]
        dest, row = parallel._slot_rows(jnp.asarray(ids), jnp.asarray(ok), jnp.asarray(before), copies, quota, local)
        for d, r in zip(np.asarray(dest)[ok], np.asarray(row)[ok], strict=True):
            received[d, r] += 1
        before += np.bincount(ids[ok], minlength=E).astype(np.int32)
    copies, quota = np.asarray(copies), np.asarray(quota)
    np.testing.assert_array_equal(received[:, local:], np.where(copies >= 0, quota, 0))
    home = counts - np.array([quota[copies == e].sum() for e in range(E)])
    np.testing.assert_array_equal(received[:, :local].reshape(-1), home)
    np.testing.assert_array_equal(received.sum(axis=1), _loads(counts, copies, quota, ranks))


def test_unused_rows_never_reach_the_output(rng):
    """An expert no slot routes to has NaN weights: with copies planned on a
    skewed routing (unused copy rows, padded receive rows) every output is
    finite and the single-device layer's."""
    config, weights = _layer(rng, "bf16")
    w13 = weights.w13
    weights = dataclasses.replace(weights, w13=dataclasses.replace(w13, values=w13.values.at[7].set(jnp.nan)))
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    ids, topk_weights = _routing(rng, skewed=True)
    ids = jnp.where(ids == 7, 6, ids)
    want = X.humming_grouped_experts(x, weights, topk_weights, ids, config, backend="reference")
    got = parallel.ep_experts(x, weights, topk_weights, ids, config, _mesh(4), redundant_experts=2, backend="reference")
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_balancing_takes_fewer_drops_under_a_capacity(rng):
    """Under a capacity that drops slots of the skewed rank, copies of its hot
    expert on other ranks let them through (fewer drops, still counted)."""
    ranks, capacity = 4, 9
    config, weights = _layer(rng, "bf16")
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    ids, topk_weights = _routing(rng, skewed=True)
    run = functools.partial(parallel.ep_experts_capped, x, weights, topk_weights, ids, config, _mesh(ranks), capacity)
    _, plain = run(backend="reference")
    _, balanced = run(redundant_experts=2, backend="reference")
    assert 0 <= int(np.asarray(balanced).sum()) < int(np.asarray(plain).sum())


def test_module_splits_its_weights_and_equals_the_grouped_module(rng):
    """``nn.ExpertParallelExperts``: its weights live split over the ranks; its
    call (eager, under ``nnx.jit`` and through ``nn.jit_frozen``) equals the single-device module's."""
    from flax import nnx

    from humming_jax import nn

    config, weights = _layer(rng, "int4_g32")
    mesh = _mesh(4)
    module = nn.ExpertParallelExperts.from_quantized(config, weights, mesh=mesh, backend="reference")
    single = nn.HummingGroupedExperts.from_quantized(config, weights, backend="reference")
    values = module.w13.get_value().values
    assert len(values.sharding.device_set) == 4 and values.addressable_shards[0].data.shape[0] == E // 4
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    ids, topk_weights = _routing(rng, skewed=False)
    want = np.asarray(single(x, topk_weights, ids), np.float32)
    np.testing.assert_array_equal(np.asarray(module(x, topk_weights, ids), np.float32), want)
    step = nnx.jit(lambda m, x, w, i: m(x, w, i))
    np.testing.assert_array_equal(np.asarray(step(module, x, topk_weights, ids), np.float32), want)
    # jit_frozen passes the module's own arrays, split over the ranks as they are.
    np.testing.assert_array_equal(np.asarray(nn.jit_frozen(module)(x, topk_weights, ids), np.float32), want)
    with pytest.raises(ValueError, match="axis_name"):
        nn.ExpertParallelExperts.from_quantized(config, weights, mesh=mesh, axis_name="data")


@pytest.mark.parametrize("weight_format,input_quant", [("fp8_block128", "fp8_dynamic_group128")])
def test_row_scaled_inputs_travel_quantized(weight_format, input_quant, rng):
    """DeepSeek-V3's pair (fp8 blocks, fp8 inputs per 128): the rows are
    quantized before the send and travel as bytes with their scales; the
    layer still equals the single-device one. bf16 rows travel as bf16."""
    hidden, inter = 128, 128
    config = ExpertsConfig(E, hidden, inter, TOP_K, weight_format=weight_format, input_quant=input_quant)
    w13 = jnp.asarray(rng.normal(size=(E, 2 * inter, hidden)) / 11, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(E, hidden, inter)) / 11, jnp.float32)
    weights = X.quantize_experts(w13, w2, config)
    x = jnp.asarray(rng.normal(size=(T, hidden)), jnp.bfloat16)
    ids, topk_weights = _routing(rng, skewed=True)
    mesh = _mesh(2)
    want = X.humming_grouped_experts(x, weights, topk_weights, ids, config, backend="reference")
    got = parallel.ep_experts(x, weights, topk_weights, ids, config, mesh, backend="reference")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    text = str(
        jax.make_jaxpr(lambda *a: parallel.ep_experts(*a, config, mesh, backend="reference"))(
            x, weights, topk_weights, ids
        )
    )
    sent = f"[2,{T * TOP_K // 2},{hidden}]"  # the dispatched rows: [ranks, slots a rank, H] (combine: bf16 out rows)
    gathers = [line for line in text.splitlines() if "all_gather" in line and sent in line]
    assert len(gathers) == 1 and ("u8[" in gathers[0]) == (input_quant != "none"), gathers


def test_the_gpu_exchange_warns_without_xlas_decomposer(monkeypatch):
    """On GPUs the exchange needs XLA's ragged-all-to-all decomposer (read at
    start-up): without it in XLA_FLAGS a warning names the flag, once."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    parallel._warn_without_decomposer.cache_clear()
    with pytest.warns(UserWarning, match=parallel.RAGGED_DECOMPOSER_FLAG):
        parallel._warn_without_decomposer()
    monkeypatch.setenv("XLA_FLAGS", parallel.RAGGED_DECOMPOSER_FLAG)
    parallel._warn_without_decomposer.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel._warn_without_decomposer()
    parallel._warn_without_decomposer.cache_clear()


@pytest.mark.parametrize("input_quant", ["none", "fp8_dynamic_token"])
def test_the_workspace_plan_gives_each_ranks_buffers(input_quant, rng):
    """``plan_workspace(..., "ep", num_ranks=R, redundant=B)``: the dispatch's
    send, receive and id buffers and the rank's output as the step makes them
    (rows quantized before the send when their scales belong to the row), as
    the dispatch stage traces them."""
    ranks, redundant = 4, 1
    config, weights = _layer(rng, "fp8_channel" if input_quant != "none" else "bf16", input_quant)
    plan = hj.plan_workspace(config, T, TOP_K, "ep", num_ranks=ranks, redundant=redundant)
    b = plan.buffers
    slots, receive = T // ranks * TOP_K, T * TOP_K
    assert b["dispatch_rows"].shape == (slots, H) and b["received_rows"].shape == (receive, H)
    assert b["received_ids"].shape == (receive,) and b["output"].shape == (T // ranks, H)
    assert b["quanted_gate_up_input"].shape[0] == receive and b["returned_rows"].shape == (slots, H)
    quantized = input_quant != "none"
    assert b["received_rows"].dtype == (jnp.float8_e4m3fn if quantized else jnp.bfloat16)
    mesh = _mesh(ranks)
    ids, topk_weights = _routing(rng, skewed=True)
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    placed = parallel.shard_weights(weights, config, mesh)
    dispatch = parallel.ep_stages(config, mesh, placed, T, redundant_experts=redundant, backend="reference")[0]
    state = jax.eval_shape(dispatch.run, dict(hidden_states=x, weights=placed, topk_weights=topk_weights, topk_ids=ids))
    for name, key in (("received_rows", "recv_rows"), ("received_ids", "recv_ids")):  # laid end to end over the ranks
        assert state[key].shape == (ranks * b[name].shape[0], *b[name].shape[1:]) and state[key].dtype == b[name].dtype
    with pytest.raises(ValueError, match="num_ranks"):
        hj.plan_workspace(config, T, TOP_K, "ep")
