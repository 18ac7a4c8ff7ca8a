"""Out-of-bounds reads and writes made visible in interpreted Triton kernels.

On a GPU a masked ``plgpu.load`` or ``plgpu.store`` whose mask lets an element
past its buffer through, or an unmasked ``ref[i]`` past it, reads another
allocation or corrupts one. The Pallas interpreter hides it: a read past the
end returns a clamped neighbour and a write there is dropped or clamped, so
the outputs the tests compare often come out right.

:func:`install` wraps the interpreter's rules for the masked load and store
and for the plain ref read and write (their state-discharge rules; the GPU
lowering never runs them). While ``CHECKING`` is on (the tests marked
``bounds``; a test and the programs it traces are checked or not, never
half), an access is out of bounds where an element its mask lets through (an
unmasked access: every element) lies outside its ref. A read then returns
poison for every element; a write writes poison wherever it reaches and to
the ref's first element (a write wholly past the end). Poison is NaN for
floats, the most negative value for signed integers, the largest for
unsigned ones, and the test's comparison fails.

Poison rather than a host callback: a program with a callback is never kept
in JAX's persistent compilation cache, which the CPU suite depends on. The
checks cost compilation time, so the suite marks the tests that reach each
kernel's edges (partial tiles, padding entries, ids out of range, rows no
expert owns), not every test.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config
from jax._src.pallas import primitives as pallas_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing
from jax._src.state import primitives as state_primitives
from jax._src.tree_util import tree_unflatten

_ORIGINAL: dict = {}

# On while a test marked ``bounds`` runs. Part of JAX's cache keys, so a program
# traced with the checks is never served to a call without them, nor the reverse.
CHECKING = config.bool_state(
    "humming_jax_test_bounds",
    False,
    "interpreted Triton loads and stores past their buffers poison what they touch (tests/bounds.py)",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def poison(dtype) -> jnp.ndarray:
    """The value an out-of-bounds access leaves, in ``dtype``."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(np.nan, dtype)
    if dtype == np.bool_:
        return jnp.asarray(True)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if info.min < 0 else info.max, dtype)


def _poisoned(found, x: jnp.ndarray) -> jnp.ndarray:
    """``x``, or poison in its every element where ``found``."""
    return jnp.where(found, poison(x.dtype), x)


def _past(index, size: int) -> jnp.ndarray:
    """``index`` outside ``[0, size)``: one unsigned comparison covers both ends."""
    return jnp.asarray(index).astype(jnp.uint32) >= size


def _outside(indexer: indexing.NDIndexer):
    """Bool array broadcastable to the indexer's result shape, True where the
    element's index lies outside the indexed shape; None where every index is
    a static slice (those are checked when the kernel is traced)."""
    out_ndim = len(indexer.get_indexer_shape())
    is_int = [not isinstance(i, indexing.Slice) for i in indexer.indices]
    int_dims = [d for d, b in enumerate(is_int) if b]
    slice_dims = [d for d, b in enumerate(is_int) if not b]
    n_int = len(indexer.int_indexer_shape)
    # Where the result puts each dimension (NumPy's rule, as get_indexer_shape):
    # contiguous integer indices in place of the first, otherwise in front.
    contiguous = all(b - a == 1 for a, b in zip(int_dims, int_dims[1:], strict=False))
    int_at = sum(1 for d in slice_dims if d < int_dims[0]) if int_dims and contiguous else 0
    outside = None
    for d, index in enumerate(indexer.indices):
        if is_int[d]:
            bad = jnp.broadcast_to(_past(index, indexer.shape[d]), indexer.int_indexer_shape)
            bad = bad.reshape((1,) * int_at + bad.shape + (1,) * (out_ndim - int_at - n_int))
        elif isinstance(index.start, int) and isinstance(index.size, int):
            continue
        else:
            i = slice_dims.index(d)
            axis = i if i < int_at else i + n_int
            bad = _past(index.start + index.stride * jnp.arange(index.size), indexer.shape[d])
            bad = bad.reshape((1,) * axis + bad.shape + (1,) * (out_ndim - axis - 1))
        outside = bad if outside is None else outside | bad
    return outside


def out_of_bounds(transforms, mask):
    """True when an element the mask lets through lies outside its ref (the
    last indexer element by element; an earlier one, where any element is
    live); None when nothing needs checking."""
    indexers = [t for t in transforms if isinstance(t, indexing.NDIndexer)]
    if not indexers:
        return None
    *outer, last = indexers
    found = _outside(last)
    if found is not None:
        found = jnp.any(found if mask is None else found & mask)
    for indexer in outer:
        bad = _outside(indexer)
        if bad is not None:
            bad = jnp.any(bad) if mask is None else jnp.any(bad) & jnp.any(mask)
            found = bad if found is None else found | bad
    return found


def _checked_load(ctx, *args_flat, args_tree, **params):
    refs, out = _ORIGINAL["load"](ctx, *args_flat, args_tree=args_tree, **params)
    if not CHECKING.value:
        return refs, out
    _, transforms, mask, _ = args_tree.unflatten(args_flat)
    found = out_of_bounds(transforms, mask)
    return refs, out if found is None else _poisoned(found, out)


def _checked_swap(ctx, *args_flat, args_tree, **params):
    ref, transforms, val, mask = args_tree.unflatten(args_flat)
    found = out_of_bounds(transforms, mask) if CHECKING.value else None
    if found is None:
        return _ORIGINAL["swap"](ctx, *args_flat, args_tree=args_tree, **params)
    args_flat = args_tree.flatten_up_to((ref, transforms, _poisoned(found, val), mask))
    (new, *rest), out = _ORIGINAL["swap"](ctx, *args_flat, args_tree=args_tree, **params)
    return (_mark_first(new, found), *rest), out


def _mark_first(new, found):
    """``new`` with its first element poisoned where ``found``: a store wholly
    past the end leaves its mark there."""
    first = (0,) * new.ndim
    corner = lax.slice(new, first, (1,) * new.ndim)
    return lax.dynamic_update_slice(new, _poisoned(found, corner), first)


def _checked_get(ctx, x, *idx, tree):
    refs, out = _ORIGINAL["get"](ctx, x, *idx, tree=tree)
    found = out_of_bounds(tree_unflatten(tree, idx), None) if CHECKING.value else None
    return refs, out if found is None else _poisoned(found, out)


def _checked_state_swap(ctx, x, val, *idx, tree):
    found = out_of_bounds(tree_unflatten(tree, idx), None) if CHECKING.value else None
    if found is None:
        return _ORIGINAL["state_swap"](ctx, x, val, *idx, tree=tree)
    (new, *rest), out = _ORIGINAL["state_swap"](ctx, x, _poisoned(found, val), *idx, tree=tree)
    return (_mark_first(new, found), *rest), out


def install() -> None:
    """Wrap the interpreter's rules (idempotent); they check while ``CHECKING`` is on.
    Call before anything is traced: registering the flag changes the trace context."""
    rules = state_discharge._discharge_rules
    if not _ORIGINAL:
        _ORIGINAL["load"] = rules[pallas_primitives.load_p]
        _ORIGINAL["swap"] = rules[pallas_primitives.swap_p]
        _ORIGINAL["get"] = rules[state_primitives.get_p]
        _ORIGINAL["state_swap"] = rules[state_primitives.swap_p]
    rules[pallas_primitives.load_p] = _checked_load
    rules[pallas_primitives.swap_p] = _checked_swap
    rules[state_primitives.get_p] = _checked_get
    rules[state_primitives.swap_p] = _checked_state_swap
