"""``process_input``: optional activation -> optional Hadamard rotation ->
optional quantization -> layout, as one op (kernel:
``pallas_kernels/process_input.py``; notes: ``benchmarks/notes/process_input.md``).

Layouts:

* ``normal`` — row i in, row i out.
* ``grouped_mask`` — ``x [E*max_tokens, K]`` (or ``[E, max_tokens, K]``); only
  the first ``expert_num_tokens[e]`` rows of expert e are valid, the rest are
  written as zeros.
* ``scatter`` — row i of the input goes to rows ``scatter_idx[i, :]`` of the
  output (``[M*R, K]`` for ``scatter_idx [M, R]``): the permute of the
  grouped path fused into quantization. Rows nobody targets are zeros
  (the kernel starts from a zeroed output unless the caller says
  ``scatter_is_permutation``, as the pipelines do: then every row is written
  once); destinations outside the output are dropped.

``num_valid_tokens`` (``int32 [1]``) bounds the output rows: rows at or past it
are zeros (values and per-row scales). With ``input_scale`` the input is
already quantized and is returned unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from humming_jax import input_quant as Q
from humming_jax.activations import ActivationSpec, apply_activation, get_activation
from humming_jax.backend import reference_gradient, resolve_backend
from pallas_kernels import process_input as kernel

LAYOUTS = ("normal", "grouped_mask", "scatter")


def _zero_rows(array: jax.Array | None, keep: jax.Array) -> jax.Array | None:
    """Zero the rows of a per-row array where ``keep`` is false (static scales pass through)."""
    if array is None or array.ndim < 2 or array.shape[0] != keep.shape[0]:
        return array
    return jnp.where(keep.reshape(-1, *([1] * (array.ndim - 1))), array, jnp.zeros((), array.dtype))


def _scatter_rows(array: jax.Array | None, destination: jax.Array, copies: int) -> jax.Array | None:
    """Row i of ``array`` to rows ``destination[i*copies : (i+1)*copies]`` of a
    zeroed output; destinations outside it (negative ones too: no wrapping) are dropped."""
    if array is None or array.ndim < 2:
        return array
    size = destination.shape[0]
    out = jnp.zeros((size, *array.shape[1:]), array.dtype)
    inside = jnp.where(destination >= 0, destination, size)
    return out.at[inside].set(jnp.repeat(array, copies, axis=0), mode="drop")


def _check_layout_args(x, layout, expert_num_tokens, scatter_idx, num_valid_tokens):
    if layout not in LAYOUTS:
        raise ValueError(f"process_input: layout: expected one of {LAYOUTS}, got {layout!r}")
    if (layout == "grouped_mask") != (expert_num_tokens is not None):
        raise ValueError("process_input: expert_num_tokens is required for, and only for, layout 'grouped_mask'")
    if (layout == "scatter") != (scatter_idx is not None):
        raise ValueError("process_input: scatter_idx is required for, and only for, layout 'scatter'")
    if layout == "grouped_mask":
        if expert_num_tokens.ndim != 1:
            raise ValueError(f"process_input: expert_num_tokens must be [E], got shape {expert_num_tokens.shape}")
        if x.shape[0] % expert_num_tokens.shape[0]:
            raise ValueError(
                f"process_input: x has {x.shape[0]} rows, not a multiple of E={expert_num_tokens.shape[0]} "
                "(grouped_mask input is [E*max_tokens, K])"
            )
    if layout == "scatter" and (scatter_idx.ndim not in (1, 2) or scatter_idx.shape[0] != x.shape[0]):
        raise ValueError(
            f"process_input: scatter_idx must be [M] or [M, R] with M={x.shape[0]}, got {scatter_idx.shape}"
        )
    if num_valid_tokens is not None and num_valid_tokens.size != 1:
        raise ValueError(f"process_input: num_valid_tokens must hold one element, got shape {num_valid_tokens.shape}")


@dataclasses.dataclass(frozen=True)
class ProcessSteps:
    """The static part of a :func:`process_input` call, validated."""

    spec: Q.InputQuantSpec
    activation: ActivationSpec | None
    hadamard_block_size: int | None
    layout: str
    compute_dtype: jnp.dtype
    scatter_is_permutation: bool = False
    dequantize: bool = False  # the quantized values times their scales, in compute_dtype


def check_dequantize(spec: Q.InputQuantSpec) -> None:
    """Raise unless ``spec``'s values times its scales can be returned in place
    of them (``process_input(dequantize=True)``): e4m3/e5m2 with f32 scales
    per tensor (static), token or group."""
    modes = (Q.InputQuantMode.STATIC_TENSOR, Q.InputQuantMode.DYNAMIC_TOKEN, Q.InputQuantMode.DYNAMIC_GROUP)
    fp8 = spec.dtype is not None and spec.dtype.value in ("float8_e4m3", "float8_e5m2")
    if not (fp8 and spec.mode in modes and spec.scale_type.value == "float32"):
        raise ValueError(
            f"process_input: dequantize: {spec.name} (e4m3/e5m2 values with f32 scales per tensor, token or group)"
        )


def _dequantized_output(q: Q.QuantizedInput, compute_dtype) -> Q.QuantizedInput:
    """The values of ``q`` times its scales as an unquantized input (one rounding to ``compute_dtype``)."""
    return _unquantized(Q.dequantize_input(q).astype(compute_dtype))


def _unquantized(values: jax.Array) -> Q.QuantizedInput:
    """``values [M, K]`` as an unquantized input (``dequantize=True``'s result)."""
    return Q.QuantizedInput(values=values, scale=None, scale_2=None, spec=Q.NONE, k=values.shape[1])


class ProcessArrays(NamedTuple):
    """The layout's and the quantizer's device arrays (None where unused)."""

    expert_num_tokens: jax.Array | None
    scatter_idx: jax.Array | None
    num_valid_tokens: jax.Array | None
    static_scale: jax.Array | None


def process_input_reference(x: jax.Array, steps: ProcessSteps, arrays: ProcessArrays) -> Q.QuantizedInput:
    """The semantics of :func:`process_input` (no validation)."""
    spec, activation, layout = steps.spec, steps.activation, steps.layout
    expert_num_tokens, scatter_idx, num_valid_tokens, static_scale = arrays
    y = x
    if activation is not None:
        y = apply_activation(y, activation)
    if steps.hadamard_block_size is not None:
        y = Q.hadamard_rotate(y, steps.hadamard_block_size)
    if spec.is_quantized:
        q = Q.quantize_input(y, spec, static_scale=static_scale)
        values, scale, scale_2 = q.values, q.scale, q.scale_2
    else:
        values, scale, scale_2 = y.astype(steps.compute_dtype), None, None
    k = y.shape[1]
    m_in = x.shape[0]
    if layout == "scatter":
        destination = scatter_idx.reshape(-1).astype(jnp.int32)
        copies = 1 if scatter_idx.ndim == 1 else scatter_idx.shape[1]
        values, scale, scale_2 = (_scatter_rows(a, destination, copies) for a in (values, scale, scale_2))
        keep = jnp.ones(destination.shape[0], bool)
    elif layout == "grouped_mask":
        max_tokens = m_in // expert_num_tokens.shape[0]
        rows = jnp.arange(m_in, dtype=jnp.int32)
        keep = (rows % max_tokens) < expert_num_tokens.astype(jnp.int32)[rows // max_tokens]
    else:
        keep = jnp.ones(m_in, bool)
    if num_valid_tokens is not None:
        keep = keep & (jnp.arange(keep.shape[0]) < num_valid_tokens.reshape(-1)[0])
    values, scale, scale_2 = (_zero_rows(a, keep) for a in (values, scale, scale_2))
    q = Q.QuantizedInput(values=values, scale=scale, scale_2=scale_2, spec=spec, k=k)
    return _dequantized_output(q, steps.compute_dtype) if steps.dequantize else q


_COMPUTE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))  # unquantized outputs
_STATIC = (
    "spec",
    "activation",
    "hadamard_block_size",
    "layout",
    "compute_dtype",
    "tiles",
    "backend",
    "scatter_is_permutation",
    "dequantize",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
@reference_gradient(_STATIC)
def process_input(
    x: jax.Array,
    spec: Q.InputQuantSpec | str = Q.NONE,
    *,
    activation: ActivationSpec | str | None = None,
    hadamard_block_size: int | None = None,
    layout: str = "normal",
    expert_num_tokens: jax.Array | None = None,
    scatter_idx: jax.Array | None = None,
    num_valid_tokens: jax.Array | None = None,
    static_scale: jax.Array | None = None,
    input_scale: jax.Array | None = None,
    input_scale_2: jax.Array | None = None,
    compute_dtype=jnp.bfloat16,
    tiles: kernel.Tiles | None = None,
    backend: str | None = None,
    scatter_is_permutation: bool = False,
    dequantize: bool = False,
) -> Q.QuantizedInput:
    """Prepare a GEMM input (Humming's ``process_input``): activation →
    Hadamard rotation → quantization → layout, in one kernel.

    Args:
        x: ``[M, N]`` bf16/f16/f32 (``[E, max_tokens, N]`` for ``grouped_mask``),
            or values already quantized per ``spec`` when ``input_scale`` is given
            (returned unchanged; an activation is then an error).
        spec: the :class:`InputQuantSpec` or its name (``"fp8_dynamic_token"``).
        activation: applied first (gated ones halve N, reading gate and up in
            the spec's order: ``ActivationSpec.gate_up_block``); None: none.
        hadamard_block_size: rotate each block of this many columns; None: none.
        layout: ``"normal"``, ``"grouped_mask"`` or ``"scatter"``.
        expert_num_tokens: ``grouped_mask``: int32 ``[E]``, rows past each count are zero.
        scatter_idx: ``scatter``: int32 ``[M, k]``, the output row of each (token, slot).
        num_valid_tokens: optional int32 ``[1]``: rows past it are zero.
        static_scale: static modes: the f32 scale.
        input_scale: the scales of a pre-quantized ``x``.
        input_scale_2: NVFP4's second (global) scale of a pre-quantized ``x``.
        compute_dtype: the dtype of unquantized outputs.
        tiles: the kernel's tiling (``pallas_kernels.process_input.Tiles``); runs
            as given or raises with the kernel's reason; None: chosen from the width.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.
        scatter_is_permutation: the caller guarantees ``scatter_idx`` is a
            permutation (the pipelines'): no zero fill of untargeted rows.
        dequantize: return the quantized values times their scales in
            ``compute_dtype`` (an unquantized input: what a GEMM tile with
            ``dequantize_input`` reads) instead of the values and scales;
            e4m3/e5m2 with f32 scales per tensor, token or group.

    Returns:
        A :class:`QuantizedInput` with values ``[M_out, K]`` (``K/2`` bytes for
        fp4; unquantized values in ``compute_dtype``) and its scales.
    """
    spec = Q.get_input_spec(spec)
    activation = get_activation(activation)
    if jnp.dtype(compute_dtype) not in _COMPUTE_DTYPES:
        names = ", ".join(d.name for d in _COMPUTE_DTYPES)
        raise TypeError(f"process_input: compute_dtype: expected one of {names}, got {jnp.dtype(compute_dtype).name}")
    if input_scale is not None:
        if activation is not None:
            raise ValueError("process_input: activation: cannot apply an activation to a pre-quantized input")
        if scatter_idx is not None:
            raise ValueError("process_input: scatter_idx: a pre-quantized input is permuted with moe_permute")
        if not spec.is_quantized:
            raise ValueError("process_input: input_scale was given but spec is 'none'")
        # A batched [E, max_tokens, ...] input and its scale are flattened row-aligned.
        values = x.reshape(-1, x.shape[-1])
        scale = input_scale.reshape(values.shape[0], input_scale.shape[-1]) if input_scale.ndim == 3 else input_scale
        return Q.QuantizedInput(
            values=values, scale=scale, scale_2=input_scale_2, spec=spec, k=values.shape[1] * spec.packs_k
        )
    if layout == "grouped_mask" and x.ndim == 3:
        x = x.reshape(-1, x.shape[-1])
    if x.ndim != 2:
        raise ValueError(f"process_input: x must be [M, K] (or [E, max_tokens, K] for grouped_mask), got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize < 2:
        raise ValueError(
            f"process_input: x: {x.dtype} values without input_scale; pass their scale as input_scale "
            "(a pre-quantized input) or float activations"
        )
    _check_layout_args(x, layout, expert_num_tokens, scatter_idx, num_valid_tokens)
    k = activation.output_width(x.shape[1]) if activation is not None else x.shape[1]
    Q.check_hadamard_block_size(hadamard_block_size, k, "process_input: hadamard_block_size")
    if spec.is_quantized:
        spec.check_k(k, "process_input: x")
    if spec.mode.is_static != (static_scale is not None):
        need = "needs" if spec.mode.is_static else "takes no"
        raise ValueError(f"process_input: static_scale: mode {spec.mode.value!r} {need} a static tensor scale")
    if dequantize:
        check_dequantize(spec)
    steps = ProcessSteps(
        spec,
        activation,
        hadamard_block_size,
        layout,
        jnp.dtype(compute_dtype),
        bool(scatter_is_permutation),
        bool(dequantize),
    )
    arrays = ProcessArrays(expert_num_tokens, scatter_idx, num_valid_tokens, static_scale)
    if _passes_through(x, steps, arrays):  # nothing to compute: no launch (the indexed pipeline's bf16 w13 input)
        return Q.QuantizedInput(values=x, spec=spec, k=k)
    # An empty batch (T=0) has nothing to compute: the reference builds its empty outputs.
    chosen = resolve_backend(backend, "process_input") if x.shape[0] else "reference"
    if chosen == "reference":
        return process_input_reference(x, steps, arrays)
    interpret = chosen == "interpret"
    return _process_input_kernel(x, steps, arrays, tiles or kernel.Tiles(), interpret=interpret)


def _passes_through(x: jax.Array, steps: ProcessSteps, arrays: ProcessArrays) -> bool:
    """Whether the op returns ``x`` as it is: unquantized, in the compute dtype,
    no activation, rotation, reordering or row bound."""
    return (
        not steps.spec.is_quantized
        and steps.activation is None
        and steps.hadamard_block_size is None
        and steps.layout == "normal"
        and arrays.num_valid_tokens is None
        and jnp.dtype(x.dtype) == steps.compute_dtype
    )


def _process_input_kernel(
    x: jax.Array, steps: ProcessSteps, arrays: ProcessArrays, tiles: kernel.Tiles, interpret: bool
) -> Q.QuantizedInput:
    spec, activation, layout = steps.spec, steps.activation, steps.layout
    expert_num_tokens, scatter_idx, num_valid_tokens, static_scale = arrays
    m_in, k_in = x.shape
    k_out = activation.output_width(k_in) if activation is not None else k_in
    copies = 1 if scatter_idx is None or scatter_idx.ndim == 1 else scatter_idx.shape[1]
    cfg = kernel.ProcessConfig(
        k_in=k_in,
        k_out=k_out,
        activation=None if activation is None else activation.kind.value,
        clamp_limit=None if activation is None else activation.clamp_limit,
        alpha=1.702 if activation is None else activation.alpha,
        beta=1.0 if activation is None else activation.beta,
        gate_up_block=0 if activation is None else activation.gate_up_block,
        hadamard=steps.hadamard_block_size,
        mode=spec.mode.value,
        act_dtype=None if spec.dtype is None else spec.dtype.value,
        qmax=0.0 if spec.dtype is None else spec.dtype.max_value,
        group_size=spec.group_size,
        scale_type=spec.scale_type.value,
        out_dtype=steps.compute_dtype.name,
        layout=layout,
        copies=copies,
        max_tokens=m_in // expert_num_tokens.shape[0] if expert_num_tokens is not None else 0,
        tiles=tiles,
        gpu=not interpret,
        dequantize=steps.dequantize,
    )
    reason = kernel.supports(tiles, cfg, x.dtype)
    if reason:
        raise ValueError(f"process_input: tiles: the kernel does not take {reason}")
    if num_valid_tokens is None:
        num_valid_tokens = jnp.full((1,), m_in * copies, jnp.int32)
    values, scale, scale_2 = kernel.process_input(
        x,
        cfg,
        num_valid_tokens=num_valid_tokens,
        static_scale=static_scale,
        expert_num_tokens=expert_num_tokens,
        scatter_idx=scatter_idx,
        zero_filled=layout == "scatter" and not steps.scatter_is_permutation,
        interpret=interpret,
    )
    if steps.dequantize:
        return _unquantized(values)
    static = None if static_scale is None else jnp.asarray(static_scale, jnp.float32).reshape(1)
    if spec.mode == Q.InputQuantMode.STATIC_TENSOR:
        scale = static
    elif spec.mode == Q.InputQuantMode.STATIC_TENSOR_DYNAMIC_GROUP:
        scale_2 = static
    return Q.QuantizedInput(values=values, scale=scale, scale_2=scale_2, spec=spec, k=k_out)
