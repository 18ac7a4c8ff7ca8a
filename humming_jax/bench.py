"""GEMM benchmark and tuning sweep (``python -m humming_jax bench|tune``).

Problems (name: E, H, I, top_k); each runs w13 (N = 2I, K = H) and
w2 (N = H, K = I) in the grouped and the indexed layout (and on request the
masked one, the batched experts': each expert's rows in a buffer of
:func:`masked_capacity` rows). Reported per case:
time, TFLOP/s on the real rows (2·T·k·N·K), GB/s on the bytes that must move
(the stored weights of the experts that received tokens + activations in and
out), the fraction of the roofline max(bytes / 4.3 TB/s, flops / 790 TFLOP/s),
and, in the same process, ``torch._grouped_mm`` (bf16) and
``jax.lax.ragged_dot`` (bf16) on the same rows when they run. A format
``WEIGHT@INPUT`` (or the anchor table's names, :data:`PAIRS`) quantizes the
input too; its quantization (``process_input``) is timed apart (``quant_us``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from humming_jax import bench_report, humming_peer, tiles_text
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax import layouts as L
from humming_jax import tuning as T
from humming_jax.backend import NoKernelError
from humming_jax.configs import ExpertsConfig
from humming_jax.experts import indexed_runs_grouped
from humming_jax.gemm import GemmTiles, as_quantized_input, gemm, plan
from humming_jax.process_input import process_input
from humming_jax.routing import moe_align_block_size, moe_prepare_scatter
from humming_jax.timing import (
    COPY_BANDWIDTH,
    MATMUL_RATE,
    bandwidth_fields,
    copy_seconds,
    device_seconds,
    event_sampler,
    interleaved,
    sampler,
    write_results,
)
from humming_jax.tuning import search

L2_BYTES = 60 * 2**20
OURS = "ours"
TORCH_GROUPED_MM = "torch_grouped_mm"
PROBLEMS = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "deepseek-v3": (256, 7168, 2048, 8),
    "gpt-oss-120b": (128, 2880, 2880, 4),
    # No table entries of its own: what the format-class entries and the heuristic run.
    "qwen3-235b-a22b": (128, 4096, 1536, 8),
}
# The anchor table's problems (Humming's H200 table times these): the bench's default.
ANCHOR_PROBLEMS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b")
TOKENS = (1, 16, 128, 512, 4096)
FORMATS = ("bf16", "int4_g128", "mxfp4")
# The anchor table's (Humming's) names of the weight@input pairs.
PAIRS = {
    "w4a16_int4_g128": "int4_g128",
    "w4a16_mxfp4": "mxfp4",
    "w8a8_fp8_block128": "fp8_block128@fp8_dynamic_group128",
    "w4a8_mxfp4_fp8g128": "mxfp4@fp8_dynamic_group128",
}


ANCHOR_FILE = "benchmarks/anchors/humming_h200.json"  # Humming's measured H200 table


def load_anchor(path: str | None) -> dict:
    """Humming's time (µs: the lower of its do_bench and CUDA-graph medians) per
    (problem, layout, gemm, T, format) from an anchor table, or {} without one."""
    try:
        with open(path) as f:
            results = json.load(f)["results"]
    except (TypeError, OSError):
        return {}
    ours = {"grouped_contiguous": "grouped", "indexed": "indexed"}
    return {
        (r["shape"], ours[r["gemm_type"]], r["sublayer"], r["T"], PAIRS[r["format"]]): 1e3 * min(r["ms"], r["ms_graph"])
        for r in results
        if r["kind"] == "humming" and r["format"] in PAIRS
    }


def split_format(name: str) -> tuple[F.WeightFormat, Q.InputQuantSpec]:
    """(weight format, input quantization) of a bench format name: ``WEIGHT``,
    ``WEIGHT@INPUT`` or a name of :data:`PAIRS`."""
    name = PAIRS.get(name, name)
    weight, _, quant = name.partition("@")
    return F.get_format(weight), Q.get_input_spec(quant or None)


KERNEL_BACKEND = "pallas"  # "interpret" lets the CPU test suite run this code path


@dataclasses.dataclass(frozen=True)
class Case:
    problem: str
    gemm: str  # w13 | w2
    layout: str  # grouped | indexed | masked
    tokens: int
    fmt: str  # a weight format, or WEIGHT@INPUT (split_format)
    # 4-bit codes stored in K order instead of the planar order the library
    # repacks them into at load time (to_planar; the kernel then needs no split x).
    k_order: bool = False
    # Planar e2m1 codes in the pair decoder's bit order (to_planar(half_bits=True)).
    half_bits: bool = True
    # Group scales as to_kernel_order stores them ("kernel": k_major_scales_preferred),
    # "n_major" [E, N, K/g] or "k_major" [E, K/g, N] for every per-group format.
    scale_order: str = "kernel"

    def shapes(self):
        e, h, i, k = PROBLEMS[self.problem]
        n, kk = (2 * i, h) if self.gemm == "w13" else (h, i)
        return e, n, kk, k


def _weight_bytes(fmt: F.WeightFormat, n: int, k: int) -> int:
    """Stored bytes of one expert's weight (values, scales, zero points)."""
    shape = (1, n, k)
    total = math.prod(fmt.values_shape(*shape)) * jnp.dtype(fmt.values_dtype).itemsize
    for part, dtype in ((fmt.scale_shape(*shape), fmt.scale_dtype), (fmt.zero_point_shape(*shape), jnp.uint8)):
        if part is not None:
            total += math.prod(part) * jnp.dtype(dtype).itemsize
    return total


def _routing(rng, tokens: int, experts: int, top_k: int) -> np.ndarray:
    scores = rng.random((tokens, experts))
    return np.argpartition(scores, -top_k, axis=1)[:, -top_k:].astype(np.int32)


# The bench's layout names and the layouts they time.
LAYOUT_KINDS = {"grouped": "grouped_contiguous", "indexed": "indexed", "masked": "grouped_masked"}
MASKED_ROW_MULTIPLE = 16  # a masked case's buffer rows an expert: its largest count rounded up to this


def expert_counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Each expert's rows in a routing ``ids`` (``[T, top_k]``, ids in ``[0, E)``): int32 ``[E]``."""
    return np.bincount(np.asarray(ids).reshape(-1), minlength=num_experts).astype(np.int32)


def masked_capacity(ids: np.ndarray, num_experts: int) -> int:
    """Rows an expert's buffer holds in a masked case (as a batched layer's
    caller sizes it): the largest count, rounded up to :data:`MASKED_ROW_MULTIPLE`."""
    return -(-int(expert_counts(ids, num_experts).max()) // MASKED_ROW_MULTIPLE) * MASKED_ROW_MULTIPLE


def _input_rows(case: Case, ids: np.ndarray) -> int:
    """Rows of the GEMM's input: the indexed w13 reads the unexpanded ``[T, K]``,
    the masked layout an ``[E · capacity, K]`` buffer."""
    e, _, _, top_k = case.shapes()
    if case.layout == "masked":
        return e * masked_capacity(ids, e)
    return case.tokens if (case.layout == "indexed" and case.gemm == "w13") else case.tokens * top_k


def _costs(case: Case, ids: np.ndarray) -> tuple[int, int]:
    """(bytes that must move, flops) on the real rows (a masked buffer's
    rows past each count are not read)."""
    _, n, k, top_k = case.shapes()
    rows = case.tokens * top_k
    hit = len(np.unique(ids))
    fmt, quant = split_format(case.fmt)
    read = rows if case.layout == "masked" else _input_rows(case, ids)
    x_bytes = read * k * (quant.dtype.bits / 8 if quant.is_quantized else 2)
    moved = hit * _weight_bytes(fmt, n, k) + int(x_bytes) + rows * n * 2
    return moved, 2 * rows * n * k


QUANTIZE_CHUNK_BYTES = 2**31  # float32 bytes of weights quantized at a time


def random_bf16(key, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    """Normal values times ``scale`` in bf16 ``shape``, drawn in float32 a
    chunk of the leading axis at a time and rounded once. ``jax.random.normal``
    in bf16 yields 128 distinct values; data of so few bit patterns draws less
    power in the tensor cores than real activations and weights (or the peers'
    ``torch.randn``), and a power-limited GEMM runs faster on it."""
    row = max(1, math.prod(shape[1:]))
    chunk = max(1, QUANTIZE_CHUNK_BYTES // (4 * row))
    parts = [
        (jax.random.normal(jax.random.fold_in(key, start), (min(chunk, shape[0] - start), *shape[1:])) * scale).astype(
            jnp.bfloat16
        )
        for start in range(0, shape[0], chunk)
    ]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _random_weight(key, fmt: F.WeightFormat, e: int, n: int, k: int) -> F.QuantizedWeight:
    """A random ``[E, N, K]`` weight in ``fmt``, drawn and quantized a few experts
    at a time: the float32 copy of a whole deepseek-v3 weight alone is 30 GB."""
    chunk = max(1, QUANTIZE_CHUNK_BYTES // (4 * n * k))
    parts = []
    for start in range(0, e, chunk):
        size = min(chunk, e - start)
        w = random_bf16(jax.random.fold_in(key, start), (size, n, k), 0.02)
        # The static shape is set to the whole weight's so the chunks' pytrees match.
        parts.append(dataclasses.replace(F.quantize_weight(w, fmt), shape=(e, n, k)))
    return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *parts)


def _arrays(case: Case, sets: int, seed: int, rows: int):
    """Weights and ``rows``-row inputs for ``sets`` independent calls (rotated so L2 does not serve them)."""
    e, n, k, _ = case.shapes()
    fmt, quant = split_format(case.fmt)
    weights, xs = [], []
    k_major = case.scale_order == "k_major" or (case.scale_order == "kernel" and F.k_major_scales_preferred(fmt))
    for s in range(sets):
        kw, kx = jax.random.split(jax.random.fold_in(jax.random.key(seed), s))
        weight = _random_weight(kw, fmt, e, n, k)
        weights.append(
            weight if case.k_order else F.to_planar(weight, half_bits=_half_bits(case, quant), k_major_scales=k_major)
        )
        xs.append(_quantized(random_bf16(kx, (rows, k)), quant))
    return weights, xs


def _half_bits(case: Case, quant: Q.InputQuantSpec) -> bool:
    """As the modules store planar e2m1 codes (:func:`humming_jax.formats.planar_half_bits`)."""
    return case.half_bits and F.planar_half_bits("bfloat16", quant)


def _static_scale(x: jax.Array, quant: Q.InputQuantSpec) -> jax.Array | None:
    """A static tensor scale that fits ``x`` (amax over the element maximum)."""
    return jnp.max(jnp.abs(x.astype(jnp.float32))).reshape(1) / quant.dtype.max_value if quant.mode.is_static else None


@functools.partial(jax.jit, static_argnames="quant")
def _quantized(x: jax.Array, quant: Q.InputQuantSpec):
    """``x`` quantized as the pipelines quantize it (``process_input``), or as it is."""
    if not quant.is_quantized:
        return x
    return process_input(x, quant, static_scale=_static_scale(x, quant), backend=KERNEL_BACKEND)


def _layout(case: Case, ids: np.ndarray, tuning: GemmTiles | None):
    """The case's layout over its routing ``ids`` (indexed: aligned to :func:`_block_size`)."""
    e, _, _, top_k = case.shapes()
    if case.layout == "grouped":
        offsets, _ = moe_prepare_scatter(jnp.asarray(ids), e)
        return L.GroupedContiguous(offsets, normalized=True)  # as the pipelines pass them
    if case.layout == "masked":  # each expert's count of rows, first in its buffer
        return L.GroupedMasked(jnp.asarray(expert_counts(ids, e)))
    block_size = _block_size(case, tuning)
    aligned = moe_align_block_size(jnp.asarray(ids), block_size, e, ignore_invalid_experts=True)
    top_k = top_k if case.gemm == "w13" else 1
    return L.Indexed(*aligned, top_k=top_k, block_size=block_size, lists_dropped=True)


def _block_size(case: Case, tiles: GemmTiles | None) -> int:
    """The indexed layout's alignment block: the tiling's rows (``tiles`` None:
    those of the first tiling the table or the heuristic lists for the case)."""
    if tiles is None:
        e, n, k, _ = case.shapes()
        fmt, quant = split_format(case.fmt)
        dtype = quant.dtype.value if quant.is_quantized else None
        return T.indexed_block_rows(T.candidates("indexed", fmt, _real_rows(case), e, n, k, input_dtype=dtype))
    return tiles.block_m


@dataclasses.dataclass
class Prepared:
    """One case's routing and input sets, made once and timed under many tilings."""

    case: Case
    ids: np.ndarray
    weights: list
    xs: list
    moved: int
    flops: int


def prepare(case: Case, seed: int = 0) -> Prepared:
    rng = np.random.default_rng(seed)
    e, _, _, top_k = case.shapes()
    ids = _routing(rng, case.tokens, e, top_k)
    moved, flops = _costs(case, ids)
    sets = int(min(8, max(2, math.ceil(2 * L2_BYTES / moved))))
    weights, xs = _arrays(case, sets, seed, _input_rows(case, ids))
    return Prepared(case, ids, weights, xs, moved, flops)


def _real_rows(case: Case) -> int:
    """The table's key: the rows that carry a token (T · top_k)."""
    return case.tokens * case.shapes()[3]


def gemm_call(prep: Prepared, tuning: GemmTiles | None):
    """``(fn(x, weight), layout)``: the call the bench times for ``prep`` under
    ``tuning`` (None: the table's choice), its routing fixed."""
    case = prep.case
    layout = _layout(case, prep.ids, tuning)

    def fn(x, weight):
        return gemm(x, weight, layout, valid_shape_m=_real_rows(case), tuning=tuning, backend=KERNEL_BACKEND)

    return fn, layout


# Entry-computation instructions that launch no device work.
_NO_LAUNCH = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


def launched_ops(hlo_text: str) -> list[str]:
    """``"opcode name"`` of each instruction of an optimized HLO module's entry
    computation that runs on the device (fusions, custom calls such as the
    Pallas kernels, copies, memsets): what one call launches."""
    ops, in_entry = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
        elif in_entry and line.startswith("}"):
            break
        elif in_entry and " = " in line:
            name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
            match = re.search(r"(?:^|\s)([a-z][a-z0-9-]*)\(", rest)
            if match and match.group(1) not in _NO_LAUNCH:
                ops.append(f"{match.group(1)} {name}")
    return ops


TIMING_REPEATS = 5  # timings of each peer, interleaved with ours


def time_prepared(
    prep: Prepared, tuning: GemmTiles | None, peers: dict[str, Callable[[int], float]] | None = None
) -> tuple[dict, jax.Array, object]:
    """(result row, the kernel's output on the first set, its layout).
    ``tuning`` None: the table's choice, run as ``gemm`` runs it (with its
    fallbacks); the row records the tiling that ran. ``peers``: samplers
    (:func:`humming_jax.timing.event_sampler`) timed in turn with ours, each
    one's median and spread in ``peer_us`` / ``peer_us_spread``."""
    case = prep.case
    fn, layout = gemm_call(prep, tuning)
    ours = sampler(fn, list(zip(prep.xs, prep.weights, strict=True)))
    samples = interleaved({OURS: ours, **(peers or {})}, TIMING_REPEATS)
    ours = samples.pop(OURS)
    seconds = statistics.median(ours)
    floor = max(prep.moved / COPY_BANDWIDTH, prep.flops / _matmul_rate(case))
    x, weight = as_quantized_input(prep.xs[0]), prep.weights[0]
    interpret = KERNEL_BACKEND != "pallas"
    ran, _ = plan(x, weight, layout, valid_shape_m=_real_rows(case), tuning=tuning, interpret=interpret)
    row = dict(
        **dataclasses.asdict(case),
        **bandwidth_fields(seconds, prep.moved),
        us_spread=[1e6 * min(ours), 1e6 * max(ours)],
        tflops=prep.flops / seconds / 1e12,
        roofline_fraction=floor / seconds,
        flops=prep.flops,
        tiles=None if ran is None else tiles_text.gemm_to_text(ran),
        peer_us={name: 1e6 * statistics.median(times) for name, times in samples.items()},
        peer_us_spread={name: [1e6 * min(times), 1e6 * max(times)] for name, times in samples.items()},
        # Whether each event-timed peer replayed a CUDA graph (else it launched eagerly).
        peer_graph={name: sample.graph for name, sample in (peers or {}).items() if hasattr(sample, "graph")},
    )
    return row, fn(prep.xs[0], prep.weights[0]), layout


CHECKED_EXPERTS = 8


def _one_expert(weight: F.QuantizedWeight, expert) -> F.QuantizedWeight:
    """Expert ``expert`` (an int or a traced scalar) of ``weight`` as a one-expert weight."""
    parts = {
        name: None if getattr(weight, name) is None else jax.lax.dynamic_slice_in_dim(getattr(weight, name), expert, 1)
        for name in ("values", "scale", "zero_point", "second_scale", "bias", "group_index")
    }
    return dataclasses.replace(weight, **parts, shape=(1, *weight.shape[1:]))


def _rows_by_expert(layout, m_out: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{expert: (input rows, output rows)}`` that ``layout`` sends through each
    expert that gets rows (the layout read to the host once)."""
    if isinstance(layout, L.GroupedContiguous):
        offsets = np.asarray(layout.expert_offsets)
        spans = {e: np.arange(offsets[e], offsets[e + 1]) for e in range(len(offsets) - 1)}
        return {e: (rows, rows) for e, rows in spans.items() if len(rows)}
    if isinstance(layout, L.GroupedMasked):  # expert e's first counts[e] rows of its buffer
        counts = np.asarray(layout.expert_num_tokens)
        capacity = m_out // len(counts)
        spans = {e: e * capacity + np.arange(min(int(c), capacity)) for e, c in enumerate(counts)}
        return {e: (rows, rows) for e, rows in spans.items() if len(rows)}
    block = layout.block_size
    padded = int(np.asarray(layout.num_tokens_padded).reshape(-1)[0])
    entries = np.asarray(layout.sorted_ids)[:padded]
    block_expert = np.repeat(np.asarray(layout.expert_ids)[: padded // block], block)
    keep = entries < m_out
    entries, block_expert = entries[keep], block_expert[keep]
    by_expert = {int(e): entries[block_expert == e] for e in np.unique(block_expert)}
    return {e: (rows // layout.top_k, rows) for e, rows in by_expert.items()}


@jax.jit
def _expert_sums(x, weight, expert, out, rows_in, rows_out, valid):
    """(Σ(out − ref)², Σref²) over the rows of ``expert`` (``rows_*`` padded,
    ``valid`` marks the real ones): ref a float32 product with its dequantized weight."""
    w = F.dequantize_weight(_one_expert(weight, expert), stored_rows=True)[0]
    ref = jnp.dot(x[rows_in].astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    got = out[rows_out].astype(jnp.float32)
    keep = valid[:, None]
    return jnp.sum(jnp.where(keep, (got - ref) ** 2, 0.0)), jnp.sum(jnp.where(keep, ref**2, 0.0))


def sampled_error(prep: Prepared, layout, out: jax.Array) -> float:
    """‖out − ref‖/‖ref‖ over the rows of up to ``CHECKED_EXPERTS`` experts
    (spread over the ones that got rows), the reference being a float32
    product with the dequantized weight of each expert: independent of the
    kernel and cheap at any problem size."""
    x = prep.xs[0]
    x = Q.dequantize_input(x) if isinstance(x, Q.QuantizedInput) else x
    rows = _rows_by_expert(layout, out.shape[0])
    hit = sorted(rows)
    chosen = hit[:: max(1, len(hit) // CHECKED_EXPERTS)][:CHECKED_EXPERTS]
    # Every expert's rows padded to one length: one compiled check per case.
    size = max((len(rows[expert][0]) for expert in chosen), default=0)
    diff = norm = 0.0
    for expert in chosen:
        rows_in, rows_out = (np.pad(r, (0, size - len(r))) for r in rows[expert])
        valid = np.arange(size) < len(rows[expert][0])
        d, n = _expert_sums(x, prep.weights[0], expert, out, rows_in, rows_out, valid)
        diff, norm = diff + float(d), norm + float(n)
    return math.sqrt(diff / norm) if norm else 0.0


def _matmul_rate(case: Case) -> float:
    """The tensor cores' peak for the case's operands: twice bf16's with 8-bit float inputs."""
    quant = split_format(case.fmt)[1]
    eight_bit_float = quant.is_quantized and quant.dtype.value.startswith("float8")
    return MATMUL_RATE * (2 if eight_bit_float else 1)


def time_quantization(case: Case, ids: np.ndarray, seed: int = 0) -> float | None:
    """Microseconds of the input's quantization (``process_input`` on the GEMM's
    input rows, bf16 in; ``ids`` the case's routing), or None for an unquantized input."""
    quant = split_format(case.fmt)[1]
    if not quant.is_quantized:
        return None
    _, _, k, _ = case.shapes()
    keys = jax.random.split(jax.random.key(seed + 1), 2)
    sets = [(random_bf16(key, (_input_rows(case, ids), k)),) for key in keys]
    return device_seconds(lambda x: _quantized(x, quant), sets) * 1e6


def time_kernel(
    case: Case,
    tuning: GemmTiles | None = None,
    seed: int = 0,
    peers: Callable[[Prepared], dict[str, Callable[[int], float]]] | None = None,
) -> dict:
    """One case under ``tuning`` (default: the table/heuristic choice), checked against
    :func:`sampled_error` (``error``); ``quant_us``: the input's quantization, apart.
    ``peers(prep)``: the samplers to time interleaved with ours (:func:`time_prepared`)."""
    prep = prepare(case, seed)
    samplers = peers(prep) if peers is not None else {}
    try:
        row, out, layout = time_prepared(prep, tuning, samplers)
    finally:
        if samplers:
            del samplers
            _release_torch()
    row["error"] = sampled_error(prep, layout, out)
    row["quant_us"] = time_quantization(case, prep.ids, seed)
    row["layout_ids"] = prep.ids
    return row


def _release_torch() -> None:
    """Hand torch's cached blocks back (they would leave JAX short on the largest problems)."""
    torch = sys.modules.get("torch")  # the peers imported it, if any ran
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def torch_peers(prep: Prepared) -> dict[str, Callable[[int], float]]:
    """``{"torch_grouped_mm": sampler}``: ``torch._grouped_mm`` (bf16) on the same
    grouped rows, its inputs drawn as many times as ours (rotated alike), or {}
    without torch on a GPU."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return {}
    e, n, k, _ = prep.case.shapes()
    counts = expert_counts(prep.ids, e)
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    # Sets rotated so L2 does not serve them, counted on torch's own (bf16) bytes, as prepare counts ours.
    moved = 2 * (int((counts > 0).sum()) * n * k + int(counts.sum()) * (k + n))
    sets = int(min(len(prep.xs), max(2, math.ceil(2 * L2_BYTES / moved))))
    a = [torch.randn(int(counts.sum()), k, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
    b = [torch.randn(e, n, k, dtype=torch.bfloat16, device="cuda").transpose(1, 2) for _ in range(sets)]

    def launch(s: int) -> None:
        torch._grouped_mm(a[s], b[s], offs=offs)

    return {TORCH_GROUPED_MM: event_sampler(launch, sets)}


def time_ragged_dot(case: Case, ids: np.ndarray) -> float | None:
    e, n, k, _ = case.shapes()
    counts = expert_counts(ids, e)
    try:
        a = random_bf16(jax.random.key(1), (int(counts.sum()), k))
        b = random_bf16(jax.random.key(2), (e, k, n))
        fn = lambda x, w, g: jax.lax.ragged_dot(x, w, g)  # noqa: E731
        return device_seconds(fn, [(a, b, jnp.asarray(counts))], repeats=3) * 1e6
    except Exception as error:  # e.g. out of memory: recorded, not fatal
        print(f"ragged_dot failed on {case}: {type(error).__name__}", file=sys.stderr)
        return None


MGPU_CONFIGS = (  # (block_m, block_n, block_k, max_concurrent_steps, grid_block_n) from its own sweep's space
    (128, 128, 64, 4, 4),
    (128, 192, 64, 4, 1),
    (128, 128, 64, 4, 1),
)


def time_mgpu_ragged_dot(case: Case, ids: np.ndarray) -> float | None:
    """Median microseconds of JAX's own Hopper grouped GEMM (Pallas Mosaic GPU:
    TMA + wgmma, ``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``) on the
    same bf16 problem, best of a few tilings; None off the GPU or if none
    lowers. A second reference point for prefill: what TMA and wgmma reach."""
    if jax.default_backend() != "gpu":
        return None
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except ImportError:
        return None
    e, n, k, _ = case.shapes()
    counts = jnp.asarray(expert_counts(ids, e))
    a = random_bf16(jax.random.key(1), (int(counts.sum()), k))
    b = random_bf16(jax.random.key(2), (e, k, n))
    best = None
    for bm, bn, bk, steps, grid_n in MGPU_CONFIGS:
        if k % bk or n % (bn * grid_n):
            continue
        tiles = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=grid_n)
        fn = functools.partial(ragged_dot_mgpu.ragged_dot, **tiles)
        try:
            us = device_seconds(lambda x, w, g, f=fn: f(x, w, group_sizes=g), [(a, b, counts)], repeats=3) * 1e6
        except Exception as error:  # a tiling that does not fit (shared memory) or lower: next one
            print(f"mgpu ragged_dot {tiles} failed on {case}: {type(error).__name__}", file=sys.stderr)
            continue
        best = us if best is None else min(best, us)
    return best


COPY_REFERENCE_MAX_TOKENS = 128  # decode-sized rows also time a pass over the same bytes


def humming_peers(prep: Prepared) -> dict[str, Callable[[int], float]]:
    """Humming's samplers on the case (:func:`humming_peer.humming_samplers`), {}
    where it cannot be timed; a failure is reported, not fatal."""
    case = prep.case
    if not humming_peer.available() or case.layout == "masked":  # Humming has no masked layout
        return {}
    try:
        return humming_peer.humming_samplers(
            PAIRS.get(case.fmt, case.fmt), case.layout, case.gemm, prep.ids, case.shapes()
        )
    except Exception as error:  # its build, heuristic or launch refused the case
        print(f"humming failed on {case}: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
        return {}


def run_bench(
    problems,
    tokens,
    formats,
    layouts=("grouped", "indexed"),
    gemms=("w13", "w2"),
    compare=True,
    on_row=None,
    k_order=False,
    anchor=None,
    humming=True,
    failures: list | None = None,
):
    """Time every case; ``on_row(rows)`` runs after each one (the JSON is kept
    current, so a run cut short keeps what it measured). ``failures``: a list
    to which a case no kernel takes is added (its fields and the error) while
    the run goes on; None: the error is raised. ``k_order``: 4-bit
    weights as quantized, not repacked (see :class:`Case`). ``humming_us``
    and ``x_humming`` (our time over Humming's): Humming's kernel timed on
    the same problem in this process, interleaved with ours, where it can be
    (``humming`` and :func:`humming_peer.available`; ``humming_source``
    "live"; the faster of ``humming_graph_us`` and ``humming_do_bench_us``,
    as the anchor keeps the faster of its two), else the ``anchor`` table's
    (:func:`load_anchor`; "anchor"), kept as ``anchor_humming_us`` beside a
    live time. ``torch_grouped_mm_us`` is timed interleaved with ours too."""
    anchor = anchor or {}
    rows = []
    torch_us = {}  # (problem, gemm, T) -> torch._grouped_mm (bf16) time, the ratio's reference
    copy_us = {}  # bytes moved -> time of a pass that reads and writes as many bytes
    for problem in problems:
        humming_peer.forget_layers()  # the last problem's Humming layers
        for t in tokens:
            for g in gemms:
                for layout in layouts:
                    for fmt in formats:
                        case = Case(problem, g, layout, t, fmt, k_order)
                        e, n, k, _ = case.shapes()
                        try:
                            weight_format, quant = split_format(fmt)
                            weight_format.check_shape(n, k)
                            quant.check_k(k)
                        except ValueError:
                            continue  # e.g. gpt-oss K=2880 with groups of 128 (needs padding)
                        with_torch = compare and layout == "grouped" and fmt == formats[0]

                        def peers(prep, with_torch=with_torch):
                            return {
                                **(torch_peers(prep) if with_torch else {}),
                                **(humming_peers(prep) if humming else {}),
                            }

                        try:
                            result = time_kernel(case, peers=peers)
                        except NoKernelError as error:
                            if failures is None:
                                raise
                            failures.append(dict(dataclasses.asdict(case), error=str(error)))
                            print(f"FAILED {case}: {error}", flush=True)
                            continue
                        ids = result.pop("layout_ids")
                        if with_torch:
                            result["torch_grouped_mm_us"] = result["peer_us"].get(TORCH_GROUPED_MM)
                            result["ragged_dot_us"] = time_ragged_dot(case, ids)
                            if t >= 512:  # prefill: the Mosaic GPU grouped GEMM as well
                                result["mgpu_ragged_dot_us"] = time_mgpu_ragged_dot(case, ids)
                            if result["torch_grouped_mm_us"] is not None:
                                torch_us[problem, g, t] = result["torch_grouped_mm_us"]
                        if (problem, g, t) in torch_us:  # throughput relative to bf16 torch (>1: faster)
                            result["vs_torch"] = torch_us[problem, g, t] / result["us"]
                        anchor_us = anchor.get((problem, layout, g, t, PAIRS.get(fmt, fmt)))
                        humming_times = {p: us for p, us in result["peer_us"].items() if p.startswith("humming")}
                        result.update({f"{name}_us": us for name, us in humming_times.items()})
                        live_us = min(humming_times.values()) if humming_times else None  # as the anchor: the faster
                        humming_us = live_us if live_us is not None else anchor_us
                        if humming_us is not None:
                            result["humming_us"] = humming_us
                            result["x_humming"] = result["us"] / humming_us
                            result["humming_source"] = "live" if live_us is not None else "anchor"
                        if live_us is not None and anchor_us is not None:
                            result["anchor_humming_us"] = anchor_us
                        if compare and t <= COPY_REFERENCE_MAX_TOKENS:
                            # Decode is judged on bandwidth: what a plain pass over as many bytes reaches.
                            if result["bytes"] not in copy_us:
                                copy_us[result["bytes"]] = copy_seconds(result["bytes"]) * 1e6
                            result["copy_us"] = copy_us[result["bytes"]]
                            result["vs_copy"] = result["copy_us"] / result["us"]
                        rows.append(result)
                        print(format_row(result), flush=True)
                        if on_row is not None:
                            on_row(rows)
    return rows


HEADER = (
    f"{'problem':<15}{'gemm':<5}{'layout':<8}{'T':>6}{'format':>11}{'us':>10}{'TFLOP/s':>9}{'GB/s':>8}"
    f"{'%roof':>7}{'torch us':>10}{'ragged us':>11}{'mgpu us':>10}{'x torch':>8}{'x copy':>8}{'error':>9}"
    f"{'quant us':>9}{'humming us':>11}{'x humming':>10}"
)


def format_row(r: dict) -> str:
    def cell(key, width):
        value = r.get(key)
        return f"{'' if value is None else f'{value:.1f}':>{width}}"

    return (
        f"{r['problem']:<15}{r['gemm']:<5}{r['layout']:<8}{r['tokens']:>6}{r['fmt']:>11}{r['us']:>10.1f}"
        f"{r['tflops']:>9.1f}{r['gbps']:>8.0f}{100 * r['roofline_fraction']:>6.0f}%"
        f"{cell('torch_grouped_mm_us', 10)}{cell('ragged_dot_us', 11)}{cell('mgpu_ragged_dot_us', 10)}"
        f"{'' if r.get('vs_torch') is None else format(r['vs_torch'], '.2f'):>8}"
        f"{'' if r.get('vs_copy') is None else format(r['vs_copy'], '.2f'):>8}{r['error']:>9.1e}"
        f"{cell('quant_us', 9)}{cell('humming_us', 11)}"
        f"{'' if r.get('x_humming') is None else format(r['x_humming'], '.2f'):>10}"
    )


def bench_main(args) -> int:
    if KERNEL_BACKEND == "pallas" and jax.default_backend() != "gpu":
        print("bench: needs a GPU (kernels are timed compiled)", file=sys.stderr)
        return 2
    print(HEADER, flush=True)

    def save(rows):
        write_results(args.out, rows, quiet=True, copy_bandwidth=COPY_BANDWIDTH, matmul_rate=MATMUL_RATE)

    failures = []  # a case no kernel takes is reported, and the other cases still run
    rows = run_bench(
        args.problems,
        args.tokens,
        args.formats,
        layouts=args.layouts,
        gemms=args.gemms,
        compare=not args.no_compare,
        on_row=save,
        k_order=args.k_order,
        anchor=load_anchor(args.anchor),
        humming=not args.no_humming,
        failures=failures,
    )
    summary = bench_report.humming_summary(rows)
    for line in bench_report.summary_lines(summary):
        print(line)
    meta = dict(copy_bandwidth=COPY_BANDWIDTH, matmul_rate=MATMUL_RATE, humming_summary=summary, failures=failures)
    write_results(args.out, rows, quiet=True, **meta)
    print(f"wrote {args.out}")
    if bench_report.plot_humming(rows, args.out.removesuffix(".json") + ".png"):
        print(f"wrote {args.out.removesuffix('.json')}.png")
    for failure in failures:
        print(
            f"bench: no kernel took {failure['problem']} {failure['gemm']} {failure['layout']} T={failure['tokens']} "
            f"{failure['fmt']}: {failure['error']}",
            file=sys.stderr,
        )
    return 1 if failures else 0


# ---- tuning ------------------------------------------------------------------------------


def merge_entry(entries: list[dict], entry: dict) -> list[dict]:
    """``entries`` (a table key's JSON entries) with ``entry`` in place of every
    entry whose M range overlaps its own: lookups take the first range that
    holds M, so an older, wider range left in place would shadow the new one."""
    low, high = entry["min_shape_m"], entry["max_shape_m"]
    kept = [e for e in entries if e["max_shape_m"] <= low or e["min_shape_m"] >= high]
    return sorted([*kept, entry], key=lambda e: e["min_shape_m"])


def _existing_entries(path: str) -> dict[str, list[dict]]:
    """The entries of the table at ``path`` (empty if there is none)."""
    try:
        with open(path) as f:
            return json.load(f).get("entries", {})
    except FileNotFoundError:
        return {}


def uncovered(problem: str, gemm: str, formats: list[str], layouts: list[str]) -> list[str]:
    """The (format, layout, M range) of one problem's GEMM that no entry of the
    shipped table covers (for the shape or its format class): the heuristic
    tiles run there. One line each, with the ``tune`` range flags that sweep it.
    A format the GEMM's weight shape cannot take (int4 g128 at gpt-oss-120b's
    K = 2880) has no line: nothing runs it there to tune. An indexed range where
    the indexed pipeline runs the grouped stages (``experts.indexed_runs_grouped``)
    says so: only a direct indexed ``gemm`` call reaches it."""
    lines = []
    num_experts, hidden, intermediate, _ = PROBLEMS[problem]
    for fmt in formats:
        weight_format, quant = split_format(fmt)
        input_dtype = quant.dtype.value if quant.is_quantized else None
        for layout_name in layouts:
            e, n, k, top_k = Case(problem, gemm, layout_name, 1, fmt).shapes()
            try:
                weight_format.check_shape(n, k)
            except ValueError:
                continue
            config = ExpertsConfig(
                num_experts, hidden, intermediate, top_k, weight_format=weight_format, input_quant=quant
            )
            for low, high in search.M_RANGES:
                m = search.representative_m(low, high)
                if not T.table_entries(LAYOUT_KINDS[layout_name], weight_format, m, e, n, k, input_dtype):
                    grouped = layout_name == "indexed" and indexed_runs_grouped(m // top_k, top_k, config)
                    lines.append(
                        f"{problem} {gemm} {fmt} {layout_name} M in ({low}, {high}] (T={m // top_k}): "
                        f"heuristic; tune --min-m {high} --max-m {high}"
                        + ("; the indexed pipeline runs the grouped stages here" if grouped else "")
                    )
    return lines


def tune_main(args) -> int:
    """Sweep :mod:`humming_jax.tuning.search`'s candidates per (layout, format
    class, M range) on one problem, check each with :func:`sampled_error`,
    print every candidate, and keep for each table key the candidate with the
    least total time over the formats of its class that all passed; write the
    table to ``args.out`` (merged into it if it exists: a key's entry for an
    overlapping M range is replaced). Copy it over ``humming_jax/tuning/<device>.json``
    to ship it."""
    if getattr(args, "uncovered", False):
        for line in uncovered(args.problem, args.gemm, args.formats, args.layouts):
            print(line)
        return 0
    if KERNEL_BACKEND == "pallas" and jax.default_backend() != "gpu":
        print("tune: needs a GPU", file=sys.stderr)
        return 2
    num_experts, top_k = PROBLEMS[args.problem][0], PROBLEMS[args.problem][3]
    timings: dict[tuple[str, int, int], dict[object, list[float]]] = {}
    members: dict[tuple[str, int, int], int] = {}
    for fmt in args.formats:
        for layout_name in args.layouts:
            kind = LAYOUT_KINDS[layout_name]
            for low, high in search.swept_ranges(args.min_m, args.max_m):
                tokens = max(1, search.representative_m(low, high) // top_k)
                case = Case(args.problem, args.gemm, layout_name, tokens, fmt, args.k_order)
                shape = case.shapes()[:3] if args.per_shape else None
                weight_format, quant = split_format(fmt)
                input_dtype = quant.dtype.value if quant.is_quantized else None
                key = (T.table_key(kind, T.format_class(weight_format, input_dtype), shape), low, high)
                members[key] = members.get(key, 0) + 1
                prep = prepare(case)
                for cand in search.candidates_for(case.tokens * top_k // num_experts):
                    text = tiles_text.gemm_to_text(cand)
                    try:
                        result, out, layout = time_prepared(prep, cand)
                    except Exception as error:  # a candidate its kernel refuses or that does not lower
                        print(f"  skip {text}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                        continue
                    err = sampled_error(prep, layout, out)
                    us = result["us"]
                    print(f"  {fmt} {layout_name} T={case.tokens} {text}: {us:.1f} us err {err:.1e}", flush=True)
                    if err < 1e-2:
                        timings.setdefault(key, {}).setdefault(cand, []).append(result["us"])
    table = _existing_entries(args.out)  # other problems' and ranges' entries are kept
    for (name, low, high), by_config in timings.items():
        complete = {c: sum(t) for c, t in by_config.items() if len(t) == members[(name, low, high)]}
        if not complete:
            continue
        best = min(complete, key=complete.get)
        entry = T.Entry(low, high, best, round(max(by_config[best]), 1), args.out).to_json()
        table[name] = merge_entry(table.get(name, []), entry)
        print(f"{name} M in ({low}, {high}]: {tiles_text.gemm_to_text(best)} {by_config[best]} us", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), entries=table), f, indent=1)
    print(f"wrote {args.out}")
    return 0
