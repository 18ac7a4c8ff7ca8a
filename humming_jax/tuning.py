"""Kernel tiling: the tuning table and the default heuristic.

``valid_shape_m`` (an estimate of the real rows, static) picks an entry; the
table maps M ranges to :class:`TuningConfig` per layout and weight-format
class. Until a table tuned on the GPU is shipped the heuristic below fills in.
"""

from __future__ import annotations

import json
from importlib import resources

from humming_jax import formats as F
from humming_jax.configs import GemmLayout, TuningConfig, TuningEntry, select_tuning

TABLE_FILE = "tuning_h200.json"
LARGE_EXPERT_BYTES = 16 * 2**20


def format_class(fmt: F.WeightFormat) -> str:
    """Formats that tile alike share table entries: 16-bit weights, 8-bit
    weights, 4-bit integers (int4/uint4: word decode) and 4-bit floats (e2m1:
    MX/NV scales every 32/16 columns, which tile differently at decode)."""
    if not fmt.is_quantized:
        return "16bit"
    if not fmt.value_type.is_packed:
        return "8bit"
    return "fp4" if fmt.value_type.value == "float4_e2m1" else "4bit"


def _pow2_at_most(value: int, cap: int) -> int:
    size = 16
    while size * 2 <= min(value, cap):
        size *= 2
    return size


def heuristic_tuning(rows_per_expert: int, n: int, k: int, fmt_class: str = "16bit") -> TuningConfig:
    """Small row counts get thin M tiles and long K tiles (weight bandwidth),
    large ones big tiles (tensor-core throughput); the shapes are the ones the
    H200 sweeps picked (benchmarks/NOTES.md; 4-bit: :func:`_four_bit_tiles`)."""
    block_m = _pow2_at_most(max(rows_per_expert, 16), 128)
    cap_n = max(16, 1 << (max(n, 16) - 1).bit_length())
    cap_k = max(16, 1 << (max(k, 16) - 1).bit_length())
    # An expert whose weight outgrows L2 and whose rows span several row tiles
    # is read once per row tile unless the programs run in bands (tile_order).
    weight_bytes = n * k * {"16bit": 2.0, "8bit": 1.0}.get(fmt_class, 0.5)
    group_m = 8 if weight_bytes > LARGE_EXPERT_BYTES and rows_per_expert > 2 * block_m else 1
    four_bit = fmt_class in ("4bit", "fp4")
    if four_bit:
        return _four_bit_tiles(block_m, cap_n, cap_k, group_m, fmt_class)
    if block_m == 128:
        return TuningConfig(128, min(256, cap_n), min(64, cap_k), num_warps=8, num_stages=4, group_m=group_m)
    block_n = min(64 if block_m <= 32 else 128, cap_n)
    block_k = min(128 if block_m <= 32 else 64, cap_k)
    return TuningConfig(block_m, block_n, block_k, num_warps=4, num_stages=3)


def _four_bit_tiles(block_m: int, cap_n: int, cap_k: int, group_m: int, fmt_class: str = "4bit") -> TuningConfig:
    """The H200 sweeps' 4-bit winners by rows per program (v8/v9, NOTES.md):
    words decoded as nibble pairs (one MMA k-pair per 16-bit half) with the
    scales folded into the decoded tile; 16-row tiles read 256 columns of K
    per step (qwen3 T=16: int4 54 us, MXFP4 73 us), 64- and 128-row tiles put
    the decoded weight in the MMA's A operand (``swap_ab``; qwen3 T=2048: int4
    352 us on 128 rows, MXFP4 415 us on 64). 32 rows: the 16-row tile with two
    MMA rows per decoded weight (qwen3 T=512: int4 162 us). e2m1 weights on
    128 rows take 256 columns (qwen3 T=4096, MXFP4: 776 us against 936 for
    128: its costlier decode pays for twice the x reuse)."""
    pairs = dict(word_decode=True, fold_scales=True, pair_decode=True)
    if block_m <= 32:
        return TuningConfig(block_m, min(128, cap_n), min(256, cap_k), 4, 3, **pairs)
    warps = 8 if block_m == 128 else 4
    block_n = min(256 if block_m == 128 and fmt_class == "fp4" else 128, cap_n)
    return TuningConfig(block_m, block_n, min(128, cap_k), warps, 3, swap_ab=True, group_m=group_m, **pairs)


def load_table(name: str = TABLE_FILE) -> dict[str, tuple[TuningEntry, ...]]:
    """``{"<layout>/<format class>": entries}`` from the packaged JSON (empty if absent)."""
    try:
        text = resources.files("humming_jax").joinpath(name).read_text()
    except FileNotFoundError:
        return {}
    table = {}
    for key, entries in json.loads(text).get("entries", {}).items():
        table[key] = tuple(
            TuningEntry(e["min_shape_m"], e["max_shape_m"], TuningConfig(**e["config"])) for e in entries
        )
    return table


_TABLE: dict[str, tuple[TuningEntry, ...]] | None = None


def table_key(layout: GemmLayout | str, fmt_class: str, shape: tuple[int, int, int] | None = None) -> str:
    """``"<layout>/<format class>"``, or with ``shape = (E, N, K)`` the key of
    entries for that weight shape only (``"…@E=8,N=28672,K=4096"``, as vLLM
    keys its MoE configs by E and N): the same M means 1024 rows per expert on
    mixtral and 64 on qwen3, which tile differently."""
    base = f"{GemmLayout(layout).value}/{fmt_class}"
    return base if shape is None else f"{base}@E={shape[0]},N={shape[1]},K={shape[2]}"


def choose_tuning(
    layout: GemmLayout, fmt: F.WeightFormat, valid_shape_m: int, num_experts: int, n: int, k: int
) -> TuningConfig:
    """The table's entry for this weight shape, else for the format class,
    else the heuristic."""
    global _TABLE
    if _TABLE is None:
        _TABLE = load_table()
    fmt_class = format_class(fmt)
    for key in (table_key(layout, fmt_class, (num_experts, n, k)), table_key(layout, fmt_class)):
        entries = _TABLE.get(key, ())
        if any(e.min_shape_m < valid_shape_m <= e.max_shape_m for e in entries):
            return select_tuning(entries, valid_shape_m)
    rows = valid_shape_m if layout == GemmLayout.DENSE else max(1, valid_shape_m // max(num_experts, 1))
    return heuristic_tuning(rows, n, k, fmt_class)
