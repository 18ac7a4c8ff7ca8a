"""Independent float64 NumPy implementations used to check the references.

Nothing here calls humming_jax: the bit layouts are decoded from their
definitions (DESIGN §3.1, humming_jax.numerics docstring) and every routing
rule is written as a plain Python loop.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E2M1_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def unpack(packed: np.ndarray) -> np.ndarray:
    packed = np.asarray(packed, np.uint8)
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def e4m3_from_bits(bits: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bit patterns -> float64 by the format's definition."""
    bits = np.asarray(bits, np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = 2.0 ** (exponent - 7) * (1 + mantissa / 8)
    subnormal = 2.0**-6 * (mantissa / 8)
    value = sign * np.where(exponent == 0, subnormal, normal)
    return np.where((bits & 0x7F) == 0x7F, np.nan, value)


def f8(array) -> np.ndarray:
    """A float8 e4m3 array (any framework) as float64, via its bits."""
    return e4m3_from_bits(np.asarray(array).view(np.uint8))


def to64(array) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype == ml_dtypes.float8_e4m3fn:
        return f8(array)
    return array.astype(np.float64)


def scale_blocks(fmt, gate_up_block: int = 0):
    """Block scales cover ``block_n`` x ``group_size`` elements (the last block of
    an axis partial) — a w13 interleaved by fewer rows stores one scale an
    interleaved block —; other scales None (their shape says what they cover)."""
    if fmt.scale_granularity.value != "block":
        return None
    rows = gate_up_block if 0 < gate_up_block < fmt.block_n else fmt.block_n
    return (1, rows, fmt.group_size)


def expand(scale: np.ndarray, shape, blocks=None) -> np.ndarray:
    """``scale`` repeated over ``shape``: each entry over ``blocks[axis]`` elements
    (default: the shape over the entries, rounded up), the last block partial."""
    out = scale
    for axis, n in enumerate(shape):
        entries = out.shape[axis]
        block = math.ceil(n / entries) if blocks is None else blocks[axis]
        if block != 1:
            out = np.repeat(out, block, axis=axis).take(range(n), axis=axis)
    return out


def gate_up_rows(n: int, block: int) -> np.ndarray:
    """Stored row r of a w13 interleaved by ``block`` holds logical row
    ``gate_up_rows(n, block)[r]``: blocks of gate rows and up rows in turn."""
    rows = []
    for pair in range(n // (2 * block)):
        rows.extend(range(pair * block, (pair + 1) * block))
        rows.extend(range(n // 2 + pair * block, n // 2 + (pair + 1) * block))
    return np.asarray(rows)


def dequantize_weight(weight, stored_rows: bool = False) -> np.ndarray:
    """Dequantize a QuantizedWeight from its stored arrays, in float64, rows in
    their logical order (a w13's gate rows, then up rows) unless
    ``stored_rows``. Planar codes (what quantize_experts and load_experts give)
    are put back in K order by the library's inverse first; test_formats
    checks the planar order itself against NumPy."""
    values = _dequantize_stored(weight)
    if weight.gate_up_block and not stored_rows:
        logical = np.empty_like(values)
        logical[:, gate_up_rows(weight.shape[1], weight.gate_up_block)] = values
        return logical
    return values


def _dequantize_stored(weight) -> np.ndarray:
    """:func:`dequantize_weight` in the stored row order."""
    if weight.nibble_unit:
        from humming_jax.formats import to_k_order

        weight = to_k_order(weight)
    fmt = weight.format
    vt = fmt.value_type.value
    values = np.asarray(weight.values)
    if vt == "int4":
        v = unpack(values).astype(np.float64) - 8
    elif vt == "uint4":
        v = unpack(values).astype(np.float64)
    elif vt == "float4_e2m1":
        v = E2M1_TABLE[unpack(values)]
    else:
        v = to64(values)
    if not fmt.is_quantized:
        return v

    def along_k(per_group):  # per-group values for every column (act-order: by group_index)
        if weight.group_index is None:
            return expand(per_group, v.shape)
        gi = np.asarray(weight.group_index)
        return np.stack([per_group[e][:, gi[e]] for e in range(v.shape[0])])

    if fmt.zero_point.value == "int":
        groups = weight.shape[2] // fmt.group_size
        v = v - along_k(unpack(np.asarray(weight.zero_point))[..., :groups].astype(np.float64))
    elif fmt.zero_point.value == "float":
        v = v - along_k(to64(weight.zero_point))
    scale = np.asarray(weight.scale)
    if weight.k_major_scales:  # stored [E, K/g, N]
        scale = np.swapaxes(scale, 1, 2)
    scale = 2.0 ** (scale.astype(np.float64) - 127) if fmt.scale_type.value == "e8m0" else to64(scale)
    blocks = scale_blocks(fmt, weight.gate_up_block)
    out = v * (along_k(scale) if fmt.scale_granularity.value == "group" else expand(scale, v.shape, blocks))
    if weight.second_scale is not None:
        second = np.asarray(weight.second_scale, np.float64)
        out = out * (second.reshape(-1, 1, 1) if second.shape[0] == weight.shape[0] else second[0])
    return out


E4M3_GRID = e4m3_from_bits(np.arange(0x7F))  # the finite non-negative e4m3 values, code order
E2M1_GRID = E2M1_TABLE[:8]


def round_to_grid(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Non-negative ``v`` to the nearest value of ``grid`` (ascending, index =
    code), ties to the even code, saturating at the largest value."""
    v = np.minimum(np.asarray(v, np.float64), grid[-1])
    idx = np.clip(np.searchsorted(grid, v), 1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    up = (v - lo > hi - v) | ((v - lo == hi - v) & (idx % 2 == 0))
    return np.where(up, hi, lo)


def shifted_mxfp4(weight, span: int = 128) -> np.ndarray:
    """An MXFP4 weight (float64) as the GEMM's shifted e2m1 path computes it:
    in each span of ``span`` columns, the e2m1 values of group g times
    ``2**(s_g - s_max + 6)`` rounded to e4m3 (nearest, ties to even), times
    ``2**(s_max - 127 - 6)``."""
    if weight.nibble_unit or weight.k_major_scales:
        from humming_jax.formats import to_k_order

        weight = to_k_order(weight)
    v = E2M1_TABLE[unpack(np.asarray(weight.values))]
    e, n, k = v.shape
    g = weight.format.group_size
    s = np.asarray(weight.scale).astype(np.float64)[..., : k // g]
    top = s.reshape(e, n, k // span, span // g).max(axis=-1)
    top = np.repeat(top, span // g, axis=-1)
    shifted = v * expand(2.0 ** (s - top + 6), v.shape)
    rounded = np.sign(shifted) * round_to_grid(np.abs(shifted), E4M3_GRID)
    return rounded * expand(2.0 ** (top - 127 - 6), v.shape)


def near_midpoint(v: np.ndarray, grid: np.ndarray, rel: float = 1e-6) -> np.ndarray:
    """Where ``v`` lies within ``rel`` (relative) of a rounding boundary of ``grid``."""
    mids = (grid[:-1] + grid[1:]) / 2
    v = np.asarray(v, np.float64)
    nearest = np.min(np.abs(v[..., None] - mids), axis=-1)
    return nearest <= rel * np.maximum(np.abs(v), 1e-30)


def dequantize_input(q) -> np.ndarray:
    spec = q.spec
    if spec.mode.value == "none":
        return to64(q.values)
    values = np.asarray(q.values)
    v = E2M1_TABLE[unpack(values)] if spec.dtype.value == "float4_e2m1" else to64(values)
    scale = np.asarray(q.scale)
    scale = 2.0 ** (scale.astype(np.float64) - 127) if spec.scale_type.value == "e8m0" else to64(scale)
    if spec.mode.value == "static_tensor":
        return v * scale.reshape(1, 1)
    if spec.mode.value == "dynamic_token":
        return v * scale.reshape(-1, 1)
    if q.scale_2 is not None:
        scale = scale * np.asarray(q.scale_2, np.float64).reshape(-1, 1)
    return v * np.repeat(scale, spec.group_size, axis=1)


# ---- activations -----------------------------------------------------------

_erf = np.vectorize(math.erf)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def gelu(x):
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def activation(x: np.ndarray, kind: str, limit: float | None = None) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if kind == "silu_no_mul":
        return silu(x)
    if kind == "gelu_no_mul":
        return gelu(x)
    if kind == "gelu_tanh_no_mul":
        return gelu_tanh(x)
    if kind == "relu2_no_mul":
        return np.maximum(x, 0) ** 2
    if kind == "swigluoai":
        g, u = x[..., 0::2], x[..., 1::2]
        lim = 7.0 if limit is None else limit
        g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
        return g * sigmoid(1.702 * g) * (u + 1)
    half = x.shape[-1] // 2
    g, u = x[..., :half], x[..., half:]
    if kind == "silu":
        if limit is not None:
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        return silu(g) * u
    if kind == "gelu":
        return gelu(g) * u
    if kind == "gelu_tanh":
        return gelu_tanh(g) * u
    if kind == "swiglustep":
        lim = 7.0 if limit is None else limit
        return np.minimum(silu(g), lim) * np.clip(u, -lim, lim)
    raise ValueError(kind)


# ---- routing ---------------------------------------------------------------


SMALL_EXPERTS = 8
SMALL_EXPERT_MAP = np.array([0, -1, 1, 2, -1, 3, -1, -1], np.int32)  # 4 local experts, 4 elsewhere
ROUTING_SHAPES = ("uniform", "hot", "map", "empty")


def small_routing(rng, num_tokens: int, top_k: int, shape: str):
    """``(topk_ids [T, k] int32, expert_map or None, local experts)`` over
    ``SMALL_EXPERTS``: uniform ids, every slot on expert 3 (``hot``), uniform
    ids with half the experts elsewhere (``map``), or every id invalid
    (``empty``: nothing to compute)."""
    ids = rng.integers(0, SMALL_EXPERTS, size=(num_tokens, top_k)).astype(np.int32)
    if shape == "hot":
        ids[:] = 3
    elif shape == "empty":
        ids[:] = SMALL_EXPERTS + 1
    expert_map = SMALL_EXPERT_MAP if shape == "map" else None
    return ids, expert_map, 4 if expert_map is not None else SMALL_EXPERTS


def slot_local_expert(ids, num_experts, expert_map=None):
    """Per flattened slot: local expert id or -1 if invalid."""
    flat = np.asarray(ids).reshape(-1)
    out = []
    for e in flat:
        if not 0 <= e < num_experts:
            out.append(-1)
        elif expert_map is None:
            out.append(int(e))
        else:
            out.append(int(expert_map[e]))
    return out


def align(ids, block_size, num_experts, expert_map=None, ignore_invalid=False, num_local=None):
    """moe_align_block_size by a Python loop over experts."""
    ids = np.asarray(ids)
    num_slots = ids.size
    length = num_slots + num_experts * (block_size - 1)
    if num_slots < num_experts:
        length = min(length, num_slots * block_size)
    flat = ids.reshape(-1)
    if expert_map is not None and not ignore_invalid:
        groups = list(range(num_experts))
        member = [int(e) if 0 <= e < num_experts else -1 for e in flat]
        block_label = lambda g: int(expert_map[g])  # noqa: E731
    else:
        n_groups = num_experts if expert_map is None else (num_local or num_experts)
        groups = list(range(n_groups))
        member = [e if e < n_groups else -1 for e in slot_local_expert(ids, num_experts, expert_map)]
        block_label = lambda g: g  # noqa: E731
    sorted_ids, expert_ids = [], []
    for g in groups:
        slots = [s for s in range(num_slots) if member[s] == g]
        if not slots:
            continue
        padded = -(-len(slots) // block_size) * block_size
        sorted_ids += slots + [num_slots] * (padded - len(slots))
        expert_ids += [block_label(g)] * (padded // block_size)
    total = len(sorted_ids)
    sorted_ids += [s for s in range(num_slots) if member[s] < 0]  # the dropped slots, after the groups
    sorted_ids += [num_slots] * (length - len(sorted_ids))
    expert_ids += [-1] * (-(-length // block_size) - len(expert_ids))
    return np.array(sorted_ids), np.array(expert_ids), total


def prepare_scatter(ids, num_experts, expert_map=None, num_local=None):
    num_local = num_local or num_experts
    local = slot_local_expert(ids, num_experts, expert_map)
    local = [e if e < num_local else -1 for e in local]
    counts = [local.count(e) for e in range(num_local)]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    dest = np.zeros(len(local), np.int64)
    fill = list(offsets[:-1])
    tail = offsets[-1]
    for s, e in enumerate(local):
        if e >= 0:
            dest[s] = fill[e]
            fill[e] += 1
        else:
            dest[s] = tail
            tail += 1
    return offsets, dest.reshape(np.asarray(ids).shape)


def grouped_rows(offsets, m):
    """Expert of each row of a grouped-contiguous input (-1 outside every
    group). Offsets read clipped to ``[0, m]`` and made non-decreasing by a
    running maximum (DESIGN: no row has two owners)."""
    owned, run = [], 0
    for o in np.asarray(offsets).tolist():
        run = max(run, min(max(int(o), 0), m))
        owned.append(run)
    expert = np.full(m, -1)
    for e in range(len(owned) - 1):
        expert[owned[e] : owned[e + 1]] = e
    return expert


def gemm(x64, w64, bias64, layout_kind, **layout):
    """out rows per layout, float64."""
    num_experts, n, _ = w64.shape
    m = x64.shape[0]

    def row(r_in, e):
        y = x64[r_in] @ w64[e].T
        return y + (bias64[e] if bias64 is not None else 0)

    if layout_kind == "dense":
        return np.stack([row(r, 0) for r in range(m)])
    if layout_kind == "grouped_contiguous":
        experts = grouped_rows(np.asarray(layout["offsets"]), m)
        return np.stack([row(r, e) if e >= 0 else np.zeros(n) for r, e in enumerate(experts)])
    if layout_kind == "grouped_masked":
        counts = np.asarray(layout["counts"])
        max_tokens = m // num_experts
        out = np.zeros((m, n))
        for e in range(num_experts):
            for i in range(min(max(int(counts[e]), 0), max_tokens)):
                out[e * max_tokens + i] = row(e * max_tokens + i, e)
        return out
    if layout_kind == "indexed":
        sorted_ids, expert_ids = np.asarray(layout["sorted_ids"]), np.asarray(layout["expert_ids"])
        top_k, block, padded = layout["top_k"], layout["block_size"], int(np.asarray(layout["padded"]).reshape(-1)[0])
        out = np.zeros((m * top_k, n))
        for p in range(min(padded, len(sorted_ids))):
            idx, e = int(sorted_ids[p]), int(expert_ids[p // block])
            if 0 <= idx < m * top_k and 0 <= e < num_experts:
                out[idx] = row(idx // top_k, e)
        return out
    raise ValueError(layout_kind)


def deepseek_v3_route(logits, bias, top_k, num_groups, topk_groups, scale):
    """DeepSeek-V3's router, token by token in float64 (sigmoid scores; groups
    scored by the sum of their two best biased scores; experts chosen by biased
    score inside the best groups; weights from the unbiased scores,
    renormalized, times the routed scaling factor)."""
    scores = 1 / (1 + np.exp(-logits))
    size = logits.shape[1] // num_groups
    weights, ids = [], []
    for row in scores + bias:
        group_scores = [np.sort(row[g * size : (g + 1) * size])[-2:].sum() for g in range(num_groups)]
        kept = np.argsort(group_scores)[::-1][:topk_groups]
        allowed = np.concatenate([np.arange(g * size, (g + 1) * size) for g in kept])
        chosen = allowed[np.argsort(row[allowed])[::-1][:top_k]]
        ids.append(chosen)
    ids = np.array(ids)
    weights = np.take_along_axis(scores, ids, -1)
    return weights / weights.sum(-1, keepdims=True) * scale, ids


def softmax_route(logits, top_k: int, renormalize: bool):
    """Softmax top-k routing in float64: (weights, ids)."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(p, ids, -1)
    return (weights / weights.sum(-1, keepdims=True) if renormalize else weights), ids


def layout_fields(layout) -> tuple[str, dict]:
    """(kind, fields) of a GEMM layout object for :func:`gemm`, read from its
    arrays by attribute name."""
    name = type(layout).__name__
    if name == "Dense":
        return "dense", {}
    if name == "GroupedContiguous":
        return "grouped_contiguous", dict(offsets=np.asarray(layout.expert_offsets))
    if name == "GroupedMasked":
        return "grouped_masked", dict(counts=np.asarray(layout.expert_num_tokens))
    if name == "Indexed":
        return "indexed", dict(
            sorted_ids=np.asarray(layout.sorted_ids),
            expert_ids=np.asarray(layout.expert_ids),
            padded=np.asarray(layout.num_tokens_padded),
            top_k=layout.top_k,
            block_size=layout.block_size,
        )
    raise ValueError(name)


def gemm_of(x, weight, layout, bf16_weight: bool = False) -> np.ndarray:
    """:func:`gemm` of an input (an array or a quantized input), a quantized
    weight and a layout object, float64; ``bf16_weight`` rounds the dequantized
    weight once to bf16 (what a kernel with folded scales multiplies)."""
    x64 = dequantize_input(x) if hasattr(x, "spec") else to64(x)
    w64 = dequantize_weight(weight)
    if bf16_weight:
        w64 = w64.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # as f32 math rounds
    b64 = None if weight.bias is None else to64(weight.bias)
    if b64 is not None and weight.gate_up_block:  # the bias of the logical rows, as dequantize_weight gives them
        logical = np.empty_like(b64)
        logical[:, gate_up_rows(weight.shape[1], weight.gate_up_block)] = b64
        b64 = logical
    kind, fields = layout_fields(layout)
    return gemm(x64, w64, b64, kind, **fields)


def relative_error(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or Inf in ``out`` fails."""
    out = to64(out)
    assert np.all(np.isfinite(out)), "output has NaN or Inf"
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
