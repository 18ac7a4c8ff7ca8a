"""Interleaved A/B of Mosaic rotation variants in one process (GPU only):

    python -m benchmarks.ab_rotation --rounds 7 \\
        v12: ring2:first_ring=2 own:own_rings=True,max_warpgroup=False,reread=False

Each variant is ``name:field=value,...`` over the library's re-read form
(:class:`MosaicRotation` with K, block and compute warpgroups from the
flags, no auto barriers, the select store).
Every variant is compiled and its codes and scales compared with the first
one's, then the rounds time each variant in turn (and a same-run copy once a
round), so that the machine's drift (clocks, the L2's state: the same
process measured 34.1 and 39.7 µs in two rounds) falls on all of them
alike: the report gives each one's median and min and its ratio to the
copy's median. Separate processes per variant, or single runs, cannot
resolve the 1–3 µs differences these kernels show.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import statistics

import jax
import jax.numpy as jnp


def parse_variant(text: str) -> tuple[str, dict]:
    """``"name:field=value,field=value"`` -> ``(name, {field: value})`` (values as Python literals)."""
    name, _, fields = text.partition(":")
    if not name:
        raise ValueError(f"a variant needs a name before ':', got {text!r}")
    options = {}
    for item in filter(None, fields.split(",")):
        field, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant {name}: expected field=value, got {item!r}")
        options[field.strip()] = ast.literal_eval(value.strip())
    return name, options


def main() -> None:
    from humming_jax import timing
    from pallas_kernels import process_input
    from pallas_kernels import process_input_mosaic as mosaic

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="name:field=value,... (MosaicRotation fields)")
    parser.add_argument("--tokens", type=int, default=4096, help="T; the rows are T * 8 (k=8)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--block", type=int, default=128, help="Hadamard block (64 or 128)")
    parser.add_argument("--warpgroups", type=int, default=4, help="compute warpgroups")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    # The library's re-read form (humming_jax.process_input._mosaic_config): no auto barriers, select store.
    base = mosaic.MosaicRotation(
        args.width, args.block, warpgroups=args.warpgroups, max_warpgroup=True, reread=True,
        auto_barriers=False, select_store=True,
    )  # fmt: skip
    variants = {}
    for text in args.variants:
        name, options = parse_variant(text)
        variants[name] = dataclasses.replace(base, **options)
    m = args.tokens * 8
    # Two inputs taken in turn (as the bench does): one 50 MB input would sit partly in the L2.
    sets = [
        (jax.random.normal(jax.random.key(seed), (m, args.width), jnp.float32).astype(jnp.bfloat16),)
        for seed in range(2)
    ]
    h = jnp.asarray(process_input.hadamard_signs(mosaic.SUB), jnp.bfloat16)
    valid = jnp.full((1,), m, jnp.int32)
    runs = {name: (lambda x, cfg=cfg: mosaic.rotate_quantize(x, h, valid, cfg)) for name, cfg in variants.items()}
    first = None
    for name, run in runs.items():
        values, scale = jax.block_until_ready(jax.jit(run)(sets[0][0]))
        codes = values.view(jnp.uint8)
        first = first or (codes, scale)
        off = float(jnp.mean((codes != first[0]).astype(jnp.float32)))
        rel = float(jnp.max(jnp.abs(scale - first[1]) / jnp.maximum(first[1], 1e-30)))
        cfg = variants[name]
        rings = cfg.own_ring() if cfg.own_rings else cfg.rings()
        print(f"{name}: rings {rings}, slots {cfg.slots}, shared memory {cfg.smem_bytes} B, codes off the "
              f"first variant's {off:.1e}, scales {rel:.1e} relative", flush=True)  # fmt: skip
    # Each timing loop compiles once; the rounds only run them (a compile a round made 4 variants x 5 rounds
    # overrun five minutes).
    samplers = {name: timing.sampler(run, sets) for name, run in runs.items()}
    nbytes = m * args.width * 3 + m * 4
    copy_sample = timing.copy_sampler(nbytes)
    times: dict[str, list[float]] = {name: [] for name in runs}
    copies = []
    for index in range(args.rounds):
        copies.append(copy_sample(3))
        for name, sample in samplers.items():
            times[name].append(sample(3))
        line = "  ".join(f"{name} {samples[-1] * 1e6:.2f}" for name, samples in times.items())
        print(f"round {index}: copy {copies[-1] * 1e6:.2f}  {line} us", flush=True)
    copy = statistics.median(copies)
    print(f"copy: median {copy * 1e6:.2f} us, min {min(copies) * 1e6:.2f}, max {max(copies) * 1e6:.2f}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<16} median {median * 1e6:6.2f} us  min {min(samples) * 1e6:6.2f}  max "
              f"{max(samples) * 1e6:6.2f}  x copy {copy / median:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
