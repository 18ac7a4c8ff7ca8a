"""One text form for every tile config: ``field=value`` pairs joined by commas
(``block_m=16,block_n=64,word_decode=1``), fields left out at their defaults.
A GEMM tiling carries its kernel's name first (``mosaic:block_m=128,...``).
Used by the CLI, the benchmarks and the tuning table's tools."""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_kernels import gemm as gemm_kernels


def to_text(tiles: Any) -> str:
    """The fields of ``tiles`` (a frozen dataclass) that differ from their defaults."""
    parts = []
    for field in dataclasses.fields(tiles):
        value = getattr(tiles, field.name)
        if value != field.default:
            parts.append(f"{field.name}={int(value) if isinstance(value, bool) else value}")
    return ",".join(parts)


def from_text(cls: type, text: str) -> Any:
    """``cls`` built from :func:`to_text`'s form (bools as 0/1); a bad field raises ``ValueError``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, raw = part.partition("=")
        if not sep or name not in fields:
            raise ValueError(
                f"{cls.__qualname__}: expected name=value pairs with names from {', '.join(fields)}, got {part!r}"
            )
        try:
            number = int(raw)
        except ValueError:
            raise ValueError(f"{cls.__qualname__}.{name}: expected an integer, got {raw!r}") from None
        values[name] = bool(number) if isinstance(fields[name].default, bool) else number
    return cls(**values)


def gemm_to_text(tiles: Any) -> str:
    """``impl:fields`` for a GEMM tiling (``triton:...`` or ``mosaic:...``)."""
    # The exact type: a kernel's Tiles may subclass another's (mosaic_mid.Tiles).
    impl = next(name for name, cls in gemm_kernels.IMPLS.items() if type(tiles) is cls)
    return f"{impl}:{to_text(tiles)}"


def gemm_from_text(text: str) -> Any:
    """A GEMM tiling from ``impl:fields`` (a bare field list is a Triton tiling)."""
    impl, sep, fields = text.partition(":")
    if not sep:
        impl, fields = "triton", text
    if impl not in gemm_kernels.IMPLS:
        raise ValueError(f"GEMM tiles: the kernel must be one of {', '.join(gemm_kernels.IMPLS)}, got {impl!r}")
    return from_text(gemm_kernels.IMPLS[impl], fields)
