"""Weight formats: codecs, packing, quantize/dequantize round trips with bounds
derived from each format's step, checked against float64 NumPy decoding."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import formats as F
from humming_jax import numerics
from pallas_kernels import codecs

import np_ref
from sweep import sweep

# ---- codecs --------------------------------------------------------------


def test_pack_layout_and_round_trip(rng):
    codes = rng.integers(0, 16, size=(3, 5, 64), dtype=np.uint8)
    packed = np.asarray(numerics.pack_nibbles(jnp.asarray(codes)))
    assert packed.shape == (3, 5, 32) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(numerics.unpack_nibbles(jnp.asarray(packed))), codes)


def test_pack_rejects_odd_k():
    with pytest.raises(ValueError, match="even"):
        numerics.pack_nibbles(jnp.zeros((2, 7), jnp.uint8))


def test_e2m1_decode_all_codes():
    codes = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(numerics.e2m1_decode(codes), np.float64), np_ref.E2M1_TABLE)


def test_e2m1_encode_matches_round_to_nearest_even(rng):
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = np.concatenate([rng.normal(0, 3, 4000), ties, -ties, [0.0, 6.0, 7.0, 100.0, -100.0]]).astype(np.float32)
    codes = np.asarray(numerics.e2m1_encode(jnp.asarray(x)))
    expected = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float64)  # RNE, saturating
    np.testing.assert_array_equal(np.abs(np_ref.E2M1_TABLE[codes]), np.abs(expected))
    assert np.all(np.sign(np_ref.E2M1_TABLE[codes]) * np.sign(x) >= 0)


def _log_uniform(rng, low_exp, high_exp, n):
    magnitude = 2.0 ** rng.uniform(low_exp, high_exp, n)
    return (magnitude * rng.choice([-1.0, 1.0], n)).astype(np.float32)


def test_float8_e4m3_cast_rounds_to_nearest_even_under_jit(rng):
    """f32 -> e4m3 (saturating) and back, compiled, over the subnormal, normal and
    saturating ranges and every midpoint between two e4m3 values: the compiler's
    conversion must round once to nearest-even, as ml_dtypes does."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid)])
    midpoints = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    x = np.concatenate([_log_uniform(rng, -12, 10, 20000), midpoints, -midpoints, [0.0, 448.0, 464.0, 1e6]])
    x = x.astype(np.float32)
    cast = jax.jit(lambda v: numerics.cast_float8_saturating(v, jnp.float8_e4m3fn))
    got = np.asarray(cast(jnp.asarray(x))).view(np.uint8)
    expected = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, (
        f"{bad.size} of {x.size} differ, e.g. x={x[bad[:5]]} got={got[bad[:5]]} want={expected[bad[:5]]}"
    )
    decode = jax.jit(lambda b: jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32))
    codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(decode(jnp.asarray(codes)))[finite], codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)[finite]
    )
    # Converted back to f32 in the same computation (XLA may fuse away a convert pair).
    round_trip = jax.jit(lambda v: numerics.cast_float8_saturating(v, jnp.float8_e4m3fn).astype(jnp.float32) * 1.0)
    np.testing.assert_array_equal(np.asarray(round_trip(jnp.asarray(x))), expected.view(ml_dtypes.float8_e4m3fn))
    e5m2 = jax.jit(lambda v: numerics.cast_float8_saturating(v, jnp.float8_e5m2).astype(jnp.float32))
    np.testing.assert_array_equal(
        np.asarray(e5m2(jnp.asarray(x))), np.clip(x, -57344, 57344).astype(ml_dtypes.float8_e5m2).astype(np.float32)
    )


def test_scaling_is_within_three_ulp_under_jit(rng):
    """The quantizers' ``x * safe_reciprocal(scale)``, compiled: on the CPU the
    product of the correctly rounded reciprocal; XLA's GPU compiler divides with
    ``div.full.f32`` (up to 2 ulp) — measured on the H200: neither the product nor
    the quotient bit for bit. So the references agree with float64 to 3 ulp
    (< 4e-7 relative), which is why the quantizer tests let values within 1e-6
    of a rounding boundary go either way."""
    x = _log_uniform(rng, -20, 20, 20000)
    scale = np.abs(_log_uniform(rng, -30, 30, 20000))
    got = np.asarray(jax.jit(lambda a, s: a * numerics.safe_reciprocal(s))(jnp.asarray(x), jnp.asarray(scale)))
    x64, scale64 = x.astype(np.float64), scale.astype(np.float64)
    product = (x64 * (1.0 / scale64).astype(np.float32)).astype(np.float32)
    quotient = (x64 / scale64).astype(np.float32)
    if jax.default_backend() == "cpu":
        assert np.all((got == product) | (got == quotient))
    np.testing.assert_allclose(got, quotient, rtol=4e-7, atol=0)


def test_e8m0_decodes_exactly():
    byte = jnp.arange(255, dtype=jnp.uint8)
    decoded = np.asarray(numerics.e8m0_decode(byte))
    # Compare bit patterns: 2**-127 is an f32 subnormal, which arithmetic may flush.
    expected = (2.0 ** (np.arange(255) - 127.0)).astype(np.float32)
    np.testing.assert_array_equal(decoded.view(np.uint32), expected.view(np.uint32))
    assert np.isnan(np.asarray(numerics.e8m0_decode(jnp.uint8(255))))
    # Without the NaN byte's select (bytes bounded by the caller) every other byte decodes the same.
    unchecked = np.asarray(codecs.e8m0_decode(byte, 0, nan=False))
    np.testing.assert_array_equal(unchecked.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_pow2_is_exact_to_the_smallest_subnormal(dtype):
    """2**e from its bits against NumPy's ldexp in float64, rounded once: every
    normal and subnormal power, zero below; ``normal_only`` equal on the normals."""
    info = jnp.finfo(dtype)
    lowest = int(info.minexp) - int(info.nmant)  # the smallest subnormal's exponent
    exponent = np.arange(lowest - 3, int(info.maxexp), dtype=np.int32)
    got = np.asarray(codecs.pow2(jnp.asarray(exponent), dtype).astype(jnp.float32), np.float64)
    want = np.where(exponent >= lowest, np.ldexp(1.0, exponent), 0.0)
    np.testing.assert_array_equal(got, want)
    normal = exponent[exponent >= int(info.minexp)]
    fast = codecs.pow2(jnp.asarray(normal), dtype, normal_only=True).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(fast, np.float64), np.ldexp(1.0, normal))


def test_e8m0_from_amax_is_smallest_sufficient_power(rng):
    amax = np.abs(rng.normal(0, 100, 1000)).astype(np.float32)
    amax[:4] = [6.0, 12.0, 3.0, 1e-30]
    byte = np.asarray(numerics.e8m0_from_amax(jnp.asarray(amax), 6.0)).astype(np.float64)
    scale = 2.0 ** (byte - 127)
    assert np.all(amax / scale <= 6.0)
    assert np.all(amax / (scale / 2) > 6.0)
    assert int(np.asarray(numerics.e8m0_from_amax(jnp.zeros(1), 6.0))[0]) == 0


def test_e4m3_scales_decode_exactly():
    bits = np.arange(256, dtype=np.uint8)
    finite = (bits & 0x7F) != 0x7F
    values = jnp.asarray(bits).view(jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(values, np.float64)[finite], np_ref.e4m3_from_bits(bits)[finite])


# ---- round trips -----------------------------------------------------------


def _half_gap_e2m1(v):
    return np.where(v < 2, 0.25, np.where(v < 4, 0.5, 1.0))


def _error_bound(weight, w):
    """Per-element bound on |w - dequant(quant(w))| from the format's step."""
    fmt = weight.format
    shape = w.shape
    if not fmt.is_quantized:
        if fmt.value_type.value == "bfloat16":
            return np.abs(w) * 2.0**-8  # half ulp of 8 significant bits
        return np.maximum(np.abs(w) * 2.0**-11, 2.0**-25)  # f16: 11 bits; subnormal step 2^-24
    scale = np.asarray(weight.scale)
    scale = 2.0 ** (scale.astype(np.float64) - 127) if fmt.scale_type.value == "e8m0" else np_ref.to64(scale)
    s = np_ref.expand(scale, shape, np_ref.scale_blocks(fmt))
    vt = fmt.value_type.value
    if vt in ("int4", "int8"):
        return 0.5 * s  # q = round(w/s) with |w|/s <= qmax(1 + scale rounding) < qmax + 0.5
    if vt == "uint4":
        return (0.5 + 15 * 2.0**-8) * s  # rounding, plus a clip of at most 15 bf16 ulps of the range
    if vt == "float8_e4m3":
        return np.maximum(np.abs(w) * 2.0**-4, s * 2.0**-10)  # half ulp of 3 mantissa bits; subnormal step 2^-9
    if weight.second_scale is not None:  # NVFP4: e4m3 block scale times the global scale
        second = np.asarray(weight.second_scale, np.float64).reshape(-1, 1, 1)
        s = s * second
        v = np.abs(w) / s
        return s * _half_gap_e2m1(np.minimum(v, 6)) + np.maximum(np.abs(w) - 6 * s, 0)
    return s * _half_gap_e2m1(np.abs(w) / s)  # MXFP4: amax/s <= 6, no saturation


SHAPES = {"fp8_block128": (2, 192, 320)}  # a partial block along N and along K


# make test: every format without a bias, and with one a format of each storage family (the bias is
# stored apart from the codes, as given; --full: every format with one).
_BIASED = ("bf16", "int4_g128", "uint4_zp_g128", "int8_channel", "fp8_block128", "mxfp4", "nvfp4")


@pytest.mark.parametrize(
    "name,bias",
    sweep(
        [(name, bias) for bias in (False, True) for name in sorted(F.PRESETS)],
        lambda case: not case[1] or case[0] in _BIASED,
    ),
)
def test_round_trip_within_step(name, bias, rng):
    e, n, k = SHAPES.get(name, (2, 48, 256))
    w = rng.normal(0, 0.05, (e, n, k)).astype(np.float32)
    w[0, 0, :8] *= 30  # outliers
    fmt = F.get_format(name).with_bias(bias)
    b = rng.normal(size=(e, n)).astype(np.float32) if bias else None
    weight = F.quantize_weight(jnp.asarray(w), fmt, bias=None if b is None else jnp.asarray(b))
    weight.validate()
    deq_jax = np.asarray(F.dequantize_weight(weight), np.float64)
    deq_np = np_ref.dequantize_weight(weight)
    np.testing.assert_allclose(deq_jax, deq_np, rtol=1e-6, atol=1e-12)
    w64 = w.astype(np.float64)
    bound = _error_bound(weight, w64)
    excess = np.abs(deq_np - w64) - bound * (1 + 1e-5) - 1e-12
    assert excess.max() <= 0, f"{name}: error exceeds the step bound by {excess.max()}"
    if bias:
        np.testing.assert_array_equal(np.asarray(weight.bias), b)


def test_int4_values_stay_in_range(rng):
    w = rng.normal(size=(1, 16, 128)).astype(np.float32)
    codes = np_ref.unpack(np.asarray(F.quantize_weight(jnp.asarray(w), F.INT4_G128).values)).astype(int) - 8
    assert codes.min() >= -7 and codes.max() <= 7
    assert np.abs(codes).max() == 7


def test_zero_weight_gives_zero_without_nan():
    for fmt in F.PRESETS.values():
        e, n, k = SHAPES.get(fmt.name, (1, 16, 256))
        weight = F.quantize_weight(jnp.zeros((e, n, k)), fmt)
        deq = np.asarray(F.dequantize_weight(weight))
        assert np.all(deq == 0), fmt.name


def test_two_dimensional_weight_is_one_expert(rng):
    w = rng.normal(size=(32, 64)).astype(np.float32)
    weight = F.quantize_weight(jnp.asarray(w), F.INT8_CHANNEL)
    assert weight.shape == (1, 32, 64)


def test_quantized_weight_is_a_pytree_with_static_format(rng):
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(2, 16, 64)), jnp.float32), F.NVFP4)
    leaves, tree = jax.tree_util.tree_flatten(weight)
    assert len(leaves) == 3  # values, scale, second_scale
    rebuilt = jax.tree_util.tree_unflatten(tree, leaves)
    assert rebuilt.format == F.NVFP4 and rebuilt.shape == (2, 16, 64)
    doubled = jax.jit(lambda q: F.dequantize_weight(q) * 2)(weight)
    np.testing.assert_allclose(np.asarray(doubled), 2 * np.asarray(F.dequantize_weight(weight)))


def test_formats_are_hashable_and_named():
    assert len({hash(f) for f in F.PRESETS.values()}) == len(F.PRESETS)
    assert F.get_format("int4_g128+bias").has_bias
    custom = dataclasses.replace(F.INT4_G128, group_size=256, name="int4_g256")
    assert custom.scale_shape(2, 8, 512) == (2, 8, 2)


# ---- bad input -------------------------------------------------------------


def test_odd_k_for_4bit_raises():
    with pytest.raises(ValueError, match="K must be even"):
        F.quantize_weight(jnp.zeros((1, 4, 33)), F.MXFP4)


def test_k_not_multiple_of_group_raises():
    with pytest.raises(ValueError, match="groups of 128"):
        F.quantize_weight(jnp.zeros((1, 4, 96)), F.INT4_G128)


def test_wrong_rank_raises():
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        F.quantize_weight(jnp.zeros((1, 1, 4, 32)), F.INT8_CHANNEL)


def test_bias_mismatch_raises():
    with pytest.raises(ValueError, match="bias"):
        F.quantize_weight(jnp.zeros((1, 4, 32)), F.INT8_CHANNEL, bias=jnp.zeros((1, 4)))
    with pytest.raises(ValueError, match="bias"):
        F.quantize_weight(jnp.zeros((1, 4, 32)), F.INT8_CHANNEL.with_bias(), bias=jnp.zeros((1, 5)))


def test_bad_format_fields_raise():
    with pytest.raises(ValueError, match="value_type"):
        F.WeightFormat("x", "int3")
    with pytest.raises(ValueError, match="group_size"):
        F.WeightFormat("x", "int4", "group", "bfloat16", 48)
    with pytest.raises(ValueError, match="zero_point"):
        F.WeightFormat("x", "int8", "group", "bfloat16", 32, zero_point="int")
    with pytest.raises(ValueError, match="unknown name"):
        F.get_format("int5")


def test_validate_names_the_part(rng):
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(2, 16, 128)), jnp.float32), F.INT4_G32)
    broken = dataclasses.replace(weight, scale=weight.scale[:, :, :2])
    with pytest.raises(ValueError, match=r"weight\.scale: expected shape"):
        broken.validate()
    with pytest.raises(TypeError, match=r"weight\.values: expected dtype uint8"):
        dataclasses.replace(weight, values=weight.values.astype(jnp.int8)).validate()


@pytest.mark.parametrize("fmt_name", ["int4_g128", "uint4_zp_g128", "mxfp4", "nvfp4", "int4_channel"])
def test_planar_order_against_numpy(fmt_name):
    """``to_planar`` against a NumPy construction from the definition: nibble i
    of each unit holds column ``i // 4 + (unit / 4) * (i % 4)``; the 16-bit
    half h of a unit then holds columns h + unit/4 * j at nibble j. Scales and
    zero points are untouched, the dequantized weight is the same, and
    ``to_k_order`` restores the stored bytes."""
    rng = np.random.default_rng(3)
    fmt = F.get_format(fmt_name)
    e, n, k = 2, 8, 256
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(e, n, k)), jnp.float32), fmt)
    unit = F.planar_unit(fmt, k)
    assert unit == (fmt.group_size if fmt.group_size else 128)
    planar = F.to_planar(weight)
    planar.validate()
    codes = np.asarray(weight.values).astype(np.int64)
    codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(e, n, k)  # column order
    expected = np.empty_like(codes)
    for i in range(k):
        base, within = i - i % unit, i % unit
        expected[..., i] = codes[..., base + within // 4 + (unit // 4) * (within % 4)]
    stored = np.asarray(planar.values).astype(np.int64)
    np.testing.assert_array_equal(stored, expected[..., 0::2] | (expected[..., 1::2] << 4))
    halves = stored.reshape(e, n, k // 4, 2)
    halves = halves[..., 0] | (halves[..., 1] << 8)  # little-endian 16-bit halves
    h = min(5, unit // 4 - 1)  # half h of unit 1: nibble j is column unit + h + unit/4 * j
    for j in range(4):
        np.testing.assert_array_equal(
            (halves[..., unit // 4 + h] >> (4 * j)) & 15, codes[..., unit + h + unit // 4 * j]
        )
    for part in ("scale", "zero_point", "second_scale"):
        assert getattr(planar, part) is getattr(weight, part)
    np.testing.assert_array_equal(np.asarray(F.dequantize_weight(planar)), np.asarray(F.dequantize_weight(weight)))
    back = F.to_k_order(planar)
    assert back.nibble_unit == 0
    np.testing.assert_array_equal(np.asarray(back.values), np.asarray(weight.values))
    assert F.to_planar(planar) is planar


def test_planar_only_where_it_applies():
    """Unpacked formats and K not a whole number of units stay in K order; a
    wrong ``nibble_unit`` is refused naming the field."""
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.normal(size=(1, 8, 192)), jnp.float32)
    assert F.planar_unit(F.get_format("int8_channel"), 256) == 0
    assert F.planar_unit(F.get_format("int4_channel"), 192) == 0  # 192 is not a multiple of 128
    for name in ("int8_channel", "int4_channel", "bf16"):
        weight = F.quantize_weight(w, F.get_format(name))
        assert F.to_planar(weight) is weight
    weight = F.quantize_weight(w, F.get_format("int4_g64"))
    with pytest.raises(ValueError, match="nibble_unit"):
        dataclasses.replace(weight, nibble_unit=128).validate()


def test_mxfp4_scales_past_the_folded_range_are_refused(rng):
    """The GEMM folds MXFP4 scales up to 2**63 exactly (e8m0 byte 190): a
    weight with a larger scale is refused where it is concrete (quantizing,
    to_planar, checkpoint loading), naming the part."""
    w = rng.normal(size=(1, 8, 64)).astype(np.float32)
    fine = F.quantize_weight(jnp.asarray(w * 2.0**60), F.MXFP4)
    assert int(np.max(np.asarray(fine.scale))) <= F.E8M0_FOLD_MAX
    F.to_planar(fine)
    with pytest.raises(ValueError, match=r"weight\.scale: MXFP4 e8m0 scales must be at most 190"):
        F.quantize_weight(jnp.asarray(w * 2.0**70), F.MXFP4)
    big = dataclasses.replace(fine, scale=jnp.full_like(fine.scale, 191))
    with pytest.raises(ValueError, match="at most 190"):
        F.to_planar(big)
    jax.jit(F.check_folded_scale_range)(big)  # traced: unchecked


@pytest.mark.parametrize("fmt_name", ["mxfp4", "int4_g128", "uint4_zp_g128"])
def test_k_major_scales_round_trip(fmt_name, rng):
    """``to_planar(k_major_scales=True)``: per-group scales stored ``[E, K/g,
    N]``, the same dequantized weight (against float64 NumPy on the scales
    transposed back), back to ``[E, N, K/g]`` exactly by ``to_k_order``;
    zero points keep their order."""
    fmt = F.get_format(fmt_name)
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(3, 16, 256)), jnp.float32), fmt)
    groups = 256 // fmt.group_size
    major = F.to_planar(weight, k_major_scales=True)
    assert major.k_major_scales and major.nibble_unit
    assert major.scale.shape == (3, groups, 16)
    np.testing.assert_array_equal(np.asarray(major.scale), np.swapaxes(np.asarray(weight.scale), 1, 2))
    assert major.zero_point is weight.zero_point
    major.validate()
    np.testing.assert_array_equal(np.asarray(F.dequantize_weight(major)), np.asarray(F.dequantize_weight(weight)))
    np.testing.assert_allclose(np.asarray(F.dequantize_weight(major)), np_ref.dequantize_weight(weight), rtol=1e-6)
    back = F.to_k_order(major)
    assert not back.k_major_scales and back.nibble_unit == 0
    for part in ("values", "scale"):
        np.testing.assert_array_equal(np.asarray(getattr(back, part)), np.asarray(getattr(weight, part)))
    assert F.with_scale_order(major, True) is major
    # a planar weight still takes the other order; the flag without the transposed array is refused
    assert F.to_planar(F.to_planar(weight), k_major_scales=True).scale.shape == (3, groups, 16)
    with pytest.raises(ValueError, match=rf"weight\.scale: expected shape \(3, {groups}, 16\)"):
        dataclasses.replace(weight, k_major_scales=True).validate()


def test_k_major_scales_only_for_group_scales(rng):
    """Scales that are not per group (channel, tensor, blocks) and act-order
    weights keep their order; a weight claiming the flag is refused naming it;
    the layer's kernel order takes it for MXFP4's e8m0 scales only."""
    w = jnp.asarray(rng.normal(size=(2, 8, 256)), jnp.float32)
    for name in ("int8_channel", "fp8_block128", "bf16"):
        weight = F.quantize_weight(w, F.get_format(name))
        assert F.with_scale_order(weight, True) is weight
    channel = F.quantize_weight(w, F.get_format("int8_channel"))
    with pytest.raises(ValueError, match="k_major_scales: only per-group scales"):
        dataclasses.replace(channel, k_major_scales=True).validate()
    assert F.k_major_scales_preferred(F.MXFP4)
    assert not F.k_major_scales_preferred(F.INT4_G128) and not F.k_major_scales_preferred(F.get_format("nvfp4"))


@pytest.mark.parametrize("fmt_name", ["mxfp4", "nvfp4"])
def test_planar_half_bits_round_trip(fmt_name, rng):
    """``to_planar(half_bits=True)``: e2m1 codes in the pair decoder's bit order,
    the same dequantized weight, back to K order exactly; other formats and
    K-order weights refuse the flag."""
    fmt = F.get_format(fmt_name)
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(2, 8, 256)), jnp.float32), fmt)
    bits = F.to_planar(weight, half_bits=True)
    assert bits.half_bits and bits.nibble_unit
    np.testing.assert_array_equal(np.asarray(F.dequantize_weight(bits)), np.asarray(F.dequantize_weight(weight)))
    np.testing.assert_array_equal(np.asarray(F.to_k_order(bits).values), np.asarray(weight.values))
    assert not F.to_k_order(bits).half_bits
    int4 = F.quantize_weight(jnp.asarray(rng.normal(size=(2, 8, 256)), jnp.float32), F.INT4_G128)
    assert not F.to_planar(int4, half_bits=True).half_bits  # not an e2m1 format: nibble order
    with pytest.raises(ValueError, match="half_bits"):
        dataclasses.replace(weight, half_bits=True).validate()


@pytest.mark.parametrize(
    "fmt_name,block,planar",
    [
        ("bf16", 32, False),
        ("int4_g128+bias", 32, True),
        ("uint4_zp_g128", 16, False),
        ("mxfp4", 32, True),
        ("nvfp4", 32, False),
        ("fp8_channel", 8, False),
        ("fp8_block128", 128, False),
        ("fp8_block128", 64, False),  # one scale a 64-row block, its 128-row block's
    ],
)
def test_gate_up_rows_interleaved_against_numpy(fmt_name, block, planar, rng):
    """``interleave_gate_up``: stored row r holds logical row
    ``np_ref.gate_up_rows(n, block)[r]`` with its scales, zero points and bias
    (block scales by whole blocks, or repeated for each smaller block);
    ``gate_up_halves`` gives back the arrays bit for bit."""
    fmt = F.get_format(fmt_name)
    e, n, k = 2, 512, 256
    w = jnp.asarray(rng.normal(size=(e, n, k)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(e, n)), jnp.float32) if fmt.has_bias else None
    weight = F.quantize_weight(w, fmt, bias=bias)
    if planar:
        weight = F.to_planar(weight, k_major_scales=True)
    interleaved = hj.interleave_gate_up(weight, block)
    interleaved.validate()
    assert interleaved.gate_up_block == block
    rows = np_ref.gate_up_rows(n, block)
    logical = np_ref.dequantize_weight(weight)
    np.testing.assert_array_equal(np_ref.dequantize_weight(interleaved, stored_rows=True), logical[:, rows])
    np.testing.assert_array_equal(np_ref.dequantize_weight(interleaved), logical)
    if bias is not None:
        np.testing.assert_array_equal(np.asarray(interleaved.bias), np.asarray(weight.bias)[:, rows])
    if fmt.scale_granularity.value == "block":  # each stored block's scale, that of its logical rows' block
        per = min(block, fmt.block_n)
        want = np.asarray(weight.scale)[:, rows[::per] // fmt.block_n]
        np.testing.assert_array_equal(np.asarray(interleaved.scale), want)
    back = hj.gate_up_halves(interleaved)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(weight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.gate_up_block == 0 and hj.interleave_gate_up(interleaved, block) is interleaved


def test_gate_up_blocks_of_64_across_a_shared_scale_block(rng):
    """I = 192: fp8_block128's second scale block holds gate rows 128-191 and
    up rows 0-63; interleaved by 64 each of those blocks stores that scale,
    and the halves come back bit for bit."""
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(2, 384, 256)), jnp.float32), F.FP8_BLOCK128)
    interleaved = hj.interleave_gate_up(weight, 64)
    interleaved.validate()
    rows = np_ref.gate_up_rows(384, 64)
    np.testing.assert_array_equal(np.asarray(interleaved.scale), np.asarray(weight.scale)[:, rows[::64] // 128])
    np.testing.assert_array_equal(np_ref.dequantize_weight(interleaved), np_ref.dequantize_weight(weight))
    library = np.asarray(hj.dequantize_weight(interleaved, jnp.float32))
    np.testing.assert_array_equal(library, np.asarray(hj.dequantize_weight(weight, jnp.float32)))
    for a, b in zip(jax.tree.leaves(hj.gate_up_halves(interleaved)), jax.tree.leaves(weight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gate_up_block_refusals(rng):
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(2, 256, 128)), jnp.float32), F.get_format("fp8_block128"))
    with pytest.raises(ValueError, match="blocks of 128 rows"):
        wide = F.quantize_weight(jnp.asarray(rng.normal(size=(1, 384, 128)), jnp.float32), weight.format)
        hj.interleave_gate_up(wide, 96)  # neither whole scale blocks nor a divisor of them
    with pytest.raises(ValueError, match="weight.scale: expected shape"):  # the 64-row blocks' scales, not the 128's
        dataclasses.replace(weight, gate_up_block=64).validate()
    with pytest.raises(ValueError, match="whole number of gate/up pairs"):
        hj.interleave_gate_up(F.quantize_weight(jnp.ones((1, 96, 128), jnp.float32), F.BF16), 32)
    interleaved = hj.interleave_gate_up(F.quantize_weight(jnp.ones((1, 128, 128), jnp.float32), F.BF16), 32)
    with pytest.raises(ValueError, match="interleaved by 32 already"):
        hj.interleave_gate_up(interleaved, 16)
    with pytest.raises(ValueError, match="weight.gate_up_block"):
        dataclasses.replace(interleaved, gate_up_block=48).validate()


def test_weight_functions_name_what_they_got():
    """The public functions of a QuantizedWeight given a plain array: a
    TypeError naming the function and the argument (was an AttributeError)."""
    raw = jnp.ones((2, 8, 32), jnp.bfloat16)
    for fn in (hj.dequantize_weight, hj.to_planar, hj.to_k_order, hj.interleave_gate_up, hj.gate_up_halves):
        with pytest.raises(TypeError, match=f"{fn.__name__}: weight: expected a QuantizedWeight"):
            fn(raw)
