"""The expert pipelines as pure functions (DESIGN §3.7): Humming grouped,
indexed and batched experts, and MoonEP experts. Each composes the ops
(routing, ``process_input``, ``gemm``), so each runs on whichever backend the
ops run on; with ``backend="reference"`` every step is pure ``jnp``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax import layouts as L
from humming_jax import routing
from humming_jax import tuning as T
from humming_jax.activations import ActivationSpec, apply_activation
from humming_jax.backend import resolve_backend
from humming_jax.configs import ExpertsConfig, is_count
from humming_jax.gemm import FLOAT_INPUTS, as_quantized_input, as_weight, format_spec, gemm, plan, takes_activation
from humming_jax.process_input import check_dequantize, process_input
from humming_jax.sharding import token_parallel
from humming_jax.tuning.heuristic import BYTE_PAIRS_MOSAIC_MIN_M
from pallas_kernels.gemm import triton

DEFAULT_BLOCK_SIZE = 64  # an indexed layout's block where no tiling names one
# Quantized inputs from this many rows an expert: the indexed pipeline (block left to it) runs
# its layer on the grouped-contiguous layout, whose GEMMs beat the indexed ones there
# (each indexed result row is stored to its slot; quantized_input.md, the 120-case bench).
INDEXED_AS_GROUPED_MIN_ROWS = 32
# Rows in all where a weight is read as byte pairs: where the grouped GEMM takes the fp8 Mosaic kernel (layer.md v3).
INDEXED_AS_GROUPED_BYTE_PAIRS_MIN_M = BYTE_PAIRS_MOSAIC_MIN_M
# Float inputs (bf16, W4A16): from this many rows an expert, where the grouped layer's
# Mosaic GEMMs outrun the indexed layer's Triton tiles (layer.md v3).
INDEXED_AS_GROUPED_FLOAT_MIN_ROWS = 1024
# 4-bit weights with float inputs (W4A16): from this many rows an expert, where the indexed
# layer's gathered tiles lose to the grouped layer's 4-bit Mosaic and mid-sized tiles (layer.md).
INDEXED_AS_GROUPED_4BIT_MIN_ROWS = 32
# Up to this many rows an expert the grouped pipeline runs the indexed stages: at decode its
# grouping and its per-expert tiles cost more than the indexed layer's aligned blocks (layer.md v7).
GROUPED_AS_INDEXED_MAX_ROWS = 1
# The indexed stages give each slot its own block, ungrouped, up to one slot per this many experts
# (and at T=1): where few slots share an expert, grouping costs a launch and saves little weight.
SLOT_BLOCKS_EXPERTS_PER_SLOT = 8
# The indexed stages leave the slots in slot order for the GEMMs to tile by expert (no grouping)
# from this many slots an expert, up to a block of tokens: where the experts outnumber the slots,
# most by-expert tiles find no work and the grouping launch is cheaper (layer.md, v87).
TILE_BY_EXPERT_MIN_SLOTS = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Weights of an expert layer (a pytree; build with :func:`quantize_experts`
    or ``checkpoints.load_experts``).

    Attributes:
        w13: gate and up projections, ``[E, N13, H]`` in the config's weight
            format (``N13 = 2·I`` for gated activations, else ``I``): gate
            rows then up rows, or interleaved by blocks
            (``w13.gate_up_block``, :func:`to_kernel_order`).
        w2: down projection, ``[E, H, I]`` in the config's w2 format.
        w13_input_scale: f32 ``[1]``, the static input scale of w13's input
            (static input modes only), else None.
        w2_input_scale: f32 ``[1]``, the same for w2's input, else None.
    """

    w13: F.QuantizedWeight
    w2: F.QuantizedWeight
    w13_input_scale: jax.Array | None = None
    w2_input_scale: jax.Array | None = None


def quantize_experts(
    w13: jax.Array,
    w2: jax.Array,
    config: ExpertsConfig,
    *,
    w13_bias: jax.Array | None = None,
    w2_bias: jax.Array | None = None,
    w13_input_scale: jax.Array | None = None,
    w2_input_scale: jax.Array | None = None,
) -> ExpertWeights:
    """Quantize a layer's float weights into the config's formats, in the
    kernels' order (:func:`to_kernel_order`). When a Hadamard block is
    configured the weights are rotated along K first, as the inputs will be.

    Args:
        w13: float ``[E, N13, H]``, gate rows then up rows for gated activations.
        w2: float ``[E, H, I]``.
        config: the layer's :class:`ExpertsConfig`.
        w13_bias: optional float ``[E, N13]`` (formats with a bias: gpt-oss).
        w2_bias: optional float ``[E, H]``.
        w13_input_scale: the static scale of w13's input (static input modes), a scalar.
        w2_input_scale: the static scale of w2's input, a scalar.

    Returns:
        The :class:`ExpertWeights`, checked against ``config``.
    """
    for name, weight in (("w13", w13), ("w2", w2)):
        if jnp.ndim(weight) != 3:  # a 2-D one would be taken as one expert's
            raise ValueError(f"quantize_experts: {name} must be [E, N, K], got shape {tuple(jnp.shape(weight))}")
    if config.hadamard_block_size:
        w13 = Q.hadamard_rotate(w13, config.hadamard_block_size)
    if config.w2_hadamard_block_size:
        w2 = Q.hadamard_rotate(w2, config.w2_hadamard_block_size)
    weights = ExpertWeights(
        F.quantize_weight(w13, config.weight_format, bias=w13_bias),
        F.quantize_weight(w2, config.w2_weight_format, bias=w2_bias),
        None if w13_input_scale is None else jnp.asarray(w13_input_scale, jnp.float32).reshape(1),
        None if w2_input_scale is None else jnp.asarray(w2_input_scale, jnp.float32).reshape(1),
    )
    check_weights(weights, config)
    return to_kernel_order(weights, config)


def to_kernel_order(weights: ExpertWeights, config: ExpertsConfig) -> ExpertWeights:
    """Repack 4-bit codes in the order the GEMM kernels read without a split
    copy of the activations (:func:`formats.to_planar`, the same values); e2m1
    codes with bf16 compute also in the pair decoder's bit order; e8m0 group
    scales in the order the Mosaic kernels read them; a gated w13's gate and
    up rows interleaved by :data:`formats.GATE_UP_BLOCK` (where N
    allows: :func:`formats.interleave_gate_up`), so that its GEMM tiles apply
    the activation themselves. What :func:`quantize_experts`, ``load_experts``
    and the NNX modules give; weights in K order or in halves still run, slower.

    Args:
        weights: the layer's :class:`ExpertWeights`.
        config: its :class:`ExpertsConfig` (compute dtype and input quantization
            choose the bit order).

    Returns:
        The same weights, 4-bit codes planar, e8m0 group scales (MXFP4,
        MXFP8) ``[E, K/32, N]`` (:func:`formats.k_major_scales_preferred`),
        w13's rows interleaved; other 16- and 8-bit weights unchanged.
    """
    half_bits = F.planar_half_bits(config.compute_dtype, config.input_quant)

    def ordered(weight: F.QuantizedWeight) -> F.QuantizedWeight:
        k_major = F.k_major_scales_preferred(weight.format)
        return F.to_planar(weight, half_bits=half_bits, k_major_scales=k_major)

    w13 = ordered(weights.w13)
    if interleaves_gate_up(w13, config):
        w13 = F.interleave_gate_up(w13, F.GATE_UP_BLOCK)
    return dataclasses.replace(weights, w13=w13, w2=ordered(weights.w2))


def interleaves_gate_up(w13: F.QuantizedWeight, config: ExpertsConfig) -> bool:
    """Whether :func:`to_kernel_order` interleaves this w13's gate and up rows:
    a gated activation that reads blocks (not SWIGLUOAI's pairs), rows in
    halves, and an N that blocks of :data:`formats.GATE_UP_BLOCK` fit."""
    if not config.activation.interleaves or w13.gate_up_block:
        return False
    return F.gate_up_block_refusal(w13.format, w13.n, F.GATE_UP_BLOCK) is None


def w13_activation(config: ExpertsConfig, weights: ExpertWeights) -> ActivationSpec:
    """The layer's activation reading w13's output in its rows' order (``w13.gate_up_block``)."""
    return dataclasses.replace(config.activation, gate_up_block=weights.w13.gate_up_block)


def check_weights(weights: ExpertWeights, config: ExpertsConfig) -> None:
    """Check ``weights`` against ``config``: shapes, formats and static scales
    (present for static input modes and, where concrete, finite and positive —
    a zero or NaN scale would zero or poison every input).

    Args:
        weights: the layer's :class:`ExpertWeights`.
        config: its :class:`ExpertsConfig`.

    Raises:
        TypeError: ``weights`` is not an :class:`ExpertWeights`.
        ValueError: naming the array that does not match and what was expected.
    """
    if not isinstance(weights, ExpertWeights):
        raise TypeError(
            f"weights: expected ExpertWeights (quantize_experts, load_experts), got {type(weights).__name__}"
        )
    for name, layer in (("w13", config.w13), ("w2", config.w2)):
        weight = getattr(weights, name)
        expected = (layer.num_experts, layer.shape_n, layer.shape_k)
        if weight.shape != expected:
            raise ValueError(f"weights.{name}: expected [E, N, K]={list(expected)}, got {list(weight.shape)}")
        if weight.format != layer.weight_format:
            raise ValueError(f"weights.{name}: format {weight.format.name!r} != config {layer.weight_format.name!r}")
        weight.validate(f"weights.{name}")
        if weight.gate_up_block and (name == "w2" or not config.activation.interleaves):
            raise ValueError(
                f"weights.{name}.gate_up_block: rows interleaved by {weight.gate_up_block}, but only a gated w13 "
                f"whose activation reads blocks (not {config.activation.kind.value!r}) is stored so "
                "(formats.gate_up_halves)"
            )
        scale = getattr(weights, f"{name}_input_scale")
        if layer.input_quant.mode.is_static and scale is None:
            raise ValueError(f"weights.{name}_input_scale: input mode {layer.input_quant.name!r} needs a static scale")
        if not layer.input_quant.mode.is_static and scale is not None:
            raise ValueError(f"weights.{name}_input_scale: input mode {layer.input_quant.name!r} takes no static scale")
        if scale is not None and not isinstance(scale, jax.core.Tracer):
            values = np.asarray(scale, np.float64)
            if not np.all(np.isfinite(values) & (values > 0)):
                raise ValueError(f"weights.{name}_input_scale: expected a finite positive scale, got {values.tolist()}")


def estimate_valid_shape_m(num_tokens: int, top_k: int, config: ExpertsConfig) -> int:
    """The rows a layer's GEMMs are expected to hold on this device (vLLM's
    estimate for choosing a tuning entry): the routed slots times the share of
    the experts held here.

    Args:
        num_tokens: the tokens routed, T.
        top_k: the slots a token, k.
        config: the layer's :class:`ExpertsConfig` (its local and global experts).

    Returns:
        ``ceil(T · k · E_local / E_global)``.
    """
    return math.ceil(num_tokens * top_k * config.num_experts / config.global_num_experts)


def indexed_block_size(num_tokens: int, top_k: int, config: ExpertsConfig) -> int:
    """The indexed pipeline's alignment block: the rows of the tile the tuning
    table or the heuristic gives its w13 call (a tile is one block, as vLLM's
    ``BLOCK_SIZE_M`` is; :func:`~humming_jax.tuning.indexed_block_rows`): 16
    at decode, 64-128 at prefill;
    :data:`DEFAULT_BLOCK_SIZE` if none is listed."""
    quant = config.input_quant
    listed = T.candidates(
        "indexed",
        config.weight_format,
        max(1, estimate_valid_shape_m(num_tokens, top_k, config)),
        config.num_experts,
        config.w13.shape_n,
        config.w13.shape_k,
        input_dtype=quant.dtype.value if quant.is_quantized else None,
    )
    rows = T.indexed_block_rows(listed)
    return DEFAULT_BLOCK_SIZE if rows is None else rows


def indexed_runs_grouped(num_tokens: int, top_k: int, config: ExpertsConfig) -> bool:
    """Whether the indexed pipeline, its blocks left to it, runs the grouped
    stages: quantized inputs from :data:`INDEXED_AS_GROUPED_MIN_ROWS` rows an
    expert — or, where an 8-bit weight is read as byte pairs (over 2**31
    values: the indexed GEMM stays on the Triton tile while the grouped one
    takes the fp8 Mosaic kernel), from :data:`INDEXED_AS_GROUPED_BYTE_PAIRS_MIN_M`
    rows —, float inputs from :data:`INDEXED_AS_GROUPED_4BIT_MIN_ROWS` with 4-bit
    weights and :data:`INDEXED_AS_GROUPED_FLOAT_MIN_ROWS` with wider ones; never
    with ``batch_invariant`` (one layout for every batch size)."""
    if config.batch_invariant:
        return False
    valid_m = estimate_valid_shape_m(num_tokens, top_k, config)
    experts = max(config.num_experts, 1)
    if not config.input_quant.is_quantized:
        four_bit = config.weight_format.value_type.bits == 4
        rows = INDEXED_AS_GROUPED_4BIT_MIN_ROWS if four_bit else INDEXED_AS_GROUPED_FLOAT_MIN_ROWS
        return valid_m >= rows * experts
    if valid_m >= INDEXED_AS_GROUPED_MIN_ROWS * experts:
        return True
    return valid_m >= INDEXED_AS_GROUPED_BYTE_PAIRS_MIN_M and _reads_byte_pairs(config)


def grouped_runs_indexed(num_tokens: int, top_k: int, config: ExpertsConfig) -> bool:
    """Whether the grouped pipeline runs the indexed stages (their blocks from
    the tuning): up to :data:`GROUPED_AS_INDEXED_MAX_ROWS` rows an expert, and
    where those stages tile the slots by expert (:func:`tiles_by_expert`, no
    grouping launch); not where :func:`indexed_runs_grouped` holds, never with
    ``batch_invariant`` (one layout for every batch size)."""
    if config.batch_invariant or indexed_runs_grouped(num_tokens, top_k, config):
        return False
    valid_m = estimate_valid_shape_m(num_tokens, top_k, config)
    if valid_m <= GROUPED_AS_INDEXED_MAX_ROWS * max(config.num_experts, 1):
        return True
    block = indexed_block_size(num_tokens, top_k, config)
    return tiles_by_expert(num_tokens, top_k, (block, block), config, has_map=False)


def slot_blocks_apply(num_tokens: int, top_k: int, config: ExpertsConfig, has_map: bool) -> bool:
    """Whether the indexed stages lay out each slot as its own block
    (:func:`routing.moe_slot_blocks`, no grouping): at T=1 or up to one slot
    per :data:`SLOT_BLOCKS_EXPERTS_PER_SLOT` experts; not with an expert map
    (the ids would need mapping) nor ``batch_invariant``."""
    if has_map or config.batch_invariant:
        return False
    slots = num_tokens * top_k
    return num_tokens == 1 or slots * SLOT_BLOCKS_EXPERTS_PER_SLOT <= config.num_experts


def tiles_by_expert(num_tokens: int, top_k: int, blocks: tuple[int, int], config: ExpertsConfig, has_map: bool) -> bool:
    """Whether the indexed stages lay out the slots in slot order for the
    GEMMs to tile by expert (``Indexed(tile_by_expert=k)``, no grouping): from
    :data:`TILE_BY_EXPERT_MIN_SLOTS` slots an expert up to a block's rows of
    tokens (both GEMMs' ``blocks``), where :func:`slot_blocks_apply` does not
    hold; not with an expert map nor ``batch_invariant``."""
    if has_map or config.batch_invariant or slot_blocks_apply(num_tokens, top_k, config, has_map):
        return False
    return TILE_BY_EXPERT_MIN_SLOTS * config.num_experts <= num_tokens * top_k and num_tokens <= min(blocks)


def _reads_byte_pairs(config: ExpertsConfig) -> bool:
    """Whether the Triton GEMM reads either weight as byte pairs (``triton.reads_byte_pairs``)."""
    layers = ((config.weight_format, config.w13), (config.w2_weight_format, config.w2))
    return any(
        triton.reads_byte_pairs(format_spec(fmt, (layer.num_experts, layer.shape_n, layer.shape_k)))
        for fmt, layer in layers
    )


def check_float_input(hidden_states, op: str) -> None:
    """Raise unless ``hidden_states`` are float activations: quantized values
    (fp8, int8 codes) come with their scale (``a1q_scale``), or they would be
    quantized again as if they were activations."""
    if jnp.dtype(hidden_states.dtype) not in FLOAT_INPUTS:
        raise ValueError(
            f"{op}: hidden_states: {hidden_states.dtype} values without a1q_scale; pass their scale as a1q_scale "
            "(pre-quantized input) or float activations (bfloat16, float16, float32)"
        )


def check_prequantized_input(hidden_states, a1q_scale, config: ExpertsConfig, op: str) -> None:
    """Raise, naming ``op`` and the argument, unless ``hidden_states`` are
    ``config.input_quant``'s values ``[..., H / packs]`` in its storage dtype
    and ``a1q_scale`` their scale in its dtype: ``[..., H / group]`` (per
    group), ``[..., 1]`` (per token) or ``[1]`` (per tensor)."""
    spec = config.input_quant
    if not spec.is_quantized:
        raise ValueError(
            f"{op}: a1q_scale was given but config.input_quant is 'none': pass float activations without a1q_scale"
        )
    if spec.scale_2_shape(1) is not None:
        raise ValueError(
            f"{op}: a1q_scale: {spec.name} inputs carry a second scale a pre-quantized input does not take; "
            "pass float activations"
        )
    cols = config.hidden_size // spec.packs_k
    if hidden_states.ndim < 2 or hidden_states.shape[-1] != cols:
        raise ValueError(f"{op}: hidden_states: {spec.name} values must be [..., {cols}], got {hidden_states.shape}")
    if jnp.dtype(hidden_states.dtype) != jnp.dtype(spec.dtype.storage_dtype):
        raise TypeError(
            f"{op}: hidden_states: {spec.name} values must be {jnp.dtype(spec.dtype.storage_dtype).name}, "
            f"got {hidden_states.dtype}"
        )
    per_row = spec.scale_shape(1, config.hidden_size)
    expected = (*hidden_states.shape[:-1], per_row[-1]) if len(per_row) == 2 else per_row
    if tuple(a1q_scale.shape) != tuple(expected):
        raise ValueError(f"{op}: a1q_scale must be {list(expected)} for {spec.name}, got {a1q_scale.shape}")
    if jnp.dtype(a1q_scale.dtype) != jnp.dtype(spec.scale_dtype):
        raise TypeError(
            f"{op}: a1q_scale must be {jnp.dtype(spec.scale_dtype).name} for {spec.name}, got {a1q_scale.dtype}"
        )


def check_routing_inputs(hidden_states, topk_weights, topk_ids, config: ExpertsConfig, op: str, a1q_scale=None) -> None:
    """Raise, naming ``op`` and the argument, unless ``hidden_states`` are float
    ``[T, H]`` (with ``a1q_scale``: pre-quantized, :func:`check_prequantized_input`)
    and ``topk_ids`` / ``topk_weights`` (floats) ``[T, top_k]``."""
    if a1q_scale is None:
        check_float_input(hidden_states, op)
        if hidden_states.ndim != 2 or hidden_states.shape[1] != config.hidden_size:
            raise ValueError(f"{op}: hidden_states must be [T, H={config.hidden_size}], got {hidden_states.shape}")
    else:
        check_prequantized_input(hidden_states, a1q_scale, config, op)
        if hidden_states.ndim != 2:
            raise ValueError(f"{op}: hidden_states must be [T, H / packs], got {hidden_states.shape}")
    if topk_ids.shape != (hidden_states.shape[0], config.top_k):
        raise ValueError(
            f"{op}: topk_ids must be [T, top_k]=[{hidden_states.shape[0]}, {config.top_k}], got {topk_ids.shape}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{op}: topk_weights must match topk_ids {topk_ids.shape}, got {topk_weights.shape}")
    routing.check_topk_weights(topk_weights, op)


def in_input_dtype(out: jax.Array, hidden_states: jax.Array, a1q_scale: jax.Array | None) -> jax.Array:
    """The layer's output (in ``config.compute_dtype``) cast to its float
    input's dtype; for a pre-quantized input, unchanged."""
    return out if a1q_scale is not None else out.astype(hidden_states.dtype)


def _expert_map_kwargs(config: ExpertsConfig, expert_map):
    return dict(num_experts=config.global_num_experts, expert_map=expert_map, num_local_experts=config.num_experts)


def _gemm_kwargs(config: ExpertsConfig, valid_shape_m: int, backend):
    return dict(
        out_dtype=jnp.dtype(config.compute_dtype),
        use_f16_accum=config.use_f16_accum,
        batch_invariant=config.batch_invariant,
        valid_shape_m=valid_shape_m,
        backend=backend,
    )


def _down_input(
    values, config: ExpertsConfig, weights: ExpertWeights, backend, dequantize=False, activated=False, **layout_kwargs
):
    """Activation + Hadamard + quantization of the w2 input (multiplied back
    out with ``dequantize``: :func:`multiplied_out_tiles`); ``activated``:
    ``values`` are w13's rows its tiles already applied the activation to
    (rows no expert owns already zero, so no row bound: without a rotation
    or quantization, no launch)."""
    return process_input(
        values,
        config.w2_input_quant,
        activation=None if activated else w13_activation(config, weights),
        hadamard_block_size=config.w2_hadamard_block_size,
        static_scale=weights.w2_input_scale,
        compute_dtype=jnp.dtype(config.compute_dtype),
        backend=backend,
        dequantize=dequantize,
        **layout_kwargs,
    )


def _w13_with_activation(
    config: ExpertsConfig, weights: ExpertWeights, x, layout, backend, w2_reads_quantized: bool = True, **gemm_kwargs
) -> dict:
    """w13's stage: ``activated`` (the activation applied by the GEMM's tiles,
    where one takes it: :func:`takes_activation`; also quantized as w2's input
    where they take that too, without a rotation — as w2 reads it, or
    multiplied back out where w2 runs on the input multiplied out) or
    ``gate_up`` (the sums, for the activation stage's pass)."""
    activation = w13_activation(config, weights)
    quant = config.w2_input_quant
    kw = dict(backend=backend, **gemm_kwargs)
    epilogues = [kw]
    if quant == Q.FP8_DYNAMIC_GROUP128 and not config.w2_hadamard_block_size:
        # w2's input quantized there too, where a tile can (multiplied back out for w2's multiplied-out tiles)
        epilogues.insert(0, dict(kw, out_quant=quant, out_dequantized=not w2_reads_quantized))
    for epilogue in epilogues:
        if takes_activation(x, weights.w13, layout, activation, **epilogue):
            out = gemm(x, weights.w13, layout, activation=activation, **epilogue)
            if epilogue.get("out_dequantized"):  # w2's input multiplied out, as the pass would give it
                out = as_quantized_input(out)
            return dict(gate_up=None, activated=out)
    return dict(gate_up=gemm(x, weights.w13, layout, **kw), activated=None)


def _down_input_stage(s: dict, config: ExpertsConfig, backend, dequantize: bool, **layout_kwargs):
    """The activation stage's w2 input: a pass over w13's sums, or over the
    activated rows, or those rows quantized by w13's tiles as they are."""
    activated = s["activated"]
    if isinstance(activated, Q.QuantizedInput):
        return activated
    if activated is not None:
        return _down_input(activated, config, s["weights"], backend, dequantize, activated=True)
    return _down_input(s["gate_up"], config, s["weights"], backend, dequantize=dequantize, **layout_kwargs)


def multiplied_out_tiles(config: ExpertsConfig, name: str, weight, layout, rows: int, valid_m: int, backend):
    """Where the ``name`` GEMM (``"w13"``/``"w2"``) would multiply its quantized
    input of ``rows`` rows out to bf16 first (its tiling's ``dequantize_input``),
    that tiling for the multiplied-out input — ``process_input(dequantize=True)``
    then writes that input itself, saving the GEMM's pass —; else None (float
    or non-fp8 inputs, the reference backend, other tilings)."""
    spec = config.input_quant if name == "w13" else config.w2_input_quant
    chosen = resolve_backend(backend, "gemm")
    if chosen == "reference" or not spec.is_quantized:
        return None
    try:
        check_dequantize(spec)
    except ValueError:
        return None
    width = getattr(config, name).shape_k
    static = jnp.ones((), jnp.float32) if spec.mode.is_static else None
    x = jax.eval_shape(
        lambda v: Q.quantize_input(v, spec, static_scale=static), jax.ShapeDtypeStruct((rows, width), jnp.float32)
    )
    kwargs = _gemm_kwargs(config, valid_m, None)
    tiles, _ = plan(
        x,
        weight,
        layout,
        kwargs["out_dtype"],
        config.use_f16_accum,
        config.batch_invariant,
        valid_m,
        interpret=chosen == "interpret",
    )
    if tiles is None or not getattr(tiles, "dequantize_input", False):
        return None
    return dataclasses.replace(tiles, dequantize_input=False)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a pipeline: ``run(state)`` reads entries of the state (a
    dict of arrays and weights) and returns the entries it adds. The
    pipelines run their stages in order; the layer benchmark times each on
    the state the previous ones left."""

    name: str
    run: Callable[[dict], dict]


def run_stages(stages, state: dict) -> dict:
    """The state after every stage of ``stages`` ran on it in order."""
    for stage in stages:
        state = {**state, **stage.run(state)}
    return state


def _stage_gemm_kwargs(config: ExpertsConfig, state: dict, backend: str | None) -> dict:
    """The GEMM keywords of a pipeline stage (the tuning's row estimate from the routing's shape)."""
    num_tokens, top_k = state["topk_ids"].shape
    return _gemm_kwargs(config, estimate_valid_shape_m(num_tokens, top_k, config), backend)


def _either(config: ExpertsConfig, switch, mine: tuple[Stage, ...], other: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """Stages that run ``other``'s where ``switch(T, k, config)`` holds for
    the call's routing, ``mine`` elsewhere (the two pipelines name their
    stages alike; one call runs one pipeline's throughout)."""

    def either(own: Stage, alternative: Stage) -> Stage:
        def run(s):
            return (alternative if switch(*s["topk_ids"].shape, config) else own).run(s)

        return Stage(own.name, run)

    return tuple(either(m, o) for m, o in zip(mine, other, strict=True))


def grouped_stages(config: ExpertsConfig, backend: str | None = None) -> tuple[Stage, ...]:
    """The grouped pipeline as stages over the state ``hidden_states [T, H]``
    (or pre-quantized values with ``a1q_scale``), ``weights``,
    ``topk_weights``, ``topk_ids [T, k]``, ``expert_map`` and ``a1q_scale``
    (each possibly None; ``num_valid_tokens`` optional); the last adds
    ``out [T, H]``. Float activations are scattered by ``process_input``;
    pre-quantized ones are permuted with their scales. A call
    :func:`grouped_runs_indexed` takes (decode) runs the indexed stages
    instead, the same result."""
    grouped = _grouped_layout_stages(config, backend)
    indexed = _indexed_layout_stages(config, None, None, backend)
    return _either(config, grouped_runs_indexed, grouped, indexed)


def _grouped_layout_stages(config: ExpertsConfig, backend: str | None) -> tuple[Stage, ...]:
    """The stages on the grouped-contiguous layout (:func:`grouped_stages`)."""

    def gemm_kwargs(s):
        return _stage_gemm_kwargs(config, s, backend)

    def route(s):
        map_kwargs = _expert_map_kwargs(config, s["expert_map"])
        topk_ids = _valid_token_ids(s["topk_ids"], s.get("num_valid_tokens"), config)
        if s.get("a1q_scale") is not None:
            permuted = routing.moe_permute(
                s["hidden_states"], topk_ids, a1q_scale=s["a1q_scale"], backend=backend, **map_kwargs
            )
            return dict(
                offsets=permuted.expert_first_token_offset,
                inv_perm=permuted.inv_permuted_idx,
                permuted=(permuted.permuted_hidden_states, permuted.permuted_scale),
            )
        offsets, scatter_idx = routing.moe_prepare_scatter(topk_ids, backend=backend, **map_kwargs)
        return dict(offsets=offsets, scatter_idx=scatter_idx, inv_perm=scatter_idx.reshape(-1))

    def grouped_layout(s) -> L.GroupedContiguous:
        # The routing's offsets are in range and non-decreasing: no running maximum before each GEMM.
        return L.GroupedContiguous(s["offsets"], normalized=True)

    def multiplied_out(s, name: str):
        """:func:`multiplied_out_tiles` of this call's ``name`` GEMM."""
        weight = getattr(s["weights"], name)
        rows = s["topk_ids"].size
        valid_m = gemm_kwargs(s)["valid_shape_m"]
        return multiplied_out_tiles(config, name, weight, grouped_layout(s), rows, valid_m, backend)

    def scatter_input(s):
        if s.get("a1q_scale") is not None:
            values, scale = s["permuted"]
            return dict(gate_up_input=process_input(values, config.input_quant, input_scale=scale, backend=backend))
        gate_up_input = process_input(
            s["hidden_states"],
            config.input_quant,
            hadamard_block_size=config.hadamard_block_size,
            layout="scatter",
            scatter_idx=s["scatter_idx"],
            scatter_is_permutation=True,  # moe_prepare_scatter's: every row written once
            num_valid_tokens=s["offsets"][-1:],
            static_scale=s["weights"].w13_input_scale,
            compute_dtype=jnp.dtype(config.compute_dtype),
            backend=backend,
            dequantize=multiplied_out(s, "w13") is not None,
        )
        return dict(gate_up_input=gate_up_input)

    def grouped_gemm(s, name: str, x):
        layout = grouped_layout(s)
        tiles = multiplied_out(s, name) if not x.spec.is_quantized else None
        return gemm(x, getattr(s["weights"], name), layout, **gemm_kwargs(s), tuning=tiles)

    def w13(s):
        x = s["gate_up_input"]
        layout = grouped_layout(s)
        tiles = multiplied_out(s, "w13") if not x.spec.is_quantized else None
        kwargs = {**gemm_kwargs(s), "tuning": tiles}
        del kwargs["backend"]
        reads_quantized = multiplied_out(s, "w2") is None
        return _w13_with_activation(config, s["weights"], x, layout, backend, reads_quantized, **kwargs)

    def activation(s):
        dequantize = multiplied_out(s, "w2") is not None
        down_input = _down_input_stage(s, config, backend, dequantize, num_valid_tokens=s["offsets"][-1:])
        return dict(down_input=down_input)

    def w2(s):
        return dict(down=grouped_gemm(s, "w2", s["down_input"]))

    def combine(s):
        out = routing.moe_unpermute(s["down"], s["topk_weights"], s["inv_perm"], s["offsets"], backend=backend)
        return dict(out=out)

    return (
        Stage("routing", route),
        Stage("input", scatter_input),
        Stage("w13", w13),
        Stage("activation", activation),
        Stage("w2", w2),
        Stage("combine", combine),
    )


def _valid_token_ids(topk_ids: jax.Array, num_valid_tokens: jax.Array | None, config: ExpertsConfig) -> jax.Array:
    """``topk_ids`` with the slots of tokens past ``num_valid_tokens`` (int32
    ``[1]``; None: every token) on no expert (id E: dropped, zero output rows)."""
    if num_valid_tokens is None:
        return topk_ids
    token = jnp.arange(topk_ids.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(token < num_valid_tokens.reshape(-1)[0], topk_ids, config.global_num_experts)


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def humming_grouped_experts(
    hidden_states: jax.Array,
    weights: ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    config: ExpertsConfig,
    expert_map: jax.Array | None = None,
    a1q_scale: jax.Array | None = None,
    backend: str | None = None,
    num_valid_tokens: jax.Array | None = None,
) -> jax.Array:
    """The expert layer on the grouped-contiguous layout (vLLM's
    ``humming_grouped_experts``): scatter each token's k slots into expert
    order (quantizing them), w13, activation and quantization, w2, weighted
    unpermute. Jitted; token-sharded inputs keep their sharding. At decode
    (:func:`grouped_runs_indexed` says where) it runs the indexed pipeline's
    stages instead: the same result, faster.

    Args:
        hidden_states: ``[T, H]`` bf16/f16/f32 activations, or values already
            quantized to ``config.input_quant`` when ``a1q_scale`` is given.
        weights: the layer's :class:`ExpertWeights`.
        topk_weights: ``[T, k]`` float router weights.
        topk_ids: ``[T, k]`` int32 expert ids; ids outside ``[0, E)`` (or mapped
            to −1) contribute nothing.
        config: the layer's :class:`ExpertsConfig` (static).
        expert_map: optional int32 ``[global E]`` → local expert or −1 (expert
            parallelism as vLLM writes it).
        a1q_scale: the scales of pre-quantized ``hidden_states``: ``[T, H / group]``,
            ``[T, 1]`` or ``[1]`` as ``config.input_quant`` makes them (float32; e8m0 uint8).
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.
        num_valid_tokens: optional int32 ``[1]``, the real tokens of a padded
            batch (a bucketed shape): the tokens past it contribute nothing
            (on the grouped layout they get no rows at all) and come out zero.

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype, computed in ``config.compute_dtype``
        (the output's dtype for pre-quantized inputs).
    """
    check_routing_inputs(hidden_states, topk_weights, topk_ids, config, "humming_grouped_experts", a1q_scale)
    check_num_valid_tokens(num_valid_tokens, "humming_grouped_experts")
    check_weights(weights, config)
    tokens = (hidden_states, topk_weights, topk_ids, a1q_scale)
    if num_valid_tokens is not None:  # a count over the whole batch: not split by token
        return _grouped_run(tokens, (weights, expert_map, num_valid_tokens), config, backend)
    rest = (weights, expert_map, None)
    return token_parallel(_grouped_run, tokens, rest, (config, backend), "humming_grouped_experts")


def check_num_valid_tokens(num_valid_tokens, op: str) -> None:
    """Raise, naming ``op``, unless ``num_valid_tokens`` is None or an integer array of one count."""
    if num_valid_tokens is None:
        return
    if not jnp.issubdtype(num_valid_tokens.dtype, jnp.integer) or num_valid_tokens.size != 1:
        raise ValueError(
            f"{op}: num_valid_tokens must be an integer array of one count ([1]), "
            f"got {num_valid_tokens.dtype} {num_valid_tokens.shape}"
        )


def _grouped_run(tokens, rest, config, backend):
    hidden_states, topk_weights, topk_ids, a1q_scale = tokens
    weights, expert_map, num_valid_tokens = rest
    state = dict(hidden_states=hidden_states, weights=weights, topk_weights=topk_weights, topk_ids=topk_ids)
    state.update(expert_map=expert_map, a1q_scale=a1q_scale, num_valid_tokens=num_valid_tokens)
    return in_input_dtype(run_stages(grouped_stages(config, backend), state)["out"], hidden_states, a1q_scale)


@functools.partial(jax.jit, static_argnames=("config", "block_size", "w2_block_size", "backend"))
def humming_indexed_experts(
    hidden_states: jax.Array,
    weights: ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    config: ExpertsConfig,
    expert_map: jax.Array | None = None,
    a1q_scale: jax.Array | None = None,
    block_size: int | None = None,
    w2_block_size: int | None = None,
    num_valid_tokens: jax.Array | None = None,
    backend: str | None = None,
) -> jax.Array:
    """The expert layer on the indexed layout (vLLM's
    ``humming_indexed_experts``): align the slots into blocks of one expert,
    w13 reading ``[T, H]`` rows by index and writing ``[T·k, N13]``,
    activation and quantization, w2 (``top_k=1``, re-aligned when its block
    size differs), fused weighted top-k sum. Jitted. With quantized inputs
    from 32 rows an expert, float ones from 1024 (:func:`indexed_runs_grouped`
    says where), and no block given, the layer runs on the grouped layout
    instead: the same result, faster.

    Args:
        hidden_states: ``[T, H]`` activations, or pre-quantized values with ``a1q_scale``.
        weights: the layer's :class:`ExpertWeights`.
        topk_weights: ``[T, k]`` float router weights.
        topk_ids: ``[T, k]`` int32 expert ids (outside ``[0, E)``: nothing).
        config: the layer's :class:`ExpertsConfig` (static).
        expert_map: optional int32 ``[global E]`` → local expert or −1.
        a1q_scale: the scales of pre-quantized ``hidden_states``: ``[T, H / group]``,
            ``[T, 1]`` or ``[1]`` as ``config.input_quant`` makes them (float32; e8m0 uint8).
        block_size: rows of an aligned block; None: the rows of the tile the
            tuning gives the w13 call (:func:`indexed_block_size`).
        w2_block_size: the same for w2; None: ``block_size``.
        num_valid_tokens: optional int32 ``[1]``, the real tokens of a padded batch.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype, computed in ``config.compute_dtype``
        (the output's dtype for pre-quantized inputs).
    """
    check_routing_inputs(hidden_states, topk_weights, topk_ids, config, "humming_indexed_experts", a1q_scale)
    check_num_valid_tokens(num_valid_tokens, "humming_indexed_experts")
    check_weights(weights, config)
    tokens = (hidden_states, topk_weights, topk_ids, a1q_scale)
    static = (config, block_size, w2_block_size, backend)
    if num_valid_tokens is not None:  # a count over the whole batch: not split by token
        return _indexed_run(tokens, (weights, expert_map, num_valid_tokens), *static)
    return token_parallel(_indexed_run, tokens, (weights, expert_map, None), static, "humming_indexed_experts")


def _indexed_run(tokens, rest, config, block_size, w2_block_size, backend):
    hidden_states, topk_weights, topk_ids, a1q_scale = tokens
    weights, expert_map, num_valid_tokens = rest
    state = dict(hidden_states=hidden_states, weights=weights, topk_weights=topk_weights, topk_ids=topk_ids)
    state.update(expert_map=expert_map, a1q_scale=a1q_scale, num_valid_tokens=num_valid_tokens)
    out = run_stages(indexed_stages(config, block_size, w2_block_size, backend), state)["out"]
    return in_input_dtype(out, hidden_states, a1q_scale)


def indexed_stages(
    config: ExpertsConfig,
    block_size: int | None = None,
    w2_block_size: int | None = None,
    backend: str | None = None,
) -> tuple[Stage, ...]:
    """The indexed pipeline as stages over the state ``hidden_states [T, H]``
    (or pre-quantized values with ``a1q_scale``), ``weights``,
    ``topk_weights``, ``topk_ids [T, k]``, ``expert_map``, ``a1q_scale`` and
    ``num_valid_tokens`` (each possibly None); the last adds ``out [T, H]``.
    ``block_size`` None: :func:`indexed_block_size`; ``w2_block_size`` None:
    ``block_size`` (one alignment serves both GEMMs). With both None, a call
    :func:`indexed_runs_grouped` takes runs the grouped stages instead (the
    same result, the tokens past ``num_valid_tokens`` on no expert)."""
    indexed = _indexed_layout_stages(config, block_size, w2_block_size, backend)
    if block_size is not None or w2_block_size is not None:
        return indexed
    return _either(config, indexed_runs_grouped, indexed, _grouped_layout_stages(config, backend))


def _indexed_layout_stages(
    config: ExpertsConfig, block_size: int | None, w2_block_size: int | None, backend: str | None
) -> tuple[Stage, ...]:
    """The stages on the indexed layout (:func:`indexed_stages`)."""

    def blocks(s) -> tuple[int, int]:
        """(w13's block, w2's block) of this call."""
        block = block_size if block_size is not None else indexed_block_size(*s["topk_ids"].shape, config)
        return block, block if w2_block_size is None else w2_block_size

    def gemm_kwargs(s):
        return _stage_gemm_kwargs(config, s, backend)

    def by_expert(s) -> bool:
        return tiles_by_expert(*s["topk_ids"].shape, blocks(s), config, s["expert_map"] is not None)

    def in_slot_order(s) -> bool:
        return by_expert(s) or slot_blocks_apply(*s["topk_ids"].shape, config, s["expert_map"] is not None)

    def route(s):
        def align(size):
            if in_slot_order(s):
                return routing.moe_slot_blocks(s["topk_ids"], size)
            return routing.moe_align_block_size(
                s["topk_ids"],
                size,
                ignore_invalid_experts=True,
                backend=backend,
                **_expert_map_kwargs(config, s["expert_map"]),
            )

        block, w2_block = blocks(s)
        aligned = align(block)
        return dict(aligned=aligned, aligned_w2=aligned if w2_block == block else align(w2_block))

    def layout_of(s, name: str) -> L.Indexed:
        if name == "w13":
            aligned, top_k, block = s["aligned"], s["topk_ids"].shape[1], blocks(s)[0]
        else:
            aligned, top_k, block = s["aligned_w2"], 1, blocks(s)[1]
        by_k = s["topk_ids"].shape[1] if by_expert(s) else 0
        ordered = in_slot_order(s)
        return L.Indexed(
            *aligned, top_k=top_k, block_size=block, lists_dropped=True, slot_order=ordered, tile_by_expert=by_k
        )

    def multiplied_out(s, name: str):
        """:func:`multiplied_out_tiles` of this call's ``name`` GEMM."""
        rows = s["topk_ids"].shape[0] if name == "w13" else s["topk_ids"].size
        valid_m = gemm_kwargs(s)["valid_shape_m"]
        weight = getattr(s["weights"], name)
        return multiplied_out_tiles(config, name, weight, layout_of(s, name), rows, valid_m, backend)

    def quantize_input(s):
        a1q_scale = s["a1q_scale"]
        gate_up_input = process_input(
            s["hidden_states"],
            config.input_quant,
            hadamard_block_size=None if a1q_scale is not None else config.hadamard_block_size,
            input_scale=a1q_scale,
            static_scale=None if a1q_scale is not None else s["weights"].w13_input_scale,
            compute_dtype=jnp.dtype(config.compute_dtype),
            backend=backend,
            dequantize=a1q_scale is None and multiplied_out(s, "w13") is not None,
        )
        return dict(gate_up_input=gate_up_input)

    def indexed_gemm(s, name: str, x):
        tiles = multiplied_out(s, name) if not x.spec.is_quantized else None
        return gemm(x, getattr(s["weights"], name), layout_of(s, name), **gemm_kwargs(s), tuning=tiles)

    def w13(s):
        x = s["gate_up_input"]
        tiles = multiplied_out(s, "w13") if not x.spec.is_quantized else None
        kwargs = {**gemm_kwargs(s), "tuning": tiles}
        del kwargs["backend"]
        reads_quantized = multiplied_out(s, "w2") is None
        return _w13_with_activation(config, s["weights"], x, layout_of(s, "w13"), backend, reads_quantized, **kwargs)

    def activation(s):
        dequantize = multiplied_out(s, "w2") is not None
        return dict(down_input=_down_input_stage(s, config, backend, dequantize))

    def w2(s):
        return dict(down=indexed_gemm(s, "w2", s["down_input"]))

    def combine(s):
        num_tokens, top_k = s["topk_ids"].shape
        out = routing.moe_fused_mul_sum(
            s["down"].reshape(num_tokens, top_k, s["down"].shape[-1]),
            s["topk_weights"],
            s["topk_ids"],
            num_experts=config.global_num_experts,
            expert_map=s["expert_map"],
            num_valid_tokens=s.get("num_valid_tokens"),
            backend=backend,
        )
        return dict(out=out)

    return (
        Stage("routing", route),
        Stage("input", quantize_input),
        Stage("w13", w13),
        Stage("activation", activation),
        Stage("w2", w2),
        Stage("combine", combine),
    )


@functools.partial(jax.jit, static_argnames=("config", "backend", "valid_shape_m"))
def batched_humming_grouped_experts(
    hidden_states: jax.Array,
    expert_num_tokens: jax.Array,
    weights: ExpertWeights,
    config: ExpertsConfig,
    a1q_scale: jax.Array | None = None,
    backend: str | None = None,
    valid_shape_m: int | None = None,
) -> jax.Array:
    """The experts on the grouped-masked layout (vLLM's batched experts):
    each expert's rows already gathered by the caller; the weighted top-k
    reduce is left to the caller. Jitted.

    Args:
        hidden_states: ``[E, max_tokens, H]`` activations (or pre-quantized
            values with ``a1q_scale``); rows past each expert's count are never read.
        expert_num_tokens: int32 ``[E]``, the rows of each expert (clipped to ``max_tokens``).
        weights: the layer's :class:`ExpertWeights`.
        config: the layer's :class:`ExpertsConfig` (static).
        a1q_scale: the scales of pre-quantized ``hidden_states``: ``[E, max_tokens, H / group]``,
            ``[E, max_tokens, 1]`` or ``[1]`` as ``config.input_quant`` makes them (float32; e8m0 uint8).
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.
        valid_shape_m: the rows the call is expected to hold in all, for the
            GEMMs' tiling (static; vLLM passes the routing's estimate,
            :func:`estimate_valid_shape_m` of its tokens): a buffer sized for
            the worst case then still runs the tiles of its real load. None:
            every buffer row, ``E · max_tokens``.

    Returns:
        ``[E, max_tokens, H]`` in ``hidden_states``' dtype (``config.compute_dtype``
        for pre-quantized inputs); rows past each count are zero.
    """
    if valid_shape_m is not None and not is_count(valid_shape_m, 1):
        raise ValueError(
            f"batched_humming_grouped_experts: valid_shape_m must be a positive int, got {valid_shape_m!r}"
        )
    if hidden_states.ndim != 3 or hidden_states.shape[0] != config.num_experts:
        raise ValueError(
            f"batched_humming_grouped_experts: hidden_states must be [E={config.num_experts}, max_tokens, H], "
            f"got {hidden_states.shape}"
        )
    if a1q_scale is None:
        if hidden_states.shape[2] != config.hidden_size:
            raise ValueError(
                f"batched_humming_grouped_experts: hidden size {hidden_states.shape[2]} != {config.hidden_size}"
            )
        check_float_input(hidden_states, "batched_humming_grouped_experts")
    else:
        check_prequantized_input(hidden_states, a1q_scale, config, "batched_humming_grouped_experts")
    if expert_num_tokens.shape != (config.num_experts,):
        raise ValueError(
            f"batched_humming_grouped_experts: expert_num_tokens must be [E]=[{config.num_experts}], "
            f"got {expert_num_tokens.shape}"
        )
    check_weights(weights, config)
    state = dict(hidden_states=hidden_states, expert_num_tokens=expert_num_tokens, weights=weights, a1q_scale=a1q_scale)
    out = run_stages(batched_stages(config, backend, valid_shape_m), state)["out"]
    return in_input_dtype(out, hidden_states, a1q_scale)


def _reads_as_it_is(config: ExpertsConfig, dtype) -> bool:
    """Whether w13 takes the layer's input rows as they are: unquantized, not
    rotated, in the compute dtype."""
    return (
        not config.input_quant.is_quantized
        and not config.hadamard_block_size
        and jnp.dtype(dtype) == jnp.dtype(config.compute_dtype)
    )


def batched_stages(
    config: ExpertsConfig, backend: str | None = None, valid_shape_m: int | None = None
) -> tuple[Stage, ...]:
    """The batched pipeline (:func:`batched_humming_grouped_experts`) as stages
    over the state ``hidden_states [E, max_tokens, H]`` (or pre-quantized
    values with ``a1q_scale``), ``expert_num_tokens [E]``, ``weights`` and
    ``a1q_scale``; the last adds ``out [E, max_tokens, H]``. ``valid_shape_m``:
    the rows expected in all, for the tiling (None: every buffer row)."""

    def layout(s) -> L.GroupedMasked:
        return L.GroupedMasked(s["expert_num_tokens"])

    def gemm_kwargs(s) -> dict:
        num_experts, max_tokens = s["hidden_states"].shape[:2]
        rows = num_experts * max_tokens
        return _gemm_kwargs(config, rows if valid_shape_m is None else min(valid_shape_m, rows), backend)

    def multiplied_out(s, name: str):
        """:func:`multiplied_out_tiles` of this call's ``name`` GEMM."""
        num_experts, max_tokens = s["hidden_states"].shape[:2]
        weight = getattr(s["weights"], name)
        valid_m = gemm_kwargs(s)["valid_shape_m"]
        return multiplied_out_tiles(config, name, weight, layout(s), num_experts * max_tokens, valid_m, backend)

    def quantize_input(s):
        hidden_states, a1q_scale = s["hidden_states"], s["a1q_scale"]
        if a1q_scale is not None:
            x = process_input(hidden_states, config.input_quant, input_scale=a1q_scale, backend=backend)
            return dict(gate_up_input=x)
        num_experts, max_tokens, width = hidden_states.shape
        rows = hidden_states.reshape(num_experts * max_tokens, width)
        if _reads_as_it_is(config, rows.dtype):
            # w13's masked layout stores no row past a count: its input needs no pass to zero them.
            return dict(gate_up_input=Q.QuantizedInput(values=rows, spec=Q.NONE, k=width))
        x = process_input(
            rows,
            config.input_quant,
            hadamard_block_size=config.hadamard_block_size,
            layout="grouped_mask",
            expert_num_tokens=s["expert_num_tokens"],
            static_scale=s["weights"].w13_input_scale,
            compute_dtype=jnp.dtype(config.compute_dtype),
            backend=backend,
            dequantize=multiplied_out(s, "w13") is not None,
        )
        return dict(gate_up_input=x)

    def w13(s):
        x = s["gate_up_input"]
        tiles = multiplied_out(s, "w13") if not x.spec.is_quantized else None
        kwargs = {name: value for name, value in gemm_kwargs(s).items() if name != "backend"}
        reads_quantized = multiplied_out(s, "w2") is None
        return _w13_with_activation(
            config, s["weights"], x, layout(s), backend, reads_quantized, **kwargs, tuning=tiles
        )

    def activation(s):
        counts = s["expert_num_tokens"]
        dequantize = multiplied_out(s, "w2") is not None
        down_input = _down_input_stage(s, config, backend, dequantize, layout="grouped_mask", expert_num_tokens=counts)
        return dict(down_input=down_input)

    def w2(s):
        num_experts, max_tokens = s["hidden_states"].shape[:2]
        x = s["down_input"]
        tiles = multiplied_out(s, "w2") if not x.spec.is_quantized else None
        down = gemm(x, s["weights"].w2, layout(s), **gemm_kwargs(s), tuning=tiles)
        return dict(out=down.reshape(num_experts, max_tokens, config.hidden_size))

    return (
        Stage("input", quantize_input),
        Stage("w13", w13),
        Stage("activation", activation),
        Stage("w2", w2),
    )


@functools.partial(jax.jit, static_argnames=("backend",))
def moonep_grouped_gemm(
    a: jax.Array, w: jax.Array | F.QuantizedWeight, cu_seqlens: jax.Array, backend: str | None = None
) -> jax.Array:
    """MoonEP's grouped GEMM: ``out[seg_g] = a[seg_g] @ w[g].T`` for each segment.

    Args:
        a: ``[NvS, K]`` bf16/f16 rows in segment order.
        w: ``[G, N, K]``, a float array or a :class:`QuantizedWeight`.
        cu_seqlens: int32 ``[G]``, cumulative segment *end* offsets.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``[NvS, N]`` in ``a``'s dtype; rows past ``cu_seqlens[-1]`` are zero.
    """
    w = as_weight(w, "w")
    return gemm(a, w, _segments(cu_seqlens, w.num_experts, "moonep_grouped_gemm"), backend=backend)


def _segments(cu_seqlens: jax.Array, groups: int, op: str) -> L.GroupedContiguous:
    """MoonEP's segment ends ``[G]`` as the grouped-contiguous layout, checked."""
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"{op}: cu_seqlens: expected integer segment ends, got {cu_seqlens.dtype}")
    if cu_seqlens.shape != (groups,):
        raise ValueError(f"{op}: cu_seqlens must be [G]=[{groups}], got {cu_seqlens.shape}")
    return L.GroupedContiguous(jnp.concatenate([jnp.zeros(1, jnp.int32), cu_seqlens.astype(jnp.int32)]))


@functools.partial(jax.jit, static_argnames=("apply_router_weight_on_input", "backend"))
def moonep_experts(
    hidden_states: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    cu_seqlens: jax.Array,
    route_weights: jax.Array,
    apply_router_weight_on_input: bool = False,
    backend: str | None = None,
) -> jax.Array:
    """MoonEP's grouped experts: ``grouped(silu(grouped(x, gate)) ·
    grouped(x, up) · w_route, down)`` over rows in segment order (G = E expert
    rows plus B redundant prefetch rows), bf16 and SILU like the original.

    Args:
        hidden_states: ``[NvS, H]`` bf16 rows in segment order.
        w_gate: bf16 ``[G, I, H]``.
        w_up: bf16 ``[G, I, H]``.
        w_down: bf16 ``[G, H, I]``.
        cu_seqlens: int32 ``[G]``, cumulative segment end offsets.
        route_weights: float ``[NvS]``, each row's router weight.
        apply_router_weight_on_input: the caller applied the weights to the
            inputs: skip the route multiply.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.

    Returns:
        ``[NvS, H]`` bf16; rows past ``cu_seqlens[-1]`` are zero.
    """
    _check_moonep_rows(hidden_states, "moonep_experts")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16):
            raise TypeError(f"moonep_experts: {name} must be bfloat16 (MoonEP experts are BF16-only), got {w.dtype}")
    if w_gate.shape != w_up.shape or w_gate.shape[2] != hidden_states.shape[1]:
        raise ValueError(
            f"moonep_experts: w_gate and w_up must both be [G, I, H={hidden_states.shape[1]}], "
            f"got {w_gate.shape} and {w_up.shape}"
        )
    expected_down = (w_gate.shape[0], w_gate.shape[2], w_gate.shape[1])
    if w_down.shape != expected_down:
        raise ValueError(f"moonep_experts: w_down must be [G, H, I]={list(expected_down)}, got {w_down.shape}")
    weights = dict(w_gate=w_gate, w_up=w_up, w_down=w_down)
    op = "moonep_experts"
    return _run_moonep(op, hidden_states, cu_seqlens, route_weights, apply_router_weight_on_input, backend, weights)


def _check_moonep_rows(hidden_states, op: str) -> None:
    """Raise, naming ``op``, unless ``hidden_states`` are bf16 ``[NvS, H]`` (MoonEP is BF16-only)."""
    if hidden_states.ndim != 2 or jnp.dtype(hidden_states.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(
            f"{op}: hidden_states must be bf16 [NvS, H] (MoonEP experts are BF16-only), "
            f"got {hidden_states.dtype} {hidden_states.shape}"
        )


def _run_moonep(op: str, hidden_states, cu_seqlens, route_weights, on_input: bool, backend, weights: dict) -> jax.Array:
    """:func:`moonep_stages` on the rows and ``weights`` (either form's), ``route_weights`` checked."""
    if route_weights.shape != (hidden_states.shape[0],):
        raise ValueError(f"{op}: route_weights must be [NvS]=[{hidden_states.shape[0]}], got {route_weights.shape}")
    state = dict(hidden_states=hidden_states, cu_seqlens=cu_seqlens, route_weights=route_weights, **weights)
    return run_stages(moonep_stages(on_input, backend), state)["out"]


def moonep_w13(w_gate: jax.Array, w_up: jax.Array) -> F.QuantizedWeight:
    """MoonEP's gate and up weights (bf16 ``[G, I, H]`` each) as one bf16 w13
    ``[G, 2I, H]``, gate and up rows interleaved by
    :data:`formats.GATE_UP_BLOCK` where ``I`` allows (else in halves): one
    GEMM whose tiles apply the activation (:func:`moonep_interleaved_experts`)
    where MoonEP's form runs two and a pass. Made once, with the weights.

    Args:
        w_gate: bf16 ``[G, I, H]``.
        w_up: bf16 ``[G, I, H]``.

    Returns:
        a bf16 :class:`QuantizedWeight` ``[G, 2I, H]`` (its ``gate_up_block``
        says the row order: 64, or 0 for halves where ``I`` is no multiple of 64).
    """
    if w_gate.shape != w_up.shape or w_gate.ndim != 3:
        raise ValueError(f"moonep_w13: w_gate and w_up must both be [G, I, H], got {w_gate.shape} and {w_up.shape}")
    w13 = as_weight(jnp.concatenate([w_gate, w_up], axis=1).astype(jnp.bfloat16), "moonep_w13")
    if F.gate_up_block_refusal(w13.format, w13.n, F.GATE_UP_BLOCK) is None:
        w13 = F.interleave_gate_up(w13, F.GATE_UP_BLOCK)
    return w13


@functools.partial(jax.jit, static_argnames=("apply_router_weight_on_input", "backend"))
def moonep_interleaved_experts(
    hidden_states: jax.Array,
    w13: F.QuantizedWeight,
    w_down: jax.Array,
    cu_seqlens: jax.Array,
    route_weights: jax.Array,
    apply_router_weight_on_input: bool = False,
    backend: str | None = None,
) -> jax.Array:
    """:func:`moonep_experts` on its gate and up weights as one w13
    (:func:`moonep_w13`): one grouped GEMM whose tiles apply SILU (where the
    planned tiling takes it, else the pass), the route weights, w_down.

    Args:
        w13: :func:`moonep_w13`'s bf16 ``[G, 2I, H]``, in place of ``w_gate``
            and ``w_up``; the other arguments (``hidden_states [NvS, H]``,
            ``w_down [G, H, I]``, ``cu_seqlens [G]``, ``route_weights [NvS]``, …)
            as :func:`moonep_experts`'s.

    Returns:
        ``[NvS, H]`` bf16; rows past ``cu_seqlens[-1]`` are zero.
    """
    if not isinstance(w13, F.QuantizedWeight) or w13.format != F.BF16:
        raise TypeError("moonep_interleaved_experts: w13: expected moonep_w13's bf16 QuantizedWeight")
    _check_moonep_rows(hidden_states, "moonep_interleaved_experts")
    g, n, h = w13.shape
    if h != hidden_states.shape[1] or n % 2:
        raise ValueError(
            f"moonep_interleaved_experts: w13 must be [G, 2I, H={hidden_states.shape[1]}], got {w13.shape}"
        )
    if jnp.dtype(w_down.dtype) != jnp.dtype(jnp.bfloat16) or w_down.shape != (g, h, n // 2):
        raise ValueError(
            f"moonep_interleaved_experts: w_down must be bf16 [G, H, I]={[g, h, n // 2]}, got {w_down.dtype} "
            f"{w_down.shape}"
        )
    weights = dict(w13=w13, w_down=w_down)
    op = "moonep_interleaved_experts"
    return _run_moonep(op, hidden_states, cu_seqlens, route_weights, apply_router_weight_on_input, backend, weights)


def moonep_stages(apply_router_weight_on_input: bool = False, backend: str | None = None) -> tuple[Stage, ...]:
    """MoonEP's experts (:func:`moonep_experts`) as stages over the state
    ``hidden_states [NvS, H]``, ``w_gate`` and ``w_up`` (or one ``w13``:
    :func:`moonep_interleaved_experts`), ``w_down``, ``cu_seqlens [G]`` and
    ``route_weights [NvS]``: w13 (MoonEP's gate and up GEMMs, or the one
    GEMM with the activation in its tiles where they take it), the
    activation (and route weights), w2; the last adds ``out [NvS, H]``."""

    def grouped(s, x, name: str) -> jax.Array:
        return moonep_grouped_gemm(x, s[name], s["cu_seqlens"], backend=backend)

    def silu(s) -> ActivationSpec:  # SILU on the one w13's rows in their order
        return ActivationSpec("silu", gate_up_block=s["w13"].gate_up_block)

    def w13(s):
        x = s["hidden_states"]
        if "w13" not in s:
            return dict(gate=grouped(s, x, "w_gate"), up=grouped(s, x, "w_up"))
        weight, act = s["w13"], silu(s)
        layout = _segments(s["cu_seqlens"], weight.num_experts, "moonep_interleaved_experts")
        if takes_activation(as_quantized_input(x), weight, layout, act, backend=backend):
            return dict(activated=gemm(x, weight, layout, activation=act, backend=backend))
        return dict(gate_up=gemm(x, weight, layout, backend=backend))

    def activation(s):
        if "activated" in s:
            act = s["activated"].astype(jnp.float32)
        elif "gate_up" in s:
            act = apply_activation(s["gate_up"], silu(s))
        else:
            act = jax.nn.silu(s["gate"].astype(jnp.float32)) * s["up"].astype(jnp.float32)
        if not apply_router_weight_on_input:
            act = act * s["route_weights"].astype(jnp.float32)[:, None]
        return dict(down_input=act.astype(s["hidden_states"].dtype))

    def w2(s):
        return dict(out=grouped(s, s["down_input"], "w_down"))

    return (Stage("w13", w13), Stage("activation", activation), Stage("w2", w2))
