"""The expert GEMM over the four layouts: validation, the choice of kernel and
tiling, and the pure-``jnp`` reference that defines what the kernels compute.

``out[r] = dequant(x)[r_in] @ dequant(w[e]).T + bias[e]`` for every live row
of the layout, accumulated in float32 (then ``act(out[r])`` with an
``activation``, gate and up in the weight's row order); rows no group own are zero. The op
lists candidate tilings (the caller's, else the tuning table's entries, then
the heuristic's) and runs the first whose kernel ``supports`` the call
(kernels: ``pallas_kernels/gemm/``; notes: ``benchmarks/notes/gemm.md``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from humming_jax import configs, tiles_text
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax import layouts as L
from humming_jax import tuning as T
from humming_jax.activations import ActivationSpec, apply_activation, get_activation
from humming_jax.backend import no_kernel, reference_gradient, resolve_backend
from pallas_kernels import gemm as kernels
from pallas_kernels.gemm import mosaic, spec, triton

FLOAT_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))  # unquantized inputs


def as_quantized_input(x: jax.Array | Q.QuantizedInput) -> Q.QuantizedInput:
    """Wrap a plain float ``[M, K]`` array as an unquantized input."""
    if isinstance(x, Q.QuantizedInput):
        return x
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in FLOAT_INPUTS:
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
    quant = x.spec
    configs.check_supported(weight.format, quant, "x.spec")
    if quant.is_quantized:
        quant.check_k(x.k, "x")
        expected_cols = x.k // quant.packs_k
        if x.values.ndim != 2 or x.values.shape[1] != expected_cols:
            raise ValueError(f"x.values: expected [M, {expected_cols}] for {quant.name}, got {x.values.shape}")
        if jnp.dtype(x.values.dtype) != jnp.dtype(quant.dtype.storage_dtype):
            raise TypeError(
                f"x.values: expected {jnp.dtype(quant.dtype.storage_dtype).name} for {quant.name}, got {x.values.dtype}"
            )
        for part, shape in (("scale", quant.scale_shape(x.m, x.k)), ("scale_2", quant.scale_2_shape(x.m))):
            array = getattr(x, part)
            if shape is None and array is not None:
                raise ValueError(f"x.{part}: {quant.name} has no {part}")
            if shape is not None and (array is None or tuple(array.shape) != tuple(shape)):
                got = None if array is None else tuple(array.shape)
                raise ValueError(f"x.{part}: expected shape {shape} for {quant.name}, got {got}")
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


def gemm_reference(
    x: Q.QuantizedInput,
    weight: F.QuantizedWeight,
    layout: L.Layout,
    out_dtype,
    activation: ActivationSpec | None = None,
    out_quant: Q.InputQuantSpec | None = None,
    out_dequantized: bool = False,
) -> jax.Array | Q.QuantizedInput:
    """The semantics of :func:`gemm` in float32 ``jnp`` (no validation)."""
    if out_quant is not None:
        quantized = Q.quantize_input(gemm_reference(x, weight, layout, jnp.float32, activation), out_quant)
        return Q.dequantize_input(quantized).astype(out_dtype) if out_dequantized else quantized
    if activation is not None:  # on the f32 sums, rounded once (as a tile's epilogue does)
        return apply_activation(gemm_reference(x, weight, layout, jnp.float32), activation).astype(out_dtype)
    x32 = Q.dequantize_input(x)
    w32 = F.dequantize_weight(weight, stored_rows=True)
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


GemmTiles = triton.Tiles | mosaic.Tiles


_GEMM_STATIC = (
    "out_dtype",
    "use_f16_accum",
    "batch_invariant",
    "valid_shape_m",
    "tuning",
    "backend",
    "activation",
    "out_quant",
    "out_dequantized",
)


@functools.partial(jax.jit, static_argnames=_GEMM_STATIC)
@reference_gradient(_GEMM_STATIC)
def gemm(
    x: jax.Array | Q.QuantizedInput,
    weight: F.QuantizedWeight | jax.Array,
    layout: L.Layout,
    *,
    out_dtype=None,
    use_f16_accum: bool = False,
    batch_invariant: bool = False,
    valid_shape_m: int | None = None,
    tuning: GemmTiles | None = None,
    backend: str | None = None,
    activation: ActivationSpec | str | None = None,
    out_quant: Q.InputQuantSpec | str | None = None,
    out_dequantized: bool = False,
) -> jax.Array | Q.QuantizedInput:
    """The expert GEMM (Humming's grouped / indexed GEMM): ``x`` times each
    row's expert weight over ``layout``. :func:`plan` says what a call runs.

    Args:
        x: ``[M, K]`` bf16/f16, or a :class:`QuantizedInput`.
        weight: ``[E, N, K]``, a :class:`QuantizedWeight` in any format or a float array.
        layout: a :class:`GroupedContiguous`, :class:`GroupedMasked`,
            :class:`Indexed` or :class:`Dense`.
        out_dtype: default ``x``'s dtype when unquantized, else bfloat16.
        use_f16_accum: accumulate in f16 (f16 inputs).
        batch_invariant: one tiling whatever the batch (a decode tile) and no
            split-K, so a row's result is bitwise the same alone or in any batch.
        valid_shape_m: an estimate of the real rows, to pick the tuning entry.
        tuning: a ``triton``, ``mosaic``, ``mosaic_mid`` or ``mosaic_fp8`` ``Tiles`` (``pallas_kernels.gemm``):
            runs as given or raises with the kernel's reason; None: the table's
            entry, else the heuristic.
        backend: ``"pallas"``, ``"interpret"`` or ``"reference"``; None: the default.
        activation: applied to the f32 sums before they are stored (a gated
            kind reads gate and up in the order its ``gate_up_block`` says,
            which must be the weight's ``gate_up_block``) — what
            :func:`takes_activation` says a kernel can do; None: none.
        out_quant: the activated rows quantized as the next GEMM's input
            (``fp8_dynamic_group128``, W8A8's w2 input; with a gated
            ``activation``) — where :func:`takes_activation` says so; None: none.
        out_dequantized: with ``out_quant``, those quantized rows multiplied
            back by their scales, in ``out_dtype`` (the next GEMM's input
            multiplied out, as ``process_input(dequantize=True)`` gives it).

    Returns:
        ``[M_out, N]`` in ``out_dtype`` (``M_out = M·top_k`` for :class:`Indexed`;
        ``N/2`` columns with a gated ``activation``); rows no expert owns are zero.
        With ``out_quant``: a :class:`QuantizedInput` of those rows (with
        ``out_dequantized``: ``[M_out, N/2]`` in ``out_dtype``).

    Raises:
        NoKernelError: on a GPU, when no kernel takes the call (naming why).
    """
    x = as_quantized_input(x)
    weight = as_weight(weight)
    out_dtype = _out_dtype(x, out_dtype)
    if out_dtype not in FLOAT_INPUTS:  # the kernels store 16- or 32-bit floats
        names = ", ".join(d.name for d in FLOAT_INPUTS)
        raise TypeError(f"gemm: out_dtype: expected one of {names}, got {out_dtype.name}")
    if valid_shape_m is not None and not configs.is_count(valid_shape_m):
        raise ValueError(
            f"gemm: valid_shape_m: expected a row count (a non-negative int) or None, got {valid_shape_m!r}"
        )
    _validate(x, weight, layout, use_f16_accum, out_dtype)
    activation = get_activation(activation)
    _check_activation(activation, weight)
    out_quant = _check_out_quant(out_quant, activation, weight)
    if out_dequantized and out_quant is None:
        raise ValueError("gemm: out_dequantized: the rows out_quant quantizes (out_quant is None)")
    out_dequantized = bool(out_dequantized)
    if tuning is not None and not isinstance(tuning, tuple(kernels.KERNELS)):
        names = ", ".join(f"{name}.Tiles" for name in kernels.IMPLS)
        raise TypeError(f"gemm: tuning: expected one of {names} (pallas_kernels.gemm), got {type(tuning).__name__}")
    if batch_invariant and tuning is not None and getattr(tuning, "split_k", 1) > 1:
        raise ValueError(f"tuning.split_k: batch_invariant needs a fixed K order (split_k=1), got {tuning.split_k}")
    planned = _kernel_plan(
        x,
        weight,
        layout,
        out_dtype,
        use_f16_accum,
        batch_invariant,
        valid_shape_m,
        tuning,
        backend,
        activation,
        out_quant,
        out_dequantized,
    )
    reference = (x, weight, layout, out_dtype, activation, out_quant, out_dequantized)
    if planned is None:  # the reference backend, or an empty batch (T=0): nothing to compute, an empty output
        return gemm_reference(*reference)
    tiles, reasons, interpret = planned
    if tiles is None:
        if tuning is not None:
            raise ValueError(f"gemm: tuning: the kernel does not take this call with {reasons[0]}")
        no_kernel("gemm", "; ".join(reasons), backend)
        return gemm_reference(*reference)
    out = _run_kernel(
        x, weight, layout, tiles, out_dtype, use_f16_accum, interpret, activation, out_quant, out_dequantized
    )
    if out_quant is None or out_dequantized:
        return out
    values, scale = out
    return Q.QuantizedInput(values=values, scale=scale, spec=out_quant, k=values.shape[1])


def _kernel_plan(
    x,
    weight,
    layout,
    out_dtype,
    use_f16_accum,
    batch_invariant,
    valid_shape_m,
    tuning,
    backend,
    activation,
    out_quant,
    out_dequantized=False,
):
    """(:func:`plan`'s tiling and reasons, interpreted) for a call on the
    kernels; None where the call runs the reference (its backend, or no rows)."""
    chosen = resolve_backend(backend, "gemm")
    if chosen == "reference" or x.m == 0:
        return None
    interpret = chosen == "interpret"
    args = (use_f16_accum, batch_invariant, valid_shape_m, tuning, interpret, activation, out_quant, out_dequantized)
    return (*plan(x, weight, layout, out_dtype, *args), interpret)


def _check_out_quant(out_quant, activation: ActivationSpec | None, weight: F.QuantizedWeight):
    """``out_quant`` as a spec (None for none), checked: fp8 per group of 128 after a gated activation."""
    if out_quant is None:
        return None
    spec_ = Q.get_input_spec(out_quant)
    if spec_ != Q.FP8_DYNAMIC_GROUP128:
        raise ValueError(f"gemm: out_quant: {spec_.name} (only fp8_dynamic_group128, W8A8's w2 input)")
    if activation is None or not activation.is_gated:
        raise ValueError("gemm: out_quant: the output quantized after a gated activation only")
    spec_.check_k(weight.n // 2, "gemm: out_quant: the activated row")
    return spec_


def _check_activation(activation: ActivationSpec | None, weight: F.QuantizedWeight) -> None:
    """Raise unless ``activation`` reads the weight's rows in their order
    (without one, an interleaved weight's sums come in its rows' order)."""
    if activation is None:
        return
    if activation.gate_up_block != weight.gate_up_block:
        raise ValueError(
            f"activation.gate_up_block: {activation.gate_up_block}, but the weight's rows are interleaved by "
            f"{weight.gate_up_block} (0: halves)"
        )
    activation.output_width(weight.n)


def as_epilogue_activation(activation: ActivationSpec | None) -> spec.EpilogueActivation | None:
    """The kernels' view of an activation."""
    if activation is None:
        return None
    return spec.EpilogueActivation(
        activation.kind.value, activation.clamp_limit, activation.alpha, activation.beta, activation.gate_up_block
    )


def takes_activation(
    x: Q.QuantizedInput,
    weight: F.QuantizedWeight,
    layout: L.Layout,
    activation: ActivationSpec,
    *,
    out_dtype=None,
    use_f16_accum: bool = False,
    batch_invariant: bool = False,
    valid_shape_m: int | None = None,
    tuning: GemmTiles | None = None,
    backend: str | None = None,
    out_quant: Q.InputQuantSpec | None = None,
    out_dequantized: bool = False,
) -> bool:
    """Whether :func:`gemm` with these arguments runs a kernel that applies
    ``activation`` (and quantizes its output as ``out_quant`` and
    ``out_dequantized`` say) in its
    epilogue (the reference backend computes it alike): where it does not, a
    pipeline runs the GEMM, then a pass. Arguments as :func:`gemm`'s (``x`` a
    :class:`QuantizedInput`)."""
    out_dtype = _out_dtype(x, out_dtype)
    planned = _kernel_plan(
        x,
        weight,
        layout,
        out_dtype,
        use_f16_accum,
        batch_invariant,
        valid_shape_m,
        tuning,
        backend,
        activation,
        out_quant,
        out_dequantized,
    )
    return planned is None or planned[0] is not None


def kernel_input_specs(fmt: F.WeightFormat) -> tuple[Q.InputQuantSpec, ...]:
    """The input quantizations of :func:`configs.supported_input_specs` that a
    GEMM kernel takes with weights in ``fmt`` (the kernels' ``supports``
    answer for a grouped call; the others run on the reference only).

    Args:
        fmt: a :class:`WeightFormat`.

    Returns:
        A tuple of :class:`InputQuantSpec`.
    """
    weight = format_spec(fmt, (1, 256, 256))
    layout = spec.LayoutSpec("grouped_contiguous", 16, 16)
    found = []
    for quant in configs.supported_input_specs(fmt):
        x_dtype, x_scale = kernel_input_spec(quant)
        call = spec.GemmCall(weight, layout, x_dtype, "bfloat16", _quant_name(quant), x_scale)
        if any(module.supports(tiles(), call) is None for tiles, module in kernels.KERNELS.items()):
            found.append(quant)
    return tuple(found)


def _quant_name(quant: Q.InputQuantSpec) -> str:
    return quant.name if quant.is_quantized else "none"


def kernel_input_spec(quant: Q.InputQuantSpec, x_dtype=jnp.bfloat16) -> tuple[str, spec.XScale]:
    """(the dtype of the input the kernels read, how they scale it) for an
    input quantized by ``quant`` (``x_dtype``: an unquantized input's dtype).
    8-bit values are read as stored with their scale; 4-bit e2m1 values are
    read as bf16 values times their group scales, exact (:func:`kernel_input`),
    with the second scale (per tensor or row) left to the kernel."""
    mode = quant.mode
    if mode == Q.InputQuantMode.NONE:
        return jnp.dtype(x_dtype).name, spec.XScale()
    if quant.dtype == Q.ActivationDType.FLOAT4_E2M1:
        second = {Q.InputQuantMode.STATIC_TENSOR_DYNAMIC_GROUP: "tensor", Q.InputQuantMode.DYNAMIC_GROUP_TOKEN: "token"}
        return "bfloat16", spec.XScale(second.get(mode, "none"))
    x_dtype = jnp.dtype(quant.dtype.storage_dtype).name
    if mode == Q.InputQuantMode.STATIC_TENSOR:
        return x_dtype, spec.XScale("tensor")
    if mode == Q.InputQuantMode.DYNAMIC_TOKEN:
        return x_dtype, spec.XScale("token")
    if mode == Q.InputQuantMode.DYNAMIC_GROUP:
        return x_dtype, spec.XScale("group", quant.scale_type.value, quant.group_size)
    return x_dtype, spec.XScale(mode.value)  # a mode no kernel takes: supports says so


def kernel_input(x: Q.QuantizedInput) -> tuple[jax.Array, jax.Array | None]:
    """(values, scale) of ``x`` as the kernels read it (:func:`kernel_input_spec`)."""
    quant = x.spec
    if quant.dtype != Q.ActivationDType.FLOAT4_E2M1:
        return x.values, x.scale
    # e2m1 times an e8m0 or e4m3 group scale has at most 6 significant bits: exact in bf16.
    values = Q.dequantize_input(dataclasses.replace(x, scale_2=None)).astype(jnp.bfloat16)
    return values, x.scale_2


def _out_dtype(x: Q.QuantizedInput, out_dtype) -> jnp.dtype:
    if out_dtype is None:
        out_dtype = x.values.dtype if not x.spec.is_quantized else jnp.bfloat16
    return jnp.dtype(out_dtype)


def plan(
    x: Q.QuantizedInput,
    weight: F.QuantizedWeight,
    layout: L.Layout,
    out_dtype=jnp.bfloat16,
    use_f16_accum: bool = False,
    batch_invariant: bool = False,
    valid_shape_m: int | None = None,
    tuning: GemmTiles | None = None,
    interpret: bool = False,
    activation: ActivationSpec | None = None,
    out_quant: Q.InputQuantSpec | None = None,
    out_dequantized: bool = False,
) -> tuple[GemmTiles | None, list[str]]:
    """(the tiling the call runs — None if no kernel takes it —, each refused
    candidate's reason). Candidates: ``tuning`` alone if given, else the
    table's entries then the heuristic's (:func:`humming_jax.tuning.candidates`).
    With an ``activation`` the call runs on the tiling it would run without
    one, if that tiling's kernel applies it (a later candidate is not tuned
    for the call: None then, with the reason); so with ``out_quant``."""
    fused = gemm_call(
        x, weight, layout, out_dtype, use_f16_accum, batch_invariant, interpret, activation, out_quant, out_dequantized
    )
    call = dataclasses.replace(fused, activation=None, out_quant="none", out_dequantized=False)
    if tuning is not None:
        listed = [tuning]
    else:
        estimate = valid_shape_m or layout.output_rows(x.m)
        if batch_invariant:  # one tiling for every batch (a row an expert's): a row's sums never change with it
            estimate = 1 if isinstance(layout, L.Dense) else weight.shape[0]
        block_size = layout.block_size if isinstance(layout, L.Indexed) else None
        listed = T.candidates(
            layout.kind.value,
            weight.format,
            estimate,
            *weight.shape,
            block_size=block_size,
            half_bits=weight.half_bits,
            input_dtype=x.spec.dtype.value if x.spec.is_quantized else None,
        )
    reasons = []
    for tiles in listed:
        module = kernels.KERNELS[type(tiles)]
        reason = module.supports(tiles, call)
        if reason is None and activation is not None:
            reason = module.supports(tiles, fused)
            if reason is not None:
                return None, [*reasons, f"{tiles_text.gemm_to_text(tiles)}: {reason}"]
        if reason is None:
            return tiles, reasons
        reasons.append(f"{tiles_text.gemm_to_text(tiles)}: {reason}")
    return None, reasons


def gemm_call(
    x,
    weight,
    layout,
    out_dtype,
    use_f16_accum=False,
    batch_invariant=False,
    interpret=False,
    activation=None,
    out_quant=None,
    out_dequantized=False,
):
    """The :class:`~pallas_kernels.gemm.spec.GemmCall` the kernels' ``supports`` answer."""
    x_dtype, x_scale = kernel_input_spec(x.spec, x.values.dtype)
    return spec.GemmCall(
        _weight_spec(weight),
        _layout_spec(layout, x.m)[0],
        x_dtype,
        jnp.dtype(out_dtype).name,
        _quant_name(x.spec),
        x_scale,
        use_f16_accum,
        batch_invariant,
        interpret,
        as_epilogue_activation(activation),
        "none" if out_quant is None else _quant_name(out_quant),
        out_dequantized,
    )


def _dequantized(weight: F.QuantizedWeight, dtype) -> F.QuantizedWeight:
    """``weight`` as an unquantized ``[E, N, K]`` weight in ``dtype`` (bf16 or
    f16), its bias kept: each element rounded once, as folded scales do."""
    fmt = F.BF16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else F.F16
    fmt = fmt.with_bias() if weight.bias is not None else fmt
    return F.QuantizedWeight(
        values=F.dequantize_weight(weight, dtype, stored_rows=True),
        bias=weight.bias,
        format=fmt,
        shape=weight.shape,
        gate_up_block=weight.gate_up_block,
    )


def format_spec(fmt: F.WeightFormat, shape: tuple[int, int, int], **stored) -> spec.WeightSpec:
    """The kernels' view of an ``[E, N, K]`` weight in ``fmt``; ``stored``: how
    this weight is stored (group index, planar order, rows a stored block
    scale covers)."""
    return spec.WeightSpec(
        *shape,
        value_type=fmt.value_type.value,
        scale=fmt.scale_granularity.value,
        scale_type=None if fmt.scale_type is None else fmt.scale_type.value,
        group_size=fmt.group_size,
        block_n=stored.pop("block_n", fmt.block_n),
        zero_point=fmt.zero_point.value,
        global_scale=fmt.global_scale.value,
        has_bias=fmt.has_bias,
        **stored,
    )


def _weight_spec(weight: F.QuantizedWeight) -> spec.WeightSpec:
    return format_spec(
        weight.format,
        weight.shape,
        has_group_index=weight.group_index is not None,
        nibble_unit=weight.nibble_unit,
        half_bits=weight.half_bits,
        k_major_scales=weight.k_major_scales,
        block_n=weight.scale_blocks[1] if weight.scale_blocks else weight.format.block_n,
    )


def _layout_spec(layout, m_in: int) -> tuple[spec.LayoutSpec, tuple[jax.Array, ...]]:
    kind = layout.kind.value
    if isinstance(layout, L.Dense):
        return spec.LayoutSpec(kind, m_in, m_in), ()
    if isinstance(layout, L.GroupedContiguous):
        # The kernels' static tile bound covers every row of offsets in [0, M] that never decrease.
        return spec.LayoutSpec(kind, m_in, m_in), (layout.owned_offsets(m_in),)
    if isinstance(layout, L.GroupedMasked):
        counts = layout.expert_num_tokens.astype(jnp.int32)
        return spec.LayoutSpec(kind, m_in, m_in, max_tokens=m_in // counts.shape[0]), (counts,)
    layout_spec = spec.LayoutSpec(
        kind,
        m_in,
        m_in * layout.top_k,
        top_k=layout.top_k,
        num_blocks=layout.expert_ids.shape[0],
        block_size=layout.block_size,
        lists_dropped=layout.lists_dropped,
        slot_order=layout.slot_order,
        tile_by_expert=layout.tile_by_expert,
    )
    arrays = (
        layout.sorted_ids.astype(jnp.int32),
        layout.expert_ids.astype(jnp.int32),
        layout.num_tokens_padded.reshape(-1)[:1].astype(jnp.int32),
    )
    return layout_spec, arrays


def _run_kernel(
    x,
    weight,
    layout,
    tiles,
    out_dtype,
    use_f16_accum,
    interpret,
    activation=None,
    out_quant=None,
    out_dequantized=False,
):
    if isinstance(tiles, mosaic.Tiles) and tiles.dequantize_first and weight.format.is_quantized:
        weight = _dequantized(weight, x.values.dtype)
    if isinstance(tiles, (triton.Tiles, mosaic.Tiles)) and tiles.dequantize_input and x.spec.is_quantized:
        # The op's step: the kernel then runs the weight-only tile on bf16 values.
        x = as_quantized_input(Q.dequantize_input(x).astype(jnp.bfloat16))
        tiles = dataclasses.replace(tiles, dequantize_input=False)
    call = gemm_call(
        x,
        weight,
        layout,
        out_dtype,
        use_f16_accum,
        interpret=interpret,
        activation=activation,
        out_quant=out_quant,
        out_dequantized=out_dequantized,
    )
    parts = tuple(
        a
        for a in (weight.values, weight.scale, weight.zero_point, weight.second_scale, weight.group_index)
        if a is not None
    )
    route = _layout_spec(layout, x.m)[1]
    values, x_scale = kernel_input(x)
    return kernels.KERNELS[type(tiles)].expert_gemm(call, tiles, values, parts, weight.bias, route, x_scale)
