"""Soak the expert pipelines: random layers, one after another, for a while,
each checked against the reference on the same weights — what a single test
cannot see (a rare race, a stray store, state left by an earlier call).

    python -m benchmarks.soak --seconds 300 --out soak.json

Each case draws a format pair, a pipeline (grouped or indexed), T in
[0, --max-tokens] (log-uniform past 2), hostile routing (ids outside [0, E), a hot expert, an
``expert_map`` with -1) and a few NaN tokens; it passes when the kernel path
matches the reference (relative error under the pair's bound, NaN exactly on
the NaN tokens' rows). The device's bytes in use are read after each case:
memory must stay flat. On the CPU the kernels run in interpret mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj

# (weight format, input quantization, relative-error bound against the reference)
PAIRS = [
    ("bf16", "none", 2e-2),
    ("int4_g128", "none", 2e-2),
    ("mxfp4", "none", 2e-2),
    ("fp8_block128", "fp8_dynamic_group128", 3e-2),
    ("int8_channel", "int8_dynamic_token", 3e-2),
    ("mxfp4", "fp8_dynamic_group128", 3e-2),
]
E, H, INTER, TOP_K = 8, 256, 128, 2


def _case(rng: np.random.Generator, index: int, max_tokens: int = 300) -> dict:
    fmt, quant, bound = PAIRS[rng.integers(len(PAIRS))]
    tokens = int(rng.choice([0, 1, 2, int(np.exp(rng.uniform(np.log(3), np.log(max_tokens))))]))
    return dict(
        index=index,
        fmt=fmt,
        quant=quant,
        bound=bound,
        pipeline=str(rng.choice(["grouped", "indexed"])),
        tokens=tokens,
        hot=bool(rng.random() < 0.3),
        out_of_range=bool(rng.random() < 0.3),
        expert_map=bool(rng.random() < 0.3),
        nan_tokens=int(min(tokens, rng.integers(0, 3))),
        seed=int(rng.integers(2**31)),
    )


def run_case(case: dict, backend: str) -> dict:
    """The kernel path against the reference on one random layer; the case with its result."""
    rng = np.random.default_rng(case["seed"])
    global_experts = 2 * E if case["expert_map"] else E
    config = hj.ExpertsConfig(
        E, H, INTER, TOP_K, weight_format=case["fmt"], input_quant=case["quant"], global_num_experts=global_experts
    )
    w13 = jnp.asarray(rng.normal(size=(E, 2 * INTER, H)) / np.sqrt(H), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(E, H, INTER)) / np.sqrt(INTER), jnp.float32)
    weights = hj.quantize_experts(w13, w2, config)
    t = case["tokens"]
    x = rng.normal(size=(t, H)).astype(np.float32)
    nan_rows = rng.choice(t, case["nan_tokens"], replace=False) if t else np.zeros(0, int)
    x[nan_rows, 0] = np.nan
    ids = np.array([rng.choice(global_experts, TOP_K, replace=False) for _ in range(t)], np.int64).reshape(t, TOP_K)
    if case["hot"] and t:
        ids[:, 0] = 1
    if case["out_of_range"] and t:
        ids[rng.integers(t), -1] = global_experts + 3
    expert_map = None
    if case["expert_map"]:  # half the global experts live here, the rest are another rank's (-1)
        owned = np.full(global_experts, -1, np.int32)
        owned[rng.choice(global_experts, E, replace=False)] = np.arange(E, dtype=np.int32)
        expert_map = jnp.asarray(owned)
    tw = jnp.asarray(rng.random((t, TOP_K)), jnp.float32)
    fn = hj.humming_grouped_experts if case["pipeline"] == "grouped" else hj.humming_indexed_experts
    args = (jnp.asarray(x, jnp.bfloat16), weights, tw, jnp.asarray(ids, jnp.int32), config, expert_map)
    got = np.asarray(fn(*args, backend=backend), np.float64)
    want = np.asarray(fn(*args, backend="reference"), np.float64)
    nan_row = np.zeros(t, bool)
    nan_row[nan_rows] = True
    finite = ~nan_row
    error = float(np.linalg.norm(got[finite] - want[finite]) / max(np.linalg.norm(want[finite]), 1e-30))
    ok = (
        got.shape == want.shape == (t, H)
        and bool(np.isfinite(got[finite]).all())
        and error < case["bound"]
        and bool((np.isnan(got).any(axis=1) == np.isnan(want).any(axis=1)).all())
    )
    return {**case, "error": error, "ok": bool(ok)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--max-cases", type=int, default=100000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=300, help="the largest T a case draws (GPU: 8192)")
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args(argv)
    backend = "pallas" if jax.default_backend() == "gpu" else "interpret"
    rng = np.random.default_rng(args.seed)
    results, start = [], time.time()
    while len(results) < args.max_cases and (not results or time.time() - start < args.seconds):
        result = run_case(_case(rng, len(results), args.max_tokens), backend)
        result["bytes_in_use"] = _bytes_in_use()
        results.append(result)
        if not result["ok"]:
            print("FAILED", json.dumps(result), flush=True)
    failed = sum(not r["ok"] for r in results)
    memory = [r["bytes_in_use"] for r in results if r["bytes_in_use"] is not None]
    print(f"soak: {len(results)} cases in {time.time() - start:.0f} s on {backend}, {failed} failed", flush=True)
    if memory:
        print(f"device bytes in use after a case: first {memory[0]}, last {memory[-1]}, max {max(memory)}", flush=True)
    summary = {"backend": backend, "seconds": time.time() - start, "failed": failed, "max_tokens": args.max_tokens}
    with open(args.out, "w") as f:
        json.dump({**summary, "cases": results}, f, indent=1)
    return 1 if failed else 0


def _bytes_in_use() -> int | None:
    """The device allocator's bytes in use (None where the backend keeps no count)."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))


if __name__ == "__main__":
    sys.exit(main())
