"""The fp8 Mosaic GEMM without warp specialization (an experiment for the
tall tiles' epilogue at short K): :mod:`mosaic_fp8`'s body run by one
warpgroup a program that issues its own TMA loads, a program per output
tile, so that one program's epilogue runs under another's K loop (as
:mod:`mosaic_mid` for the 16-bit kernel). This file owns the tile config
and what the kernel refuses."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from pallas_kernels.gemm import mosaic_fp8
from pallas_kernels.gemm.spec import GemmCall


@dataclasses.dataclass(frozen=True)
class Tiles(mosaic_fp8.Tiles):
    """:class:`mosaic_fp8.Tiles`' fields, run by one warpgroup a program: its
    accumulator is the whole ``block_m x block_n`` tile (``wg_n = block_n``)."""

    warp_specialized: ClassVar[bool] = False


def supports(tiles: Tiles, call: GemmCall) -> str | None:
    """Why this kernel cannot run ``call`` with ``tiles`` (None if it can):
    :func:`mosaic_fp8.supports` on one warpgroup's tile."""
    if not isinstance(tiles, Tiles):
        return f"tiles of type {type(tiles).__name__} (mosaic_fp8_mid.Tiles)"
    return mosaic_fp8.supports(tiles, call)


def expert_gemm(
    call: GemmCall, tiles: Tiles, x: jax.Array, weight_arrays, bias, route_arrays, x_scale: jax.Array | None = None
) -> jax.Array:
    """The family's entry point (as :func:`mosaic_fp8.expert_gemm`, whose shapes and dtypes it takes)."""
    if not isinstance(tiles, Tiles):
        raise TypeError(f"mosaic_fp8_mid.expert_gemm: tiles must be mosaic_fp8_mid.Tiles, got {type(tiles).__name__}")
    return mosaic_fp8.expert_gemm(call, tiles, x, weight_arrays, bias, route_arrays, x_scale)
