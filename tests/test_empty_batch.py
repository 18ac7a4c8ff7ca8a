"""An empty batch (T=0: idle expert-parallel ranks, dynamic batching) gives
correctly shaped empty results through every public entry point, on the
kernel backend and the reference."""

import jax
import jax.numpy as jnp
import pytest

import humming_jax as hj
from humming_jax import input_quant as Q

KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
BACKENDS = [KERNEL_BACKEND, "reference"]
E, H, INTER, TOP_K = 4, 256, 128, 2


def _shapes(tree):
    return jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype).name), tree)


@pytest.mark.parametrize("backend", BACKENDS)
def test_routing_ops(backend):
    ids = jnp.zeros((0, TOP_K), jnp.int32)
    x = jnp.zeros((0, H), jnp.bfloat16)
    sorted_ids, expert_ids, padded = hj.moe_align_block_size(ids, 16, E, backend=backend)
    assert sorted_ids.shape == (0,) and expert_ids.shape == (0,) and padded.tolist() == [0]
    offsets, scatter_idx = hj.moe_prepare_scatter(ids, E, backend=backend)
    assert offsets.tolist() == [0] * (E + 1) and scatter_idx.shape == (0, TOP_K)
    scale = jnp.zeros((0, 2), jnp.float32)
    permuted = hj.moe_permute(x, ids, E, a1q_scale=scale, backend=backend)
    assert permuted.permuted_hidden_states.shape == (0, H) and permuted.permuted_scale.shape == (0, 2)
    assert permuted.inv_permuted_idx.shape == (0,) and permuted.expert_first_token_offset.shape == (E + 1,)
    weights = jnp.zeros((0, TOP_K), jnp.float32)
    out = hj.moe_unpermute(
        permuted.permuted_hidden_states, weights, permuted.inv_permuted_idx, offsets, backend=backend
    )
    assert (out.shape, out.dtype) == ((0, H), jnp.bfloat16)
    fused = hj.moe_fused_mul_sum(jnp.zeros((0, TOP_K, H), jnp.bfloat16), weights, ids, E, backend=backend)
    assert (fused.shape, fused.dtype) == ((0, H), jnp.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "spec", [Q.NONE, Q.FP8_DYNAMIC_TOKEN, Q.MXFP8_DYNAMIC, Q.NVFP4_DYNAMIC_TOKEN], ids=lambda s: s.name
)
def test_quantization_and_process_input(spec, backend):
    """vLLM's contract: an empty MXFP8 quantization returns [0, K] values and [0, K/32] scales."""
    x = jnp.zeros((0, H), jnp.bfloat16)
    q = hj.quantize_input(x, spec) if spec.is_quantized else None
    got = hj.process_input(x, spec, backend=backend)
    want_cols = H // spec.packs_k
    assert got.values.shape == (0, want_cols)
    if q is not None:
        assert _shapes(got.values) == _shapes(q.values) and _shapes(got.scale) == _shapes(q.scale)
    if spec == Q.MXFP8_DYNAMIC:
        assert got.scale.shape == (0, H // 32)
    gate_up = jnp.zeros((0, 2 * INTER), jnp.bfloat16)
    scatter = hj.process_input(
        gate_up, spec, activation="silu", layout="scatter", scatter_idx=jnp.zeros((0, 1), jnp.int32), backend=backend
    )
    assert scatter.values.shape == (0, INTER // spec.packs_k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["bf16", "int4_g128", "mxfp4"])
def test_gemm_layouts(fmt, backend):
    x = jnp.zeros((0, H), jnp.bfloat16)
    w = hj.quantize_weight(jnp.ones((E, 128, H), jnp.float32) * 0.01, hj.get_format(fmt))
    grouped = hj.GroupedContiguous(jnp.zeros(E + 1, jnp.int32))
    assert hj.gemm(x, w, grouped, backend=backend).shape == (0, 128)
    indexed = hj.Indexed(*hj.moe_align_block_size(jnp.zeros((0, TOP_K), jnp.int32), 16, E), top_k=TOP_K, block_size=16)
    assert hj.gemm(x, w, indexed, backend=backend).shape == (0, 128)
    masked = hj.GroupedMasked(jnp.zeros(E, jnp.int32))
    assert hj.gemm(x, w, masked, backend=backend).shape == (0, 128)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipelines_and_modules(backend, rng):
    config = hj.ExpertsConfig(E, H, INTER, TOP_K, weight_format="int4_g128")
    w13 = jnp.asarray(rng.normal(size=(E, 2 * INTER, H)) * 0.05, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(E, H, INTER)) * 0.05, jnp.float32)
    weights = hj.quantize_experts(w13, w2, config)
    x = jnp.zeros((0, H), jnp.bfloat16)
    tw, ids = jnp.zeros((0, TOP_K), jnp.float32), jnp.zeros((0, TOP_K), jnp.int32)
    for pipeline in (hj.humming_grouped_experts, hj.humming_indexed_experts):
        out = pipeline(x, weights, tw, ids, config, backend=backend)
        assert (out.shape, out.dtype) == ((0, H), jnp.bfloat16)
    batched = hj.batched_humming_grouped_experts(
        jnp.zeros((E, 0, H), jnp.bfloat16), jnp.zeros(E, jnp.int32), weights, config, backend=backend
    )
    assert batched.shape == (E, 0, H)
    g = 3
    moonep = hj.moonep_experts(
        jnp.zeros((0, H), jnp.bfloat16),
        jnp.ones((g, INTER, H), jnp.bfloat16),
        jnp.ones((g, INTER, H), jnp.bfloat16),
        jnp.ones((g, H, INTER), jnp.bfloat16),
        jnp.zeros(g, jnp.int32),
        jnp.zeros((0,), jnp.float32),
        backend=backend,
    )
    assert moonep.shape == (0, H)


def test_modules():
    """The NNX expert modules and the MoE block (router, shared expert) on no tokens."""
    from flax import nnx

    from humming_jax import nn

    config = hj.ExpertsConfig(8, 128, 128, 2, weight_format="int4_g128")
    x = jnp.zeros((0, 128), jnp.bfloat16)
    tw, ids = jnp.zeros((0, 2), jnp.float32), jnp.zeros((0, 2), jnp.int32)
    for module_cls in (nn.HummingGroupedExperts, nn.HummingIndexedExperts):
        out = module_cls(config, rngs=nnx.Rngs(0))(x, tw, ids)
        assert (out.shape, out.dtype) == ((0, 128), jnp.bfloat16)
    experts = nn.HummingGroupedExperts(config, rngs=nnx.Rngs(0))
    block = nn.MoEBlock(experts, rngs=nnx.Rngs(1), shared_intermediate_size=64)
    out = block(jnp.zeros((2, 0, 128), jnp.bfloat16))
    assert out.shape == (2, 0, 128)
