"""Routing and data-movement benchmark: the Pallas kernels against the plain
``jnp`` implementations (the references) of the same ops, in one process.

    python -m benchmarks.bench_routing [--out results/routing.json] [--quick]

Prints a table and writes JSON: per op and problem, the time of each
implementation, the bytes the op must move and the achieved GB/s.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj
from humming_jax import tiles_text
from humming_jax.bench import random_bf16
from humming_jax.routing import align_length
from humming_jax.timing import COPY_BANDWIDTH, bandwidth_fields, comparison_cells, device_seconds, write_results
from pallas_kernels.routing import RowTiles

TOKENS = (1, 16, 128, 512, 4096, 16384)
EXPERTS = ((8, 2), (128, 8), (256, 8))
HIDDEN = (2048, 7168)
BLOCK_SIZE = 64
KERNEL = "pallas"  # the backend timed against the jnp reference


def _routing(rng, tokens, experts, top_k):
    scores = rng.random((tokens, experts))
    ids = np.argpartition(scores, -top_k, axis=1)[:, -top_k:].astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(weights)


def _copies(nbytes: int) -> int:
    """Input sets rotated per timing: more than L2 holds where memory allows."""
    return 2 if nbytes > 2**26 else 4


def _row(op, backend, problem, seconds, nbytes):
    return dict(op=op, backend=backend, **problem, **bandwidth_fields(seconds, nbytes))


def bench(tokens_list, experts_list, hidden_list, seed=0, on_rows=None, row_tiles=(None,)):
    """All rows; ``on_rows(rows)`` after each group of measurements (the JSON is
    rewritten as it goes, so a run cut by a time limit keeps what it measured).
    The row ops' kernels are timed once per entry of ``row_tiles``
    (:class:`pallas_kernels.routing.RowTiles`, None: the default tiling), the references once."""
    rng = np.random.default_rng(seed)
    rows = []
    on_rows = on_rows or (lambda rows: None)
    for tokens in tokens_list:
        for experts, top_k in experts_list:
            slots = tokens * top_k
            problem = dict(T=tokens, E=experts, k=top_k)
            routings = [_routing(rng, tokens, experts, top_k) for _ in range(4)]
            length = align_length(slots, experts, BLOCK_SIZE)
            align_bytes = 4 * slots + 4 * length + 4 * -(-length // BLOCK_SIZE)
            scatter_bytes = 4 * slots + 4 * slots + 4 * (experts + 1)
            for backend in (KERNEL, "reference"):
                align = lambda ids, w, b=backend, n=experts: hj.moe_align_block_size(ids, BLOCK_SIZE, n, backend=b)  # noqa: E731
                rows.append(_row("align", backend, problem, device_seconds(align, routings), align_bytes))
                scatter = lambda ids, w, b=backend, n=experts: hj.moe_prepare_scatter(ids, n, backend=b)  # noqa: E731
                rows.append(_row("prepare_scatter", backend, problem, device_seconds(scatter, routings), scatter_bytes))
            print(table(rows[-4:], header=False), flush=True)
            on_rows(rows)
            for hidden in hidden_list:
                problem_h = dict(problem, H=hidden)
                row_bytes = 2 * hidden
                moved = slots * row_bytes + tokens * row_bytes  # k rows in (or out) per token, one row the other way
                copies = _copies(slots * row_bytes * 4)
                sets = []
                for i, (ids, weights) in enumerate(routings[:copies]):
                    key_x, key_e = jax.random.split(jax.random.key(seed * 1000 + i))
                    x = random_bf16(key_x, (tokens, hidden))
                    permuted = hj.moe_permute(x, ids, experts)
                    expanded = random_bf16(key_e, (tokens, top_k, hidden))
                    sets.append((x, ids, weights, permuted, expanded))
                runs = [(KERNEL, tiles) for tiles in row_tiles] + [("reference", None)]
                for backend, tiles in runs:
                    for name, fn in _row_ops(backend, experts, tiles):
                        row = _row(name, backend, problem_h, device_seconds(fn, sets), moved)
                        rows.append(dict(row, row_tiles=_tiles_name(tiles)) if backend == KERNEL else row)
                print(table(rows[-3 * len(runs) :], header=False), flush=True)
                on_rows(rows)
            print(f"done T={tokens} E={experts} k={top_k}", file=sys.stderr, flush=True)
    return rows


def _tiles_name(tiles) -> str:
    return "default" if tiles is None else tiles_text.to_text(tiles) or "default"


def _row_ops(backend: str, experts: int, tiles):
    """(name, fn(x, ids, weights, permuted, expanded)) of the three row ops."""
    options = dict(backend=backend) if backend == "reference" else dict(backend=backend, row_tiles=tiles)

    def permute(x, ids, w, p, e):
        return hj.moe_permute(x, ids, experts, **options)

    def unpermute(x, ids, w, p, e):
        return hj.moe_unpermute(p.permuted_hidden_states, w, p.inv_permuted_idx, p.expert_first_token_offset, **options)

    def fused(x, ids, w, p, e):
        return hj.moe_fused_mul_sum(e, w, ids, experts, **options)

    return (("permute", permute), ("unpermute", unpermute), ("fused_mul_sum", fused))


def table(rows, header: bool = True) -> str:
    references = {_problem_key(r): r for r in rows if r["backend"] == "reference"}
    lines = (
        [
            f"{'op':<16}{'T':>6}{'E':>5}{'k':>3}{'H':>6}{'tiles':>11}{'pallas us':>11}{'jnp us':>10}{'speedup':>9}"
            f"{'GB/s':>8}{'% copy':>8}"
        ]
        if header
        else []
    )
    for r in rows:
        ref = references.get(_problem_key(r))
        if r["backend"] != KERNEL or ref is None:
            continue
        op, t, e, k, h = _problem_key(r)
        lines.append(f"{op:<16}{t:>6}{e:>5}{k:>3}{h:>6}{r.get('row_tiles', '-'):>11}" + comparison_cells(r, ref))
    return "\n".join(lines)


def _problem_key(r: dict) -> tuple:
    return (r["op"], r["T"], r["E"], r["k"], r.get("H", "-"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/routing.json")
    parser.add_argument("--quick", action="store_true", help="a few sizes only")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument(
        "--experts", nargs="*", default=[f"{e},{k}" for e, k in EXPERTS], help="E,k pairs (default: all three)"
    )
    parser.add_argument("--hidden", type=int, nargs="*", default=list(HIDDEN))
    parser.add_argument(
        "--row-tiles",
        nargs="*",
        default=[],
        help="row-op tilings to sweep, each NAME=VALUE,... of RowTiles (block_tokens=8,num_warps=8; default first)",
    )
    args = parser.parse_args(argv)
    try:
        row_tiles = (None, *(tiles_text.from_text(RowTiles, text) for text in args.row_tiles))
    except ValueError as error:
        parser.error(f"--row-tiles: {error}")
    try:
        experts = tuple(tuple(int(v) for v in pair.split(",")) for pair in args.experts)
        assert all(len(pair) == 2 for pair in experts)
    except (ValueError, AssertionError):
        parser.error(f"--experts: expected E,k pairs such as 128,8, got {args.experts}")
    if jax.default_backend() != "gpu":
        print("bench_routing: needs a GPU (the kernels are timed compiled, not interpreted)", file=sys.stderr)
        return 2
    print(table([], header=True), flush=True)

    def save(rows):
        write_results(args.out, rows, quiet=True, block_size=BLOCK_SIZE, copy_bandwidth=COPY_BANDWIDTH)

    if args.quick:
        rows = bench((16, 4096), ((256, 8),), (7168,), on_rows=save)
    else:
        rows = bench(tuple(args.tokens), experts, tuple(args.hidden), on_rows=save, row_tiles=row_tiles)
    print(table(rows))
    save(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
