"""The word decoders (inline PTX on the GPU) run by an independent NumPy
interpreter of their programs, for every code at every nibble position."""

import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import word_decode as wd

import np_ref

FLOAT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def run(program: wd.Program, words: np.ndarray) -> np.ndarray:
    """``[len(words), 8]`` float64: the 8 results per word, each position from
    only the ops its PTX block keeps."""
    out = np.empty((len(words), 8))
    for position in range(8):
        register = program.outputs[position % 4]
        regs = _interpret(program.dtype, wd.needed_ops(program, register), words)
        out[:, position] = _halves(program.dtype, regs[register])[position // 4]
    return out


def _halves(dtype, x):
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(FLOAT[dtype]).astype(np.float64)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(FLOAT[dtype]).astype(np.float64)
    return lo, hi


def _prmt(a, b, selector: int):
    """PTX ``prmt.b32`` (default mode) in NumPy: result byte i is byte n & 7
    of (b:a), n the selector's nibble i; n & 8 replicates that byte's top bit."""
    source = [(a >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    source += [(b >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = source[nibble & 7]
        if nibble & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * i)
    return out


def _interpret(dtype, ops, words, words2=None):
    regs = {wd.WORD: words.astype(np.uint64)}
    if words2 is not None:
        regs[wd.WORD2] = words2.astype(np.uint64)
    mask32 = np.uint64(0xFFFFFFFF)

    def val(x):
        return regs[x] if isinstance(x, str) else np.uint64(x)

    def pack(lo, hi):
        lo = lo.astype(FLOAT[dtype]).view(np.uint16).astype(np.uint64)
        hi = hi.astype(FLOAT[dtype]).view(np.uint16).astype(np.uint64)
        return lo | (hi << np.uint64(16))

    for op in ops:
        a = val(op.a)
        if op.op == "shl":
            out = (a << np.uint64(op.b)) & mask32
        elif op.op == "shr":
            out = a >> np.uint64(op.b)
        elif op.op == "and":
            out = a & val(op.b)
        elif op.op == "or_and":
            out = (a & val(op.b)) | val(op.c)
        elif op.op == "prmt":
            out = _prmt(a, val(op.b), op.c)
        elif op.op == "rsub":
            out = (val(op.b) - a) & mask32
        elif op.op == "select":
            out = (a & val(op.b)) | (~a & mask32 & val(op.c))
        else:  # packed float arithmetic, rounded to the 16-bit type (exact here)
            (al, ah), (bl, bh) = _halves(dtype, a), _halves(dtype, val(op.b))
            f = np.subtract if op.op == "sub2" else np.multiply
            out = pack(f(al, bl), f(ah, bh))
        regs[op.dst] = out
    return regs


def _words(rng):
    """Every code at every position, plus random words."""
    codes = np.tile(np.arange(16, dtype=np.uint64), (8, 1))  # [8 positions, 16 codes]
    words = [np.uint64(c) << np.uint64(4 * p) for p in range(8) for c in codes[p]]
    words = np.array(words + list(rng.integers(0, 2**32, size=200, dtype=np.uint64)), np.uint64)
    nibbles = np.stack([(words >> np.uint64(4 * p)) & np.uint64(0xF) for p in range(8)], axis=1).astype(np.int64)
    return words, nibbles


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("offset", [8.0, 0.0])
def test_int4_words(dtype, offset, rng):
    words, nibbles = _words(rng)
    np.testing.assert_array_equal(run(wd.int4_program(dtype, offset), words), nibbles - offset)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_e2m1_words(dtype, rng):
    words, nibbles = _words(rng)
    np.testing.assert_array_equal(run(wd.e2m1_program(dtype), words), np_ref.E2M1_TABLE[nibbles] * wd.E2M1_FACTOR)


def test_e2m1_raw_words(rng):
    """Without the normalizing multiply (bf16): the e2m1 value times 2**-126,
    bf16 subnormals for e = 0, and no multiply in the PTX."""
    words, nibbles = _words(rng)
    program = wd.e2m1_program("bfloat16", normalized=False)
    np.testing.assert_array_equal(run(program, words), np_ref.E2M1_TABLE[nibbles] * wd.E2M1_RAW_FACTOR)
    assert all(op.op != "mul2" for op in program.ops) and "mul" not in wd.to_ptx_pair(program, 2)
    with pytest.raises(ValueError, match="bfloat16"):
        wd.e2m1_program("float16", normalized=False)


@pytest.mark.parametrize("scale_byte", [0, 63, 64, 127, 190, 191, 254])
def test_e2m1_raw_times_folded_scale(scale_byte):
    """The GEMM multiplies the raw values by the e8m0 scale times 2**64 in
    bf16 (folded scales) and the sum by 2**62: exact, subnormal products
    included, for scales up to 2**63 (byte 190); byte 191 overflows (refused
    when the weight is loaded), and the smallest scales only lose the values
    below bf16's subnormals."""
    raw = np_ref.E2M1_TABLE * wd.E2M1_RAW_FACTOR
    scale = np.float64(2.0 ** (scale_byte - 127 + 64))
    with np.errstate(invalid="ignore", over="ignore"):  # 0 x inf past the window
        folded = np.asarray(raw, ml_dtypes.bfloat16).astype(np.float64) * np.asarray(scale, ml_dtypes.bfloat16)
        product = np.asarray(folded, ml_dtypes.bfloat16).astype(np.float64) * 2.0**62
    true = np_ref.E2M1_TABLE * 2.0 ** (scale_byte - 127)
    if scale_byte > 190:
        assert not np.all(np.isfinite(product))
    elif scale_byte >= 64:
        np.testing.assert_array_equal(product, true)
    else:  # below the window: tiny values may round (never grow)
        assert np.all(np.abs(product - true) <= 2.0 ** (-133 + 62))


@pytest.mark.parametrize("dtype,normalized", [("bfloat16", False), ("bfloat16", True), ("float16", True)])
def test_e2m1_half_bits_words(dtype, normalized, rng):
    """The decoder's bit order (E2M1_HALF_BITS): every code at every position
    and random words decode like nibbles do, in 11 integer ops per word
    (nibble order: 15); half_codes / halves_from_codes are inverses."""
    words, nibbles = _words(rng)
    codes = [np.asarray(nibbles[:, p], np.uint64) for p in range(8)]
    low = wd.halves_from_codes(codes[:4])
    high = wd.halves_from_codes(codes[4:])
    for j, code in enumerate(wd.half_codes(low)):
        np.testing.assert_array_equal(code, codes[j])
    program = wd.e2m1_program(dtype, normalized, wd.E2M1_HALF_BITS)
    factor = wd.E2M1_FACTOR if normalized else wd.E2M1_RAW_FACTOR
    np.testing.assert_array_equal(run(program, low | (high << np.uint64(16))), np_ref.E2M1_TABLE[nibbles] * factor)
    integer_ops = [op for op in program.ops if op.op not in ("mul2", "sub2")]
    if dtype == "bfloat16":
        assert len(integer_ops) == 11
    assert len([op for op in wd.e2m1_program(dtype, normalized).ops if op.op != "mul2"]) == 15


def test_ptx_text():
    """One 16-bit result per position ($0), the word is $1, only the needed ops."""
    text = wd.to_ptx(wd.e2m1_program("bfloat16"), 5)
    assert text.startswith("{") and text.endswith("}")
    assert "mov.b32 {other, $0}, t1;" in text and "lop3.b32 t1, s1_1, 0x80008000, t1, 0xEA;" in text
    assert "mul.rn.bf16x2 t1, t1, k" in text and "t0" not in text
    text = wd.to_ptx(wd.int4_program("float16", 8.0), 2)
    assert "mov.b32 {$0, other}, t2;" in text and "shr.b32 s2, $1, 8;" in text and "sub.rn.f16x2" in text


def test_pair_ptx_text():
    """``pack=2`` over 16-bit halves: Triton packs the two halves into the
    32-bit $1; register ``pair`` of it is the 32-bit $0."""
    text = wd.to_ptx_pair(wd.int4_program("bfloat16", 8.0), 3)
    assert text.startswith("{") and text.endswith("}")
    assert "mov.b32 $0, t3;" in text and "shr.b32 s3, $1, 12;" in text and "sub.rn.bf16x2 t3, t3, k" in text
    assert "other" not in text and "$2" not in text and "t2" not in text
    text = wd.to_ptx_pair(wd.e2m1_program("float16"), 0)
    assert "mov.b32 $0, t0;" in text and "mul.rn.f16x2 t0, t0, k" in text


def _packed(first, second):
    """Two 16-bit operands as Triton's ``pack=2`` hands them to the asm: one
    32-bit register, the first element in the low half."""
    return (first & np.uint64(0xFFFF)) | ((second & np.uint64(0xFFFF)) << np.uint64(16))


def _halves_of(words):
    """uint32 words as their 16-bit halves in memory order (little-endian)."""
    return np.stack([words & np.uint64(0xFFFF), words >> np.uint64(16)], axis=1).reshape(-1)


@pytest.mark.parametrize(
    "program",
    [
        wd.int4_program("bfloat16", 8.0),
        wd.e2m1_program("float16"),
        wd.e2m1_program("bfloat16", False, wd.E2M1_HALF_BITS),
    ],
)
def test_pair_decoder_on_any_two_halves(program, rng):
    """Whichever two halves Triton packs into one call (a word's two halves,
    or two unrelated elements, as in layouts that pair rows), each result is
    the code at nibble ``pair`` of its own half."""
    words, _ = _words(rng)
    halves = _halves_of(words)
    alone = run(program, halves)  # each half decoded as a word of its own: positions 0-3
    partners = {"the word's halves": np.arange(len(halves)) ^ 1, "shuffled": rng.permutation(len(halves))}
    for name, partner in partners.items():
        joined = _packed(halves, halves[partner])
        for pair in range(4):
            register = program.outputs[pair]
            regs = _interpret(program.dtype, wd.needed_ops(program, register), joined)
            low, high = _halves(program.dtype, regs[register])
            np.testing.assert_array_equal(low, alone[:, pair], err_msg=name)
            np.testing.assert_array_equal(high, alone[partner, pair], err_msg=name)


@pytest.mark.parametrize("program", [wd.int4_program("bfloat16", 8.0), wd.e2m1_program("float16")])
def test_pair_registers_hold_nibbles_j_and_j_plus_4(program, rng):
    """Where a word's two halves are packed together (the decode layouts),
    the joined register is the word: register ``pair`` holds the value at
    nibble ``pair`` (low) and ``pair + 4`` (high), one k-pair of the MMA."""
    words, _ = _words(rng)
    single = run(program, words)
    halves = _halves_of(words)
    joined = _packed(halves[0::2], halves[1::2])
    np.testing.assert_array_equal(joined, words)
    for pair in range(4):
        register = program.outputs[pair]
        regs = _interpret(program.dtype, wd.needed_ops(program, register), joined)
        low, high = _halves(program.dtype, regs[register])
        np.testing.assert_array_equal(low, single[:, pair])
        np.testing.assert_array_equal(high, single[:, pair + 4])


def test_int4_e4m3_quads(rng):
    """Four halves a call (two registers): byte i of output j is the e4m3
    byte of (code - 8) x 2**-9 of nibble j of half i, for every code at every
    position of every half and random halves; 6 ops an output, no float op."""
    program = wd.int4_e4m3_program()
    codes = np.concatenate([np.arange(16), rng.integers(0, 16, 400)])
    halves = [rng.integers(0, 2**16, size=len(codes) * 4, dtype=np.uint64) for _ in range(4)]
    for h in range(4):  # half h, position p: every code, the others random
        for p in range(4):
            part = slice(p * len(codes), (p + 1) * len(codes))
            planted = codes.astype(np.uint64) << np.uint64(4 * p)
            halves[h][part] = (halves[h][part] & ~np.uint64(0xF << (4 * p))) | planted
    first = halves[0] | (halves[1] << np.uint64(16))
    second = halves[2] | (halves[3] << np.uint64(16))
    for j in range(4):
        register = program.outputs[j]
        ops = wd.needed_ops(program, register)
        assert len(ops) == 6 and all(op.op not in ("sub2", "mul2") for op in ops)
        out = _interpret(program.dtype, ops, first, second)[register]
        for i in range(4):
            byte = ((out >> np.uint64(8 * i)) & np.uint64(0xFF)).astype(np.uint8)
            value = byte.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            code = ((halves[i] >> np.uint64(4 * j)) & np.uint64(0xF)).astype(np.int64)
            np.testing.assert_array_equal(value, (code - 8) * wd.INT4_E4M3_FACTOR)


def test_quad_ptx_text():
    """``pack=4``: the four halves arrive as $1 and $2, the four bytes leave as $0."""
    text = wd.to_ptx_quad(wd.int4_e4m3_program(), 1)
    assert text.startswith("{") and text.endswith("}")
    assert "prmt.b32 g1, $1, $2, 0x6420;" in text and "mov.b32 $0, t1;" in text
    assert "lop3.b32 t1, m1, c1, n1, 0xCA;" in text and "sub.u32 n1, k" in text and "g0" not in text
