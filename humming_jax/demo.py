"""The main job: a small Qwen3-like MoE layer through every expert pipeline on
the default backend, checked against float math.

Each Humming pipeline runs int4 group-128 weights; MoonEP runs the same
weights in bf16 (it is BF16-only). Two errors are printed per pipeline:
against the unquantized float32 computation (the quantization error shows
here; int4 g128 on normal weights gives about 0.2 for the layer), and against float64 math
on the dequantized weights (what the pipeline must match to bf16 precision).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj
from humming_jax import routing
from humming_jax.activations import apply_activation
from humming_jax.backend import resolve_backend

# Bounds. int4 g128 rounding error is uniform in ±s/2 with s = amax/7; amax of
# 128 normal weights stays below ~3.6 sigma, so one GEMM's relative RMS error
# is at most 3.6/7/sqrt(12) = 0.15. The layer holds three such errors in
# series (gate, up, down): sqrt(3) * 0.15 = 0.26, rounded up to 0.3.
# bf16 paths land between 1e-3 and 1e-2 against exact math.
QUANTIZED_VS_FLOAT_BOUND = 0.3
BF16_BOUND = 2e-2


@dataclasses.dataclass(frozen=True)
class DemoProblem:
    num_experts: int = 16
    hidden: int = 256
    intermediate: int = 128
    top_k: int = 4
    num_tokens: int = 64
    weight_format: str = "int4_g128"
    seed: int = 0


@dataclasses.dataclass
class DemoRow:
    pipeline: str
    backend: str
    error_vs_float: float
    error_vs_dequantized: float
    seconds: float
    bound_vs_float: float

    @property
    def passed(self) -> bool:
        return self.error_vs_float <= self.bound_vs_float and self.error_vs_dequantized <= BF16_BOUND


def _relative_error(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _float_moe(x, w13, w2, topk_weights, topk_ids, activation) -> np.ndarray:
    """Per-token float64 expert math: ``sum_j w_tj * act(x_t W13[e]^T) W2[e]^T``."""
    x, w13, w2 = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, w13, w2))
    ids, weights = np.asarray(topk_ids), np.asarray(topk_weights, np.float64)
    gate_up = np.einsum("tk,tjnk->tjn", x, w13[ids])
    act = np.asarray(apply_activation(jnp.asarray(gate_up, jnp.float32), activation), np.float64)
    down = np.einsum("tji,tjhi->tjh", act, w2[ids])
    return np.einsum("tj,tjh->th", weights, down)


def _timed(fn, *args, repeats: int = 5):
    out = jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, float(np.median(times))


def _quiet(message: str) -> None:
    del message


def run_demo(
    problem: DemoProblem = DemoProblem(), backend: str | None = None, progress: Callable[[str], None] = _quiet
) -> list[DemoRow]:
    """Every pipeline on ``problem``, checked; ``progress`` gets a line before
    each step (compiling a pipeline takes seconds, tens in interpret mode)."""
    e, h, i, k, t = problem.num_experts, problem.hidden, problem.intermediate, problem.top_k, problem.num_tokens
    keys = jax.random.split(jax.random.key(problem.seed), 4)
    x = jax.random.normal(keys[0], (t, h), jnp.float32).astype(jnp.bfloat16)
    w13 = jax.random.normal(keys[1], (e, 2 * i, h), jnp.float32) / np.sqrt(h)
    w2 = jax.random.normal(keys[2], (e, h, i), jnp.float32) / np.sqrt(i)
    topk_weights, topk_ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(keys[3], (t, e))), k)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdims=True)

    config = hj.ExpertsConfig(e, h, i, k, weight_format=problem.weight_format)
    weights = hj.quantize_experts(w13, w2, config)
    ref_float = _float_moe(x, w13, w2, topk_weights, topk_ids, config.activation)
    ref_dequant = _float_moe(
        x,
        hj.dequantize_weight(weights.w13),
        hj.dequantize_weight(weights.w2),
        topk_weights,
        topk_ids,
        config.activation,
    )
    gemm_backend = resolve_backend(backend, "gemm")
    rows = []
    progress(f"compiling and timing the grouped pipeline ({gemm_backend})")

    out, seconds = _timed(
        lambda *a: hj.humming_grouped_experts(*a, config, backend=backend), x, weights, topk_weights, topk_ids
    )
    rows.append(
        DemoRow(
            "humming_grouped",
            gemm_backend,
            _relative_error(out, ref_float),
            _relative_error(out, ref_dequant),
            seconds,
            QUANTIZED_VS_FLOAT_BOUND,
        )
    )

    progress("the indexed pipeline")
    out, seconds = _timed(
        lambda *a: hj.humming_indexed_experts(*a, config, backend=backend), x, weights, topk_weights, topk_ids
    )
    rows.append(
        DemoRow(
            "humming_indexed",
            gemm_backend,
            _relative_error(out, ref_float),
            _relative_error(out, ref_dequant),
            seconds,
            QUANTIZED_VS_FLOAT_BOUND,
        )
    )

    # Batched: dispatch tokens into [E, max_tokens, H]; the caller does the top-k reduce.
    progress("the batched pipeline")
    offsets, scatter_idx = routing.moe_prepare_scatter(topk_ids, e)
    expert_num_tokens = offsets[1:] - offsets[:-1]
    position = scatter_idx - offsets[topk_ids]  # row of each slot inside its expert
    batched_in = jnp.zeros((e, t, h), x.dtype).at[topk_ids, position].set(jnp.broadcast_to(x[:, None], (t, k, h)))
    batched_out, seconds = _timed(
        lambda *a: hj.batched_humming_grouped_experts(*a, config, backend=backend),
        batched_in,
        expert_num_tokens,
        weights,
    )
    out = jnp.einsum("tj,tjh->th", topk_weights, batched_out[topk_ids, position].astype(jnp.float32))
    rows.append(
        DemoRow(
            "batched_humming_grouped",
            gemm_backend,
            _relative_error(out, ref_float),
            _relative_error(out, ref_dequant),
            seconds,
            QUANTIZED_VS_FLOAT_BOUND,
        )
    )

    # MoonEP: segment-ordered rows (one segment per expert, plus B=2 empty
    # redundant rows), bf16 weights; reduced back to tokens for the check.
    redundant = 2
    progress("the MoonEP experts")
    permuted = routing.moe_permute(x, topk_ids, e)
    route_weights = topk_weights.reshape(-1)[permuted.permuted_idx]
    cu_seqlens = jnp.concatenate([offsets[1:], jnp.full(redundant, offsets[-1])])
    pad = lambda w: jnp.concatenate([w, w[:redundant]]).astype(jnp.bfloat16)  # noqa: E731
    moon_out, seconds = _timed(
        lambda *a: hj.moonep_experts(*a, backend=backend),
        permuted.permuted_hidden_states,
        pad(w13[:, :i]),
        pad(w13[:, i:]),
        pad(w2),
        cu_seqlens,
        route_weights,
    )
    out = hj.moe_unpermute(moon_out, jnp.ones_like(topk_weights), permuted.inv_permuted_idx, offsets)
    bf16_ref = _float_moe(
        x, w13.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), topk_weights, topk_ids, config.activation
    )
    rows.append(
        DemoRow(
            "moonep", gemm_backend, _relative_error(out, ref_float), _relative_error(out, bf16_ref), seconds, BF16_BOUND
        )
    )
    return rows


def format_table(rows: list[DemoRow], problem: DemoProblem) -> str:
    lines = [
        f"MoE layer: E={problem.num_experts} H={problem.hidden} I={problem.intermediate} "
        f"top_k={problem.top_k} T={problem.num_tokens}, weights {problem.weight_format} (MoonEP: bf16), "
        f"device {jax.devices()[0].platform}",
        f"{'pipeline':<26}{'backend':<11}{'err vs float32':>16}{'err vs dequant':>16}{'time':>11}  check",
    ]
    for row in rows:
        lines.append(
            f"{row.pipeline:<26}{row.backend:<11}{row.error_vs_float:>16.3e}{row.error_vs_dequantized:>16.3e}"
            f"{row.seconds * 1e3:>9.2f}ms  {'PASS' if row.passed else 'FAIL'}"
        )
    return "\n".join(lines)


def workspace_line(problem: DemoProblem) -> str:
    """The static workspace plan of the layer (what vLLM would allocate)."""
    config = hj.ExpertsConfig(
        problem.num_experts, problem.hidden, problem.intermediate, problem.top_k, weight_format=problem.weight_format
    )
    peaks = {
        p: hj.plan_workspace(
            config, problem.num_tokens, problem.top_k, p, max_num_tokens=problem.num_tokens, num_dispatchers=1
        ).peak_bytes
        for p in ("grouped", "indexed", "batched")
    }
    return "workspace peak bytes: " + ", ".join(f"{p} {b:,}" for p, b in peaks.items())


def main(argv: list[str] | None = None) -> int:
    problem = DemoProblem()
    print(f"quantizing a {problem.weight_format} layer ({jax.devices()[0].platform})", flush=True)
    rows = run_demo(problem, progress=lambda line: print(f"  {line}…", flush=True))
    print(format_table(rows, problem))
    print(workspace_line(problem))
    failed = [row.pipeline for row in rows if not row.passed]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("all pipelines match the reference")
    return 0
