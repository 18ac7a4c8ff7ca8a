"""The expert GEMM kernels. ``triton``: every weight format and layout, 16-bit
inputs. ``mosaic``: Hopper's TMA + wgmma kernel for prefill (16-bit and planar
4-bit integer weights). Each owns its ``Tiles`` and one ``supports(tiles,
call) -> reason | None``; ``spec`` holds what both are told about a call. The
type of a tile config names its kernel (:data:`KERNELS`)."""

from pallas_kernels.gemm import mosaic, spec, triton

KERNELS = {triton.Tiles: triton, mosaic.Tiles: mosaic}
IMPLS = {"triton": triton.Tiles, "mosaic": mosaic.Tiles}  # the names the tuning table uses

__all__ = ["IMPLS", "KERNELS", "mosaic", "spec", "triton"]
