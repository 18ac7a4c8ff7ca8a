"""Humming's own GEMM (the CUDA library this one reimplements, the `humming`
package of its wheel) timed on the bench's problem — the same format, routing
and M — in the same process, when the package, torch and a GPU are there.

A layer is built as Humming's own benchmark builds its anchor table (random
bf16 weights × 0.02, quantized with its weight schema expert-chunk by chunk,
``load_from_tensors``, ``transform``), its kernel chosen by its heuristic for
M rows and the layout, compiled once, and launched on pre-quantized inputs;
timed both ways the anchor table was: ``triton.testing.do_bench``'s median (L2
flushed between calls, the anchor's ``ms``) and CUDA-graph replays back to back
(its ``ms_graph``; here calibrated and interleaved with ours, as ours are timed).
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Callable

import numpy as np

from humming_jax.timing import event_sampler

# Our weight@input names -> Humming's weight and input configs (its benchmark's FORMATS).
CONFIGS = {
    "int4_g128": (
        {"b_dtype": "int4", "weight_scale_group_size": 128, "bs_dtype": "bfloat16"},
        {"dtype": "bfloat16"},
    ),
    "mxfp4": (
        {"b_dtype": "float4e2m1", "weight_scale_group_size": 32, "bs_dtype": "float8e8m0"},
        {"dtype": "bfloat16"},
    ),
    "fp8_block128@fp8_dynamic_group128": (
        {"b_dtype": "float8e4m3", "weight_scale_group_size": 128, "weight_scale_group_size_n": 128},
        {"dtype": "float8e4m3", "input_scale_group_size": 128},
    ),
    "mxfp4@fp8_dynamic_group128": (
        {"b_dtype": "float4e2m1", "weight_scale_group_size": 32, "bs_dtype": "float8e8m0"},
        {"dtype": "float8e4m3", "input_scale_group_size": 128},
    ),
}
WEIGHT_CHUNK_BYTES = 2 * 10**9  # bf16 weights quantized this many bytes of experts at a time


@functools.cache
def _humming():
    """Humming's modules (a namespace), or None without the package, torch or a GPU."""
    try:
        import torch
        import triton.testing
        from humming import ops
        from humming.config import GemmType
        from humming.forward import may_quant_input
        from humming.kernel.humming import HummingKernel
        from humming.layer import HummingLayer
        from humming.ops.utils import init_humming_launcher
        from humming.schema import HummingWeightSchema
        from humming.tune import get_heuristics_config
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    init_humming_launcher()
    return types.SimpleNamespace(
        torch=torch,
        do_bench=triton.testing.do_bench,
        ops=ops,
        GemmType=GemmType,
        may_quant_input=may_quant_input,
        HummingKernel=HummingKernel,
        HummingLayer=HummingLayer,
        HummingWeightSchema=HummingWeightSchema,
        get_heuristics_config=get_heuristics_config,
    )


def available() -> bool:
    """Whether Humming's kernels can be timed here."""
    return _humming() is not None


def routing_arrays(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(counts [E], order [M], starts [E+1])`` of top-k ids ``[T, k]``:
    grouped row i holds slot ``order[i]`` (slots by expert, stable), expert
    e's rows ``[starts[e], starts[e+1])``."""
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=num_experts)
    order = np.argsort(flat, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return counts, order, starts


def align(ids: np.ndarray, num_experts: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's ``moe_align_block_size`` as Humming's benchmark writes it:
    ``(sorted_ids, expert_ids, num_tokens_padded)``, each expert's slots padded
    to whole blocks with the sentinel M."""
    flat = ids.reshape(-1)
    m = flat.size
    counts, order, starts = routing_arrays(ids, num_experts)
    padded = -(-counts // block) * block
    pad_start = np.cumsum(padded) - padded
    sorted_e = flat[order]
    position = pad_start[sorted_e] + np.arange(m) - starts[:-1][sorted_e]
    sorted_ids = np.full(int(padded.sum()), m, np.int32)
    sorted_ids[position] = order
    expert_ids = np.repeat(np.arange(num_experts, dtype=np.int32), padded // block)
    return sorted_ids, expert_ids, np.asarray([sorted_ids.size], np.int32)


@functools.cache
def _layer(fmt: str, num_experts: int, n: int, k: int):
    """(layer, its config) of random weights in ``fmt`` (kept: a problem's few layers are reused across T)."""
    h = _humming()
    torch = h.torch
    weight_config, input_config = CONFIGS[fmt]
    with torch.device("cuda"):
        layer = h.HummingLayer(
            shape_n=n,
            shape_k=k,
            weight_config=dict(weight_config),
            input_config=dict(input_config),
            num_experts=num_experts,
            torch_dtype=torch.bfloat16,
        )
    chunk = max(1, WEIGHT_CHUNK_BYTES // (n * k * 2))
    generator = torch.Generator(device="cuda")
    generator.manual_seed(17)
    parts = []
    for first in range(0, num_experts, chunk):
        count = min(chunk, num_experts - first)
        w = torch.randn((count, n, k), generator=generator, device="cuda", dtype=torch.bfloat16).mul_(0.02)
        parts.append(h.HummingWeightSchema.quant_tensor(w, layer.weight_schema, torch.bfloat16))
        del w
    tensors = {}
    for name in parts[0]:
        pieces = [p[name] for p in parts]
        if pieces[0].element_size() == 1 and pieces[0].dtype not in (torch.uint8, torch.int8):
            tensors[name] = torch.cat([p.view(torch.uint8) for p in pieces]).view(pieces[0].dtype)
        else:
            tensors[name] = torch.cat(pieces)
    layer.load_from_tensors(tensors)
    layer.transform()
    return layer, layer.humming_config


def forget_layers() -> None:
    """Free the cached layers (before a problem whose weights need the memory)."""
    if _humming() is not None:
        _layer.cache_clear()
        _humming().torch.cuda.empty_cache()


GRAPH = "humming_graph"  # sustained: CUDA-graph replays back to back, as ours are timed
DO_BENCH = "humming_do_bench"  # its table's method: do_bench, L2 flushed before each call


def humming_samplers(
    fmt: str, layout: str, gemm: str, ids: np.ndarray, shapes: tuple[int, int, int, int]
) -> dict[str, Callable[[int], float]]:
    """Samplers (seconds of one call, as :func:`humming_jax.timing.sampler`'s) of
    Humming's kernel for ``fmt`` (a key of :data:`CONFIGS`) on the ``layout``
    ("grouped" | "indexed") GEMM of ``shapes = (E, N, K, top_k)`` routed by
    ``ids [T, top_k]`` (``gemm``: "w13" reads ``[T, K]`` indexed by slot // top_k,
    "w2" ``[T·top_k, K]``), timed both ways its table was (:data:`GRAPH`,
    :data:`DO_BENCH`; the table keeps the faster); {} where Humming cannot run it."""
    launch = humming_launch(fmt, layout, gemm, ids, shapes)
    if launch is None:
        return {}
    do_bench = _humming().do_bench
    return {
        GRAPH: event_sampler(lambda _: launch(), 1),
        DO_BENCH: lambda _: 1e-3 * float(do_bench(launch, warmup=5, rep=25, return_mode="median")),
    }


def humming_launch(
    fmt: str, layout: str, gemm: str, ids: np.ndarray, shapes: tuple[int, int, int, int]
) -> Callable[[], None] | None:
    """A function that enqueues one call of Humming's kernel on the case of
    :func:`humming_samplers` (its inputs made once), or None where Humming cannot run it."""
    h = _humming()
    if h is None or fmt not in CONFIGS:
        return None
    torch = h.torch
    e, n, k, top_k = shapes
    layer, config = _layer(fmt, e, n, k)
    m = ids.size
    gemm_type = "indexed" if layout == "indexed" else "grouped_contiguous"
    tuning = h.get_heuristics_config(config, shape_m=m, gemm_type=h.GemmType(gemm_type), device=0)
    as_json = functools.partial(json.dumps, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    kernels = h.HummingKernel.prepare_kernels(
        config.to_str(), as_json({"gemm_type": gemm_type}), as_json(tuning), torch.cuda.current_device()
    )
    rows = ids.shape[0] if gemm == "w13" else m
    x = torch.randn((rows, k), device="cuda", dtype=torch.bfloat16)
    on_gpu = functools.partial(torch.as_tensor, device="cuda")
    if gemm_type == "indexed":
        sorted_ids, expert_ids, padded = align(ids, e, tuning["block_shape"][0])
        route = dict(sorted_ids=on_gpu(sorted_ids), expert_ids=on_gpu(expert_ids), num_tokens_padded=on_gpu(padded))
        route["expert_layout"] = None
        launch_top_k = top_k if gemm == "w13" else 1
    else:
        _, order, starts = routing_arrays(ids, e)
        slot_rows = order // top_k if gemm == "w13" else order
        x = x[on_gpu(slot_rows.astype(np.int64))].contiguous()
        route = dict(sorted_ids=None, expert_ids=None, num_tokens_padded=None, expert_layout=on_gpu(starts))
        launch_top_k = 1
    x_values, x_scale = h.may_quant_input(config, x) if CONFIGS[fmt][1]["dtype"] != "bfloat16" else (x, None)
    weights = {name: getattr(layer, name, None) for name in ("weight", "weight_scale", "weight_scale_2")}
    weights.update(zero_point=getattr(layer, "zero_point", None), bias=getattr(layer, "bias", None))
    out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    locks = torch.zeros((4096,), device="cuda", dtype=torch.int32)

    def launch():
        h.ops.launch_kernel(
            configs=kernels,
            inputs=x_values,
            input_scale=x_scale,
            outputs=out,
            locks=locks,
            top_k=launch_top_k,
            valid_shape_m=m,
            **weights,
            **route,
        )

    launch()
    torch.cuda.synchronize()
    return launch
