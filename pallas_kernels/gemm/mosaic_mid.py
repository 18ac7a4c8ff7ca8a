"""The Mosaic GPU expert GEMM without warp specialization, for the mid range
(tens of rows an expert): one warpgroup a program issues its own TMA loads
(JAX's plain pipeline) and runs the products, no cluster, and a program per
output tile instead of a persistent grid. The hardware then runs as many
programs an SM as their shared memory and registers allow, so one program's
pipeline fill and epilogue run under another's K loop; with few rows a tile,
that overlap is worth more than the warp-specialized kernel's.

The body, formats, layouts and epilogue are :mod:`mosaic`'s (its kernel reads
the structure from the type of its tiles); this file owns the tile config and
what the kernel refuses."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from pallas_kernels.gemm import mosaic
from pallas_kernels.gemm.spec import GemmCall


@dataclasses.dataclass(frozen=True)
class Tiles(mosaic.Tiles):
    """:class:`mosaic.Tiles`' fields, run by one warpgroup a program: its
    accumulator is the whole ``block_m x block_n`` tile (``wg_n = block_n``)
    and ``cluster_n`` must be 1."""

    warp_specialized: ClassVar[bool] = False


def supports(tiles: Tiles, call: GemmCall) -> str | None:
    """Why this kernel cannot run ``call`` with ``tiles`` (None if it can):
    :func:`mosaic.supports` on one warpgroup's tile (no cluster)."""
    if not isinstance(tiles, Tiles):
        return f"tiles of type {type(tiles).__name__} (mosaic_mid.Tiles)"
    return mosaic.supports(tiles, call)


def expert_gemm(
    call: GemmCall, tiles: Tiles, x: jax.Array, weight_arrays, bias, route_arrays, x_scale: jax.Array | None = None
) -> jax.Array:
    """The family's entry point (as :func:`mosaic.expert_gemm`, whose shapes and dtypes it takes)."""
    if not isinstance(tiles, Tiles):
        raise TypeError(f"mosaic_mid.expert_gemm: tiles must be mosaic_mid.Tiles, got {type(tiles).__name__}")
    return mosaic.expert_gemm(call, tiles, x, weight_arrays, bias, route_arrays, x_scale)
