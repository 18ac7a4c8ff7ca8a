"""Command line: ``python -m humming_jax demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m humming_jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run a small MoE layer through every expert pipeline and check it")
    bench = commands.add_parser("bench", help="GPU: time the expert GEMMs over the problem set (JSON + table)")
    tune = commands.add_parser("tune", help="GPU: sweep tiles per layout/format/M range and write the table")
    report = commands.add_parser("report", help="merge bench results files; Humming's ratios by format and T")
    report.add_argument("files", nargs="+", help="bench JSONs, in the order measured (a later file wins a case)")
    report.add_argument("--out", default=None, help="the merged rows and summaries (JSON; the plot beside it)")
    from humming_jax import bench as bench_module
    from humming_jax import layer_bench

    for sub, default_out in ((bench, "benchmarks/results/gemm.json"), (tune, "benchmarks/results/tuning.json")):
        sub.add_argument(
            "--formats",
            nargs="+",
            default=None,
            help="weight formats, WEIGHT@INPUT pairs (fp8_block128@fp8_dynamic_group128) or the anchor's pair names "
            f"(default: {' '.join(bench_module.FORMATS)}; with --layer: {' '.join(layer_bench.LAYER_FORMATS)})",
        )
        sub.add_argument(
            "--out",
            default=default_out,
            help="results JSON (tune: the table; use it with HUMMING_JAX_TUNING=FILE) (default: %(default)s)",
        )
        sub.add_argument(
            "--k-order",
            action="store_true",
            help="4-bit weights in K order (default: planar, as the modules store them)",
        )
    bench.add_argument(
        "--problems", nargs="+", default=list(bench_module.ANCHOR_PROBLEMS), choices=list(bench_module.PROBLEMS)
    )
    bench.add_argument("--tokens", nargs="+", type=int, default=list(bench_module.TOKENS))
    bench.add_argument("--layouts", nargs="+", default=["grouped", "indexed"], choices=["grouped", "indexed", "masked"])
    bench.add_argument("--gemms", nargs="+", default=["w13", "w2"], choices=["w13", "w2"])
    bench.add_argument("--no-compare", action="store_true", help="skip torch._grouped_mm and jax.lax.ragged_dot")
    bench.add_argument(
        "--no-humming",
        action="store_true",
        help="do not time Humming's kernel in this process (when its package is importable); use --anchor only",
    )
    bench.add_argument(
        "--layer",
        action="store_true",
        help="time whole expert layers (each stage, host time, a torch bf16 layer) instead of the GEMMs",
    )
    bench.add_argument(
        "--pipelines",
        nargs="+",
        choices=list(layer_bench.PIPELINES),
        help="with --layer (default: every one where there are several devices, else grouped and indexed)",
    )
    bench.add_argument(
        "--no-stages", action="store_true", help="with --layer: time whole layers only (a third of the compilations)"
    )
    bench.add_argument(
        "--anchor",
        default=bench_module.ANCHOR_FILE,
        help="Humming's measured table (JSON) for the 'humming us' and 'x humming' columns; absent: none",
    )
    tune.add_argument("--problem", default="qwen3-30b-a3b", choices=list(bench_module.PROBLEMS))
    tune.add_argument("--gemm", default="w13", choices=["w13", "w2"], help="which of the problem's GEMMs to time")
    tune.add_argument("--layouts", nargs="+", default=["grouped", "indexed"], choices=["grouped", "indexed", "masked"])
    tune.add_argument(
        "--min-m", type=int, default=0, help="skip M ranges (rows: tokens x top-k) whose upper end is below this"
    )
    tune.add_argument(
        "--max-m", type=int, default=0, help="skip M ranges (rows: tokens x top-k) starting at or above this"
    )
    tune.add_argument(
        "--uncovered",
        action="store_true",
        help="list the M ranges of --problem's --gemm that no table entry covers (the heuristic runs); no GPU",
    )
    tune.add_argument(
        "--per-shape",
        action="store_true",
        help="write the entries for this problem's (E, N, K) only (they take precedence over the class entries)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from humming_jax.demo import main as demo_main

        return demo_main()
    if args.command == "report":
        from humming_jax.bench_report import report_main

        return report_main(args.files, args.out)
    if args.command == "bench" and args.layer:
        args.formats = args.formats or list(layer_bench.LAYER_FORMATS)
        if args.out == "benchmarks/results/gemm.json":
            args.out = "benchmarks/results/layer.json"
        return layer_bench.layer_main(args)
    args.formats = args.formats or list(bench_module.FORMATS)
    if args.command == "bench":
        return bench_module.bench_main(args)
    return bench_module.tune_main(args)


if __name__ == "__main__":
    sys.exit(main())
