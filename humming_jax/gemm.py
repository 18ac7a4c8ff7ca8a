"""The expert GEMM over the four layouts (DESIGN §3.6): validation, backend
choice and the pure-``jnp`` reference that defines what the kernels compute.

``out[r] = dequant(x)[r_in] @ dequant(w[e]).T + bias[e]`` for every live row
of the layout, accumulated in float32; rows no group owns are zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from humming_jax import configs
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax import layouts as L
from humming_jax import tuning as T
from humming_jax.backend import hopper_gpu as _hopper_gpu
from humming_jax.backend import resolve_backend
from pallas_kernels import gemm as kernel
from pallas_kernels import gemm_mosaic as mosaic_kernel

_FLOAT_INPUTS = (jnp.bfloat16, jnp.float16, jnp.float32)


def as_quantized_input(x: jax.Array | Q.QuantizedInput) -> Q.QuantizedInput:
    """Wrap a plain float ``[M, K]`` array as an unquantized input."""
    if isinstance(x, Q.QuantizedInput):
        return x
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _FLOAT_INPUTS]:
        raise TypeError(f"x: an unquantized input must be bfloat16, float16 or float32, got {x.dtype}")
    return Q.QuantizedInput(values=x, spec=Q.NONE, k=x.shape[1])


def as_weight(w: jax.Array | F.QuantizedWeight, argument: str = "weight") -> F.QuantizedWeight:
    """Wrap a plain ``[E, N, K]`` bf16/f16 array as an unquantized weight."""
    if isinstance(w, F.QuantizedWeight):
        return w
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"{argument}: expected [E, N, K], got shape {w.shape}")
    fmt = {jnp.dtype(jnp.bfloat16): F.BF16, jnp.dtype(jnp.float16): F.F16}.get(jnp.dtype(w.dtype))
    if fmt is None:
        raise TypeError(f"{argument}: a plain weight array must be bfloat16 or float16, got {w.dtype}")
    return F.QuantizedWeight(values=w, format=fmt, shape=tuple(w.shape))


def _validate(x: Q.QuantizedInput, weight: F.QuantizedWeight, layout, use_f16_accum: bool, out_dtype) -> None:
    weight.validate("weight")
    if x.k != weight.k:
        raise ValueError(f"x: K={x.k} does not match the weight's K={weight.k}")
    spec = x.spec
    configs.check_supported(weight.format, spec, "x.spec")
    if spec.is_quantized:
        spec.check_k(x.k, "x")
        expected_cols = x.k // spec.packs_k
        if x.values.ndim != 2 or x.values.shape[1] != expected_cols:
            raise ValueError(f"x.values: expected [M, {expected_cols}] for {spec.name}, got {x.values.shape}")
        if jnp.dtype(x.values.dtype) != jnp.dtype(spec.dtype.storage_dtype):
            raise TypeError(
                f"x.values: expected {jnp.dtype(spec.dtype.storage_dtype).name} for {spec.name}, got {x.values.dtype}"
            )
        for part, shape in (("scale", spec.scale_shape(x.m, x.k)), ("scale_2", spec.scale_2_shape(x.m))):
            array = getattr(x, part)
            if shape is None and array is not None:
                raise ValueError(f"x.{part}: {spec.name} has no {part}")
            if shape is not None and (array is None or tuple(array.shape) != tuple(shape)):
                got = None if array is None else tuple(array.shape)
                raise ValueError(f"x.{part}: expected shape {shape} for {spec.name}, got {got}")
    if not isinstance(layout, (L.GroupedContiguous, L.GroupedMasked, L.Indexed, L.Dense)):
        raise TypeError(
            f"layout: expected GroupedContiguous, GroupedMasked, Indexed or Dense, got {type(layout).__name__}"
        )
    layout.validate(x.m, weight.num_experts)
    if use_f16_accum and jnp.dtype(out_dtype) != jnp.dtype(jnp.float16):
        raise ValueError("use_f16_accum: f16 accumulation is only for float16 compute (out_dtype float16)")


def _per_expert_products(x32: jax.Array, w32: jax.Array, row_expert: jax.Array) -> jax.Array:
    """``y[r] = x32[r] @ w32[row_expert[r]].T``, one expert at a time (memory M*N)."""

    def one_expert(acc, expert_and_weight):
        expert, w_e = expert_and_weight
        y = jnp.dot(x32, w_e.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return jnp.where((row_expert == expert)[:, None], y, acc), None

    init = jnp.zeros((x32.shape[0], w32.shape[1]), jnp.float32)
    experts = jnp.arange(w32.shape[0], dtype=jnp.int32)
    out, _ = jax.lax.scan(one_expert, init, (experts, w32))
    return out


def gemm_reference(x: Q.QuantizedInput, weight: F.QuantizedWeight, layout: L.Layout, out_dtype) -> jax.Array:
    """The semantics of :func:`gemm` in float32 ``jnp`` (no validation)."""
    x32 = Q.dequantize_input(x)
    w32 = F.dequantize_weight(weight)
    bias = None if weight.bias is None else weight.bias.astype(jnp.float32)
    if isinstance(layout, L.Indexed):
        rows_in, rows_out, expert, live = L.indexed_entries(layout, x.m, weight.num_experts)
        y = _per_expert_products(x32[rows_in], w32, expert)
        if bias is not None:
            y = y + bias[expert]
        m_out = layout.output_rows(x.m)
        out = jnp.zeros((m_out, weight.n), jnp.float32).at[rows_out].set(y, mode="drop")
        return out.astype(out_dtype)
    expert, valid = L.row_experts(layout, x.m)
    y = _per_expert_products(x32, w32, expert)
    if bias is not None:
        y = y + bias[expert]
    return jnp.where(valid[:, None], y, 0.0).astype(out_dtype)


@functools.partial(
    jax.jit, static_argnames=("out_dtype", "use_f16_accum", "batch_invariant", "valid_shape_m", "tuning", "backend")
)
def gemm(
    x: jax.Array | Q.QuantizedInput,
    weight: F.QuantizedWeight | jax.Array,
    layout: L.Layout,
    *,
    out_dtype=None,
    use_f16_accum: bool = False,
    batch_invariant: bool = False,
    valid_shape_m: int | None = None,
    tuning: configs.TuningConfig | None = None,
    backend: str | None = None,
) -> jax.Array:
    """Expert GEMM: ``x [M, K]`` (float, or a :class:`QuantizedInput`) times
    ``weight [E, N, K]`` in any :class:`WeightFormat`, over ``layout``.

    Returns ``[M_out, N]`` in ``out_dtype`` (default: ``x``'s dtype when it is
    unquantized, else bfloat16). ``valid_shape_m`` (an estimate of the real
    rows) picks the tuning entry; ``tuning`` overrides it. ``batch_invariant``
    forbids split-K so that a row's result never depends on other rows.
    The tiling is :func:`kernel_tuning`'s (see there for folded scales).
    """
    x = as_quantized_input(x)
    weight = as_weight(weight)
    if out_dtype is None:
        out_dtype = x.values.dtype if not x.spec.is_quantized else jnp.bfloat16
    out_dtype = jnp.dtype(out_dtype)
    _validate(x, weight, layout, use_f16_accum, out_dtype)
    compute = configs.ComputeConfig(layout.kind, use_f16_accum, batch_invariant)
    if tuning is not None:
        tuning.check_compute(compute)
    chosen = resolve_backend(backend, "gemm")
    unsupported = _kernel_unsupported(x, layout)
    if chosen != "reference" and unsupported:
        if backend is not None:
            raise ValueError(f"gemm: backend {backend!r}: the kernel does not take {unsupported} yet")
        chosen = "reference"
    if chosen == "reference":
        return gemm_reference(x, weight, layout, out_dtype)
    on_gpu = chosen != "interpret"
    tuning, dequantize = plan_tuning(
        x, weight, layout, tuning, valid_shape_m, batch_invariant, use_f16_accum, out_dtype, on_gpu
    )
    if dequantize:
        weight = _dequantized(weight, x.values.dtype)
    return _gemm_kernel(x, weight, layout, tuning, out_dtype, use_f16_accum, interpret=not on_gpu)


# Rows an expert needs before a dequantize pass over every expert's weight pays
# for the 16-bit Mosaic product (H200: mixtral int4 at 1024 rows an expert
# 4255 us through the pass against the Triton tile's 4396; qwen3 MXFP4 at 256
# rows 2527 against 769).
DEQUANTIZE_MIN_ROWS = 512


def plan_tuning(
    x: Q.QuantizedInput,
    weight: F.QuantizedWeight,
    layout: L.Layout,
    tuning: configs.TuningConfig | None = None,
    valid_shape_m: int | None = None,
    batch_invariant: bool = False,
    use_f16_accum: bool = False,
    out_dtype=jnp.bfloat16,
    on_gpu: bool = True,
) -> tuple[configs.TuningConfig, bool]:
    """(the tiling the kernel runs, whether the weight is dequantized first).

    ``tuning`` None: the table's entry (:func:`kernel_tuning`), which is a
    preference — an entry naming the Mosaic kernel runs a form of it that the
    call allows: dequantize_first for quantized weights it does not decode
    itself when the experts have rows enough to pay for the pass
    (:data:`DEQUANTIZE_MIN_ROWS`; else, and at decode-sized row tiles, the
    heuristic's Triton tile — the pass reads every expert's weight), the
    staged form for a ``swap_ab`` entry it cannot run (interpreted, or 32-bit
    outputs), and when the kernel cannot take the call at all the Triton tile
    of the same size (4-bit weights: the heuristic's decode tile). A
    ``tuning`` passed by hand runs as given."""
    from_table = tuning is None
    tuning = kernel_tuning(layout, weight, x.m, valid_shape_m, tuning, batch_invariant)
    rows = valid_shape_m or layout.output_rows(x.m)
    per_expert = max(1, rows if layout.kind == configs.GemmLayout.DENSE else rows // max(weight.num_experts, 1))

    def heuristic() -> tuple[configs.TuningConfig, bool]:
        """The heuristic's Triton tile (the decode options of the weight's format class)."""
        fallback = T.heuristic_tuning(per_expert, weight.n, weight.k, T.format_class(weight.format))
        return kernel_tuning(layout, weight, x.m, valid_shape_m, fallback, batch_invariant), False

    if from_table and tuning.mosaic and weight.format.is_quantized and _nibble_decode_unsupported(x, weight):
        if not (tuning.dequantize_first or (tuning.block_m >= 64 and per_expert >= DEQUANTIZE_MIN_ROWS)):
            return heuristic()  # a dequantize pass over every expert would cost more than it saves
        tuning = dataclasses.replace(tuning, dequantize_first=True)  # its 16-bit path, after one dequantize pass
    dequantize = tuning.dequantize_first and weight.format.is_quantized
    if dequantize:
        tuning = dataclasses.replace(
            tuning,
            dequantize_first=False,
            word_decode=False,
            fold_scales=False,
            pair_decode=False,
            swap_ab=tuning.swap_ab and not tuning.mosaic,  # the Mosaic swap_ab form is for decoded 4-bit weights
        )
        if from_table and tuning.mosaic:  # an entry for 4-bit decode (one 128-column unit a step): the 16-bit K step
            tuning = dataclasses.replace(tuning, block_k=min(tuning.block_k, 64))
    if not from_table or not tuning.mosaic:
        return tuning, dequantize
    if tuning.swap_ab and mosaic_kernel.swap_ab_refusal(out_dtype, interpret=not on_gpu):
        # The staged form computes the same (its pieces are rewritten each step: no delayed release).
        tuning = dataclasses.replace(tuning, swap_ab=False, delay_release=0)
    fits = _mosaic_fits(x, weight, layout, tuning, use_f16_accum, on_gpu, quantized=not dequantize)
    if not fits and tuning.cluster_n > 1:
        single = dataclasses.replace(tuning, cluster_n=1)  # e.g. an odd number of column tiles: no pairs
        if _mosaic_fits(x, weight, layout, single, use_f16_accum, on_gpu, quantized=not dequantize):
            tuning, fits = single, True
    if not fits:
        # The table names the Mosaic kernel, but this call has what it cannot take
        # (a GPU other than Hopper, a shape off its tiles, f16 accumulation): 4-bit weights
        # it would have decoded take the heuristic's Triton tile (with the format's decode
        # options); 16-bit ones the Triton tile of the same size, with the warps and stages
        # that tile won with (8 and 4, 128x256x64 bf16) and none of the Mosaic-only options.
        if weight.format.is_quantized and not dequantize:
            return heuristic()
        tuning = dataclasses.replace(tuning.without_mosaic(), num_warps=8, num_stages=4, word_decode=False)
    return tuning, dequantize


def _dequantized(weight: F.QuantizedWeight, dtype) -> F.QuantizedWeight:
    """``weight`` as an unquantized ``[E, N, K]`` weight in ``dtype`` (bf16 or
    f16), its bias kept: each element rounded once, as folded scales do."""
    fmt = F.BF16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else F.F16
    fmt = fmt.with_bias() if weight.bias is not None else fmt
    return F.QuantizedWeight(
        values=F.dequantize_weight(weight, dtype), bias=weight.bias, format=fmt, shape=weight.shape
    )


def kernel_tuning(
    layout: L.Layout,
    weight: F.QuantizedWeight,
    rows: int,
    valid_shape_m: int | None = None,
    tuning: configs.TuningConfig | None = None,
    batch_invariant: bool = False,
) -> configs.TuningConfig:
    """The tiling the kernel runs for ``rows`` input rows: ``tuning``, else the
    table's entry (or the heuristic) for ``valid_shape_m`` (default: the
    layout's output rows), adapted to the layout.

    With ``fold_scales`` (the H200 decode entries) integer formats round
    ``(q - z) * s`` once to the compute dtype before the product, as Humming's
    and Marlin's kernels do; the other formats stay exact."""
    if tuning is None:
        estimate = valid_shape_m or layout.output_rows(rows)
        tuning = T.choose_tuning(layout.kind, weight.format, estimate, weight.num_experts, weight.n, weight.k)
    if isinstance(layout, L.Indexed):  # a tile is one alignment block; blocks under 16 rows skip the MMAs
        small = layout.block_size < 16
        tuning = dataclasses.replace(
            tuning,
            block_m=layout.block_size,
            use_mma=tuning.use_mma and not small,
            swap_ab=tuning.swap_ab and not small,
            # Multiply-add tiles widen the weights to f32 at once: scales after
            # the product (exact), not folded into a rounded bf16 weight.
            fold_scales=tuning.fold_scales and not small,
            pair_decode=tuning.pair_decode and not small,
        )
    # The Triton decoder reads the half-bits order as nibble pairs only (the Mosaic
    # kernel takes such weights through dequantize_first).
    if weight.half_bits and not (tuning.dequantize_first or tuning.mosaic):
        block_k = max(128, tuning.block_k // 128 * 128)
        tuning = dataclasses.replace(tuning, block_k=block_k, word_decode=True, pair_decode=True, fold_scales=True)
    if batch_invariant:
        tuning = dataclasses.replace(tuning, split_k=1)
    return tuning


def _kernel_unsupported(x: Q.QuantizedInput, layout) -> str | None:
    """Why the kernel cannot run this call (None if it can)."""
    if x.spec.is_quantized:
        return f"quantized inputs ({x.spec.name})"
    if jnp.dtype(x.values.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"{x.values.dtype} inputs (bfloat16 or float16)"
    if isinstance(layout, L.Indexed) and layout.block_size & (layout.block_size - 1):
        return f"an indexed block_size of {layout.block_size} (a power of two)"
    return None


def _weight_spec(weight: F.QuantizedWeight) -> kernel.WeightSpec:
    fmt = weight.format
    return kernel.WeightSpec(
        num_experts=weight.num_experts,
        n=weight.n,
        k=weight.k,
        value_type=fmt.value_type.value,
        scale=fmt.scale_granularity.value,
        scale_type=None if fmt.scale_type is None else fmt.scale_type.value,
        group_size=fmt.group_size,
        block_n=fmt.block_n,
        zero_point=fmt.zero_point.value,
        global_scale=fmt.global_scale.value,
        has_bias=fmt.has_bias,
        has_group_index=weight.group_index is not None,
        nibble_unit=weight.nibble_unit,
        half_bits=weight.half_bits,
    )


def _layout_spec(layout, m_in: int) -> tuple[kernel.LayoutSpec, tuple[jax.Array, ...]]:
    kind = layout.kind.value
    if isinstance(layout, L.Dense):
        return kernel.LayoutSpec(kind, m_in, m_in), ()
    if isinstance(layout, L.GroupedContiguous):
        return kernel.LayoutSpec(kind, m_in, m_in), (layout.expert_offsets.astype(jnp.int32),)
    if isinstance(layout, L.GroupedMasked):
        counts = layout.expert_num_tokens.astype(jnp.int32)
        return kernel.LayoutSpec(kind, m_in, m_in, max_tokens=m_in // counts.shape[0]), (counts,)
    spec = kernel.LayoutSpec(
        kind,
        m_in,
        m_in * layout.top_k,
        top_k=layout.top_k,
        num_blocks=layout.expert_ids.shape[0],
        lists_dropped=layout.lists_dropped,
    )
    arrays = (
        layout.sorted_ids.astype(jnp.int32),
        layout.expert_ids.astype(jnp.int32),
        layout.num_tokens_padded.reshape(-1)[:1].astype(jnp.int32),
    )
    return spec, arrays


def _nibble_decode_unsupported(x, weight) -> str | None:
    """Why the Mosaic kernel cannot decode this quantized weight itself (None if it can)."""
    fmt = weight.format
    if fmt.value_type not in (F.ValueType.INT4, F.ValueType.UINT4) or fmt.zero_point == F.ZeroPoint.FLOAT:
        return f"{fmt.name} weights (int4, or uint4 with integer zero points; others through dequantize_first)"
    granularity = fmt.scale_granularity
    if not (
        granularity == F.ScaleGranularity.CHANNEL
        or (granularity == F.ScaleGranularity.GROUP and fmt.group_size == mosaic_kernel.UNIT)
    ):
        return f"{fmt.name} weights ({mosaic_kernel.UNIT}-column groups or per-channel scales)"
    if weight.nibble_unit != mosaic_kernel.UNIT or weight.half_bits:
        return f"{fmt.name} weights in K order (the planar order of {mosaic_kernel.UNIT}-column units: to_planar)"
    if jnp.dtype(fmt.scale_dtype) != jnp.dtype(x.values.dtype):
        return f"{fmt.scale_dtype.__name__} scales with {x.values.dtype} inputs (scales in the input dtype)"
    if weight.group_index is not None:
        return "a group index (act order)"
    return None


def _mosaic_unsupported(x, weight, layout, use_f16_accum, on_gpu: bool) -> str | None:
    """Why the Mosaic GPU kernel cannot run this call (None if it can)."""
    if weight.format.is_quantized:
        unsupported = _nibble_decode_unsupported(x, weight)
        if unsupported:
            return unsupported
    elif jnp.dtype(weight.values.dtype) != jnp.dtype(x.values.dtype):
        return f"{weight.values.dtype} weights with {x.values.dtype} inputs (the same 16-bit dtype)"
    return _mosaic_layout_unsupported(layout, use_f16_accum, on_gpu)


def _mosaic_layout_unsupported(layout, use_f16_accum, on_gpu: bool) -> str | None:
    """Why the Mosaic GPU kernel cannot run on this device, layout or accumulation (None if it can)."""
    if on_gpu and not _hopper_gpu():
        device = jax.devices()[0]
        return f"this device ({device.device_kind}: the kernel needs a Hopper GPU, sm_90)"
    if isinstance(layout, L.Indexed):
        return "the indexed layout (dense, grouped_contiguous or grouped_masked: TMA cannot gather rows)"
    if use_f16_accum:
        return "f16 accumulation"
    return None


def _nibble_operands(weight: F.QuantizedWeight, dtype):
    """A planar 4-bit weight as the Mosaic kernel reads it: codes ``uint16
    [E, N, K/4]`` (each 16-bit half of the planar order), scales ``[E, G, N]``
    in ``dtype`` with G = K/128 (per-channel ones repeated), and for uint4 the
    code offsets ``magic + zero`` ``[E, G, N]``; and the kernel's decode spec."""
    e, n, k = weight.shape
    groups = k // mosaic_kernel.UNIT
    codes = jax.lax.bitcast_convert_type(weight.values.reshape(e, n, k // 4, 2), jnp.uint16)
    scales = jnp.broadcast_to(jnp.swapaxes(weight.scale, 1, 2), (e, groups, n)).astype(dtype)
    zero_points = None
    if weight.format.zero_point == F.ZeroPoint.INT:
        magic_value = mosaic_kernel.MAGIC[jnp.dtype(dtype).name][1]
        zero_points = (jnp.swapaxes(F.decode_zero_point(weight), 1, 2) + magic_value).astype(dtype)
    code_offset = 8 if weight.format.value_type == F.ValueType.INT4 else 0
    decode = mosaic_kernel.NibbleDecode(groups, code_offset=code_offset, zero_points=zero_points is not None)
    return codes, scales, zero_points, decode


def _mosaic_fits(x, weight, layout, tuning, use_f16_accum, on_gpu: bool, quantized: bool = True) -> bool:
    """Whether the Mosaic GPU kernel takes this call with ``tuning``'s tiles
    (``quantized`` False: ``weight`` after the dequantize pass)."""
    if quantized and _mosaic_unsupported(x, weight, layout, use_f16_accum, on_gpu):
        return False
    if not quantized and _mosaic_layout_unsupported(layout, use_f16_accum, on_gpu):
        return False
    decode = (
        mosaic_kernel.NibbleDecode(weight.k // mosaic_kernel.UNIT) if quantized and weight.format.is_quantized else None
    )
    try:
        mosaic_kernel.check_tiles(mosaic_tiles(tuning), weight.n, weight.k, x.values.dtype, decode)
    except ValueError:
        return False
    return True


def mosaic_tiles(tuning: configs.TuningConfig) -> mosaic_kernel.MosaicTiles:
    """The Mosaic GPU kernel's tiles for a ``TuningConfig`` with ``mosaic=True``."""
    return mosaic_kernel.MosaicTiles(
        tuning.block_m,
        tuning.block_n,
        tuning.block_k,
        stages=tuning.num_stages,
        group_m=tuning.group_m,
        stage_slots=tuning.stage_slots,
        split_rows=tuning.split_rows,
        swap_ab=tuning.swap_ab,
        delay_release=tuning.delay_release,
        word_decode=tuning.word_decode,
        epilogue_slots=tuning.epilogue_slots,
        cluster_n=tuning.cluster_n,
        cluster_m=tuning.cluster_m,
    )


def _gemm_mosaic(x, weight, layout, tuning, out_dtype, use_f16_accum, interpret):
    unsupported = _mosaic_unsupported(x, weight, layout, use_f16_accum, on_gpu=not interpret)
    if unsupported:
        raise ValueError(f"gemm: tuning.mosaic: the Mosaic GPU kernel does not take {unsupported}")
    offsets = layout.expert_offsets if isinstance(layout, L.GroupedContiguous) else None
    counts = layout.expert_num_tokens if isinstance(layout, L.GroupedMasked) else None
    run = functools.partial(
        mosaic_kernel.expert_gemm_mosaic,
        tiles=mosaic_tiles(tuning),
        out_dtype=out_dtype,
        counts=counts,
        bias=weight.bias,
        interpret=interpret,
    )
    if not weight.format.is_quantized:
        return run(x.values, weight.values, offsets)
    codes, scales, zero_points, decode = _nibble_operands(weight, x.values.dtype)
    return run(x.values, codes, offsets, decode=decode, scales=scales, zero_points=zero_points)


def _gemm_kernel(x, weight, layout, tuning, out_dtype, use_f16_accum, interpret):
    if tuning.mosaic:
        return _gemm_mosaic(x, weight, layout, tuning, out_dtype, use_f16_accum, interpret)
    layout_spec, route = _layout_spec(layout, x.m)
    parts = tuple(
        a
        for a in (weight.values, weight.scale, weight.zero_point, weight.second_scale, weight.group_index)
        if a is not None
    )
    fields = dataclasses.asdict(tuning)
    for name in ("dequantize_first", "mosaic", *configs.MOSAIC_OPTIONS):  # handled here, or Mosaic-only options
        del fields[name]
    tiles = kernel.Tiles(**fields)  # the kernel's mirror of TuningConfig, field for field
    return kernel.expert_gemm(
        x.values,
        parts,
        weight.bias,
        route,
        _weight_spec(weight),
        layout_spec,
        tiles,
        out_dtype=out_dtype,
        use_f16_accum=use_f16_accum,
        interpret=interpret,
    )
