"""Activation quantization, Hadamard rotation and activations against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from humming_jax import input_quant as Q
from humming_jax.activations import Activation, ActivationSpec, apply_activation

import np_ref


def _heavy_tailed(rng, m, k):
    x = rng.standard_t(df=2, size=(m, k)).astype(np.float32)
    x[1] = 0.0  # a zero row: its scale must not produce NaN or Inf
    x[2] = 0.37  # all-equal row
    return x


def _expected_scale(x64, spec, static_scale=None):
    """Scale (and second scale) of each row/group by the spec's definition, float64."""
    qmax = spec.dtype.max_value
    m, k = x64.shape
    mode = spec.mode.value
    if mode == "static_tensor":
        return np.full((m, 1), static_scale), None
    if mode == "dynamic_token":
        scale = np.abs(x64).max(1, keepdims=True) / qmax
        floor = 1.0 / (qmax * 512) if spec.dtype.value.startswith("float8") else 0.0  # vLLM's per-token fp8 floor
        return np.maximum(scale, floor), None
    amax = np.abs(x64).reshape(m, k // spec.group_size, spec.group_size).max(-1)
    if mode == "dynamic_group":
        if spec.scale_type.value == "e8m0":
            with np.errstate(divide="ignore"):
                exponent = np.where(amax > 0, np.ceil(np.log2(amax / qmax)), -127)
            return 2.0**exponent, None
        return amax / qmax, None
    second = (
        np.full((m, 1), static_scale)
        if mode == "static_tensor_dynamic_group"
        else np.abs(x64).max(1, keepdims=True) / (448.0 * qmax)
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        group = np.where(second > 0, amax / qmax / second, 0)
    return np.minimum(group, 448), second


def _assert_scale_close(got, raw, scale_type):
    """f32 scales within 1e-6 relative; e4m3 scales must be a nearest e4m3 value
    of the exact scale (either neighbour on a tie, up to 1e-5 relative)."""
    if scale_type != "float8_e4m3":
        np.testing.assert_allclose(got, raw, rtol=1e-6)
        return
    ulp = np.where(raw < 2.0**-6, 2.0**-9, 2.0 ** (np.floor(np.log2(np.maximum(raw, 2.0**-6))) - 3))
    assert np.all(np.abs(got - raw) <= 0.5 * ulp * (1 + 1e-5) + 1e-5 * raw)


def _step_bound(v_abs, dtype):
    """Half the grid spacing around |value| in units of the scale, plus saturation."""
    if dtype == "int8":
        return np.full_like(v_abs, 0.5) + np.maximum(v_abs - 127, 0)
    if dtype == "float4_e2m1":
        gap = np.where(v_abs < 2, 0.25, np.where(v_abs < 4, 0.5, 1.0))
        return gap + np.maximum(v_abs - 6, 0)
    mantissa, min_normal, top = {"float8_e4m3": (3, 2.0**-6, 448.0), "float8_e5m2": (2, 2.0**-14, 57344.0)}[dtype]
    return np.maximum(
        np.minimum(v_abs, top) * 2.0 ** -(mantissa + 1), min_normal * 2.0 ** -(mantissa + 1)
    ) + np.maximum(v_abs - top, 0)


@pytest.mark.parametrize("name", sorted(Q.INPUT_PRESETS))
def test_quantize_input_scales_values_and_bound(name, rng):
    spec = Q.INPUT_PRESETS[name]
    x = _heavy_tailed(rng, 12, 256)
    static = np.float32(np.abs(x).max() / 300) if spec.mode.is_static else None
    q = Q.quantize_input(jnp.asarray(x), spec, static_scale=None if static is None else jnp.asarray([static]))
    x64 = x.astype(np.float64)
    deq_np = np_ref.dequantize_input(q)
    np.testing.assert_allclose(np.asarray(Q.dequantize_input(q), np.float64), deq_np, rtol=1e-6, atol=1e-30)
    if not spec.is_quantized:
        np.testing.assert_array_equal(np.asarray(q.values), x)
        return
    assert np.all(np.isfinite(deq_np))
    assert np.all(deq_np[1] == 0), "zero row must quantize to zeros"
    scale, second = _expected_scale(x64, spec, None if static is None else float(static))
    got_scale = np.asarray(q.scale)
    got_scale = (
        2.0 ** (got_scale.astype(np.float64) - 127) if spec.scale_type.value == "e8m0" else np_ref.to64(got_scale)
    )
    if spec.mode.value == "static_tensor":
        got_scale = np.broadcast_to(got_scale.reshape(1, 1), scale.shape)
    _assert_scale_close(got_scale, scale, spec.scale_type.value)
    scale = got_scale  # the bound below is in units of the stored scale
    if second is not None:
        got_second = np.broadcast_to(np.asarray(q.scale_2, np.float64).reshape(-1, 1), second.shape)
        np.testing.assert_allclose(got_second, second, rtol=1e-6)
    # Dequantized values sit within half a grid step of x (plus saturation).
    full_scale = (
        scale if spec.mode.value in ("static_tensor", "dynamic_token") else np.repeat(scale, spec.group_size, 1)
    )
    if second is not None:
        full_scale = full_scale * second
    with np.errstate(divide="ignore", invalid="ignore"):
        v_abs = np.where(full_scale > 0, np.abs(x64) / full_scale, 0)
    bound = _step_bound(v_abs, spec.dtype.value) * full_scale
    assert np.all(np.abs(deq_np - x64) <= bound * (1 + 1e-5) + 1e-30)


def test_fp8_values_equal_independent_rounding(rng):
    """Quantized fp8 values equal x/scale rounded to nearest even by NumPy's
    float8 cast, except on exact ties (none expected on random data)."""
    x = _heavy_tailed(rng, 16, 256)
    q = Q.quantize_input(jnp.asarray(x), Q.FP8_DYNAMIC_GROUP128)
    scale = np.repeat(np.asarray(q.scale, np.float64), 128, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(scale > 0, x / scale, 0).astype(np.float32)
    expected = np.clip(scaled, -448, 448).astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), expected.view(np.uint8))


def test_int8_ties_round_to_even():
    x = jnp.asarray([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]], jnp.float32)
    q = Q.quantize_input(x, Q.INT8_STATIC_TENSOR, static_scale=jnp.ones(1))
    np.testing.assert_array_equal(np.asarray(q.values), [[127, 0, 2, 2, 0, -2]])


def test_static_scale_required_and_rejected():
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="static_scale"):
        Q.quantize_input(x, Q.FP8_STATIC_TENSOR)
    with pytest.raises(ValueError, match="static_scale"):
        Q.quantize_input(x, Q.FP8_DYNAMIC_TOKEN, static_scale=jnp.ones(1))


def test_bad_specs_raise():
    with pytest.raises(ValueError, match="dtype"):
        Q.InputQuantSpec("dynamic_token")
    with pytest.raises(ValueError, match="group_size"):
        Q.InputQuantSpec("dynamic_group", "float8_e4m3", 48)
    with pytest.raises(ValueError, match="float4_e2m1"):
        Q.InputQuantSpec("dynamic_token", "float4_e2m1")
    with pytest.raises(ValueError, match="mode"):
        Q.InputQuantSpec("per_block", "int8")
    with pytest.raises(ValueError, match="K must be even"):
        Q.quantize_input(jnp.ones((2, 33)), Q.InputQuantSpec("dynamic_group", "float4_e2m1", 1, "e8m0"))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        Q.quantize_input(jnp.ones((2, 3, 32)), Q.FP8_DYNAMIC_TOKEN)
    with pytest.raises(TypeError, match="quantize_input: x must be float activations, got int8"):
        Q.quantize_input(jnp.ones((2, 32), jnp.int8), Q.FP8_DYNAMIC_TOKEN)


# ---- Hadamard ----------------------------------------------------------------


@pytest.mark.parametrize("block", [2, 16, 128, 512])
def test_hadamard_matches_numpy_and_preserves_products(block, rng):
    h = np.array([[1.0]])
    while h.shape[0] < block:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    h /= np.sqrt(block)
    k = 1024
    x = rng.normal(size=(4, k))
    w = rng.normal(size=(8, k))
    rx = np.asarray(Q.hadamard_rotate(jnp.asarray(x, jnp.float32), block), np.float64)
    expected = (x.reshape(4, k // block, block) @ h).reshape(4, k)
    np.testing.assert_allclose(rx, expected, rtol=1e-5, atol=1e-5)
    rw = np.asarray(Q.hadamard_rotate(jnp.asarray(w, jnp.float32), block), np.float64)
    np.testing.assert_allclose(rx @ rw.T, x @ w.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("block", [0, 3, 24, 1024, 2.0])
def test_hadamard_bad_block_raises(block):
    with pytest.raises(ValueError, match="hadamard_block_size"):
        Q.hadamard_rotate(jnp.ones((2, 2048)), block)


def test_hadamard_block_must_divide_k():
    with pytest.raises(ValueError, match="not a multiple"):
        Q.hadamard_rotate(jnp.ones((2, 96)), 64)


# ---- activations ---------------------------------------------------------------

CASES = [(a, None) for a in Activation] + [
    (Activation.SILU, 3.0),
    (Activation.SWIGLUOAI, 5.0),
    (Activation.SWIGLUSTEP, 2.0),
]


@pytest.mark.parametrize("kind,limit", CASES, ids=lambda c: str(getattr(c, "value", c)))
def test_activation_matches_numpy(kind, limit, rng):
    x = (rng.normal(size=(6, 64)) * 5).astype(np.float32)
    spec = ActivationSpec(kind, clamp_limit=limit)
    out = np.asarray(apply_activation(jnp.asarray(x), spec), np.float64)
    expected = np_ref.activation(x.astype(np.float64), kind.value, limit)
    assert out.shape == expected.shape == (6, 32 if kind.is_gated else 64)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


def test_activation_spec_validation():
    with pytest.raises(ValueError, match="clamp_limit"):
        ActivationSpec(Activation.GELU, clamp_limit=1.0)
    with pytest.raises(ValueError, match="kind"):
        ActivationSpec("tanh")
    with pytest.raises(ValueError, match="even"):
        apply_activation(jnp.ones((2, 5)), "silu")


def test_quantized_input_is_pytree():
    q = Q.quantize_input(jnp.ones((4, 64)), Q.MXFP8_DYNAMIC)
    leaves = jax.tree_util.tree_leaves(q)
    assert len(leaves) == 2
    assert jax.jit(lambda a: a)(q).spec == Q.MXFP8_DYNAMIC


@pytest.mark.parametrize("form", ["as_compiled_here", "integers", "normalized"])
def test_divide_is_correctly_rounded(form, rng):
    """``numerics.divide_rn`` (every scale and reciprocal of the reference and
    of interpret mode) equals the float64 quotient rounded to f32 — which is the
    correctly rounded f32 quotient — for normal results, subnormal operands and
    quotients one bit past f32 (the hardest roundings); specials follow ``/``.
    Both of its forms: the integer division the GPU compiles, the normalized
    IEEE division the CPU compiles."""
    from humming_jax import numerics
    from pallas_kernels import codecs

    divide = {
        "as_compiled_here": numerics.divide_rn,
        "integers": codecs._divide_in_integers,
        "normalized": codecs._divide_normalized,
    }[form]
    if form == "normalized" and jax.default_backend() != "cpu":
        pytest.skip("the normalized form relies on the CPU's IEEE division (the GPU compiles the integer one)")

    n = 20000
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-80, 80, n))).astype(np.float32)
    y = (rng.standard_normal(n) * np.exp(rng.uniform(-80, 80, n))).astype(np.float32)
    x[:200] = rng.integers(1, 2**23, 200).astype(np.int32).view(np.float32)  # subnormal numerators
    y[200:300] = rng.integers(1, 2**23, 100).astype(np.int32).view(np.float32)  # subnormal denominators
    q = rng.integers(2**24, 2**25, 4000) * 2.0**-24  # 25-bit quotients: x/y lands near a rounding midpoint
    y[1000:5000] = rng.uniform(1, 2, 4000).astype(np.float32)
    x[1000:5000] = (q * y[1000:5000]).astype(np.float32)
    x[6000:6004], y[6004:6008] = [0.0, np.inf, np.nan, -0.0], [0.0, np.inf, np.nan, -np.inf]
    got = np.asarray(jax.jit(divide)(x, y))
    with np.errstate(all="ignore"):
        want = (x.astype(np.float64) / y.astype(np.float64)).astype(np.float32)
    normal = (np.abs(want) >= np.finfo(np.float32).tiny) & np.isfinite(want)
    np.testing.assert_array_equal(got[normal].view(np.int32), want[normal].view(np.int32))
    special = ~np.isfinite(want) | (want == 0)
    np.testing.assert_array_equal(np.isnan(got[special]), np.isnan(want[special]))
    np.testing.assert_array_equal(got[special & ~np.isnan(want)], want[special & ~np.isnan(want)])


@pytest.mark.parametrize(
    "name", ["fp8_dynamic_token", "fp8_dynamic_group128", "nvfp4_dynamic_token", "int8_dynamic_token"]
)
def test_quantization_is_the_same_jitted_or_not(name, rng):
    """Scales and codes are bit-identical eager and under ``jit`` (XLA may
    turn ``x / c`` into ``x * (1/c)`` under jit; the scales divide with
    ``divide_rn``, integer arithmetic no rewrite touches)."""
    spec = Q.get_input_spec(name)
    x = jnp.asarray(rng.normal(size=(64, 256)) * np.exp(rng.uniform(-3, 3, (64, 1))), jnp.bfloat16)
    eager = Q.quantize_input(x, spec)
    jitted = jax.jit(lambda v: Q.quantize_input(v, spec))(x)
    for part in ("values", "scale", "scale_2"):
        a, b = getattr(eager, part), getattr(jitted, part)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
