"""Lower one GEMM tiling for sm_90 on a machine without a GPU and, when the
``triton`` package is importable, compile it to SASS and count the
instructions of its K loop — how a decode change can be judged (and its
lowering checked) before any GPU run.

    python -m benchmarks.lower_sm90 --fmt int4_g128 --tokens 16 \\
        --config triton:block_m=16,block_n=64,block_k=256,word_decode=1,fold_scales=1,pair_decode=1 --out build/sm90
    python -m benchmarks.lower_sm90 --fmt w8a8_fp8_block128 --tokens 4096 \\
        --config triton:block_m=64,block_n=128,block_k=128,num_stages=4 --out build/sm90
    python -m benchmarks.lower_sm90 --process hadamard128+fp8_token --width 768 \\
        --tiles block_rows=8,num_warps=8,row_blocks=4 --tokens 4096 --out build/sm90

(the second: a ``process_input`` case of ``benchmarks.bench_process_input``,
compiled with the launch's own warps and stages).

Writes ``<out>/<name>.ttir`` (the Triton IR that Pallas emits) and, with
Triton, ``.ttgir``, ``.llir``, ``.ptx``, ``.sass``; prints the K loop's
instructions and the global loads it waits on (those Triton's pipeliner left
synchronous: :func:`loads_in_loops`). Triton here is the
standalone package (``pip install triton``; it ships ptxas and cuobjdump), not
the copy inside jaxlib, so register counts and a few passes may differ from
the GPU build: compare tilings with each other, not with a profile. Uses two
private hooks of jax 0.11.2's Pallas Triton lowering (the GPU query and the
module builder).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import types

import numpy as np

from benchmarks import sass_loop
from benchmarks.inspect_gemm import parse_config


def gpu_info_as(compute_capability: int = 90) -> types.SimpleNamespace:
    """A stand-in for Pallas Triton's GPU query: it reports ``compute_capability``."""
    info = types.SimpleNamespace(compute_capability=compute_capability)
    return types.SimpleNamespace(get_gpu_info=lambda: info)


@contextlib.contextmanager
def capture_triton_modules(compute_capability: int = 90):
    """Within the block, Pallas Triton kernels lower without a GPU (as for
    ``compute_capability``); yields the list their TTIR texts are appended to."""
    from jax._src.pallas.triton import lowering
    from jax._src.pallas.triton import pallas_call_registration as registration

    texts: list[str] = []
    build = lowering.lower_jaxpr_to_triton_module

    def recording(*args, **kwargs):
        result = build(*args, **kwargs)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    saved = registration.gpu_info_lib, registration.lowering.lower_jaxpr_to_triton_module
    registration.gpu_info_lib = gpu_info_as(compute_capability)
    registration.lowering.lower_jaxpr_to_triton_module = recording
    try:
        yield texts
    finally:
        registration.gpu_info_lib, registration.lowering.lower_jaxpr_to_triton_module = saved


def ttir_of(fn, *args) -> list[str]:
    """TTIR of every Pallas Triton kernel ``jax.jit(fn)(*args)`` launches,
    lowered for sm_90 without a GPU (arrays or ShapeDtypeStructs)."""
    return [text for text, _, _ in ttir_with_launch(fn, *args)]


def ttir_with_launch(fn, *args) -> list[tuple[str, int, int]]:
    """``(TTIR, num_warps, num_stages)`` of every Pallas Triton kernel
    ``jax.jit(fn)(*args)`` launches, lowered for sm_90 without a GPU (the
    warps and stages read from the custom calls of the lowered module)."""
    import jax

    with capture_triton_modules() as texts:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    launches = re.findall(r"num_stages = (\d+) : i32, num_warps = (\d+) : i32", lowered)
    if len(launches) != len(texts):
        raise RuntimeError(f"lower_sm90: {len(texts)} kernels but {len(launches)} launch configurations")
    return [(text, int(warps), int(stages)) for text, (stages, warps) in zip(texts, launches, strict=True)]


def process_ttir(case: str, width: int, tokens: int, tiles: str | None) -> list[tuple[str, int, int]]:
    """``(TTIR, num_warps, num_stages)`` of the ``process_input`` kernel for a
    case of ``benchmarks.bench_process_input`` (``tokens`` x top-8 rows,
    ``width`` columns after the activation) under ``tiles`` (text form; None:
    the default)."""
    import jax
    import jax.numpy as jnp

    import humming_jax as hj
    from benchmarks.bench_process_input import CASES, TOP_K

    activation, block, spec = CASES[case]
    x = jax.ShapeDtypeStruct((tokens * TOP_K, 2 * width if activation else width), jnp.bfloat16)
    kw = dict(activation=activation, hadamard_block_size=block, backend="pallas")
    from humming_jax.tiles_text import from_text
    from pallas_kernels.process_input import Tiles

    kw["tiles"] = None if tiles is None else from_text(Tiles, tiles)
    return ttir_with_launch(lambda x: hj.process_input(x, spec, **kw), x)


def gemm_ttir(*args, **kwargs) -> list[str]:
    """TTIR of :func:`gemm_launches` (the same arguments)."""
    return [text for text, _, _ in gemm_launches(*args, **kwargs)]


def gemm_launches(
    fmt: str,
    tokens: int,
    tuning,
    shape: tuple[int, int, int],
    planar: bool = False,
    half_bits: bool = False,
    k_major_scales: bool = False,
    activation: str | None = None,
) -> list[tuple[str, int, int]]:
    """TTIR of the grouped GEMM kernels of ``tokens`` tokens (top-8 of ``E``
    experts, or top-2 below 8) on an ``[E, N, K]`` weight of format ``fmt``
    (``WEIGHT`` or ``WEIGHT@INPUT`` as the bench takes it; in the planar
    nibble order with ``planar``; e2m1 codes in the decoder's bit order with
    ``half_bits``; group scales ``[E, K/g, N]`` with ``k_major_scales``;
    ``tuning`` None: what the op chooses on an H200; ``activation``: applied
    in the epilogue, gated kinds on rows interleaved by
    ``formats.GATE_UP_BLOCK``), with each launch's warps and stages."""
    import dataclasses

    import jax.numpy as jnp

    from humming_jax import formats as F
    from humming_jax import input_quant as Q
    from humming_jax import layouts as L
    from humming_jax.activations import get_activation
    from humming_jax.bench import split_format
    from humming_jax.gemm import gemm
    from humming_jax.routing import moe_prepare_scatter

    e, n, k = shape
    top_k = 8 if e >= 8 else 2
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weight_format, quant = split_format(fmt)
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.02), weight_format)
    if planar:
        weight = F.to_planar(weight, half_bits=half_bits, k_major_scales=k_major_scales)
    spec = get_activation(activation)
    if spec is not None and spec.interleaves:
        weight = F.interleave_gate_up(weight)
        spec = dataclasses.replace(spec, gate_up_block=weight.gate_up_block)
    x = jnp.asarray(rng.normal(size=(tokens * top_k, k)), jnp.bfloat16)
    if quant.is_quantized:
        x = Q.quantize_input(x, quant, static_scale=jnp.float32(0.02) if quant.mode.is_static else None)
    layout = L.GroupedContiguous(moe_prepare_scatter(jnp.asarray(ids), e, backend="reference")[0])

    def run(x, weight, layout):
        return gemm(x, weight, layout, tuning=tuning, backend="pallas", activation=spec)

    return ttir_with_launch(run, x, weight, layout)


SASS_OP = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def loop_histogram(sass: str) -> tuple[int, collections.Counter]:
    """Instructions of the SASS loops (from each backward branch's target to
    the branch), by opcode with modifiers."""
    lines = sass.splitlines()
    address = {}
    for i, line in enumerate(lines):
        found = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if found:
            address.setdefault(int(found.group(1), 16), i)
    ops: collections.Counter = collections.Counter()
    for i, line in enumerate(lines):
        branch = re.search(r"@!?P\d BRA (0x[0-9a-f]+)", line)
        start = address.get(int(branch.group(1), 16)) if branch else None
        if start is None or start > i:
            continue
        for body in lines[start : i + 1]:
            found = SASS_OP.match(body)
            if found:
                ops[found.group(2)] += 1
    return sum(ops.values()), ops


def loads_in_loops(ttgir: str) -> list[str]:
    """The types of the global loads an ``scf.for`` waits on after Triton's
    software pipeliner (``tt.load`` ops inside it — pipelined loads are
    ``async_copy`` ops — whose value the same iteration uses; one only carried
    to the next iteration through ``scf.yield`` is a prefetch, not a wait)."""
    open_loops, found = [], []
    lines = ttgir.splitlines()
    for number, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if open_loops and line.lstrip().startswith("}") and indent == open_loops[-1]:
            open_loops.pop()
        elif "scf.for" in line and line.rstrip().endswith("{"):
            open_loops.append(indent)
        elif open_loops and "tt.load" in line:
            name = line.split("=", 1)[0].strip()
            mentions = [u for u in lines[number + 1 :] if re.search(re.escape(name) + r"\b", u)]
            carried = any("scf.yield" in u for u in mentions)
            if not carried or any(u.lstrip().startswith("%") for u in mentions):
                found.append(line.split(" : ", 1)[-1].split(" loc(")[0].strip())
    return found


def optimize_ttir(ttir_path: str) -> str:
    """Run the TTIR passes (canonicalize, combine — e.g. ``acc + dot(a, b, 0)``
    into ``dot(a, b, acc)`` —, CSE, …) on the Pallas module, as a compile from
    Python source or jaxlib's pipeline does; ``triton.compile`` on an IR file
    skips its first stage's passes. Writes and returns ``<base>.opt.ttir``."""
    from triton._C.libtriton import ir, passes
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ir.parse_mlir_module(ttir_path, context)
    manager = ir.pass_manager(context)  # the nvidia backend's make_ttir passes for sm_90
    passes.common.add_inliner(manager)
    passes.ttir.add_rewrite_tensor_pointer(manager)
    passes.common.add_canonicalizer(manager)
    passes.ttir.add_combine(manager)
    passes.ttir.add_reorder_broadcast(manager)
    passes.common.add_cse(manager)
    passes.common.add_symbol_dce(manager)
    passes.ttir.add_loop_unroll(manager)
    manager.run(module, "make_ttir")
    path = ttir_path.removesuffix(".ttir") + ".opt.ttir"
    with open(path, "w") as f:
        f.write(str(module))
    return path


def compile_sm90(ttir_path: str, num_warps: int, num_stages: int) -> str:
    """Compile with the standalone Triton for sm_90 (the TTIR passes first,
    :func:`optimize_ttir`); write its stages next to ``ttir_path`` and return
    the SASS."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(
        optimize_ttir(ttir_path),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    base = ttir_path.removesuffix(".ttir")
    for stage in ("ttgir", "llir", "ptx"):
        text = kernel.asm.get(stage)
        if text is not None:
            with open(f"{base}.{stage}", "w") as f:
                f.write(text if isinstance(text, str) else text.decode())
    with open(f"{base}.cubin", "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = sass_loop.cuda_tool("cuobjdump")
    sass = subprocess.run([tool, "-sass", f"{base}.cubin"], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", f"{base}.cubin"], capture_output=True, text=True, check=True).stdout
    with open(f"{base}.sass", "w") as f:
        f.write(sass)
    registers = re.search(r"REG:(\d+)", usage)
    print(f"registers {registers.group(1) if registers else '?'}, shared bytes {kernel.metadata.shared}")
    return sass


def _write_and_compile(launches: list[tuple[str, int, int]], out: str, name: str, loops: str) -> int:
    """Write each ``(TTIR, num_warps, num_stages)`` launch's TTIR, then (with
    Triton) compile it to SASS and print the instructions of its ``loops``."""
    paths = []
    for i, (text, _, _) in enumerate(launches):
        paths.append(os.path.join(out, f"{name}{i}.ttir"))
        with open(paths[-1], "w") as f:
            f.write(text)
    print("wrote", ", ".join(paths))
    try:
        import triton  # noqa: F401
    except ImportError:
        print("lower_sm90: no triton package here; TTIR only", file=sys.stderr)
        return 0
    for path, (_, warps, stages) in zip(paths, launches, strict=True):
        total, ops = loop_histogram(compile_sm90(path, warps, stages))
        print(f"{path}: {warps} warps, {stages} stages, {loops} {total} instructions")
        print("  " + ", ".join(f"{op} {count}" for op, count in ops.most_common(16)))
        with open(path.removesuffix(".ttir") + ".ttgir") as f:
            waits = loads_in_loops(f.read())
        print(f"  loads the loop waits on (not pipelined): {len(waits)}" + "".join(f"\n    {t}" for t in waits))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fmt", default="int4_g128")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--config", help="as benchmarks.inspect_gemm (the GEMM mode); 'auto': the op's choice")
    parser.add_argument("--process", help="a benchmarks.bench_process_input case (the process_input mode)")
    parser.add_argument("--width", type=int, default=768, help="process_input: columns after the activation")
    parser.add_argument("--tiles", help="process_input: tiles in the text form, e.g. block_rows=8 (default: chosen)")
    parser.add_argument("--shape", default="8,1536,2048", help="E,N,K of the weight (qwen3 w13 with 8 experts)")
    parser.add_argument("--out", default="build/sm90")
    parser.add_argument("--name", default="gemm")
    parser.add_argument("--planar", action="store_true", help="the weight in the planar nibble order (to_planar)")
    parser.add_argument("--half-bits", action="store_true", help="planar e2m1 codes in the decoder's bit order")
    parser.add_argument("--activation", help="the GEMM applies this activation in its epilogue (e.g. silu)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.process:
        launches = process_ttir(args.process, args.width, args.tokens, args.tiles)
        return _write_and_compile(launches, args.out, args.name, "loops")
    if not args.config:
        parser.error("--config is required (or --process)")
    tuning = None if args.config == "auto" else parse_config(args.config)
    shape = tuple(int(v) for v in args.shape.split(","))
    launches = gemm_launches(
        args.fmt, args.tokens, tuning, shape, args.planar, args.half_bits, activation=args.activation
    )
    return _write_and_compile(launches, args.out, args.name, "K loop")


if __name__ == "__main__":
    sys.exit(main())
