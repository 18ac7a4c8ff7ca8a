"""Token-parallel pipelines: inputs sharded along their token axis keep that
sharding through the Pallas kernels.

XLA cannot partition a Pallas call (an opaque custom call): left to itself it
gathers every token onto every device and each computes the whole batch. The
token-major pipelines (``humming_grouped_experts``, ``humming_indexed_experts``)
are per-token computations — routing, expert products and the weighted sum of
a token need no other token — so :func:`token_parallel` wraps them with
``jax.experimental.custom_partitioning``: when the partitioner sees
``hidden_states`` sharded along tokens (mesh axes that divide T), each device
runs the whole pipeline on its own tokens with the weights replicated
(sharded weights are gathered first: expert parallelism is
:mod:`humming_jax.parallel`). Gradients are the reference pipeline's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

from humming_jax.backend import reference_gradient, resolve_backend


def token_parallel(run, tokens: tuple, rest: tuple, static: tuple, op: str):
    """``run(tokens, rest, *static)``, partitioned along the tokens under SPMD.

    ``tokens``: arrays ``[T, ...]`` (or None) sharing their leading token axis,
    ``hidden_states`` first; ``rest``: the other arguments (replicated);
    ``static``: hashable arguments of ``run``, its last the backend. ``run``
    returns ``[T, H]``. On a machine with one device, or on the reference
    backend (plain ``jnp``, which XLA partitions itself), ``run`` is called as
    it is."""
    *fixed, backend = static
    if jax.device_count() == 1 or resolve_backend(backend, op) == "reference":
        return run(tokens, rest, *static)
    return _partitioned_op(tokens, rest, run=run, fixed=tuple(fixed), backend=backend)


@reference_gradient(("run", "fixed", "backend"))
def _partitioned_op(tokens, rest, run, fixed: tuple, backend):
    """The partitioned pipeline; its derivative is the reference pipeline's
    (``custom_partitioning`` has none)."""
    if backend == "reference":
        return run(tokens, rest, *fixed, backend)
    return _partitioned(run, (*fixed, backend), tokens, rest)


@dataclasses.dataclass(frozen=True, eq=False)
class _Traced:
    """The pipeline traced once on the global shapes (hashed by identity: a
    static argument of :func:`_call`)."""

    run: Callable
    static: tuple
    treedef: object
    num_tokens: int
    ranks: tuple
    closed: object  # the ClosedJaxpr


def _partitioned(run, static, tokens, rest):
    """The partitioned call; a pipeline with ordered effects (the Mosaic GPU
    interpreter's callbacks, which a partitioned call cannot carry) runs
    unpartitioned from the same trace."""
    leaves, treedef = jax.tree.flatten((tokens, rest))
    closed = jax.make_jaxpr(functools.partial(_run_leaves, run, static, treedef))(*leaves)
    if closed.effects:
        return jaxpr_as_fun(closed)(*leaves)[0]
    traced = _Traced(run, static, treedef, len(jax.tree.leaves(tokens)), tuple(leaf.ndim for leaf in leaves), closed)
    return _call(traced, *leaves)


def _rule(traced: _Traced, mesh, operand_types, result_types) -> str:
    """Shardy's rule: the token arrays and the output share factor ``t``; every
    other dimension is a factor of its own."""
    operands = []
    for i, rank in enumerate(traced.ranks):
        dims = [f"x{i}_{d}" for d in range(rank)]
        if i < traced.num_tokens:
            dims[0] = "t"
        operands.append(" ".join(dims))
    return ", ".join(operands) + " -> t h"


def _run_leaves(run, static, treedef, *leaves):
    tokens, rest = jax.tree.unflatten(treedef, leaves)
    return run(tokens, rest, *static)


def _token_axes(mesh, arg_shapes, num_tokens: int):
    """The mesh axes ``hidden_states`` is sharded on along its tokens, if they
    divide the token count (else None: every device takes every token)."""
    spec = arg_shapes[0].sharding.spec
    axes = spec[0] if len(spec) else None
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(mesh.shape[name] for name in names)
    if any(shape.shape[0] % shards for shape in arg_shapes[:num_tokens]):
        return None
    return axes


def _shardings(mesh, arg_shapes, num_tokens: int):
    axes = _token_axes(mesh, arg_shapes, num_tokens)
    args = tuple(
        NamedSharding(mesh, PartitionSpec(axes) if i < num_tokens else PartitionSpec()) for i in range(len(arg_shapes))
    )
    return args, NamedSharding(mesh, PartitionSpec(axes))


def _partition(traced: _Traced, mesh, arg_shapes, result_shape):
    """Each device's part: the pipeline traced anew on its own tokens."""
    args, out = _shardings(mesh, arg_shapes, traced.num_tokens)
    return mesh, functools.partial(_run_leaves, traced.run, traced.static, traced.treedef), out, args


@functools.partial(custom_partitioning, static_argnums=(0,))
def _call(traced: _Traced, *leaves):
    return jaxpr_as_fun(traced.closed)(*leaves)[0]


_call.def_partition(partition=_partition, sharding_rule=_rule)
