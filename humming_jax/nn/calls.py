"""A module's call for a decode loop: jitted, its variables passed as a flat list.

A jitted call flattens its arguments on every call. An ``nnx.State`` flattens
in Python, one call a variable, so a model's step pays for each of its
variables before anything runs; a list of arrays flattens in C++.
``jit_frozen`` splits the module once and passes its arrays as that list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx


def jit_frozen(module: nnx.Module, *, static_argnames: tuple[str, ...] = ()) -> Callable[..., Any]:
    """``module``'s ``__call__`` jitted, with its variables as they are now.

    The variables are read once, here: a later change to the module's weights
    needs a new ``jit_frozen``. For inference — a call that assigns to one of
    the module's variables raises ``ValueError`` when traced, since the
    assignment would be lost.

    Args:
        module: the Flax NNX module (a model, a ``MoEBlock``, an expert module).
        static_argnames: the call's keyword arguments that are static (e.g. ``top_k``).

    Returns:
        ``f(*args, **kwargs)``, equal to ``module(*args, **kwargs)``, its
        arguments any that a jitted function takes.
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(f"jit_frozen: module must be an nnx.Module, got {type(module).__name__}")
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)

    def call(arrays: list[jax.Array], *args: Any, **kwargs: Any) -> Any:
        merged = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
        out = merged(*args, **kwargs)
        after = jax.tree.leaves(nnx.state(merged))
        if len(after) != len(arrays) or any(a is not b for a, b in zip(after, arrays, strict=True)):
            raise ValueError(
                f"jit_frozen: calling {type(module).__name__} assigned to its variables; "
                "jit_frozen is for calls that only read them: pass what changes from call to call "
                "(a KV cache) as an argument, or use nnx.jit to keep the updates"
            )
        return out

    jitted = jax.jit(call, static_argnames=static_argnames)

    def frozen_call(*args: Any, **kwargs: Any) -> Any:
        return jitted(leaves, *args, **kwargs)

    return frozen_call
