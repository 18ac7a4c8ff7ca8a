"""A/B of GEMM tilings on the bench's cases, in one process, interleaved.

    python -m benchmarks.ab_tilings --formats mxfp4@fp8_dynamic_group128 \
        --problems qwen3-30b-a3b --tokens 512 4096 --layouts grouped indexed \
        --tilings default "mosaic_fp8:block_m=64,block_n=256" "mosaic_fp8:" --out ab.json

Each case's routing and inputs are made once; every tiling (``default``: what
``gemm`` picks) is timed in turn, ``--repeats`` rounds, its output checked
against the sampled float32 reference (``bench.sampled_error``) in the first.
An indexed layout's block is the tiling's rows. Prints a row per timing and
writes them as JSON after each case, so a run stopped by a time limit keeps
the cases done (a tiling a kernel refuses is a row with its error).
``--humming`` times Humming's kernel on each case after every round's
tilings, both ways the bench times it (rows ``humming_graph``,
``humming_do_bench``).

``--variant FILE`` loads another version of a kernel file (e.g. one from the
history: ``git show COMMIT:pallas_kernels/gemm/mosaic_fp8.py > FILE``) beside
the tree's; its tilings are written ``variant:FIELDS`` and run its code.
Several at once: ``--variant v28=FILE v29=FILE``, tiled ``v28:FIELDS`` and
``v29:FIELDS``; ``v28:default`` runs the tiles ``default`` ran (listed
before it) on the variant's kernel. A Mosaic kernel file is also tiled
``v28_mid:FIELDS``: its body without warp specialization, as ``mosaic_mid``.
``--seeds 0 1 2`` times each case on that many routings (and inputs), each its
own case: a choice between row tiles can hinge on one expert's count (a tile
that just holds the largest expert's rows runs one wave where one 16 rows
shorter runs two), so each row also carries ``expert_rows_max``.
``--scale-orders kernel n_major k_major`` times each tiling on weights whose
group scales are stored as ``to_kernel_order`` stores them, as ``[E, N, K/g]``
and as ``[E, K/g, N]`` (any per-group format), interleaved.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import sys
import time

import pallas_kernels.gemm as gemm_kernels
from humming_jax import bench, tiles_text
from humming_jax.timing import write_results

VARIANT = "variant"  # the tiles-text name of a --variant file's kernel


def _tiling(text: str, default=None):
    """The tiles of ``text``; ``NAME:default`` is ``default`` (the tiles the
    case's ``default`` ran) on the variant ``NAME``'s kernel, field for field."""
    if text == "default":
        return None
    name, _, fields = text.partition(":")
    if fields == "default":
        if default is None:
            raise ValueError(f"--tilings: {text!r} needs 'default' listed before it")
        return gemm_kernels.IMPLS[name](**dataclasses.asdict(default))
    return tiles_text.gemm_from_text(text)


def load_variant(path: str, name: str = VARIANT) -> None:
    """Register the kernel module at ``path`` as ``name`` (its ``Tiles`` run its
    ``expert_gemm``). A module whose tiles are warp-specialized (a Mosaic
    kernel file) is also registered as ``NAME_mid``: its body run as
    ``mosaic_mid`` runs ``mosaic``'s (one warpgroup a program, a program a
    tile), so a change to the shared body is timed on both structures."""
    if (name in gemm_kernels.IMPLS or f"{name}_mid" in gemm_kernels.IMPLS) and name != VARIANT:
        raise ValueError(f"--variant: {name!r} names a kernel of the tree")
    spec = importlib.util.spec_from_file_location(f"{name}_kernel", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while the file runs)
    spec.loader.exec_module(module)
    gemm_kernels.KERNELS[module.Tiles] = module
    gemm_kernels.IMPLS[name] = module.Tiles
    if getattr(module.Tiles, "warp_specialized", False):
        mid = dataclasses.dataclass(frozen=True)(
            type("Tiles", (module.Tiles,), {"warp_specialized": False, "__module__": module.__name__})
        )
        gemm_kernels.KERNELS[mid] = module  # its supports and expert_gemm read the structure from the type
        gemm_kernels.IMPLS[f"{name}_mid"] = mid


def run(args) -> list[dict]:
    rows = []
    cases = itertools.product(args.formats, args.problems, args.gemms, args.layouts, args.tokens, args.seeds)
    for fmt, problem, gemm, layout, tokens, seed in cases:
        preps = {
            order: bench.prepare(bench.Case(problem, gemm, layout, tokens, fmt, scale_order=order), seed=seed)
            for order in args.scale_orders
        }
        default = None
        peers = bench.humming_peers(preps[args.scale_orders[0]]) if args.humming else {}
        first = preps[args.scale_orders[0]]
        largest = int(bench.expert_counts(first.ids, first.case.shapes()[0]).max())
        case = dict(
            fmt=fmt, problem=problem, gemm=gemm, layout=layout, tokens=tokens, seed=seed, expert_rows_max=largest
        )
        for repeat in range(args.repeats):
            for text, order in itertools.product(args.tilings, args.scale_orders):
                prep = preps[order]
                row = dict(case, tiling=text, repeat=repeat)
                if len(args.scale_orders) > 1:
                    row["scale_order"] = order
                start = time.time()
                try:
                    result, out, used = bench.time_prepared(prep, _tiling(text, default))
                    if text == "default" and result["tiles"]:
                        default = tiles_text.gemm_from_text(result["tiles"])
                    row.update(us=result["us"], tflops=result["tflops"], gbps=result["gbps"], tiles=result["tiles"])
                    if repeat == 0:
                        row["error"] = bench.sampled_error(prep, used, out)
                except Exception as error:  # a tiling the kernel refuses, or one that does not compile
                    row["failed"] = f"{type(error).__name__}: {str(error)[:300]}"
                row["wall_s"] = round(time.time() - start, 1)
                print(row, flush=True)
                rows.append(row)
            for name, sample in peers.items():  # Humming in the same rounds (both ways the bench times it)
                start = time.time()
                row = dict(case, tiling=name, repeat=repeat, us=1e6 * sample(bench.TIMING_REPEATS))
                row["wall_s"] = round(time.time() - start, 1)
                print(row, flush=True)
                rows.append(row)
        del preps, prep, peers
        write_results(args.out, rows, quiet=True)  # the cases done so far: a call cut short keeps them
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", nargs="+", required=True)
    parser.add_argument("--problems", nargs="+", default=["qwen3-30b-a3b"], choices=list(bench.PROBLEMS))
    parser.add_argument("--gemms", nargs="+", default=["w13", "w2"], choices=["w13", "w2"])
    parser.add_argument("--layouts", nargs="+", default=["grouped"], choices=["grouped", "indexed", "masked"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--tilings", nargs="+", default=["default"], help="tiles text (tiles_text) or 'default'")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="routings (and inputs) a case is timed on")
    parser.add_argument(
        "--scale-orders",
        nargs="+",
        default=["kernel"],
        choices=["kernel", "n_major", "k_major"],
        help="group scales as to_kernel_order stores them, [E, N, K/g] or [E, K/g, N] (several: interleaved)",
    )
    parser.add_argument(
        "--variant", nargs="+", default=[], help="other versions of a kernel file: FILE (tiled 'variant:'), NAME=FILE"
    )
    parser.add_argument(
        "--humming", action="store_true", help="Humming's kernel on each case too, a row each way, every repeat"
    )
    parser.add_argument("--out", default="benchmarks/results/ab_tilings.json")
    args = parser.parse_args(argv)
    for text in args.variant:
        name, _, path = text.rpartition("=")
        load_variant(path, name or VARIANT)
    for text in args.tilings:
        if not text.endswith(":default"):
            _tiling(text)  # a malformed tiling fails before anything runs
    write_results(args.out, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
