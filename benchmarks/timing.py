"""Device timing for jitted JAX functions.

One executable runs the op on ``R`` different input sets back to back (Python
unrolled, so no host round trip between them and nothing loop-invariant to
hoist); timing it at ``R`` and ``2R`` copies and taking the difference cancels
the fixed dispatch cost, leaving the device time of ``R`` ops.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax


def _repeated(fn: Callable, copies: int) -> Callable:
    def run(inputs: Sequence[tuple]):
        return [fn(*inputs[i % len(inputs)]) for i in range(copies)]

    return jax.jit(run)


def _median_seconds(run: Callable, inputs, repeats: int) -> float:
    jax.block_until_ready(run(inputs))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_seconds(fn: Callable, inputs: Sequence[tuple], copies: int = 8, repeats: int = 15) -> float:
    """Median device seconds of one ``fn(*inputs[i])`` call."""
    once = _median_seconds(_repeated(fn, copies), inputs, repeats)
    twice = _median_seconds(_repeated(fn, 2 * copies), inputs, repeats)
    per_op = (twice - once) / copies
    return per_op if per_op > 0 else twice / (2 * copies)
