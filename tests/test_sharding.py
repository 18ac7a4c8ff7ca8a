"""Token-sharded inputs keep their sharding through the kernel pipelines
(``humming_jax.sharding``), on simulated CPU devices (tests/conftest.py asks
XLA for eight): the output is sharded as the tokens were, every device runs
the layer on its own tokens (no gather of the batch in the compiled program),
and the values are the single-device layer's; gradients flow (the reference's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from humming_jax import experts as X
from humming_jax.configs import ExpertsConfig

from sweep import FULL

E, H, INTER, TOP_K, T, DEVICES = 8, 64, 32, 2, 16, 4
KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"


def _mesh():
    if jax.device_count() < DEVICES:
        if jax.default_backend() == "cpu":
            pytest.fail(f"needs {DEVICES} devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (conftest)")
        pytest.skip(f"needs {DEVICES} devices, this machine has {jax.device_count()}")
    return jax.make_mesh((DEVICES,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:DEVICES])


def _case(rng, fmt="int4_g32"):
    config = ExpertsConfig(E, H, INTER, TOP_K, weight_format=fmt)
    w13 = jnp.asarray(rng.normal(size=(E, 2 * INTER, H)) / 8, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(E, H, INTER)) / 6, jnp.float32)
    weights = X.quantize_experts(w13, w2, config)
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, E, (T, TOP_K)), jnp.int32)
    topk_weights = jnp.asarray(rng.random((T, TOP_K)), jnp.float32)
    return config, weights, x, topk_weights, ids


# make test: the grouped pipeline (the indexed one under --full: the same token-parallel wrapper).
@pytest.mark.parametrize(
    "pipeline",
    [X.humming_grouped_experts, pytest.param(X.humming_indexed_experts, marks=FULL)],
    ids=lambda f: f.__name__,
)
def test_sharded_tokens_stay_sharded(pipeline, rng):
    mesh = _mesh()
    config, weights, x, topk_weights, ids = _case(rng)
    want = np.asarray(pipeline(x, weights, topk_weights, ids, config, backend=KERNEL_BACKEND), np.float32)
    by_token = NamedSharding(mesh, P("data"))
    args = [jax.device_put(a, by_token) for a in (x, topk_weights, ids)]

    def layer(x, topk_weights, ids, weights):
        return pipeline(x, weights, topk_weights, ids, config, backend=KERNEL_BACKEND)

    compiled = jax.jit(layer).lower(*args, weights).compile()
    out = compiled(*args, weights)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    hlo = compiled.as_text()
    assert "all-gather" not in hlo and "all-reduce" not in hlo, "the batch was gathered"
    assert f"bf16[{T // DEVICES},{H}]" in hlo  # a device's own tokens
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)


def test_gradients_through_sharded_tokens(rng):
    """The backward pass is the reference pipeline's (the kernels have none)."""
    mesh = _mesh()
    config, weights, x, topk_weights, ids = _case(rng, "bf16")
    by_token = NamedSharding(mesh, P("data"))

    def loss(x, topk_weights, backend):
        out = X.humming_grouped_experts(x, weights, topk_weights, ids, config, backend=backend)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    got = grad(jax.device_put(x, by_token), jax.device_put(topk_weights, by_token), KERNEL_BACKEND)
    want = grad(x, topk_weights, "reference")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=5e-2, atol=5e-2)


def test_replicated_or_uneven_tokens_run_whole(rng):
    """A replicated input, and tokens that do not divide over the mesh axis
    (6 on 4 devices, constrained inside the jitted step), run whole on every
    device: the single-device values."""
    mesh = _mesh()
    config, weights, x, topk_weights, ids = _case(rng)
    replicated = NamedSharding(mesh, P())
    args = [jax.device_put(a, replicated) for a in (x, topk_weights, ids)]
    out = X.humming_grouped_experts(args[0], weights, args[1], args[2], config, backend=KERNEL_BACKEND)
    want = X.humming_grouped_experts(x, weights, topk_weights, ids, config, backend=KERNEL_BACKEND)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))

    @jax.jit
    def uneven(x, topk_weights, ids):
        x, topk_weights, ids = (
            jax.lax.with_sharding_constraint(a[:6], NamedSharding(mesh, P("data"))) for a in (x, topk_weights, ids)
        )
        return X.humming_grouped_experts(x, weights, topk_weights, ids, config, backend=KERNEL_BACKEND)

    want = X.humming_grouped_experts(x[:6], weights, topk_weights[:6], ids[:6], config, backend=KERNEL_BACKEND)
    np.testing.assert_array_equal(np.asarray(uneven(*args), np.float32), np.asarray(want, np.float32))
