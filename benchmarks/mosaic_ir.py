"""Lower one Mosaic GPU GEMM tiling for the GPU on a machine without one and
count the per-thread operations of its module — how a change to the Mosaic
kernel (its decode, staging, barriers) can be judged before a GPU run.

    python -m benchmarks.mosaic_ir --fmt int4_g128 --shape 8,4096,4096 --rows 2048 \\
        --config 128,256,128,4,3,mosaic,group_m=8 --out build/mosaic_int4.mlir
    python -m benchmarks.mosaic_ir --fmt w4a8_mxfp4 --shape 8,1024,1024 --rows 512 \\
        --config mosaic_fp8:block_m=64,block_n=256,swap_ab=1

The module is the one the Mosaic GPU custom call carries: after layout
inference and the lowering of the Mosaic dialect (per-thread ``vector``,
``arith``, ``llvm`` and ``nvvm`` operations; the LLVM passes and ptxas run on
the GPU machine). Operations are counted as written in the module (an
unrolled loop body once per copy), not as executed. Uses a private hook of
jax 0.11.2's Mosaic GPU lowering (the module's serialization).

It also checks every TMA copy's shared-memory address (``--tma``,
:func:`capture_tma_copies`): TMA reads and writes shared memory at 128-byte
multiples, and a box that starts elsewhere faults on the GPU (misaligned
address) — the offset of each copy's shared buffer is followed back to the
kernel's shared-memory base through the lowering's views and subviews.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import math
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
    "wgmma.commit_group": "wgmma commits (a product issued)",
    "prmt.b32": "byte permutes",
    "mbarrier": "mbarrier operations",
    "vector<2xbf16>": "packed bf16 arithmetic",
    "vector<2xi16>": "packed 16-bit integer operations",
}


@contextlib.contextmanager
def capture_mosaic_modules():
    """Within the block, yields the list that the text of every Mosaic GPU
    module lowered (the serialized form of the custom call) is appended to;
    the Pallas Triton kernels beside them (the grouped calls' row-tile
    table) lower as for sm_90 without a GPU."""
    from jax.experimental.mosaic.gpu import core

    from benchmarks.lower_sm90 import capture_triton_modules

    texts: list[str] = []
    serialize = core._run_serde_pass

    def recording(module, **kwargs):
        if kwargs.get("serialize"):
            texts.append(str(module))
        return serialize(module, **kwargs)

    core._run_serde_pass = recording
    try:
        with capture_triton_modules():
            yield texts
    finally:
        core._run_serde_pass = serialize


TMA_ALIGN = 128  # bytes: where a TMA copy may start in shared memory
BASE_ALIGN = 1024  # the dynamic shared memory's base (Mosaic swizzles from it)
_DYNAMIC = -(2**63)  # MLIR's marker of a dynamic offset in a subview's static offsets


@dataclasses.dataclass(frozen=True)
class TmaCopy:
    """One TMA copy of a lowered kernel: ``direction`` "load" (global to
    shared) or "store"; the shared buffer's ``shape`` and ``itemsize``; the
    largest power of two its start is known to be a multiple of (bytes,
    at most :data:`BASE_ALIGN`)."""

    direction: str
    shape: tuple[int, ...]
    itemsize: int
    alignment: int

    @property
    def aligned(self) -> bool:
        return self.alignment % TMA_ALIGN == 0


@contextlib.contextmanager
def capture_tma_copies():
    """Within the block, yields the list each Mosaic GPU TMA copy lowered
    appends its :class:`TmaCopy` to."""
    from jax.experimental.mosaic.gpu import launch_context

    copies: list[TmaCopy] = []
    async_copy = launch_context.LaunchContext.async_copy

    def recording(self, *, src_ref, dst_ref, **kwargs):
        load = _in_shared_memory(dst_ref)
        smem = dst_ref if load else src_ref
        copies.append(TmaCopy("load" if load else "store", *_buffer(smem), smem_alignment(smem)))
        return async_copy(self, src_ref=src_ref, dst_ref=dst_ref, **kwargs)

    launch_context.LaunchContext.async_copy = recording
    try:
        yield copies
    finally:
        launch_context.LaunchContext.async_copy = async_copy


def _in_shared_memory(ref) -> bool:
    return "#gpu.address_space<workgroup>" in str(ref.type)


def _buffer(ref) -> tuple[tuple[int, ...], int]:
    from jax._src.lib.mlir import ir

    ty = ir.MemRefType(ref.type)
    return tuple(ty.shape), _itemsize(ty)


def _itemsize(ty) -> int:
    bits = re.search(r"(\d+)", str(ty.element_type))
    return max(1, int(bits.group(1)) // 8) if bits else 1


def smem_alignment(ref) -> int:
    """The largest power of two (at most :data:`BASE_ALIGN`) that the byte
    offset of the shared buffer ``ref`` (an MLIR memref value) from the
    dynamic shared memory's base is known to be a multiple of."""
    const, unknown = _byte_offset(ref)
    known = math.gcd(const, unknown) or BASE_ALIGN
    return math.gcd(known, BASE_ALIGN)


def _byte_offset(ref) -> tuple[int, int]:
    """``(c, g)``: ``ref``'s byte offset from the shared base is ``c`` plus
    some multiple of ``g`` (``g`` 0: exactly ``c``)."""
    from jax._src.lib.mlir import ir

    op = ref.owner
    name = op.name
    if name == "gpu.dynamic_shared_memory":
        return 0, 0
    if name == "memref.view":  # the buffer's byte shift in the shared memory
        const, unknown = _byte_offset(op.operands[0])
        shift = op.operands[1]
        if shift.owner.name == "arith.constant":
            return const + _factor(shift), unknown
        return const, math.gcd(unknown, _factor(shift))
    if name == "memref.subview":  # offsets along the source's strides
        source = op.operands[0]
        const, unknown = _byte_offset(source)
        ty = ir.MemRefType(source.type)
        strides, _ = ty.get_strides_and_offset()
        dynamic = iter(op.operands[1:])
        for offset, stride in zip(ir.DenseI64ArrayAttr(op.attributes["static_offsets"]), strides, strict=True):
            step = stride * _itemsize(ty)
            if offset == _DYNAMIC:
                unknown = math.gcd(unknown, _factor(next(dynamic)) * step)
            else:
                const += offset * step
        return const, unknown
    if name in ("memref.expand_shape", "memref.collapse_shape", "memref.transpose", "memref.cast"):
        return _byte_offset(op.operands[0])
    raise NotImplementedError(f"smem_alignment: a shared buffer made by {name} (not followed)")


def _factor(value, depth: int = 0) -> int:
    """A number the integer ``value`` is known to be a multiple of (0: the value 0)."""
    from jax._src.lib.mlir import ir

    op = value.owner
    if depth > 32 or not hasattr(op, "name"):
        return 1  # a block argument (a loop's counter): any value
    name, operands = op.name, op.operands
    if name == "arith.constant":
        return abs(ir.IntegerAttr(op.attributes["value"]).value)
    if name in ("arith.index_cast", "arith.index_castui", "arith.extsi", "arith.extui"):
        return _factor(operands[0], depth + 1)
    if name == "arith.muli":
        return _factor(operands[0], depth + 1) * _factor(operands[1], depth + 1)
    if name == "arith.shli" and operands[1].owner.name == "arith.constant":
        return _factor(operands[0], depth + 1) << _factor(operands[1], depth + 1)
    if name in ("arith.addi", "arith.subi"):
        return math.gcd(_factor(operands[0], depth + 1), _factor(operands[1], depth + 1))
    if name == "arith.select":
        return math.gcd(_factor(operands[1], depth + 1), _factor(operands[2], depth + 1))
    return 1


def misaligned(copies: list[TmaCopy]) -> list[TmaCopy]:
    """The copies of ``copies`` whose shared address may start off a 128-byte multiple."""
    return sorted({c for c in copies if not c.aligned}, key=str)


FP8_FORMATS = ("w8a8_fp8_block128", "w4a8_mxfp4")  # the fp8 kernel's: e4m3 blocks / MXFP4, fp8 group-128 inputs


def mosaic_ir(fmt: str, shape: tuple[int, int, int], rows: int, tuning) -> str:
    """The module text of the Mosaic GEMM for ``rows`` rows of x times an
    ``[E, N, K]`` weight in ``fmt`` ("bf16", or int4/uint4/MXFP4 decoded in
    the kernel; :data:`FP8_FORMATS` on the fp8 kernel), lowered for the GPU."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gemm import mosaic

    if fmt in FP8_FORMATS:
        return _fp8_module(fmt, shape, rows, tuning)

    e, n, k = shape
    tiles = tuning
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    if fmt == "bf16":
        weight, quant, decode = jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16), (), None
    elif fmt == "mxfp4":  # planar e2m1 codes in the pair decoder's bit order, an e8m0 byte a 32-column unit
        decode = mosaic.NibbleDecode(k // mosaic.E2M1_UNIT, e2m1=True, half_bits=True)
        weight = jax.ShapeDtypeStruct((e, n, k // mosaic.PIECES), jnp.uint16)
        quant = (jax.ShapeDtypeStruct((e, k // mosaic.E2M1_UNIT, n), jnp.uint8),)
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


def _fp8_module(fmt: str, shape: tuple[int, int, int], rows: int, tiles) -> str:
    """The fp8 kernel's module (``mosaic_fp8:`` tiles): e4m3 128 x 128 blocks
    or MXFP4 codes (the pair decoder's bit order, scales ``[E, N, K/32]``)
    times fp8 inputs with a scale a row and 128 columns."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.gemm import mosaic_fp8, mx_e4m3

    e, n, k = shape
    x = jax.ShapeDtypeStruct((rows, k), jnp.float8_e4m3fn)
    x_scale = jax.ShapeDtypeStruct((rows, k // mosaic_fp8.BLOCK_K), jnp.float32)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    if fmt == "w4a8_mxfp4":
        scaling = mosaic_fp8.Scaling("group", "mx", half_bits=True)
        w = jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8)
        w_scale = jax.ShapeDtypeStruct((e, n, k // mx_e4m3.MX_GROUP), jnp.uint8)
    else:
        scaling = mosaic_fp8.Scaling("group", "block")
        w = jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn)
        blocks = mosaic_fp8.BLOCK_K
        w_scale = jax.ShapeDtypeStruct((e, n // blocks, k // blocks), jnp.float32)
    run = functools.partial(mosaic_fp8.expert_gemm_fp8, tiles=tiles, scaling=scaling, out_dtype=jnp.bfloat16)
    with capture_mosaic_modules() as texts:
        jax.jit(lambda *a: run(*a)).trace(x, x_scale, w, w_scale, offsets).lower(lowering_platforms=("cuda",))
    return texts[-1]


def shared_memory_size(text: str) -> int:
    """The dynamic shared memory (bytes) the module's kernel launches with."""
    sizes = re.findall(r"dynamic_shared_memory_size %c(\d+)_i32", text)
    if len(sizes) != 1:
        raise ValueError(f"expected one kernel launch with its shared memory size, found {len(sizes)}")
    return int(sizes[0])


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
    parser.add_argument(
        "--fmt", default="int4_g128", choices=("bf16", "int4_g128", "uint4_zp_g128", "mxfp4", *FP8_FORMATS)
    )
    parser.add_argument("--shape", default="8,4096,4096", help="E,N,K of the weight")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--config", required=True, help="as inspect_gemm's: mosaic (mosaic_fp8 for the fp8 formats)")
    parser.add_argument("--out", help="write the module text here")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tma", action="store_true", help="list the TMA copies' shared-memory alignment")
    args = parser.parse_args(argv)
    tuning = parse_config(args.config)
    shape = tuple(int(v) for v in args.shape.split(","))
    with capture_tma_copies() as copies:
        text = mosaic_ir(args.fmt, shape, args.rows, tuning)
    bad = misaligned(copies)
    print(f"TMA copies: {len(copies)}, {len(bad)} may start off a {TMA_ALIGN}-byte multiple")
    if args.tma or bad:
        for copy, count in sorted(collections.Counter(copies).items(), key=str):
            flag = "" if copy.aligned else "  MISALIGNED"
            print(f"{count:6d}  {copy.direction} {copy.shape} x{copy.itemsize} B, aligned to {copy.alignment}{flag}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(f"shared memory: {shared_memory_size(text):,} bytes")
    for key, count in key_counts(text).items():
        print(f"{count:6d}  {key}  ({KEY_OPS[key]})")
    print(f"{len(text.splitlines())} lines; most frequent operations:")
    for name, count in op_histogram(text).most_common(args.top):
        print(f"{count:6d}  {name}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
