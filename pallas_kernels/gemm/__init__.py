"""The expert GEMM kernels. ``triton``: every weight format, layout and input
quantization. ``mosaic``: Hopper's TMA + wgmma kernel for prefill (16-bit and planar
4-bit integer weights). ``mosaic_mid``: the same body without warp specialization,
a program per output tile (the mid range: tens of rows an expert). ``mosaic_fp8``:
the same on the fp8 tensor cores (e4m3 weights, e4m3/e5m2 inputs, block-scaled).
Each owns its ``Tiles`` and one ``supports(tiles, call) -> reason | None``;
``spec`` holds what all are told about a call. The type of a tile config names
its kernel (:data:`KERNELS`)."""

from pallas_kernels.gemm import mosaic, mosaic_fp8, mosaic_mid, spec, triton

KERNELS = {
    triton.Tiles: triton,
    mosaic.Tiles: mosaic,
    mosaic_mid.Tiles: mosaic_mid,
    mosaic_fp8.Tiles: mosaic_fp8,
}
IMPLS = {
    "triton": triton.Tiles,
    "mosaic": mosaic.Tiles,
    "mosaic_mid": mosaic_mid.Tiles,
    "mosaic_fp8": mosaic_fp8.Tiles,
}  # the names the tuning table uses

__all__ = ["IMPLS", "KERNELS", "mosaic", "mosaic_fp8", "mosaic_mid", "spec", "triton"]
