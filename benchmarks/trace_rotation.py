"""Where the Mosaic rotation's time goes, per warpgroup, from the on-device
profiler (GPU only): ``python -m benchmarks.trace_rotation --tokens 4096
--width 768 --warpgroups 4 --out DIR``.

Runs ``process_input_mosaic.rotate_quantize`` (the re-read form) with its
named regions recorded, then prints, for each warpgroup role (the max
warpgroup, each quantizing one, the memory one), the mean time a program
spends in each region and its whole span, and the steps of one program
against the kernel's start (when each tile's row max and values were done),
and the unprofiled kernel's time against a same-run copy. The profiler
stamps events with the SM's cycle counter, and its trace (Chrome trace JSON,
left in ``DIR``) labels thousands of cycles as µs: the report says k cycles.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np


def _intervals(events: list[dict]) -> list[tuple[str, int, int, float, float]]:
    """``(name, sm, warpgroup_trace, start, end)`` (k cycles) from begin/end pairs."""
    open_events: dict[tuple, list] = collections.defaultdict(list)
    out = []
    for event in events:
        key = (event["name"], event["pid"], event["tid"])
        if event["ph"] == "B":
            open_events[key].append(event["ts"])
        else:
            start = open_events[key].pop()
            out.append((event["name"], event["pid"], event["tid"], start, event["ts"]))
    return out


def summarize(path: str, warpgroups: int, memory: bool = True, own_rings: bool = False) -> str:
    """The report of one trace file (``warpgroups`` compute warpgroups + the memory one,
    unless the compute warpgroups issue their own loads: ``memory=False``; with
    ``own_rings`` each takes both passes: no max or memory role)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = _intervals(events)
    start = min(s for *_, s, _ in spans)
    end = max(e for *_, e in spans)
    if own_rings:
        roles = [f"own {w}" for w in range(warpgroups)]
    else:
        roles = ["max"] + [f"quantize {q}" for q in range(warpgroups - 1)] + (["memory"] if memory else [])

    def role(tid: int) -> str:
        return roles[(tid - 1) % len(roles)]

    def program(tid: int) -> int:
        return (tid - 1) // len(roles)

    per: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for name, _sm, tid, s, e in spans:
        per[(role(tid), name)].append(e - s)
    lines = [f"kernel span (first to last recorded event): {end - start:.2f} k cycles, {len(events)} events"]
    count = len({program(tid) for *_, tid, _, _ in spans}) or 1
    for (who, name), times in sorted(per.items()):
        lines.append(
            f"{who:>11} {name:<22} {len(times) / count:6.1f} a program, {np.sum(times) / count:7.2f} k cycles a "
            f"program, {np.mean(times):6.3f} each"
        )
    first = program(min(tid for *_, tid, _, _ in spans))
    lines.append(f"one program's steps (k cycles from the kernel's first event), program trace {first}:")
    for name, _sm, tid, s, e in sorted(spans, key=lambda span: span[3]):
        if program(tid) == first and name.endswith("_step"):
            lines.append(f"  {role(tid):>11} {name:<14} {s - start:7.2f} .. {e - start:7.2f}")
    return "\n".join(lines)


def main() -> None:
    from humming_jax import timing
    from pallas_kernels import process_input
    from pallas_kernels import process_input_mosaic as mosaic

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="T; the rows are T * 8 (k=8)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--block", type=int, default=128, help="Hadamard block (64 or 128)")
    parser.add_argument("--warpgroups", type=int, default=4, help="compute warpgroups (the max one + quantizing)")
    parser.add_argument("--slots", type=int, default=0, help="output slots a quantizing warpgroup (0: chosen)")
    parser.add_argument("--blocks-per-slot", type=int, default=1, help="Hadamard blocks an output slot holds")
    parser.add_argument("--select-store", action="store_true", help="one select store a part, no branches")
    parser.add_argument("--no-auto-barriers", action="store_true", help="without the compiler's barriers")
    parser.add_argument("--own-rings", action="store_true", help="the own-rings form (every warpgroup both passes)")
    parser.add_argument("--self-loads", action="store_true", help="no memory warpgroup: each issues its own loads")
    parser.add_argument("--first-ring", type=int, default=0, help="the max warpgroup's ring in blocks (0: chosen)")
    parser.add_argument("--ranges", type=int, default=96, help="profiler ranges a warpgroup")
    parser.add_argument("--out", required=True, help="directory for the traces")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    form = dict(own_rings=True) if args.own_rings else dict(max_warpgroup=True, reread=True)
    cfg = mosaic.MosaicRotation(
        args.width, args.block, warpgroups=args.warpgroups, **form,
        profile_ranges=args.ranges, output_slots=args.slots, blocks_per_slot=args.blocks_per_slot,
        select_store=args.select_store, auto_barriers=not args.no_auto_barriers, first_ring=args.first_ring,
        self_loads=args.self_loads,
    )  # fmt: skip
    rings = cfg.own_ring() if args.own_rings else cfg.rings()
    print(f"rings (blocks): {rings}, output slots {cfg.slots}, shared memory {cfg.smem_bytes} bytes")
    m = args.tokens * 8
    x = jax.random.normal(jax.random.key(0), (m, args.width), jnp.float32).astype(jnp.bfloat16)
    h = jnp.asarray(process_input.hadamard_signs(mosaic.SUB), jnp.bfloat16)
    valid = jnp.full((1,), m, jnp.int32)
    run = jax.jit(lambda x: mosaic.rotate_quantize(x, h, valid, cfg, profile_dir=args.out))
    for _ in range(3):
        jax.block_until_ready(run(x))
    plain = dataclasses.replace(cfg, profile_ranges=0)
    seconds = timing.device_seconds(lambda x: mosaic.rotate_quantize(x, h, valid, plain), [(x,)])
    nbytes = m * args.width * 3 + m * 4
    copy = timing.copy_seconds(nbytes)
    print(f"unprofiled: {seconds * 1e6:.1f} us, same-run copy {copy * 1e6:.1f} us, x copy {copy / seconds:.2f}")
    newest = max(glob.glob(os.path.join(args.out, "*-trace.json")), key=os.path.getmtime)
    print(summarize(newest, args.warpgroups, memory=not (args.self_loads or args.own_rings), own_rings=args.own_rings))


if __name__ == "__main__":
    main()
