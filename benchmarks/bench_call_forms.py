"""Host time of one decode step of a model of MoE blocks, in each form a Flax
user can jit it: the step issued (the call returns) and waited for.

    python -m benchmarks.bench_call_forms [--blocks 1 8 32] [--body light layer] [--out F]

``--body light``: the step returns ``x + 1`` and only carries the blocks'
variables, so its time is what the form costs to issue; ``layer``: the
blocks run (small experts, the default backend). Each block is a
``MoEBlock`` over ``HummingGroupedExperts`` (int4 g32, E=8, H=I=64, k=2).
Forms: ``jax.jit`` over ``nnx.split``'s state, over the module (a pytree),
``nnx.jit`` in tree and graph mode, ``nnx.jit_partial`` and
``humming_jax.nn.jit_frozen``; a trivial ``jax.jit(x + 1)`` is the floor.
Median µs over ``--calls`` calls, each issued on an idle device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import humming_jax as hj
from humming_jax import nn
from humming_jax.timing import write_results

CONFIG = hj.ExpertsConfig(8, 64, 64, 2, weight_format="int4_g32")


class Model(nnx.Module):
    """``blocks`` MoE blocks in a row; ``light``: the call only returns ``x + 1``."""

    def __init__(self, blocks: int, light: bool):
        self.blocks = nnx.List(
            [nn.MoEBlock(nn.HummingGroupedExperts(CONFIG, rngs=nnx.Rngs(i)), rngs=nnx.Rngs(i)) for i in range(blocks)]
        )
        self.light = light

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.light:
            return x + 1
        for block in self.blocks:
            x = block(x)
        return x


def forms(model: Model, x: jax.Array) -> dict:
    """Each form as a call of no arguments issuing one step."""
    graphdef, state = nnx.split(model)
    call = lambda m, x: m(x)  # noqa: E731
    split = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    module, tree, graph = jax.jit(call), nnx.jit(call, graph=False), nnx.jit(call)
    partial, frozen = nnx.jit_partial(call, model, graph=False), nn.jit_frozen(model)
    trivial = jax.jit(lambda x: x + 1)
    return {
        "trivial jit": lambda: trivial(x),
        "jit, split state": lambda: split(state, x),
        "jit, module": lambda: module(model, x),
        "nnx.jit tree": lambda: tree(model, x),
        "nnx.jit graph": lambda: graph(model, x),
        "nnx.jit_partial": lambda: partial(x),
        "jit_frozen": lambda: frozen(x),
    }


def time_form(step, calls: int) -> tuple[float, float]:
    """Median seconds to issue one step and to have it done."""
    for _ in range(10):
        jax.block_until_ready(step())
    issued, waited = [], []
    for _ in range(calls):
        start = time.perf_counter()
        out = step()
        returned = time.perf_counter()
        jax.block_until_ready(out)
        issued.append(returned - start)
        waited.append(time.perf_counter() - start)
    return statistics.median(issued), statistics.median(waited)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--body", nargs="+", choices=("light", "layer"), default=["light", "layer"])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the forms, interleaved")
    parser.add_argument("--out", default="benchmarks/results/layer/call_forms.json")
    args = parser.parse_args(argv)
    x = jnp.ones((4, CONFIG.hidden_size), jnp.bfloat16)
    rows = []
    for body in args.body:
        for blocks in args.blocks:
            model = Model(blocks, light=body == "light")
            variables = len(jax.tree.leaves(nnx.state(model)))
            steps = forms(model, x)
            for rnd in range(args.rounds):
                for name, step in steps.items():
                    issued, waited = time_form(step, args.calls)
                    rows.append(
                        dict(body=body, blocks=blocks, variables=variables, form=name, round=rnd,
                             issued_us=issued * 1e6, waited_us=waited * 1e6)
                    )  # fmt: skip
                    print(f"{body:5s} {blocks:3d} blocks  {name:18s} issued {issued * 1e6:8.1f}  "
                          f"waited {waited * 1e6:8.1f} µs", flush=True)  # fmt: skip
            write_results(args.out, rows, quiet=True, calls=args.calls)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
