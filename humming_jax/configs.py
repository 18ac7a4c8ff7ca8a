"""Static configuration, kept apart as Humming does: the *layer* (shapes,
quantization, dtypes), the *compute* (layout, accumulation, batch invariance)
and the *tuning* (tiles, warps, stages, split-K). All frozen, hashable and
validated on construction; a bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax.activations import ActivationSpec, get_activation

COMPUTE_DTYPES = ("bfloat16", "float16")


def _spec_key(spec: Q.InputQuantSpec):
    return (spec.mode, spec.dtype, spec.group_size, spec.scale_type)


_FP8_TOKEN = (Q.FP8_DYNAMIC_TOKEN, Q.FP8_E5M2_DYNAMIC_TOKEN)
_WNA16 = (Q.NONE, *_FP8_TOKEN, Q.INT8_DYNAMIC_TOKEN)


def supported_input_specs(fmt: F.WeightFormat) -> tuple[Q.InputQuantSpec, ...]:
    """Input quantizations a GEMM supports with weights in ``fmt`` (the
    weight/activation pairs Humming runs; see vLLM's supported list)."""
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
    """Raise ``ValueError`` if weights in ``fmt`` cannot take inputs quantized by ``spec``."""
    supported = supported_input_specs(fmt)
    if _spec_key(spec) not in {_spec_key(s) for s in supported}:
        raise ValueError(
            f"{argument}: {spec.name!r} is not supported with weight format {fmt.name!r}; "
            f"supported: {', '.join(s.name for s in supported)}"
        )


def _positive_int(value, field: str, owner: str, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{owner}.{field}: expected a {kind} int, got {value!r}")


def _power_of_two(value, field: str, owner: str) -> None:
    _positive_int(value, field, owner)
    if value & (value - 1):
        raise ValueError(f"{owner}.{field}: expected a power of two, got {value}")


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """One expert GEMM: ``num_experts`` weights ``[shape_n, shape_k]``.

    ``shape_n``/``shape_k`` are the stored (padded) sizes; the real sizes are
    ``shape_n - pad_shape_n`` and ``shape_k - pad_shape_k`` (vLLM's convention).
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
    GROUPED_CONTIGUOUS = "grouped_contiguous"
    GROUPED_MASKED = "grouped_masked"
    INDEXED = "indexed"
    DENSE = "dense"


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How a GEMM computes: its layout, f16 accumulation, batch invariance."""

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


# TuningConfig fields only the Mosaic GPU kernel reads (the Triton kernel's tiles
# mirror the others); a tiling that leaves that kernel takes their defaults.
MOSAIC_OPTIONS = ("stage_slots", "split_rows", "delay_release", "epilogue_slots", "cluster_n", "cluster_m")


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Kernel launch parameters. Tiles are powers of two (Triton's rule);
    ``block_m``/``block_n``/``block_k`` at least 16 (the smallest MMA), except
    ``block_m`` without MMAs (``use_mma=False``)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    swap_ab: bool = False  # compute out.T = w @ x.T (the weight tile is the MMA's A operand)
    group_m: int = 1  # row tiles per band of the program order: >1 keeps an expert's weight columns in L2
    # 4-bit weights read as uint32 words of 8 codes (spans of 128+); with mosaic, the
    # nibbles taken from the 32-bit registers that hold two codes (compiled only).
    word_decode: bool = False
    # Scales multiply the decoded weight tile before the product (one MMA chain per K
    # tile); integer formats then round (q - z) * s once to the compute dtype.
    fold_scales: bool = False
    # False: the products are f32 multiply-adds on the CUDA cores (a GEMV-like
    # path for row tiles of 1-8 rows, where a 16-row MMA would mostly multiply padding).
    use_mma: bool = True
    # Prefill: dequantize the whole weight to the compute dtype once (one pass over
    # it, transient memory E*N*K*2 bytes) and run the 16-bit product with these
    # tiles, instead of decoding each weight tile once per row tile.
    dequantize_first: bool = False
    # With word_decode: pieces pair the nibbles j and j+4 of each word as consecutive K,
    # so each decoded 32-bit register is an MMA operand's k-pair (no repacking).
    pair_decode: bool = False
    # Column tiles per program, in one loop over (column tile, K tile) that the
    # compiler pipelines across tiles: the next tile's loads overlap this one's
    # last products and store (short K loops: qwen3 w2 decode runs 3 K tiles a tile).
    column_tiles: int = 1
    # The Mosaic GPU kernel (Hopper: TMA loads, warp-specialized wgmma, a persistent
    # grid): 16-bit weights, planar int4/uint4 with 128-column groups or per-channel
    # scales (decoded in the kernel: block_k=128), others through dequantize_first;
    # optional bias, dense, grouped-contiguous or grouped-masked rows; block_m x block_n per tile on
    # two compute warpgroups, num_stages K steps in flight, group_m row tiles per band
    # (num_warps unused). With swap_ab (4-bit weights, compiled only) each decoded
    # piece is the wgmma's register operand and the accumulator out.T, as in the
    # Triton swap_ab tiles.
    mosaic: bool = False
    # The Mosaic kernel's 4-bit path: decoded 32-column pieces staged in shared
    # memory per compute warpgroup — 2 (the next piece waits for the product two
    # pieces back) or 4 (a whole 128-column unit: no wait inside a K step).
    stage_slots: int = 2
    # The Mosaic kernel's compute warpgroups take a share of the tile's rows each
    # (64 or 128 rows) and share its weight tile — a 4-bit one decoded a share by
    # each — instead of a share of its columns: less decoding per product.
    split_rows: bool = False
    # The Mosaic kernel keeps a K step's wgmma in flight while the next step's is
    # issued (its shared-memory slot released one step late; num_stages > 1):
    # 0 or 1, for 16-bit weights and the swap_ab form.
    delay_release: int = 0
    # The Mosaic kernel's epilogue slots a warpgroup (1 or 2): with 2 the next output
    # chunk is written while the last one's store still reads its slot.
    epilogue_slots: int = 1
    # The Mosaic kernel's programs in clusters of 1 or 2 on adjacent column tiles of one
    # row tile, x's tiles multicast by TMA to both: a sixth less shared-memory fill
    # from L2 for 16-bit weights (half of x's 16 of 48 KB a step), a third for 4-bit.
    cluster_n: int = 1
    # Or clusters of 2 on a pair of row tiles of one expert, the weight's tiles multicast
    # (a third less for 16-bit weights: 32 of 48 KB a step; each expert's row tiles
    # padded to an even count). Not both.
    cluster_m: int = 1

    def __post_init__(self):
        owner = "TuningConfig"
        for name in ("block_m", "block_n", "block_k", "num_warps", "split_k", "column_tiles"):
            _power_of_two(getattr(self, name), name, owner)
        _positive_int(self.group_m, "group_m", owner)
        for name in ("block_m", "block_n", "block_k") if self.use_mma else ("block_n", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"{owner}.{name}: expected at least 16, got {getattr(self, name)}")
        if not self.use_mma and (self.block_m > 8 or self.swap_ab):
            raise ValueError(
                f"{owner}.use_mma: False is for row tiles of at most 8 rows without swap_ab, "
                f"got block_m={self.block_m}, swap_ab={self.swap_ab}"
            )
        if self.num_warps > 32:
            raise ValueError(f"{owner}.num_warps: expected at most 32, got {self.num_warps}")
        _positive_int(self.num_stages, "num_stages", owner)
        if self.column_tiles > 1 and self.split_k > 1:
            raise ValueError(
                f"{owner}.column_tiles: a loop over column tiles is for split_k=1, got split_k={self.split_k}"
            )
        if self.mosaic and (self.split_k > 1 or self.column_tiles > 1 or self.pair_decode):
            raise ValueError(
                f"{owner}.mosaic: the Mosaic GPU kernel takes none of split_k, column_tiles, pair_decode, got {self}"
            )
        if self.stage_slots not in (2, 4) or (self.stage_slots != 2 and not self.mosaic):
            raise ValueError(
                f"{owner}.stage_slots: 2 or 4, and other than 2 only with mosaic=True, got {self.stage_slots}"
            )
        if self.delay_release not in (0, 1) or (self.delay_release and not self.mosaic):
            raise ValueError(f"{owner}.delay_release: 0 or 1, and 1 only with mosaic=True, got {self.delay_release}")
        if self.epilogue_slots not in (1, 2) or (self.epilogue_slots != 1 and not self.mosaic):
            raise ValueError(f"{owner}.epilogue_slots: 1 or 2, and 2 only with mosaic=True, got {self.epilogue_slots}")
        if self.cluster_n not in (1, 2) or (self.cluster_n != 1 and not self.mosaic):
            raise ValueError(f"{owner}.cluster_n: 1 or 2, and 2 only with mosaic=True, got {self.cluster_n}")
        if self.cluster_m not in (1, 2) or (self.cluster_m != 1 and not self.mosaic):
            raise ValueError(f"{owner}.cluster_m: 1 or 2, and 2 only with mosaic=True, got {self.cluster_m}")
        if self.cluster_m * self.cluster_n > 2:
            raise ValueError(f"{owner}.cluster_m, cluster_n: clusters of two programs, so not both 2, got {self}")
        if self.split_rows and not self.mosaic:
            raise ValueError(f"{owner}.split_rows: a Mosaic kernel option, needs mosaic=True")
        if self.pair_decode and not self.word_decode:
            raise ValueError(f"{owner}.pair_decode: pairs the nibbles of decoded words, so it needs word_decode=True")

    def without_mosaic(self) -> TuningConfig:
        """The same tiling for the Triton kernel: ``mosaic`` off, the Mosaic-only
        options (:data:`MOSAIC_OPTIONS`) at their defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in MOSAIC_OPTIONS}
        return dataclasses.replace(self, mosaic=False, **defaults)

    def check_compute(self, compute: ComputeConfig) -> None:
        if compute.batch_invariant and self.split_k > 1:
            raise ValueError(
                f"TuningConfig.split_k: batch_invariant computation needs a fixed K order, so split_k must be 1, "
                f"got {self.split_k}"
            )


@dataclasses.dataclass(frozen=True)
class RowTilesConfig:
    """Tiling of the row-moving routing kernels (``moe_permute``,
    ``moe_unpermute``, ``moe_fused_mul_sum``): ``block_tokens`` token rows by
    ``block_cols`` columns per program on ``num_warps`` warps (powers of two).
    The defaults won the H200 sweep (4 x 256 x 4: 88-92 % of copy bandwidth at
    T=4096, H=7168, k=8); with more tokens per program, the kernels halve
    ``block_tokens`` (down to 4) below ~1024 programs."""

    block_tokens: int = 4
    block_cols: int = 256
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_tokens", "block_cols", "num_warps"):
            _power_of_two(getattr(self, name), name, "RowTilesConfig")
        if self.block_cols < 16:
            raise ValueError(f"RowTilesConfig.block_cols: expected at least 16, got {self.block_cols}")
        if self.num_warps > 32:
            raise ValueError(f"RowTilesConfig.num_warps: expected at most 32, got {self.num_warps}")

    @classmethod
    def parse(cls, text: str) -> RowTilesConfig:
        """From ``"TOKENSxCOLSxWARPS"`` (e.g. ``"8x1024x8"``)."""
        try:
            tokens, cols, warps = (int(part) for part in text.split("x"))
        except ValueError:
            raise ValueError(f"row tiles: expected TOKENSxCOLSxWARPS such as 8x1024x8, got {text!r}") from None
        return cls(tokens, cols, warps)

    def text(self) -> str:
        """The form :meth:`parse` reads."""
        return f"{self.block_tokens}x{self.block_cols}x{self.num_warps}"


@dataclasses.dataclass(frozen=True)
class ProcessTilesConfig:
    """Tiling of the ``process_input`` kernel: ``block_rows`` whole rows per
    program on ``num_warps`` warps (powers of two; 0: chosen from the row width
    — ~4096 elements per program, 8 warps from 8192, 4 where a Hadamard
    product has fewer than 64 rows). ``two_pass`` (Hadamard
    only): the rows are processed as b-wide column blocks of up to 64 rows, the
    per-token max found in a first pass and the blocks rotated again to be
    quantized, instead of whole rows held at once. ``mosaic`` (1 to 3: its
    compute warpgroups): the Mosaic GPU kernel for a Hadamard rotation of bf16
    rows quantized to fp8 per token (tiles of 64 tokens streamed through
    shared memory by TMA, the products on wgmma; ``mosaic_max``: the first
    warpgroup takes each tile's row max a step ahead of the others, which
    quantize; ``mosaic_reread``: as ``mosaic_max``, with the quantizing
    warpgroups re-reading each tile from L2 through rings of Hadamard blocks
    instead of holding whole tiles; ``mosaic_self_loads`` with it: no memory
    warpgroup, each compute warpgroup feeds its own ring; ``mosaic_own``: no
    max or memory warpgroup — every compute warpgroup takes both passes over
    its share of each tile's blocks from a ring of its own, the row max
    combined a tile at a time; the other fields stay at their defaults)."""

    block_rows: int = 0
    num_warps: int = 0
    two_pass: bool = False
    # Blocks of rows per program, in a loop that loads the next block's input
    # while this one is processed (pipelined by hand: Triton pipelines only loads
    # that feed a dot); 1: one block per program; 0: chosen (8 for a one-pass
    # Hadamard rotation while the grid keeps 2 programs per SM, else 1).
    row_blocks: int = 0
    # A bf16 input rotated without activation is loaded as [rows · n, b]
    # Hadamard blocks, the product's operand as it is (False: as rows, reshaped).
    operand_blocks: bool = True
    # The whole row as one column block of the next power of two, the lanes past
    # K masked (K=768: one 1024-wide block instead of 512 + 256).
    one_block: bool = False
    # The products of the operand-blocks rotation (or of two passes) on sub-blocks
    # of this many columns (a power of two from 16, under the Hadamard block b),
    # the rest of the rotation as butterflies in f32 (H_b = H_{b/s} ⊗ H_s): b/s
    # times fewer tensor-core flops and an s x s matrix. b: one product per
    # Hadamard block; 0: chosen (operand blocks: 64 under blocks of 128 and
    # more, else whole blocks; two passes: whole blocks).
    hadamard_sub: int = 0
    mosaic: int = 0
    mosaic_max: bool = False
    mosaic_reread: bool = False
    mosaic_self_loads: bool = False
    mosaic_own: bool = False

    def __post_init__(self):
        if self.mosaic not in ((0, 1, 2, 3, 4) if self.mosaic_reread or self.mosaic_own else (0, 1, 2, 3)):
            raise ValueError(
                "ProcessTilesConfig.mosaic: 1 to 3 compute warpgroups, 4 with mosaic_reread or mosaic_own (0: off), "
                f"got {self.mosaic}"
            )
        if self.mosaic_self_loads and not self.mosaic_reread:
            raise ValueError("ProcessTilesConfig.mosaic_self_loads: the re-read form's own loads: needs mosaic_reread")
        if self.mosaic_own and (self.mosaic < 1 or self.mosaic_max or self.mosaic_reread):
            raise ValueError(
                "ProcessTilesConfig.mosaic_own: a form of its own (no max warpgroup, no re-read): needs mosaic of 1 "
                f"to 4 without mosaic_max or mosaic_reread, got {self}"
            )
        if self.mosaic_max and self.mosaic < 2:
            raise ValueError(
                "ProcessTilesConfig.mosaic_max: a warpgroup for the row max beside one or more that quantize: "
                f"needs mosaic of 2 or 3, got {self.mosaic}"
            )
        if self.mosaic_reread and (self.mosaic < 2 or self.mosaic_max):
            raise ValueError(
                "ProcessTilesConfig.mosaic_reread: a warpgroup for the row max (implied: leave mosaic_max off) beside "
                f"one or more that quantize: needs mosaic of 2 to 4, got {self.mosaic}"
            )
        mosaic_fields = dict(mosaic=0, mosaic_max=False, mosaic_reread=False, mosaic_self_loads=False, mosaic_own=False)
        if self.mosaic and dataclasses.replace(self, **mosaic_fields) != ProcessTilesConfig():
            raise ValueError(
                "ProcessTilesConfig.mosaic: the Mosaic kernel has its own tiling; leave the other fields at their "
                f"defaults, got {self}"
            )
        for name in ("block_rows", "num_warps"):
            if getattr(self, name):
                _power_of_two(getattr(self, name), name, "ProcessTilesConfig")
        if self.hadamard_sub:
            _power_of_two(self.hadamard_sub, "hadamard_sub", "ProcessTilesConfig")
            if self.hadamard_sub < 16:
                raise ValueError(
                    f"ProcessTilesConfig.hadamard_sub: the products need 16 columns or more, got {self.hadamard_sub}"
                )
        _positive_int(self.row_blocks, "row_blocks", "ProcessTilesConfig", allow_zero=True)
        if self.row_blocks > 1 and self.two_pass:
            raise ValueError("ProcessTilesConfig.row_blocks: a loop over row blocks is for one pass, not two_pass")
        if self.num_warps > 32:
            raise ValueError(f"ProcessTilesConfig.num_warps: expected at most 32, got {self.num_warps}")

    @classmethod
    def parse(cls, text: str) -> ProcessTilesConfig:
        """From ``"ROWSxWARPS"``, ``"ROWSxWARPSxPASSES"`` or
        ``"ROWSxWARPSxPASSESxBLOCKS"`` (e.g. ``"8x8"``, ``"64x8x2"``, ``"4x4x1x8"``;
        0 rows or warps: chosen), with a trailing ``r`` for
        ``operand_blocks=False`` (``"0x0r"``), ``p`` for ``one_block`` (``"8x4p"``)
        and ``hS`` for ``hadamard_sub=S`` (``"8x4x1x4h32"``); ``"0x0m"``, ``"0x0mW"``
        for the Mosaic kernel on 1 or W (2 to 4) compute warpgroups, ``x`` after them
        for ``mosaic_max`` (``"0x0m3x"``), ``r`` for ``mosaic_reread`` (``"0x0m3r"``),
        ``rs`` with ``mosaic_self_loads`` (``"0x0m4rs"``), ``o`` for ``mosaic_own`` (``"0x0m3o"``)."""
        mosaic = re.fullmatch(r"0x0m([234]?)(x?)(r?)(s?)(o?)", text)
        if mosaic:
            return cls(
                mosaic=int(mosaic.group(1) or 1),
                mosaic_max=bool(mosaic.group(2)),
                mosaic_reread=bool(mosaic.group(3)),
                mosaic_self_loads=bool(mosaic.group(4)),
                mosaic_own=bool(mosaic.group(5)),
            )
        sub = re.search(r"h(\d+)$", text)
        text = text[: sub.start()] if sub else text
        one_block = text.endswith("p")
        text = text.removesuffix("p")
        reshaped = text.endswith("r")
        text = text.removesuffix("r")
        try:
            parts = [int(part) for part in text.split("x")]
            assert 2 <= len(parts) <= 4 and (len(parts) == 2 or parts[2] in (1, 2))
            assert len(parts) < 4 or parts[3] >= 1
        except (ValueError, AssertionError):
            raise ValueError(
                f"process tiles: expected ROWSxWARPS[xPASSES[xBLOCKS]][r][p][hS] such as 8x8, 64x8x2, 4x4x1x8, 8x4p "
                f"or 8x4x1x4h32, or 0x0m[W][x|r|rs|o] (the Mosaic kernel), "
                f"got {text!r}"
            ) from None
        blocks = parts[3] if len(parts) == 4 else 0
        two_pass = len(parts) >= 3 and parts[2] == 2
        return cls(
            parts[0],
            parts[1],
            two_pass=two_pass,
            row_blocks=blocks,
            operand_blocks=not reshaped,
            one_block=one_block,
            hadamard_sub=int(sub.group(1)) if sub else 0,
        )

    def text(self) -> str:
        """The form :meth:`parse` reads (shortest: passes and blocks only when set)."""
        if self.mosaic:
            suffix = "".join(
                letter
                for letter, on in [
                    ("x", self.mosaic_max),
                    ("r", self.mosaic_reread),
                    ("s", self.mosaic_self_loads),
                    ("o", self.mosaic_own),
                ]
                if on
            )
            return "0x0m" + (str(self.mosaic) if self.mosaic > 1 else "") + suffix
        name = f"{self.block_rows}x{self.num_warps}" + ("x2" if self.two_pass else "")
        name = name if self.row_blocks == 0 else f"{name}x1x{self.row_blocks}"
        name = name if self.operand_blocks else f"{name}r"
        name = f"{name}p" if self.one_block else name
        return f"{name}h{self.hadamard_sub}" if self.hadamard_sub else name


@dataclasses.dataclass(frozen=True)
class TuningEntry:
    """``config`` applies when ``min_shape_m < valid_shape_m <= max_shape_m``."""

    min_shape_m: int
    max_shape_m: int
    config: TuningConfig


def select_tuning(table: tuple[TuningEntry, ...], valid_shape_m: int, default: TuningConfig | None = None):
    """The entry of ``table`` whose M range holds ``valid_shape_m`` (Humming's rule)."""
    for entry in table:
        if entry.min_shape_m < valid_shape_m <= entry.max_shape_m:
            return entry.config
    if default is None:
        raise ValueError(f"select_tuning: no entry covers valid_shape_m={valid_shape_m}")
    return default


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """The static config of an expert layer: w13 (gate+up, ``[E, 2I, H]`` or
    ``[E, I, H]`` for ``_NO_MUL``) and w2 (down, ``[E, H, I]``).

    ``num_experts`` is the number of local experts the weights hold;
    ``global_num_experts`` the range of router ids (default: the same).
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
        if self.use_f16_accum and self.compute_dtype != "float16":
            raise ValueError(f"{owner}.use_f16_accum: f16 accumulation needs compute_dtype 'float16'")
        # Building both layer configs validates shapes, formats and modes.
        self.w13, self.w2  # noqa: B018

    @property
    def w13_n(self) -> int:
        return 2 * self.intermediate_size if self.activation.is_gated else self.intermediate_size

    @property
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

    @property
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
