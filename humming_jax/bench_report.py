"""The GEMM bench's comparison with Humming, summed up: per format the
geometric mean and the largest of our time over Humming's across the cases
that have both (the issues' targets are written in these), and a plot of the
ratio against T; ``python -m humming_jax report`` does the same over several
runs merged (:func:`report_main`)."""

from __future__ import annotations

import math
from collections.abc import Callable


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


CASE_FIELDS = ("fmt", "problem", "layout", "gemm", "tokens")


def merge_rows(runs: list[list[dict]]) -> list[dict]:
    """The rows of several bench runs, one per case (:data:`CASE_FIELDS`): a
    later run's row replaces an earlier one's (runs in the order measured)."""
    merged: dict[tuple, dict] = {}
    for rows in runs:
        for r in rows:
            merged[tuple(r[f] for f in CASE_FIELDS)] = r
    return list(merged.values())


def against_faster(row: dict) -> float | None:
    """Our time over the faster of Humming's live time and its anchor's (the
    live one can hold a launch the anchor's CUDA-graph time does not); None
    without either."""
    times = [t for t in (row.get("humming_us"), row.get("anchor_humming_us")) if t]
    return row["us"] / min(times) if times and row.get("us") else None


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def by_tokens(rows: list[dict], ratio: Callable[[dict], float | None] = against_faster) -> list[dict]:
    """Per format: the cases with a ratio (``ratio(row)``), their geometric
    mean and largest, how many exceed 1.25, and the geometric mean at each T."""
    found = []
    for fmt in sorted({r["fmt"] for r in rows}):
        pairs = [(r, ratio(r)) for r in rows if r["fmt"] == fmt]
        pairs = [(r, x) for r, x in pairs if x]
        if not pairs:
            continue
        values = [x for _, x in pairs]
        tokens = sorted({r["tokens"] for r, _ in pairs})
        found.append(
            dict(
                fmt=fmt,
                cases=len(values),
                geomean=_geomean(values),
                max=max(values),
                above_1_25=sum(x > 1.25 for x in values),
                by_tokens={t: _geomean([x for r, x in pairs if r["tokens"] == t]) for t in tokens},
            )
        )
    return found


def by_tokens_lines(summary: list[dict], label: str) -> list[str]:
    """One printed line per :func:`by_tokens` entry."""
    return [
        f"{label} {s['fmt']}: {s['cases']} cases, geomean {s['geomean']:.2f}, max {s['max']:.2f}, "
        f"{s['above_1_25']} above 1.25; by T " + ", ".join(f"{t}: {g:.2f}" for t, g in s["by_tokens"].items())
        for s in summary
    ]


def report_main(paths: list[str], out: str | None) -> int:
    """``python -m humming_jax report``: several bench JSONs merged (later
    files win a case), the Humming summaries printed, and with ``out`` the
    merged rows and the summaries written there (and the plot beside it)."""
    import json

    runs = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"report: {path} is not a bench results file (a JSON object with 'rows')")
        lacking = sorted({f for r in data["rows"] for f in CASE_FIELDS if f not in r})
        if lacking:
            raise ValueError(f"report: {path}'s rows lack {', '.join(lacking)} (the GEMM bench's rows have them)")
        runs.append(data["rows"])
    rows = merge_rows(runs)
    live = by_tokens(rows, lambda r: r.get("x_humming"))
    faster = by_tokens(rows)
    lines = by_tokens_lines(live, "x humming") + by_tokens_lines(faster, "x faster of live and anchor")
    print("\n".join(lines) if lines else "no row has a Humming time")
    if out:
        summaries = dict(x_humming=live, x_faster_humming=faster)
        with open(out, "w") as f:
            json.dump(dict(meta=dict(merged_from=paths, humming_summary=summaries), rows=rows), f, indent=1)
        plot_humming(rows, out.removesuffix(".json") + ".png")
        print(f"wrote {out}")
    return 0
