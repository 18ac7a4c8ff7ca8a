"""Decoding 8 packed 4-bit codes of a uint32 word into 8 16-bit floats (or
int4 codes into e4m3 bytes, four a register) with a few 32-bit integer
instructions (inline PTX on the GPU).

A decoder is a short *program* over 32-bit registers (data, not text),
rendered to PTX for ``plgpu.elementwise_inline_asm`` and run in NumPy by the
tests. Each of its four outputs holds the codes at nibble positions j and
j + 4 of a word (piece j of the GEMM); with ``pair_decode`` the words are read
as 16-bit halves, each register an MMA k-pair. Programs: int4/uint4 (``lop3``
under a magic exponent, one packed subtraction: exact) and e2m1 (the value
times a power of two the GEMM folds into its scales). How each works:
docs/DESIGN.md, appendix D.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

WORD = "w"  # the input register of every program
WORD2 = "w2"  # the second input register of four-element programs (``int4_e4m3_program``)
# 16-bit float bit patterns whose value is ``base + nibble`` when a nibble is
# OR-ed into the low mantissa bits: (pattern, base) per compute dtype.
MAGIC = {"bfloat16": (0x4300, 128.0), "float16": (0x6400, 1024.0)}
E2M1_FACTOR = 2.0**-6  # decoded e2m1 values are the true ones times this
E2M1_RAW_FACTOR = 2.0**-126  # the same without the normalizing multiply (bf16)
INT4_E4M3_FACTOR = 2.0**-9  # e4m3 bytes of int4 codes: q - 8 times this (e4m3 subnormals and 2**-6)


@dataclasses.dataclass(frozen=True)
class Op:
    """``dst = op(a, b[, c])`` on 32-bit registers; ``b``/``c`` may be ints.

    op: ``shl``/``shr`` (logical, b = count), ``and``, ``or_and`` (``(a & b) | c``,
    lop3 0xEA), ``sub2``/``mul2`` (two packed 16-bit floats of the compute dtype),
    ``prmt`` (bytes of ``a`` (0-3) and ``b`` (4-7) picked by the selector ``c``,
    a nibble per result byte; bit 3 of a nibble replicates the picked byte's
    top bit), ``rsub`` (``b - a``, 32-bit integers), ``select`` (``(a & b) | (~a & c)``,
    lop3 0xCA).
    """

    op: str
    dst: str
    a: str
    b: str | int
    c: str | int | None = None


@dataclasses.dataclass(frozen=True)
class Program:
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]  # 4 registers: output j holds positions j (low) and j + 4 (high)
    dtype: str  # bfloat16 | float16 | float8_e4m3fn (int4_e4m3_program)


def _pair(value: float, dtype: str) -> int:
    half = int(np.asarray(value, jnp.dtype(dtype)).view(np.uint16))
    return half | half << 16


def int4_program(dtype: str, offset: float) -> Program:
    """Codes ``q + offset`` (int4: offset 8; uint4: 0) to ``q`` exactly."""
    magic, base = MAGIC[dtype]
    ops, outputs = [], []
    for j in range(4):
        source = WORD
        if j:
            source = f"s{j}"
            ops.append(Op("shr", source, WORD, 4 * j))
        ops.append(Op("or_and", f"t{j}", source, 0x000F000F, magic | magic << 16))
        ops.append(Op("sub2", f"t{j}", f"t{j}", _pair(base + offset, dtype)))
        outputs.append(f"t{j}")
    return Program(tuple(ops), tuple(outputs), dtype)


def int4_e4m3_program() -> Program:
    """int4 codes (``q + 8``) of four 16-bit halves to e4m3 bytes of ``q``
    times :data:`INT4_E4M3_FACTOR`, exactly: the inputs are two registers of
    two halves each (``WORD``: halves 0, 1; ``WORD2``: 2, 3) and output j
    holds, in byte i, the code at nibble position j of half i. q >= 0 is the
    subnormal byte ``q`` (``q + 8 < 16``: the code's low 3 bits), q < 0 the
    byte ``0x80 | -q`` = ``0x88 - (q + 8)`` (8 is ``0x08``, exponent 1); the
    code's top bit picks one or the other per byte."""
    ops, outputs = [], []
    for j in range(4):
        byte = j // 2  # the byte of each half that holds nibble j
        gathered = f"g{j}"
        selector = sum((4 * (i // 2) + 2 * (i % 2) + byte) << (4 * i) for i in range(4))
        ops.append(Op("prmt", gathered, WORD, WORD2, selector))
        if j % 2:  # the nibble is the byte's high one: its top bit is the byte's
            low, top = f"l{j}", gathered
            ops.append(Op("shr", low, gathered, 4))
        else:
            low, top = gathered, f"h{j}"
            ops.append(Op("shl", top, gathered, 4))
        ops.append(Op("and", f"c{j}", low, 0x07070707))
        ops.append(Op("prmt", f"m{j}", top, top, 0xBA98))  # 0xFF where the code is 8 or more
        ops.append(Op("rsub", f"n{j}", f"c{j}", 0x88888888))
        ops.append(Op("select", f"t{j}", f"m{j}", f"c{j}", f"n{j}"))
        outputs.append(f"t{j}")
    return Program(tuple(ops), tuple(outputs), "float8_e4m3fn")


# Where the bits (m, e0, e1, s) of the e2m1 code at position j (0-3) of a
# 16-bit half sit: nibble j (the packed order), or the decode order of
# planar e2m1 weights (``to_planar(..., half_bits=True)``), where codes 0, 1,
# 2 are bf16's magnitude and sign bits shifted by 0, 3 and 6 (one shift and
# one LOP3 each, code 0 no shift) and code 3 fills the rest (three shifts):
# 11 integer ops per word against 15.
NIBBLE_BITS = tuple(tuple(4 * j + b for b in range(4)) for j in range(4))
E2M1_HALF_BITS = ((6, 7, 8, 15), (3, 4, 5, 12), (0, 1, 2, 9), (10, 11, 13, 14))


def e2m1_program(dtype: str, normalized: bool = True, bits: tuple = NIBBLE_BITS) -> Program:
    """e2m1 codes (their bits where ``bits`` says) to their values times
    :data:`E2M1_FACTOR`, exactly; with ``normalized=False`` (bf16 only) times
    :data:`E2M1_RAW_FACTOR`, one packed multiply fewer per two values. Each
    code's bits are grouped by the shift that brings them to the 16-bit
    float's magnitude (e1 e0 m under the lowest exponent bit) and sign bits:
    one shift (none for 0) and one mask op per group."""
    if not normalized and dtype != "bfloat16":
        raise ValueError(f"e2m1_program: raw (unnormalized) values need bfloat16, not {dtype}")
    # The exponent field's lowest bit and the value the multiply brings it to.
    exponent_bit, scale = {"bfloat16": (7, 2.0**120), "float16": (10, 2.0**8)}[dtype]
    targets = (exponent_bit - 1, exponent_bit, exponent_bit + 1, 15)  # m, e0, e1, sign
    ops, outputs = [], []
    for j, sources in enumerate(bits):
        groups: dict[int, int] = {}  # shift -> mask of the target bits (both halves)
        for source, target in zip(sources, targets, strict=True):
            groups[target - source] = groups.get(target - source, 0) | (1 << target) | (1 << (target + 16))
        result = None
        for g, (move, mask) in enumerate(sorted(groups.items(), key=lambda item: item[0] != 0)):
            source = WORD
            if move:
                source = f"s{j}_{g}"
                ops.append(Op("shl" if move > 0 else "shr", source, WORD, abs(move)))
            if result is None:
                result = f"t{j}"
                ops.append(Op("and", result, source, mask))
            else:
                ops.append(Op("or_and", result, source, mask, result))
        if normalized:
            ops.append(Op("mul2", result, result, _pair(scale, dtype)))
        outputs.append(result)
    return Program(tuple(ops), tuple(outputs), dtype)


def half_code(halves, position: int, bits: tuple = E2M1_HALF_BITS):
    """The code (0-15) at ``position`` (0-3) of 16-bit halves whose bits are
    laid out as ``bits`` says (NumPy or jnp integer arrays)."""
    return sum(((halves >> source) & 1) << b for b, source in enumerate(bits[position]))


def half_codes(halves, bits: tuple = E2M1_HALF_BITS) -> list:
    """The 4 codes of 16-bit halves (:func:`half_code` at each position)."""
    return [half_code(halves, position, bits) for position in range(len(bits))]


def halves_from_codes(codes, bits: tuple = E2M1_HALF_BITS):
    """Inverse of :func:`half_codes`: 4 code arrays (0-15) to 16-bit halves."""
    half = 0
    for code, sources in zip(codes, bits, strict=True):
        half = half | sum(((code >> b) & 1) << source for b, source in enumerate(sources))
    return half


def needed_ops(program: Program, register: str) -> list[Op]:
    """The ops ``register`` depends on, in program order."""
    wanted, kept = {register}, []
    for op in reversed(program.ops):
        if op.dst in wanted:
            kept.append(op)
            wanted |= {x for x in (op.a, op.b, op.c) if isinstance(x, str)}
    return kept[::-1]


def to_ptx(program: Program, position: int) -> str:
    """Inline PTX computing the value at nibble ``position`` (0-7) of the word
    ``$1`` into the 16-bit ``$0`` (Pallas's inline asm has one result)."""
    register = program.outputs[position % 4]
    halves = "{$0, other}" if position < 4 else "{other, $0}"
    return _ptx(program, register, [".reg .b16 other;"], f"mov.b32 {halves}, {register};")


def to_ptx_pair(program: Program, pair: int) -> str:
    """Inline PTX for ``pack=2`` over 16-bit halves of words: Triton packs the
    two halves into the 32-bit ``$1`` (first element low) and the two 16-bit
    results into the 32-bit ``$0``. The program's register ``pair`` computed
    on ``$1``: its low half depends on the low 16 bits only, its high half on
    the high 16 bits (checked by the tests), so each result is the code at
    nibble position ``pair`` (0-3) of its own half."""
    register = program.outputs[pair]
    return _ptx(program, register, [], f"mov.b32 $0, {register};")


def to_ptx_quad(program: Program, pair: int) -> str:
    """Inline PTX for ``pack=4`` over 16-bit halves (two 32-bit input
    registers ``$1``, ``$2``) and 8-bit results (one 32-bit ``$0``): the
    program's register ``pair``. Each result byte depends on its own half
    only, so whichever four elements Triton packs, each gets its own code."""
    register = program.outputs[pair]
    return _ptx(program, register, [], f"mov.b32 $0, {register};")


def _ptx(program: Program, register: str, declarations: list[str], result: str) -> str:
    """One asm block: the ops ``register`` needs (the input word is ``$1``),
    then the ``result`` move."""
    kind = {"bfloat16": "bf16x2", "float16": "f16x2"}.get(program.dtype)
    ops = needed_ops(program, register)
    constants = [f"k{i}" for i, op in enumerate(ops) if op.op in ("sub2", "mul2", "rsub")]
    lines = ["{", f".reg .b32 {', '.join(sorted({op.dst for op in ops} | set(constants)))};", *declarations]
    return "\n".join([*lines, *_op_lines(ops, kind), result, "}"])


def _op_lines(ops: list[Op], kind: str) -> list[str]:
    def reg(name):
        return {WORD: "$1", WORD2: "$2"}.get(name, name)

    lines = []
    for i, op in enumerate(ops):
        if op.op == "prmt":
            lines.append(f"prmt.b32 {op.dst}, {reg(op.a)}, {reg(op.b)}, {op.c:#x};")
        elif op.op == "rsub":
            lines.append(f"mov.b32 k{i}, {op.b:#x};")
            lines.append(f"sub.u32 {op.dst}, k{i}, {reg(op.a)};")
        elif op.op == "select":
            lines.append(f"lop3.b32 {op.dst}, {reg(op.a)}, {reg(op.b)}, {reg(op.c)}, 0xCA;")
        elif op.op in ("shl", "shr"):
            lines.append(f"{op.op}.b32 {op.dst}, {reg(op.a)}, {op.b};")
        elif op.op == "and":
            lines.append(f"and.b32 {op.dst}, {reg(op.a)}, {op.b:#x};")
        elif op.op == "or_and":
            c = f"{op.c:#x}" if isinstance(op.c, int) else reg(op.c)
            lines.append(f"lop3.b32 {op.dst}, {reg(op.a)}, {op.b:#x}, {c}, 0xEA;")
        else:  # packed float arithmetic takes registers only
            lines.append(f"mov.b32 k{i}, {op.b:#x};")
            lines.append(f"{op.op[:3]}.rn.{kind} {op.dst}, {reg(op.a)}, k{i};")
    return lines


def _run(units: jax.Array, ptx: str, constraints: str, pack: int, dtype: str) -> jax.Array:
    bits_dtype = jnp.int8 if jnp.dtype(dtype).itemsize == 1 else jnp.int16
    (bits,) = plgpu.elementwise_inline_asm(
        ptx,
        args=[units],
        constraints=constraints,
        pack=pack,
        result_shape_dtypes=[jax.ShapeDtypeStruct(units.shape, bits_dtype)],
    )
    return jax.lax.bitcast_convert_type(bits, jnp.dtype(dtype))


def decode_word_pairs(halves: jax.Array, program: Program, pair: int) -> jax.Array:
    """The code at nibble position ``pair`` (0-3) of each uint16 element of
    ``halves`` (16-bit halves of words: element 2u holds nibbles 0-3 of word
    u, element 2u+1 nibbles 4-7; GPU kernels only), in the program's dtype.
    Where Triton packs elements 2u and 2u+1 into one call, the joined word is
    word u and the result is the program's register ``pair`` as it is."""
    return _run(halves, to_ptx_pair(program, pair), "=r,r", 2, program.dtype)


def decode_word_position(words: jax.Array, program: Program, position: int) -> jax.Array:
    """Run ``program`` on uint32 ``words`` (GPU kernels only): the codes at
    nibble ``position`` of every word, in the program's dtype."""
    return _run(words, to_ptx(program, position), "=h,r", 1, program.dtype)


def decode_e4m3_quads(halves: jax.Array, program: Program, pair: int) -> jax.Array:
    """The code at nibble position ``pair`` (0-3) of each uint16 element of
    ``halves`` (as :func:`decode_word_pairs`; GPU kernels only) as e4m3, by
    :func:`int4_e4m3_program`: four elements a call, one result byte each."""
    return _run(halves, to_ptx_quad(program, pair), "=r,r,r", 4, program.dtype)
