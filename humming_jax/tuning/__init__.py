"""GEMM tiling: the per-device tuning table (data: ``<device>.json`` beside
this file), the heuristic, and the search space ``python -m humming_jax tune``
sweeps. :func:`candidates` lists, in order, the tilings a call may run; the op
runs the first whose kernel ``supports`` it."""

from humming_jax.tuning.heuristic import DEQUANTIZE_MIN_ROWS, for_block, heuristic_candidates, rows_per_expert
from humming_jax.tuning.table import Entry, format_class, load_table, table_entries, table_key, table_path
from pallas_kernels.gemm import mosaic_fp8, triton

__all__ = [
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
    runs with that many rows (:func:`for_block`); ``half_bits``: see
    :func:`heuristic_candidates`; ``input_dtype``: a quantized input's values (:func:`format_class`)."""
    entries = [e.tiles for e in table_entries(layout, fmt, valid_shape_m, num_experts, n, k, input_dtype)]
    if block_size is not None:
        entries = [for_block(t, block_size) if isinstance(t, triton.Tiles) else t for t in entries]
    rows = rows_per_expert(layout, valid_shape_m, num_experts)
    return entries + heuristic_candidates(
        rows, n, k, fmt, block_size, half_bits, input_dtype, num_experts, indexed=layout == "indexed"
    )


def indexed_block_rows(listed: list) -> int | None:
    """The rows of the first of ``listed`` whose kernel runs an indexed layout
    one tile a block (the Triton tile, the fp8 Mosaic kernel): the layout's
    alignment block (None if none does)."""
    rows = [t.block_m for t in listed if isinstance(t, (triton.Tiles, mosaic_fp8.Tiles))]
    return rows[0] if rows else None
