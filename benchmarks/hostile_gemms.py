"""Large GEMMs on hostile layouts, for the sanitizers (issue 29): every kernel
family the op reaches — 16-bit, 4-bit weight-only, W8A8, W4A8, int8 × int8 —
at tens of thousands of rows, with grouped offsets far outside ``[0, M]``
(−2³¹ first, ends past M and at 2³¹ − 1, every row on one expert, empty
groups), an indexed layout over ids in ``[−1, E]``, a slot-ordered one
(decode's: a block a slot) over ids with int32's extremes, and the same
arrays tiled by expert (a tile an expert, its rows found in the ids; a token
listing an expert twice).

Each call is checked against the reference (``backend="reference"``): every
value finite, rows no expert owns exactly zero, the relative error under a
bound. Run it under ``compute-sanitizer --tool memcheck`` (``gpu.sh OUT
hostile``; one ``cudaMalloc`` a buffer there, so that a store past a buffer is
an error): a kernel that reads or writes past its buffers fails there, one that
leaves a row unwritten fails the checks.

    python -m benchmarks.hostile_gemms --rows 65536 --out hostile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax import tiles_text

# (weight format, input quantization or None): one pair per kernel family and scale path.
PAIRS = (
    ("bf16", None),
    ("int4_g128", None),
    ("mxfp4", None),
    ("fp8_block128", "fp8_dynamic_group128"),
    ("mxfp4", "fp8_dynamic_group128"),
    ("int4_g128", "fp8_dynamic_token"),
    ("int8_channel", "int8_dynamic_token"),
)
BOUND = 2e-2  # fp8 and int8 inputs against the f32 reference on their dequantized values


def grouped_offsets(m: int, e: int) -> dict[str, list[int]]:
    """Hostile offsets over ``m`` rows and ``e`` = 8 experts, by name."""
    assert e == 8
    return {
        "extremes": [-(2**31), 100, 100, m // 3, m // 3, m - 536, m + 4464, 2**31 - 1, 2**31 - 1],
        "one_expert": [0] * e + [m],
        "crowded": [5, 9, 9, m // 2, m // 2 + 1, m // 2 + 2, m, m, m],
    }


def indexed_layout(rng: np.random.Generator, tokens: int, e: int, top_k: int, block: int) -> hj.Indexed:
    """Ids in ``[-1, e]`` (a slot of each out of range), one hot expert, aligned to ``block``."""
    ids = rng.integers(0, e, size=(tokens, top_k)).astype(np.int32)
    ids[: tokens // 3, 0] = 5
    ids[::97, 1] = -1
    ids[::89, 1] = e
    aligned = hj.moe_align_block_size(jnp.asarray(ids), block, e, ignore_invalid_experts=True)
    return hj.Indexed(*aligned, top_k=top_k, block_size=block, lists_dropped=True)


def slot_layout(
    rng: np.random.Generator, tokens: int, e: int, top_k: int, block: int, by_expert: bool = False
) -> hj.Indexed:
    """Each slot its own block (decode's layout), ids with int32's extremes, −1 and ``e`` among them;
    ``by_expert``: the same arrays tiled by expert (at most ``block`` tokens), a token listing an expert twice."""
    ids = rng.integers(0, e, size=(tokens, top_k)).astype(np.int32)
    ids[::7, 0] = np.iinfo(np.int32).min
    ids[::11, 1] = np.iinfo(np.int32).max
    ids[::13, 0], ids[::17, 1] = -1, e
    ids[::5, 3] = ids[::5, 2]
    arrays = hj.moe_slot_blocks(jnp.asarray(ids), block)
    by = top_k if by_expert else 0
    return hj.Indexed(*arrays, top_k=top_k, block_size=block, lists_dropped=True, slot_order=True, tile_by_expert=by)


def _input(rng: np.random.Generator, quant_name: str | None, m: int, k: int):
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    if quant_name is None:
        return x.astype(jnp.bfloat16)
    return Q.quantize_input(x, Q.get_input_spec(quant_name))


def _weight(rng: np.random.Generator, fmt_name: str, e: int, n: int, k: int):
    w = jnp.asarray(rng.normal(0, 0.05, (e, n, k)), jnp.float32)
    if fmt_name == "bf16":
        return w.astype(jnp.bfloat16)
    weight = F.quantize_weight(w, F.get_format(fmt_name))
    return hj.to_planar(weight) if fmt_name in ("int4_g128", "mxfp4") else weight  # the kernels' order


def check(out, ref, bound: float = BOUND) -> dict:
    """Finite values, zero rows (along the first axis) where the reference's
    are, and the relative error under ``bound``."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    out, ref = out.reshape(out.shape[0], -1), ref.reshape(ref.shape[0], -1)
    unowned = np.all(ref == 0, axis=1)
    error = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    finite, unowned_zero = bool(np.all(np.isfinite(out))), bool(np.all(out[unowned] == 0))
    return dict(
        finite=finite,
        unowned_rows=int(unowned.sum()),
        unowned_zero=unowned_zero,
        error=error,
        ok=finite and unowned_zero and error < bound,
    )


def run(
    rows: int, e: int, n: int, k: int, tilings: list[str], backend: str | None = None, pairs=PAIRS, seed: int = 0
) -> list[dict]:
    """Every pair of ``pairs`` on every hostile layout, by the default tiling and each of ``tilings``."""
    rng = np.random.default_rng(seed)
    results = []
    for fmt_name, quant_name in pairs:
        weight = _weight(rng, fmt_name, e, n, k)
        x = _input(rng, quant_name, rows, k)
        offsets = grouped_offsets(rows, e)
        layouts = {name: hj.GroupedContiguous(jnp.asarray(o, jnp.int32)) for name, o in offsets.items()}
        tokens = rows // 8
        layouts["indexed"] = indexed_layout(rng, tokens, e, 8, 64)
        slot_tokens = max(1, min(64, rows // 256))  # decode-sized: a block a slot
        layouts["slot_order"] = slot_layout(rng, slot_tokens, e, 8, 16)
        tiled_tokens = min(16, slot_tokens)  # a block's rows of tokens at most
        layouts["tile_by_expert"] = slot_layout(rng, tiled_tokens, e, 8, 16, by_expert=True)
        for name, layout in layouts.items():
            t = {"indexed": tokens, "slot_order": slot_tokens, "tile_by_expert": tiled_tokens}.get(name)
            xs = jax.tree.map(lambda a, t=t: a[:t], x) if t else x
            for text in [None, *tilings]:
                tuning = None if text is None else tiles_text.gemm_from_text(text)
                row = dict(fmt=fmt_name, input=quant_name, layout=name, rows=rows, tiling=text or "default")

                def compared(xs=xs, weight=weight, layout=layout, tuning=tuning):
                    out = hj.gemm(xs, weight, layout, out_dtype=jnp.float32, tuning=tuning, backend=backend)
                    return check(out, hj.gemm(xs, weight, layout, out_dtype=jnp.float32, backend="reference"))

                # An exception is a tiling the kernel refuses for this call: not a failed check.
                results.append(checked_row(row, compared, ok_if_raised=None))
    return results


def checked_row(row: dict, compared, ok_if_raised: bool | None) -> dict:
    """``row`` with the fields ``compared()`` returns — or, if it raises,
    ``ok=ok_if_raised`` and the error — and its wall time; printed."""
    start = time.time()
    try:
        row.update(compared())
    except Exception as error:
        row.update(ok=ok_if_raised, failed=f"{type(error).__name__}: {str(error)[:300]}")
    row["wall_s"] = round(time.time() - start, 1)
    print(row, flush=True)
    return row


def report(results: list[dict], out: str) -> int:
    """Writes ``results`` as JSON to ``out``, prints the count that failed
    their checks (``ok`` False); the exit status: 1 if any did."""
    with open(out, "w") as f:
        json.dump(dict(device=str(jax.devices()[0]), rows=results), f, indent=1)
    bad = [r for r in results if r["ok"] is False]
    print(f"{len(results)} calls, {len(bad)} failed their checks")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--shape", default="8,1024,2048", help="E,N,K of the weights (E = 8)")
    parser.add_argument("--tilings", nargs="*", default=[], help="tiles texts run beside the default")
    names = [f"{w}@{x}" if x else w for w, x in PAIRS]
    parser.add_argument("--pairs", nargs="+", default=names, choices=names, help="weight[@input] pairs to run")
    parser.add_argument("--backend", help="the op's backend (default: the device's kernels)")
    parser.add_argument("--out", default="hostile_gemms.json")
    args = parser.parse_args(argv)
    e, n, k = (int(v) for v in args.shape.split(","))
    pairs = [tuple(name.split("@")) if "@" in name else (name, None) for name in args.pairs]
    return report(run(args.rows, e, n, k, args.tilings, args.backend, pairs), args.out)


if __name__ == "__main__":
    sys.exit(main())
