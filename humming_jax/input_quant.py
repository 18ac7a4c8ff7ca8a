"""Activation (input) quantization and the Hadamard rotation.

An :class:`InputQuantSpec` says how a GEMM input is quantized (mode, dtype,
group size, scale dtype); ``x ≈ q * scale * scale_2``. Scales come from the
absolute maximum; values are rounded to nearest (ties to even) and saturated.
A zero block gets scale 0 (e8m0: byte 0) and zero values, never NaN or Inf; a
block holding a NaN gets a NaN scale (e8m0: byte 255), so that token's output
is NaN and no other's (every backend alike).
float4 e2m1 values are packed two per byte along K (:mod:`numerics`). The
shapes of ``scale`` and ``scale_2`` per mode: docs/DESIGN.md, appendix A.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np

from humming_jax import numerics


class InputQuantMode(enum.StrEnum):
    """Where an input's scales come from.

    Attributes:
        NONE: unquantized.
        STATIC_TENSOR: one f32 scale given ahead (per tensor).
        DYNAMIC_TOKEN: one scale per row, from its amax.
        DYNAMIC_GROUP: one scale per group of columns of a row (fp8 g128, MX).
        STATIC_TENSOR_DYNAMIC_GROUP: group scales under a static tensor scale.
        DYNAMIC_GROUP_TOKEN: group scales and a second f32 scale per row (NVFP4 per token).
    """

    NONE = "none"
    STATIC_TENSOR = "static_tensor"
    DYNAMIC_TOKEN = "dynamic_token"
    DYNAMIC_GROUP = "dynamic_group"
    STATIC_TENSOR_DYNAMIC_GROUP = "static_tensor_dynamic_group"
    DYNAMIC_GROUP_TOKEN = "dynamic_group_token"

    @property
    def has_group_scale(self) -> bool:
        return self in (
            InputQuantMode.DYNAMIC_GROUP,
            InputQuantMode.STATIC_TENSOR_DYNAMIC_GROUP,
            InputQuantMode.DYNAMIC_GROUP_TOKEN,
        )

    @property
    def has_secondary_scale(self) -> bool:
        return self in (InputQuantMode.STATIC_TENSOR_DYNAMIC_GROUP, InputQuantMode.DYNAMIC_GROUP_TOKEN)

    @property
    def is_static(self) -> bool:
        return self in (InputQuantMode.STATIC_TENSOR, InputQuantMode.STATIC_TENSOR_DYNAMIC_GROUP)


class ActivationDType(enum.StrEnum):
    FLOAT8_E4M3 = "float8_e4m3"
    FLOAT8_E5M2 = "float8_e5m2"
    INT8 = "int8"
    FLOAT4_E2M1 = "float4_e2m1"

    @property
    def max_value(self) -> float:
        return {
            "float8_e4m3": numerics.FLOAT8_E4M3_MAX,
            "float8_e5m2": numerics.FLOAT8_E5M2_MAX,
            "int8": numerics.INT8_MAX,
            "float4_e2m1": numerics.FLOAT4_E2M1_MAX,
        }[self.value]

    @property
    def storage_dtype(self):
        return {
            "float8_e4m3": jnp.float8_e4m3fn,
            "float8_e5m2": jnp.float8_e5m2,
            "int8": jnp.int8,
            "float4_e2m1": jnp.uint8,
        }[self.value]

    @property
    def bits(self) -> int:
        return 4 if self == ActivationDType.FLOAT4_E2M1 else 8


class InputScaleType(enum.StrEnum):
    FLOAT32 = "float32"
    E8M0 = "e8m0"
    FLOAT8_E4M3 = "float8_e4m3"


@dataclasses.dataclass(frozen=True)
class InputQuantSpec:
    """How a GEMM input is quantized (Humming's input schema). Frozen and
    hashable (static under jit); the presets are in ``INPUT_PRESETS``
    (:func:`get_input_spec`).

    Attributes:
        mode: the :class:`InputQuantMode`.
        dtype: the quantized value type (e4m3, e5m2, int8, e2m1), None for ``none``.
        group_size: columns a group scale covers (group modes).
        scale_type: f32, e8m0 or e4m3.
        name: the preset's name.
    """

    mode: InputQuantMode = InputQuantMode.NONE
    dtype: ActivationDType | None = None
    group_size: int = 0
    scale_type: InputScaleType = InputScaleType.FLOAT32
    name: str = ""

    def __post_init__(self):
        def coerce(enum_type, value, field):
            try:
                return enum_type(value)
            except ValueError:
                allowed = ", ".join(repr(m.value) for m in enum_type)
                raise ValueError(f"InputQuantSpec.{field}: got {value!r}, expected one of {allowed}") from None

        object.__setattr__(self, "mode", coerce(InputQuantMode, self.mode, "mode"))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", coerce(ActivationDType, self.dtype, "dtype"))
        object.__setattr__(self, "scale_type", coerce(InputScaleType, self.scale_type, "scale_type"))
        self._validate()
        if not self.name:
            object.__setattr__(self, "name", self._default_name())

    def _default_name(self) -> str:
        if self.mode == InputQuantMode.NONE:
            return "none"
        group = f"_g{self.group_size}" if self.group_size else ""
        return f"{self.dtype.value}_{self.mode.value}{group}_{self.scale_type.value}"

    def _validate(self) -> None:
        mode = self.mode
        if mode == InputQuantMode.NONE:
            if self.dtype is not None or self.group_size:
                raise ValueError("InputQuantSpec: mode 'none' takes no dtype and no group_size")
            return
        if self.dtype is None:
            raise ValueError(f"InputQuantSpec.dtype: mode {mode.value!r} needs an activation dtype")
        if mode.has_group_scale:
            if self.group_size <= 0 or self.group_size & (self.group_size - 1):
                raise ValueError(
                    f"InputQuantSpec.group_size: mode {mode.value!r} needs a power-of-two group, got {self.group_size}"
                )
        elif self.group_size:
            raise ValueError(f"InputQuantSpec.group_size: mode {mode.value!r} has no groups, got {self.group_size}")
        if mode.has_secondary_scale and self.scale_type != InputScaleType.FLOAT8_E4M3:
            raise ValueError(
                f"InputQuantSpec.scale_type: mode {mode.value!r} stores e4m3 group scales under an f32 "
                "second scale; use 'float8_e4m3'"
            )
        if not mode.has_group_scale and self.scale_type != InputScaleType.FLOAT32:
            raise ValueError(f"InputQuantSpec.scale_type: mode {mode.value!r} uses f32 scales")
        if self.scale_type != InputScaleType.FLOAT32 and self.dtype == ActivationDType.INT8:
            raise ValueError("InputQuantSpec.scale_type: int8 activations take f32 scales")
        if self.dtype == ActivationDType.FLOAT4_E2M1 and not mode.has_group_scale:
            raise ValueError(
                "InputQuantSpec.mode: float4_e2m1 activations need group scales "
                "('dynamic_group', 'static_tensor_dynamic_group' or 'dynamic_group_token')"
            )

    @property
    def is_quantized(self) -> bool:
        return self.mode != InputQuantMode.NONE

    @property
    def packs_k(self) -> int:
        return 2 if self.dtype == ActivationDType.FLOAT4_E2M1 else 1

    def scale_shape(self, m: int, k: int) -> tuple[int, int] | None:
        if self.mode == InputQuantMode.NONE:
            return None
        if self.mode == InputQuantMode.STATIC_TENSOR:
            return (1,)
        if self.mode == InputQuantMode.DYNAMIC_TOKEN:
            return (m, 1)
        return (m, k // self.group_size)

    def scale_2_shape(self, m: int) -> tuple[int, ...] | None:
        if self.mode == InputQuantMode.STATIC_TENSOR_DYNAMIC_GROUP:
            return (1,)
        if self.mode == InputQuantMode.DYNAMIC_GROUP_TOKEN:
            return (m, 1)
        return None

    @property
    def scale_dtype(self):
        return {
            InputScaleType.FLOAT32: jnp.float32,
            InputScaleType.E8M0: jnp.uint8,
            InputScaleType.FLOAT8_E4M3: jnp.float8_e4m3fn,
        }[self.scale_type]

    def check_k(self, k: int, argument: str = "x") -> None:
        if self.packs_k == 2 and k % 2:
            raise ValueError(f"{argument}: {self.name} packs two 4-bit values per byte, so K must be even; got {k}")
        if self.mode.has_group_scale and k % self.group_size:
            raise ValueError(f"{argument}: {self.name} has groups of {self.group_size}; K={k} is not a multiple")


NONE = InputQuantSpec()
FP8_STATIC_TENSOR = InputQuantSpec("static_tensor", "float8_e4m3", name="fp8_static_tensor")
FP8_DYNAMIC_TOKEN = InputQuantSpec("dynamic_token", "float8_e4m3", name="fp8_dynamic_token")
FP8_E5M2_DYNAMIC_TOKEN = InputQuantSpec("dynamic_token", "float8_e5m2", name="fp8_e5m2_dynamic_token")
FP8_DYNAMIC_GROUP128 = InputQuantSpec("dynamic_group", "float8_e4m3", 128, name="fp8_dynamic_group128")
INT8_STATIC_TENSOR = InputQuantSpec("static_tensor", "int8", name="int8_static_tensor")
INT8_DYNAMIC_TOKEN = InputQuantSpec("dynamic_token", "int8", name="int8_dynamic_token")
MXFP8_DYNAMIC = InputQuantSpec("dynamic_group", "float8_e4m3", 32, "e8m0", name="mxfp8_dynamic")
MXFP4_DYNAMIC = InputQuantSpec("dynamic_group", "float4_e2m1", 32, "e8m0", name="mxfp4_dynamic")
NVFP4_DYNAMIC = InputQuantSpec("static_tensor_dynamic_group", "float4_e2m1", 16, "float8_e4m3", name="nvfp4_dynamic")
NVFP4_DYNAMIC_TOKEN = InputQuantSpec(
    "dynamic_group_token", "float4_e2m1", 16, "float8_e4m3", name="nvfp4_dynamic_token"
)

INPUT_PRESETS: dict[str, InputQuantSpec] = {
    s.name: s
    for s in (
        NONE,
        FP8_STATIC_TENSOR,
        FP8_DYNAMIC_TOKEN,
        FP8_E5M2_DYNAMIC_TOKEN,
        FP8_DYNAMIC_GROUP128,
        INT8_STATIC_TENSOR,
        INT8_DYNAMIC_TOKEN,
        MXFP8_DYNAMIC,
        MXFP4_DYNAMIC,
        NVFP4_DYNAMIC,
        NVFP4_DYNAMIC_TOKEN,
    )
}


def get_input_spec(spec: str | InputQuantSpec | None) -> InputQuantSpec:
    """Look an input quantization up by name.

    Args:
        spec: a preset's name (``"fp8_dynamic_group128"``), a spec, or None.

    Returns:
        The :class:`InputQuantSpec` (``NONE`` for None).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if spec is None:
        return NONE
    if isinstance(spec, InputQuantSpec):
        return spec
    if spec not in INPUT_PRESETS:
        raise ValueError(f"input quantization: unknown name {spec!r}; known: {', '.join(INPUT_PRESETS)}")
    return INPUT_PRESETS[spec]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedInput:
    """A quantized GEMM input (a pytree).

    Attributes:
        values: ``[M, K]`` (``[M, K/2]`` bytes for fp4), or the unquantized rows.
        scale: per tensor ``[1]``, per row ``[M, 1]`` or per group ``[M, K/g]``; None unquantized.
        scale_2: NVFP4's second f32 scale (per tensor or per row), else None.
        spec: the :class:`InputQuantSpec` (static).
        k: the logical K (static).
    """

    values: jax.Array
    scale: jax.Array | None = None
    scale_2: jax.Array | None = None
    spec: InputQuantSpec = dataclasses.field(default=NONE, metadata=dict(static=True))
    k: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def m(self) -> int:
        return self.values.shape[0]


# ---------------------------------------------------------------------------
# Hadamard rotation
# ---------------------------------------------------------------------------

MAX_HADAMARD_BLOCK = 512


def check_hadamard_block_size(block_size: int | None, k: int | None = None, argument: str = "hadamard_block_size"):
    if block_size is None:
        return
    if not isinstance(block_size, int) or block_size < 2 or block_size & (block_size - 1) or block_size > 512:
        raise ValueError(f"{argument}: expected a power of two in [2, {MAX_HADAMARD_BLOCK}], got {block_size!r}")
    if k is not None and k % block_size:
        raise ValueError(f"{argument}: K={k} is not a multiple of the Hadamard block {block_size}")


@functools.cache
def hadamard_matrix(n: int) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix ``H_n / sqrt(n)`` (symmetric, orthogonal)."""
    check_hadamard_block_size(n, argument="hadamard_matrix: n")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def hadamard_rotate(x: jax.Array, block_size: int) -> jax.Array:
    """Rotate the last axis by ``H_b / sqrt(b)`` in independent blocks, in f32.
    A weight stored as ``hadamard_rotate(w, b)`` gives ``rot(x) @ rot(w).T == x @ w.T``.

    Args:
        x: ``[..., K]``, K a multiple of ``block_size``.
        block_size: b, a power of two.

    Returns:
        float32 ``[..., K]``.
    """
    k = x.shape[-1]
    check_hadamard_block_size(block_size, k)
    h = jnp.asarray(hadamard_matrix(block_size))
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], k // block_size, block_size)
    rotated = jnp.einsum("...b,bc->...c", blocks, h, precision=jax.lax.Precision.HIGHEST)
    return rotated.reshape(x.shape)


# ---------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------


def _encode_values(scaled: jax.Array, dtype: ActivationDType) -> jax.Array:
    if dtype == ActivationDType.INT8:
        return jnp.clip(numerics.round_half_even(scaled), -127, 127).astype(jnp.int8)
    if dtype == ActivationDType.FLOAT4_E2M1:
        return numerics.pack_nibbles(numerics.e2m1_encode(scaled))
    return numerics.cast_float8_saturating(scaled, dtype.storage_dtype)


def _decode_values(values: jax.Array, dtype: ActivationDType) -> jax.Array:
    if dtype == ActivationDType.FLOAT4_E2M1:
        return numerics.e2m1_decode(numerics.unpack_nibbles(values))
    return values.astype(jnp.float32)


def decode_group_scale(scale: jax.Array, spec: InputQuantSpec) -> jax.Array:
    if spec.scale_type == InputScaleType.E8M0:
        return numerics.e8m0_decode(scale)
    return scale.astype(jnp.float32)


def _group_amax(x: jax.Array, group_size: int) -> jax.Array:
    m, k = x.shape
    return jnp.abs(x).reshape(m, k // group_size, group_size).max(axis=-1)


def quantize_input(
    x: jax.Array,
    spec: InputQuantSpec | str,
    *,
    static_scale: jax.Array | None = None,
) -> QuantizedInput:
    """Quantize rows per ``spec`` (the ``jnp`` quantizer; :func:`process_input` is the kernel).

    Args:
        x: ``[M, K]``, any float dtype.
        spec: an :class:`InputQuantSpec` or its name.
        static_scale: f32 ``[1]`` or a scalar: the tensor scale of the static
            modes, required exactly for them.

    Returns:
        A :class:`QuantizedInput` (for ``none`` the values are ``x`` unchanged).
    """
    spec = get_input_spec(spec)
    if x.ndim != 2:
        raise ValueError(f"quantize_input: x must be [M, K], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize_input: x must be float activations, got {x.dtype}")
    m, k = x.shape
    mode = spec.mode
    if mode.is_static != (static_scale is not None):
        need = "needs" if mode.is_static else "takes no"
        raise ValueError(f"quantize_input: static_scale: mode {mode.value!r} {need} a static tensor scale")
    if mode == InputQuantMode.NONE:
        return QuantizedInput(values=x, spec=spec, k=k)
    spec.check_k(k, "quantize_input: x")
    values, scale, scale_2 = _quantized_parts(x, None if static_scale is None else jnp.asarray(static_scale), spec)
    return QuantizedInput(values=values, scale=scale, scale_2=scale_2, spec=spec, k=k)


@functools.partial(jax.jit, static_argnames="spec")
def _quantized_parts(x: jax.Array, static_scale: jax.Array | None, spec: InputQuantSpec):
    """(values, scale, scale_2) of :func:`quantize_input`: one compiled program a
    spec and shape (op by op, the correctly rounded divisions compile hundreds)."""
    mode = spec.mode
    x32 = x.astype(jnp.float32)
    qmax = spec.dtype.max_value
    scale_2 = None

    if mode == InputQuantMode.STATIC_TENSOR:
        scale = jnp.asarray(static_scale, jnp.float32).reshape(1)
        inverse = numerics.safe_reciprocal(scale.reshape(1, 1))
    elif mode == InputQuantMode.DYNAMIC_TOKEN:
        scale = numerics.divide_rn(jnp.abs(x32).max(axis=-1, keepdims=True), qmax)
        if spec.dtype in (ActivationDType.FLOAT8_E4M3, ActivationDType.FLOAT8_E5M2):  # vLLM's floor (NaN stays)
            scale = numerics.floor_fp8_token_scale(scale, qmax)
        inverse = numerics.safe_reciprocal(scale)
    else:
        amax = _group_amax(x32, spec.group_size)
        if mode == InputQuantMode.DYNAMIC_GROUP:
            if spec.scale_type == InputScaleType.E8M0:
                scale = numerics.e8m0_from_amax(amax, qmax)
            elif spec.scale_type == InputScaleType.FLOAT8_E4M3:
                scale = numerics.cast_float8_saturating(numerics.divide_rn(amax, qmax), jnp.float8_e4m3fn)
            else:
                scale = numerics.divide_rn(amax, qmax)
            group_scale = decode_group_scale(scale, spec)
        else:
            if mode == InputQuantMode.STATIC_TENSOR_DYNAMIC_GROUP:
                scale_2 = jnp.asarray(static_scale, jnp.float32).reshape(1)
                second = scale_2.reshape(1, 1)
            else:
                # Per-token second scale: the row amax lands on e4m3 max x element max.
                scale_2 = numerics.divide_rn(jnp.abs(x32).max(axis=-1, keepdims=True), numerics.FLOAT8_E4M3_MAX * qmax)
                second = scale_2
            scaled = numerics.divide_rn(amax, qmax) * numerics.safe_reciprocal(second)
            scale = numerics.cast_float8_saturating(scaled, jnp.float8_e4m3fn)
            group_scale = scale.astype(jnp.float32) * second
        # The barrier keeps XLA from fusing the long division into the repeat, once per element.
        inverse = jnp.repeat(jax.lax.optimization_barrier(numerics.safe_reciprocal(group_scale)), spec.group_size, -1)

    return _encode_values(x32 * inverse, spec.dtype), scale, scale_2


def dequantize_input(q: QuantizedInput) -> jax.Array:
    """Dequantize: ``values · scale · scale_2``.

    Args:
        q: a :class:`QuantizedInput`.

    Returns:
        float32 ``[M, K]``.
    """
    return _dequantized(q)


@jax.jit
def _dequantized(q: QuantizedInput) -> jax.Array:
    spec = q.spec
    if spec.mode == InputQuantMode.NONE:
        return q.values.astype(jnp.float32)
    values = _decode_values(q.values, spec.dtype)
    m, k = values.shape
    if spec.mode == InputQuantMode.STATIC_TENSOR:
        return values * q.scale.astype(jnp.float32).reshape(1, 1)
    if spec.mode == InputQuantMode.DYNAMIC_TOKEN:
        return values * q.scale.astype(jnp.float32).reshape(m, 1)
    group_scale = decode_group_scale(q.scale, spec)
    if q.scale_2 is not None:
        group_scale = group_scale * q.scale_2.astype(jnp.float32).reshape(-1, 1)
    return values * jnp.repeat(group_scale, spec.group_size, axis=-1)
