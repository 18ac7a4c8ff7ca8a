"""Backend choice.

``"pallas"`` runs the Pallas kernels compiled for the GPU, ``"interpret"`` runs
the same kernels in Pallas interpret mode (CPU), ``"reference"`` runs the pure
``jnp`` reference. With no explicit choice the environment variable
``HUMMING_JAX_BACKEND`` decides, else the platform: GPU -> ``pallas``,
anything else -> ``reference`` (faster there than the interpreted kernels;
``"interpret"`` is for testing the kernels off a GPU).

A call that no kernel takes (:func:`no_kernel`) raises on a GPU, naming the op
and the reason, unless the user opted in to the reference
(``HUMMING_JAX_REFERENCE_FALLBACK=1``: it then runs with a one-time warning).
Off a GPU, with no explicit backend (``HUMMING_JAX_BACKEND=interpret``), the
reference runs with the same one-time warning: the CPU has no fast path to miss.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Literal

import jax

Backend = Literal["pallas", "interpret", "reference"]
BACKENDS: tuple[str, ...] = ("pallas", "interpret", "reference")
ENV_VAR = "HUMMING_JAX_BACKEND"
FALLBACK_ENV_VAR = "HUMMING_JAX_REFERENCE_FALLBACK"


class NoKernelError(ValueError):
    """No kernel takes a call that must run on one."""


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: expected one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    return name


def default_backend() -> str:
    """The backend used when none is given: ``HUMMING_JAX_BACKEND`` if set, else
    ``"pallas"`` on a GPU and ``"reference"`` anywhere else.

    Returns:
        One of :data:`BACKENDS`.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        return _check(env.strip().lower(), f"environment variable {ENV_VAR}")
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def resolve_backend(backend: str | None, op: str) -> str:
    """The backend an op runs on.

    Args:
        backend: ``"pallas"``, ``"interpret"``, ``"reference"`` or None (the default).
        op: the op's name, for the error message.

    Returns:
        ``backend`` if given (checked), else :func:`default_backend`.
    """
    if backend is not None:
        return _check(backend, f"{op}: backend")
    return default_backend()


_WARNED: set[tuple[str, str]] = set()


def no_kernel(op: str, reason: str, backend: str | None) -> None:
    """Called when no kernel takes a call of ``op``: returns if its reference
    may run instead (with a one-time warning), else raises :class:`NoKernelError`."""
    opted_in = os.environ.get(FALLBACK_ENV_VAR, "").strip() not in ("", "0")
    if backend is not None or (jax.default_backend() == "gpu" and not opted_in):
        where = f"backend {backend!r}" if backend is not None else "on the GPU"
        raise NoKernelError(
            f"{op}: no kernel takes this call ({reason}); {where} it does not run the reference — pass "
            f"backend='reference' or set {FALLBACK_ENV_VAR}=1 to run it"
        )
    if (op, reason) not in _WARNED:
        _WARNED.add((op, reason))
        warnings.warn(f"{op}: no kernel takes this call ({reason}); running the jnp reference", stacklevel=3)


def reference_gradient(static_argnames: tuple[str, ...]):
    """Decorate a kernel op ``fn(..., backend=...)`` so that its derivative is
    the derivative of its ``jnp`` reference (Pallas kernels have none): the
    forward pass runs the kernel, the backward pass ``jax.vjp`` of
    ``fn(..., backend="reference")`` on the same arguments (recomputed). The
    ``static_argnames`` (those ``jax.jit`` takes as static) stay out of the
    differentiated arguments. Rounding in a quantizer has a zero derivative,
    as in the reference."""

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def op(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arrays = dict(bound.arguments)
            static = {name: arrays.pop(name) for name in static_argnames if name in arrays}
            if resolve_backend(static.get("backend"), fn.__name__) == "reference":
                return fn(**arrays, **static)

            def run(arrays, backend):
                return fn(**arrays, **{**static, "backend": backend})

            @jax.custom_vjp
            def kernel(arrays):
                return run(arrays, static.get("backend"))

            def forward(arrays):
                return kernel(arrays), arrays

            def backward(arrays, cotangent):
                return jax.vjp(lambda a: run(a, "reference"), arrays)[1](cotangent)

            kernel.defvjp(forward, backward)
            return kernel(arrays)

        return op

    return wrap
