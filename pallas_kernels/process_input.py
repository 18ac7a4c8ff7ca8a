"""The Triton-lowered ``process_input`` kernel: activation -> Hadamard
rotation -> quantization -> layout, one pass over the rows.

Each program takes ``block_rows`` whole rows (scales need whole groups or
rows), computes the activation in f32, rotates blocks of ``b`` columns with a
``[b, b]`` ±1 Hadamard matrix on the tensor cores (two bf16 products, the value
split into high and low halves: ~16 mantissa bits kept), quantizes, and writes
each row to its place: the same row (``normal``, ``grouped_mask``) or the rows
``scatter_idx[i, :]`` (``scatter``). Rows outside the valid set are written as
zeros, so every output element is written exactly once. Tiling: :class:`Tiles`;
what it cannot take: :func:`supports`. Notes: benchmarks/notes/process_input.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import activation, codecs
from pallas_kernels.indexing import nonneg_div, nonneg_rem


def _power_of_two_or_zero(value, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value & (value - 1):
        raise ValueError(f"process_input.Tiles.{name}: expected 0 (chosen) or a power of two, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernel's tiling; 0 leaves a field to the launch's choice:
    ``block_rows`` whole rows a program (~4096 elements, at least the 16 rows
    a Hadamard product needs), ``num_warps`` (8 from 8192 elements, 4 where a
    Hadamard product has fewer than 64 rows), ``row_blocks`` blocks of rows a
    program in a loop that loads the next block while this one is processed
    (:func:`chosen_row_blocks`), ``hadamard_sub`` columns of one Hadamard
    product in the operand-blocks rotation, the rest as f32 butterflies
    (:func:`product_columns`)."""

    block_rows: int = 0
    num_warps: int = 0
    row_blocks: int = 0
    hadamard_sub: int = 0

    def __post_init__(self):
        for name in ("block_rows", "num_warps", "hadamard_sub"):
            _power_of_two_or_zero(getattr(self, name), name)
        if not isinstance(self.row_blocks, int) or isinstance(self.row_blocks, bool) or self.row_blocks < 0:
            raise ValueError(f"process_input.Tiles.row_blocks: expected a non-negative int, got {self.row_blocks!r}")
        if self.num_warps > 32:
            raise ValueError(f"process_input.Tiles.num_warps: expected at most 32, got {self.num_warps}")
        if self.hadamard_sub and self.hadamard_sub < 16:
            raise ValueError(f"process_input.Tiles.hadamard_sub: 16 columns or more a product, got {self.hadamard_sub}")


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """Static description of one ``process_input`` launch."""

    k_in: int  # input row width
    k_out: int  # row width after the activation
    activation: str | None = None
    clamp_limit: float | None = None
    alpha: float = 1.702
    beta: float = 1.0
    gate_up_block: int = 0  # gated input: gate and up interleaved by blocks of this many columns
    hadamard: int | None = None
    mode: str = "none"
    act_dtype: str | None = None  # float8_e4m3 | float8_e5m2 | int8 | float4_e2m1
    qmax: float = 0.0
    group_size: int = 0
    scale_type: str = "float32"  # float32 | e8m0 | float8_e4m3
    out_dtype: str = "bfloat16"  # values dtype when not quantized
    layout: str = "normal"  # normal | grouped_mask | scatter
    copies: int = 1  # scatter: destinations per input row
    max_tokens: int = 0  # grouped_mask: rows per expert
    tiles: Tiles = Tiles()
    gpu: bool = False  # compiled for the GPU (not interpreted): use exact division
    # fp8 values multiplied back by their f32 scales and stored in out_dtype (no scales):
    # the input a GEMM that multiplies it out reads, without a pass of its own.
    dequantize: bool = False

    @property
    def width(self) -> int:
        return max(16, pl.next_power_of_2(self.k_out))

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """``(start, size)`` column blocks of a row, each a power of two: the
        binary digits of ``k_out`` (768 = 512 + 256, 2880 = 2048 + 512 + 256 +
        64), so no lane is padding. Every block is a whole number of groups and
        Hadamard blocks when ``k_out`` is (they are powers of two). Rows
        narrower than 16 columns or not a multiple of 16 take one padded block
        of ``width`` (masked past ``k_out``)."""
        if self.k_out % 16:
            return ((0, self.width),)
        sizes = [1 << bit for bit in range(self.k_out.bit_length() - 1, 3, -1) if self.k_out >> bit & 1]
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        return tuple(zip(starts, sizes, strict=True))

    @property
    def rows(self) -> int:
        if self.tiles.block_rows:
            return self.tiles.block_rows
        # At least 2 rows: one row a program left the widest rows short of bandwidth.
        rows = max(2, 4096 // self.width)
        if self.hadamard:
            # The rotation's products [rows * size / b, b] x [b, b] need 16 rows in
            # every column block (the MMA minimum) and run better with 64, as far
            # as a block of 8192 elements allows.
            per_row = self.hadamard_blocks_per_row
            wanted = min(pl.cdiv(64, per_row), max(1, 8192 // self.width))
            rows = max(rows, pl.cdiv(16, per_row), wanted)
        return rows

    @property
    def padded(self) -> bool:
        """One column block wider than the row (its tail past ``k_out`` masked)."""
        return self.segments[0][1] > self.k_out

    @property
    def hadamard_blocks_per_row(self) -> int:
        """Hadamard blocks in a row's narrowest column block: a product of one
        pass has ``rows * hadamard_blocks_per_row`` rows."""
        return min(size for _, size in self.segments) // self.hadamard

    @property
    def smallest_product_rows(self) -> int:
        """Rows of a one-pass program's smallest Hadamard product (its narrowest
        column block: ``rows * hadamard_blocks_per_row``)."""
        return self.rows * self.hadamard_blocks_per_row

    @property
    def warps(self) -> int:
        if self.tiles.num_warps:
            return self.tiles.num_warps
        elements = self.rows * self.width
        # Plain rows keep 4 warps up to 2 x 4096 elements; Hadamard products take 8
        # from 8192, except products under 64 rows (mma.sync), where 4 won.
        if self.hadamard and self.smallest_product_rows < 64:
            return 4
        return 8 if elements >= (8192 if self.hadamard else 16384) else 4

    @property
    def packed(self) -> bool:
        return self.act_dtype == "float4_e2m1"

    @property
    def num_groups(self) -> int:
        return self.k_out // self.group_size if self.group_size else 0


def _input_columns(start: int, size: int, cfg: ProcessConfig) -> list[tuple[jax.Array, int]]:
    """The input loads behind activation columns ``[start, start + size)``:
    ``(input columns [n], row width)`` each, in the order :func:`_activate` takes them."""
    kind = cfg.activation
    outputs = start + jnp.arange(size, dtype=jnp.int32)
    if kind is None or kind.endswith("_no_mul"):
        return [(outputs, cfg.k_out)]
    if kind == "swigluoai":  # interleaved [g0, u0, g1, u1, ...]: one contiguous load, split in registers
        return [(2 * start + jnp.arange(2 * size, dtype=jnp.int32), 2 * cfg.k_out)]
    block = cfg.gate_up_block
    if block:  # [g_0..g_{c-1}, u_0..u_{c-1}, g_c, ...]: runs of c columns
        gate = nonneg_div(outputs, block) * (2 * block) + nonneg_rem(outputs, block)
        return [(gate, 2 * cfg.k_out), (gate + block, 2 * cfg.k_out)]
    return [(outputs, cfg.k_out), (outputs + cfg.k_out, 2 * cfg.k_out)]  # gate, up


def _load_inputs(x_ref, rows, row_mask, padded: bool, cfg: ProcessConfig, segments) -> list:
    """Every input tile the column blocks ``segments`` need (``x``'s dtype),
    rows outside ``row_mask`` and columns past a ``padded`` block's width as 0."""
    tiles = []
    for start, size in segments:
        for columns, width in _input_columns(start, size, cfg):
            mask = row_mask[:, None] & (columns < width)[None, :] if padded else row_mask[:, None]
            tiles.append(plgpu.load(x_ref.at[rows[:, None], columns[None, :]], mask=mask, other=0))
    return tiles


def _activate(tiles: list, size: int, cfg: ProcessConfig):
    """The activation of one column block from its input tiles (:func:`_input_columns`)."""
    tiles = [tile.astype(jnp.float32) for tile in tiles]
    kind = cfg.activation
    if kind is None:
        return tiles[0]
    if kind.endswith("_no_mul"):
        return activation.ungated(kind, tiles[0])
    if kind == "swigluoai":
        pairs = tiles[0]
        gate, up = (half.reshape(pairs.shape[0], size) for half in jax.lax.split(pairs.reshape(-1, size, 2), (1, 1), 2))
    else:
        gate, up = tiles
    return activation.gated(kind, gate, up, cfg.clamp_limit, cfg.alpha, cfg.beta)


def _hadamard_product(blocks, h, bf16_exact: bool):
    """``blocks [r, s] @ h`` (``h``: an ``[s, s]`` ±1 matrix, bf16) in f32: f32
    values as two bf16 tensor-core products (high and low halves), or one when
    ``bf16_exact`` (a bf16 input without activation: the low half is 0)."""
    high = blocks.astype(jnp.bfloat16)
    product = jnp.dot(high, h, preferred_element_type=jnp.float32)
    if not bf16_exact:
        low = (blocks - high.astype(jnp.float32)).astype(jnp.bfloat16)
        product = product + jnp.dot(low, h, preferred_element_type=jnp.float32)
    return product


def _rotate(y, h, cfg: ProcessConfig, bf16_exact: bool):
    """Blockwise Hadamard rotation of ``y [rows, width]`` by ``±1 / sqrt(b)``
    (``h``: the ``[b, b]`` ±1 matrix, loaded once per program)."""
    b = cfg.hadamard
    rows, width = y.shape
    rotated = _hadamard_product(y.reshape(rows * width // b, b), h, bf16_exact)
    return (rotated * (1.0 / math.sqrt(b))).reshape(rows, width)


def _encode(scaled, cfg: ProcessConfig):
    if cfg.act_dtype == "int8":
        # NaN codes as 0, as XLA converts it: the GPU's clamp would turn it into -127.
        scaled = jnp.where(jnp.isnan(scaled), 0.0, scaled)
        return jnp.clip(codecs.round_half_even(scaled), -127, 127).astype(jnp.int8)
    if cfg.act_dtype == "float4_e2m1":
        codes = codecs.e2m1_encode(scaled)
        rows, width = codes.shape
        low, high = jax.lax.split(codes.reshape(rows, width // 2, 2), (1, 1), axis=2)
        return codecs.pack_pairs(low.reshape(rows, width // 2), high.reshape(rows, width // 2))
    dtype = jnp.float8_e4m3fn if cfg.act_dtype == "float8_e4m3" else jnp.float8_e5m2
    return codecs.cast_float8_saturating(scaled, dtype, on_gpu=cfg.gpu)


def _row_max(blocks):
    """Per-row max over a list of ``[rows, c]`` (or ``[rows]``) blocks, NaN if any is."""
    maxima = [b if b.ndim == 1 else _amax(b, axis=1) for b in blocks]
    return functools.reduce(_nan_maximum, maxima)


def _amax(values, axis: int):
    """The max of ``|values|`` along ``axis``, NaN where any value is NaN (the
    GPU's max skips NaN: a NaN token would get a finite scale and finite garbage)."""
    largest = jnp.max(jnp.abs(values), axis=axis)
    return jnp.where(jnp.max((values != values).astype(jnp.float32), axis=axis) > 0, jnp.nan, largest)


def _nan_maximum(a, b):
    return jnp.where((a != a) | (b != b), jnp.nan, jnp.maximum(a, b))


def _token_scale(scale, cfg: ProcessConfig):
    """A per-token scale ``amax / max``, fp8 ones clamped from below as vLLM's
    are (:func:`codecs.fp8_token_scale_floor`; NaN stays NaN)."""
    if cfg.act_dtype not in ("float8_e4m3", "float8_e5m2"):
        return scale
    return codecs.floor_fp8_token_scale(scale, cfg.qmax)


def _quantize(ys, static_ref, cfg: ProcessConfig, row_amax=None):
    """:func:`_quantized`, or with ``cfg.dequantize`` its values multiplied
    back by their scales in ``out_dtype`` (and no scales)."""
    values, scales, second = _quantized(ys, static_ref, cfg, row_amax)
    if not cfg.dequantize:
        return values, scales, second
    out = []
    for index, codes in enumerate(values):
        rows = codes.shape[0]
        if cfg.mode == "static_tensor":
            product = codes.astype(jnp.float32) * static_ref[0]
        elif cfg.mode == "dynamic_token":
            product = codes.astype(jnp.float32) * scales[:, None]
        else:
            grouped = codes.astype(jnp.float32).reshape(rows, -1, cfg.group_size)
            product = (grouped * scales[index][:, :, None]).reshape(rows, -1)
        out.append(product.astype(jnp.dtype(cfg.out_dtype)))
    return out, None, None


def _quantized(ys, static_ref, cfg: ProcessConfig, row_amax=None):
    """Quantize a row's column blocks ``ys`` (list of ``[rows, c]`` f32).
    ``row_amax`` ``[rows]``: the max of ``|y|`` over the whole row when ``ys``
    is only part of it (two passes). Returns (values per block, scale per
    block (groups) or per row (token) or None, second scale per row or None)."""
    rows = ys[0].shape[0]
    if cfg.mode == "none":
        return [y.astype(jnp.dtype(cfg.out_dtype)) for y in ys], None, None
    qmax, exact = cfg.qmax, cfg.gpu
    recip = functools.partial(codecs.safe_reciprocal, exact_on_gpu=exact)
    divide = functools.partial(codecs.divide, exact_on_gpu=exact)
    if cfg.mode == "static_tensor":
        inverse = recip(jnp.full((rows, 1), static_ref[0], jnp.float32))
        return [_encode(y * inverse, cfg) for y in ys], None, None
    if cfg.mode == "dynamic_token":
        scale = _token_scale(divide(_row_max(ys) if row_amax is None else row_amax, qmax), cfg)
        inverse = recip(scale)[:, None]
        return [_encode(y * inverse, cfg) for y in ys], scale, None
    grouped = [y.reshape(rows, y.shape[1] // cfg.group_size, cfg.group_size) for y in ys]
    amaxes = [_amax(g, axis=2) for g in grouped]
    second = None
    if cfg.mode == "static_tensor_dynamic_group":
        second = jnp.full((rows,), static_ref[0], jnp.float32)
    elif cfg.mode == "dynamic_group_token":  # the row amax lands on e4m3 max x element max
        second = divide(_row_max(amaxes) if row_amax is None else row_amax, codecs.FLOAT8_E4M3_MAX * qmax)
    values, stored_scales = [], []
    for g, amax in zip(grouped, amaxes, strict=True):
        if second is not None:
            stored = codecs.cast_float8_saturating(
                divide(amax, qmax) * recip(second)[:, None], jnp.float8_e4m3fn, on_gpu=cfg.gpu
            )
            scale = stored.astype(jnp.float32) * second[:, None]
        elif cfg.scale_type == "e8m0":
            stored = codecs.e8m0_from_amax(amax, qmax)
            scale = codecs.e8m0_decode(stored)
        elif cfg.scale_type == "float8_e4m3":
            stored = codecs.cast_float8_saturating(divide(amax, qmax), jnp.float8_e4m3fn, on_gpu=cfg.gpu)
            scale = stored.astype(jnp.float32)
        else:
            stored = scale = divide(amax, qmax)
        values.append(_encode((g * recip(scale)[:, :, None]).reshape(rows, -1), cfg))
        stored_scales.append(stored)
    return values, stored_scales, (second if cfg.mode == "dynamic_group_token" else None)


def _process_kernel(*refs, cfg: ProcessConfig, m_in: int, zero_filled: int = 0):
    refs = list(refs)
    x_ref = refs.pop(0)
    h_ref = refs.pop(0) if cfg.hadamard else None
    static_ref = refs.pop(0) if cfg.mode in ("static_tensor", "static_tensor_dynamic_group") else None
    counts_ref = refs.pop(0) if cfg.layout == "grouped_mask" else None
    scatter_ref = refs.pop(0) if cfg.layout == "scatter" else None
    valid_ref = refs.pop(0)
    del refs[:zero_filled]  # the zeroed outputs' input side (aliased to the outputs below)
    values_ref = refs.pop(0)
    scale_ref = refs.pop(0) if refs else None
    scale2_ref = refs.pop(0) if refs else None

    # The Hadamard matrix is read once per program (once for all its row blocks).
    h = h_ref[...] if cfg.hadamard else None
    ins = _Inputs(x_ref, h, static_ref, counts_ref, scatter_ref, valid_ref)
    out_refs = (values_ref, scale_ref, scale2_ref)
    if rotates_blocks(cfg, x_ref.dtype):
        program, programs = pl.program_id(0), pl.num_programs(0)  # outside the loop (interpret mode)

        def rotated_block(i, carry):  # no carried tiles: Triton pipelines these loads itself
            _process_rotated_rows(program + i * programs, ins, out_refs, cfg, m_in)
            return carry

        jax.lax.fori_loop(0, cfg.tiles.row_blocks, rotated_block, 0)
        return
    if cfg.tiles.row_blocks == 1:
        _process_rows(pl.program_id(0), _block_inputs(x_ref, pl.program_id(0), cfg, m_in), ins, out_refs, cfg, m_in)
        return
    # Blocks program, program + grid, ...: the next block's loads are issued
    # before this block is processed (its tiles are the loop's carry).
    program, programs = pl.program_id(0), pl.num_programs(0)  # outside the loop (interpret mode)

    def block(i, tiles):
        index = program + i * programs
        ahead = _block_inputs(x_ref, index + programs, cfg, m_in)  # past the last block: all masked
        _process_rows(index, tiles, ins, out_refs, cfg, m_in)
        return ahead

    jax.lax.fori_loop(0, cfg.tiles.row_blocks, block, _block_inputs(x_ref, program, cfg, m_in))


def _block_rows(block, cfg: ProcessConfig, m_in: int):
    rows = block * cfg.rows + jnp.arange(cfg.rows, dtype=jnp.int32)
    return rows, rows < m_in


def _block_inputs(x_ref, block, cfg: ProcessConfig, m_in: int) -> list:
    """The input tiles of a block of rows (one pass: every column block)."""
    rows, row_mask = _block_rows(block, cfg, m_in)
    return _load_inputs(x_ref, rows, row_mask, cfg.padded, cfg, cfg.segments)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What a program reads besides its rows' input tiles (refs, or None when
    the launch has no such input; ``h`` the loaded Hadamard matrix)."""

    x_ref: object
    h: object
    static_ref: object
    counts_ref: object
    scatter_ref: object
    valid_ref: object


def _process_rows(block, tiles, ins: _Inputs, out_refs, cfg: ProcessConfig, m_in: int):
    """The rows ``[block * rows, (block + 1) * rows)`` (those below ``m_in``),
    from their input ``tiles`` (:func:`_block_inputs`)."""
    x_ref, h, static_ref = ins.x_ref, ins.h, ins.static_ref
    values_ref, scale_ref, scale2_ref = out_refs
    rows, row_mask = _block_rows(block, cfg, m_in)
    bf16_exact = cfg.activation is None and x_ref.dtype == jnp.bfloat16
    destinations, keeps = _destinations(rows, row_mask, ins, cfg)
    out = _Outputs(values_ref, scale_ref, scale2_ref, destinations, keeps, row_mask)

    segments = cfg.segments
    padded = cfg.padded
    ys, loads = [], iter(tiles)
    for start, size in segments:
        y = _activate([next(loads) for _ in _input_columns(start, size, cfg)], size, cfg)
        ys.append(_rotate(y, h, cfg, bf16_exact) if cfg.hadamard else y)
    _store(out, _quantize(ys, static_ref, cfg), segments, padded, cfg)


def _destinations(rows, row_mask, ins: _Inputs, cfg: ProcessConfig):
    """Per copy of the rows: their output rows and which of them keep their
    values (the others are written as zeros)."""
    num_valid = ins.valid_ref[0]
    if cfg.layout == "scatter":
        destinations = [
            plgpu.load(ins.scatter_ref.at[rows * cfg.copies + r], mask=row_mask, other=0) for r in range(cfg.copies)
        ]
        # A destination outside [0, num_valid) keeps no values (see _written for those outside the output).
        return destinations, [row_mask & (dest >= 0) & (dest < num_valid) for dest in destinations]
    keep = row_mask & (rows < num_valid)
    if cfg.layout == "grouped_mask":
        count = plgpu.load(ins.counts_ref.at[rows // cfg.max_tokens], mask=row_mask, other=0)
        keep = keep & (rows % cfg.max_tokens < count)
    return [rows], [keep]


def rotates_blocks(cfg: ProcessConfig, x_dtype) -> bool:
    """Whether the rows are processed as ``[rows · size/b, b]`` Hadamard blocks
    loaded straight as the product's operand (:func:`_process_rotated_rows`):
    a one-pass rotation of a bf16 input without activation (one product),
    every column block a whole number of Hadamard blocks, a per-token, static
    or no quantization to 8-bit or 16-bit values."""
    return bool(
        cfg.hadamard
        and cfg.activation is None
        and jnp.dtype(x_dtype) == jnp.dtype(jnp.bfloat16)
        and cfg.k_out % cfg.hadamard == 0  # a padded block's tail is whole Hadamard blocks of zeros
        and all(size % cfg.hadamard == 0 for _, size in cfg.segments)
        and cfg.mode in ("none", "dynamic_token", "static_tensor")
        and cfg.act_dtype != "float4_e2m1"
    )


def _process_rotated_rows(block, ins: _Inputs, out_refs, cfg: ProcessConfig, m_in: int):
    """The rows of ``block`` (see :func:`rotates_blocks`), each column block a
    ``[rows · n, b]`` tile whose row i is Hadamard block i % n of row i // n:
    loaded with that addressing, rotated by one product (or, with
    ``hadamard_sub``, by one product per sub-block and f32 butterflies), quantized
    per token and stored with the same addressing — no reshape between the load and the
    product, so the compiler can copy the input into shared memory
    asynchronously, where the product reads it. The same arithmetic as
    :func:`_rotate` and :func:`_quantize`."""
    b, rows_n = cfg.hadamard, cfg.rows
    width = ins.h.shape[0]  # columns of one product: the Hadamard block, or the launcher's sub-block
    rows, row_mask = _block_rows(block, cfg, m_in)
    destinations, keeps = _destinations(rows, row_mask, ins, cfg)
    along = jnp.arange(width, dtype=jnp.int32)
    segments = []  # per column block: (n, [(columns [rows * n, width], rotated values)] per sub-block)
    for start, size in cfg.segments:
        n = size // b
        i = jnp.arange(rows_n * n, dtype=jnp.int32)
        row = block * rows_n + jax.lax.div(i, jnp.int32(n))
        parts = []
        for part in range(b // width):
            cols = start + part * width + (jax.lax.rem(i, jnp.int32(n)) * b)[:, None] + along[None, :]
            inside = (row < m_in)[:, None] & (cols < cfg.k_out) if cfg.padded else (row < m_in)[:, None]
            x = plgpu.load(ins.x_ref.at[row[:, None], cols], mask=inside, other=0)
            parts.append((cols, jnp.dot(x, ins.h, preferred_element_type=jnp.float32)))
        rotated = butterflies([p for _, p in parts])  # H_b = H_{b/width} ⊗ H_width (one part: as is)
        segments.append((n, [(cols, y * (1.0 / math.sqrt(b))) for (cols, _), y in zip(parts, rotated, strict=True)]))

    def per_block(values, n):  # a [rows] vector for the [rows * n] block rows
        return jnp.broadcast_to(values[:, None], (rows_n, n)).reshape(rows_n * n)

    scale, row_amax = None, None
    if cfg.mode == "dynamic_token":  # the row's amax over all its blocks, then _quantize per block row
        amaxes = []
        for n, tiles in segments:  # sub-blocks share a layout: their max is elementwise, one reduction
            largest = functools.reduce(_nan_maximum, [jnp.abs(y) for _, y in tiles])
            amaxes.append(_amax(_amax(largest, axis=1).reshape(rows_n, n), axis=1))
        row_amax = functools.reduce(_nan_maximum, amaxes)
        scale = _token_scale(codecs.divide(row_amax, cfg.qmax, exact_on_gpu=cfg.gpu), cfg)
    outputs = [
        _quantize([y for _, y in tiles], ins.static_ref, cfg, None if row_amax is None else per_block(row_amax, n))[0]
        for n, tiles in segments
    ]
    values_ref, scale_ref, _ = out_refs
    for dest, keep in zip(destinations, keeps, strict=True):
        written = _written(dest, row_mask, values_ref.shape[0])
        out_rows = codecs.scatter_index(dest, written, values_ref.shape[0])
        for (n, tiles), values in zip(segments, outputs, strict=True):
            block_rows, mask, block_keep = per_block(out_rows, n), per_block(written, n)[:, None], per_block(keep, n)
            for (cols, _), tile_values in zip(tiles, values, strict=True):
                plgpu.store(
                    values_ref.at[block_rows[:, None], cols],
                    _zero_rows(tile_values, block_keep),
                    mask=mask & (cols < cfg.k_out) if cfg.padded else mask,
                )
        if scale is not None and not cfg.dequantize:
            plgpu.store(scale_ref.at[out_rows, 0], _zero_rows(scale, keep), mask=written)


def butterflies(parts: list) -> list:
    """``y_a = Σ_d H[a, d] p_d`` for the Sylvester ``H`` of order ``len(parts)``
    (a power of two): the sub-block products ``p_d = x_d · H_s`` combined into
    the rotation by ``H_b = H_{b/s} ⊗ H_s``, as log2 stages of f32 sums and
    differences of whole tiles (one layout: no data moves between threads)."""
    parts = list(parts)
    step = 1
    while step < len(parts):
        for first in range(0, len(parts), 2 * step):
            for j in range(first, first + step):
                parts[j], parts[j + step] = parts[j] + parts[j + step], parts[j] - parts[j + step]
        step *= 2
    return parts


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """Where a program's rows go: the output refs and, per copy of a row, its
    destination rows and which of them keep their values (others get zeros)."""

    values_ref: object
    scale_ref: object
    scale2_ref: object
    destinations: list
    keeps: list
    row_mask: jax.Array


def _store(out: _Outputs, quantized, segments, padded: bool, cfg: ProcessConfig):
    """Store the quantized column blocks (``segments``: ``(start, size)``, start
    static or traced) and their scales at every destination of the rows."""
    values, scales, second = quantized
    row_mask = out.row_mask
    per_byte = 2 if cfg.packed else 1
    for dest, keep in zip(out.destinations, out.keeps, strict=True):
        written = _written(dest, row_mask, out.values_ref.shape[0])
        out_rows = codecs.scatter_index(dest, written, out.values_ref.shape[0])
        for index, (start, size) in enumerate(segments):
            value_cols = start // per_byte + jnp.arange(size // per_byte, dtype=jnp.int32)
            mask = written[:, None] & (value_cols < cfg.k_out // per_byte)[None, :] if padded else written[:, None]
            plgpu.store(
                out.values_ref.at[out_rows[:, None], value_cols[None, :]], _zero_rows(values[index], keep), mask=mask
            )
            if isinstance(scales, list):
                group_cols = start // cfg.group_size + jnp.arange(size // cfg.group_size, dtype=jnp.int32)
                mask = written[:, None] & (group_cols < cfg.num_groups)[None, :] if padded else written[:, None]
                plgpu.store(
                    out.scale_ref.at[out_rows[:, None], group_cols[None, :]],
                    _zero_rows(scales[index], keep),
                    mask=mask,
                )
        if scales is not None and not isinstance(scales, list):
            plgpu.store(out.scale_ref.at[out_rows, 0], _zero_rows(scales, keep), mask=written)
        if second is not None:
            plgpu.store(out.scale2_ref.at[out_rows, 0], _zero_rows(second, keep), mask=written)


def _written(dest, row_mask, size: int):
    """Which rows store at ``dest``: a destination outside the output (a
    caller's scatter index) is not stored at all, not even as zeros."""
    return row_mask & (dest >= 0) & (dest < size)


def _zero_rows(array, keep):
    """Rows of ``array`` where ``keep`` is false replaced by zeros (of its dtype)."""
    keep = keep.reshape(keep.shape + (1,) * (array.ndim - 1))
    return jnp.where(keep, array, jnp.zeros((), array.dtype))


def hadamard_signs(block: int) -> np.ndarray:
    """The unnormalized Sylvester Hadamard matrix of order ``block`` (entries ±1)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return h


# Programs a grid keeps at least when row blocks are looped: 2 per SM of an H100/H200.
MIN_LOOPED_PROGRAMS = 264


def chosen_row_blocks(cfg: ProcessConfig, m_in: int) -> int:
    """Row blocks per program when the tiles leave it open: 8 for a one-pass
    Hadamard rotation (the loop reads the rotation matrix once per program and
    loads the next block during this one's products), 4 on 4 warps, fewer
    while the grid would fall under MIN_LOOPED_PROGRAMS; 1 otherwise (the
    activations and quantizations ran slower looped). Figures:
    benchmarks/notes/process_input.md."""
    if not cfg.hadamard:
        return 1
    programs = pl.cdiv(m_in, cfg.rows)
    # Programs of 4 warps (products under 64 rows) ran best with 4 blocks.
    most = 4 if cfg.warps == 4 else 8
    return next((b for b in (8, 4, 2) if b <= most and programs >= b * MIN_LOOPED_PROGRAMS), 1)


# Columns of one Hadamard product when the tiles leave it open (operand-blocks
# rotation, blocks of 128 and more): narrower, the butterflies' f32 work
# outgrows the products they save.
CHOSEN_HADAMARD_SUB = 64


def product_columns(cfg: ProcessConfig, x_dtype) -> int:
    """Columns of the rotation's matrix products: ``tiles.hadamard_sub`` where
    given (operand-blocks rotation), else
    :data:`CHOSEN_HADAMARD_SUB` under blocks larger than that in the
    operand-blocks rotation (:func:`rotates_blocks`); the whole Hadamard block
    otherwise."""
    if not rotates_blocks(cfg, x_dtype):
        return cfg.hadamard
    if cfg.tiles.hadamard_sub:
        return cfg.tiles.hadamard_sub
    return CHOSEN_HADAMARD_SUB if cfg.hadamard > CHOSEN_HADAMARD_SUB else cfg.hadamard


def pipeline_stages(cfg: ProcessConfig) -> int:
    """Triton pipeline stages (it pipelines only loads that feed a dot): the
    row-block loop's 3; two passes 2 — each pass's loop over column blocks
    then copies the next block's input asynchronously (sm_90 SASS at K=768,
    64 rows, h64: LDG -> LDGSTS, 98 -> 94 registers, 45 KB of shared memory);
    1 for a program of one block."""
    return 1 if cfg.tiles.row_blocks == 1 else 3


def _scale_dtype(cfg: ProcessConfig):
    return {"float32": jnp.float32, "e8m0": jnp.uint8, "float8_e4m3": jnp.float8_e4m3fn}[cfg.scale_type]


def process_input(
    x: jax.Array,
    cfg: ProcessConfig,
    *,
    num_valid_tokens: jax.Array,
    static_scale: jax.Array | None = None,
    expert_num_tokens: jax.Array | None = None,
    scatter_idx: jax.Array | None = None,
    zero_filled: bool = False,
    interpret: bool = False,
):
    """Run the kernel on ``x [M, k_in]``. Returns ``(values, scale, scale_2)``
    for the kernel-computed parts (static scales are the caller's). With the
    scatter layout every output row is written once when ``scatter_idx`` is a
    permutation of ``[0, M*copies)``; else ``zero_filled`` starts from zeroed
    outputs (updated in place) so that rows nobody targets are zeros."""
    m_in = x.shape[0]
    m_out = m_in * cfg.copies
    if not cfg.tiles.row_blocks:
        cfg = dataclasses.replace(cfg, tiles=dataclasses.replace(cfg.tiles, row_blocks=chosen_row_blocks(cfg, m_in)))
    inputs = [x]
    if cfg.hadamard:
        inputs.append(jnp.asarray(hadamard_signs(product_columns(cfg, x.dtype)), jnp.bfloat16))
    if static_scale is not None:
        inputs.append(static_scale.reshape(1).astype(jnp.float32))
    if expert_num_tokens is not None:
        inputs.append(expert_num_tokens.astype(jnp.int32))
    if scatter_idx is not None:
        inputs.append(scatter_idx.reshape(-1).astype(jnp.int32))
    inputs.append(num_valid_tokens.reshape(-1)[:1].astype(jnp.int32))

    if cfg.mode == "none" or cfg.dequantize:
        out_shape = [jax.ShapeDtypeStruct((m_out, cfg.k_out), jnp.dtype(cfg.out_dtype))]
    else:
        storage = {
            "float8_e4m3": jnp.float8_e4m3fn,
            "float8_e5m2": jnp.float8_e5m2,
            "int8": jnp.int8,
            "float4_e2m1": jnp.uint8,
        }[cfg.act_dtype]
        out_shape = [jax.ShapeDtypeStruct((m_out, cfg.k_out // (2 if cfg.packed else 1)), storage)]
        if cfg.mode == "dynamic_token":
            out_shape.append(jax.ShapeDtypeStruct((m_out, 1), jnp.float32))
        elif cfg.mode != "static_tensor":
            out_shape.append(jax.ShapeDtypeStruct((m_out, cfg.num_groups), _scale_dtype(cfg)))
        if cfg.mode == "dynamic_group_token":
            out_shape.append(jax.ShapeDtypeStruct((m_out, 1), jnp.float32))
    aliases = {}
    if zero_filled:
        aliases = {len(inputs) + j: j for j in range(len(out_shape))}
        inputs += [jnp.zeros(s.shape, s.dtype) for s in out_shape]
    outs = pl.pallas_call(
        functools.partial(_process_kernel, cfg=cfg, m_in=m_in, zero_filled=len(aliases)),
        grid=(pl.cdiv(pl.cdiv(m_in, cfg.rows), cfg.tiles.row_blocks),),
        out_shape=tuple(out_shape),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.warps, num_stages=pipeline_stages(cfg)),
        interpret=interpret,
        name="moe_process_input",
    )(*inputs)
    outs = list(outs) + [None] * (3 - len(outs))
    return tuple(outs)


def supports(tiles: Tiles, cfg: ProcessConfig, x_dtype) -> str | None:
    """Why the kernel cannot run ``cfg`` with ``tiles`` (None if it can): the
    Hadamard products need 16 rows (the MMA minimum); sub-block products are
    for the operand-blocks rotation (:func:`rotates_blocks`), under the
    Hadamard block (or the block itself: one product a block)."""
    if cfg.dequantize and (
        cfg.act_dtype not in ("float8_e4m3", "float8_e5m2")
        or cfg.mode not in ("static_tensor", "dynamic_token", "dynamic_group")
        or cfg.scale_type != "float32"
    ):
        return (
            f"dequantize with {cfg.act_dtype} {cfg.mode} {cfg.scale_type} scales "
            "(e4m3/e5m2 with f32 scales per tensor, token or group)"
        )
    sub = tiles.hadamard_sub
    cfg = dataclasses.replace(cfg, tiles=tiles)
    if sub and not (cfg.hadamard and (sub == cfg.hadamard or (sub < cfg.hadamard and rotates_blocks(cfg, x_dtype)))):
        return (
            f"hadamard_sub={sub}: sub-block products are for a Hadamard rotation of a bf16 input without activation, "
            f"quantized per token, statically or not at all, under the Hadamard block (hadamard_block_size="
            f"{cfg.hadamard}, activation={cfg.activation}, input {jnp.dtype(x_dtype).name}, mode {cfg.mode})"
        )
    per_row = cfg.hadamard_blocks_per_row if cfg.hadamard else 0
    if per_row and tiles.block_rows and tiles.block_rows * per_row < 16:
        return (
            f"block_rows={tiles.block_rows}: the Hadamard products need 16 rows of {cfg.hadamard} columns, so at least "
            f"{-(-16 // per_row)} rows a program here"
        )
    return None
