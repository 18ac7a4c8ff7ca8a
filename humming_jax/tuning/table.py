"""The tuning table: per device, entries keyed by layout and format class (or
by weight shape, which takes precedence), each an M range and exactly the
tiling that runs there (``impl`` + ``tiles``), with the time it measured and
the results file it came from."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from importlib import resources
from typing import Any

import jax

from humming_jax import formats as F
from humming_jax import tiles_text
from pallas_kernels import gemm as gemm_kernels

# Device kind -> table file. Devices without a table of their own use the H200's:
# its Mosaic entries are refused off Hopper and the heuristic takes those calls.
TABLES = {"NVIDIA H200": "h200.json"}
DEFAULT_TABLE = "h200.json"


@dataclasses.dataclass(frozen=True)
class Entry:
    """``tiles`` runs when ``min_shape_m < valid_shape_m <= max_shape_m``."""

    min_shape_m: int
    max_shape_m: int
    tiles: Any  # a kernel's Tiles (triton.Tiles, mosaic.Tiles)
    us: float | None = None
    source: str | None = None

    def to_json(self) -> dict:
        impl = tiles_text.gemm_to_text(self.tiles).split(":")[0]
        fields = {
            f.name: getattr(self.tiles, f.name)
            for f in dataclasses.fields(self.tiles)
            if getattr(self.tiles, f.name) != f.default
        }
        return dict(
            min_shape_m=self.min_shape_m,
            max_shape_m=self.max_shape_m,
            impl=impl,
            tiles=fields,
            us=self.us,
            source=self.source,
        )

    @classmethod
    def from_json(cls, data: dict) -> Entry:
        impl = data["impl"]
        if impl not in gemm_kernels.IMPLS:
            raise ValueError(f"tuning table: impl must be one of {', '.join(gemm_kernels.IMPLS)}, got {impl!r}")
        tiles = gemm_kernels.IMPLS[impl](**data["tiles"])
        return cls(data["min_shape_m"], data["max_shape_m"], tiles, data.get("us"), data.get("source"))


def format_class(fmt: F.WeightFormat, input_dtype: str | None = None) -> str:
    """Formats that tile alike share entries: 16-bit weights, 8-bit weights,
    4-bit integers (int4/uint4) and 4-bit floats (e2m1: MX/NV scales every
    32/16 columns, which tile differently at decode); with a quantized input
    whose values are ``input_dtype`` (an :class:`~humming_jax.input_quant.ActivationDType`
    value) the class is suffixed ``-a8`` (e4m3/e5m2), ``-i8`` (int8: integer
    products) or ``-a4`` (e2m1): their scales multiply each span's product, and
    other tiles win."""
    if not fmt.is_quantized:
        weight = "16bit"
    elif not fmt.value_type.is_packed:
        weight = "8bit"
    else:
        weight = "fp4" if fmt.value_type.value == "float4_e2m1" else "4bit"
    if input_dtype is None:
        return weight
    suffix = {"float8_e4m3": "a8", "float8_e5m2": "a8", "int8": "i8", "float4_e2m1": "a4"}.get(input_dtype)
    if suffix is None:
        raise ValueError(f"input_dtype: expected float8_e4m3, float8_e5m2, int8 or float4_e2m1, got {input_dtype!r}")
    return f"{weight}-{suffix}"


def table_key(layout: str, fmt_class: str, shape: tuple[int, int, int] | None = None) -> str:
    """``"<layout>/<format class>"``, or with ``shape = (E, N, K)`` the key of
    entries for that weight shape only (``"…@E=8,N=28672,K=4096"``, as vLLM
    keys its MoE configs by E and N): the same M means 1024 rows per expert on
    mixtral and 64 on qwen3, which tile differently."""
    base = f"{layout}/{fmt_class}"
    return base if shape is None else f"{base}@E={shape[0]},N={shape[1]},K={shape[2]}"


TABLE_ENV = "HUMMING_JAX_TUNING"  # a table file of one's own (what `tune --out` writes), used in place of ours


def table_path(name: str | None = None):
    """The table file: the packaged file ``name``; without one, the file
    ``$HUMMING_JAX_TUNING`` names if set, else the packaged table of the
    default device."""
    if name is None and os.environ.get(TABLE_ENV):
        return pathlib.Path(os.environ[TABLE_ENV])
    if name is None:
        name = TABLES.get(str(jax.devices()[0].device_kind), DEFAULT_TABLE)
    return resources.files("humming_jax.tuning").joinpath(name)


def parse_table(text: str) -> dict[str, tuple[Entry, ...]]:
    return {key: tuple(Entry.from_json(e) for e in entries) for key, entries in json.loads(text)["entries"].items()}


def load_table(name: str | None = None) -> dict[str, tuple[Entry, ...]]:
    """``{key: entries}`` of the table :func:`table_path` names (empty if the
    packaged one does not exist; a missing ``$HUMMING_JAX_TUNING`` file raises)."""
    path = table_path(name)
    if name is None and os.environ.get(TABLE_ENV) and not path.is_file():
        raise FileNotFoundError(f"{TABLE_ENV}={os.environ[TABLE_ENV]!r}: no such tuning table file")
    return _read_table(str(path))


@functools.cache
def _read_table(path: str) -> dict[str, tuple[Entry, ...]]:
    try:
        text = pathlib.Path(path).read_text()
    except FileNotFoundError:
        return {}
    return parse_table(text)


# A layout without entries of its own takes another's: the masked layout runs the grouped
# kernels on each expert's rows as the contiguous one does (vLLM's batched experts read the
# fused-MoE configs too).
ENTRIES_OF = {"grouped_masked": "grouped_contiguous"}


def table_entries(
    layout: str,
    fmt: F.WeightFormat,
    valid_shape_m: int,
    num_experts: int,
    n: int,
    k: int,
    input_dtype: str | None = None,
) -> list[Entry]:
    """The entry whose M range holds ``valid_shape_m`` under the weight shape's
    key, else under the format class's (a shape's entry is not backed by the
    class's: the heuristic takes what its kernel refuses); then, for a layout
    with none, the same under :data:`ENTRIES_OF`'s layout; empty if none has one.
    ``input_dtype``: a quantized input's values (:func:`format_class`)."""
    table = load_table()
    fmt_class = format_class(fmt, input_dtype)
    for listed in (layout, ENTRIES_OF.get(layout)):
        keys = (table_key(listed, fmt_class, (num_experts, n, k)), table_key(listed, fmt_class)) if listed else ()
        for key in keys:
            found = [e for e in table.get(key, ()) if e.min_shape_m < valid_shape_m <= e.max_shape_m]
            if found:
                return found
    return []
