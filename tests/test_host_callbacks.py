"""The test processes' callback rule (tests/host_callbacks.py) gives the
callbacks what JAX's own gives them."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

pytestmark = pytest.mark.skipif(os.environ["JAX_PLATFORMS"] != "cpu", reason="installed for the CPU suite only")


def test_installed_on_this_jax():
    import host_callbacks
    from jax._src import callback

    assert host_callbacks.install()
    assert callback.io_callback_impl is host_callbacks._io_callback


def test_callbacks_see_the_values_and_types_of_jaxs_rule():
    seen = []

    def host(scalar, ids, block):
        seen.append((type(scalar), type(block)))
        return np.asarray(block * 2 + ids.sum() + scalar, np.float32)

    @jax.jit
    def f(scalar, ids, block):
        return io_callback(host, jax.ShapeDtypeStruct(block.shape, jnp.float32), scalar, ids, block)

    block = jnp.arange(40, dtype=jnp.float32).reshape(5, 8) - 7.5  # past the kept size
    for scalar in (3, 4, 3):  # a kept value handed back, and a new one
        ids = jnp.asarray([1, scalar, 2], jnp.int32)
        out = f(jnp.int32(scalar), ids, block)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(block) * 2 + 3 + scalar + scalar)
    assert all(issubclass(a, jax.Array) and issubclass(b, jax.Array) for a, b in seen), seen
