"""Bad values a hostile caller passes get a clear error naming the argument
(issue 29): quantized codes as activations, static scales that would zero or
poison every input, float segment ends, a tuple for the weights, gate and up
tensors of a checkpoint that cannot be fused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import input_quant as Q
from humming_jax.checkpoints import load_experts

E, H, INTER, TOP_K, T = 4, 128, 128, 2, 6


@pytest.fixture
def layer(rng):
    config = hj.ExpertsConfig(E, H, INTER, TOP_K, weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    w13 = jnp.asarray(rng.normal(0, 0.05, (E, 2 * INTER, H)), jnp.float32)
    w2 = jnp.asarray(rng.normal(0, 0.05, (E, H, INTER)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, E, (T, TOP_K)), jnp.int32)
    return config, hj.quantize_experts(w13, w2, config), jnp.full((T, TOP_K), 0.5, jnp.float32), ids


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8])
def test_quantized_codes_without_their_scale(layer, dtype, rng):
    """fp8 / int8 codes passed as activations would be quantized again: each
    entry point asks for their scale instead."""
    config, weights, tw, ids = layer
    codes = jnp.asarray(rng.normal(size=(T, H)), jnp.float32).astype(dtype)
    for pipeline in (hj.humming_grouped_experts, hj.humming_indexed_experts):
        with pytest.raises(ValueError, match="hidden_states: .* without a1q_scale"):
            pipeline(codes, weights, tw, ids, config)
    batched = codes.reshape(1, T, H).repeat(E, axis=0)
    with pytest.raises(ValueError, match="hidden_states: .* without a1q_scale"):
        hj.batched_humming_grouped_experts(batched, jnp.full((E,), 2, jnp.int32), weights, config)
    with pytest.raises(ValueError, match="process_input: x: .* without input_scale"):
        hj.process_input(codes, Q.FP8_DYNAMIC_GROUP128)


@pytest.mark.parametrize("scale", [0.0, float("nan")])
def test_static_scales_must_be_finite_and_positive(scale, rng):
    config = hj.ExpertsConfig(E, H, INTER, TOP_K, weight_format="fp8_channel", input_quant="fp8_static_tensor")
    w13 = jnp.asarray(rng.normal(0, 0.05, (E, 2 * INTER, H)), jnp.float32)
    w2 = jnp.asarray(rng.normal(0, 0.05, (E, H, INTER)), jnp.float32)
    good = jnp.asarray([0.01], jnp.float32)
    with pytest.raises(ValueError, match="weights.w13_input_scale: expected a finite positive scale"):
        hj.quantize_experts(w13, w2, config, w13_input_scale=jnp.asarray([scale]), w2_input_scale=good)
    with pytest.raises(ValueError, match="weights.w2_input_scale: expected a finite positive scale"):
        hj.quantize_experts(w13, w2, config, w13_input_scale=good, w2_input_scale=jnp.asarray([scale]))
    weights = hj.quantize_experts(w13, w2, config, w13_input_scale=good, w2_input_scale=good)
    assert float(weights.w13_input_scale[0]) == pytest.approx(0.01)


def test_float_segment_ends_are_refused(rng):
    w = jnp.asarray(rng.normal(size=(3, 32, 64)), jnp.bfloat16)
    a = jnp.asarray(rng.normal(size=(10, 64)), jnp.bfloat16)
    with pytest.raises(TypeError, match="cu_seqlens: expected integer segment ends, got float32"):
        hj.moonep_grouped_gemm(a, w, jnp.asarray([2.9, 6.0, 10.0], jnp.float32))


def test_a_tuple_for_the_weights(layer):
    config, weights, tw, ids = layer
    x = jnp.zeros((T, H), jnp.bfloat16)
    with pytest.raises(TypeError, match="weights: expected ExpertWeights .* got tuple"):
        hj.humming_grouped_experts(x, (weights.w13, weights.w2), tw, ids, config)


def test_checkpoint_gate_and_up_of_different_groups(tmp_path, rng):
    """A compressed-tensors checkpoint whose up projection has other scale
    groups than its gate cannot be fused into one w13: the error names the
    expert and the part (GPTQ, AWQ, FP8-block and NVFP4 tensors are each
    checked against the config's shape first)."""
    from test_checkpoints import PREFIX, _per_expert, _save, write_compressed_tensors

    tensors, _, _ = _per_expert(rng, write_compressed_tensors)
    config = hj.ExpertsConfig(2, 256, 256, 2, weight_format="int4_g128")
    bad = dict(tensors)
    key = f"{PREFIX}.1.up_proj.weight_scale"
    bad[key] = np.ascontiguousarray(tensors[key][:, :1])  # one group along K instead of two
    with pytest.raises(ValueError, match=r"w13 expert 1 scales: gate and up differ past the rows \(\(2,\) vs \(1,\)\)"):
        load_experts(_save(tmp_path, bad), PREFIX, config, "compressed_tensors")


def test_traced_scales_are_not_checked_under_jit(layer):
    """Under ``jit`` a static scale is a tracer: the check runs where it is concrete (at load)."""
    config, weights, tw, ids = layer
    x = jnp.zeros((T, H), jnp.bfloat16)
    out = jax.eval_shape(lambda w: hj.humming_grouped_experts(x, w, tw, ids, config), weights)
    assert out.shape == (T, H)


@pytest.mark.parametrize("pipeline", [hj.humming_grouped_experts])  # indexed: the same kernels, rows in place
def test_a_nan_token_poisons_its_own_output_only(layer, pipeline, rng):
    """The NaN rule through a quantized layer: the token with a NaN gets a NaN
    output row; every other token's row is finite and what it is without it."""
    config, weights, tw, ids = layer
    x = rng.normal(size=(T, H)).astype(np.float32)
    clean = pipeline(jnp.asarray(x, jnp.bfloat16), weights, tw, ids, config)
    x[2, 5] = np.nan
    out = np.asarray(pipeline(jnp.asarray(x, jnp.bfloat16), weights, tw, ids, config), np.float32)
    assert np.all(np.isnan(out[2]))
    others = [t for t in range(T) if t != 2]
    np.testing.assert_array_equal(out[others], np.asarray(clean, np.float32)[others])
