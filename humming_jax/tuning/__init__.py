"""GEMM tiling: the per-device tuning table (data: ``<device>.json`` beside
this file), the heuristic, and the search space ``python -m humming_jax tune``
sweeps. :func:`candidates` lists, in order, the tilings a call may run; the op
runs the first whose kernel ``supports`` it."""

import dataclasses

from humming_jax.tuning.heuristic import DEQUANTIZE_MIN_ROWS, for_block, heuristic_candidates, rows_per_expert
from humming_jax.tuning.table import Entry, format_class, load_table, table_entries, table_key, table_path
from pallas_kernels.gemm import mosaic, mosaic_fp8, triton

# Rows an expert under which 4-bit weights with fp8 inputs run as the weight-only
# format (a few rows multiplied out cost less than a promotion per input-scale span).
DEQUANTIZE_INPUT_MAX_ROWS = 32

__all__ = [
    "DEQUANTIZE_INPUT_MAX_ROWS",
    "DEQUANTIZE_MIN_ROWS",
    "Entry",
    "candidates",
    "format_class",
    "heuristic_candidates",
    "indexed_block_rows",
    "load_table",
    "rows_per_expert",
    "table_entries",
    "table_key",
    "table_path",
]


def candidates(
    layout: str,
    fmt,
    valid_shape_m: int,
    num_experts: int,
    n: int,
    k: int,
    block_size: int | None = None,
    half_bits: bool = False,
    input_dtype: str | None = None,
) -> list:
    """The table's entry for this call (its weight shape's, else its format
    class's), then the heuristic's tilings. ``block_size``: an indexed
    layout's alignment block — a tile is one block, so an entry's Triton tile
    runs with that many rows (:func:`for_block`) and a Mosaic entry of other
    rows is left out; ``half_bits``: see
    :func:`heuristic_candidates`; ``input_dtype``: a quantized input's values (:func:`format_class`).
    4-bit weights with fp8 inputs at decode (under :data:`DEQUANTIZE_INPUT_MAX_ROWS`
    rows an expert) take, after their own entries, the weight-only format's
    entries with the input multiplied out first (``dequantize_input``)."""
    entries = [e.tiles for e in table_entries(layout, fmt, valid_shape_m, num_experts, n, k, input_dtype)]
    rows = rows_per_expert(layout, valid_shape_m, num_experts)
    if format_class(fmt, input_dtype) in ("4bit-a8", "fp4-a8") and rows < DEQUANTIZE_INPUT_MAX_ROWS:
        weight_only = [e.tiles for e in table_entries(layout, fmt, valid_shape_m, num_experts, n, k)]
        entries += [dataclasses.replace(t, dequantize_input=True) for t in weight_only if _multiplies_out(t)]
    if block_size is not None:  # a Mosaic tile is one block: one of other rows cannot take the call
        entries = [
            for_block(t, block_size) if isinstance(t, triton.Tiles) else t
            for t in entries
            if isinstance(t, triton.Tiles) or t.block_m == block_size
        ]
    return entries + heuristic_candidates(
        rows,
        n,
        k,
        fmt,
        block_size,
        half_bits,
        input_dtype,
        num_experts,
        indexed=layout == "indexed",
        total_rows=valid_shape_m,
    )


def _multiplies_out(tiles) -> bool:
    """Whether ``tiles``' kernel can multiply a scaled input out before its product."""
    return any(f.name == "dequantize_input" for f in dataclasses.fields(tiles))


def indexed_block_rows(listed: list) -> int | None:
    """The rows of the first of ``listed`` whose kernel runs an indexed layout
    one tile a block (every kernel: the Mosaic ones on rows gathered in block
    order): the layout's alignment block (None if none does)."""
    rows = [t.block_m for t in listed if isinstance(t, (triton.Tiles, mosaic.Tiles, mosaic_fp8.Tiles))]
    return rows[0] if rows else None
