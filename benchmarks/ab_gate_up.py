"""A/B of w13's row order on whole expert layers, in one process, interleaved:
the layer on its weights as ``to_kernel_order`` stores them (gate and up rows
interleaved by blocks, so w13's tiles apply the activation where they can)
against the same weights with w13 in halves
(w13's sums, then the activation pass).

    python -m benchmarks.ab_gate_up --cases qwen3-30b-a3b:indexed:1:int4_g128 \\
        qwen3-30b-a3b:grouped:4096:w8a8_fp8_block128 --repeats 5 --out ab_gate_up.json

A case is ``PROBLEM:PIPELINE:T:FORMAT`` (a layer-bench case: ``bench.PROBLEMS``,
grouped, indexed, batched or moonep, a format or anchor pair name; MoonEP: its
module's one interleaved w13 against MoonEP's own form, gate and up apart). Each case's routings (the
layer bench's rotated sets) and weights are made once; the two orders are
timed in turn, ``--repeats`` rounds (min, median, max µs), and their outputs
compared (``rel_diff``: the activation rounded once against after w13's
rounding, ~5e-3 in bf16). With ``--stages`` each order's pipeline stages
(``layer_bench.stages``: w13, the activation pass, ...; not MoonEP's own form)
are also timed alone, interleaved with the other order's
(``blocks_stages`` / ``halves_stages``: a stage's min, median and max µs), so
a change in w13's tiles and in the pass after it shows apart. Orders whose layers
launch the same kernels (``same_kernels`` in the row, and on stderr) differ inside
a kernel's parameters at most — or not at all, as when an order made by a patch
never reached a jitted pipeline's cached trace. Prints a row a
case and writes them as JSON after each, so a run stopped by a time limit
keeps the cases done.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import jax
import numpy as np

from humming_jax import bench, layer_bench
from humming_jax import experts as X
from humming_jax import formats as F
from humming_jax.timing import interleaved, kernel_census, write_results

ORDERS = ("blocks", "halves")
PIPELINES = ("grouped", "indexed", "batched", "moonep")


def parse_case(text: str) -> layer_bench.LayerCase:
    """``PROBLEM:PIPELINE:T:FORMAT`` as a layer-bench case."""
    parts = text.split(":")
    if len(parts) != 4 or parts[1] not in PIPELINES or not parts[2].isdigit():
        raise ValueError(f"--cases: expected PROBLEM:{'|'.join(PIPELINES)}:T:FORMAT, got {text!r}")
    if parts[0] not in bench.PROBLEMS:
        raise ValueError(f"--cases: unknown problem {parts[0]!r}; known: {', '.join(bench.PROBLEMS)}")
    return layer_bench.LayerCase(parts[0], parts[1], int(parts[2]), parts[3])


def orders(case: layer_bench.LayerCase, seed: int = 0) -> dict[str, dict]:
    """The state entries of the case's weights in the kernels' order
    (``blocks``) and with w13 in halves (MoonEP: its gate and up apart)."""
    blocks = layer_bench._weights(case, seed)
    if case.pipeline == "moonep":
        halves = F.gate_up_halves(blocks["w13"]).values
        inter = halves.shape[1] // 2
        apart = dict(w_gate=halves[:, :inter], w_up=halves[:, inter:], w_down=blocks["w_down"])
        return {"blocks": blocks, "halves": apart}
    halves = X.ExpertWeights(F.gate_up_halves(blocks.w13), blocks.w2)
    return {"blocks": dict(weights=blocks), "halves": dict(weights=halves)}


def layer_fn(case: layer_bench.LayerCase, order: str):
    """The layer the order runs: the bench's, or MoonEP's own form on its weights apart."""
    backend = bench.KERNEL_BACKEND
    if case.pipeline == "moonep" and order == "halves":
        keys = ("hidden_states", "w_gate", "w_up", "w_down", "cu_seqlens", "route_weights")
        return lambda s: X.moonep_experts(*(s[key] for key in keys), backend=backend)
    return layer_bench._layer_fn(case, backend)


def stage_samplers(case: layer_bench.LayerCase, sets: list[dict]) -> dict[str, object]:
    """``{stage name: sampler}`` of the pipeline's stages, each timed alone on
    the state the earlier stages leave (:func:`layer_bench.stage_inputs`)."""
    staged = layer_bench.stages(case, bench.KERNEL_BACKEND)
    _, befores = layer_bench.stage_inputs(staged, sets)
    pairs = zip(staged, befores, strict=True)
    return {stage.name: bench.sampler(stage.run, [(b,) for b in before]) for stage, before in pairs}


def same_kernels(fns: dict, states: dict) -> list[list[str]]:
    """The pairs of orders whose layers launch the same kernels (:func:`kernel_census`),
    each also said on stderr: they differ inside a kernel's parameters at most — or not
    at all, as when an order's patch never reached a jitted pipeline's cached trace."""
    census = {name: kernel_census(fns[name], states[name]) for name in fns}
    pairs = [[a, b] for a, b in itertools.combinations(census, 2) if census[a] == census[b]]
    for a, b in pairs:
        print(f"ab_gate_up: orders {a!r} and {b!r} launch the same {len(census[a])} kernels", file=sys.stderr)
    return pairs


def _spread(seconds: list[float]) -> list[float]:
    return [round(1e6 * v, 2) for v in (min(seconds), statistics.median(seconds), max(seconds))]


def time_case(case: layer_bench.LayerCase, repeats: int, seed: int = 0, with_stages: bool = False) -> dict:
    """One result row: each order's µs (min, median, max of ``repeats``) and the
    outputs' difference; ``with_stages``: each order's stages too."""
    rng = np.random.default_rng(seed)
    weights = orders(case, seed)
    _, inputs = layer_bench.input_sets(case, rng)
    fns = {name: layer_fn(case, name) for name in ORDERS}
    outs = {name: np.asarray(jax.jit(fns[name])(dict(inputs[0], **w)), np.float64) for name, w in weights.items()}
    diff = np.linalg.norm(outs["blocks"] - outs["halves"]) / max(np.linalg.norm(outs["halves"]), 1e-30)
    same = same_kernels(fns, {name: dict(inputs[0], **w) for name, w in weights.items()})
    samplers = {name: bench.sampler(fns[name], [(dict(s, **w),) for s in inputs]) for name, w in weights.items()}
    if with_stages:
        for name, w in weights.items():
            staged = stage_samplers(case, [dict(s, **w) for s in inputs])
            samplers.update({f"{name}:{stage}": sample for stage, sample in staged.items()})
    w13 = weights["blocks"]["w13"] if case.pipeline == "moonep" else weights["blocks"]["weights"].w13
    samples = interleaved(samplers, repeats)
    row = dict(
        problem=case.problem,
        pipeline=case.pipeline,
        tokens=case.tokens,
        fmt=case.fmt,
        gate_up_block=w13.gate_up_block,
        rel_diff=float(diff),
    )
    if same:
        row["same_kernels"] = same
    for name, seconds in samples.items():
        order, _, stage = name.partition(":")
        if stage:
            row.setdefault(f"{order}_stages", {})[stage] = _spread(seconds)
        else:
            row[name] = _spread(seconds)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", required=True, help="PROBLEM:PIPELINE:T:FORMAT each")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stages", action="store_true", help="also time each order's stages alone (not MoonEP)")
    parser.add_argument("--out", default="benchmarks/results/layer/ab_gate_up.json")
    args = parser.parse_args(argv)
    cases = [parse_case(text) for text in args.cases]
    if args.stages and any(case.pipeline == "moonep" for case in cases):
        raise ValueError("--stages: MoonEP's own form has no stages to match; leave moonep cases out")
    if bench.KERNEL_BACKEND == "pallas" and jax.default_backend() != "gpu":
        print("ab_gate_up: needs a GPU (kernels are timed compiled)", file=sys.stderr)
        return 2
    rows = []
    for case in cases:
        rows.append(time_case(case, args.repeats, with_stages=args.stages))
        print(rows[-1], flush=True)
        write_results(args.out, rows, quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
