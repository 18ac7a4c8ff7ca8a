"""Lower one Mosaic GPU GEMM tiling for the GPU on a machine without one and
count the per-thread operations of its module — how a change to the Mosaic
kernel (its decode, staging, barriers) can be judged before a GPU run.

    python -m benchmarks.mosaic_ir --fmt int4_g128 --shape 8,4096,4096 --rows 2048 \\
        --config 128,256,128,4,3,mosaic,group_m=8 --out build/mosaic_int4.mlir

The module is the one the Mosaic GPU custom call carries: after layout
inference and the lowering of the Mosaic dialect (per-thread ``vector``,
``arith``, ``llvm`` and ``nvvm`` operations; the LLVM passes and ptxas run on
the GPU machine). Operations are counted as written in the module (an
unrolled loop body once per copy), not as executed. Uses a private hook of
jax 0.11.2's Mosaic GPU lowering (the module's serialization).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import sys

from benchmarks.inspect_gemm import parse_config

# Operations worth reading first, with what they stand for.
KEY_OPS = {
    "nvvm.ldmatrix": "shared-memory matrix loads",
    "nvvm.stmatrix": "shared-memory matrix stores",
    "nvvm.fence.proxy": "generic-to-async proxy fences",
    "nvvm.cp.async.bulk.tensor": "TMA copies",
    "wgmma.mma_async": "wgmma instructions",
    "mbarrier": "mbarrier operations",
    "vector<2xbf16>": "packed bf16 arithmetic",
    "vector<2xi16>": "packed 16-bit integer operations",
}


@contextlib.contextmanager
def capture_mosaic_modules():
    """Within the block, yields the list that the text of every Mosaic GPU
    module lowered (the serialized form of the custom call) is appended to."""
    from jax.experimental.mosaic.gpu import core

    texts: list[str] = []
    serialize = core._run_serde_pass

    def recording(module, **kwargs):
        if kwargs.get("serialize"):
            texts.append(str(module))
        return serialize(module, **kwargs)

    core._run_serde_pass = recording
    try:
        yield texts
    finally:
        core._run_serde_pass = serialize


def mosaic_ir(fmt: str, shape: tuple[int, int, int], rows: int, tuning) -> str:
    """The module text of the Mosaic GEMM for ``rows`` rows of x times an
    ``[E, N, K]`` weight in ``fmt`` ("bf16", or int4/uint4 decoded in the
    kernel), lowered for the GPU."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gemm import mosaic

    e, n, k = shape
    tiles = tuning
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    if fmt == "bf16":
        weight, quant, decode = jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16), (), None
    else:
        decode = mosaic.NibbleDecode(k // mosaic.UNIT, zero_points=fmt.startswith("uint4"))
        weight = jax.ShapeDtypeStruct((e, n, k // mosaic.PIECES), jnp.uint16)
        quant = (jax.ShapeDtypeStruct((e, k // mosaic.UNIT, n), jnp.bfloat16),) * (1 + decode.zero_points)

    def run(x, weight, offsets, *quant):
        scales, zeros = (quant + (None, None))[:2]
        return mosaic.expert_gemm_mosaic(
            x, weight, offsets, tiles, out_dtype=jnp.bfloat16, decode=decode, scales=scales, zero_points=zeros
        )

    with capture_mosaic_modules() as texts:
        jax.jit(run).trace(x, weight, offsets, *quant).lower(lowering_platforms=("cuda",))
    return texts[-1]


def op_histogram(text: str) -> collections.Counter:
    """Operation names of a module's text, counted."""
    names = re.findall(r"(?:= |^\s+)([a-z_]+\.[a-z_.0-9]+)", text, re.M)
    return collections.Counter(names)


def key_counts(text: str) -> dict[str, int]:
    """Lines of the module mentioning each of :data:`KEY_OPS`."""
    lines = text.splitlines()
    return {key: sum(key in line for line in lines) for key in KEY_OPS}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fmt", default="int4_g128", choices=("bf16", "int4_g128", "uint4_zp_g128"))
    parser.add_argument("--shape", default="8,4096,4096", help="E,N,K of the weight")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--config", required=True, help="as inspect_gemm's, with mosaic")
    parser.add_argument("--out", help="write the module text here")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    tuning = parse_config(args.config)
    shape = tuple(int(v) for v in args.shape.split(","))
    text = mosaic_ir(args.fmt, shape, args.rows, tuning)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for key, count in key_counts(text).items():
        print(f"{count:6d}  {key}  ({KEY_OPS[key]})")
    print(f"{len(text.splitlines())} lines; most frequent operations:")
    for name, count in op_histogram(text).most_common(args.top):
        print(f"{count:6d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
