"""``process_input`` (DESIGN §3.4): optional activation -> optional Hadamard
rotation -> optional quantization -> layout, as one op.

Layouts:

* ``normal`` — row i in, row i out.
* ``grouped_mask`` — ``x [E*max_tokens, K]`` (or ``[E, max_tokens, K]``); only
  the first ``expert_num_tokens[e]`` rows of expert e are valid, the rest are
  written as zeros.
* ``scatter`` — row i of the input goes to rows ``scatter_idx[i, :]`` of the
  output (``[M*R, K]`` for ``scatter_idx [M, R]``): the permute of the
  grouped path fused into quantization. Rows nobody targets are zeros.

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
from humming_jax.backend import hopper_gpu, resolve_backend
from humming_jax.configs import ProcessTilesConfig
from pallas_kernels import process_input as kernel
from pallas_kernels import process_input_mosaic as mosaic_kernel

LAYOUTS = ("normal", "grouped_mask", "scatter")


def _zero_rows(array: jax.Array | None, keep: jax.Array) -> jax.Array | None:
    """Zero the rows of a per-row array where ``keep`` is false (static scales pass through)."""
    if array is None or array.ndim < 2 or array.shape[0] != keep.shape[0]:
        return array
    return jnp.where(keep.reshape(-1, *([1] * (array.ndim - 1))), array, jnp.zeros((), array.dtype))


def _scatter_rows(array: jax.Array | None, destination: jax.Array, copies: int) -> jax.Array | None:
    """Row i of ``array`` to rows ``destination[i*copies : (i+1)*copies]`` of a zeroed output."""
    if array is None or array.ndim < 2:
        return array
    out = jnp.zeros((destination.shape[0], *array.shape[1:]), array.dtype)
    return out.at[destination].set(jnp.repeat(array, copies, axis=0), mode="drop")


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
        copies = destination.shape[0] // m_in
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
    return Q.QuantizedInput(values=values, scale=scale, scale_2=scale_2, spec=spec, k=k)


@functools.partial(
    jax.jit,
    static_argnames=("spec", "activation", "hadamard_block_size", "layout", "compute_dtype", "tiles", "backend"),
)
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
    tiles: ProcessTilesConfig | None = None,
    backend: str | None = None,
) -> Q.QuantizedInput:
    """Prepare a GEMM input: ``x [M, N]`` -> activation -> Hadamard -> quantize
    -> layout, returning a :class:`QuantizedInput` (values ``[M_out, K]``, or
    ``K/2`` bytes for fp4; unquantized values are in ``compute_dtype``).

    ``x`` may be ``[E, max_tokens, K]`` for ``grouped_mask``; the output is
    flattened to 2-D. If ``input_scale`` is given, ``x`` is already quantized
    per ``spec``: it is returned unchanged (an activation is then an error).
    ``tiles`` sets the kernel's rows per program, warps, two passes (Hadamard)
    and row blocks per program (default: chosen from the width), or
    (``tiles.mosaic``) takes the Mosaic GPU kernel for a Hadamard rotation of
    bf16 rows quantized to fp8 per token (the default for that case on a
    Hopper GPU from 16384 rows: :func:`default_tiles`).
    """
    spec = Q.get_input_spec(spec)
    activation = get_activation(activation)
    if input_scale is not None:
        if activation is not None:
            raise ValueError("process_input: activation: cannot apply an activation to a pre-quantized input")
        if scatter_idx is not None:
            raise ValueError("process_input: scatter_idx: a pre-quantized input is permuted with moe_permute")
        if not spec.is_quantized:
            raise ValueError("process_input: input_scale was given but spec is 'none'")
        # A batched [E, max_tokens, ...] input and its scale are flattened row-aligned.
        values = x.reshape(-1, x.shape[-1])
        scale = input_scale.reshape(values.shape[0], -1) if input_scale.ndim == 3 else input_scale
        return Q.QuantizedInput(
            values=values, scale=scale, scale_2=input_scale_2, spec=spec, k=values.shape[1] * spec.packs_k
        )
    if layout == "grouped_mask" and x.ndim == 3:
        x = x.reshape(-1, x.shape[-1])
    if x.ndim != 2:
        raise ValueError(f"process_input: x must be [M, K] (or [E, max_tokens, K] for grouped_mask), got {x.shape}")
    _check_layout_args(x, layout, expert_num_tokens, scatter_idx, num_valid_tokens)
    k = activation.output_width(x.shape[1]) if activation is not None else x.shape[1]
    Q.check_hadamard_block_size(hadamard_block_size, k, "process_input: hadamard_block_size")
    if spec.is_quantized:
        spec.check_k(k, "process_input: x")
    if spec.mode.is_static != (static_scale is not None):
        need = "needs" if spec.mode.is_static else "takes no"
        raise ValueError(f"process_input: static_scale: mode {spec.mode.value!r} {need} a static tensor scale")
    steps = ProcessSteps(spec, activation, hadamard_block_size, layout, jnp.dtype(compute_dtype))
    arrays = ProcessArrays(expert_num_tokens, scatter_idx, num_valid_tokens, static_scale)
    chosen = resolve_backend(backend, "process_input")
    if chosen == "reference":
        return process_input_reference(x, steps, arrays)
    interpret = chosen == "interpret"
    return _process_input_kernel(x, steps, arrays, tiles or default_tiles(x, steps, interpret), interpret=interpret)


def _check_tiles(cfg, tiles: ProcessTilesConfig, x_dtype) -> None:
    """The Hadamard products need 16 rows (the MMA minimum). Two passes rotate
    b-wide column blocks of the program's rows: they need a Hadamard block size
    and groups that fit in one product. Sub-block products are for two passes
    and for the operand-blocks rotation, under the Hadamard block (the block
    size itself: one product a block, in any rotation)."""
    sub = tiles.hadamard_sub
    sub_rotation = tiles.two_pass or kernel.rotates_blocks(cfg, x_dtype)
    if sub and not (cfg.hadamard and (sub == cfg.hadamard or sub < cfg.hadamard and sub_rotation)):
        raise ValueError(
            f"process_input: tiles.hadamard_sub={sub}: sub-block products are for a Hadamard rotation in two "
            f"passes or of a bf16 input without activation, quantized per token, statically or not at all, with "
            f"sub-blocks under the Hadamard block, or the block size for whole-block products (got "
            f"hadamard_block_size={cfg.hadamard}, activation={cfg.activation}, input {jnp.dtype(x_dtype).name}, "
            f"mode {cfg.mode}, two_pass={tiles.two_pass})"
        )
    if not tiles.two_pass:
        per_row = cfg.hadamard_blocks_per_row if cfg.hadamard else 0
        if per_row and tiles.block_rows and tiles.block_rows * per_row < 16:
            raise ValueError(
                f"process_input: tiles.block_rows: the Hadamard products need 16 rows of {cfg.hadamard} columns, "
                f"so at least {-(-16 // per_row)} rows per program here; got {tiles.block_rows}"
            )
        return
    if not cfg.hadamard:
        raise ValueError("process_input: tiles.two_pass: only for a Hadamard rotation (hadamard_block_size)")
    if cfg.group_size > cfg.hadamard:
        raise ValueError(
            f"process_input: tiles.two_pass: groups of {cfg.group_size} columns span several Hadamard blocks of "
            f"{cfg.hadamard}; use one pass"
        )
    if sub and cfg.group_size > sub:
        raise ValueError(
            f"process_input: tiles.two_pass: groups of {cfg.group_size} columns span several sub-block products of "
            f"{sub} (tiles.hadamard_sub); use wider products"
        )
    if tiles.block_rows and tiles.block_rows < 16:
        raise ValueError(f"process_input: tiles.block_rows: two passes need at least 16 rows, got {tiles.block_rows}")


# Rows from which the default takes the Mosaic rotation for its case (measured on the H200 at
# K=768: 0.64-0.66 of the copy against Triton's 0.55-0.58 at 16384 rows; at 4096 rows Triton is 2x faster).
MOSAIC_ROTATION_MIN_ROWS = 16384
# Widths the default sends there: measured at 768 only (at 2048 Triton reaches 0.71 of the copy).
MOSAIC_ROTATION_MAX_K = 768
# The own-rings form at 2 warpgroups (rings of 5 blocks of 128 for a share of 3): 30.4 against the re-read form's
# 31.9 µs at K=768, T=4096 in one process, 7 interleaved rounds (3 or 4 warpgroups: rings of 1-1.5 shares, slower);
# Hadamard(64): 33.6 against 36.1 µs.
MOSAIC_ROTATION_DEFAULT = ProcessTilesConfig(mosaic=2, mosaic_own=True)


def _mosaic_config(x: jax.Array, steps: ProcessSteps, tiles: ProcessTilesConfig) -> mosaic_kernel.MosaicRotation:
    return mosaic_kernel.MosaicRotation(
        k=x.shape[1],
        hadamard=steps.hadamard_block_size or 0,
        warpgroups=tiles.mosaic,
        max_warpgroup=tiles.mosaic_max or tiles.mosaic_reread,
        reread=tiles.mosaic_reread,
        self_loads=tiles.mosaic_self_loads,
        own_rings=tiles.mosaic_own,
        # The ring forms without the compiler's barriers, one select store a part
        # (the re-read form with the default rings: 31.9 against 35.8 µs at K=768, T=4096, same run).
        auto_barriers=not (tiles.mosaic_reread or tiles.mosaic_own),
        select_store=tiles.mosaic_reread or tiles.mosaic_own,
    )


def _mosaic_problems(
    x: jax.Array, steps: ProcessSteps, cfg: mosaic_kernel.MosaicRotation, interpret: bool
) -> list[str]:
    """Why the Mosaic kernel cannot take this call as ``cfg`` (empty if it can)."""
    spec = steps.spec
    problems = [
        f"activation {steps.activation.kind.value}" if steps.activation is not None else None,
        f"input {x.dtype}" if x.dtype != jnp.bfloat16 else None,
        f"spec {spec.name}"
        if (spec.mode.value, getattr(spec.dtype, "value", None)) != ("dynamic_token", "float8_e4m3")
        else None,
        f"layout {steps.layout}" if steps.layout != "normal" else None,
        mosaic_kernel.refusal(cfg) if steps.hadamard_block_size else "no Hadamard rotation",
    ]
    if not interpret and not hopper_gpu():
        problems.append(f"a Hopper GPU (TMA and wgmma), the device is {jax.devices()[0].device_kind}")
    return [p for p in problems if p]


def default_tiles(x: jax.Array, steps: ProcessSteps, interpret: bool) -> ProcessTilesConfig:
    """The tiling when none is given: the Mosaic rotation (own-rings form, 2
    compute warpgroups) for its case on a Hopper GPU from
    ``MOSAIC_ROTATION_MIN_ROWS`` rows up to ``MOSAIC_ROTATION_MAX_K`` columns,
    else the Triton kernel's chosen tiling. Interpreted, always the latter
    (the Mosaic interpreter is for its own tests)."""
    if interpret or x.ndim != 2 or x.shape[0] < MOSAIC_ROTATION_MIN_ROWS or x.shape[1] > MOSAIC_ROTATION_MAX_K:
        return ProcessTilesConfig()
    if _mosaic_problems(x, steps, _mosaic_config(x, steps, MOSAIC_ROTATION_DEFAULT), interpret):
        return ProcessTilesConfig()
    return MOSAIC_ROTATION_DEFAULT


def _mosaic_rotation(
    x: jax.Array, steps: ProcessSteps, arrays: ProcessArrays, tiles: ProcessTilesConfig, interpret: bool
) -> Q.QuantizedInput:
    """``tiles.mosaic``: the Mosaic kernel's case (a bf16 input rotated without
    activation, fp8 e4m3 per token, the normal layout), or a ValueError."""
    spec = steps.spec
    cfg = _mosaic_config(x, steps, tiles)
    problems = _mosaic_problems(x, steps, cfg, interpret)
    if problems:
        raise ValueError(
            "process_input: tiles.mosaic: the Mosaic kernel takes a bf16 input without activation, rotated by "
            "Hadamard blocks and quantized to fp8 e4m3 per token in the normal layout; got " + "; ".join(problems)
        )
    m = x.shape[0]
    num_valid = arrays.num_valid_tokens
    num_valid = jnp.full((1,), m, jnp.int32) if num_valid is None else num_valid
    signs = jnp.asarray(kernel.hadamard_signs(mosaic_kernel.SUB), jnp.bfloat16)
    values, scale = mosaic_kernel.rotate_quantize(x, signs, num_valid, cfg, interpret=interpret)
    return Q.QuantizedInput(values=values, scale=scale, scale_2=None, spec=spec, k=x.shape[1])


def _process_input_kernel(
    x: jax.Array, steps: ProcessSteps, arrays: ProcessArrays, tiles: ProcessTilesConfig, interpret: bool
) -> Q.QuantizedInput:
    if tiles.mosaic:
        return _mosaic_rotation(x, steps, arrays, tiles, interpret)
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
        block_rows=tiles.block_rows,
        num_warps=tiles.num_warps,
        two_pass=tiles.two_pass,
        row_blocks=tiles.row_blocks,
        operand_blocks=tiles.operand_blocks,
        one_block=tiles.one_block,
        hadamard_sub=tiles.hadamard_sub,
        gpu=not interpret,
    )
    _check_tiles(cfg, tiles, x.dtype)
    if num_valid_tokens is None:
        num_valid_tokens = jnp.full((1,), m_in * copies, jnp.int32)
    values, scale, scale_2 = kernel.process_input(
        x,
        cfg,
        num_valid_tokens=num_valid_tokens,
        static_scale=static_scale,
        expert_num_tokens=expert_num_tokens,
        scatter_idx=scatter_idx,
        interpret=interpret,
    )
    static = None if static_scale is None else jnp.asarray(static_scale, jnp.float32).reshape(1)
    if spec.mode == Q.InputQuantMode.STATIC_TENSOR:
        scale = static
    elif spec.mode == Q.InputQuantMode.STATIC_TENSOR_DYNAMIC_GROUP:
        scale_2 = static
    return Q.QuantizedInput(values=values, scale=scale, scale_2=scale_2, spec=spec, k=k_out)
