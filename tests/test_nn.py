"""Flax NNX modules: equal to the functional pipelines, jit-compiled once across
routings, usable inside nnx.scan over layers; MoEBlock routing against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import humming_jax as hj
from humming_jax import nn

import np_ref
import sweep as sweep_module
from sweep import FULL

CONFIG = hj.ExpertsConfig(8, 128, 128, 2, weight_format="int4_g128")


def _routing(seed, tokens=6, experts=8, top_k=2):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    return jnp.asarray(rng.random((tokens, top_k)), jnp.float32), jnp.asarray(ids)


def _tokens(seed, tokens=6, hidden=128):
    return jax.random.normal(jax.random.key(seed), (tokens, hidden), jnp.bfloat16)


# make test: the grouped module (the indexed one, a module over the same wrapper, under --full; its
# layer against the others in test_moe_block_padded_batch_and_every_expert_module).
@pytest.mark.parametrize(
    "module_cls,pipeline",
    [
        (nn.HummingGroupedExperts, hj.humming_grouped_experts),
        pytest.param(nn.HummingIndexedExperts, hj.humming_indexed_experts, marks=FULL),
    ],
)
def test_modules_equal_functional_pipelines(module_cls, pipeline):
    module = module_cls(CONFIG, rngs=nnx.Rngs(0))
    weights, ids = _routing(1)
    x = _tokens(2)
    expected = pipeline(x, module.weights, weights, ids, CONFIG)
    np.testing.assert_array_equal(np.asarray(module(x, weights, ids), np.float32), np.asarray(expected, np.float32))
    valid = jnp.asarray([4], jnp.int32)  # a padded batch: both modules take its real count
    padded = np.asarray(module(x, weights, ids, num_valid_tokens=valid), np.float32)
    want = pipeline(x, module.weights, weights, ids, CONFIG, num_valid_tokens=valid)
    np.testing.assert_array_equal(padded, np.asarray(want, np.float32))
    assert np.all(padded[4:] == 0)


def test_from_float_matches_quantize_experts():
    rng = np.random.default_rng(0)
    w13 = jnp.asarray(rng.normal(size=(8, 256, 128)) / 11, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(8, 128, 128)) / 11, jnp.float32)
    module = nn.HummingIndexedExperts.from_float(CONFIG, w13, w2, block_size=16)
    direct = hj.quantize_experts(w13, w2, CONFIG)
    # Both keep 4-bit codes in the kernel's planar order: the same arrays, the K-order codes repacked.
    stored = module.weights.w13
    assert stored.nibble_unit == direct.w13.nibble_unit == hj.formats.planar_unit(stored.format, stored.k) > 0
    np.testing.assert_array_equal(np.asarray(stored.values), np.asarray(direct.w13.values))
    k_order = hj.quantize_weight(w13, CONFIG.weight_format)
    assert stored.gate_up_block == hj.formats.GATE_UP_BLOCK  # and its gate and up rows interleaved
    np.testing.assert_array_equal(
        np.asarray(hj.to_k_order(hj.gate_up_halves(stored)).values), np.asarray(k_order.values)
    )
    np.testing.assert_array_equal(np.asarray(hj.dequantize_weight(stored)), np.asarray(hj.dequantize_weight(k_order)))
    weights, ids = _routing(3)
    out = module(_tokens(4), weights, ids)
    assert out.shape == (6, 128) and out.dtype == jnp.bfloat16
    assert module.workspace(6).buffers["output"].shape == (6, 128)


def test_batched_and_moonep_modules_equal_functions():
    batched = nn.BatchedHummingGroupedExperts(CONFIG, rngs=nnx.Rngs(0), max_num_tokens=4)
    x = jax.random.normal(jax.random.key(1), (8, 4, 128), jnp.bfloat16)
    counts = jnp.asarray([1, 2, 0, 4, 4, 1, 0, 3], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(batched(x, counts), np.float32),
        np.asarray(hj.batched_humming_grouped_experts(x, counts, batched.weights, CONFIG), np.float32),
    )
    moon = nn.MoonEPExperts(4, 64, 32, num_redundant=2, rngs=nnx.Rngs(0))
    xs = jax.random.normal(jax.random.key(2), (10, 64), jnp.bfloat16)
    cu = jnp.asarray([2, 2, 5, 8, 8, 8], jnp.int32)  # empty segments, unused redundant rows, 2 padding rows
    route_weights = jax.random.uniform(jax.random.key(3), (10,))
    out = moon(xs, cu, route_weights)
    w13, w_down = moon.w13.get_value(), moon.w_down.get_value()
    expected = hj.moonep_interleaved_experts(xs, w13, w_down, cu, route_weights)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    assert np.all(np.asarray(out, np.float32)[8:] == 0)
    # MoonEP's own form (gate and up apart, the activation a pass): within the activation's bf16 rounding.
    halves = hj.gate_up_halves(w13).values
    original = hj.moonep_experts(xs, halves[:, :32], halves[:, 32:], w_down, cu, route_weights)
    assert np_ref.relative_error(np.asarray(out, np.float64), np.asarray(original, np.float64)) < 1e-2


def test_jit_compiles_once_across_routings():
    block = nn.MoEBlock(nn.HummingGroupedExperts(CONFIG, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    experts = nn.HummingIndexedExperts(CONFIG, rngs=nnx.Rngs(2), block_size=16)
    traces = []

    @nnx.jit
    def step(block, experts, x, weights, ids):
        traces.append(1)
        return block(x), experts(x, weights, ids)

    for seed in range(4):
        weights, ids = _routing(seed)
        jax.block_until_ready(step(block, experts, _tokens(seed), weights, ids))
    assert len(traces) == 1


def test_decode_loop_call_forms_agree():
    """The call forms the README gives a decode loop — ``jax.jit`` over the
    split state, ``jax.jit`` over the module (a pytree in Flax's tree mode),
    ``nnx.jit(graph=False)``, ``nn.jit_frozen`` — give the eager block's
    result with every expert module (``make test``: the grouped and MoonEP ones)."""
    config = hj.ExpertsConfig(8, 128, 128, 2, weight_format="bf16")
    grouped = nn.HummingGroupedExperts(config, rngs=nnx.Rngs(0), backend="reference")
    halves = hj.gate_up_halves(grouped.weights.w13).values
    moon = nn.MoonEPExperts(
        8, 128, 128, w_gate=halves[:, :128], w_up=halves[:, 128:], w_down=grouped.weights.w2.values, backend="reference"
    )
    modules = [
        (grouped, {}),
        (nn.HummingIndexedExperts.from_quantized(config, grouped.weights, backend="reference"), {}),
        (
            nn.BatchedHummingGroupedExperts.from_quantized(
                config, grouped.weights, max_num_tokens=6, backend="reference"
            ),
            {},
        ),
        (moon, {"top_k": 2}),
    ]
    x = _tokens(5)
    # make test: the grouped and MoonEP modules (a Humming module and the other family); --full: all four.
    for experts, kw in modules if sweep_module.FULL_RUN else modules[::3]:
        block = nn.MoEBlock(experts, rngs=nnx.Rngs(1), **kw)
        graphdef, state = nnx.split(block)
        forms = {
            "split state": jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x))(state, x),
            "module": jax.jit(lambda b, x: b(x))(block, x),
            "tree mode": nnx.jit(lambda b, x: b(x), graph=False)(block, x),
            "jit_frozen": nn.jit_frozen(block)(x),
        }
        eager = np.asarray(block(x), np.float32)
        for name, out in forms.items():
            np.testing.assert_allclose(np.asarray(out, np.float32), eager, rtol=1e-2, atol=1e-2, err_msg=name)


def test_jit_frozen_traces_once_and_refuses_a_call_that_assigns():
    """``jit_frozen`` compiles once for a shape, keeps static keywords static,
    reads the weights as they were when it was made, and raises where the call
    assigns to a variable (the assignment would be lost)."""
    config = hj.ExpertsConfig(8, 128, 128, 2, weight_format="bf16")
    experts = nn.HummingGroupedExperts(config, rngs=nnx.Rngs(0), backend="reference")
    block = nn.MoEBlock(experts, rngs=nnx.Rngs(1))
    traces = []

    class Counted(nnx.Module):
        def __init__(self, block):
            self.block = block

        def __call__(self, x, scale=1.0):
            traces.append(scale)
            return self.block(x) * scale

    step = nn.jit_frozen(Counted(block), static_argnames=("scale",))
    x = _tokens(3)
    expected = np.asarray(block(x), np.float32)
    for seed in range(3):
        got, want = step(_tokens(seed)), block(_tokens(seed))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert traces == [1.0]
    np.testing.assert_allclose(np.asarray(step(x, scale=2.0), np.float32), 2 * expected, rtol=1e-2, atol=2e-2)
    assert traces == [1.0, 2.0]
    block.router.kernel[...] = block.router.kernel[...] * 0
    np.testing.assert_allclose(np.asarray(step(x), np.float32), expected, rtol=1e-2, atol=1e-2)

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.count[...] = self.count[...] + 1
            return x

    with pytest.raises(ValueError, match="jit_frozen: calling Counter assigned"):
        nn.jit_frozen(Counter())(x)
    with pytest.raises(TypeError, match="module must be an nnx.Module"):
        nn.jit_frozen(lambda x: x)


# The block's routing, dispatch and layer stacking on the reference backend: the
# modules' kernel paths are the tests above and test_pipelines'.
def test_moe_block_routing_and_shared_expert():
    experts = nn.HummingGroupedExperts(CONFIG, rngs=nnx.Rngs(0), backend="reference")
    for scoring in ("softmax", "sigmoid"):
        block = nn.MoEBlock(
            experts,
            rngs=nnx.Rngs(1),
            scoring=scoring,
            shared_intermediate_size=64,
            correction_bias=scoring == "sigmoid",
        )
        x = _tokens(5).reshape(2, 3, 128)
        out = block(x)
        assert out.shape == x.shape and out.dtype == x.dtype
        logits = np.asarray(block.router(x.reshape(6, 128).astype(jnp.float32)), np.float64)
        scores = (
            (
                np.exp(logits - logits.max(-1, keepdims=True))
                / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
            )
            if scoring == "softmax"
            else 1 / (1 + np.exp(-logits))
        )
        ids = np.argsort(-scores, axis=-1)[:, :2]
        weights = np.take_along_axis(scores, ids, -1)
        weights = weights / weights.sum(-1, keepdims=True)
        got_w, got_ids = nn.route(jnp.asarray(logits, jnp.float32), 2, scoring)
        np.testing.assert_array_equal(np.sort(np.asarray(got_ids), -1), np.sort(ids, -1))
        np.testing.assert_allclose(np.sort(np.asarray(got_w), -1), np.sort(weights, -1), rtol=1e-5)
        expected = experts(x.reshape(6, 128), got_w, got_ids) + block.shared(x.reshape(6, 128))
        np.testing.assert_allclose(
            np.asarray(out.reshape(6, 128), np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2
        )
    with pytest.raises(ValueError, match="scoring"):
        nn.route(jnp.zeros((2, 8)), 2, "relu")


def test_scan_over_layers():
    """Two MoE layers stacked with nnx.vmap and applied with nnx.scan."""
    layers = 2

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return nn.MoEBlock(nn.HummingGroupedExperts(CONFIG, rngs=rngs, backend="reference"), rngs=rngs)

    stack = create(nnx.Rngs(0))

    @nnx.jit
    def forward(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def layer(h, block):
            return h + block(h)

        return layer(x, stack)

    x = _tokens(7)
    out = forward(stack, x)
    # The same layers applied one by one.
    graphdef, state = nnx.split(stack)
    h = x
    for i in range(layers):
        block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
        h = h + block(h)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(h, np.float32), rtol=2e-2, atol=2e-2)


def test_module_errors():
    with pytest.raises(ValueError, match="rngs"):
        nn.HummingGroupedExperts(CONFIG)
    with pytest.raises(ValueError, match="w_down must be"):
        nn.MoonEPExperts(
            4, 64, 32, w_gate=jnp.ones((4, 32, 64)), w_up=jnp.ones((4, 32, 64)), w_down=jnp.ones((4, 32, 64))
        )
    other = hj.ExpertsConfig(8, 128, 128, 2, weight_format="int8_channel")
    weights = nn.HummingGroupedExperts(CONFIG, rngs=nnx.Rngs(0)).weights
    with pytest.raises(ValueError, match="format"):
        nn.HummingGroupedExperts.from_quantized(other, weights)
    batched = nn.BatchedHummingGroupedExperts(CONFIG, rngs=nnx.Rngs(0), max_num_tokens=4)
    with pytest.raises(ValueError, match="max_num_tokens"):
        batched(jnp.ones((8, 5, 128), jnp.bfloat16), jnp.ones(8, jnp.int32))
    with pytest.raises(ValueError, match="max_num_tokens: expected a positive int, got 0"):
        nn.BatchedHummingGroupedExperts(CONFIG, rngs=nnx.Rngs(0), max_num_tokens=0)
    with pytest.raises(ValueError, match="num_redundant: expected an int of at least 0, got -1"):
        nn.MoonEPExperts(4, 64, 32, num_redundant=-1, rngs=nnx.Rngs(0))
    experts = nn.HummingGroupedExperts(CONFIG, rngs=nnx.Rngs(0), backend="reference")
    with pytest.raises(ValueError, match=r"MoEBlock: top_k: expected 1\.\.8"):
        nn.MoEBlock(experts, rngs=nnx.Rngs(1), top_k=9)
    with pytest.raises(ValueError, match=r"MoEBlock: x: expected \[\.\.\., H=128\], got \[3, 64\]"):
        nn.MoEBlock(experts, rngs=nnx.Rngs(1))(jnp.ones((3, 64)))
    with pytest.raises(TypeError, match="MoEBlock: x: expected float activations, got int32"):
        nn.MoEBlock(experts, rngs=nnx.Rngs(1))(jnp.ones((3, 128), jnp.int32))


def test_moe_block_with_batched_and_moonep_experts():
    """Every expert module drops into MoEBlock: the batched and MoonEP ones give
    the grouped module's result on the same weights and routing."""
    config = hj.ExpertsConfig(8, 128, 128, 2, weight_format="bf16")
    grouped = nn.HummingGroupedExperts(config, rngs=nnx.Rngs(0), backend="reference")
    batched = nn.BatchedHummingGroupedExperts.from_quantized(
        config, grouped.weights, max_num_tokens=6, backend="reference"
    )
    pad = lambda w: jnp.concatenate([w, w[:1]])  # noqa: E731  (one redundant row: a copy of expert 0)
    w13 = hj.gate_up_halves(grouped.weights.w13).values  # the gate rows, then the up rows
    moon = nn.MoonEPExperts(
        8,
        128,
        128,
        num_redundant=1,
        w_gate=pad(w13[:, :128]),
        w_up=pad(w13[:, 128:]),
        w_down=pad(grouped.weights.w2.values),
        backend="reference",
    )
    x = _tokens(8)
    reference = nn.MoEBlock(grouped, rngs=nnx.Rngs(1))(x)
    for experts, kw in ((batched, {}), (moon, {"top_k": 2})):
        out = nn.MoEBlock(experts, rngs=nnx.Rngs(1), **kw)(x)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference, np.float32), rtol=2e-2, atol=2e-2)


def test_moe_block_tiles_the_batched_experts_for_its_routed_rows(monkeypatch):
    """MoEBlock's batched experts run the tiles of its routed rows (T·k, as
    vLLM estimates them), not of the buffer's worst case (E · max_num_tokens)."""
    from humming_jax.nn import experts as nn_experts

    config = hj.ExpertsConfig(8, 128, 128, 2, weight_format="bf16")
    batched = nn.BatchedHummingGroupedExperts(config, rngs=nnx.Rngs(0), max_num_tokens=6, backend="reference")
    seen = []
    original = nn_experts.E.batched_humming_grouped_experts

    def spy(*args, **kwargs):
        seen.append(kwargs["valid_shape_m"])
        return original(*args, **kwargs)

    monkeypatch.setattr(nn_experts.E, "batched_humming_grouped_experts", spy)
    nn.MoEBlock(batched, rngs=nnx.Rngs(1))(_tokens(0, tokens=5))
    assert seen == [5 * 2]


def test_moe_block_padded_batch_and_every_expert_module():
    """MoEBlock over each expert module — the expert-parallel one too, on two
    devices (the CPU's simulated ones; not on a one-GPU machine) — with a padded batch (``num_valid_tokens``,
    NaN rows past it): the real rows as the unpadded block gives them, zeros
    past them; ``expert_map`` refused by the modules that place their experts
    themselves."""
    config = hj.ExpertsConfig(8, 128, 128, 2, weight_format="bf16")
    grouped = nn.HummingGroupedExperts(config, rngs=nnx.Rngs(0), backend="reference")
    halves = hj.gate_up_halves(grouped.weights.w13).values
    modules = {
        "grouped": grouped,
        "indexed": nn.HummingIndexedExperts.from_quantized(config, grouped.weights, backend="reference"),
        "batched": nn.BatchedHummingGroupedExperts.from_quantized(
            config, grouped.weights, max_num_tokens=8, backend="reference"
        ),
        "moonep": nn.MoonEPExperts(
            8,
            128,
            128,
            w_gate=halves[:, :128],
            w_up=halves[:, 128:],
            w_down=grouped.weights.w2.values,
            backend="reference",
        ),
    }
    if len(jax.devices()) >= 2:  # the CPU's simulated devices; a one-GPU machine has no second rank
        mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
        modules["ep"] = nn.ExpertParallelExperts.from_quantized(config, grouped.weights, mesh=mesh, backend="reference")
    x = _tokens(3, tokens=8)
    padded = jnp.where(jnp.arange(8)[:, None] < 5, x, jnp.nan).astype(x.dtype)
    for name, experts in modules.items():
        block = nn.MoEBlock(
            experts, rngs=nnx.Rngs(1), shared_intermediate_size=32, **({"top_k": 2} if name == "moonep" else {})
        )
        alone = np.asarray(block(x[:6]), np.float32)[:5]  # (6 rows: the EP module splits them over two ranks)
        out = np.asarray(block(padded, num_valid_tokens=jnp.asarray([5], jnp.int32)), np.float32)
        assert np.all(out[5:] == 0) and np.all(np.isfinite(out)), name
        np.testing.assert_allclose(out[:5], alone, rtol=2e-2, atol=2e-2, err_msg=name)
        if name in ("batched", "moonep", "ep"):
            with pytest.raises(ValueError, match="places its experts itself"):
                block(x, expert_map=jnp.arange(8, dtype=jnp.int32))


def test_group_limited_routing_and_router_bias(rng):
    """DeepSeek-V3's group-limited top-k with routed scaling against NumPy, the
    group arguments checked, and gpt-oss's router bias in the block."""
    logits = rng.normal(size=(7, 32)) * 2
    bias = rng.normal(size=32) * 0.1
    got_w, got_ids = nn.route(
        jnp.asarray(logits, jnp.float32), 4, "sigmoid", True, jnp.asarray(bias, jnp.float32), 8, 3, 2.5
    )
    want_w, want_ids = np_ref.deepseek_v3_route(logits, bias, 4, 8, 3, 2.5)
    order = np.argsort(np.asarray(got_ids), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got_ids), order, -1), np.sort(want_ids, -1))
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(got_w), order, -1),
        np.take_along_axis(want_w, np.argsort(want_ids, -1), -1),
        rtol=1e-5,
    )
    for groups, kept in ((5, 2), (8, 9), (8, 1)):  # 32 % 5; more kept groups than groups; 1 group of 4 < top_k=5
        with pytest.raises(ValueError, match="num_groups|topk_groups"):
            nn.route(jnp.zeros((2, 32)), 5, "sigmoid", num_groups=groups, topk_groups=kept)
    experts = nn.HummingGroupedExperts(CONFIG, rngs=nnx.Rngs(0), backend="reference")
    block = nn.MoEBlock(experts, rngs=nnx.Rngs(1), router_bias=True)
    assert block.router.bias is not None and block.router.bias.get_value().shape == (CONFIG.global_num_experts,)


def test_submodules_reachable_from_the_package():
    import humming_jax.checkpoints

    assert hj.nn is nn and hj.checkpoints is humming_jax.checkpoints
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hj.nope  # noqa: B018
