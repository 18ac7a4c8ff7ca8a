"""Gradients through the kernel path: the forward pass runs the kernels, the
backward pass the derivative of the ``jnp`` reference (``reference_gradient``);
checked against the reference's own gradients and, for the GEMM, a float64
NumPy derivative."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import humming_jax as hj
from humming_jax import formats as F
from humming_jax import layouts as L

KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"


def _layer(rng, t=6):
    w13 = jnp.asarray(rng.normal(size=(4, 256, 128)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(4, 128, 128)) * 0.1, jnp.float32)
    config = hj.ExpertsConfig(4, 128, 128, 2, weight_format="int4_g128")
    weights = hj.quantize_experts(w13, w2, config)
    x = jnp.asarray(rng.normal(size=(t, 128)), jnp.float32)
    topk_weights = jnp.asarray(rng.random((t, 2)), jnp.float32)
    topk_ids = jnp.asarray(np.stack([rng.choice(4, 2, replace=False) for _ in range(t)]), jnp.int32)
    return config, weights, x, topk_weights, topk_ids


def test_gemm_gradient_is_the_dequantized_weights_product(rng):
    """d/dx Σ c ⊙ gemm(x, W) = c · W_e for each row's expert (float64 NumPy),
    through the kernel, for a 4-bit weight on the grouped layout."""
    e, n, k, m = 4, 64, 128, 40
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(e, n, k)) * 0.1, jnp.float32), F.INT4_G128)
    offsets = np.array([0, 9, 9, 30, m], np.int32)  # expert 1 empty
    layout = L.GroupedContiguous(jnp.asarray(offsets))
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    c = rng.normal(size=(m, n))

    def loss(x):
        out = hj.gemm(x.astype(jnp.bfloat16), weight, layout, out_dtype=jnp.float32, backend=KERNEL_BACKEND)
        return jnp.sum(out * jnp.asarray(c, jnp.float32))

    got = np.asarray(jax.grad(loss)(x), np.float64)
    w = np.asarray(F.dequantize_weight(weight), np.float64)
    want = np.concatenate([c[offsets[i] : offsets[i + 1]] @ w[i] for i in range(e)])
    # (the input's cast to bf16 passes the cotangent through as is)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_pipeline_gradients_equal_the_references(rng):
    """The hidden states' and the routing weights' gradients of a 4-bit layer
    run on the kernels equal the reference pipeline's (a kernel op has no
    derivative of its own: a bare Pallas error before). The indexed pipeline
    is made of the same differentiable ops."""
    pipeline = hj.humming_grouped_experts
    config, weights, x, topk_weights, topk_ids = _layer(rng)

    def loss(x, topk_weights, backend):
        out = pipeline(x.astype(jnp.bfloat16), weights, topk_weights, topk_ids, config, backend=backend)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    got = jax.grad(loss, argnums=(0, 1))(x, topk_weights, KERNEL_BACKEND)
    want = jax.grad(loss, argnums=(0, 1))(x, topk_weights, "reference")
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)) and np.abs(b).max() > 0
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


def test_router_of_a_moe_block_trains(rng):
    """``nnx.grad`` of a MoEBlock on the kernel path reaches the router."""
    experts = hj.nn.HummingGroupedExperts(hj.ExpertsConfig(4, 128, 32, 2, weight_format="bf16"), rngs=nnx.Rngs(0))
    block = hj.nn.MoEBlock(experts, rngs=nnx.Rngs(1))
    x = jnp.asarray(rng.normal(size=(6, 128)), jnp.bfloat16)

    def loss(block):
        return jnp.sum(block(x).astype(jnp.float32) ** 2)

    grads = nnx.grad(loss)(block)
    router = np.asarray(grads.router.kernel.get_value(), np.float64)
    assert np.all(np.isfinite(router)) and np.abs(router).max() > 0
