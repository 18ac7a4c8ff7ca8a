"""Backend choice (DESIGN §2).

``"pallas"`` runs the Pallas kernels compiled for the GPU, ``"interpret"`` runs
the same kernels in Pallas interpret mode (CPU), ``"reference"`` runs the pure
``jnp`` reference. With no explicit choice the environment variable
``HUMMING_JAX_BACKEND`` decides, else the platform: GPU -> ``pallas``,
anything else -> ``interpret``. An op that has no kernel yet runs its
reference when the backend was not asked for explicitly; asking for a kernel
backend explicitly on such an op is an error.
"""

from __future__ import annotations

import os
from typing import Literal

import jax

Backend = Literal["pallas", "interpret", "reference"]
BACKENDS: tuple[str, ...] = ("pallas", "interpret", "reference")
ENV_VAR = "HUMMING_JAX_BACKEND"


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: expected one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    return name


def default_backend() -> str:
    """The backend used when none is given: env var, else from the platform."""
    env = os.environ.get(ENV_VAR)
    if env:
        return _check(env.strip().lower(), f"environment variable {ENV_VAR}")
    return "pallas" if jax.default_backend() == "gpu" else "interpret"


# The kernel backends each op implements: ("pallas", "interpret") once it
# has a Pallas kernel, () while only its reference exists.
KERNELS = ("pallas", "interpret")
KERNEL_BACKENDS: dict[str, tuple[str, ...]] = {
    "moe_align_block_size": KERNELS,
    "moe_prepare_scatter": KERNELS,
    "moe_permute": KERNELS,
    "moe_unpermute": KERNELS,
    "moe_fused_mul_sum": KERNELS,
    "process_input": KERNELS,
    "gemm": KERNELS,
}


def resolve_backend(backend: str | None, op: str) -> str:
    """Pick the backend ``op`` runs on (see the module docstring)."""
    kernel_backends = KERNEL_BACKENDS[op]
    if backend is not None:
        _check(backend, f"{op}: backend")
        if backend != "reference" and backend not in kernel_backends:
            raise ValueError(
                f"{op}: backend {backend!r} is not available for this op; "
                f"available: {', '.join(map(repr, (*kernel_backends, 'reference')))}"
            )
        return backend
    chosen = default_backend()
    return chosen if chosen in kernel_backends else "reference"


def hopper_gpu() -> bool:
    """Whether the default device is a Hopper GPU (sm_90: TMA and wgmma; the
    Blackwell generation has no wgmma), which the Mosaic GPU kernels need."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")
