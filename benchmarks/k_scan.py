"""Per-tile overhead of a GEMM tiling: one case of the bench timed at several
K, every other dimension fixed, and a line ``t = a + b·K`` fitted through the
times. The intercept ``a`` is what does not scale with K — each output tile's
pipeline fill, epilogue and store; its share of the first K's time says how
much a schedule that hides the epilogue (warpgroups in ping-pong) could win
on short-K GEMMs (qwen3's w2: K = 768).

    python -m benchmarks.k_scan --problem qwen3-30b-a3b --fmt int4_g128 \\
        --config mosaic:block_m=144,block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2

The case is the problem's w2 (N = H, its routing at ``--tokens``) with K
replaced by each of ``--ks``; weights and inputs are made and stored as the
bench makes them (:func:`humming_jax.bench.prepare`). Without ``--config`` the
tuning table chooses at each K (per-shape entries do not match a made-up K:
name the tiling to compare like with like). Prints each time and the fit;
writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

import numpy as np

from humming_jax import bench, tiles_text
from humming_jax.timing import write_results

KS = (768, 1536, 3072, 6144)


@contextlib.contextmanager
def _problem_at_k(problem: str, k: int):
    """A bench problem whose w2 is ``problem``'s with K = ``k`` (its name, while the block runs)."""
    e, h, _, top_k = bench.PROBLEMS[problem]
    name = f"{problem}@K={k}"
    bench.PROBLEMS[name] = (e, h, k, top_k)  # w2: N = H, K = I
    try:
        yield name
    finally:
        del bench.PROBLEMS[name]


def fit_line(ks: Sequence[int], us: Sequence[float]) -> dict:
    """``t = a + b·K`` by least squares: the intercept, the slope and the intercept's share of the first time."""
    slope, intercept = np.polyfit(np.asarray(ks, float), np.asarray(us, float), 1)
    return dict(intercept_us=float(intercept), us_per_k=float(slope), share_at_first_k=float(intercept / us[0]))


def scan(problem: str, fmt: str, tokens: int, ks: Sequence[int], layout: str = "grouped", tuning=None) -> dict:
    """The rows (K, µs, TFLOP/s, the tiling that ran) and the fit of :func:`fit_line`."""
    rows = []
    for k in ks:
        with _problem_at_k(problem, k) as name:
            prep = bench.prepare(bench.Case(name, "w2", layout, tokens, fmt))
            row, _, _ = bench.time_prepared(prep, tuning)
        rows.append(dict(k=k, us=row["us"], us_spread=row["us_spread"], tflops=row["tflops"], tiles=row["tiles"]))
        print(f"{problem} {fmt} {layout} T={tokens} K={k}: {row['us']:.1f} us, {row['tflops']:.0f} TFLOP/s", flush=True)
    fit = fit_line([r["k"] for r in rows], [r["us"] for r in rows])
    print(
        f"{problem} {fmt}: intercept {fit['intercept_us']:.1f} us ({100 * fit['share_at_first_k']:.0f} % at K={ks[0]}),"
        f" {fit['us_per_k']:.4f} us per column of K",
        flush=True,
    )
    return dict(problem=problem, fmt=fmt, layout=layout, tokens=tokens, rows=rows, **fit)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="qwen3-30b-a3b", choices=list(bench.PROBLEMS))
    parser.add_argument("--fmt", nargs="+", default=["int4_g128"], help="bench formats (WEIGHT or WEIGHT@INPUT)")
    parser.add_argument("--config", help="the tiling, in the tiles text form (default: the table's choice)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument("--layout", default="grouped", choices=["grouped", "indexed"])
    parser.add_argument(
        "--variant", nargs="+", default=[], help="other kernel files, NAME=FILE, tiled NAME:FIELDS (as ab_tilings')"
    )
    parser.add_argument("--out", default="benchmarks/results/k_scan.json")
    args = parser.parse_args(argv)
    if len(args.ks) < 2:
        parser.error("--ks: at least two values of K to fit a line through")
    if args.variant:
        from benchmarks.ab_tilings import VARIANT, load_variant

        for text in args.variant:
            name, _, path = text.rpartition("=")
            load_variant(path, name or VARIANT)
    tuning = tiles_text.gemm_from_text(args.config) if args.config else None
    results = [scan(args.problem, fmt, args.tokens, args.ks, args.layout, tuning) for fmt in args.fmt]
    write_results(args.out, results, quiet=True, config=args.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
