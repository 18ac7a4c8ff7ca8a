"""What every expert-GEMM kernel is told about a call: the weight, the layout
and the call itself (:class:`GemmCall`, which each kernel's ``supports``
answers), and the program order the kernels share."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """Static description of a quantized weight ``[E, N, K]`` (see humming_jax.formats)."""

    num_experts: int
    n: int
    k: int
    value_type: str  # bfloat16 float16 int8 int4 uint4 float8_e4m3 float4_e2m1
    scale: str = "none"  # none tensor channel group block
    scale_type: str | None = None  # float32 bfloat16 float16 e8m0 float8_e4m3
    group_size: int = 0
    block_n: int = 0
    zero_point: str = "none"  # none int float
    global_scale: str = "none"  # none tensor expert
    has_bias: bool = False
    has_group_index: bool = False  # act-order: column k uses group group_index[e, k]
    # Packed codes in K order (0) or in the planar order within units of this
    # many columns: nibble i of a unit holds column i // 4 + (unit / 4) * (i % 4).
    nibble_unit: int = 0
    # Planar e2m1 codes with each 16-bit half's bits in the pair decoder's
    # order (word_decode.E2M1_HALF_BITS): read as halves (pairs) only.
    half_bits: bool = False
    # Group scales stored [E, K/g, N] (the Mosaic kernels' TMA order), not [E, N, K/g].
    k_major_scales: bool = False

    @property
    def packed(self) -> bool:
        return self.value_type in ("int4", "uint4", "float4_e2m1")

    @property
    def quantized(self) -> bool:
        return self.value_type not in ("bfloat16", "float16")

    def dequantized(self, dtype) -> WeightSpec:
        """The spec of this weight after a dequantize pass to ``dtype`` (its bias kept)."""
        return WeightSpec(self.num_experts, self.n, self.k, jnp.dtype(dtype).name, has_bias=self.has_bias)


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    kind: str  # dense grouped_contiguous grouped_masked indexed
    m_in: int
    m_out: int
    top_k: int = 1
    num_blocks: int = 0  # indexed: len(expert_ids)
    block_size: int = 0  # indexed: rows of one alignment block
    max_tokens: int = 0  # grouped_masked
    # indexed: the slots no live block holds are all listed in dead blocks
    # (past num_tokens_padded or of expert -1), so the kernel zeroes every row
    # it must and needs no zero-filled output.
    lists_dropped: bool = False
    # indexed: block b holds slot b alone (routing's slot blocks): the kernel
    # takes the slot from the block's index and gets expert_ids alone.
    slot_order: bool = False
    # indexed, slot-ordered: 0, or the slots k of each of the at most block_size
    # tokens, when the kernel may tile the rows by expert (a row a token).
    tile_by_expert: int = 0

    @property
    def zero_filled(self) -> bool:
        """The caller passes a zeroed output that the kernel updates in place."""
        return self.kind == "indexed" and not self.lists_dropped


@dataclasses.dataclass(frozen=True)
class XScale:
    """How the values of a quantized input ``x [M, K]`` (stored as
    ``GemmCall.x_dtype``: float8_e4m3, float8_e5m2, int8, or a 16-bit float
    holding exact values) are scaled: ``x = values * scale``, the scale being
    one f32 for the tensor (``[1]``), one per row (``[M, 1]``) or one per row
    and group of ``group_size`` columns (``[M, K / group_size]``, f32 or e8m0
    bytes)."""

    mode: str = "none"  # none tensor token group
    scale_type: str = "float32"  # float32 e8m0
    group_size: int = 0


@dataclasses.dataclass(frozen=True)
class EpilogueActivation:
    """The activation a GEMM applies to its f32 sums before it stores them
    (``humming_jax.activations.ActivationSpec``'s fields): a gated kind reads
    gate and up in the weight's row order — SWIGLUOAI pairs, the others
    blocks of ``gate_up_block`` rows (0: halves, which no tile holds together)
    — and stores ``N / 2`` columns."""

    kind: str
    clamp_limit: float | None = None
    alpha: float = 1.702
    beta: float = 1.0
    gate_up_block: int = 0

    @property
    def gated(self) -> bool:
        return not self.kind.endswith("_no_mul")

    @property
    def pair_block(self) -> int:
        """Rows of one gate (then up) block in the weight: 1 for pairs, 0 for halves."""
        return 1 if self.kind == "swigluoai" else self.gate_up_block

    def out_n(self, n: int) -> int:
        """Output columns of a weight with ``n`` rows."""
        return n // 2 if self.gated else n


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """One GEMM call as a kernel's ``supports`` sees it. ``x_dtype`` is the
    stored input dtype; ``input_quant`` the name of its quantization ("none":
    a float input) and ``x_scale`` how the kernel scales its values;
    ``activation`` the activation the kernel applies to its sums (None: none)."""

    weight: WeightSpec
    layout: LayoutSpec
    x_dtype: str
    out_dtype: str
    input_quant: str = "none"
    x_scale: XScale = XScale()
    use_f16_accum: bool = False
    batch_invariant: bool = False
    interpret: bool = False
    activation: EpilogueActivation | None = None  # applied in the epilogue (gated: N/2 outputs)
    # The activated output quantized in the epilogue ("fp8_dynamic_group128": e4m3 values and an
    # f32 scale a row and 128 columns, w2's input), or "none".
    out_quant: str = "none"
    # With out_quant: the quantized values multiplied back by their scales, in out_dtype (the next
    # GEMM's input multiplied out) — the 16-bit kernels' form; the fp8 kernel stores e4m3 and scales.
    out_dequantized: bool = False

    def with_dequantized_input(self) -> GemmCall:
        """The call as a kernel sees it after its tiles' ``dequantize_input``
        (the op multiplies the input out first): bf16 inputs, no scale."""
        return dataclasses.replace(self, x_dtype="bfloat16", input_quant="none", x_scale=XScale())


def check_positive(tiles, names: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the first of ``names`` that is not a positive
    int on the frozen tile config ``tiles`` (``<module>.Tiles.<field>``)."""
    for name in names:
        value = getattr(tiles, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            kernel = type(tiles).__module__.rsplit(".", 1)[-1]
            raise ValueError(f"{kernel}.Tiles.{name}: expected a positive int, got {value!r}")


def tile_order(program, row_tiles: int, col_tiles: int, group_m: int):
    """(row tile, column tile) of a program. Programs run in bands of
    ``group_m`` row tiles; inside a band the row tile varies fastest, then the
    column tile. ``group_m = 1``: the programs running together share one row
    tile (and its expert), which stays in L2 (small experts). Larger bands keep
    a few row tiles and the weight columns they share in L2 together, so an
    expert's weight is read from memory about once, not once per row tile
    (experts with many rows and large weights). ``program`` >= 0 (truncating
    division)."""
    band = group_m * col_tiles
    first_row = jax.lax.div(program, band) * group_m
    rows_in_band = jnp.minimum(row_tiles - first_row, group_m)
    within = jax.lax.rem(program, band)
    return first_row + jax.lax.rem(within, rows_in_band), jax.lax.div(within, rows_in_band)
