"""Weight formats: a frozen, hashable spec (static under ``jit``), the
``QuantizedWeight`` pytree, and ``quantize_weight`` / ``dequantize_weight``.

Weights are ``[E, N, K]``; the dequantized weight is ``(value - zero_point)
* scale * second_scale``, every scale stored blockwise (``[E, S_n, S_k]``
covering ``[E, N, K]`` in blocks of ``N/S_n`` by ``K/S_k``). The stored
arrays of each value type, the zero points' packing and act-order's
``group_index``: docs/DESIGN.md, appendix A; the bit layouts:
:mod:`humming_jax.numerics`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from humming_jax import numerics
from pallas_kernels import word_decode


class ValueType(enum.StrEnum):
    """What one stored weight element is."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"
    INT4 = "int4"
    UINT4 = "uint4"
    FLOAT8_E4M3 = "float8_e4m3"
    FLOAT4_E2M1 = "float4_e2m1"

    @property
    def bits(self) -> int:
        return {"bfloat16": 16, "float16": 16, "int8": 8, "float8_e4m3": 8}.get(self.value, 4)

    @property
    def is_packed(self) -> bool:
        return self.bits == 4


class ScaleGranularity(enum.StrEnum):
    NONE = "none"
    TENSOR = "tensor"  # one scale per expert
    CHANNEL = "channel"  # one per output row n
    GROUP = "group"  # one per row and group of `group_size` along K
    BLOCK = "block"  # one per block_n x group_size tile


class ScaleType(enum.StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    E8M0 = "e8m0"  # power-of-two, stored as uint8 biased exponent
    FLOAT8_E4M3 = "float8_e4m3"


class ZeroPoint(enum.StrEnum):
    NONE = "none"
    INT = "int"  # uint4 zero point, packed two per byte along the group axis
    FLOAT = "float"  # float zero point in the scale dtype


class GlobalScale(enum.StrEnum):
    NONE = "none"
    TENSOR = "tensor"  # one f32 for the whole weight, stored [1]
    EXPERT = "expert"  # one f32 per expert, stored [E]


def _enum_field(enum_type, value, field_name: str):
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"WeightFormat.{field_name}: got {value!r}, expected one of {allowed}") from None


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """A weight format (Humming's weight schema). Frozen and hashable: pass it
    as a static argument. The presets are in ``PRESETS`` (:func:`get_format`).

    Attributes:
        name: the preset's name (``"int4_g128"``, ``"mxfp4+bias"``).
        value_type: the stored value type (bf16, f16, int4, uint4, int8, e4m3, e2m1, …).
        scale_granularity: none, per tensor, per channel, per group of K or per block.
        scale_type: f32, bf16, f16, e8m0 or e4m3 (None: unscaled).
        group_size: columns of K a scale covers (groups and blocks).
        block_n: rows of N a block scale covers.
        zero_point: none, integer or float (per group).
        global_scale: a second f32 scale per expert (NVFP4).
        has_bias: a bias ``[E, N]`` is added to the product.
    """

    name: str
    value_type: ValueType
    scale_granularity: ScaleGranularity = ScaleGranularity.NONE
    scale_type: ScaleType | None = None
    group_size: int = 0  # along K, for GROUP and BLOCK
    block_n: int = 0  # along N, for BLOCK
    zero_point: ZeroPoint = ZeroPoint.NONE
    global_scale: GlobalScale = GlobalScale.NONE
    has_bias: bool = False

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("value_type", _enum_field(ValueType, self.value_type, "value_type"))
        set_("scale_granularity", _enum_field(ScaleGranularity, self.scale_granularity, "scale_granularity"))
        if self.scale_type is not None:
            set_("scale_type", _enum_field(ScaleType, self.scale_type, "scale_type"))
        set_("zero_point", _enum_field(ZeroPoint, self.zero_point, "zero_point"))
        set_("global_scale", _enum_field(GlobalScale, self.global_scale, "global_scale"))
        self._validate()

    def _validate(self) -> None:
        vt, gran = self.value_type, self.scale_granularity
        unquantized = vt in (ValueType.BFLOAT16, ValueType.FLOAT16)
        if unquantized != (gran == ScaleGranularity.NONE):
            raise ValueError(
                f"WeightFormat.scale_granularity: {gran.value!r} with value_type {vt.value!r}; "
                "bfloat16/float16 weights take 'none', quantized weights need a scale"
            )
        if not unquantized and self.scale_type is None:
            raise ValueError("WeightFormat.scale_type: a quantized format needs a scale_type")
        if gran in (ScaleGranularity.GROUP, ScaleGranularity.BLOCK):
            if self.group_size <= 0 or self.group_size & (self.group_size - 1):
                raise ValueError(
                    f"WeightFormat.group_size: expected a positive power of two for {gran.value!r} scales, "
                    f"got {self.group_size}"
                )
        elif self.group_size:
            raise ValueError(f"WeightFormat.group_size: must be 0 for {gran.value!r} scales, got {self.group_size}")
        if gran == ScaleGranularity.BLOCK and self.block_n <= 0:
            raise ValueError(f"WeightFormat.block_n: expected a positive block height, got {self.block_n}")
        if self.zero_point != ZeroPoint.NONE:
            if vt != ValueType.UINT4 or gran != ScaleGranularity.GROUP:
                raise ValueError(
                    "WeightFormat.zero_point: zero points are supported for value_type 'uint4' "
                    f"with 'group' scales, got {vt.value!r} with {gran.value!r}"
                )
        elif vt == ValueType.UINT4:
            raise ValueError("WeightFormat.zero_point: value_type 'uint4' needs a zero point ('int' or 'float')")
        if self.scale_type == ScaleType.E8M0 and vt not in (ValueType.FLOAT4_E2M1, ValueType.FLOAT8_E4M3):
            raise ValueError("WeightFormat.scale_type: 'e8m0' scales are for MX formats (float4_e2m1, float8_e4m3)")
        if self.global_scale != GlobalScale.NONE and self.scale_type != ScaleType.FLOAT8_E4M3:
            raise ValueError("WeightFormat.global_scale: a second scale is for NVFP4-style e4m3 block scales")
        if vt == ValueType.FLOAT4_E2M1 and self.scale_type not in (ScaleType.E8M0, ScaleType.FLOAT8_E4M3):
            raise ValueError("WeightFormat.scale_type: float4_e2m1 takes 'e8m0' (MXFP4) or 'float8_e4m3' (NVFP4)")

    # ---- derived facts -------------------------------------------------
    @property
    def is_quantized(self) -> bool:
        return self.scale_granularity != ScaleGranularity.NONE

    @property
    def packs_k(self) -> int:
        """Logical K elements per stored element along K (2 for 4-bit)."""
        return 2 if self.value_type.is_packed else 1

    @property
    def values_dtype(self):
        return {
            ValueType.BFLOAT16: jnp.bfloat16,
            ValueType.FLOAT16: jnp.float16,
            ValueType.INT8: jnp.int8,
            ValueType.FLOAT8_E4M3: jnp.float8_e4m3fn,
        }.get(self.value_type, jnp.uint8)

    @property
    def scale_dtype(self):
        if self.scale_type is None:
            return None
        return {
            ScaleType.FLOAT32: jnp.float32,
            ScaleType.BFLOAT16: jnp.bfloat16,
            ScaleType.FLOAT16: jnp.float16,
            ScaleType.E8M0: jnp.uint8,
            ScaleType.FLOAT8_E4M3: jnp.float8_e4m3fn,
        }[self.scale_type]

    def values_shape(self, num_experts: int, n: int, k: int) -> tuple[int, int, int]:
        return (num_experts, n, k // self.packs_k)

    def scale_shape(self, num_experts: int, n: int, k: int) -> tuple[int, int, int] | None:
        gran = self.scale_granularity
        if gran == ScaleGranularity.NONE:
            return None
        if gran == ScaleGranularity.TENSOR:
            return (num_experts, 1, 1)
        if gran == ScaleGranularity.CHANNEL:
            return (num_experts, n, 1)
        if gran == ScaleGranularity.GROUP:
            return (num_experts, n, k // self.group_size)
        return (num_experts, math.ceil(n / self.block_n), math.ceil(k / self.group_size))

    def scale_blocks(self) -> tuple[int, int, int] | None:
        """Elements a stored scale covers along ``[E, N, K]`` for block scales —
        ``block_n`` rows by ``group_size`` columns, the last block of each axis
        partial (as block-scaled checkpoints store them) — else None (the
        scale's shape says it)."""
        if self.scale_granularity == ScaleGranularity.BLOCK:
            return (1, self.block_n, self.group_size)
        return None

    def zero_point_shape(self, num_experts: int, n: int, k: int) -> tuple[int, int, int] | None:
        if self.zero_point == ZeroPoint.NONE:
            return None
        groups = k // self.group_size
        return (num_experts, n, (groups + 1) // 2) if self.zero_point == ZeroPoint.INT else (num_experts, n, groups)

    def second_scale_shape(self, num_experts: int) -> tuple[int] | None:
        return {GlobalScale.NONE: None, GlobalScale.TENSOR: (1,), GlobalScale.EXPERT: (num_experts,)}[self.global_scale]

    def check_shape(self, n: int, k: int, argument: str = "weight") -> None:
        """Raise ``ValueError`` if ``[*, n, k]`` cannot be stored in this format."""
        if self.value_type.is_packed and k % 2:
            raise ValueError(
                f"{argument}: format {self.name!r} packs two 4-bit values per byte along K, "
                f"so K must be even; got K={k}"
            )
        if self.scale_granularity == ScaleGranularity.GROUP and k % self.group_size:
            raise ValueError(
                f"{argument}: format {self.name!r} has groups of {self.group_size} along K; "
                f"K={k} is not a multiple (pad K, see LayerConfig.pad_shape_k)"
            )

    def with_bias(self, has_bias: bool = True) -> WeightFormat:
        name = self.name if not has_bias or self.name.endswith("+bias") else self.name + "+bias"
        return dataclasses.replace(self, has_bias=has_bias, name=name)


def _preset(name, value_type, gran="none", scale_type=None, group_size=0, **kw) -> WeightFormat:
    return WeightFormat(name, value_type, gran, scale_type, group_size, **kw)


BF16 = _preset("bf16", "bfloat16")
F16 = _preset("f16", "float16")
INT4_CHANNEL = _preset("int4_channel", "int4", "channel", "bfloat16")
INT4_G32 = _preset("int4_g32", "int4", "group", "bfloat16", 32)
INT4_G64 = _preset("int4_g64", "int4", "group", "bfloat16", 64)
INT4_G128 = _preset("int4_g128", "int4", "group", "bfloat16", 128)
INT8_CHANNEL = _preset("int8_channel", "int8", "channel", "bfloat16")
INT8_G32 = _preset("int8_g32", "int8", "group", "bfloat16", 32)
INT8_G64 = _preset("int8_g64", "int8", "group", "bfloat16", 64)
INT8_G128 = _preset("int8_g128", "int8", "group", "bfloat16", 128)
UINT4_ZP_G128 = _preset("uint4_zp_g128", "uint4", "group", "bfloat16", 128, zero_point="int")
UINT4_FZP_G128 = _preset("uint4_fzp_g128", "uint4", "group", "bfloat16", 128, zero_point="float")
FP8_CHANNEL = _preset("fp8_channel", "float8_e4m3", "channel", "float32")
FP8_TENSOR = _preset("fp8_tensor", "float8_e4m3", "tensor", "float32")
FP8_BLOCK128 = _preset("fp8_block128", "float8_e4m3", "block", "float32", 128, block_n=128)
MXFP4 = _preset("mxfp4", "float4_e2m1", "group", "e8m0", 32)
MXFP8 = _preset("mxfp8", "float8_e4m3", "group", "e8m0", 32)
NVFP4 = _preset("nvfp4", "float4_e2m1", "group", "float8_e4m3", 16, global_scale="expert")

PRESETS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        BF16,
        F16,
        INT4_CHANNEL,
        INT4_G32,
        INT4_G64,
        INT4_G128,
        INT8_CHANNEL,
        INT8_G32,
        INT8_G64,
        INT8_G128,
        UINT4_ZP_G128,
        UINT4_FZP_G128,
        FP8_CHANNEL,
        FP8_TENSOR,
        FP8_BLOCK128,
        MXFP4,
        MXFP8,
        NVFP4,
    )
}


def get_format(name: str | WeightFormat) -> WeightFormat:
    """Look a preset up by name.

    Args:
        name: a preset's name (``"int4_g128"``, ``"mxfp4+bias"``, …) or a
            :class:`WeightFormat` (returned as it is).

    Returns:
        The :class:`WeightFormat`.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if isinstance(name, WeightFormat):
        return name
    base, plus_bias = (name[: -len("+bias")], True) if name.endswith("+bias") else (name, False)
    if base not in PRESETS:
        raise ValueError(f"weight format: unknown name {name!r}; known: {', '.join(PRESETS)} (each also '+bias')")
    return PRESETS[base].with_bias(plus_bias) if plus_bias else PRESETS[base]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight in a :class:`WeightFormat`: a pytree whose leaves are the stored
    arrays and whose static part is the format and the logical shape. Unused
    parts are None. Build with :func:`quantize_weight` or a checkpoint loader.

    Attributes:
        values: the stored values ``[E, N, K]`` (4-bit codes packed two a byte: ``K/2``).
        scale: the scales, shaped by the format's granularity (groups: ``[E, N, K/g]``,
            or ``[E, K/g, N]`` with ``k_major_scales``).
        zero_point: uint4 formats: the zero points per group.
        second_scale: NVFP4: f32 ``[E]``, the global scale.
        bias: ``[E, N]`` for formats with a bias.
        group_index: GPTQ act-order: int32 ``[E, K]``, the group of each column.
        format: the :class:`WeightFormat` (static).
        shape: the logical ``(E, N, K)`` (static).
        nibble_unit: 0 for codes in K order, else the planar order's unit (:func:`to_planar`).
        half_bits: planar e2m1 codes with each 16-bit half in the pair decoder's bit order.
        k_major_scales: group scales stored ``[E, K/g, N]`` (:func:`to_planar`).
        gate_up_block: 0, or a gated w13's gate and up rows interleaved by
            blocks of this many (:func:`interleave_gate_up`).
    """

    values: jax.Array
    scale: jax.Array | None = None
    zero_point: jax.Array | None = None
    second_scale: jax.Array | None = None
    bias: jax.Array | None = None
    group_index: jax.Array | None = None
    format: WeightFormat = dataclasses.field(default=BF16, metadata=dict(static=True))
    shape: tuple[int, int, int] = dataclasses.field(default=(0, 0, 0), metadata=dict(static=True))
    # 0: packed codes in K order (column k at nibble k). U > 0: the kernel's
    # planar order within units of U columns (see to_planar).
    nibble_unit: int = dataclasses.field(default=0, metadata=dict(static=True))
    # Planar e2m1 codes with each 16-bit half's bits in the pair decoder's order
    # (E2M1_HALF_BITS: 11 integer ops per 8 codes instead of 15); the GEMM
    # reads such weights as nibble pairs only (see to_planar).
    half_bits: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # Group scales stored [E, K/g, N]: the order the Mosaic kernels' TMA reads
    # them in, so no call transposes them (see to_planar).
    k_major_scales: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # A gated w13 whose rows are [g_0..g_{c-1}, u_0..u_{c-1}, g_c, ...] for c > 0: a GEMM
    # tile of 2c columns holds both halves of c outputs and applies the activation itself.
    gate_up_block: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def scale_blocks(self) -> tuple[int, int, int] | None:
        """Elements a stored block scale covers: the format's blocks, or for a
        w13 interleaved by blocks of fewer rows than a scale block one scale
        an interleaved block (its scale block's, repeated: :func:`interleave_gate_up`)."""
        blocks = self.format.scale_blocks()
        if blocks is not None and 0 < self.gate_up_block < blocks[1]:
            return (1, self.gate_up_block, blocks[2])
        return blocks

    @property
    def n(self) -> int:
        return self.shape[1]

    @property
    def k(self) -> int:
        return self.shape[2]

    def validate(self, argument: str = "weight") -> None:
        """Check every stored array against the format; raise naming the part."""
        fmt = self.format
        e, n, k = self.shape
        fmt.check_shape(n, k, argument)
        if self.half_bits and not (self.nibble_unit and fmt.value_type == ValueType.FLOAT4_E2M1):
            raise ValueError(f"{argument}.half_bits: only planar e2m1 weights (to_planar) have it, not {fmt.name!r}")
        if self.nibble_unit and self.nibble_unit != planar_unit(fmt, k):
            raise ValueError(
                f"{argument}.nibble_unit: expected 0 (K order) or {planar_unit(fmt, k)} (planar) for format "
                f"{fmt.name!r} and K={k}, got {self.nibble_unit}"
            )
        reason = gate_up_block_refusal(fmt, n, self.gate_up_block) if self.gate_up_block else None
        if reason:
            raise ValueError(f"{argument}.gate_up_block: {reason}")
        if self.k_major_scales and not _orders_scales(self):
            raise ValueError(
                f"{argument}.k_major_scales: only per-group scales without a group index have it, not {fmt.name!r}"
            )
        scale_shape = fmt.scale_shape(e, n, k)
        if self.scale_blocks is not None:
            scale_shape = (e, -(-n // self.scale_blocks[1]), scale_shape[2])
        if self.k_major_scales:
            scale_shape = (e, scale_shape[2], n)
        expected = {
            "values": (fmt.values_shape(e, n, k), fmt.values_dtype),
            "scale": (scale_shape, fmt.scale_dtype),
            "zero_point": (
                fmt.zero_point_shape(e, n, k),
                jnp.uint8 if fmt.zero_point == ZeroPoint.INT else fmt.scale_dtype,
            ),
            "second_scale": (fmt.second_scale_shape(e), jnp.float32),
            "bias": ((e, n) if fmt.has_bias else None, None),
        }
        if self.group_index is not None:
            if fmt.scale_granularity != ScaleGranularity.GROUP:
                raise ValueError(f"{argument}.group_index: only per-group formats take a group index, not {fmt.name!r}")
            expected["group_index"] = ((e, k), jnp.int32)
        for part, (shape, dtype) in expected.items():
            array = getattr(self, part)
            if shape is None:
                if array is not None:
                    raise ValueError(f"{argument}.{part}: format {fmt.name!r} has no {part}, but one was given")
                continue
            if array is None:
                raise ValueError(f"{argument}.{part}: format {fmt.name!r} needs a {part} of shape {shape}")
            if tuple(array.shape) != tuple(shape):
                raise ValueError(
                    f"{argument}.{part}: expected shape {shape} for format {fmt.name!r} and "
                    f"[E, N, K]={list(self.shape)}, got {tuple(array.shape)}"
                )
            if dtype is not None and jnp.dtype(array.dtype) != jnp.dtype(dtype):
                raise TypeError(
                    f"{argument}.{part}: expected dtype {jnp.dtype(dtype).name} for format {fmt.name!r}, "
                    f"got {jnp.dtype(array.dtype).name}"
                )


# ---------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------


def _blockwise_amax(w: jax.Array, scale_shape: tuple[int, int, int], blocks=None) -> jax.Array:
    """Max |w| over each scale block of ``w [E, N, K]`` (``blocks``: the
    elements a scale covers, :meth:`WeightFormat.scale_blocks`); returns ``scale_shape``."""
    e, n, k = w.shape
    _, sn, sk = scale_shape
    bn, bk = (math.ceil(n / sn), math.ceil(k / sk)) if blocks is None else blocks[1:]
    padded = jnp.pad(jnp.abs(w), ((0, 0), (0, sn * bn - n), (0, sk * bk - k)))
    return padded.reshape(e, sn, bn, sk, bk).max(axis=(2, 4))


def _blockwise_min_max(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    e, n, k = w.shape
    grouped = w.reshape(e, n, k // group_size, group_size)
    return grouped.min(axis=-1), grouped.max(axis=-1)


def _store_scale(scale_f32: jax.Array, fmt: WeightFormat) -> jax.Array:
    """Round an f32 scale to the format's scale dtype (e8m0 handled by caller)."""
    if fmt.scale_type == ScaleType.FLOAT8_E4M3:
        return numerics.cast_float8_saturating(scale_f32, jnp.float8_e4m3fn)
    return scale_f32.astype(fmt.scale_dtype)


def _decode_scale(stored: jax.Array, fmt: WeightFormat) -> jax.Array:
    if fmt.scale_type == ScaleType.E8M0:
        return numerics.e8m0_decode(stored)
    return stored.astype(jnp.float32)


def quantize_weight(
    w: jax.Array,
    fmt: WeightFormat | str,
    *,
    bias: jax.Array | None = None,
) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight into ``fmt``.

    Args:
        w: float ``[E, N, K]`` (or ``[N, K]``, taken as one expert).
        fmt: the :class:`WeightFormat` or a preset's name.
        bias: ``[E, N]`` float, for formats with a bias.

    Returns:
        The :class:`QuantizedWeight` (codes in K order).

    Scale rules (amax taken over each scale block):

    * int4/int8 symmetric: ``s = amax / qmax`` (qmax 7 / 127), ``q = round(w / s)``.
    * uint4 + zero point: the group range is widened to include 0, then
      ``s = (max - min) / 15``, ``z = round(-min / s)`` (int) or ``-min / s``
      (float), ``q = clip(round(w / s + z), 0, 15)``.
    * fp8 per-channel / per-tensor / block: ``s = amax / 448`` (f32).
    * MX (e8m0): the smallest power of two with ``amax / s <= element max``.
    * NVFP4: per-expert ``g = amax_e / (448 * 6)``, block ``s = e4m3(amax_b / (6 g))``.

    ``q`` is always computed against the *stored* (rounded) scale, so
    dequantization reproduces exactly what was rounded. Ties round to even.
    """
    fmt = get_format(fmt)
    w = jnp.asarray(w)
    if w.ndim == 2:
        w = w[None]
        bias = None if bias is None else jnp.asarray(bias).reshape(1, -1)
    if w.ndim != 3:
        raise ValueError(f"quantize_weight: w must be [E, N, K] or [N, K], got shape {w.shape}")
    e, n, k = w.shape
    fmt.check_shape(n, k, "quantize_weight: w")
    if fmt.has_bias != (bias is not None):
        raise ValueError(
            f"quantize_weight: bias: format {fmt.name!r} "
            + ("needs a bias [E, N]" if fmt.has_bias else "has no bias; use fmt.with_bias()")
        )
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"quantize_weight: bias: expected shape {(e, n)}, got {tuple(bias.shape)}")
    parts = _quantized_parts(w, fmt)
    if bias is not None:
        parts["bias"] = jnp.asarray(bias)
    weight = QuantizedWeight(**parts, format=fmt, shape=(e, n, k))
    check_folded_scale_range(weight)
    return weight


@functools.partial(jax.jit, static_argnames="fmt")
def _quantized_parts(w: jax.Array, fmt: WeightFormat) -> dict[str, jax.Array]:
    """The stored arrays of ``w [E, N, K]`` in ``fmt`` (one compiled program a
    format and shape: called eagerly, op by op, they would compile hundreds)."""
    e, n, k = w.shape
    w32 = w.astype(jnp.float32)
    vt = fmt.value_type
    parts: dict[str, Any] = {}

    if not fmt.is_quantized:
        parts["values"] = w.astype(fmt.values_dtype)
    elif fmt.zero_point != ZeroPoint.NONE:
        lo, hi = _blockwise_min_max(w32, fmt.group_size)
        lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)
        scale = _store_scale(jnp.where(hi > lo, (hi - lo) / 15.0, 1.0), fmt)
        scale32 = scale.astype(jnp.float32)
        zero = -lo / scale32
        if fmt.zero_point == ZeroPoint.INT:
            zero_codes = jnp.clip(numerics.round_half_even(zero), 0, 15).astype(jnp.uint8)
            groups = zero_codes.shape[-1]
            padded = jnp.pad(zero_codes, ((0, 0), (0, 0), (0, groups % 2)))
            parts["zero_point"] = numerics.pack_nibbles(padded)
            zero_used = zero_codes.astype(jnp.float32)
        else:
            parts["zero_point"] = zero.astype(fmt.scale_dtype)
            zero_used = parts["zero_point"].astype(jnp.float32)
        inverse = numerics.block_broadcast(jax.lax.optimization_barrier(numerics.safe_reciprocal(scale32)), w.shape)
        full_zero = numerics.block_broadcast(zero_used, w.shape)
        q = jnp.clip(numerics.round_half_even(w32 * inverse + full_zero), 0, 15)
        parts["values"] = numerics.pack_nibbles(q.astype(jnp.uint8))
        parts["scale"] = scale
    else:
        scale_shape = fmt.scale_shape(e, n, k)
        amax = _blockwise_amax(w32, scale_shape, fmt.scale_blocks())
        if vt == ValueType.FLOAT4_E2M1 and fmt.global_scale != GlobalScale.NONE:
            axes = (0, 1, 2) if fmt.global_scale == GlobalScale.TENSOR else (1, 2)
            global_amax = amax.max(axis=axes, keepdims=True)
            second = jnp.where(global_amax > 0, global_amax / (448.0 * 6.0), 1.0)
            scale = _store_scale(amax / (6.0 * second), fmt)
            scale32 = scale.astype(jnp.float32) * second
            parts["second_scale"] = second.reshape(fmt.second_scale_shape(e)).astype(jnp.float32)
        elif fmt.scale_type == ScaleType.E8M0:
            element_max = numerics.FLOAT4_E2M1_MAX if vt == ValueType.FLOAT4_E2M1 else numerics.FLOAT8_E4M3_MAX
            scale = numerics.e8m0_from_amax(amax, element_max)
            scale32 = numerics.e8m0_decode(scale)
        else:
            qmax = {
                ValueType.INT4: numerics.INT4_MAX,
                ValueType.INT8: numerics.INT8_MAX,
                ValueType.FLOAT8_E4M3: numerics.FLOAT8_E4M3_MAX,
            }[vt]
            scale = _store_scale(amax / qmax, fmt)
            scale32 = scale.astype(jnp.float32)
        parts["scale"] = scale
        # The barrier keeps XLA from fusing the reciprocal's long division into
        # the broadcast, once per element: CPU compile times of minutes.
        inverse = jax.lax.optimization_barrier(numerics.safe_reciprocal(scale32))
        scaled = w32 * numerics.block_broadcast(inverse, w.shape, fmt.scale_blocks())
        if vt == ValueType.INT4:
            q = jnp.clip(numerics.round_half_even(scaled), -8, 7)
            parts["values"] = numerics.pack_nibbles((q + 8).astype(jnp.uint8))
        elif vt == ValueType.INT8:
            parts["values"] = jnp.clip(numerics.round_half_even(scaled), -127, 127).astype(jnp.int8)
        elif vt == ValueType.FLOAT8_E4M3:
            parts["values"] = numerics.cast_float8_saturating(scaled, jnp.float8_e4m3fn)
        else:
            parts["values"] = numerics.pack_nibbles(numerics.e2m1_encode(scaled))
    return parts


def decode_values(weight: QuantizedWeight) -> jax.Array:
    """Stored values as float32 ``[E, N, K]`` (before zero point and scales)."""
    vt = weight.format.value_type
    values = weight.values
    if not vt.is_packed:
        return values.astype(jnp.float32)
    codes = _codes_in_k_order(weight)
    if vt == ValueType.INT4:
        return codes.astype(jnp.float32) - 8.0
    if vt == ValueType.UINT4:
        return codes.astype(jnp.float32)
    return numerics.e2m1_decode(codes)


# ---------------------------------------------------------------------------
# planar nibble order (a load-time layout for the GEMM kernel)
# ---------------------------------------------------------------------------


def planar_unit(fmt: WeightFormat, k: int) -> int:
    """Columns per unit of the planar order for a packed 4-bit format and K
    columns: the group size for per-group scales (so a unit never straddles
    two groups), else 128; 0 when the format is not packed or K is not a
    whole number of units."""
    if not fmt.value_type.is_packed:
        return 0
    unit = fmt.group_size if fmt.scale_granularity == ScaleGranularity.GROUP else 128
    return unit if unit >= 8 and k % unit == 0 else 0


def planar_columns(unit: int) -> np.ndarray:
    """``[unit]``: the column (within its unit) of each nibble position of the
    planar order. Nibble i holds column ``i // 4 + (unit / 4) * (i % 4)``: the
    16-bit half h of a unit holds columns h, h + unit/4, h + unit/2,
    h + 3·unit/4, so the kernel's piece j (nibble j of every half) covers
    unit/4 consecutive columns and meets x as it is, with no split copy."""
    i = np.arange(unit)
    return i // 4 + (unit // 4) * (i % 4)


def _regroup_half_bits(values: jax.Array, to_half_bits: bool) -> jax.Array:
    """Packed codes ``uint8 [..., K/2]`` with each 16-bit half (bytes 2h, 2h+1)
    turned from nibble order into the decoder's bit order (or back)."""
    pairs = values.reshape(*values.shape[:-1], -1, 2).astype(jnp.uint16)
    half = pairs[..., 0] | (pairs[..., 1] << 8)
    tables = (word_decode.NIBBLE_BITS, word_decode.E2M1_HALF_BITS)
    source, target = tables if to_half_bits else tables[::-1]
    half = word_decode.halves_from_codes(word_decode.half_codes(half, source), target)
    return jnp.stack([half & 0xFF, half >> 8], axis=-1).astype(jnp.uint8).reshape(values.shape)


def _codes_in_k_order(weight: QuantizedWeight) -> jax.Array:
    """The 4-bit codes ``uint8 [E, N, K]`` in column order, whatever the storage order."""
    return _codes_of(weight.values, weight.shape, weight.nibble_unit, weight.half_bits)


def _codes_of(values: jax.Array, shape: tuple[int, int, int], unit: int, half_bits: bool) -> jax.Array:
    """:func:`_codes_in_k_order` of the stored ``values``."""
    values = _regroup_half_bits(values, False) if half_bits else values
    codes = numerics.unpack_nibbles(values)
    if not unit:
        return codes
    e, n, k = shape
    # Nibble 4a + b of a unit holds column a + (unit/4) b: a transpose, not a gather
    # (XLA fuses it into the dequantize pass of dequantize_first).
    by_piece = codes.reshape(e, n, k // unit, unit // 4, 4)
    return jnp.swapaxes(by_piece, -1, -2).reshape(e, n, k)


# MXFP4 scales the GEMM folds into bf16 weights exactly: up to 2**63 (byte 190;
# the folded scale carries 2**64, see pallas_kernels.gemm.E2M1_FOLDED_EXPONENT).
E8M0_FOLD_MAX = 190


def check_folded_scale_range(weight: QuantizedWeight, argument: str = "weight") -> None:
    """Refuse MXFP4 scales above 2**63 (e8m0 bytes past :data:`E8M0_FOLD_MAX`;
    weights beyond ~5e19), which the GEMM's folded scales cannot hold. Checked
    where a weight is concrete (loading, quantizing, :func:`to_planar`);
    traced weights pass unchecked."""
    fmt = weight.format
    if fmt.value_type != ValueType.FLOAT4_E2M1 or fmt.scale_type != ScaleType.E8M0 or weight.scale is None:
        return
    if isinstance(weight.scale, jax.core.Tracer) or weight.scale.size == 0:
        return
    top = int(np.max(np.asarray(weight.scale)))
    if top > E8M0_FOLD_MAX:
        raise ValueError(
            f"{argument}.scale: MXFP4 e8m0 scales must be at most {E8M0_FOLD_MAX} (2**63), got a byte of {top}"
        )


def planar_half_bits(compute_dtype, input_quant=None) -> bool:
    """Whether planar e2m1 codes are stored in the pair decoder's bit order
    (``to_planar(half_bits=True)``): for bf16 compute, where the GEMM reads
    them as nibble pairs in spans of 128+ columns — unless the input
    (an ``InputQuantSpec``) keeps 8-bit values with scales for narrower
    groups (MXFP8 inputs: a scale every 32 columns)."""
    narrow = (
        input_quant is not None
        and input_quant.mode.has_group_scale
        and input_quant.dtype.bits == 8
        and input_quant.group_size < 128
    )
    return jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16) and not narrow


def k_major_scales_preferred(fmt: WeightFormat) -> bool:
    """Whether :func:`to_kernel_order <humming_jax.experts.to_kernel_order>`
    stores the format's group scales ``[E, K/g, N]``: e8m0 bytes (MXFP4,
    MXFP8), which the Mosaic kernels read along N a K step at a time."""
    return fmt.scale_granularity == ScaleGranularity.GROUP and fmt.scale_type == ScaleType.E8M0


def _orders_scales(weight: QuantizedWeight) -> bool:
    """Whether the weight's scales may be stored K-major: per-group scales without a group index."""
    return weight.format.scale_granularity == ScaleGranularity.GROUP and weight.group_index is None


def with_scale_order(weight: QuantizedWeight, k_major: bool) -> QuantizedWeight:
    """``weight`` with its group scales ``[E, K/g, N]`` (``k_major``) or
    ``[E, N, K/g]``; weights without per-group scales (or with a group index)
    as they are."""
    if weight.k_major_scales == k_major or (k_major and not _orders_scales(weight)):
        return weight
    return dataclasses.replace(weight, scale=jnp.swapaxes(weight.scale, 1, 2), k_major_scales=k_major)


def n_major_scale(weight: QuantizedWeight) -> jax.Array | None:
    """The stored scales in the format's own shape (groups ``[E, N, K/g]``), whatever the order."""
    return jnp.swapaxes(weight.scale, 1, 2) if weight.k_major_scales else weight.scale


def _check_weight(weight, op: str) -> None:
    """A clear error where a public function of :class:`QuantizedWeight` gets something else."""
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(
            f"{op}: weight: expected a QuantizedWeight (from quantize_weight or quantize_experts), "
            f"got {type(weight).__name__}"
        )


def to_planar(weight: QuantizedWeight, half_bits: bool = False, k_major_scales: bool = False) -> QuantizedWeight:
    """Repack 4-bit codes in the planar order the GEMM kernel reads without
    splitting x (a load-time repack: the same values, a permutation of nibbles
    within each unit of :func:`planar_unit` columns).

    Args:
        weight: a :class:`QuantizedWeight`.
        half_bits: e2m1 formats (ignored for the others): each 16-bit half's
            bits also in the pair decoder's order — for bf16 compute, where the
            GEMM then always decodes nibble pairs.
        k_major_scales: per-group scales also stored ``[E, K/g, N]``
            (:func:`with_scale_order`; ignored for other scales).

    Returns:
        The planar weight; weights that cannot be planar (unpacked formats, K
        not a whole number of units) and planar ones as they are, but for the
        scales' order.
    """
    _check_weight(weight, "to_planar")
    check_folded_scale_range(weight)
    if k_major_scales:
        weight = with_scale_order(weight, True)
    unit = planar_unit(weight.format, weight.k)
    if weight.nibble_unit or not unit:
        return weight
    half_bits = half_bits and weight.format.value_type == ValueType.FLOAT4_E2M1
    values = _planar_values(weight.values, weight.shape, unit, half_bits)
    return dataclasses.replace(weight, values=values, nibble_unit=unit, half_bits=half_bits)


# One compiled program a shape (op by op, a load-time repack would compile each of its steps).
@functools.partial(jax.jit, static_argnames=("shape", "unit", "half_bits"))
def _planar_values(values: jax.Array, shape: tuple[int, int, int], unit: int, half_bits: bool) -> jax.Array:
    """K-order packed codes ``uint8 [E, N, K/2]`` in :func:`to_planar`'s order."""
    e, n, k = shape
    codes = numerics.unpack_nibbles(values).reshape(e, n, k // unit, unit)
    values = numerics.pack_nibbles(codes[..., planar_columns(unit)].reshape(e, n, k))
    return _regroup_half_bits(values, True) if half_bits else values


def to_k_order(weight: QuantizedWeight) -> QuantizedWeight:
    """The inverse of :func:`to_planar`.

    Args:
        weight: a :class:`QuantizedWeight`, planar or not.

    Returns:
        The weight with its codes in column (K) order and its scales ``[E, N, K/g]``.
    """
    _check_weight(weight, "to_k_order")
    weight = with_scale_order(weight, False)
    if not weight.nibble_unit:
        return weight
    values = _k_order_values(weight.values, weight.shape, weight.nibble_unit, weight.half_bits)
    return dataclasses.replace(weight, values=values, nibble_unit=0, half_bits=False)


@functools.partial(jax.jit, static_argnames=("shape", "unit", "half_bits"))
def _k_order_values(values: jax.Array, shape: tuple[int, int, int], unit: int, half_bits: bool) -> jax.Array:
    """Planar packed codes back in K order (:func:`to_k_order`)."""
    return numerics.pack_nibbles(_codes_of(values, shape, unit, half_bits))


def _along_k(per_group: jax.Array, weight: QuantizedWeight) -> jax.Array:
    """A ``[E, N(or blocks), G]`` per-group array expanded to ``[E, N, K]``."""
    if weight.group_index is None:
        return numerics.block_broadcast(per_group, weight.shape)
    rows = numerics.block_broadcast(per_group, (weight.shape[0], weight.shape[1], per_group.shape[2]))
    return jnp.take_along_axis(rows, jnp.broadcast_to(weight.group_index[:, None, :], weight.shape), axis=2)


def decode_zero_point(weight: QuantizedWeight) -> jax.Array | None:
    """Zero points as float32 ``[E, N, G]``, or None."""
    fmt = weight.format
    if fmt.zero_point == ZeroPoint.NONE:
        return None
    if fmt.zero_point == ZeroPoint.INT:
        groups = weight.k // fmt.group_size
        return numerics.unpack_nibbles(weight.zero_point)[..., :groups].astype(jnp.float32)
    return weight.zero_point.astype(jnp.float32)


def dequantize_weight(weight: QuantizedWeight, dtype=jnp.float32, stored_rows: bool = False) -> jax.Array:
    """Dequantize: ``(value − zero) · scale · second_scale``.

    Args:
        weight: a :class:`QuantizedWeight` (any order).
        dtype: the output dtype (default float32).
        stored_rows: rows in the order they are stored (a w13 interleaved by
            :func:`interleave_gate_up` as the GEMM reads it) instead of the
            logical order (gate rows, then up rows).

    Returns:
        ``[E, N, K]`` in ``dtype``.
    """
    _check_weight(weight, "dequantize_weight")
    values = _dequantized(weight, jnp.dtype(dtype))
    if weight.gate_up_block and not stored_rows:
        return jnp.take(values, jnp.asarray(np.argsort(gate_up_rows(weight.n, weight.gate_up_block))), axis=1)
    return values


@functools.partial(jax.jit, static_argnames="dtype")
def _dequantized(weight: QuantizedWeight, dtype) -> jax.Array:
    """:func:`dequantize_weight`, one compiled program a format and shape."""
    fmt = weight.format
    values = decode_values(weight)
    if not fmt.is_quantized:
        return values.astype(dtype)
    zero = decode_zero_point(weight)
    if zero is not None:
        values = values - _along_k(zero, weight)
    scale = _decode_scale(n_major_scale(weight), fmt)
    out = values * (
        _along_k(scale, weight)
        if fmt.scale_granularity == ScaleGranularity.GROUP
        else numerics.block_broadcast(scale, values.shape, weight.scale_blocks)
    )
    if weight.second_scale is not None:
        second = weight.second_scale.astype(jnp.float32)
        out = out * (second.reshape(-1, 1, 1) if second.shape[0] == weight.num_experts else second[0])
    return out.astype(dtype)


# ---------------------------------------------------------------------------
# gate and up rows of w13 interleaved by blocks
# ---------------------------------------------------------------------------

# The block w13's gate and up rows are interleaved in (to_kernel_order): a Mosaic
# warpgroup's 128 rows hold 64 outputs' gate and up sums (in a swapped tile a
# thread holds rows r and r + 64); a 64-column Triton tile reads half a pair. Every
# format: block scales of more rows (fp8_block128) are stored one a 64-row block
# (QuantizedWeight.scale_blocks).
GATE_UP_BLOCK = 64


def gate_up_block_refusal(fmt: WeightFormat, n: int, block: int) -> str | None:
    """Why an ``[E, n, K]`` weight in ``fmt`` cannot store its gate and up rows
    interleaved by blocks of ``block`` (None if it can)."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        return f"expected a positive int, got {block!r}"
    if n % (2 * block):
        return f"N={n} is not a whole number of gate/up pairs of {block}-row blocks"
    blocks = fmt.scale_blocks()
    if blocks is not None and block % blocks[1] and blocks[1] % block:
        return (
            f"format {fmt.name!r} scales blocks of {blocks[1]} rows: gate/up blocks of {block} "
            "neither hold whole scale blocks nor divide them"
        )
    return None


def gate_up_rows(n: int, block: int) -> np.ndarray:
    """Row r of the interleaved order holds row ``gate_up_rows(n, block)[r]`` of
    gate-then-up rows: ``[g_0..g_{c-1}, u_0..u_{c-1}, g_c, ...]`` (c = ``block``)."""
    r = np.arange(n)
    pair, within = r // (2 * block), r % (2 * block)
    return np.where(within < block, pair * block + within, n // 2 + pair * block + within - block)


def _rows_reordered(weight: QuantizedWeight, rows: np.ndarray, gate_up_block: int) -> QuantizedWeight:
    """``weight`` with its rows (values, N-indexed scales, zero points, bias) in the order ``rows``."""
    fmt = weight.format
    take = functools.partial(jnp.take, indices=jnp.asarray(rows))
    out = dataclasses.replace(
        weight,
        values=take(weight.values, axis=1),
        zero_point=None if weight.zero_point is None else take(weight.zero_point, axis=1),
        bias=None if weight.bias is None else take(weight.bias, axis=1),
        gate_up_block=gate_up_block,
    )
    scale = weight.scale
    if scale is not None and fmt.scale_granularity in (ScaleGranularity.CHANNEL, ScaleGranularity.GROUP):
        scale = take(scale, axis=2 if weight.k_major_scales else 1)
    elif scale is not None and fmt.scale_granularity == ScaleGranularity.BLOCK:
        # Blocks of the finer of the two stored heights (each block of either order is
        # whole in them), reordered, then one scale a block of the new order's height.
        old, new = weight.scale_blocks[1], out.scale_blocks[1]
        fine = min(old, new)
        scale = jnp.repeat(scale, old // fine, axis=1)[:, : -(-weight.n // fine)]
        scale = jnp.take(scale, jnp.asarray(rows[::fine] // fine), axis=1)[:, :: new // fine]
    return dataclasses.replace(out, scale=scale)


def interleave_gate_up(weight: QuantizedWeight, block: int = GATE_UP_BLOCK) -> QuantizedWeight:
    """A gated w13 (gate rows, then up rows) with its rows interleaved by
    blocks of ``block``: ``[g_0..g_{c-1}, u_0..u_{c-1}, g_c, ...]`` — the same
    values, so that a GEMM tile of ``2·block`` columns holds both halves of
    ``block`` outputs and applies the activation in its epilogue.

    Args:
        weight: ``[E, 2I, K]`` in gate/up halves (``gate_up_block`` 0).
        block: rows a block (a multiple or a divisor of the format's row blocks
            of scales; with a divisor each block stores its scale block's scales).

    Returns:
        The weight with ``gate_up_block=block``; one already interleaved by
        ``block`` as it is.

    Raises:
        ValueError: the weight is interleaved by another block, or the format
            or N cannot be cut into blocks of ``block``.
    """
    _check_weight(weight, "interleave_gate_up")
    if weight.gate_up_block == block:
        return weight
    if weight.gate_up_block:
        raise ValueError(
            f"weight.gate_up_block: interleaved by {weight.gate_up_block} already (gate_up_halves first), asked {block}"
        )
    reason = gate_up_block_refusal(weight.format, weight.n, block)
    if reason:
        raise ValueError(f"interleave_gate_up: block: {reason}")
    return _rows_reordered(weight, gate_up_rows(weight.n, block), block)


def gate_up_halves(weight: QuantizedWeight) -> QuantizedWeight:
    """The inverse of :func:`interleave_gate_up`.

    Args:
        weight: a w13 interleaved by blocks (``gate_up_block`` > 0), or not.

    Returns:
        The weight with its gate rows, then its up rows (``gate_up_block`` 0);
        one in halves as it is.
    """
    _check_weight(weight, "gate_up_halves")
    if not weight.gate_up_block:
        return weight
    return _rows_reordered(weight, np.argsort(gate_up_rows(weight.n, weight.gate_up_block)), 0)
