"""Time a few tilings of one GEMM case and show the instruction mix of their
compiled kernels (GPU only).

    python -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --fmt int4_g128 --tokens 16 \
        --config 16,64,128,4,3 --config 16,64,128,4,3,word_decode --dump DIR

Each ``--config`` is ``block_m,block_n,block_k,num_warps,num_stages[,option...]``
with options ``swap_ab``, ``word_decode``, ``split_k=S``, ``group_m=G``.
XLA writes the PTX of every compiled module under ``--dump``; the PTX of each
``moe_gemm`` kernel found there is summarised by instruction class (global and
shared loads, async copies, MMAs, barriers, bit operations, conversions), the
counts being static (per kernel body, loops counted once).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import sys

CLASSES = {
    "ld.global": r"^\s*ld\.global",
    "st.global": r"^\s*st\.global",
    "cp.async": r"^\s*cp\.async(?!\.(commit|wait))",
    "cp.async.bulk": r"^\s*cp\.async\.bulk",
    "ld.shared": r"^\s*ld\.shared",
    "st.shared": r"^\s*st\.shared",
    "ldmatrix": r"^\s*ldmatrix",
    "mma.sync": r"^\s*mma\.sync",
    "wgmma": r"^\s*wgmma\.mma_async",
    "bar.sync": r"^\s*(bar\.sync|barrier\.sync)",
    "lop3/and/or/shr/shl": r"^\s*(lop3|and|or|xor|shr|shl|shf|bfe|prmt)\.",
    "cvt": r"^\s*cvt\.",
    "fma/mul/add/sub (f32/bf16)": r"^\s*(fma|mul|add|sub)\.(rn\.)?(f32|bf16|bf16x2|f16x2)",
    "setp/selp": r"^\s*(setp|selp)\.",
}


def kernel_bodies(text: str) -> dict[str, str]:
    """``.entry`` name -> body of every kernel in a PTX file."""
    bodies = {}
    for match in re.finditer(r"\.entry\s+(\S+?)\s*\(", text):
        start = match.end()
        end = text.find("\n.entry", start)
        bodies[match.group(1)] = text[start : end if end > 0 else len(text)]
    return bodies


def instruction_mix(body: str) -> dict[str, int]:
    counts = collections.Counter()
    for line in body.splitlines():
        for name, pattern in CLASSES.items():
            if re.match(pattern, line):
                counts[name] += 1
    counts["total lines"] = sum(1 for line in body.splitlines() if line.strip().endswith(";"))
    return dict(counts)


def summarise_dump(dump: pathlib.Path, seen: set[str], save: pathlib.Path | None = None) -> None:
    for path in sorted(dump.rglob("*.ptx")):
        for name, body in kernel_bodies(path.read_text(errors="replace")).items():
            if "moe_gemm" not in name or name in seen:
                continue
            seen.add(name)
            mix = instruction_mix(body)
            if save:
                save.mkdir(parents=True, exist_ok=True)
                (save / f"{len(seen):02d}_{name[:80]}.ptx").write_text(body)
            print(f"  {path.name} {name}: " + ", ".join(f"{k} {v}" for k, v in mix.items()), flush=True)


def parse_config(text: str):
    from humming_jax.configs import TuningConfig

    fields = text.split(",")
    options = {}
    for option in fields[5:]:
        key, _, value = option.partition("=")
        options[key] = int(value) if value else True
    return TuningConfig(*(int(v) for v in fields[:5]), **options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="qwen3-30b-a3b")
    parser.add_argument("--gemm", default="w13", choices=("w13", "w2"))
    parser.add_argument("--layout", default="grouped", choices=("grouped", "indexed"))
    parser.add_argument("--fmt", default="int4_g128")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--dump", help="directory for XLA's dump (PTX); omitted: timing only")
    parser.add_argument("--save-ptx", type=pathlib.Path, help="write each GEMM kernel's PTX here")
    args = parser.parse_args(argv)
    if args.dump:  # must be set before the backend starts
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump}"
    import jax

    from humming_jax import bench

    if jax.default_backend() != "gpu":
        print("inspect_gemm: needs a GPU", file=sys.stderr)
        return 2
    prep = bench.prepare(bench.Case(args.problem, args.gemm, args.layout, args.tokens, args.fmt))
    seen: set[str] = set()
    for text in args.config:
        tuning = parse_config(text)
        row, out, layout = bench.time_prepared(prep, tuning)
        error = bench.sampled_error(prep, layout, out)
        print(f"{text}: {row['us']:.1f} us, {row['gbps']:.0f} GB/s, err {error:.1e}", flush=True)
        if args.dump:
            summarise_dump(pathlib.Path(args.dump), seen, args.save_ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
