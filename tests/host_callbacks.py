"""Cheaper host callbacks for the Mosaic GPU interpreter on the CPU.

The interpreter runs each warpgroup's memory operations, barriers and
``wgmma`` through ``jax.experimental.io_callback``: a small kernel makes tens
of thousands of calls, nine in ten of whose arguments are int32 scalars
(thread, block and buffer ids). JAX 0.11.2's callback rule puts every
argument on the CPU device with ``jax.device_put`` before the Python function
sees it, which costs more than the interpreter's own work.

:func:`install` replaces that rule for the test processes: an argument of at
most ``SMALL`` elements is put on the device once per distinct value and
dtype and the same (immutable) array handed to every later call; larger ones
are put as before. The callbacks see the same values and types. Installed
only on the jax it was written against (the rule's signature is private).
"""

from __future__ import annotations

import functools
import inspect

import jax
import numpy as np
from jax._src import callback as jax_callback
from jax._src import config, tree_util

# Arguments of at most this many elements are kept (ids, coordinates, index tuples).
SMALL = 16
_KEPT: dict = {}
_RULE_PARAMETERS = ["args", "result_avals", "callback", "sharding", "ordered"]


def _on_cpu(value, device):
    value = np.asarray(value)
    if value.size > SMALL:
        return jax.device_put(value, device)
    key = (value.dtype.str, value.shape, value.tobytes())
    kept = _KEPT.get(key)
    if kept is None:
        kept = _KEPT[key] = jax.device_put(value, device)
    return kept


@functools.cache
def _cpu():
    return jax.local_devices(backend="cpu")[0]


def _io_callback(*args, result_avals, callback, sharding, ordered):
    """JAX's ``io_callback_impl`` with the small arguments' device arrays kept."""
    del result_avals, sharding, ordered
    device = _cpu()
    args = tuple(_on_cpu(arg, device) for arg in args)
    with config.default_device(device):
        return tree_util.tree_map(np.asarray, callback(*args))


def install() -> bool:
    """Replace the callback rule; False (nothing changed) on another jax."""
    rule = jax_callback.io_callback_impl
    if rule is _io_callback:
        return True
    if jax.__version__ != "0.11.2" or list(inspect.signature(rule).parameters) != _RULE_PARAMETERS:
        return False
    jax_callback.io_callback_impl = _io_callback
    return True
