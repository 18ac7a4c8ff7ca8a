"""Device timing for jitted JAX functions.

One executable runs the op on ``copies`` different input sets back to back
(Python-unrolled: no host round trip between them, and distinct inputs leave
nothing for XLA to deduplicate or hoist). The median wall time of that
executable over ``copies`` is the time of one op; the fixed cost of launching
the executable (tens of microseconds) is spread over the copies, so for ops of
a few microseconds it adds about ``launch / copies`` to each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax


def device_seconds(fn: Callable, inputs: Sequence[tuple], copies: int | None = None, repeats: int = 10) -> float:
    """Median seconds of one ``fn(*inputs[i])`` call (``copies`` defaults to ``len(inputs)``)."""
    copies = copies or len(inputs)

    @jax.jit
    def run(sets):
        return [fn(*sets[i % len(sets)]) for i in range(copies)]

    jax.block_until_ready(run(inputs))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / copies
