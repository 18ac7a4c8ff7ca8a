"""An fp8 × fp8 → f32 dot for Pallas Triton kernels that says how far the
tensor cores may accumulate on their own.

Hopper's fp8 MMAs accumulate in reduced precision. Triton promotes the sum
into an f32 register accumulator every ``maxNumImpreciseAcc`` columns of K;
Pallas's ``dot_general`` lowering leaves that attribute at 0, which makes
Triton promote after every 32-deep instruction and wait for each one. This
dot sets it (:data:`PROMOTE_K` columns, as the CUDA libraries do) and is a
plain ``dot_general`` everywhere else (interpret mode, the CPU). It takes the
accumulator itself: Triton folds ``acc + dot`` into the MMA chain only for
dots without the attribute, so chained products would each get their own
registers and an f32 add.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir

PROMOTE_K = 128  # columns of K summed by the tensor cores between two f32 promotions
_CONTRACT = (((1,), (1,)), ((), ()))  # a [m, k] · b [n, k] -> [m, n]


def _plain(a, b, acc, *, promote_k: int):
    del promote_k
    return acc + jax.lax.dot_general(a, b, _CONTRACT, preferred_element_type=jnp.float32)


def _abstract(a, b, acc, *, promote_k: int):
    del promote_k
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_dot: a [m, k] and b [n, k] expected, got {a.shape} and {b.shape}")
    if acc.shape != (a.shape[0], b.shape[0]) or acc.dtype != jnp.float32:
        raise ValueError(f"fp8_dot: acc f32 {(a.shape[0], b.shape[0])} expected, got {acc.dtype} {acc.shape}")
    return jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)


fp8_dot_p = jex_core.Primitive("fp8_dot")
fp8_dot_p.def_impl(_plain)
fp8_dot_p.def_abstract_eval(_abstract)
mlir.register_lowering(fp8_dot_p, mlir.lower_fun(_plain, multiple_results=False))


def fp8_dot(a: jax.Array, b: jax.Array, acc: jax.Array | None = None) -> jax.Array:
    """``acc + a [m, k] · b [n, k]ᵀ`` in f32 (a, b: float8_e4m3fn; ``acc``
    f32 ``[m, n]``, zeros if None), the tensor cores summing
    :data:`PROMOTE_K` columns between two promotions."""
    if acc is None:
        acc = jnp.zeros((a.shape[0], b.shape[0]), jnp.float32)
    return fp8_dot_p.bind(a, b, acc, promote_k=PROMOTE_K)


def _register_triton_lowering() -> None:
    """The Triton rule: Pallas's own dot lowering, then the attribute on its
    ``tt.dot``. Pallas's Triton lowering is internal to JAX (pinned version)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    dot_rule = triton_lowering.triton_lowering_rules[jax.lax.dot_general_p]

    def rule(ctx, a, b, acc, *, promote_k: int):
        dot_ctx = ctx.replace(avals_in=ctx.avals_in[:2])
        out = dot_rule(
            dot_ctx,
            a,
            b,
            dimension_numbers=_CONTRACT,
            out_sharding=None,
            precision=None,
            preferred_element_type=jnp.float32,
        )
        op = out.owner
        if op.name != "tt.dot":
            raise NotImplementedError(f"fp8_dot: the dot lowering ended in {op.name}, not tt.dot")
        op.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), promote_k)
        op.operands[2] = acc  # the dot's zero accumulator replaced by the caller's
        return out

    triton_lowering.triton_lowering_rules[fp8_dot_p] = rule


_register_triton_lowering()
