"""Device timing for jitted JAX functions.

The op runs ``iterations`` times inside one ``fori_loop`` (one executable, one
launch). Each iteration passes its inputs through an optimization barrier
together with the loop index, so XLA cannot hoist the loop-invariant op out of
the loop, and the outputs are the loop carry, so nothing is dead. The input
sets rotate inside each iteration (unrolled), so consecutive calls do not just
re-read what the previous one left in L2. The median time of the executable
divided by the number of calls is the time of one op; iterations are raised
until one timing lasts at least ``min_seconds`` (clocks ramp up, launch cost
vanishes); the trip count is static (a dynamic one would make XLA read the
loop predicate back to the host every iteration), so that costs one compile
more.

Peers launched through PyTorch (``torch._grouped_mm``, Humming) are timed
the same way by :func:`event_sampler` — back-to-back calls over rotated
input sets, calibrated to the same duration, a CUDA graph replayed where
they capture — and :func:`interleaved` takes one timing of each in turn,
each round starting one later: a GEMM near the power limit runs faster in
a short burst from idle than under a sustained load, so a peer timed in a
burst is not comparable, and in a fixed order the first ran faster.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.extend
import jax.numpy as jnp


def _looped(fn: Callable, sets: Sequence[tuple]):
    out_shapes = [jax.eval_shape(fn, *args) for args in sets]

    @functools.partial(jax.jit, static_argnums=1)
    def run(sets, iterations: int):
        def body(i, carry):
            del carry  # every set's outputs are the next carry: none is dead
            outs = []
            for args in sets:
                args, _ = jax.lax.optimization_barrier((args, i))
                outs.append(fn(*args))
            return outs

        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)
        return jax.lax.fori_loop(0, iterations, body, init)

    return run


# Calibration: a first timing of this many iterations (compile and warm-up),
# then the best of ESTIMATE_RUNS timings estimates one call.
FIRST_ITERATIONS = 4
ESTIMATE_RUNS = 3


def _calibrated(estimate: float, min_seconds: float) -> int:
    """Iterations (a power of two, FIRST_ITERATIONS to 4096) for one timing of ``min_seconds``
    at ``estimate`` seconds an iteration."""
    needed = min(4096, max(FIRST_ITERATIONS, int(min_seconds / max(estimate, 1e-7))))
    return 1 << (needed - 1).bit_length()


def sampler(fn: Callable, sets: Sequence[tuple], min_seconds: float = 0.01) -> Callable[[int], float]:
    """Compile ``fn``'s timing loop once (calibrated so one timing lasts ``min_seconds``)
    and return ``sample(repeats)``: the median device seconds of one ``fn(*sets[i])`` call
    over ``repeats`` timings. Interleaved comparisons call it again and again without
    compiling anew."""
    sets = list(sets)
    run = _looped(fn, sets)

    def timed(iterations: int) -> float:
        start = time.perf_counter()
        jax.block_until_ready(run(sets, iterations))
        return time.perf_counter() - start

    iterations = FIRST_ITERATIONS
    timed(iterations)  # compile and warm up
    estimate = min(timed(iterations) for _ in range(ESTIMATE_RUNS)) / iterations
    calibrated = _calibrated(estimate, min_seconds)
    if calibrated > iterations:
        iterations = calibrated  # a static trip count: one more compile
        timed(iterations)

    def sample(repeats: int) -> float:
        return statistics.median(timed(iterations) for _ in range(repeats)) / (iterations * len(sets))

    return sample


class TorchCuda:
    """The CUDA device as PyTorch drives it: what :func:`event_sampler` needs
    (a stand-in with the same three methods tests the sampler off the GPU)."""

    def __init__(self):
        import torch

        self.torch = torch

    def capture(self, enqueue: Callable[[], None]) -> Callable[[], None] | None:
        """A CUDA graph replaying what ``enqueue`` launches, or None where it cannot be captured
        (e.g. an op that reads a size back to the host)."""
        torch = self.torch
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # a warm-up run on a side stream first, as capture requires
                enqueue()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                enqueue()
        except Exception:  # noqa: BLE001 -- any capture failure means: launch eagerly
            torch.cuda.synchronize()
            return None
        return graph.replay

    def seconds(self, run: Callable[[], None]) -> float:
        """Device seconds between two events around what ``run`` enqueues."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def event_sampler(
    launch: Callable[[int], None], sets: int, min_seconds: float = 0.01, capture: bool = True, device=None
) -> Callable[[int], float]:
    """:func:`sampler` for a peer that PyTorch launches: ``launch(s)`` enqueues
    one call on input set ``s`` (of ``sets``, rotated as ours rotate). A timing
    is ``iterations`` rounds over the sets back to back between two CUDA
    events, replayed from a CUDA graph where the calls capture (no host launch
    cost between them, as our one-executable loop has none; ``sample.graph``
    says which ran; ``capture`` False: never tried, for calls that read back
    to the host), calibrated to last ``min_seconds`` as ours are — so both are
    timed in the same clock and power state, not one in a short burst."""
    device = device or TorchCuda()

    def build(iterations: int) -> tuple[Callable[[], None], bool]:
        def enqueue():
            for _ in range(iterations):
                for s in range(sets):
                    launch(s)

        replay = device.capture(enqueue) if capture else None
        return (enqueue, False) if replay is None else (replay, True)

    iterations = FIRST_ITERATIONS
    run, graph = build(iterations)
    device.seconds(run)  # warm up
    estimate = min(device.seconds(run) for _ in range(ESTIMATE_RUNS)) / iterations
    calibrated = _calibrated(estimate, min_seconds)
    if calibrated > iterations:  # a longer graph (or loop) only where the first was short
        iterations = calibrated
        run, graph = build(iterations)
        device.seconds(run)

    def sample(repeats: int) -> float:
        return statistics.median(device.seconds(run) for _ in range(repeats)) / (iterations * sets)

    sample.graph = graph
    sample.iterations = iterations
    # A captured graph reads the buffers ``launch`` holds, by address: they must live as
    # long as the graph does, or later allocations reuse them under its replays.
    sample.launch = launch
    return sample


def kernel_census(fn: Callable, *args) -> tuple:
    """The Pallas kernels ``fn(*args)`` traces to, in order: each launch's name,
    grid and output types (nested jits and control flow walked) — Triton's and
    interpreted kernels (``pallas_call``) and Mosaic GPU's (``plgpu.kernel``,
    traced as ``mpmd_map``). Two A/B orders with one census run one program —
    e.g. a patch that a jitted function's cached trace never saw."""
    found = []

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            outs = tuple(str(v.aval) for v in eqn.outvars)
            if eqn.primitive.name == "pallas_call":
                found.append((eqn.params.get("name"), eqn.params["grid_mapping"].grid, outs))
                continue
            if eqn.primitive.name == "mpmd_map":  # a Mosaic GPU kernel: its mesh's grid
                found.append((eqn.params.get("name"), tuple(eqn.params["meshes"][0].grid), outs))
                continue
            for value in eqn.params.values():
                for inner in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(inner, jax.extend.core.ClosedJaxpr):
                        walk(inner.jaxpr)
                    elif isinstance(inner, jax.extend.core.Jaxpr):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return tuple(found)


def interleaved(samplers: dict[str, Callable[[int], float]], repeats: int = 5) -> dict[str, list[float]]:
    """``{name: [seconds of one call]}``: one timing of each sampler in turn, ``repeats``
    rounds, so drifting clocks and power weigh on all of them alike; each round starts
    one sampler later (the first of a round can run at its own pace: no one is always first)."""
    samples = {name: [] for name in samplers}
    names = list(samplers)
    for round_ in range(repeats):
        start = round_ % len(names) if names else 0
        for name in names[start:] + names[:start]:
            samples[name].append(samplers[name](1))
    return samples


def device_seconds(fn: Callable, sets: Sequence[tuple], repeats: int = 5, min_seconds: float = 0.01) -> float:
    """Median device seconds of one ``fn(*sets[i])`` call."""
    return sampler(fn, sets, min_seconds)(repeats)


# Calls of the looped function a kernel trace covers (one run of the executable).
TRACED_CALLS = 16


def _device_events(events: Sequence[dict]) -> tuple[list[dict], dict[tuple[int, int], str]]:
    """A trace's complete events on device processes (``process_name``
    starting ``/device:``) and the names of their threads (streams)."""
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and e["args"]["name"].startswith("/device:")
    }
    threads = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in devices
    }
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e]
    return kernels, threads


def _union_seconds(kernels: Sequence[dict]) -> float:
    """Seconds some event is running (the union of ``[ts, ts + dur)``): the
    sum of the durations less any overlap."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy * 1e-6


def device_kernel_seconds(events: Sequence[dict], prefixes: Sequence[str]) -> dict[str, float] | None:
    """Seconds of the device kernels in a Chrome / Perfetto trace's ``events``
    (``traceEvents``: complete events, ``ts`` and ``dur`` in µs) whose names
    start with each prefix, ``"all"`` device kernels, ``"busy"`` the time
    some kernel ran (``all`` less overlap: events that run at once, or a
    line that repeats a stream's) and ``"span"`` first start to last end
    (``busy`` plus the gaps); a device is a process whose ``process_name``
    starts ``/device:`` (host events are not counted). None where the trace
    holds no device kernel (a CPU run)."""
    kernels, _ = _device_events(events)
    if not kernels:
        return None
    totals = {prefix: sum(e["dur"] for e in kernels if e["name"].startswith(prefix)) * 1e-6 for prefix in prefixes}
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) * 1e-6
    return {**totals, "all": sum(e["dur"] for e in kernels) * 1e-6, "busy": _union_seconds(kernels), "span": span}


def device_kernel_table(events: Sequence[dict], calls: int, rows: int = 16) -> list[dict]:
    """The device events of a trace of ``calls`` calls by (thread, name):
    ``thread`` (the stream or line the profiler put it on), ``name``,
    ``launches`` and ``us`` a call, the longest ``rows`` first — what a
    traced total is made of (a kernel missing, or a line that is not a
    stream's, shows here)."""
    kernels, threads = _device_events(events)
    table: dict[tuple[str, str], list[float]] = {}
    for e in kernels:
        key = (threads.get((e["pid"], e.get("tid")), str(e.get("tid"))), e["name"])
        entry = table.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += e["dur"]
    listed = [
        dict(thread=thread, name=name, launches=count / calls, us=total / calls)
        for (thread, name), (count, total) in table.items()
    ]
    return sorted(listed, key=lambda r: -r["us"])[:rows]


@dataclasses.dataclass(frozen=True)
class TracedKernels:
    """A kernel trace's figures for one call: ``seconds`` by name prefix,
    ``"all"``, ``"busy"`` and ``"span"`` (:func:`device_kernel_seconds`),
    ``table`` the events by thread and name (:func:`device_kernel_table`)."""

    seconds: dict[str, float]
    table: list[dict]


def traced_kernels(
    fn: Callable, sets: Sequence[tuple], prefixes: Sequence[str], calls: int = TRACED_CALLS
) -> TracedKernels | None:
    """Device time a call of ``fn`` spends in kernels whose names start with
    each of ``prefixes`` (and every device kernel), from a profiler trace of
    ``calls`` calls looped as :func:`sampler` loops them — the kernels' own
    time inside the whole function, not each timed alone. None where the
    trace holds no device kernel (the CPU)."""
    run = _looped(fn, list(sets))
    jax.block_until_ready(run(list(sets), calls))  # compiled and warm
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            jax.block_until_ready(run(list(sets), calls))
        traces = sorted(pathlib.Path(folder).rglob("perfetto_trace.json.gz"))
        if not traces:
            return None
        with gzip.open(traces[-1], "rt") as f:
            events = json.load(f).get("traceEvents", [])
    seconds = device_kernel_seconds(events, prefixes)
    if seconds is None:
        return None
    per_call = calls * len(sets)
    per_call_seconds = {name: value / per_call for name, value in seconds.items()}
    return TracedKernels(per_call_seconds, device_kernel_table(events, per_call))


def copy_sampler(nbytes: int) -> Callable[[int], float]:
    """:func:`sampler` of an elementwise pass that reads and writes ``nbytes``
    in all (``nbytes / 2`` each way, uint32 words), timed like a kernel: the
    bandwidth a problem of that size can reach, launch and ramp included."""
    words = max(1, nbytes // 8)
    buffers = [(jnp.full((words,), seed, jnp.uint32),) for seed in range(2)]
    return sampler(lambda a: a + jnp.uint32(1), buffers)


def copy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Device seconds of the copy of :func:`copy_sampler`."""
    return copy_sampler(nbytes)(repeats)


COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on the H200
MATMUL_RATE = 790e12  # flop/s, bf16 matrix products measured on the H200


def bandwidth_fields(seconds: float, nbytes: int) -> dict:
    """The time and bandwidth columns of a benchmark row."""
    return dict(
        us=seconds * 1e6,
        bytes=nbytes,
        gbps=nbytes / seconds / 1e9,
        copy_fraction=nbytes / seconds / COPY_BANDWIDTH,
    )


def write_results(path: str, rows: list[dict], quiet: bool = False, **meta) -> None:
    """Write benchmark rows as JSON with the machine they were measured on."""
    import platform

    header = dict(
        device=str(jax.devices()[0].device_kind),
        jax=jax.__version__,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d"),
        **meta,
    )
    with open(path, "w") as f:
        json.dump(dict(meta=header, rows=rows), f, indent=1)
    if not quiet:
        print(f"wrote {path}")


def comparison_cells(kernel: dict, reference: dict) -> str:
    """Table cells comparing a kernel row with its ``jnp`` reference row:
    kernel us, jnp us, speedup, GB/s and % of the copy bandwidth."""
    return (
        f"{kernel['us']:>11.1f}{reference['us']:>10.1f}{reference['us'] / kernel['us']:>9.2f}"
        f"{kernel['gbps']:>8.0f}{100 * kernel['copy_fraction']:>7.0f}%"
    )
