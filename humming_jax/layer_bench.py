"""The whole expert layer timed: ``python -m humming_jax bench --layer``.

Per (problem, pipeline, format, T): the jitted pipeline's device time, each
of its stages' (:func:`humming_jax.experts.grouped_stages` /
``indexed_stages``: routing, input quantization + scatter, w13, activation +
quantization, w2, combine; ``batched_stages``: input quantization, w13,
activation + quantization, w2 — the rows already gathered an expert, the
reduce the caller's; ``moonep_stages``: w13 — gate and up as the MoonEP module holds them, one GEMM —,
activation, w2, bf16 only; ``parallel.ep_stages``: dispatch, experts,
combine — the same functions the pipeline runs, each timed on the state the
previous ones left; EP rows add the ranks' loads without and with copies), the share of the stages outside the two
GEMMs (and, on a GPU, of the layer outside its GEMM kernels, from a kernel trace: a stage timed alone carries a
launch of its own), the host time of one call above its device time (waited for; its
enqueue alone; a call's share of calls issued back to back), and, in the same
process when torch is importable on a GPU, a bf16 PyTorch layer
(``torch._grouped_mm``, permute and unpermute with torch ops; for the
batched and MoonEP layouts, whose rows come grouped, its GEMMs and
activation alone). Inputs rotate
over several routings (so the experts a decode step reads are not the previous
step's, left in L2); the weights are one set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from humming_jax import bench, bench_report, parallel
from humming_jax import experts as X
from humming_jax.configs import ExpertsConfig
from humming_jax.timing import bandwidth_fields, event_sampler, traced_kernels

# batched: the grouped-masked layout (each expert's rows gathered by the caller, reduced by the
# caller); moonep: MoonEP's segment order (bf16); ep: parallel.ep_experts over this machine's
# devices; ep_balanced: with EP_REDUNDANT copies a rank.
PIPELINES = ("grouped", "indexed", "batched", "moonep", "ep", "ep_balanced")
LOCAL_PIPELINES = ("grouped", "indexed", "batched", "moonep")
# Pipelines whose input arrives with each expert's rows together (T·k rows in and out).
GATHERED_PIPELINES = ("batched", "moonep")
EP_REDUNDANT = 2
# bf16, W4A16 int4 and MXFP4, W8A8 FP8-block and W4A8 (the anchor's pair names).
LAYER_FORMATS = ("bf16", "int4_g128", "mxfp4", "w8a8_fp8_block128", "w4a8_mxfp4_fp8g128")
GEMM_STAGES = ("w13", "w2")
GEMM_KERNELS = "moe_gemm"  # the names the GEMM kernels launch under (Triton's and Mosaic's)
INPUT_SETS = 4  # routings rotated per timing
REFERENCE_MAX_BYTES = 2**32  # f32 bytes of a dequantized weight past which the error is not checked
HOST_CALLS = 30
# NVLink 4's peak in one direction for an H100 / H200 SXM GPU (its data sheet): what an EP
# rank's exchange is held to (its dispatch and combine send and receive at once).
LINK_GBPS = 450.0


def default_pipelines() -> tuple[str, ...]:
    """Every pipeline where there are devices to spread the experts over; on
    one device the expert-parallel ones run the local layer again (one rank,
    its exchange a no-op): the local layers only."""
    return PIPELINES if jax.device_count() > 1 else LOCAL_PIPELINES


@dataclasses.dataclass(frozen=True)
class LayerCase:
    problem: str  # a key of bench.PROBLEMS: (E, H, I, top_k)
    pipeline: str  # one of PIPELINES
    tokens: int
    fmt: str  # a weight format, WEIGHT@INPUT or an anchor pair name (bench.split_format)

    def config(self) -> ExpertsConfig:
        e, h, i, top_k = bench.PROBLEMS[self.problem]
        fmt, quant = bench.split_format(self.fmt)
        return ExpertsConfig(e, h, i, top_k, weight_format=fmt, input_quant=quant)


def ep_mesh(case: LayerCase) -> jax.sharding.Mesh:
    """The expert axis over as many of this machine's devices as divide the
    experts and the tokens (one GPU: one rank, dispatch and combine local)."""
    e = bench.PROBLEMS[case.problem][0]
    ranks = max(r for r in range(1, jax.device_count() + 1) if e % r == 0 and case.tokens % r == 0)
    return jax.make_mesh((ranks,), ("expert",), devices=jax.devices()[:ranks])


def _sent_bytes(case: LayerCase, ranks: int) -> int:
    """Bytes a rank sends in one EP step: its routed rows (quantized before the
    send where their scales are per row) with their ids, and the rows it
    returns (bf16), at the average load (S·k rows each way)."""
    config = case.config()
    slots = case.tokens // ranks * config.top_k
    quant = config.input_quant
    if parallel.sends_quantized(config):
        groups = 1 if quant.group_size == 0 else config.hidden_size // quant.group_size
        row = config.hidden_size * quant.dtype.bits // 8 + 4 * groups
    else:
        row = 2 * config.hidden_size
    return slots * (row + 4 + 2 * config.hidden_size)


def stages(case: LayerCase, backend: str | None, weights: X.ExpertWeights | None = None) -> tuple[X.Stage, ...]:
    """The pipeline's stages (``ep``: dispatch, experts, combine; needs the weights)."""
    config = case.config()
    if case.pipeline.startswith("ep"):
        mesh = ep_mesh(case)
        return parallel.ep_stages(
            config, mesh, weights, case.tokens, redundant_experts=_redundant(case), backend=backend
        )
    if case.pipeline == "grouped":
        return X.grouped_stages(config, backend)
    if case.pipeline == "indexed":
        return X.indexed_stages(config, backend=backend)
    if case.pipeline == "batched":
        return X.batched_stages(config, backend, batched_valid_shape_m(case))
    if case.pipeline == "moonep":
        return X.moonep_stages(backend=backend)
    raise ValueError(f"pipeline: expected one of {PIPELINES}, got {case.pipeline!r}")


def batched_valid_shape_m(case: LayerCase) -> int:
    """The rows a batched case's GEMMs are tiled for: the routing's estimate,
    as vLLM's batched experts pass it (the buffer's rows are its worst case)."""
    config = case.config()
    return X.estimate_valid_shape_m(case.tokens, config.top_k, config)


def _weights(case: LayerCase, seed: int) -> X.ExpertWeights | dict:
    """Random weights in the case's formats and the kernels' order (as
    :func:`humming_jax.experts.quantize_experts` gives them), drawn a few
    experts at a time (bench's ``_random_weight``); MoonEP's: its bf16
    ``w_gate``, ``w_up`` ``[E, I, H]`` as the module holds them (one ``w13``:
    ``experts.moonep_w13``) and ``w_down`` ``[E, H, I]``."""
    config = case.config()
    key = jax.random.key(seed)
    if case.pipeline == "moonep":
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        shapes = dict(w_gate=(e, i, h), w_up=(e, i, h), w_down=(e, h, i))
        drawn = {
            name: bench.random_bf16(jax.random.fold_in(key, n), shape, 0.02)
            for n, (name, shape) in enumerate(shapes.items())
        }
        return dict(w13=X.moonep_w13(drawn["w_gate"], drawn["w_up"]), w_down=drawn["w_down"])
    w13 = bench._random_weight(jax.random.fold_in(key, 13), config.weight_format, *_shape(config, "w13"))
    w2 = bench._random_weight(jax.random.fold_in(key, 2), config.w2_weight_format, *_shape(config, "w2"))
    return X.to_kernel_order(X.ExpertWeights(w13, w2), config)


def _shape(config: ExpertsConfig, name: str) -> tuple[int, int, int]:
    layer = getattr(config, name)
    return layer.num_experts, layer.shape_n, layer.shape_k


def _routing(case: LayerCase, rng: np.random.Generator) -> dict:
    """One routing: ``hidden [T, H]`` float32, ``ids [T, k]``, ``topk_weights``
    (each row sums to 1)."""
    e, h, _, top_k = bench.PROBLEMS[case.problem]
    ids = bench._routing(rng, case.tokens, e, top_k)
    weights = rng.random((case.tokens, top_k)).astype(np.float32) + 0.1
    hidden = rng.normal(size=(case.tokens, h)).astype(np.float32)
    return dict(hidden=hidden, ids=ids, topk_weights=weights / weights.sum(axis=1, keepdims=True))


def _expert_order(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(the slots ``[T·k]`` sorted by expert, stable; each expert's count ``[E]``)."""
    flat = ids.reshape(-1)
    return np.argsort(flat, kind="stable"), np.bincount(flat, minlength=num_experts)


def batched_capacity(routings: list[dict], num_experts: int) -> int:
    """Rows an expert's buffer holds in a batched case: the largest count over
    the case's routings, rounded up as the GEMM bench's masked cases are
    (:func:`humming_jax.bench.masked_capacity`)."""
    return max(bench.masked_capacity(r["ids"], num_experts) for r in routings)


def _inputs(case: LayerCase, routing: dict, capacity: int = 0) -> dict:
    """The pipeline's state for one routing (its weights added by the caller):
    tokens with their routing (grouped, indexed, EP); each expert's rows in a
    ``[E, capacity, H]`` buffer, NaN past its count (batched); the rows in
    expert order with their segment ends and router weights (MoonEP)."""
    e, _, _, top_k = bench.PROBLEMS[case.problem]
    hidden = routing["hidden"]
    if case.pipeline not in GATHERED_PIPELINES:
        return dict(
            hidden_states=jnp.asarray(hidden, jnp.bfloat16),
            topk_ids=jnp.asarray(routing["ids"]),
            topk_weights=jnp.asarray(routing["topk_weights"]),
            expert_map=None,
            a1q_scale=None,
            num_valid_tokens=None,
        )
    order, counts = _expert_order(routing["ids"], e)
    rows = hidden[order // top_k]
    if case.pipeline == "moonep":
        return dict(
            hidden_states=jnp.asarray(rows, jnp.bfloat16),
            cu_seqlens=jnp.asarray(np.cumsum(counts), jnp.int32),
            route_weights=jnp.asarray(routing["topk_weights"].reshape(-1)[order]),
        )
    experts = routing["ids"].reshape(-1)[order]
    starts = np.cumsum(counts) - counts
    buffer = np.full((e, capacity, hidden.shape[1]), np.nan, np.float32)
    buffer[experts, np.arange(len(order)) - starts[experts]] = rows
    return dict(
        hidden_states=jnp.asarray(buffer, jnp.bfloat16),
        expert_num_tokens=jnp.asarray(counts, jnp.int32),
        a1q_scale=None,
    )


def input_sets(case: LayerCase, rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    """:data:`INPUT_SETS` routings (:func:`_routing`) and the pipeline's state
    for each (:func:`_inputs`, the weights not yet added)."""
    routings = [_routing(case, rng) for _ in range(INPUT_SETS)]
    capacity = batched_capacity(routings, case.config().num_experts) if case.pipeline == "batched" else 0
    return routings, [_inputs(case, routing, capacity) for routing in routings]


def _costs(case: LayerCase, ids: np.ndarray) -> tuple[int, int]:
    """(bytes the layer must move: the weights of the experts that get rows,
    the input and the output; flops of the two GEMMs) on the real rows."""
    config = case.config()
    hit = len(np.unique(ids))
    moved = 0
    flops = 0
    rows = case.tokens * config.top_k
    for name, fmt in (("w13", config.weight_format), ("w2", config.w2_weight_format)):
        e, n, k = _shape(config, name)
        moved += hit * bench._weight_bytes(fmt, n, k)
        flops += 2 * rows * n * k
    moved += 2 * 2 * (rows if case.pipeline in GATHERED_PIPELINES else case.tokens) * config.hidden_size  # bf16 in, out
    return moved, flops


def _layer_fn(case: LayerCase, backend: str | None):
    """The jitted pipeline as users call it: ``fn(state) -> [T, H]``."""
    config = case.config()
    if case.pipeline.startswith("ep"):
        pipeline = functools.partial(parallel.ep_experts, mesh=ep_mesh(case), redundant_experts=_redundant(case))
    elif case.pipeline == "batched":
        valid_m = batched_valid_shape_m(case)
        return lambda s: X.batched_humming_grouped_experts(
            s["hidden_states"], s["expert_num_tokens"], s["weights"], config, backend=backend, valid_shape_m=valid_m
        )
    elif case.pipeline == "moonep":
        return lambda s: X.moonep_interleaved_experts(
            s["hidden_states"],
            s["w13"],
            s["w_down"],
            s["cu_seqlens"],
            s["route_weights"],
            backend=backend,
        )
    elif case.pipeline == "grouped":
        pipeline = X.humming_grouped_experts
    else:
        pipeline = X.humming_indexed_experts

    def fn(state):
        return pipeline(
            state["hidden_states"],
            state["weights"],
            state["topk_weights"],
            state["topk_ids"],
            config,
            backend=backend,
        )

    return fn


def _traced_fields(case: LayerCase, fn, sets) -> dict:
    """From a kernel trace of the layer (a GPU, one device): the GEMM kernels'
    own time inside it (``gemm_kernel_us``), every kernel's
    (``kernel_us``), the time some kernel ran (``busy_us``: less where
    events overlap) and first start to last end (``span_us``: with the
    gaps), each a call; the share of the traced span outside the GEMM
    kernels (not of the stages, each timed alone with a launch of its own;
    not of the chained layer's time: the trace runs in a burst, which near
    the power limit runs faster than a sustained chain), and the trace's
    longest kernels (``traced_kernels``: thread, name, launches and µs a
    call). None elsewhere."""
    names = ("gemm_kernel_us", "kernel_us", "busy_us", "span_us", "traced_outside_share", "traced_kernels")
    traced = None
    if jax.default_backend() == "gpu" and not case.pipeline.startswith("ep"):
        traced = traced_kernels(fn, [(s,) for s in sets], (GEMM_KERNELS,))
    if traced is None:
        return dict.fromkeys(names)
    us = {key: value * 1e6 for key, value in traced.seconds.items()}
    share = 1.0 - us[GEMM_KERNELS] / us["span"] if us[GEMM_KERNELS] > 0 and us["span"] > 0 else None
    figures = (us[GEMM_KERNELS], us["all"], us["busy"], us["span"], share, traced.table)
    return dict(zip(names, figures, strict=True))


def _outside(r: dict) -> float | None:
    """The share outside the GEMMs: by the kernel trace where there is one, else by the stages."""
    traced = r.get("traced_outside_share")
    return traced if traced is not None else r["outside_share"]


def _host_times(fn, state, device_us: float) -> dict:
    """Host costs of the jitted layer, µs: ``host_us`` — one call waited for,
    less its device time (a step that syncs every call); ``dispatch_us`` — the
    call's return without waiting (the host's enqueue, hidden behind the device
    when shorter); ``pipelined_us`` — wall time a call of ``HOST_CALLS`` issued
    back to back (what a decode loop that does not sync pays a step)."""
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(state))
    waited, returned = [], []
    for _ in range(HOST_CALLS):
        start = time.perf_counter()
        out = jitted(state)
        returned.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        waited.append(time.perf_counter() - start)
    start = time.perf_counter()
    outs = [jitted(state) for _ in range(HOST_CALLS)]
    jax.block_until_ready(outs)
    pipelined = (time.perf_counter() - start) / HOST_CALLS
    return dict(
        host_us=statistics.median(waited) * 1e6 - device_us,
        dispatch_us=statistics.median(returned) * 1e6,
        pipelined_us=pipelined * 1e6,
    )


def _reference_error(case: LayerCase, state: dict, out: jax.Array) -> float | None:
    """‖out − ref‖/‖ref‖ against the pipeline on the reference backend (f32
    ``jnp``), or None where the dequantized weights would not fit."""
    config = case.config()
    largest = max(math.prod(_shape(config, name)) for name in GEMM_STAGES)
    if 4 * largest > REFERENCE_MAX_BYTES:
        return None
    ref = np.asarray(jax.jit(_layer_fn(case, "reference"))(state), np.float64)
    got = np.asarray(out, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def stage_inputs(staged: tuple[X.Stage, ...], sets: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """Each input set's final state and, for each stage, the states it starts
    from: the final state's entries the earlier stages had (stages only add
    entries), so one compiled run of them all gives every stage's input."""
    finals = [jax.jit(functools.partial(X.run_stages, staged))(s) for s in sets]
    befores, keys = [], list(sets[0])
    for stage in staged:
        befores.append([{key: final[key] for key in keys} for final in finals])
        keys += list(jax.eval_shape(stage.run, befores[-1][0]))
    return finals, befores


def time_layer(case: LayerCase, seed: int = 0, with_stages: bool = True) -> dict:
    """One result row (see the module docstring); times in µs. Without
    ``with_stages`` the stages are not timed (three compilations a case
    instead of nine)."""
    backend = bench.KERNEL_BACKEND
    rng = np.random.default_rng(seed)
    weights = _weights(case, seed)
    if case.pipeline.startswith("ep"):
        weights = parallel.shard_weights(weights, case.config(), ep_mesh(case))
    routings, inputs = input_sets(case, rng)
    held = weights if case.pipeline == "moonep" else dict(weights=weights)
    sets = [dict(state, **held) for state in inputs]
    ids = routings[0]["ids"]
    capacity = inputs[0]["hidden_states"].shape[1] if case.pipeline == "batched" else None
    moved, flops = _costs(case, ids)
    fn = _layer_fn(case, backend)
    layer_s = bench.device_seconds(fn, [(s,) for s in sets])
    staged = stages(case, backend, weights) if with_stages else ()
    finals, befores = stage_inputs(staged, sets) if staged else ([], [])
    stage_us = {
        stage.name: bench.device_seconds(stage.run, [(b,) for b in before]) * 1e6
        for stage, before in zip(staged, befores, strict=True)
    }
    out = finals[0]["out"] if staged else jax.jit(fn)(sets[0])
    gemm_us = sum(stage_us[name] for name in GEMM_STAGES) if set(GEMM_STAGES) <= set(stage_us) else None
    staged_us = sum(stage_us.values())
    floor = max(moved / bench.COPY_BANDWIDTH, flops / bench.MATMUL_RATE)
    return dict(
        **dataclasses.asdict(case),
        **bandwidth_fields(layer_s, moved),
        tflops=flops / layer_s / 1e12,
        roofline_fraction=floor / layer_s,
        flops=flops,
        stage_us=stage_us,
        gemm_us=gemm_us,
        outside_share=None if gemm_us is None else 1.0 - gemm_us / staged_us,
        **(_ep_fields(case, ids, stage_us) if case.pipeline.startswith("ep") else {}),
        **({"batched_capacity": capacity} if case.pipeline == "batched" else {}),
        **_traced_fields(case, fn, sets),
        **_host_times(fn, sets[0], layer_s * 1e6),
        torch_layer_us=time_torch_layer(case, ids),
        error=_reference_error(case, sets[0], out),
    )


def _redundant(case: LayerCase) -> int:
    return EP_REDUNDANT if case.pipeline == "ep_balanced" else 0


def _ep_fields(case: LayerCase, ids: np.ndarray, stage_us: dict) -> dict:
    """Ranks, bytes a rank sends, and the slots each rank serves on the timed
    routing without copies (``loads``) and with the case's copies
    (``balanced_loads``, :func:`parallel.balance_plan`); with the stages
    timed, the exchange's bandwidth: the bytes that leave a rank for the
    others (``link_bytes_per_rank``: its sent bytes times (R - 1) / R, the
    even routing's share) over the dispatch and combine time
    (``exchange_gbps``), and that against :data:`LINK_GBPS`
    (``link_fraction``; one rank: nothing crosses a link)."""
    ranks = ep_mesh(case).shape["expert"]
    e = bench.PROBLEMS[case.problem][0]
    flat = ids.reshape(-1)
    counts = np.bincount(flat[(flat >= 0) & (flat < e)], minlength=e)
    loads = parallel.rank_loads(counts, ranks)
    balanced = loads
    if _redundant(case):
        balanced = parallel.rank_loads(
            counts, ranks, *parallel.balance_plan(jnp.asarray(counts), ranks, _redundant(case))
        )
    sent = _sent_bytes(case, ranks)
    link_bytes = sent * (ranks - 1) // ranks
    exchange_us = stage_us.get("dispatch", 0.0) + stage_us.get("combine", 0.0)
    gbps = link_bytes / exchange_us / 1e3 if exchange_us > 0 and link_bytes else None
    return dict(
        ranks=ranks,
        redundant=_redundant(case),
        sent_bytes_per_rank=sent,
        link_bytes_per_rank=link_bytes,
        exchange_gbps=gbps,
        link_fraction=None if gbps is None else gbps / LINK_GBPS,
        loads=np.asarray(loads).tolist(),
        balanced_loads=np.asarray(balanced).tolist(),
    )


def time_torch_layer(case: LayerCase, ids: np.ndarray) -> float | None:
    """Median µs of a bf16 PyTorch layer on the same routing (sort the routed
    rows by expert, ``torch._grouped_mm`` w13, SiLU-and-mul, w2, weighted
    scatter-add back to the tokens; for the batched and MoonEP layouts, whose
    rows arrive grouped, the GEMMs and the activation alone — MoonEP's as its
    PyTorch original runs them), or None without torch on a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return None
    try:
        us = _torch_layer_us(torch, case, ids)
    except torch.OutOfMemoryError:  # its bf16 weights beside JAX's pool: the column stays empty, said so
        print(f"{case.problem} T={case.tokens}: torch's bf16 layer does not fit beside JAX's arrays", flush=True)
        us = None
    torch.cuda.empty_cache()  # torch's cached blocks would leave JAX short on the largest problems
    return us


def _torch_layer_us(torch, case: LayerCase, ids: np.ndarray) -> float:
    e, h, i, top_k = bench.PROBLEMS[case.problem]
    flat = torch.tensor(ids.reshape(-1), dtype=torch.int64, device="cuda")
    route = torch.rand(case.tokens * top_k, dtype=torch.float32, device="cuda")
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    if case.pipeline == "moonep":
        # MoonEP's PyTorch original: gate and up apart, the route weight applied with the activation.
        w_gate, w_up = (torch.randn(e, i, h, dtype=torch.bfloat16, device="cuda").transpose(1, 2) for _ in range(2))
    else:
        w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device="cuda").transpose(1, 2)

    def experts(rows, offs):
        if case.pipeline == "moonep":
            gate = torch._grouped_mm(rows, w_gate, offs=offs)
            up = torch._grouped_mm(rows, w_up, offs=offs)
            return torch._grouped_mm(torch.nn.functional.silu(gate) * up * route[:, None].to(rows.dtype), w2, offs=offs)
        gate_up = torch._grouped_mm(rows, w13, offs=offs)
        return torch._grouped_mm(torch.nn.functional.silu(gate_up[:, :i]) * gate_up[:, i:], w2, offs=offs)

    if case.pipeline in GATHERED_PIPELINES:
        # The rows arrive grouped, their segment ends known: the GEMMs and the activation alone.
        rows = torch.randn(len(flat), h, dtype=torch.bfloat16, device="cuda")
        offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
        layer = functools.partial(experts, rows, offs)
    else:
        x = torch.randn(case.tokens, h, dtype=torch.bfloat16, device="cuda")

        def layer():
            order = torch.argsort(flat)
            offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
            token = order // top_k
            down = experts(x[token], offs).float() * route[order, None]
            out = torch.zeros(case.tokens, h, dtype=torch.float32, device="cuda")
            return out.index_add_(0, token, down).to(torch.bfloat16)

    # Timed as the GEMM bench times its peers: a burst from idle runs at clocks a sustained load does not keep.
    return 1e6 * event_sampler(lambda _: layer(), 1, capture=False)(5)  # bincount reads a size back


HEADER = (
    f"{'problem':<15}{'pipeline':<9}{'T':>6}{'format':>20}{'us':>10}{'GB/s':>7}{'TFLOP/s':>9}"
    f"{'gemms us':>10}{'outside':>8}{'host us':>9}{'enqueue':>9}{'piped us':>9}{'torch us':>10}{'error':>9}"
)


def format_row(r: dict) -> str:
    torch_us = "" if r["torch_layer_us"] is None else f"{r['torch_layer_us']:.1f}"
    error = "" if r["error"] is None else f"{r['error']:.1e}"
    stage_text = " ".join(f"{name}={us:.1f}" for name, us in r["stage_us"].items())
    if r["pipeline"].startswith("ep"):
        stage_text += " " + (
            f"ranks={r['ranks']} B={r['redundant']} sent={r['sent_bytes_per_rank']} B/rank "
            + (f"link={r['exchange_gbps']:.0f} GB/s ({100 * r['link_fraction']:.0f}%) " if r["exchange_gbps"] else "")
            + f"loads={r['loads']} balanced={r['balanced_loads']}"
        )
    if r.get("traced_outside_share") is not None:
        stage_text += (
            f" traced: gemm kernels={r['gemm_kernel_us']:.1f} all kernels={r['kernel_us']:.1f}"
            f" busy={r['busy_us']:.1f} span={r['span_us']:.1f} outside={100 * r['traced_outside_share']:.0f}%"
        )
    gemm = "" if r["gemm_us"] is None else f"{r['gemm_us']:.1f}"
    outside = "" if r["outside_share"] is None else f"{100 * r['outside_share']:.0f}%"
    return (
        f"{r['problem']:<15}{r['pipeline']:<9}{r['tokens']:>6}{r['fmt']:>20}{r['us']:>10.1f}{r['gbps']:>7.0f}"
        f"{r['tflops']:>9.1f}{gemm:>10}{outside:>8}{r['host_us']:>9.1f}{r.get('dispatch_us', float('nan')):>9.1f}"
        f"{r.get('pipelined_us', float('nan')):>9.1f}"
        f"{torch_us:>10}{error:>9}  [{stage_text}]"
    )


def run_layers(problems, tokens, formats, pipelines=None, on_row=None, with_stages: bool = True) -> list[dict]:
    """Every case that the format's shapes allow; ``on_row(rows)`` after each;
    ``pipelines`` None: :func:`default_pipelines`."""
    pipelines = pipelines or default_pipelines()
    rows = []
    for problem in problems:
        for t in tokens:
            for fmt in formats:
                for pipeline in pipelines:
                    case = LayerCase(problem, pipeline, t, fmt)
                    if pipeline == "moonep" and fmt != "bf16":
                        print(f"{problem} {fmt}: moonep skipped (MoonEP's experts are bf16 only)", flush=True)
                        continue
                    try:
                        case.config()
                        for name in GEMM_STAGES:
                            _, n, k = _shape(case.config(), name)
                            weight_format, quant = bench.split_format(fmt)
                            weight_format.check_shape(n, k)
                            quant.check_k(k)
                    except ValueError as reason:
                        print(f"{problem} {fmt}: skipped ({reason})", flush=True)
                        continue
                    rows.append(time_layer(case, with_stages=with_stages))
                    print(format_row(rows[-1]), flush=True)
                    if on_row is not None:
                        on_row(rows)
    return rows


def plot(rows: list[dict], path: str) -> bool:
    """Layer time and the share outside the GEMMs against T, one panel per
    problem (PNG); False without matplotlib or without rows."""
    plt = bench_report.pyplot()
    if plt is None or not rows:
        return False
    problems = sorted({r["problem"] for r in rows})
    fig, axes = plt.subplots(2, len(problems), figsize=(5 * len(problems), 8), squeeze=False)
    for col, problem in enumerate(problems):
        mine = [r for r in rows if r["problem"] == problem]
        for key in sorted({(r["pipeline"], r["fmt"]) for r in mine}):
            line = sorted((r for r in mine if (r["pipeline"], r["fmt"]) == key), key=lambda r: r["tokens"])
            ts = [r["tokens"] for r in line]
            axes[0][col].plot(ts, [r["us"] for r in line], marker="o", label=f"{key[0]} {key[1]}")
            shares = [(r["tokens"], 100 * _outside(r)) for r in line if _outside(r) is not None]
            if shares:
                axes[1][col].plot(*zip(*shares, strict=True), marker="o", label=f"{key[0]} {key[1]}")
        torch_line = sorted({(r["tokens"], r["torch_layer_us"]) for r in mine if r["torch_layer_us"]})
        if torch_line:
            axes[0][col].plot(*zip(*torch_line, strict=True), "k--", label="torch bf16")
        axes[0][col].set(xscale="log", yscale="log", title=problem, xlabel="T", ylabel="layer µs")
        axes[1][col].set(xscale="log", xlabel="T", ylabel="% outside the GEMMs")
        axes[0][col].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def layer_main(args) -> int:
    import sys

    from humming_jax.timing import write_results

    if bench.KERNEL_BACKEND == "pallas" and jax.default_backend() != "gpu":
        print("bench --layer: needs a GPU (kernels are timed compiled)", file=sys.stderr)
        return 2
    print(HEADER, flush=True)

    def save(rows):
        write_results(args.out, rows, quiet=True, copy_bandwidth=bench.COPY_BANDWIDTH, matmul_rate=bench.MATMUL_RATE)

    rows = run_layers(
        args.problems,
        args.tokens,
        args.formats,
        args.pipelines,
        on_row=save,
        with_stages=not args.no_stages,
    )
    save(rows)
    print(f"wrote {args.out}")
    if plot(rows, args.out.removesuffix(".json") + ".png"):
        print(f"wrote {args.out.removesuffix('.json')}.png")
    return 0
