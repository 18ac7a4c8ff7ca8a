"""The expert pipelines (grouped, indexed, batched, MoonEP) against per-token
float64 NumPy math on the dequantized weights."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import experts as X
from humming_jax import input_quant as Q

import np_ref
import sweep as sweep_module
from sweep import FULL, sweep


def _problem(rng, config, num_tokens, ids=None):
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    w13 = rng.normal(size=(e, config.w13_n, h)).astype(np.float32) / np.sqrt(h)
    w2 = rng.normal(size=(e, h, i)).astype(np.float32) / np.sqrt(i)
    x = rng.normal(size=(num_tokens, h)).astype(np.float32)
    if ids is None:
        ids = np.stack([rng.choice(config.global_num_experts, config.top_k, replace=False) for _ in range(num_tokens)])
    weights = rng.random(ids.shape).astype(np.float32)
    return x, w13, w2, ids.astype(np.int32), weights


def _numpy_moe(x, w13, w2, ids, weights, activation, expert_map=None, num_experts=None):
    num_experts = num_experts or w13.shape[0]
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < num_experts:
                continue
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            act = np_ref.activation((x[t] @ w13[e].T)[None], activation.kind.value, activation.clamp_limit)[0]
            out[t] += weights[t, j] * (act @ w2[e].T)
    return out


def _expected_layer(x, weights, ids, tw, config, expert_map=None, num_experts=None, bf16_input=True):
    """:func:`_numpy_moe` of the input (bf16-rounded with ``bf16_input``) through the layer's dequantized weights."""
    x64 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) if bf16_input else np.asarray(x, np.float64)
    w13d, w2d = np_ref.dequantize_weight(weights.w13), np_ref.dequantize_weight(weights.w2)
    return _numpy_moe(x64, w13d, w2d, ids, tw, config.activation, expert_map, num_experts)


PIPELINES = ["grouped", "indexed"]


def _run(pipeline, x, weights, tw, ti, config, **kw):
    fn = hj.humming_grouped_experts if pipeline == "grouped" else hj.humming_indexed_experts
    return fn(jnp.asarray(x, jnp.bfloat16), weights, jnp.asarray(tw), jnp.asarray(ti), config, **kw)


_STEPS = [("int4_g128", "silu"), ("mxfp4+bias", "swigluoai"), ("nvfp4", "relu2_no_mul")]


# make test: each weight and activation once, the pipelines in turn.
@pytest.mark.parametrize(
    "fmt,activation,pipeline",
    sweep(
        [(*step, p) for step in _STEPS for p in PIPELINES],
        [(*step, PIPELINES[i % len(PIPELINES)]) for i, step in enumerate(_STEPS)],
    ),
)
def test_pipeline_matches_numpy(pipeline, fmt, activation, rng):
    config = hj.ExpertsConfig(8, 128, 128, 2, activation=activation, weight_format=fmt)
    x, w13, w2, ids, tw = _problem(rng, config, 9)
    bias = (
        dict(
            w13_bias=jnp.asarray(rng.normal(size=(8, config.w13_n)) * 0.1, jnp.float32),
            w2_bias=jnp.asarray(rng.normal(size=(8, 128)) * 0.1, jnp.float32),
        )
        if "bias" in fmt
        else {}
    )
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config, **bias)
    out = _run(pipeline, x, weights, tw, ids, config)
    w13d, w2d = np_ref.dequantize_weight(weights.w13), np_ref.dequantize_weight(weights.w2)
    if bias:  # fold biases into the float64 math through an extra input column
        x_aug = np.concatenate([np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64), np.ones((9, 1))], 1)
        w13d = np.concatenate([w13d, np.asarray(bias["w13_bias"], np.float64)[:, :, None]], 2)
        expected = np.zeros((9, 128))
        for t in range(9):
            for j in range(2):
                e = ids[t, j]
                act = np_ref.activation((x_aug[t] @ w13d[e].T)[None], activation)[0]
                expected[t] += tw[t, j] * (act @ w2d[e].T + np.asarray(bias["w2_bias"], np.float64)[e])
    else:
        expected = _numpy_moe(
            np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64), w13d, w2d, ids, tw, config.activation
        )
    assert out.shape == (9, 128) and out.dtype == jnp.bfloat16
    assert np_ref.relative_error(out, expected) < 1e-2


# make test: each case once, the pipelines in turn (out-of-range ids on both: they raise before compiling).
@pytest.mark.parametrize(
    "case,pipeline",
    sweep(
        [(c, p) for c in ("T=1", "hot", "out_of_range", "expert_map") for p in PIPELINES],
        lambda case: (
            case[0] == "out_of_range" or ("T=1", "hot", "expert_map").index(case[0]) % 2 == PIPELINES.index(case[1])
        ),
    ),
)
@pytest.mark.bounds
def test_pipeline_routing_edge_cases(pipeline, case, rng):
    num_tokens = 1 if case == "T=1" else 12
    expert_map = None
    global_experts = 8
    if case == "expert_map":
        expert_map = np.array([-1, 0, -1, 1, 2, -1, 3, -1])
    local = 4 if expert_map is not None else 8
    config = hj.ExpertsConfig(local, 128, 64, 3, weight_format="int8_channel", global_num_experts=global_experts)
    ids = np.stack([rng.choice(global_experts, 3, replace=False) for _ in range(num_tokens)])
    if case == "hot":
        ids[:, 0] = 5
        ids[:, 1:] = 5  # all slots on one expert
    if case == "out_of_range":
        ids[0, 0], ids[3, 2] = -1, 8
    x, w13, w2, ids, tw = _problem(rng, config, num_tokens, ids=ids)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    emap = None if expert_map is None else jnp.asarray(expert_map, jnp.int32)
    out = _run(pipeline, x, weights, tw, ids, config, expert_map=emap)
    expected = _expected_layer(x, weights, ids, tw, config, expert_map, global_experts)
    assert np_ref.relative_error(out, expected) < 1e-2


def test_indexed_with_different_w2_block_size_and_hadamard(rng):
    config = hj.ExpertsConfig(
        4, 256, 128, 2, weight_format="int4_g32", hadamard_block_size=64, w2_hadamard_block_size=128
    )
    x, w13, w2, ids, tw = _problem(rng, config, 10)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)  # rotated before quantizing
    out = hj.humming_indexed_experts(
        jnp.asarray(x, jnp.bfloat16),
        weights,
        jnp.asarray(tw),
        jnp.asarray(ids),
        config,
        block_size=16,
        w2_block_size=32,
    )
    grouped = hj.humming_grouped_experts(
        jnp.asarray(x, jnp.bfloat16), weights, jnp.asarray(tw), jnp.asarray(ids), config
    )

    def unrotate(w, block):  # the normalized Hadamard is symmetric and its own inverse
        h = np.array([[1.0]])
        while h.shape[0] < block:
            h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
        return (w.reshape(*w.shape[:-1], -1, block) @ (h / np.sqrt(block))).reshape(w.shape)

    w13d = unrotate(np_ref.dequantize_weight(weights.w13), 64)
    w2d = unrotate(np_ref.dequantize_weight(weights.w2), 128)
    expected = _numpy_moe(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64), w13d, w2d, ids, tw, config.activation)
    assert np_ref.relative_error(out, expected) < 1e-2
    assert np_ref.relative_error(out, np.asarray(grouped, np.float64)) < 1e-2


# indexed: the grouped pipeline runs its stages at decode (test_grouped_runs_indexed_at_decode)
@pytest.mark.parametrize("pipeline", sweep(["grouped", "indexed", "batched"], ["grouped"]))
def test_block_fp8_activations_and_prequantized_input(pipeline, rng):
    config = hj.ExpertsConfig(4, 256, 128, 2, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    x, w13, w2, ids, tw = _problem(rng, config, 8)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    expected = _expected_layer(x, weights, ids, tw, config, bf16_input=False)
    if pipeline == "batched":
        offsets, scatter_idx = hj.moe_prepare_scatter(jnp.asarray(ids), 4)
        counts = offsets[1:] - offsets[:-1]
        pos = np.asarray(scatter_idx - offsets[jnp.asarray(ids)])
        batched = np.zeros((4, 8, 256), np.float32)
        batched[ids, pos] = np.broadcast_to(x[:, None], (8, 2, 256))
        q = Q.quantize_input(jnp.asarray(batched.reshape(32, 256)), Q.FP8_DYNAMIC_GROUP128)
        outs = []
        for prequantized in (False, True):
            kw = dict(a1q_scale=q.scale.reshape(4, 8, 2)) if prequantized else {}
            inp = q.values.reshape(4, 8, 256) if prequantized else jnp.asarray(batched, jnp.bfloat16)
            res = hj.batched_humming_grouped_experts(inp, counts, weights, config, **kw)
            res = np.asarray(res, np.float64)
            assert np.all(res[np.arange(8)[None, :] >= np.asarray(counts)[:, None]] == 0)
            outs.append(np.einsum("tj,tjh->th", tw, res[ids, pos]))
    else:
        q = Q.quantize_input(jnp.asarray(x), Q.FP8_DYNAMIC_GROUP128)
        outs = [_run(pipeline, x, weights, tw, ids, config)]
        fn = hj.humming_grouped_experts if pipeline == "grouped" else hj.humming_indexed_experts
        outs.append(fn(q.values, weights, jnp.asarray(tw), jnp.asarray(ids), config, a1q_scale=q.scale))
    for out in outs:
        assert np_ref.relative_error(out, expected) < 6e-2  # fp8 e4m3 activations and weights


def test_indexed_runs_grouped_with_quantized_inputs_at_prefill(rng):
    """From 32 rows an expert with quantized inputs the indexed pipeline (no
    block given) runs the grouped stages: the grouped pipeline's result, the
    tokens past ``num_valid_tokens`` zero; below that, or with a block given,
    the indexed layout."""
    config = hj.ExpertsConfig(4, 256, 128, 2, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    assert not X.indexed_runs_grouped(63, 2, config) and X.indexed_runs_grouped(64, 2, config)
    # float inputs: 4-bit weights from 32 rows an expert, 16-bit ones from 1024
    int4 = hj.ExpertsConfig(4, 256, 128, 2, weight_format="int4_g128")
    assert not X.indexed_runs_grouped(63, 2, int4) and X.indexed_runs_grouped(64, 2, int4)
    bf16 = hj.ExpertsConfig(4, 256, 128, 2)
    assert not X.indexed_runs_grouped(2047, 2, bf16) and X.indexed_runs_grouped(2048, 2, bf16)
    assert not X.indexed_runs_grouped(2048, 2, hj.ExpertsConfig(4, 256, 128, 2, batch_invariant=True))
    # DeepSeek-V3's fp8 w2 (over 2**31 values, read as byte pairs by the indexed GEMM): from 128 rows in all.
    deepseek = hj.ExpertsConfig(256, 7168, 2048, 8, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    assert [X.indexed_runs_grouped(t, 8, deepseek) for t in (1, 16)] == [False, True]
    x, w13, w2, ids, tw = _problem(rng, config, 64)
    ids[5] = [1, 9]  # an id outside [0, E): nothing
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    grouped = np.asarray(_run("grouped", x, weights, tw, ids, config), np.float64)
    x[40:] = np.nan  # padding tokens: nothing of theirs reaches a valid token
    padded = {}
    for pipeline in PIPELINES:
        out = _run(pipeline, x, weights, tw, ids, config, num_valid_tokens=jnp.asarray([40]))
        padded[pipeline] = np.asarray(out, np.float64)
        assert np.all(padded[pipeline][40:] == 0) and np.all(np.isfinite(padded[pipeline])), pipeline
        assert np_ref.relative_error(padded[pipeline][:40], grouped[:40]) < 1e-6, pipeline
    np.testing.assert_array_equal(padded["indexed"], padded["grouped"])  # the grouped stages, bit for bit
    with pytest.raises(ValueError, match="num_valid_tokens must be an integer array of one count"):
        _run("grouped", x, weights, tw, ids, config, num_valid_tokens=jnp.asarray([40.0]))
    blocked = _run("indexed", x[:40], weights, tw[:40], ids[:40], config, block_size=16)
    assert np_ref.relative_error(np.asarray(blocked, np.float64), grouped[:40]) < 2e-2  # another layout's tiles


@pytest.mark.bounds
def test_padded_decode_batch(rng):
    """A bucketed decode batch (``num_valid_tokens``, NaN padding rows): both
    pipelines — the grouped one running the indexed stages at a row an expert
    — give the unpadded batch's rows (five tokens, and one) and zeros past
    them (the unpadded rows through the reference: its own tests hold it to float64).
    make test runs the indexed pipeline only: the grouped one runs its stages
    here, bit for bit (test_grouped_runs_indexed_at_decode)."""
    config = hj.ExpertsConfig(16, 128, 128, 2, weight_format="int4_g128")
    x, w13, w2, ids, tw = _problem(rng, config, 8)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    assert X.grouped_runs_indexed(8, 2, config)
    pipelines = PIPELINES if sweep_module.FULL_RUN else ("indexed",)
    for valid in (5, 1):
        alone = _run("indexed", x[:valid], weights, tw[:valid], ids[:valid], config, backend="reference")
        alone = np.asarray(alone, np.float64)
        padded_x = x.copy()
        padded_x[valid:] = np.nan
        for pipeline in pipelines:
            out = _run(pipeline, padded_x, weights, tw, ids, config, num_valid_tokens=jnp.asarray([valid], jnp.int32))
            out = np.asarray(out, np.float64)
            assert np.all(out[valid:] == 0) and np.all(np.isfinite(out)), (pipeline, valid)
            assert np_ref.relative_error(out[:valid], alone) < 1e-2, (pipeline, valid)


@FULL  # make test's time: the only default check of the switch under an expert map (test-full, the GPU step)
def test_indexed_runs_grouped_under_an_expert_map(rng):
    """Expert parallelism's map (4 of 8 global experts local): 128 tokens x 2
    give 32 rows a local expert, so the indexed pipeline runs the grouped
    stages, bit for bit the grouped pipeline's result."""
    local = hj.ExpertsConfig(
        4, 128, 128, 2, weight_format="fp8_block128", input_quant="fp8_dynamic_group128", global_num_experts=8
    )
    assert X.indexed_runs_grouped(128, 2, local)
    x, w13, w2, ids, tw = _problem(rng, local, 128)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), local)
    emap = jnp.asarray([-1, 0, -1, 1, 2, -1, 3, -1], jnp.int32)
    outs = [np.asarray(_run(p, x, weights, tw, ids, local, expert_map=emap), np.float64) for p in PIPELINES]
    np.testing.assert_array_equal(outs[1], outs[0])


def test_grouped_runs_indexed_at_decode(rng, monkeypatch):
    """Up to one row an expert, and where the indexed stages tile the slots by
    expert (two slots an expert up to a block of tokens), the grouped pipeline
    runs the indexed stages (no grouping scatter): the indexed pipeline's
    result bit for bit, float and pre-quantized inputs, ids outside [0, E)
    contributing nothing; elsewhere, with ``batch_invariant`` or where the
    indexed pipeline runs the grouped stages, the grouped layout."""
    config = hj.ExpertsConfig(4, 256, 128, 2, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    assert X.indexed_block_size(16, 2, config) == 16
    expected_switch = [True, True, False, True, True, False]
    assert [X.grouped_runs_indexed(t, 2, config) for t in (1, 2, 3, 4, 16, 17)] == expected_switch
    assert not X.grouped_runs_indexed(1, 2, dataclasses.replace(config, batch_invariant=True))
    # DeepSeek-V3's fp8 w2 read as byte pairs: the indexed pipeline runs grouped from 128 rows, so neither switches.
    deepseek = hj.ExpertsConfig(256, 7168, 2048, 8, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    assert [X.grouped_runs_indexed(t, 8, deepseek) for t in (1, 16, 32)] == [True, False, False]
    int4 = hj.ExpertsConfig(256, 7168, 2048, 8, weight_format="int4_g128")
    assert [X.grouped_runs_indexed(t, 8, int4) for t in (16, 32, 33)] == [True, True, False]
    x, w13, w2, ids, tw = _problem(rng, config, 2)
    ids[1] = [3, 7]  # an id outside [0, E): nothing
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    indexed = np.asarray(_run("indexed", x, weights, tw, ids, config), np.float64)

    def no_scatter(*args, **kwargs):
        raise AssertionError("the grouped pipeline scattered at decode")

    monkeypatch.setattr(X.routing, "moe_prepare_scatter", no_scatter)
    monkeypatch.setattr(X.routing, "moe_permute", no_scatter)
    hj.humming_grouped_experts.clear_cache()
    grouped = np.asarray(_run("grouped", x, weights, tw, ids, config), np.float64)
    np.testing.assert_array_equal(grouped, indexed)
    expected = _expected_layer(x, weights, ids, tw, config, bf16_input=False)
    assert np_ref.relative_error(grouped, expected) < 6e-2  # fp8 e4m3 activations and weights
    hj.humming_grouped_experts.clear_cache()


@FULL  # make test's time: the only default check of pre-quantized inputs on this switch (test-full, the GPU step)
def test_grouped_runs_indexed_with_prequantized_inputs(rng, monkeypatch):
    """At decode the grouped pipeline on pre-quantized fp8 inputs (with their
    ``a1q_scale``) runs the indexed stages (no grouping scatter): the indexed
    pipeline's result bit for bit."""

    def no_scatter(*args, **kwargs):
        raise AssertionError("the grouped pipeline scattered at decode")

    monkeypatch.setattr(X.routing, "moe_prepare_scatter", no_scatter)
    monkeypatch.setattr(X.routing, "moe_permute", no_scatter)
    hj.humming_grouped_experts.clear_cache()
    config = hj.ExpertsConfig(4, 256, 128, 2, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    x, w13, w2, ids, tw = _problem(rng, config, 2)
    ids[1] = [3, 7]  # an id outside [0, E): nothing
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    q = Q.quantize_input(jnp.asarray(x), Q.FP8_DYNAMIC_GROUP128)
    args = (weights, jnp.asarray(tw), jnp.asarray(ids), config)
    prequantized = [
        fn(q.values, *args, a1q_scale=q.scale) for fn in (hj.humming_grouped_experts, hj.humming_indexed_experts)
    ]
    np.testing.assert_array_equal(np.asarray(prequantized[0]), np.asarray(prequantized[1]))
    assert np.all(np.isfinite(np.asarray(prequantized[0])))
    hj.humming_grouped_experts.clear_cache()


def test_decode_slots_in_their_own_blocks(rng, monkeypatch):
    """At T=1, or up to one slot per 8 experts, the indexed stages give each
    slot its own block (no grouping; not with an expert map or
    ``batch_invariant``): the aligned layout's result bit for bit, ids outside
    [0, E) and an expert twice in a token as the float64 layer says."""
    config = hj.ExpertsConfig(64, 128, 128, 2, weight_format="int4_g128")
    assert [X.slot_blocks_apply(t, 2, config, False) for t in (1, 4, 5)] == [True, True, False]
    assert not X.slot_blocks_apply(1, 2, config, True)
    assert not X.slot_blocks_apply(1, 2, dataclasses.replace(config, batch_invariant=True), False)
    mixtral = hj.ExpertsConfig(8, 4096, 14336, 2, weight_format="int4_g128")
    assert [X.slot_blocks_apply(t, 2, mixtral, False) for t in (1, 2)] == [True, False]
    x, w13, w2, ids, tw = _problem(rng, config, 4)
    ids[1] = [3, 64]  # an id outside [0, E)
    ids[2] = [-1, 5]
    ids[3] = [5, 5]  # an expert twice in one token
    # (the grouped pipeline runs these stages at decode: test_grouped_runs_indexed_at_decode, and
    # test_decode_layer_launches_for_sm90 lowers both without a grouping)
    _ungrouped_equals_aligned(x, w13, w2, ids, tw, config, "slot_blocks_apply", monkeypatch)


def _ungrouped_equals_aligned(x, w13, w2, ids, tw, config, switch: str, monkeypatch):
    """The indexed layer on ``ids`` with no grouping launched equals, bit for
    bit, the aligned layout's (``experts.<switch>`` patched False), and the
    float64 layer (ids outside [0, E) contributing nothing)."""
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    valid = (ids >= 0) & (ids < config.num_experts)
    expected = _expected_layer(x, weights, np.where(valid, ids, -1), tw, config)

    def clear():
        for fn in (hj.humming_grouped_experts, hj.humming_indexed_experts):
            fn.clear_cache()

    def no_grouping(*args, **kwargs):
        raise AssertionError("the decode layer grouped its slots")

    with monkeypatch.context() as patch:
        patch.setattr(X.routing, "moe_align_block_size", no_grouping)
        clear()
        got = np.asarray(_run("indexed", x, weights, tw, ids, config), np.float64)
    with monkeypatch.context() as patch:
        patch.setattr(X, switch, lambda *a: False)
        clear()
        aligned = np.asarray(_run("indexed", x, weights, tw, ids, config), np.float64)
    clear()
    np.testing.assert_array_equal(got, aligned)
    assert np_ref.relative_error(aligned, expected) < 2e-2


def test_decode_tokens_tiled_by_expert(rng, monkeypatch):
    """From two slots an expert up to a block's rows of tokens, where slot
    blocks do not apply, the indexed pipeline's stages
    lay the slots out in slot order for the GEMMs to tile by expert (no
    grouping; not with an expert map or ``batch_invariant``): the aligned
    layout's result bit for bit, ids outside [0, E) and an expert twice in a
    token as the float64 layer says."""
    config = hj.ExpertsConfig(8, 128, 128, 2, weight_format="int4_g128")
    tiled = [X.tiles_by_expert(t, 2, (16, 16), config, False) for t in (1, 7, 8, 16, 17)]
    assert tiled == [False, False, True, True, False]
    assert [X.tiles_by_expert(t, 2, (16, 8), config, False) for t in (8, 9)] == [True, False]  # the smaller block
    assert not X.tiles_by_expert(8, 2, (16, 16), config, True)
    assert not X.tiles_by_expert(8, 2, (16, 16), dataclasses.replace(config, batch_invariant=True), False)
    assert not X.tiles_by_expert(16, 8, (16, 16), hj.ExpertsConfig(128, 128, 128, 8), False)  # a slot an expert
    x, w13, w2, ids, tw = _problem(rng, config, 10)
    ids[:, 0] = 7  # a hot expert
    ids[1, 1] = 8  # an id outside [0, E)
    ids[2, 1] = -1
    ids[3] = 5  # an expert twice in one token
    _ungrouped_equals_aligned(x, w13, w2, ids, tw, config, "tiles_by_expert", monkeypatch)


@pytest.mark.bounds
def test_batched_matches_numpy_and_zeroes_padding(rng):
    config = hj.ExpertsConfig(4, 128, 128, 1, weight_format="uint4_zp_g128", activation="gelu_tanh")
    max_tokens = 5
    counts = np.array([0, 5, 2, 3])
    x = rng.normal(size=(4, max_tokens, 128)).astype(np.float32)
    x[np.arange(max_tokens)[None, :] >= counts[:, None]] = np.nan  # rows past a count are never read
    _, w13, w2, _, _ = _problem(rng, config, 1)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    out = np.asarray(
        hj.batched_humming_grouped_experts(
            jnp.asarray(x, jnp.bfloat16), jnp.asarray(counts, jnp.int32), weights, config
        ),
        np.float64,
    )
    w13d, w2d = np_ref.dequantize_weight(weights.w13), np_ref.dequantize_weight(weights.w2)
    xb = np.nan_to_num(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64))
    expected = np.zeros_like(out)
    for e in range(4):
        for r in range(counts[e]):
            expected[e, r] = np_ref.activation((xb[e, r] @ w13d[e].T)[None], "gelu_tanh")[0] @ w2d[e].T
    assert np_ref.relative_error(out, expected) < 1e-2
    assert np.all(out[0] == 0) and np.all(out[2, 2:] == 0)


@pytest.mark.parametrize("fmt", ["int4_g128", "bf16"])
def test_batched_float_input_needs_no_pass(fmt, rng, monkeypatch):
    """Unquantized, unrotated input in the compute dtype: w13 reads the
    ``[E, max_tokens, H]`` buffer as it is — no pass over it (it only zeroed
    the rows past each count, which w13 never stores) — and NaN padding gives
    the zero-padded buffer's result bit for bit, zero past each count."""
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format=fmt)
    counts = np.array([3, 0, 8, 1])
    x = rng.normal(size=(4, 8, 128)).astype(np.float32)
    past = np.arange(8)[None, :] >= counts[:, None]
    _, w13, w2, _, _ = _problem(rng, config, 1)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    passes, original = [], X.process_input

    def spy(values, *args, **kwargs):
        passes.append((values.shape, kwargs.get("layout", "normal"), kwargs.get("activation")))
        return original(values, *args, **kwargs)

    monkeypatch.setattr(X, "process_input", spy)

    def run(buffer):
        out = hj.batched_humming_grouped_experts(
            jnp.asarray(buffer, jnp.bfloat16), jnp.asarray(counts, jnp.int32), weights, config
        )
        return np.asarray(out, np.float64)

    poisoned, zeroed = x.copy(), x.copy()
    poisoned[past], zeroed[past] = np.nan, 0.0
    got = run(poisoned)
    assert not [p for p in passes if p[0] == (32, 128) and p[2] is None and p[1] == "grouped_mask"], passes
    assert np.array_equal(got, run(zeroed)) and np.all(got[past] == 0)
    assert np_ref.relative_error(got, _batched_expected(x, counts, weights, "silu")) < 2e-2


def test_batched_tiles_for_the_expected_rows(rng, monkeypatch):
    """``valid_shape_m`` (vLLM's estimate of the routed rows) reaches both
    GEMMs' tiling in place of the buffer's every row (clipped to them); the
    result is the same; a bad value is named."""
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="int4_g128")
    _, w13, w2, _, _ = _problem(rng, config, 1)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    x = jnp.asarray(rng.normal(size=(4, 8, 128)), jnp.bfloat16)
    counts = jnp.asarray([1, 0, 2, 1], jnp.int32)
    seen = []
    original = X.gemm

    def spy(*args, **kwargs):
        seen.append(kwargs["valid_shape_m"])
        return original(*args, **kwargs)

    monkeypatch.setattr(X, "gemm", spy)
    outs = [
        np.asarray(hj.batched_humming_grouped_experts(x, counts, weights, config, valid_shape_m=m), np.float64)
        for m in (None, 4, 1000)
    ]
    assert seen == [32, 32, 4, 4, 32, 32]  # w13 and w2 a call; None and 1000: the buffer's 4 x 8 rows
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    with pytest.raises(ValueError, match="valid_shape_m must be a positive int"):
        hj.batched_humming_grouped_experts(x, counts, weights, config, valid_shape_m=0)


# ---- MoonEP -------------------------------------------------------------------


def _moonep_numpy(x, wg, wu, wd, cu, route, on_input):
    out = np.zeros((x.shape[0], wd.shape[1]))
    start = 0
    for g, end in enumerate(cu):
        for r in range(start, end):
            act = np_ref.silu(x[r] @ wg[g].T) * (x[r] @ wu[g].T)
            if not on_input:
                act = act * route[r]
            out[r] = act @ wd[g].T
        start = end
    return out


_SEGMENTS = [[3, 0, 5, 0, 2, 0], [10, 0, 0, 0, 0, 0], [2, 3, 1, 0, 2, 1], [0, 0, 0, 0, 0, 4]]


@pytest.mark.parametrize(
    "segments,on_input",
    sweep([(s, o) for o in (False, True) for s in _SEGMENTS], [(_SEGMENTS[0], False), (_SEGMENTS[2], True)]),
)
def test_moonep(segments, on_input, rng):
    """E=4 expert rows + B=2 redundant rows; empty segments, one segment,
    redundant rows used and unused; two padding rows past cu_seqlens[-1]."""
    g, h, i = 6, 64, 32
    nvs = sum(segments) + 2
    cu = np.cumsum(segments).astype(np.int32)
    x = rng.normal(size=(nvs, h)).astype(np.float32)
    x[-2:] = np.nan  # padding rows are garbage; the output there must be zero
    wg, wu = (rng.normal(size=(g, i, h)).astype(np.float32) / 8 for _ in range(2))
    wd = rng.normal(size=(g, h, i)).astype(np.float32) / 6
    route = rng.random(nvs).astype(np.float32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    out = hj.moonep_experts(bf(x), bf(wg), bf(wu), bf(wd), jnp.asarray(cu), jnp.asarray(route), on_input)
    f64 = lambda a: np.asarray(bf(a), np.float64)  # noqa: E731
    expected = _moonep_numpy(f64(x), f64(wg), f64(wu), f64(wd), cu, route, on_input)
    out = np.asarray(out, np.float64)
    assert np.all(out[cu[-1] :] == 0)
    assert np_ref.relative_error(out[: cu[-1]], expected[: cu[-1]]) < 1e-2


@pytest.mark.parametrize("on_input", [False, pytest.param(True, marks=FULL)])
def test_moonep_interleaved(on_input, rng, monkeypatch):
    """The MoonEP module's form: gate and up as one w13 interleaved by 64
    (``moonep_w13``), one GEMM whose tiles apply SILU (``takes_activation``),
    then the route weights and w_down; against float64 and MoonEP's own form
    (within the activation's bf16 rounding); padding rows (NaN) come out zero."""
    g, h, i = 6, 64, 128
    segments = _SEGMENTS[0]
    nvs = sum(segments) + 2
    cu = np.cumsum(segments).astype(np.int32)
    x = rng.normal(size=(nvs, h)).astype(np.float32)
    x[-2:] = np.nan
    wg, wu = (rng.normal(size=(g, i, h)).astype(np.float32) / 8 for _ in range(2))
    wd = rng.normal(size=(g, h, i)).astype(np.float32) / 11
    route = rng.random(nvs).astype(np.float32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    w13 = hj.moonep_w13(bf(wg), bf(wu))
    assert w13.gate_up_block == 64 and w13.shape == (g, 2 * i, h)
    taken = _activation_answers(monkeypatch)
    args = (bf(wd), jnp.asarray(cu), jnp.asarray(route), on_input)
    out = np.asarray(hj.moonep_interleaved_experts(bf(x), w13, *args), np.float64)
    assert taken == [True]
    original = np.asarray(hj.moonep_experts(bf(x), bf(wg), bf(wu), *args), np.float64)
    f64 = lambda a: np.asarray(bf(a), np.float64)  # noqa: E731
    expected = _moonep_numpy(f64(x), f64(wg), f64(wu), f64(wd), cu, route, on_input)
    assert np.all(out[cu[-1] :] == 0)
    assert np_ref.relative_error(out[: cu[-1]], expected[: cu[-1]]) < 1e-2
    assert np_ref.relative_error(out[: cu[-1]], original[: cu[-1]]) < 1e-2
    with pytest.raises(ValueError, match="w_down must be"):
        hj.moonep_interleaved_experts(bf(x), w13, bf(wd[:, :, :64]), *args[1:])
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        hj.moonep_interleaved_experts(bf(x), w13, bf(wd), jnp.asarray(cu[:-1]), *args[2:])
    with pytest.raises(TypeError, match="cu_seqlens: expected integer"):
        hj.moonep_interleaved_experts(bf(x), w13, bf(wd), jnp.asarray(cu, jnp.float32), *args[2:])
    with pytest.raises(TypeError, match="w13: expected"):
        hj.moonep_interleaved_experts(bf(x), hj.quantize_weight(jnp.asarray(wg), "int8_channel"), *args)


def test_moonep_grouped_gemm_and_errors(rng):
    a = jnp.asarray(rng.normal(size=(7, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(3, 16, 32)), jnp.bfloat16)
    out = np.asarray(hj.moonep_grouped_gemm(a, w, jnp.asarray([2, 2, 6], jnp.int32)), np.float64)
    a64, w64 = np.asarray(a, np.float64), np.asarray(w, np.float64)
    np.testing.assert_allclose(out[:2], a64[:2] @ w64[0].T, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(out[2:6], a64[2:6] @ w64[2].T, rtol=1e-2, atol=1e-2)
    assert np.all(out[6] == 0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        hj.moonep_grouped_gemm(a, w, jnp.asarray([2, 6], jnp.int32))
    with pytest.raises(TypeError, match="bfloat16"):
        hj.moonep_experts(a, w.astype(jnp.float32), w, jnp.swapaxes(w, 1, 2), jnp.asarray([2, 2, 6]), jnp.ones(7))
    with pytest.raises(ValueError, match="moonep_experts: hidden_states must be bf16"):
        hj.moonep_experts(a.astype(jnp.float32), w, w, jnp.swapaxes(w, 1, 2), jnp.asarray([2, 2, 6]), jnp.ones(7))


def test_pipeline_bad_input(rng):
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="int4_g128")
    x, w13, w2, ids, tw = _problem(rng, config, 4)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    with pytest.raises(ValueError, match="hidden_states must be"):
        hj.humming_grouped_experts(jnp.ones((4, 64)), weights, jnp.asarray(tw), jnp.asarray(ids), config)
    with pytest.raises(ValueError, match="topk_ids must be"):
        hj.humming_indexed_experts(jnp.ones((4, 128)), weights, jnp.asarray(tw), jnp.asarray(ids[:, :1]), config)
    for pipeline in (hj.humming_grouped_experts, hj.humming_indexed_experts):  # the ids passed as the weights
        with pytest.raises(TypeError, match=f"{pipeline.__name__}: topk_weights must be a float array"):
            pipeline(jnp.ones((4, 128)), weights, jnp.asarray(ids), jnp.asarray(ids), config)
    other = hj.ExpertsConfig(4, 128, 128, 2, weight_format="int8_channel")
    with pytest.raises(ValueError, match="weights.w13: format"):
        hj.humming_grouped_experts(jnp.ones((4, 128)), weights, jnp.asarray(tw), jnp.asarray(ids), other)
    with pytest.raises(ValueError, match=r"quantize_experts: w13 must be \[E, N, K\], got shape \(256, 128\)"):
        hj.quantize_experts(jnp.asarray(w13[0]), jnp.asarray(w2), config)
    static = hj.ExpertsConfig(4, 128, 128, 2, weight_format="fp8_channel", input_quant="fp8_static_tensor")
    with pytest.raises(ValueError, match="w13_input_scale"):
        hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), static)


def test_prequantized_per_tensor_input_and_its_bad_forms(rng):
    """A pre-quantized input with one static scale (``fp8_static_tensor``,
    ``a1q_scale [1]``): the grouped layer moves no scale with its rows and
    gives the float input's layer bit for bit (the same static scale
    quantizes it). Pre-quantized inputs that do not fit the config raise,
    naming the pipeline and the argument."""
    config = hj.ExpertsConfig(4, 256, 128, 2, weight_format="fp8_channel", input_quant="fp8_static_tensor")
    x, w13, w2, ids, tw = _problem(rng, config, 8)
    scale = jnp.asarray([0.05], jnp.float32)
    weights = hj.quantize_experts(
        jnp.asarray(w13), jnp.asarray(w2), config, w13_input_scale=scale, w2_input_scale=scale
    )
    q = Q.quantize_input(jnp.asarray(x, jnp.bfloat16), config.input_quant, static_scale=scale)
    args = (weights, jnp.asarray(tw), jnp.asarray(ids), config)
    # The reference's stages: the scale's route is the pipeline's (moe_permute's kernel takes a [1] in test_routing).
    floats = hj.humming_grouped_experts(jnp.asarray(x, jnp.bfloat16), *args, backend="reference")
    given = hj.humming_grouped_experts(q.values, *args, a1q_scale=q.scale, backend="reference")
    floats, given = np.asarray(floats, np.float32), np.asarray(given, np.float32)
    np.testing.assert_array_equal(given, floats)
    assert np.all(np.isfinite(given)) and np.any(given != 0)
    group = hj.ExpertsConfig(4, 256, 128, 2, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    gw = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), group)
    g = Q.quantize_input(jnp.asarray(x), Q.FP8_DYNAMIC_GROUP128)
    gargs = (gw, jnp.asarray(tw), jnp.asarray(ids), group)
    int4 = hj.ExpertsConfig(4, 256, 128, 2, weight_format="int4_g128")
    bad = [
        ((g.values, *gargs), dict(a1q_scale=g.scale[:, :1]), ValueError, r"a1q_scale must be \[8, 2\]"),
        ((g.values, *gargs), dict(a1q_scale=g.scale.astype(jnp.bfloat16)), TypeError, "a1q_scale must be float32"),
        ((jnp.asarray(x, jnp.bfloat16), *gargs), dict(a1q_scale=g.scale), TypeError, "values must be float8_e4m3fn"),
        (
            (g.values, gw, jnp.asarray(tw), jnp.asarray(ids[:, :1]), group),
            dict(a1q_scale=g.scale),
            ValueError,
            "topk_ids",
        ),
        ((g.values, gw, jnp.asarray(ids), jnp.asarray(ids), group), dict(a1q_scale=g.scale), TypeError, "topk_weights"),
    ]
    for pipeline in (hj.humming_grouped_experts, hj.humming_indexed_experts):
        for call_args, kwargs, error, message in bad:
            with pytest.raises(error, match=f"{pipeline.__name__}: .*{message}"):
                pipeline(*call_args, **kwargs)
        with pytest.raises(ValueError, match="a1q_scale was given but config.input_quant is 'none'"):
            pipeline(g.values, weights, jnp.asarray(tw), jnp.asarray(ids), int4, a1q_scale=g.scale)
    counts = jnp.asarray([2, 0, 1, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"batched_humming_grouped_experts: a1q_scale must be \[4, 2, 2\]"):
        hj.batched_humming_grouped_experts(g.values.reshape(4, 2, 256), counts, gw, group, a1q_scale=g.scale)


def test_layers_return_their_inputs_dtype(rng):
    """A float32 or float16 input: each pipeline computes in
    ``config.compute_dtype`` (bf16) and returns the input's dtype — the bf16
    input's values, cast (the input rounded to bf16 is all that differs)."""
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="int4_g128")
    x, w13, w2, ids, tw = _problem(rng, config, 5)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    tw, ids = jnp.asarray(tw), jnp.asarray(ids)
    counts = jnp.asarray([2, 0, 3, 1], jnp.int32)
    xb = rng.normal(size=(4, 3, 128)).astype(np.float32)
    layers = {
        "grouped": (lambda h: hj.humming_grouped_experts(h, weights, tw, ids, config), x),
        "indexed": (lambda h: hj.humming_indexed_experts(h, weights, tw, ids, config), x),
        "batched": (lambda h: hj.batched_humming_grouped_experts(h, counts, weights, config), xb),
    }
    if not sweep_module.FULL_RUN:  # make test: the grouped layer (the cast is the layers' shared helper)
        layers = {"grouped": layers["grouped"]}
    for name, (layer, values) in layers.items():
        rounded = np.asarray(layer(jnp.asarray(values, jnp.bfloat16)), np.float32)
        # float16 through one pipeline: the cast in and out is the layers' shared wrapper.
        for dtype in (jnp.float32, jnp.float16) if name == "grouped" else (jnp.float32,):
            given = jnp.asarray(jnp.asarray(values, jnp.bfloat16), dtype)  # exact in both
            out = layer(given)
            assert out.dtype == dtype, (name, out.dtype)
            np.testing.assert_array_equal(
                np.asarray(out, np.float32), np.asarray(jnp.asarray(rounded, dtype), np.float32)
            )


def test_jit_does_not_recompile_for_new_routing(rng):
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="int4_g128")
    x, w13, w2, ids, tw = _problem(rng, config, 6)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    xs = jnp.asarray(x, jnp.bfloat16)
    hj.humming_grouped_experts(xs, weights, jnp.asarray(tw), jnp.asarray(ids), config)
    before = hj.humming_grouped_experts._cache_size()
    for seed in range(3):
        new_ids = np.random.default_rng(seed).integers(0, 4, size=ids.shape).astype(np.int32)
        jax.block_until_ready(hj.humming_grouped_experts(xs, weights, jnp.asarray(tw), jnp.asarray(new_ids), config))
    assert hj.humming_grouped_experts._cache_size() == before


@pytest.mark.parametrize("fmt", ["int4_g128", "mxfp4"])
def test_weights_come_in_the_kernels_order(fmt, rng):
    """quantize_experts gives 4-bit codes in the planar order the kernels read
    without a split copy of the activations (e2m1 in bf16 also in the pair
    decoder's bit order; MXFP4's scales ``[E, K/32, N]``); the same layer
    built in K order gives the same output."""
    config = hj.ExpertsConfig(8, 128, 128, 2, weight_format=fmt)
    x, w13, w2, ids, tw = _problem(rng, config, 5)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    for w in (weights.w13, weights.w2):
        assert w.nibble_unit == hj.formats.planar_unit(w.format, w.k) > 0
        assert w.half_bits == w.k_major_scales == (fmt == "mxfp4")
    again = hj.to_kernel_order(weights, config)  # already in order: the same weights
    assert again.w13 is weights.w13 and again.w2 is weights.w2
    if fmt == "mxfp4":  # (the layer in interpret mode once: e2m1 pairs are the stricter order)
        k_order = hj.ExpertWeights(hj.to_k_order(weights.w13), hj.to_k_order(weights.w2))
        planar, k_ordered = (_run("grouped", x, w, tw, ids, config, backend="interpret") for w in (weights, k_order))
        np.testing.assert_array_equal(np.asarray(planar, np.float32), np.asarray(k_ordered, np.float32))


@FULL  # an interpreted layer of 256 (indexed: 512) rows an expert (test-full, the GPU step)
@pytest.mark.parametrize("pipeline", ["grouped", "indexed"])
def test_w4a8_prefill_through_the_e4m3_copy(pipeline, rng):
    """W4A8 from E4M3_COPY_MIN_ROWS rows an expert (indexed:
    E4M3_COPY_MIN_ROWS_INDEXED): both GEMMs decode the codes into an e4m3 copy
    and run the channel-scaled e4m3 product (the plan's first choice); the
    layer against float64 NumPy."""
    from humming_jax import tuning as T
    from humming_jax.tuning import heuristic

    config = hj.ExpertsConfig(4, 256, 128, 2, weight_format="mxfp4", input_quant="fp8_dynamic_group128")
    indexed = pipeline == "indexed"
    rows = heuristic.E4M3_COPY_MIN_ROWS_INDEXED if indexed else heuristic.E4M3_COPY_MIN_ROWS
    tokens = rows * config.num_experts // config.top_k
    layout = "indexed" if indexed else "grouped_contiguous"
    for n, k in ((config.w13_n, config.hidden_size), (config.hidden_size, config.intermediate_size)):
        listed = T.candidates(
            layout, config.weight_format, tokens * 2, 4, n, k, half_bits=True, input_dtype="float8_e4m3"
        )
        assert listed[0] == heuristic.E4M3_COPY
    x, w13, w2, ids, tw = _problem(rng, config, tokens)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    out = np.asarray(_run(pipeline, x, weights, tw, ids, config), np.float64)
    assert np_ref.relative_error(out, _expected_layer(x, weights, ids, tw, config)) < 6e-2  # fp8 e4m3 activations


@pytest.mark.parametrize("pipeline", sweep(PIPELINES, PIPELINES[:1]))
def test_w4a8_inputs_written_multiplied_out(pipeline, rng):
    """W4A8 at decode: the GEMMs' tiles multiply the fp8 input out to bf16
    (``dequantize_input``), so the pipeline has ``process_input`` write those
    values itself (``dequantize=True``, no pass of the GEMM's own) — the
    same layer, against float64 NumPy."""
    config = hj.ExpertsConfig(4, 256, 128, 2, weight_format="mxfp4", input_quant="fp8_dynamic_group128")
    x, w13, w2, ids, tw = _problem(rng, config, 8)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    layout = hj.GroupedContiguous(jnp.asarray([0, 4, 8, 12, 16], jnp.int32))
    tiles = X.multiplied_out_tiles(config, "w13", weights.w13, layout, 16, 16, "interpret")
    assert tiles is not None and not tiles.dequantize_input  # the fused path runs
    assert X.multiplied_out_tiles(config, "w13", weights.w13, layout, 16, 16, "reference") is None
    out = np.asarray(_run(pipeline, x, weights, tw, ids, config), np.float64)
    expected = _expected_layer(x, weights, ids, tw, config)
    assert np_ref.relative_error(out, expected) < 6e-2  # fp8 e4m3 activations and e2m1 weights
    reference = np.asarray(_run(pipeline, x, weights, tw, ids, config, backend="reference"), np.float64)
    assert np_ref.relative_error(out, reference) < 3e-2  # (the reference keeps the scaled input in f32)
    # The GEMM on the input written multiplied out is bit for bit the GEMM multiplying it out itself.
    rows = jnp.asarray(rng.normal(size=(16, 256)), jnp.bfloat16)
    quantized = hj.process_input(rows, config.input_quant, backend="interpret")
    written = hj.process_input(rows, config.input_quant, backend="interpret", dequantize=True)
    itself = hj.gemm(quantized, weights.w13, layout, backend="interpret", valid_shape_m=16)
    fused = hj.gemm(written, weights.w13, layout, backend="interpret", tuning=tiles)
    np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(itself, np.float32))


@FULL  # test_w4a8_inputs_written_multiplied_out's pass on the batched layout
def test_w4a8_batched_inputs_written_multiplied_out(rng, monkeypatch):
    """The batched pipeline, as the others: where the GEMMs' tiles multiply the
    fp8 input out to bf16 (W4A8 at decode), ``process_input`` writes those
    values itself, for w13's input and w2's; against float64 per expert and
    the reference, rows past a count (NaN in the buffer) zero."""
    config = hj.ExpertsConfig(4, 256, 128, 2, weight_format="mxfp4", input_quant="fp8_dynamic_group128")
    _, w13, w2, _, _ = _problem(rng, config, 1)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    counts = np.array([3, 0, 4, 1])
    x = rng.normal(size=(4, 4, 256)).astype(np.float32)
    x[np.arange(4)[None, :] >= counts[:, None]] = np.nan
    flags = []
    original = X.process_input

    def spy(*args, **kwargs):
        flags.append(kwargs.get("dequantize", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(X, "process_input", spy)
    run = functools.partial(hj.batched_humming_grouped_experts, jnp.asarray(x, jnp.bfloat16), jnp.asarray(counts))
    out = np.asarray(run(weights, config), np.float64)
    assert flags == [True, True]  # w13's input and w2's (the activation in w13's tiles)
    expected = _batched_expected(x, counts, weights, "silu")
    assert np.all(out[np.arange(4)[None, :] >= counts[:, None]] == 0)
    assert np_ref.relative_error(out, expected) < 6e-2  # fp8 e4m3 activations and e2m1 weights
    reference = np.asarray(run(weights, config, backend="reference"), np.float64)
    assert np_ref.relative_error(out, reference) < 3e-2


_EPILOGUE_LAYERS = [
    ("int4_g128", "silu", "none"),
    ("fp8_block128", "silu", "fp8_dynamic_group128"),  # W8A8: blocks of 64, a scale a 64-row block
    ("bf16", "gelu_tanh", "none"),
    ("mxfp4", "silu", "fp8_dynamic_group128"),
]


_EPILOGUE_CASES = [(*layer, pipeline) for layer in _EPILOGUE_LAYERS for pipeline in ("grouped", "indexed", "batched")]


# make test: each pipeline once, each of the first two layers (4-bit weights, W8A8) on one or two.
@pytest.mark.parametrize(
    "fmt,activation,quant,pipeline",
    sweep(
        _EPILOGUE_CASES,
        [(*_EPILOGUE_LAYERS[0], "grouped"), (*_EPILOGUE_LAYERS[1], "indexed"), (*_EPILOGUE_LAYERS[0], "batched")],
    ),
)
def test_activation_in_w13s_tiles(fmt, activation, quant, pipeline, rng, monkeypatch):
    """``quantize_experts`` interleaves w13's gate and up rows, so w13's tiles
    apply the activation (no pass of their sums: ``takes_activation``); the
    layer on the same weights in halves runs the pass. Both against float64,
    and each other within a bf16 rounding of gate and up."""
    config = hj.ExpertsConfig(4, 128, 128, 2, activation=activation, weight_format=fmt, input_quant=quant)
    x, w13, w2, ids, tw = _problem(rng, config, 16)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    assert weights.w13.gate_up_block == hj.formats.GATE_UP_BLOCK
    halves = dataclasses.replace(weights, w13=hj.gate_up_halves(weights.w13))
    taken = _activation_answers(monkeypatch)

    def run(w):
        if pipeline != "batched":
            return np.asarray(_run(pipeline, x, w, tw, ids, config), np.float64)
        counts = jnp.asarray([4, 0, 3, 4], jnp.int32)  # an empty expert, padding rows
        rows = jnp.asarray(x[:16].reshape(4, 4, 128), jnp.bfloat16)
        return np.asarray(hj.batched_humming_grouped_experts(rows, counts, w, config), np.float64)

    fused, passed = run(weights), run(halves)
    assert taken == [True, False]
    if pipeline == "batched":
        rows = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64).reshape(4, 4, 128)
        w13d, w2d = np_ref.dequantize_weight(weights.w13), np_ref.dequantize_weight(weights.w2)
        expected = np.zeros((4, 4, 128))
        for e, count in enumerate([4, 0, 3, 4]):
            act = np_ref.activation(rows[e, :count] @ w13d[e].T, activation)
            expected[e, :count] = act @ w2d[e].T
        assert np.all(fused[1] == 0) and np.all(fused[2, 3:] == 0)
    else:
        expected = _expected_layer(x, weights, ids, tw, config)
    bound = 6e-2 if quant != "none" else 2e-2
    assert np_ref.relative_error(fused, expected) < bound
    assert np_ref.relative_error(passed, expected) < bound
    assert np_ref.relative_error(fused, passed) < (3e-2 if quant != "none" else 1e-2)


def test_interleaved_rows_need_an_activation_that_reads_blocks(rng):
    config = hj.ExpertsConfig(4, 128, 128, 2, activation="swigluoai", weight_format="bf16")
    x, w13, w2, ids, tw = _problem(rng, config, 2)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    assert weights.w13.gate_up_block == 0  # SWIGLUOAI reads its own pairs
    wrong = dataclasses.replace(weights, w13=hj.interleave_gate_up(weights.w13, 32))
    with pytest.raises(ValueError, match="weights.w13.gate_up_block"):
        _run("grouped", x, wrong, tw, ids, config)


def _activation_answers(monkeypatch, out_quant: bool = False) -> list:
    """``takes_activation``'s answers (filled as the layer runs): those for the
    activation alone, or (``out_quant``) those where the epilogue would also
    quantize w2's input."""
    answers = []
    original = X.takes_activation

    def spy(*args, **kwargs):
        answer = original(*args, **kwargs)
        if (kwargs.get("out_quant") is not None) == out_quant:
            answers.append(answer)
        return answer

    monkeypatch.setattr(X, "takes_activation", spy)
    return answers


def _batched_expected(x, counts, weights, activation: str) -> np.ndarray:
    """The batched layer in float64: each expert's first ``counts[e]`` rows of
    ``x [E, max_tokens, H]`` (bf16-rounded; NaN padding ignored) through its
    dequantized weights, zero past the counts."""
    xb = np.nan_to_num(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64))
    w13d, w2d = np_ref.dequantize_weight(weights.w13), np_ref.dequantize_weight(weights.w2)
    expected = np.zeros((*xb.shape[:2], w2d.shape[1]))
    for e, count in enumerate(counts):
        expected[e, :count] = np_ref.activation(xb[e, :count] @ w13d[e].T, activation) @ w2d[e].T
    return expected


# indexed: at 128 rows an expert the indexed pipeline runs the grouped stages (test-full, the GPU step)
@pytest.mark.parametrize("pipeline", sweep(["grouped", "indexed"], ["grouped"]))
def test_w8a8_prefill_activation_in_w13s_tiles(pipeline, rng, monkeypatch):
    """W8A8 at 128 rows an expert (the fp8 kernel's 64 x 256 tiles): w13
    interleaved by 64 rows with a scale a 64-row block, so each warpgroup's
    128 columns hold whole gate/up pairs, the tiles apply the activation and
    quantize w2's fp8 group-128 input (a tile's 128 outputs a row: one group)
    — no pass between the GEMMs; the layer on w13 in halves runs the
    activation's pass. Both against float64, and each other within a bf16
    rounding of gate and up."""
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    x, w13, w2, ids, tw = _problem(rng, config, 256)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    assert weights.w13.gate_up_block == 64 and weights.w13.scale.shape == (4, 256 // 64, 1)
    halves = dataclasses.replace(weights, w13=hj.gate_up_halves(weights.w13))
    taken = _activation_answers(monkeypatch)
    quantized = _activation_answers(monkeypatch, out_quant=True)
    interleaved = np.asarray(_run(pipeline, x, weights, tw, ids, config), np.float64)
    passed = np.asarray(_run(pipeline, x, halves, tw, ids, config), np.float64)
    assert quantized == [True, False] and taken == [False]
    expected = _expected_layer(x, weights, ids, tw, config)
    assert np_ref.relative_error(interleaved, expected) < 6e-2
    assert np_ref.relative_error(passed, expected) < 6e-2
    assert np_ref.relative_error(interleaved, passed) < 3e-2


def test_w8a8_batched_prefill(rng, monkeypatch):
    """The batched W8A8 layer at ~128 rows an expert (its rows gathered, NaN
    past each count): w13's fp8 tiles on the masked layout apply the
    activation and quantize w2's input; against float64 per expert and the
    layer on w13 in halves (the activation's pass); rows past a count zero."""
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    counts = np.array([128, 0, 120, 97])
    x = rng.normal(size=(4, 128, 128)).astype(np.float32)
    x[np.arange(128)[None, :] >= counts[:, None]] = np.nan
    _, w13, w2, _, _ = _problem(rng, config, 1)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    halves = dataclasses.replace(weights, w13=hj.gate_up_halves(weights.w13))
    taken = _activation_answers(monkeypatch)
    quantized = _activation_answers(monkeypatch, out_quant=True)

    def run(w):
        out = hj.batched_humming_grouped_experts(
            jnp.asarray(x, jnp.bfloat16), jnp.asarray(counts, jnp.int32), w, config
        )
        return np.asarray(out, np.float64)

    interleaved = run(weights)
    passed = run(halves)
    assert quantized == [True, False] and taken == [False]
    expected = _batched_expected(x, counts, weights, "silu")
    assert np.all(np.isfinite(interleaved)) and np.all(interleaved[np.arange(128)[None, :] >= counts[:, None]] == 0)
    assert np_ref.relative_error(interleaved, expected) < 6e-2
    assert np_ref.relative_error(passed, expected) < 6e-2
    assert np_ref.relative_error(interleaved, passed) < 3e-2


def test_w4a8_w2_input_multiplied_out_by_w13s_tiles(rng):
    """W4A8 where w2 runs on its input multiplied out (the 16-bit tiles, as
    at qwen3 T=4096): w13's 16-bit tiles on the input multiplied out apply
    the activation, quantize w2's fp8 group-128 input and multiply it back
    out — the unquantized input the quantizing pass with ``dequantize`` gives,
    within an e4m3 rounding of it."""
    from pallas_kernels.gemm import mosaic

    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="mxfp4", input_quant="fp8_dynamic_group128")
    x, w13, w2, _, _ = _problem(rng, config, 40)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    layout = hj.GroupedContiguous(jnp.asarray([0, 7, 7, 30, 33], jnp.int32))
    xq = Q.quantize_input(jnp.asarray(x, jnp.float32), config.input_quant)
    tiles = mosaic.Tiles(64, 256, 128, stages=2, dequantize_input=True)
    kw = dict(out_dtype=jnp.bfloat16, tuning=tiles)
    s = X._w13_with_activation(config, weights, xq, layout, None, w2_reads_quantized=False, **kw)
    assert s["gate_up"] is None and not s["activated"].spec.is_quantized
    got = np.asarray(s["activated"].values, np.float64)
    sums = hj.gemm(xq, weights.w13, layout, backend="reference", out_dtype=jnp.float32)
    passed = X._down_input(sums, config, weights, "reference", dequantize=True)
    want = np.asarray(passed.values, np.float64)
    assert got.shape == want.shape == (40, 128)
    assert np_ref.relative_error(got, want) < 2e-2
    assert np.all(got[33:] == 0) and np.all(np.isfinite(got))
    # Past one row tile an expert the pass quantizes w2's input: the tile applies the activation alone.
    many = hj.GroupedContiguous(jnp.asarray([0, 100, 100, 200, 260], jnp.int32))
    x_many = Q.quantize_input(jnp.asarray(rng.normal(size=(260, 128)), jnp.float32), config.input_quant)
    spec, quant = X.w13_activation(config, weights), config.w2_input_quant
    assert not X.takes_activation(x_many, weights.w13, many, spec, out_quant=quant, out_dequantized=True, **kw)
    assert X.takes_activation(x_many, weights.w13, many, spec, **kw)
    assert X.takes_activation(xq, weights.w13, layout, spec, out_quant=quant, out_dequantized=True, **kw)


@pytest.mark.parametrize("bounds", [(0, 7, 7, 30, 33), (0, 100, 100, 200, 260)], ids=["one_tile", "two_tiles"])
def test_w4a8_w13_in_the_layers_form(rng, bounds):
    """W4A8's w13 as the layer runs it: ``process_input`` writes the input
    multiplied out and w13 gets its tiles with ``dequantize_input`` cleared
    (``multiplied_out_tiles``), so the kernel sees a 16-bit call. Up to one
    row tile an expert its epilogue quantizes w2's input and multiplies it
    back out (no ``gate_up``, an unquantized ``activated``); past one it
    applies the activation alone and the pass quantizes. Either way w2's
    input is within an e4m3 rounding of the reference's."""
    from humming_jax.process_input import process_input
    from pallas_kernels.gemm import mosaic

    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="mxfp4", input_quant="fp8_dynamic_group128")
    _, w13, w2, _, _ = _problem(rng, config, 8)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    layout = hj.GroupedContiguous(jnp.asarray(bounds, jnp.int32))
    rows = bounds[-1] + 7  # rows past the last expert's: owned by none
    x = jnp.asarray(rng.normal(size=(rows, 128)), jnp.float32)
    multiplied = process_input(x, config.input_quant, dequantize=True, backend="reference")
    assert not multiplied.spec.is_quantized
    tiles = mosaic.Tiles(64, 256, 128, stages=2)  # multiplied_out_tiles' form: dequantize_input cleared
    kw = dict(out_dtype=jnp.bfloat16, tuning=tiles)
    s = X._w13_with_activation(config, weights, multiplied, layout, None, w2_reads_quantized=False, **kw)
    assert s["gate_up"] is None
    one_tile = max(np.diff(bounds)) <= tiles.block_m
    # One tile an expert: w2's input straight from the epilogue; past it, activated rows for the pass.
    assert isinstance(s["activated"], Q.QuantizedInput) == one_tile
    valid = jnp.asarray([bounds[-1]])
    got = X._down_input_stage(dict(s, weights=weights), config, None, True, num_valid_tokens=valid)
    xq = Q.quantize_input(x, config.input_quant)
    sums = hj.gemm(xq, weights.w13, layout, backend="reference", out_dtype=jnp.float32)
    want = X._down_input(sums, config, weights, "reference", dequantize=True)
    assert not got.spec.is_quantized and got.values.shape == want.values.shape == (rows, 128)
    got64, want64 = np.asarray(got.values, np.float64), np.asarray(want.values, np.float64)
    n = bounds[-1]
    assert np_ref.relative_error(got64[:n], want64[:n]) < 2e-2 and np.all(np.isfinite(got64))
    assert np.all(got64[n:] == 0)


def test_w4a8_w2_input_past_one_row_tile_an_expert(rng):
    """W4A8 past one row tile an expert on the 16-bit tile with the input
    multiplied out: w13's stage and the pass after it (whichever applies the
    activation) give w2's input multiplied out, within an e4m3 rounding of
    the reference's; every row owned, none NaN."""
    from pallas_kernels.gemm import mosaic

    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="mxfp4", input_quant="fp8_dynamic_group128")
    _, w13, w2, _, _ = _problem(rng, config, 8)
    weights = hj.quantize_experts(jnp.asarray(w13), jnp.asarray(w2), config)
    many = hj.GroupedContiguous(jnp.asarray([0, 100, 100, 200, 260], jnp.int32))  # 65 rows an expert on 64
    x = Q.quantize_input(jnp.asarray(rng.normal(size=(260, 128)), jnp.float32), config.input_quant)
    kw = dict(out_dtype=jnp.bfloat16, tuning=mosaic.Tiles(64, 256, 128, stages=2, dequantize_input=True))
    s = X._w13_with_activation(config, weights, x, many, None, w2_reads_quantized=False, **kw)
    got = X._down_input_stage(dict(s, weights=weights), config, None, True, num_valid_tokens=jnp.asarray([260]))
    sums = hj.gemm(x, weights.w13, many, backend="reference", out_dtype=jnp.float32)
    want = X._down_input(sums, config, weights, "reference", dequantize=True)
    assert not got.spec.is_quantized and got.values.shape == want.values.shape == (260, 128)
    got64, want64 = np.asarray(got.values, np.float64), np.asarray(want.values, np.float64)
    assert np_ref.relative_error(got64, want64) < 2e-2 and np.all(np.isfinite(got64))
