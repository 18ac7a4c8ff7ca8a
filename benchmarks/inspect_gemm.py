"""Time a few tilings of one GEMM case side by side (GPU only), each checked
against a float32 product on sampled experts.

    python -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --fmt int4_g128 --tokens 16 \
        --config triton:block_m=16,block_n=64,block_k=128 \
        --config triton:block_m=16,block_n=64,block_k=256,word_decode=1

Each ``--config`` is a GEMM tiling in the one text form (``humming_jax.tiles_text``):
``triton:`` or ``mosaic:`` and the fields of that kernel's ``Tiles`` that differ
from their defaults.
For the hardware view of one kernel, run it under Nsight
Compute with a few sections (the ``full`` set does not finish in a 10-minute
slot): ``ncu -k regex:gemm -c 1 --section SpeedOfLight --section Occupancy
--section LaunchStats --section WarpStateStats --section SchedulerStats
python -m benchmarks.inspect_gemm ... --config ...`` (one config).
"""

from __future__ import annotations

import argparse
import sys


def parse_config(text: str):
    from humming_jax.tiles_text import gemm_from_text

    return gemm_from_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="qwen3-30b-a3b")
    parser.add_argument("--gemm", default="w13", choices=("w13", "w2"))
    parser.add_argument("--layout", default="grouped", choices=("grouped", "indexed"))
    parser.add_argument("--fmt", default="int4_g128")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--k-order", action="store_true", help="4-bit weights in K order (default: planar)")
    parser.add_argument(
        "--nibble-halves", action="store_true", help="planar e2m1 codes in nibble order (default: the decoder's bits)"
    )
    parser.add_argument("--hlo", action="store_true", help="also list what one call launches (the optimized module)")
    parser.add_argument("--hlo-out", help="with --hlo: write each config's optimized module here (a suffix per config)")
    parser.add_argument(
        "--humming",
        action="store_true",
        help="then Humming's kernel on the same case (its wheel importable; Nsight Compute: NCU_KERNEL=...|humming)",
    )
    args = parser.parse_args(argv)
    configs = [parse_config(text) for text in args.config]  # bad configs fail before the GPU work
    import jax

    from humming_jax import bench

    if jax.default_backend() != "gpu":
        print("inspect_gemm: needs a GPU", file=sys.stderr)
        return 2
    case = bench.Case(args.problem, args.gemm, args.layout, args.tokens, args.fmt, args.k_order, not args.nibble_halves)
    prep = bench.prepare(case)
    for number, (text, tuning) in enumerate(zip(args.config, configs, strict=True)):
        try:
            row, out, layout = bench.time_prepared(prep, tuning)
        except Exception as error:  # e.g. a tile past the shared memory: report it, time the next one
            print(f"{text}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        if args.hlo:
            fn, _ = bench.gemm_call(prep, tuning)
            module = jax.jit(fn).lower(prep.xs[0], prep.weights[0]).compile().as_text()
            print(f"{text}: launches " + "; ".join(bench.launched_ops(module)), flush=True)
            if args.hlo_out:  # what each launch reads and writes: the fusions' own computations
                with open(f"{args.hlo_out}.{number}.txt", "w") as f:
                    f.write(module)
        error = bench.sampled_error(prep, layout, out)
        copy = f"{100 * row['copy_fraction']:.0f} % of copy"  # of the bytes that must move, at the copy bandwidth
        print(f"{text}: {row['us']:.1f} us, {row['gbps']:.0f} GB/s, err {error:.1e}, {copy}", flush=True)
    if args.humming:
        return _time_humming(prep)
    return 0


def _time_humming(prep) -> int:
    """Humming's kernel on ``prep``'s case, timed both ways the bench times it."""
    from humming_jax import bench, humming_peer

    if not humming_peer.available():
        print("humming: its package, torch or a GPU is missing", file=sys.stderr)
        return 2
    samplers = bench.humming_peers(prep)
    if not samplers:
        print(f"humming: no kernel of its runs {prep.case.fmt}", file=sys.stderr)
        return 2
    for name, sample in samplers.items():
        print(f"{name}: {1e6 * sample(5):.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
