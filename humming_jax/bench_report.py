"""The GEMM bench's comparison with Humming, summed up: per format the
geometric mean and the largest of our time over Humming's across the cases
that have both (the issues' targets are written in these), and a plot of the
ratio against T."""

from __future__ import annotations

import math


def humming_summary(rows: list[dict]) -> list[dict]:
    """Per format (and layout, and all layouts): ``cases``, ``geomean`` and
    ``max`` of ``x_humming`` over the rows that have it, and the worst case's
    ``(problem, layout, gemm, tokens)``."""
    found = []
    formats = sorted({r["fmt"] for r in rows if r.get("x_humming")})
    for fmt in formats:
        for layout in (None, *sorted({r["layout"] for r in rows if r["fmt"] == fmt})):
            mine = [r for r in rows if r["fmt"] == fmt and r.get("x_humming") and layout in (None, r["layout"])]
            if not mine:
                continue
            ratios = [r["x_humming"] for r in mine]
            worst = max(mine, key=lambda r: r["x_humming"])
            found.append(
                dict(
                    fmt=fmt,
                    layout=layout or "all",
                    cases=len(mine),
                    geomean=math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
                    max=worst["x_humming"],
                    worst=(worst["problem"], worst["layout"], worst["gemm"], worst["tokens"]),
                )
            )
    return found


def summary_lines(summary: list[dict]) -> list[str]:
    """One printed line per :func:`humming_summary` entry."""
    return [
        f"x humming {s['fmt']} {s['layout']}: {s['cases']} cases, geomean {s['geomean']:.2f}, "
        f"max {s['max']:.2f} ({' '.join(map(str, s['worst']))})"
        for s in summary
    ]


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_humming(rows: list[dict], path: str) -> bool:
    """Our time over Humming's against T, a panel per format, a line per
    (problem, layout, gemm) (PNG); False without matplotlib or rows to plot."""
    rows = [r for r in rows if r.get("x_humming")]
    plt = pyplot()
    if not rows or plt is None:
        return False
    formats = sorted({r["fmt"] for r in rows})
    fig, axes = plt.subplots(1, len(formats), figsize=(5 * len(formats), 4), squeeze=False)
    for col, fmt in enumerate(formats):
        ax = axes[0][col]
        mine = [r for r in rows if r["fmt"] == fmt]
        for key in sorted({(r["problem"], r["layout"], r["gemm"]) for r in mine}):
            line = sorted((r for r in mine if (r["problem"], r["layout"], r["gemm"]) == key), key=lambda r: r["tokens"])
            ax.plot([r["tokens"] for r in line], [r["x_humming"] for r in line], marker="o", label=" ".join(key))
        ax.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
        ax.set(xscale="log", title=fmt, xlabel="T", ylabel="time / Humming's")
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
