"""Static configuration, kept apart as Humming does: the *layer* (shapes,
quantization, dtypes) and the *compute* (layout, accumulation, batch
invariance); the tiling is each kernel's own (``pallas_kernels``) and the
tuning table's (``humming_jax.tuning``). All frozen, hashable and validated on
construction; a bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import numbers

from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax.activations import ActivationSpec, get_activation

COMPUTE_DTYPES = ("bfloat16", "float16")


def _spec_key(spec: Q.InputQuantSpec):
    return (spec.mode, spec.dtype, spec.group_size, spec.scale_type)


_FP8_TOKEN = (Q.FP8_DYNAMIC_TOKEN, Q.FP8_E5M2_DYNAMIC_TOKEN)
_WNA16 = (Q.NONE, *_FP8_TOKEN, Q.INT8_DYNAMIC_TOKEN)


def supported_input_specs(fmt: F.WeightFormat) -> tuple[Q.InputQuantSpec, ...]:
    """The input quantizations weights in ``fmt`` take (the weight/activation
    pairs Humming runs; vLLM's supported list).

    Args:
        fmt: a :class:`WeightFormat` or a preset's name.

    Returns:
        A tuple of :class:`InputQuantSpec`, ``NONE`` first.
    """
    vt, gran = fmt.value_type, fmt.scale_granularity
    if not fmt.is_quantized:
        return (Q.NONE,)
    if vt in (F.ValueType.INT4, F.ValueType.UINT4, F.ValueType.INT8):
        return _WNA16
    if vt == F.ValueType.FLOAT8_E4M3:
        if fmt.scale_type == F.ScaleType.E8M0:  # MXFP8
            return (Q.NONE, *_FP8_TOKEN, Q.MXFP8_DYNAMIC)
        if gran == F.ScaleGranularity.BLOCK:
            return (Q.NONE, *_FP8_TOKEN, Q.FP8_DYNAMIC_GROUP128)
        return (Q.NONE, *_FP8_TOKEN, Q.FP8_STATIC_TENSOR, Q.FP8_DYNAMIC_GROUP128)
    if fmt.scale_type == F.ScaleType.E8M0:  # MXFP4
        return (Q.NONE, *_FP8_TOKEN, Q.FP8_DYNAMIC_GROUP128, Q.MXFP8_DYNAMIC, Q.MXFP4_DYNAMIC)
    return (Q.NONE, *_FP8_TOKEN, Q.NVFP4_DYNAMIC, Q.NVFP4_DYNAMIC_TOKEN)  # NVFP4


def check_supported(fmt: F.WeightFormat, spec: Q.InputQuantSpec, argument: str = "input_quant") -> None:
    """Check that weights in ``fmt`` take inputs quantized by ``spec``.

    Args:
        fmt: a :class:`WeightFormat` or a preset's name.
        spec: an :class:`InputQuantSpec` or its name.
        argument: the caller's argument name, for the message.

    Raises:
        ValueError: the pair is not supported, naming what ``fmt`` takes.
    """
    supported = supported_input_specs(fmt)
    if _spec_key(spec) not in {_spec_key(s) for s in supported}:
        raise ValueError(
            f"{argument}: {spec.name!r} is not supported with weight format {fmt.name!r}; "
            f"supported: {', '.join(s.name for s in supported)}"
        )


def is_count(value, least: int = 0) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``least``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def _positive_int(value, field: str, owner: str, allow_zero: bool = False) -> None:
    if not is_count(value, 0 if allow_zero else 1):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{owner}.{field}: expected a {kind} int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """One expert GEMM: ``num_experts`` weights ``[shape_n, shape_k]`` (vLLM's convention).

    Attributes:
        shape_n: N as stored (padded).
        shape_k: K as stored (padded).
        num_experts: E.
        weight_format: the :class:`WeightFormat`.
        input_quant: the input's :class:`InputQuantSpec`.
        compute_dtype: the dtype of unquantized inputs.
        pad_shape_n: padding of N (the real N is ``shape_n − pad_shape_n``).
        pad_shape_k: padding of K.
        hadamard_block_size: the input's rotation block, None: none.
    """

    shape_n: int
    shape_k: int
    num_experts: int
    weight_format: F.WeightFormat = F.BF16
    input_quant: Q.InputQuantSpec = Q.NONE
    compute_dtype: str = "bfloat16"
    pad_shape_n: int = 0
    pad_shape_k: int = 0
    hadamard_block_size: int | None = None

    def __post_init__(self):
        owner = "LayerConfig"
        object.__setattr__(self, "weight_format", F.get_format(self.weight_format))
        object.__setattr__(self, "input_quant", Q.get_input_spec(self.input_quant))
        for name in ("shape_n", "shape_k", "num_experts"):
            _positive_int(getattr(self, name), name, owner)
        for name, full in (("pad_shape_n", self.shape_n), ("pad_shape_k", self.shape_k)):
            _positive_int(getattr(self, name), name, owner, allow_zero=True)
            if getattr(self, name) >= full:
                raise ValueError(f"{owner}.{name}: padding {getattr(self, name)} must be below the size {full}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{owner}.compute_dtype: expected one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        self.weight_format.check_shape(self.shape_n, self.shape_k, f"{owner}.shape_k")
        check_supported(self.weight_format, self.input_quant, f"{owner}.input_quant")
        self.input_quant.check_k(self.shape_k, f"{owner}.shape_k")
        Q.check_hadamard_block_size(self.hadamard_block_size, self.shape_k, f"{owner}.hadamard_block_size")

    @property
    def real_n(self) -> int:
        return self.shape_n - self.pad_shape_n

    @property
    def real_k(self) -> int:
        return self.shape_k - self.pad_shape_k


class GemmLayout(enum.StrEnum):
    """The row layouts of an expert GEMM (the classes of :mod:`humming_jax.layouts`).

    Attributes:
        GROUPED_CONTIGUOUS: each expert's rows contiguous, by offsets.
        GROUPED_MASKED: ``[E, max_tokens]`` rows with a count per expert.
        INDEXED: rows read and written by index, in aligned blocks of one expert.
        DENSE: one weight, every row.
    """

    GROUPED_CONTIGUOUS = "grouped_contiguous"
    GROUPED_MASKED = "grouped_masked"
    INDEXED = "indexed"
    DENSE = "dense"


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How a GEMM computes.

    Attributes:
        layout: the :class:`GemmLayout`.
        use_f16_accum: accumulate in f16 (f16 compute only).
        batch_invariant: a row's result never depends on the other rows or their
            number (one tiling for every batch, no split-K).
    """

    layout: GemmLayout = GemmLayout.GROUPED_CONTIGUOUS
    use_f16_accum: bool = False
    batch_invariant: bool = False

    def __post_init__(self):
        try:
            object.__setattr__(self, "layout", GemmLayout(self.layout))
        except ValueError:
            allowed = ", ".join(repr(g.value) for g in GemmLayout)
            raise ValueError(f"ComputeConfig.layout: got {self.layout!r}, expected one of {allowed}") from None
        for name in ("use_f16_accum", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ComputeConfig.{name}: expected a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """The static config of an expert layer: w13 (gate+up, ``[E, 2I, H]``, or
    ``[E, I, H]`` for ``*_no_mul``) and w2 (down, ``[E, H, I]``). Frozen and
    hashable: a static argument of the pipelines.

    Attributes:
        num_experts: E, the local experts the weights hold.
        hidden_size: H.
        intermediate_size: I.
        top_k: k, the slots per token.
        activation: an :class:`ActivationSpec` (or its name).
        weight_format: w13's :class:`WeightFormat` (or a preset's name).
        input_quant: w13's input :class:`InputQuantSpec` (or its name).
        w2_weight_format: w2's format; None: ``weight_format``.
        w2_input_quant: w2's input quantization; None: ``input_quant``.
        compute_dtype: the dtype of unquantized GEMM inputs (``"bfloat16"``, ``"float16"``).
        global_num_experts: the range of router ids; None: ``num_experts``.
        hadamard_block_size: rotate w13's input (and weights) in blocks; None: none.
        w2_hadamard_block_size: the same for w2.
        use_f16_accum: f16 accumulation in the GEMMs (f16 compute).
        batch_invariant: a token's output never depends on the batch.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    activation: ActivationSpec = ActivationSpec()
    weight_format: F.WeightFormat = F.BF16
    input_quant: Q.InputQuantSpec = Q.NONE
    w2_weight_format: F.WeightFormat | None = None
    w2_input_quant: Q.InputQuantSpec | None = None
    compute_dtype: str = "bfloat16"
    global_num_experts: int | None = None
    hadamard_block_size: int | None = None
    w2_hadamard_block_size: int | None = None
    use_f16_accum: bool = False
    batch_invariant: bool = False

    def __post_init__(self):
        owner = "ExpertsConfig"
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k"):
            _positive_int(getattr(self, name), name, owner)
        object.__setattr__(self, "activation", get_activation(self.activation))
        object.__setattr__(self, "weight_format", F.get_format(self.weight_format))
        object.__setattr__(self, "input_quant", Q.get_input_spec(self.input_quant))
        if self.w2_weight_format is None:
            object.__setattr__(self, "w2_weight_format", self.weight_format)
        object.__setattr__(self, "w2_weight_format", F.get_format(self.w2_weight_format))
        if self.w2_input_quant is None:
            object.__setattr__(self, "w2_input_quant", self.input_quant)
        object.__setattr__(self, "w2_input_quant", Q.get_input_spec(self.w2_input_quant))
        if self.global_num_experts is None:
            object.__setattr__(self, "global_num_experts", self.num_experts)
        _positive_int(self.global_num_experts, "global_num_experts", owner)
        if self.global_num_experts < self.num_experts:
            raise ValueError(
                f"{owner}.global_num_experts: {self.global_num_experts} is below num_experts={self.num_experts}"
            )
        if self.top_k > self.global_num_experts:
            raise ValueError(
                f"{owner}.top_k: {self.top_k} experts a token, more than there are "
                f"(global_num_experts={self.global_num_experts})"
            )
        if self.use_f16_accum and self.compute_dtype != "float16":
            raise ValueError(f"{owner}.use_f16_accum: f16 accumulation needs compute_dtype 'float16'")
        # Building both layer configs validates shapes, formats and modes.
        self.w13, self.w2  # noqa: B018

    def __hash__(self) -> int:
        # A jitted layer hashes its static config on every call: the nested
        # formats' hashes once, not each time (the generated hash, cached).
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, field.name) for field in dataclasses.fields(self)))

    def __getstate__(self) -> dict:
        # String hashes differ between processes: a pickled config hashes anew where it lands.
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    @property
    def w13_n(self) -> int:
        return 2 * self.intermediate_size if self.activation.is_gated else self.intermediate_size

    @functools.cached_property  # built once (a frozen config; the modules read it every call)
    def w13(self) -> LayerConfig:
        return LayerConfig(
            self.w13_n,
            self.hidden_size,
            self.num_experts,
            self.weight_format,
            self.input_quant,
            self.compute_dtype,
            hadamard_block_size=self.hadamard_block_size,
        )

    @functools.cached_property
    def w2(self) -> LayerConfig:
        return LayerConfig(
            self.hidden_size,
            self.intermediate_size,
            self.num_experts,
            self.w2_weight_format,
            self.w2_input_quant,
            self.compute_dtype,
            hadamard_block_size=self.w2_hadamard_block_size,
        )

    def compute(self, layout: GemmLayout | str) -> ComputeConfig:
        return ComputeConfig(GemmLayout(layout), self.use_f16_accum, self.batch_invariant)
