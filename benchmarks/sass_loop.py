"""The K loop of a compiled GEMM kernel, read from its SASS: the innermost
loop that issues wgmma (``HGMMA``, ``QGMMA``, ``IGMMA``), its instructions by opcode and — where
the weight is the wgmma's register operand (the decoding swap tiles, ours and
Humming's) — the instructions a thread issues per decoded weight: what a
decode change must cut, compared between two kernels of the same problem.

    python -m benchmarks.sass_loop OUT/s/mosaic/*.sass
    python -m benchmarks.sass_loop OUT/s/mosaic/moe_gemm_mosaic_0.ptx
    python -m benchmarks.sass_loop --humming-cache DIR --signature "Shape<176,256,64>" \\
        --signature "IntegerType<false,4>" --signature "Shape<0,28672,4096>"

Reads SASS text as ``cuobjdump -sass`` or ``nvdisasm`` print it (an
instruction a line after its ``/*address*/``; branch targets as addresses or
``.L_x_N`` labels), a cubin (disassembled with the ``cuobjdump`` on PATH
or the one the ``triton`` package ships), or PTX (a dump of ``gpu.sh OUT
sass``: compiled here by that ``ptxas``, its report printed — registers,
spills, serialized wgmmas —, so a kernel dumped once is read offline). ``--humming-cache`` finds the
kernels of Humming's compile cache (each a folder with ``kernel.cubin`` and
``signature.txt``, its template arguments) whose signature holds every
``--signature`` text. Counts are of instructions as written in the loop
body, once each (not as executed).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shutil
import subprocess

INSTRUCTION = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:\{\s*)?(@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)([^;]*);"
)
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
TARGET = re.compile(r"BRA\s+(?:\.U\s+)?(?:`\((\.L_x_\d+)\)|(0x[0-9a-f]+))")
WGMMA = re.compile(r"[HQIB]GMMA\.(\d+)x(\d+)x(\d+)")  # bf16/f16, fp8, int8, binary
THREADS_PER_WARPGROUP = 128


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # with its modifiers, e.g. HADD2.BF16_V2
    operands: str
    target: int | None  # a branch's target address


@dataclasses.dataclass(frozen=True)
class Loop:
    instructions: tuple[Instruction, ...]

    def histogram(self) -> collections.Counter:
        return collections.Counter(i.opcode for i in self.instructions)

    def wgmma_count(self) -> int:
        return sum(1 for i in self.instructions if WGMMA.match(i.opcode))

    def register_weights(self) -> int:
        """Weights a thread feeds the loop's wgmmas from its registers: each
        ``?GMMA.MxNxK`` whose first source is a register takes an M x K
        fragment from its warpgroup's 128 threads."""
        total = 0
        for i in self.instructions:
            shape = WGMMA.match(i.opcode)
            sources = [s.strip() for s in i.operands.split(",")]
            if shape and len(sources) > 1 and re.fullmatch(r"R\d+", sources[1]):
                total += int(shape.group(1)) * int(shape.group(3)) // THREADS_PER_WARPGROUP
        return total


def parse(text: str) -> list[Instruction]:
    """The instructions of a SASS listing, branch targets resolved to addresses."""
    labels, pending, raw = {}, [], []
    for line in text.splitlines():
        label = LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = INSTRUCTION.search(line)
        if not found:
            continue
        address = int(found.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        raw.append((address, found.group(3), found.group(4).strip(), TARGET.search(line)))
    out = []
    for address, opcode, operands, target in raw:
        resolved = None
        if target:
            resolved = labels.get(target.group(1)) if target.group(1) else int(target.group(2), 16)
        out.append(Instruction(address, opcode, operands, resolved))
    return out


def wgmma_loops(instructions: list[Instruction]) -> list[Loop]:
    """The innermost loops that issue wgmma: each backward branch's range
    (its target through the branch) holding a wgmma where no smaller such
    range lies inside it (a barrier's retry loop inside does not count);
    densest in wgmma first (a tail's branch back into the loop makes longer,
    sparser ranges)."""
    ranges = []
    for end, branch in enumerate(instructions):
        if branch.target is None or branch.target > branch.address:
            continue
        start = next((i for i, ins in enumerate(instructions) if ins.address >= branch.target), None)
        if start is not None and any(WGMMA.match(i.opcode) for i in instructions[start : end + 1]):
            ranges.append((start, end))
    loops = []
    for start, end in ranges:
        if not any(s >= start and e <= end and (s, e) != (start, end) for s, e in ranges):
            loops.append(Loop(tuple(instructions[start : end + 1])))
    return sorted(loops, key=lambda loop: -loop.wgmma_count() / len(loop.instructions))


def cuda_tool(name: str) -> str:
    """A CUDA binary tool: PATH's, or the one the triton package ships."""
    tool = shutil.which(name)
    if tool is None:
        import triton

        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return tool


def disassemble(cubin: str) -> str:
    """``cuobjdump -sass`` of a cubin."""
    return subprocess.run([cuda_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout


PTX_VERSION = re.compile(r"^\.version \d+\.\d+$", re.M)
PTXAS_NEWEST = re.compile(r"current version is '(\d+\.\d+)'")


def for_ptxas(ptx: str, version: str) -> str:
    """``ptx`` with its ``.version`` line set to ``version`` (a newer
    compiler's PTX — Mosaic GPU's says 9.0 — for an older ptxas: the kernels
    use nothing newer; ptxas says so if one does)."""
    return PTX_VERSION.sub(f".version {version}", ptx, count=1)


def assemble(ptx_path: str, arch: str = "sm_90a") -> tuple[str, str]:
    """A PTX file (a dump of ``gpu.sh OUT sass``) compiled by ptxas: the
    cubin's path and ptxas's report — register use, spills and whether it
    serialized the wgmmas (its C7512 line). PTX newer than this ptxas takes
    is retried at the version ptxas names."""
    ptxas = cuda_tool("ptxas")
    with open(ptx_path) as f:
        text = f.read()
    stem = os.path.splitext(ptx_path)[0]
    source, cubin = stem + ".ptxas.ptx", stem + ".cubin"
    for _ in range(2):
        with open(source, "w") as f:
            f.write(text)
        done = subprocess.run([ptxas, f"-arch={arch}", "-v", source, "-o", cubin], capture_output=True, text=True)
        newest = PTXAS_NEWEST.search(done.stderr)
        if done.returncode == 0 or newest is None:
            break
        text = for_ptxas(text, newest[1])
    if done.returncode:
        raise RuntimeError(f"ptxas failed on {ptx_path}: {done.stderr.strip()[:400]}")
    return cubin, done.stderr.strip()


def humming_kernels(cache: str, signatures: list[str]) -> list[str]:
    """Cubins of Humming's compile cache whose signature (spaces ignored) holds every text."""
    wanted = [s.replace(" ", "") for s in signatures]
    found = []
    for entry in sorted(os.listdir(cache)):
        folder = os.path.join(cache, entry)
        signature = os.path.join(folder, "signature.txt")
        cubin = os.path.join(folder, "kernel.cubin")
        if os.path.exists(signature) and os.path.exists(cubin):
            with open(signature) as f:
                text = f.read().replace(" ", "").replace("\n", "")
            if all(w in text for w in wanted):
                found.append(cubin)
    return found


def report(name: str, text: str, top: int = 16) -> str:
    instructions = parse(text)
    loops = wgmma_loops(instructions)
    # No loop around the products (a K loop unrolled whole, one tile a program): the whole kernel.
    loop, what = (loops[0], "K loop") if loops else (Loop(tuple(instructions)), "kernel (no wgmma loop)")
    size, weights = len(loop.instructions), loop.register_weights()
    lines = [f"{name}: {what} of {size} instructions a thread, {loop.wgmma_count()} wgmma"]
    if weights:
        lines[0] += f", {weights} weights from registers: {size / weights:.2f} instructions a weight"
    for opcode, count in loop.histogram().most_common(top):
        share = f"  ({count / weights:.2f} a weight)" if weights else ""
        lines.append(f"  {count:5d}  {opcode}{share}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="SASS text files, cubins or PTX files (compiled by ptxas)")
    parser.add_argument("--humming-cache", help="Humming's compile cache (a folder of kernel folders)")
    parser.add_argument("--signature", action="append", default=[], help="text the kernel's signature holds")
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args(argv)
    files = list(args.files)
    if args.humming_cache:
        files += humming_kernels(args.humming_cache, args.signature)
    if not files:
        parser.error("no SASS, cubin or matching Humming kernel")
    for path in files:
        if path.endswith(".ptx"):
            cubin, ptxas_report = assemble(path)
            print(ptxas_report)
            text = disassemble(cubin)
        elif path.endswith(".cubin"):
            text = disassemble(path)
        else:
            with open(path) as f:
                text = f.read()
        print(report(path, text, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
