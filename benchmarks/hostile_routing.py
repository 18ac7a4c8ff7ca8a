"""The routing and scatter kernels at large shapes on hostile ids, for the
sanitizers (issue 29): align (blocks of 64; of 128 under an expert map),
prepare_scatter (with and without the map), permute, ``process_input``
scattering fp8 per-128 codes, unpermute and the fused top-k sum (under the
map, ``num_valid_tokens`` short of T) at tens of thousands of tokens × top-8,
E = 256: ids with one hot expert, one −1 and one past E.

Each call is checked against the reference (``backend="reference"``): integer
layouts, permuted rows and quantized codes and scales bit for bit; the f32
sums within a bound, zero where the reference's rows are zero, every value
finite. Run it under ``compute-sanitizer`` (``gpu.sh OUT hostile-routing``;
``SANITIZER=racecheck`` for shared-memory hazards).

    python -m benchmarks.hostile_routing --tokens 65536 --out hostile_routing.json
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj
from benchmarks.hostile_gemms import check, checked_row, report
from humming_jax import routing

# Sums in another order: f32 results, and 16-bit ones a rounding step apart.
BOUNDS = {"float32": 1e-5, "bfloat16": 2**-7, "float16": 2**-10}


def hostile_ids(rng: np.random.Generator, tokens: int, e: int, top_k: int) -> np.ndarray:
    """int32 ``[tokens, top_k]`` in ``[0, e)``, expert 5 in the first third's
    first slot, then one −1 and one id past ``e`` (where there are slots)."""
    ids = rng.integers(0, e, size=(tokens, top_k)).astype(np.int32)
    ids[: max(1, tokens // 3), 0] = 5
    flat = ids.reshape(-1)
    if flat.size > 2:
        flat[flat.size // 2] = -1
        flat[flat.size // 3 + 1] = e + 7
    return ids


def even_experts_map(e: int) -> jnp.ndarray:
    """Even experts local (local id ``e // 2``), odd ones −1."""
    return jnp.asarray([g // 2 if g % 2 == 0 else -1 for g in range(e)], jnp.int32)


def compare(out, ref) -> dict:
    """``out`` against ``ref`` (arrays or tuples of them): integer and 8-bit
    float arrays bit for bit; wider floats finite, zero where the reference's
    rows are, within their dtype's :data:`BOUNDS`."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    exact, finite, zero_rows, within = True, True, True, True
    error = 0.0
    for o, r in zip(outs, refs, strict=True):
        o, r = np.asarray(o), np.asarray(r)
        if o.shape != r.shape or o.dtype != r.dtype:
            return dict(ok=False, failed=f"shape/dtype {o.shape} {o.dtype} against {r.shape} {r.dtype}")
        if str(o.dtype) in BOUNDS:
            checked = check(o, r, BOUNDS[str(o.dtype)])
            finite &= checked["finite"]
            zero_rows &= checked["unowned_zero"]
            error, within = max(error, checked["error"]), within and checked["ok"]
        else:
            exact &= bool(np.array_equal(o.view(np.uint8), r.view(np.uint8)))
    return dict(
        exact=exact,
        finite=finite,
        zero_rows=zero_rows,
        error=error,
        ok=exact and finite and zero_rows and within,
    )


def _calls(rng: np.random.Generator, tokens: int, hidden: int, e: int, top_k: int) -> dict:
    """Each routing call by name, as a function of the backend."""
    ids = jnp.asarray(hostile_ids(rng, tokens, e, top_k))
    emap, local = even_experts_map(e), e // 2
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32), jnp.bfloat16)
    weights = jnp.asarray(rng.random((tokens, top_k), np.float32))
    # The unpermute's rows and its layout (the map's: slots past offsets[-1] contribute nothing).
    rows = jnp.asarray(rng.standard_normal((tokens * top_k, hidden), np.float32), jnp.bfloat16)
    offsets, scatter_idx = routing.moe_prepare_scatter(ids, e, emap, local, backend="reference")
    valid = jnp.asarray([max(0, tokens - 1234)], jnp.int32)
    slots = jnp.asarray(rng.standard_normal((tokens, top_k, hidden), np.float32), jnp.bfloat16)

    def permute(b):
        p = routing.moe_permute(x, ids, e, backend=b)
        return p.permuted_hidden_states, p.expert_first_token_offset, p.inv_permuted_idx, p.permuted_idx

    def scatter_fp8(b):
        q = hj.process_input(
            x,
            "fp8_dynamic_group128",
            layout="scatter",
            scatter_idx=scatter_idx,
            num_valid_tokens=offsets[-1:],
            backend=b,
        )
        return q.values, q.scale

    return {
        "align_64": lambda b: routing.moe_align_block_size(ids, 64, e, backend=b),
        "align_128_map": lambda b: routing.moe_align_block_size(ids, 128, e, emap, num_local_experts=local, backend=b),
        "prepare_scatter": lambda b: routing.moe_prepare_scatter(ids, e, backend=b),
        "prepare_scatter_map": lambda b: routing.moe_prepare_scatter(ids, e, emap, local, backend=b),
        "permute": permute,
        "process_input_scatter_fp8_g128": scatter_fp8,
        "unpermute_map": lambda b: routing.moe_unpermute(rows, weights, scatter_idx.reshape(-1), offsets, backend=b),
        "fused_mul_sum_map": lambda b: routing.moe_fused_mul_sum(slots, weights, ids, e, emap, valid, backend=b),
    }


def run(
    tokens: int,
    hidden: int,
    e: int = 256,
    top_k: int = 8,
    backend: str | None = None,
    seed: int = 0,
    ops: tuple[str, ...] | None = None,
) -> list:
    """Every call of :func:`_calls` (or those named in ``ops``) on ``backend`` against the reference."""
    rng = np.random.default_rng(seed)
    results = []
    for name, call in _calls(rng, tokens, hidden, e, top_k).items():
        if ops is not None and name not in ops:
            continue
        row = dict(op=name, tokens=tokens, top_k=top_k, experts=e, hidden=hidden)
        compared = lambda call=call: compare(jax.block_until_ready(call(backend)), call("reference"))  # noqa: E731
        results.append(checked_row(row, compared, ok_if_raised=False))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--backend", help="the ops' backend (default: the device's kernels)")
    parser.add_argument("--out", default="hostile_routing.json")
    args = parser.parse_args(argv)
    return report(run(args.tokens, args.hidden, backend=args.backend), args.out)


if __name__ == "__main__":
    sys.exit(main())
