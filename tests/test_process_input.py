"""process_input: activation -> Hadamard -> quantization -> layout, against
float64 NumPy, for the three layouts and num_valid_tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import input_quant as Q
from humming_jax.tiles_text import from_text, to_text
from pallas_kernels.process_input import Tiles

import np_ref
from sweep import sweep


def _rows_processed(x, activation, block):
    y = np_ref.activation(x, activation) if activation else x.astype(np.float64)
    if block:
        h = np.array([[1.0]])
        while h.shape[0] < block:
            h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
        y = (y.reshape(y.shape[0], -1, block) @ (h / np.sqrt(block))).reshape(y.shape)
    return y


SPECS = [
    Q.NONE,
    Q.FP8_DYNAMIC_TOKEN,
    Q.FP8_DYNAMIC_GROUP128,
    Q.MXFP8_DYNAMIC,
    Q.NVFP4_DYNAMIC_TOKEN,
    Q.INT8_DYNAMIC_TOKEN,
]
TOL = {"none": 8e-3, "int8": 3e-2, "float8_e4m3": 7e-2, "float4_e2m1": 0.2}


_NORMAL_STEPS = [("silu", None), ("swigluoai", 128), (None, 64)]


# Each spec on the plain rows and on one of the other steps (each met by two specs).
# make test: each step once (specs 0-2; the rest meet the kernel's steps below).
@pytest.mark.parametrize(
    "spec,activation,block",
    sweep(
        [(spec, *steps) for i, spec in enumerate(SPECS) for steps in [(None, None), _NORMAL_STEPS[i % 3]]],
        [(spec, *_NORMAL_STEPS[i % 3]) for i, spec in enumerate(SPECS[:3])],
    ),
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_normal_layout(spec, activation, block, rng):
    m, n = 10, 512
    x = (rng.normal(size=(m, n)) * 2).astype(np.float32)
    num_valid = 7
    q = hj.process_input(
        jnp.asarray(x, jnp.bfloat16),
        spec,
        activation=activation,
        hadamard_block_size=block,
        num_valid_tokens=jnp.asarray([num_valid], jnp.int32),
    )
    expected = _rows_processed(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64), activation, block)
    got = np_ref.dequantize_input(q)
    assert got.shape == expected.shape
    assert np.all(got[num_valid:] == 0)
    tol = TOL["none" if not spec.is_quantized else spec.dtype.value]
    assert np_ref.relative_error(got[:num_valid], expected[:num_valid]) < tol
    if not spec.is_quantized:
        assert q.values.dtype == jnp.bfloat16


@pytest.mark.bounds
def test_grouped_mask_layout_zeroes_invalid_rows(rng):
    e, max_tokens, k = 4, 6, 256
    counts = np.array([0, 6, 2, 9])  # an empty expert and a count past max_tokens
    x = rng.normal(size=(e, max_tokens, k)).astype(np.float32)
    x[0] = np.nan  # rows past the counts are garbage; they must not leak
    q = hj.process_input(
        jnp.asarray(x), Q.FP8_DYNAMIC_GROUP128, layout="grouped_mask", expert_num_tokens=jnp.asarray(counts, jnp.int32)
    )
    got = np_ref.dequantize_input(q).reshape(e, max_tokens, k)
    assert np.all(np.isfinite(got))
    for expert in range(e):
        valid = min(counts[expert], max_tokens)
        assert np.all(got[expert, valid:] == 0)
        if valid:
            assert np_ref.relative_error(got[expert, :valid], x[expert, :valid]) < 7e-2


def test_scatter_layout_moves_rows(rng):
    t, top_k, k = 5, 3, 128
    ids = rng.integers(0, 8, size=(t, top_k)).astype(np.int32)
    ids[0, 0] = 99  # invalid: goes past offsets[-1] and is bounded away
    offsets, scatter_idx = hj.moe_prepare_scatter(jnp.asarray(ids), 8)
    x = rng.normal(size=(t, k)).astype(np.float32)
    q = hj.process_input(
        jnp.asarray(x), Q.FP8_DYNAMIC_TOKEN, layout="scatter", scatter_idx=scatter_idx, num_valid_tokens=offsets[-1:]
    )
    got = np_ref.dequantize_input(q)
    assert got.shape == (t * top_k, k)
    dest = np.asarray(scatter_idx)
    n_valid = int(offsets[-1])
    for token in range(t):
        for j in range(top_k):
            row = dest[token, j]
            if row < n_valid:
                assert np_ref.relative_error(got[row], x[token]) < 7e-2
            else:
                assert np.all(got[row] == 0)


def test_prequantized_input_passes_through(rng):
    x = jnp.asarray(rng.normal(size=(4, 256)), jnp.float32)
    q = Q.quantize_input(x, Q.FP8_DYNAMIC_GROUP128)
    out = hj.process_input(q.values, Q.FP8_DYNAMIC_GROUP128, input_scale=q.scale)
    assert out.values is not None
    np.testing.assert_array_equal(np.asarray(out.values).view(np.uint8), np.asarray(q.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(out.scale), np.asarray(q.scale))
    with pytest.raises(ValueError, match="activation"):
        hj.process_input(q.values, Q.FP8_DYNAMIC_GROUP128, input_scale=q.scale, activation="silu")


def test_nothing_to_do_launches_nothing(rng):
    """An unquantized input in the compute dtype with no activation, rotation,
    layout or row bound comes back as it is, NaN included, with no kernel in
    the lowered program; with any step, the kernel runs."""
    from benchmarks.lower_sm90 import ttir_of

    x = jnp.asarray(rng.normal(size=(8, 256)), jnp.bfloat16).at[3, 5].set(jnp.nan)
    out = hj.process_input(x, Q.NONE)
    assert out.scale is None and out.k == 256 and out.values.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out.values).view(np.uint16), np.asarray(x).view(np.uint16))
    assert ttir_of(lambda v: hj.process_input(v, Q.NONE, backend="pallas").values, x) == []
    assert len(ttir_of(lambda v: hj.process_input(v, Q.NONE, activation="silu", backend="pallas").values, x)) == 1


def test_process_input_bad_arguments():
    x = jnp.ones((8, 256))
    with pytest.raises(TypeError, match="process_input: compute_dtype: expected one of bfloat16"):
        hj.process_input(x, compute_dtype=jnp.int8)
    with pytest.raises(ValueError, match="layout"):
        hj.process_input(x, layout="gather")
    with pytest.raises(ValueError, match="expert_num_tokens"):
        hj.process_input(x, layout="grouped_mask")
    with pytest.raises(ValueError, match="scatter_idx"):
        hj.process_input(x, layout="scatter")
    with pytest.raises(ValueError, match="hadamard_block_size"):
        hj.process_input(x, hadamard_block_size=48)
    with pytest.raises(ValueError, match="static_scale"):
        hj.process_input(x, Q.FP8_STATIC_TENSOR)
    with pytest.raises(ValueError, match="not a multiple of E"):
        hj.process_input(jnp.ones((7, 256)), layout="grouped_mask", expert_num_tokens=jnp.ones(2, jnp.int32))


# ---- the Pallas kernel against the reference --------------------------------------------
# Ties round to nearest even everywhere (int8 by the f32 magic-number rounding,
# fp8 by the hardware/XLA conversion, e2m1 by explicit midpoint rules), so the
# kernel's quantized values equal the reference's whenever their f32 inputs
# are equal. With an activation or a Hadamard rotation the f32 inputs can
# differ in the last bits (the kernel's own exp/erf and bf16-split rotation);
# a value next to a rounding boundary may then land one grid step away.

KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
KERNEL_SPECS = [
    Q.NONE,
    Q.FP8_DYNAMIC_TOKEN,
    Q.FP8_DYNAMIC_GROUP128,
    Q.INT8_DYNAMIC_TOKEN,
    Q.MXFP8_DYNAMIC,
    Q.NVFP4_DYNAMIC,
    Q.FP8_STATIC_TENSOR,
    Q.INT8_STATIC_TENSOR,
    Q.MXFP4_DYNAMIC,
    Q.NVFP4_DYNAMIC_TOKEN,
    Q.FP8_E5M2_DYNAMIC_TOKEN,
]


def _inputs(rng, m, n):
    x = rng.standard_t(df=3, size=(m, n)).astype(np.float32)
    x[0, :7] *= 40  # outliers
    x[1] = 0.0  # zero row
    x[2] = -1.25  # all-equal row
    return x


def _near_tie(ref, x64):
    """Elements whose scaled value x/scale sits within 1e-6 (relative) of a rounding
    boundary of the value grid: a division rounded differently (the GPU's f32
    reciprocal) may legitimately round them the other way."""
    spec = ref.spec
    m, k = x64.shape
    if spec.mode.value == "static_tensor":
        full = np.full((m, k), np_ref.to64(ref.scale).reshape(-1)[0])
    elif spec.mode.value == "dynamic_token":
        full = np.repeat(np_ref.to64(ref.scale), k, axis=1)
    else:
        scale = np.asarray(ref.scale)
        scale = 2.0 ** (scale.astype(np.float64) - 127) if spec.scale_type.value == "e8m0" else np_ref.to64(scale)
        if ref.scale_2 is not None:
            scale = scale * np.asarray(ref.scale_2, np.float64).reshape(-1, 1)
        full = np.repeat(scale, spec.group_size, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(full > 0, x64 / full, 0.0)
    grid = {"int8": np.round, "float4_e2m1": lambda a: a.astype(ml_dtypes.float4_e2m1fn).astype(np.float64)}.get(
        spec.dtype.value, lambda a: np.clip(a, -57344, 57344).astype(spec.dtype.storage_dtype).astype(np.float64)
    )
    with np.errstate(over="ignore"):  # values past the grid saturate
        return grid(v * (1 + 1e-6)) != grid(v * (1 - 1e-6))


def _e4m3_scale_near_tie(ref, x64) -> np.ndarray:
    """``[M, K/group]``: group scales whose float64 target amax/(qmax*scale_2) lies
    within 1e-6 of an e4m3 rounding boundary."""
    spec = ref.spec
    m, k = x64.shape
    amax = np.abs(x64).reshape(m, k // spec.group_size, spec.group_size).max(axis=2)
    second = np.ones((m, 1)) if ref.scale_2 is None else np.asarray(ref.scale_2, np.float64).reshape(-1, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        target = np.where(second > 0, amax / spec.dtype.max_value / second, 0.0)
    return np_ref.near_midpoint(target, np_ref.E4M3_GRID)


def _check_against_reference(got, ref, exact: bool, x64=None):
    spec = ref.spec
    dg, dr = np_ref.dequantize_input(got), np_ref.dequantize_input(ref)
    assert np.all(np.isfinite(dg)) and np.all(np.isfinite(np_ref.to64(got.scale) if got.scale is not None else 0))
    if not spec.is_quantized:
        np.testing.assert_allclose(dg, dr, rtol=8e-3, atol=1e-6 * np.abs(dr).max())
        return

    def codes(values):  # as numbers, so that -0 and +0 compare equal
        return np_ref.E2M1_TABLE[np_ref.unpack(values)] if spec.dtype.value == "float4_e2m1" else np_ref.to64(values)

    same = codes(got.values) == codes(ref.values)
    scale_tie = np.zeros(np.shape(got.scale), bool)
    if exact and spec.scale_type is not None and spec.scale_type.value == "float8_e4m3":
        # An e4m3 group scale whose target sits on a midpoint may round either way where
        # two backends' f32 arithmetic differs by an ulp: then its group's values follow it.
        scale_tie = np.asarray(got.scale).view(np.uint8) != np.asarray(ref.scale).view(np.uint8)
        assert (~scale_tie | _e4m3_scale_near_tie(ref, x64)).all()
        same |= np.repeat(scale_tie, spec.group_size, axis=1)
    if exact:
        assert (same | _near_tie(ref, x64)).all()
    else:  # rounding noise (e.g. a rotated constant row) may be quantized differently: ignore it
        signal = np.abs(dr) > 1e-5 * np.abs(dr).max(axis=1, keepdims=True)
        assert same[signal].mean() > 0.995
    if got.scale is not None and spec.scale_type.value == "float32":
        np.testing.assert_allclose(np.asarray(got.scale), np.asarray(ref.scale), rtol=1e-6 if exact else 1e-5)
    elif got.scale is not None and exact:
        equal = np.asarray(got.scale).view(np.uint8) == np.asarray(ref.scale).view(np.uint8)
        assert (equal | scale_tie).all()
    if got.scale_2 is not None:
        np.testing.assert_allclose(np.asarray(got.scale_2), np.asarray(ref.scale_2), rtol=1e-6 if exact else 1e-5)
    # Dequantized values agree to within one grid step of the element.
    bound = np.maximum(np.abs(dr), np.abs(dg)) * 2.0**-2 + 1e-6 * np.abs(dr).max()
    if spec.dtype.value == "float4_e2m1":
        bound = np.maximum(np.abs(dr), np.abs(dg)) * 0.5 + 1e-6 * np.abs(dr).max()
    if spec.dtype.value == "int8":
        bound = np.abs(dr).max(axis=1, keepdims=True) / 127 * 1.01 + 1e-30
    # A group whose scale rounded the other way at a tie has every value on the other grid.
    tied = np.repeat(scale_tie, spec.group_size, axis=1) if spec.group_size and scale_tie.ndim == 2 else False
    assert np.all((np.abs(dg - dr) <= bound) | tied)


_KERNEL_STEPS = [
    (None, None),
    ("silu", None),
    ("gelu", None),
    ("swigluoai", None),
    ("silu_no_mul", None),
    (None, 128),
    ("gelu_tanh", 32),
]
# Every spec with every activation/rotation would repeat each code path many times:
# each spec meets the plain rows and one of the others, every other one met by
# at least one spec (a spec's quantizer and an activation's code are independent).
_KERNEL_CASES = [
    (spec, *steps) for i, spec in enumerate(KERNEL_SPECS) for steps in [_KERNEL_STEPS[0], _KERNEL_STEPS[1 + i % 6]]
]
# make test: the first six specs on the six other steps, three quantizers of
# other kinds on the plain rows, where codes must be exact.
_KERNEL_CASES_CI = [(spec, *_KERNEL_STEPS[1 + i]) for i, spec in enumerate(KERNEL_SPECS[:6])] + [
    (spec, *_KERNEL_STEPS[0]) for spec in (Q.FP8_DYNAMIC_GROUP128, Q.MXFP4_DYNAMIC, Q.INT8_STATIC_TENSOR)
]


@pytest.mark.parametrize(
    "spec,activation,block", sweep(_KERNEL_CASES, _KERNEL_CASES_CI), ids=lambda v: getattr(v, "name", str(v))
)
def test_kernel_matches_reference(spec, activation, block, rng):
    m, n = 11, 512
    x = jnp.asarray(_inputs(rng, m, n), jnp.bfloat16)
    static = jnp.asarray([0.02], jnp.float32) if spec.mode.is_static else None
    kw = dict(
        activation=activation,
        hadamard_block_size=block,
        static_scale=static,
        num_valid_tokens=jnp.asarray([9], jnp.int32),
    )
    got = hj.process_input(x, spec, backend=KERNEL_BACKEND, **kw)
    ref = hj.process_input(x, spec, backend="reference", **kw)
    assert got.values.shape == ref.values.shape and got.values.dtype == ref.values.dtype
    exact = activation is None and block is None
    _check_against_reference(got, ref, exact, np.asarray(x, np.float64))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16_one_product", "f32_two_products"])
def test_hadamard_without_activation(dtype, rng):
    """No activation: a bf16 input is rotated with one bf16 product (exact, its
    low half is zero), an f32 input with a high and a low bf16 product."""
    x = jnp.asarray(_inputs(rng, 11, 384), dtype)
    for spec in (Q.NONE, Q.FP8_DYNAMIC_TOKEN):
        kw = dict(hadamard_block_size=128, num_valid_tokens=jnp.asarray([9], jnp.int32))
        got = hj.process_input(x, spec, backend=KERNEL_BACKEND, **kw)
        ref = hj.process_input(x, spec, backend="reference", **kw)
        _check_against_reference(got, ref, False, np.asarray(x, np.float64))


# 384: two column blocks (256 + 128); one column block with the plain rows only.
@pytest.mark.parametrize(
    "spec,k",
    sweep(
        [(Q.NONE, 256), (Q.NONE, 384), (Q.FP8_DYNAMIC_GROUP128, 384), (Q.NVFP4_DYNAMIC_TOKEN, 384)],
        [(Q.FP8_DYNAMIC_GROUP128, 384)],  # (NVFP4's two scales: test_nvfp4_against_float64_quantizer)
    ),
    ids=lambda v: getattr(v, "name", str(v)),
)
@pytest.mark.bounds
def test_kernel_layouts(spec, k, rng):
    # grouped_mask: garbage (NaN) past the counts, an empty and an over-full expert
    e, max_tokens = 4, 6
    counts = jnp.asarray([0, 6, 2, 9], jnp.int32)
    x = _inputs(rng, e * max_tokens, 2 * k)
    x[:max_tokens] = np.nan
    results = {
        backend: hj.process_input(
            jnp.asarray(x), spec, activation="silu", layout="grouped_mask", expert_num_tokens=counts, backend=backend
        )
        for backend in (KERNEL_BACKEND, "reference")
    }
    _check_against_reference(results[KERNEL_BACKEND], results["reference"], exact=False)
    # scatter: the permute of the grouped path, bounded by num_valid_tokens
    t, top_k = 9, 3
    ids = rng.integers(0, 8, size=(t, top_k)).astype(np.int32)
    ids[0, 1] = -1
    offsets, scatter_idx = hj.moe_prepare_scatter(jnp.asarray(ids), 8)
    xs = jnp.asarray(_inputs(rng, t, k), jnp.bfloat16)
    kw = dict(layout="scatter", scatter_idx=scatter_idx, num_valid_tokens=offsets[-1:])
    got = hj.process_input(xs, spec, backend=KERNEL_BACKEND, **kw)
    ref = hj.process_input(xs, spec, backend="reference", **kw)
    x_rows = np.asarray(xs, np.float64)[np.argsort(np.asarray(scatter_idx).reshape(-1)) // top_k]
    _check_against_reference(got, ref, exact=True, x64=x_rows)
    assert np.all(np_ref.dequantize_input(got)[int(offsets[-1]) :] == 0)


@pytest.mark.parametrize("backend", [KERNEL_BACKEND, "reference"])
@pytest.mark.parametrize("spec", [Q.NVFP4_DYNAMIC, Q.NVFP4_DYNAMIC_TOKEN], ids=lambda s: s.name)
def test_nvfp4_against_float64_quantizer(spec, backend, rng):
    """Kernel and reference each against an independent float64 NVFP4 quantizer:
    the e4m3 group scale is amax/6/second rounded to nearest (ties to even,
    saturating at 448), the e2m1 value x/(scale*second) likewise. Only values
    within 1e-6 of a rounding boundary may differ (f32 vs float64 arithmetic).
    On a GPU this tells which side a kernel/reference mismatch is on."""
    m, n, group = 11, 512, 16
    x = jnp.asarray(_inputs(rng, m, n), jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    static = jnp.asarray([0.02], jnp.float32) if spec.mode.is_static else None
    q = hj.process_input(x, spec, static_scale=static, backend=backend)
    amax = np.abs(x64).reshape(m, n // group, group).max(axis=2)
    if static is not None:
        second = np.full((m, 1), float(np.asarray(static, np.float64)[0]))
    else:
        second = np.abs(x64).max(axis=1, keepdims=True) / (448.0 * 6.0)
        np.testing.assert_allclose(np.asarray(q.scale_2, np.float64).reshape(m, 1), second, rtol=1e-6)
    with np.errstate(divide="ignore", invalid="ignore"):
        target = np.where(second > 0, amax / 6.0 / second, 0.0)
    got_scale = np_ref.f8(q.scale)
    expected_scale = np_ref.round_to_grid(target, np_ref.E4M3_GRID)
    scale_ok = (got_scale == expected_scale) | np_ref.near_midpoint(target, np_ref.E4M3_GRID)
    assert scale_ok.all(), f"{(~scale_ok).sum()} of {scale_ok.size} group scales differ from float64"
    full = np.repeat(got_scale * second, group, axis=1)  # the values follow the scale actually stored
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(full > 0, x64 / full, 0.0)
    expected = np.sign(v) * np_ref.round_to_grid(np.abs(v), np_ref.E2M1_GRID)
    got = np_ref.E2M1_TABLE[np_ref.unpack(q.values)]
    value_ok = (got == expected) | np_ref.near_midpoint(np.abs(v), np_ref.E2M1_GRID)
    assert value_ok.all(), f"{(~value_ok).sum()} of {value_ok.size} values differ from float64"


_COLUMN_BLOCK_CASES = [
    (Q.FP8_DYNAMIC_GROUP128, 384, "silu", None),  # 256 + 128
    (Q.FP8_DYNAMIC_GROUP128, 384, None, 128),  # Hadamard blocks in both column blocks
    (Q.FP8_DYNAMIC_TOKEN, 176, "swigluoai", None),  # 128 + 32 + 16: the row amax spans three blocks
    (Q.MXFP8_DYNAMIC, 352, "gelu", None),  # 256 + 64 + 32
    (Q.NVFP4_DYNAMIC_TOKEN, 176, None, None),  # packed values and e4m3 scales per block
    (Q.INT8_DYNAMIC_TOKEN, 200, None, None),  # not a multiple of 16: one padded block
    (Q.NONE, 176, "silu", None),
]


@pytest.mark.parametrize(
    "spec,k_out,activation,block",
    sweep(_COLUMN_BLOCK_CASES, [_COLUMN_BLOCK_CASES[i] for i in (0, 2, 5)]),
    ids=str,
)
@pytest.mark.bounds
def test_kernel_rows_in_power_of_two_column_blocks(spec, k_out, activation, block, rng):
    """Rows whose width is not a power of two run as several power-of-two column
    blocks (no padded lanes): kernel against the reference, scales included."""
    m = 13
    k_in = 2 * k_out if activation in ("silu", "swigluoai", "gelu") else k_out
    x = jnp.asarray(_inputs(rng, m, k_in), jnp.bfloat16)
    kw = dict(activation=activation, hadamard_block_size=block, num_valid_tokens=jnp.asarray([11], jnp.int32))
    got = hj.process_input(x, spec, backend=KERNEL_BACKEND, **kw)
    ref = hj.process_input(x, spec, backend="reference", **kw)
    assert got.values.shape == ref.values.shape
    _check_against_reference(got, ref, activation is None and block is None, np.asarray(x, np.float64))


@pytest.mark.parametrize(
    "tiles",
    sweep(
        ["block_rows=1,num_warps=1", "block_rows=8,num_warps=8", "block_rows=32,num_warps=2"],
        ["block_rows=32,num_warps=2"],
    ),
)
def test_tiles_change_only_the_tiling(tiles, rng):
    """``tiles`` (rows per program, warps) gives the default tiling's output
    bit for bit: SILU + MXFP8 over 19 rows (a ragged last block), K=384."""
    x = jnp.asarray(_inputs(rng, 19, 768), jnp.bfloat16)
    kw = dict(activation="silu", num_valid_tokens=jnp.asarray([17], jnp.int32), backend=KERNEL_BACKEND)
    want = hj.process_input(x, Q.MXFP8_DYNAMIC, **kw)
    got = hj.process_input(x, Q.MXFP8_DYNAMIC, tiles=from_text(Tiles, tiles), **kw)
    for a, b in ((got.values, want.values), (got.scale, want.scale)):
        np.testing.assert_array_equal(np.asarray(a.view(jnp.uint8)), np.asarray(b.view(jnp.uint8)))


_ROW_BLOCK_CASES = [
    ("block_rows=2,num_warps=4,row_blocks=3", "silu"),
    ("block_rows=4,num_warps=4,row_blocks=2", "swigluoai"),
    ("block_rows=8,num_warps=4,row_blocks=2", "hadamard"),  # (make test: the Hadamard tests loop row blocks)
    ("block_rows=2,num_warps=4,row_blocks=4", "scatter"),
]


@pytest.mark.parametrize("tiles,case", sweep(_ROW_BLOCK_CASES, [_ROW_BLOCK_CASES[3]]))
def test_row_blocks_loop(tiles, case, rng):
    """``row_blocks``: each program loops over several row blocks (the next
    block's loads issued before this one is processed) — the same output bit
    for bit as one block per program, ragged last blocks included (19 rows)."""
    x = jnp.asarray(_inputs(rng, 19, 768), jnp.bfloat16)
    kw = dict(num_valid_tokens=jnp.asarray([17], jnp.int32), backend=KERNEL_BACKEND)
    spec = Q.FP8_DYNAMIC_GROUP128
    if case == "silu":
        kw["activation"] = "silu"
    elif case == "swigluoai":
        kw["activation"], spec = "swigluoai", Q.MXFP8_DYNAMIC
    elif case == "hadamard":
        x, spec, kw["hadamard_block_size"] = x[:, :256], Q.FP8_DYNAMIC_TOKEN, 128
    else:
        kw.update(layout="scatter", scatter_idx=jnp.asarray(rng.permutation(38).reshape(19, 2), jnp.int32))
        kw["num_valid_tokens"] = jnp.asarray([30], jnp.int32)
    want = hj.process_input(x, spec, **kw)
    got = hj.process_input(x, spec, tiles=from_text(Tiles, tiles), **kw)
    for a, b in ((got.values, want.values), (got.scale, want.scale)):
        np.testing.assert_array_equal(np.asarray(a.view(jnp.uint8)), np.asarray(b.view(jnp.uint8)))


def test_tiles_config_and_text_form():
    """One text form (``humming_jax.tiles_text``): fields at their defaults left out."""
    assert from_text(Tiles, "block_rows=4,num_warps=4,row_blocks=8") == Tiles(4, 4, row_blocks=8)
    for text in ("block_rows=8,num_warps=8", "row_blocks=3", "block_rows=4,hadamard_sub=32", ""):
        assert to_text(from_text(Tiles, text)) == text
    with pytest.raises(ValueError, match="row_blocks"):
        Tiles(4, 4, row_blocks=-1)
    with pytest.raises(ValueError, match="expected name=value pairs with names from block_rows"):
        from_text(Tiles, "8x4")
    with pytest.raises(ValueError, match="Tiles.block_rows: expected an integer"):
        from_text(Tiles, "block_rows=many")
    assert from_text(Tiles, "block_rows=4").row_blocks == 0  # chosen


def test_chosen_row_blocks():
    """Left open, a one-pass Hadamard rotation loops over 8 row blocks (4 on 4
    warps) where the grid keeps 2 programs per SM (fewer blocks below),
    everything else 1."""
    from pallas_kernels import process_input as kernel

    hadamard = kernel.ProcessConfig(k_in=2048, k_out=2048, hadamard=128, mode="dynamic_token")
    assert kernel.chosen_row_blocks(hadamard, 32768) == 8
    assert kernel.chosen_row_blocks(hadamard, 128) == 1
    rows = hadamard.rows
    assert kernel.chosen_row_blocks(hadamard, rows * 2 * kernel.MIN_LOOPED_PROGRAMS) == 2
    silu = kernel.ProcessConfig(k_in=4096, k_out=2048, activation="silu", mode="dynamic_group")
    assert kernel.chosen_row_blocks(silu, 32768) == 1
    # K=768 (512 + 256 columns): products of 32 and 16 rows run on 4 warps and loop over 4 blocks.
    narrow = kernel.ProcessConfig(k_in=768, k_out=768, hadamard=128, mode="dynamic_token")
    assert (narrow.rows, narrow.smallest_product_rows, narrow.warps) == (8, 16, 4)
    assert kernel.chosen_row_blocks(narrow, 32768) == 4
    assert (hadamard.smallest_product_rows, hadamard.warps) == (64, 8)


def test_tiles_too_few_rows_for_the_hadamard_products():
    x = jnp.ones((8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="tiles.*block_rows=4: the Hadamard products need 16 rows"):
        hj.process_input(x, hadamard_block_size=128, tiles=Tiles(4, 4), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="num_warps"):
        Tiles(4, 3)


_BLOCK_OPERAND_CASES = [
    (Q.FP8_DYNAMIC_TOKEN, 768, 128, "normal"),  # two column blocks (512 + 256)
    (Q.FP8_DYNAMIC_TOKEN, 768, 128, "scatter"),
    (Q.INT8_DYNAMIC_TOKEN, 256, 64, "scatter"),
    (Q.FP8_STATIC_TENSOR, 384, 128, "grouped_mask"),
    (Q.NONE, 256, 32, "normal"),
]


@pytest.mark.parametrize(
    "spec,k,block,layout",
    sweep(_BLOCK_OPERAND_CASES, [_BLOCK_OPERAND_CASES[i] for i in (2, 3)]),
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_hadamard_blocks_loaded_as_operands(spec, k, block, layout, rng):
    """A bf16 input rotated without activation runs as ``[rows · n, b]``
    Hadamard blocks loaded straight as the product's operand
    (``rotates_blocks``): the same values and scales as the reference in every
    layout, rows past the counts / valid tokens zero (NaN poison in rows the
    grouped layout must not read), ragged last row blocks included."""
    from pallas_kernels import process_input as kernel

    cfg = kernel.ProcessConfig(k_in=k, k_out=k, hadamard=block, mode=spec.mode.value)
    assert kernel.rotates_blocks(cfg, jnp.bfloat16)
    assert not kernel.rotates_blocks(dataclasses.replace(cfg, activation="silu"), jnp.bfloat16)
    assert not kernel.rotates_blocks(cfg, jnp.float32)
    kw = dict(hadamard_block_size=block)
    if spec.mode.is_static:
        kw["static_scale"] = jnp.asarray([0.02], jnp.float32)
    if layout == "grouped_mask":
        e, max_tokens = 4, 6
        x = _inputs(rng, e * max_tokens, k)
        x[:max_tokens] = np.nan  # expert 0 is empty: never read
        kw.update(layout="grouped_mask", expert_num_tokens=jnp.asarray([0, 6, 2, 9], jnp.int32))
    elif layout == "scatter":
        t, top_k = 9, 3
        ids = rng.integers(0, 8, size=(t, top_k)).astype(np.int32)
        ids[0, 1] = -1
        offsets, scatter_idx = hj.moe_prepare_scatter(jnp.asarray(ids), 8)
        x = _inputs(rng, t, k)
        kw.update(layout="scatter", scatter_idx=scatter_idx, num_valid_tokens=offsets[-1:])
    else:
        x = _inputs(rng, 37, k)
        kw["num_valid_tokens"] = jnp.asarray([33], jnp.int32)
    x = jnp.asarray(x, jnp.bfloat16)
    got = hj.process_input(x, spec, backend=KERNEL_BACKEND, **kw)
    ref = hj.process_input(x, spec, backend="reference", **kw)
    _check_against_reference(got, ref, False)
    # Bit for bit: the row-block loop against the chosen tiles (the same sub-blocks).
    looped = hj.process_input(x, spec, backend=KERNEL_BACKEND, tiles=Tiles(row_blocks=3), **kw)
    for a, b in ((looped.values, got.values), (looped.scale, got.scale)):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


LOOPED = "block_rows=16,num_warps=4,row_blocks=2"


@pytest.mark.parametrize(
    "spec,k,sub,tiles,layout",
    sweep(
        [
            # 512 + 256: two column blocks of 4 sub-products a Hadamard block
            *((Q.FP8_DYNAMIC_TOKEN, 768, 32, "", layout) for layout in ("normal", "scatter")),
            # looped row blocks
            *((Q.FP8_DYNAMIC_TOKEN, 384, 64, LOOPED, layout) for layout in ("normal", "scatter")),
            # the other quantizers and sizes once each (the layout only moves rows)
            (Q.INT8_DYNAMIC_TOKEN, 256, 16, "", "normal"),
            (Q.FP8_STATIC_TENSOR, 384, 64, "", "scatter"),
        ],
        [(Q.FP8_DYNAMIC_TOKEN, 384, 64, LOOPED, "scatter")],
    ),
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_hadamard_sub_block_products(spec, k, sub, tiles, layout, rng):
    """``hadamard_sub``: each Hadamard block of 128 rotated
    as 128/S products with the S x S matrix and f32 butterflies across them
    (H_128 = H_{128/S} ⊗ H_S): the reference's values and scales up to f32
    summation order (heavy-tailed rows, a zero row, an all-equal row), and
    ~all codes equal to the whole-block product's."""
    x = jnp.asarray(_inputs(rng, 19, k), jnp.bfloat16)
    kw = dict(num_valid_tokens=jnp.asarray([17], jnp.int32), hadamard_block_size=128)
    if spec.mode.is_static:
        kw["static_scale"] = jnp.asarray([0.02], jnp.float32)
    if layout == "scatter":
        kw.update(layout="scatter", scatter_idx=jnp.asarray(rng.permutation(38).reshape(19, 2), jnp.int32))
        kw["num_valid_tokens"] = jnp.asarray([30], jnp.int32)
    parsed = from_text(Tiles, ",".join(filter(None, [tiles, f"hadamard_sub={sub}"])))
    whole = hj.process_input(x, spec, backend=KERNEL_BACKEND, tiles=dataclasses.replace(parsed, hadamard_sub=128), **kw)
    got = hj.process_input(x, spec, backend=KERNEL_BACKEND, tiles=parsed, **kw)
    _check_against_reference(got, hj.process_input(x, spec, backend="reference", **kw), False)
    if spec.is_quantized:
        same = np.asarray(got.values).view(np.uint8) == np.asarray(whole.values).view(np.uint8)
        assert same.mean() > 0.995
    if got.scale is not None and spec.mode.value == "dynamic_token":
        np.testing.assert_allclose(np.asarray(got.scale), np.asarray(whole.scale), rtol=1e-6)
    rows_out = np.asarray(got.values).shape[0]
    if layout == "normal":  # rows past the valid tokens are zero
        assert not np.asarray(got.values.astype(jnp.float32))[17:rows_out].any()


def test_butterflies_are_the_sylvester_product():
    """The f32 butterflies combine sub-block products p_d into y_a = Σ_d H[a, d] p_d."""
    from pallas_kernels import process_input as kernel

    rng = np.random.default_rng(3)
    for parts in (1, 2, 4, 8):
        p = rng.normal(size=(parts, 5, 3))
        got = np.stack(kernel.butterflies([jnp.asarray(v) for v in p]))
        want = np.einsum("ad,drc->arc", kernel.hadamard_signs(parts).astype(np.float64), p)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # f32 sums
    # ... which with H_S on each S-column part is the rotation by H_b (Sylvester: H_b = H_{b/S} ⊗ H_S).
    np.testing.assert_array_equal(
        kernel.hadamard_signs(128), np.kron(kernel.hadamard_signs(4), kernel.hadamard_signs(32))
    )


def test_chosen_product_columns():
    """Tiles that leave ``hadamard_sub`` open get 64-column products under
    blocks of 128 and more in the operand-blocks rotation (the H200's winner),
    whole blocks under that and in the other rotations; a given width stands."""
    from pallas_kernels import process_input as kernel

    def columns(hadamard, **kw):
        cfg = kernel.ProcessConfig(k_in=2048, k_out=2048, hadamard=hadamard, mode="dynamic_token", **kw)
        return kernel.product_columns(cfg, jnp.bfloat16)

    assert [columns(b) for b in (16, 32, 64, 128, 256, 512)] == [16, 32, 64, 64, 64, 64]
    assert columns(128, tiles=Tiles(hadamard_sub=32)) == 32 and columns(128, tiles=Tiles(hadamard_sub=128)) == 128
    silu = kernel.ProcessConfig(k_in=4096, k_out=2048, hadamard=128, activation="silu", mode="dynamic_token")
    assert kernel.product_columns(silu, jnp.bfloat16) == 128
    cfg = kernel.ProcessConfig(k_in=2048, k_out=2048, hadamard=128, mode="dynamic_token")
    assert kernel.product_columns(cfg, jnp.float32) == 128


def test_hadamard_sub_refusals(rng):
    x = jnp.asarray(_inputs(rng, 8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="hadamard_sub: 16 columns or more"):
        Tiles(hadamard_sub=8)
    with pytest.raises(ValueError, match="hadamard_sub"):
        Tiles(hadamard_sub=48)
    sub = Tiles(hadamard_sub=32)
    for kw in (
        dict(hadamard_block_size=128, activation="silu"),  # activations take the rows path
        dict(hadamard_block_size=16),  # not under the block
        dict(),  # no rotation
    ):
        kw = {"tiles": sub, **kw}
        with pytest.raises(ValueError, match="tiles.*hadamard_sub=32"):
            hj.process_input(x, Q.FP8_DYNAMIC_TOKEN, backend=KERNEL_BACKEND, **kw)
    with pytest.raises(ValueError, match="tiles.*hadamard_sub=32"):  # f32 input: two products a block
        hj.process_input(x.astype(jnp.float32), hadamard_block_size=128, tiles=sub, backend=KERNEL_BACKEND)


@pytest.mark.parametrize("spec", sweep([Q.NONE, Q.FP8_DYNAMIC_GROUP128, Q.MXFP4_DYNAMIC], [Q.MXFP4_DYNAMIC]))
@pytest.mark.bounds
def test_scatter_rows_nobody_targets_are_zeros(spec, rng):
    """A caller's ``scatter_idx`` need not be a permutation: destinations past
    the output are dropped and rows nobody targets are zeros (values and
    scales) in the kernel as in the reference; the pipelines' permutations
    (``scatter_is_permutation``) write every row once, the same values."""
    x = jnp.asarray(rng.normal(size=(6, 128)), jnp.bfloat16)
    gappy = jnp.asarray([[0, 5], [7, 2], [40, 9], [1, 11], [3, -5], [8, 10]], jnp.int32)  # rows 4, 6 untargeted
    kw = dict(layout="scatter", scatter_idx=gappy)
    got = hj.process_input(x, spec, backend=KERNEL_BACKEND, **kw)
    want = hj.process_input(x, spec, backend="reference", **kw)
    for part in ("values", "scale"):
        a, b = getattr(got, part), getattr(want, part)
        if b is not None:
            np.testing.assert_array_equal(np.asarray(a[jnp.asarray([4, 6])]).view(np.uint8), 0)
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    permutation = jnp.asarray(rng.permutation(12).reshape(6, 2), jnp.int32)
    kw = dict(layout="scatter", scatter_idx=permutation)
    trusted = hj.process_input(x, spec, backend=KERNEL_BACKEND, scatter_is_permutation=True, **kw)
    checked = hj.process_input(x, spec, backend=KERNEL_BACKEND, **kw)
    np.testing.assert_array_equal(np.asarray(trusted.values).view(np.uint8), np.asarray(checked.values).view(np.uint8))


@pytest.mark.parametrize(
    "spec",
    sweep(
        [
            Q.FP8_DYNAMIC_TOKEN,
            Q.INT8_DYNAMIC_TOKEN,
            Q.FP8_DYNAMIC_GROUP128,
            Q.MXFP8_DYNAMIC,
            Q.MXFP4_DYNAMIC,
            Q.NVFP4_DYNAMIC,
            Q.NVFP4_DYNAMIC_TOKEN,
        ],
        [Q.INT8_DYNAMIC_TOKEN, Q.FP8_DYNAMIC_GROUP128, Q.NVFP4_DYNAMIC_TOKEN],
    ),
)
def test_a_nan_poisons_its_scale_group_only(spec, rng):
    """The NaN rule: a NaN input element makes the scale of its group (its
    row, for per-token modes; e8m0: byte 255) NaN, so the token's GEMM output
    is NaN and no other token's is — the kernel as the reference, bit for bit."""
    x = rng.normal(size=(4, 256)).astype(np.float32)
    x[1, 7] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    kw = dict(static_scale=jnp.asarray([0.01], jnp.float32)) if spec.mode.is_static else {}
    got, want = (hj.process_input(x, spec, backend=b, **kw) for b in (KERNEL_BACKEND, "reference"))
    for part in ("values", "scale", "scale_2"):
        a, b = getattr(got, part), getattr(want, part)
        if b is not None:  # (both divide correctly rounded: div.rn in the kernel, divide_rn in the reference)
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    dequantized = np.asarray(Q.dequantize_input(got))
    # Per-token modes and NVFP4 per token (its row's second scale): the row; groups: the group.
    poisoned = 256 if spec.mode.value in ("dynamic_token", "dynamic_group_token") else spec.group_size
    assert np.isnan(dequantized[1]).sum() == poisoned
    assert np.all(np.isfinite(dequantized[[0, 2, 3]]))


@pytest.mark.parametrize("spec", [Q.FP8_DYNAMIC_TOKEN, Q.FP8_E5M2_DYNAMIC_TOKEN, Q.INT8_DYNAMIC_TOKEN], ids=str)
def test_fp8_token_scales_have_vllms_floor(spec, rng):
    """Per-token fp8 scales are at least 1 / (max * 512) in f32, as vLLM's
    per-token fp8 quantization clamps them: a row of tiny values or zeros gets
    that scale (int8 rows do not); a NaN row stays NaN; kernel and reference
    bit for bit."""
    x = rng.normal(size=(4, 256)).astype(np.float32)
    x[1] *= 1e-5
    x[2] = 0.0
    x[3, 5] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    got, want = (hj.process_input(x, spec, backend=b) for b in (KERNEL_BACKEND, "reference"))
    for part in ("values", "scale"):  # as floats: e5m2 has several NaN codes
        a, b = (np.asarray(getattr(q, part)).astype(np.float32) for q in (got, want))
        np.testing.assert_array_equal(a, b)
    scale = np.asarray(want.scale, np.float32).reshape(-1)
    qmax = spec.dtype.max_value
    amax = np.abs(np.asarray(x, np.float32)).max(axis=1)
    if spec.dtype.value.startswith("float8"):
        floor = np.float32(1.0) / np.float32(qmax * 512)
        assert scale[1] == floor == scale[2] and amax[1] / qmax < floor
    else:
        assert scale[2] == 0 and scale[1] == np.float32(amax[1]) / np.float32(qmax)
    assert scale[0] == np.float32(amax[0]) / np.float32(qmax) and np.isnan(scale[3])


@pytest.mark.parametrize(
    "spec,layout,block",
    sweep(
        [
            (Q.FP8_DYNAMIC_GROUP128, "scatter", None),  # the grouped pipeline's w13 input
            (Q.FP8_DYNAMIC_TOKEN, "normal", 128),  # Hadamard blocks loaded as the product's operands
            (Q.FP8_STATIC_TENSOR, "normal", None),
            (Q.get_input_spec("fp8_e5m2_dynamic_token"), "scatter", None),
        ],
        [(Q.FP8_DYNAMIC_GROUP128, "scatter", None), (Q.FP8_DYNAMIC_TOKEN, "normal", 128)],
    ),
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_dequantized_output(spec, layout, block, rng):
    """``dequantize=True``: the quantized values times their scales in the
    compute dtype, as an unquantized input — bit for bit what multiplying the
    quantized result out gives (a GEMM tile's ``dequantize_input``), on every
    backend; rows past ``num_valid_tokens`` zero, NaN confined to its token."""
    t, k, top_k = 9, 384, 2
    x = _inputs(rng, t, k)
    x[4, 7] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    kw = dict(hadamard_block_size=block, static_scale=jnp.asarray([0.03], jnp.float32) if spec.mode.is_static else None)
    if layout == "scatter":
        ids = rng.integers(0, 4, size=(t, top_k)).astype(np.int32)
        ids[0, 1] = -1
        offsets, scatter_idx = hj.moe_prepare_scatter(jnp.asarray(ids), 4)
        kw.update(layout="scatter", scatter_idx=scatter_idx, scatter_is_permutation=True, num_valid_tokens=offsets[-1:])
    else:
        kw.update(num_valid_tokens=jnp.asarray([7], jnp.int32))
    for backend in (KERNEL_BACKEND, "reference"):
        q = hj.process_input(x, spec, backend=backend, **kw)
        want = np.asarray(Q.dequantize_input(q).astype(jnp.bfloat16).astype(jnp.float32))
        got = hj.process_input(x, spec, backend=backend, dequantize=True, **kw)
        assert got.spec == Q.NONE and got.scale is None and got.values.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got.values.astype(jnp.float32)), want)
        nan_rows = np.any(np.isnan(want), axis=1)
        assert 0 < nan_rows.sum() <= top_k  # token 4's rows only
    with pytest.raises(ValueError, match="dequantize: int8_dynamic_token"):
        hj.process_input(x, Q.INT8_DYNAMIC_TOKEN, dequantize=True)


# (quantization, activation, columns out, gate/up block): whole and padded column blocks
# (40 outputs: one padded block of 64), one and several pairs a block; W8A8's w2 input
# (blocks of 128), whose last column block (896 = 512 + 256 + 128) lies within one pair.
_GATE_UP_BLOCKS = [
    (Q.NONE, "silu", 768, 32),
    (Q.FP8_DYNAMIC_GROUP128, "gelu_tanh", 256, 32),
    (Q.FP8_DYNAMIC_TOKEN, "swiglustep", 40, 8),
    (Q.FP8_DYNAMIC_GROUP128, "silu", 896, 128),
    (Q.MXFP8_DYNAMIC, "gelu", 192, 64),
]


@pytest.mark.parametrize(
    "spec,kind,k_out,block", sweep(_GATE_UP_BLOCKS, _GATE_UP_BLOCKS[:4]), ids=lambda v: getattr(v, "name", str(v))
)
def test_gate_and_up_interleaved_by_blocks(spec, kind, k_out, block, rng):
    """``ActivationSpec.gate_up_block``: gate and up columns interleaved by
    blocks (the order of a w13 stored by ``interleave_gate_up``); the kernel
    and the reference against the float64 activation of the same rows in
    halves, and bit for bit the kernel on those halves."""
    m = 9
    halves = (rng.normal(size=(m, 2 * k_out)) * 2).astype(np.float32)
    interleaved = halves[:, np_ref.gate_up_rows(2 * k_out, block)]
    spec_blocks = hj.ActivationSpec(kind, gate_up_block=block)
    expected = np_ref.activation(np.asarray(jnp.asarray(halves, jnp.bfloat16), np.float64), kind)
    tol = TOL["none" if not spec.is_quantized else spec.dtype.value]
    outputs = {}
    for backend in (KERNEL_BACKEND, "reference"):
        q = hj.process_input(jnp.asarray(interleaved, jnp.bfloat16), spec, activation=spec_blocks, backend=backend)
        outputs[backend] = q
        assert np_ref.relative_error(np_ref.dequantize_input(q), expected) < tol
    in_halves = hj.process_input(jnp.asarray(halves, jnp.bfloat16), spec, activation=kind, backend=KERNEL_BACKEND)
    np.testing.assert_array_equal(
        np.asarray(
            outputs[KERNEL_BACKEND].values.view(np.uint8) if spec.is_quantized else outputs[KERNEL_BACKEND].values,
            np.float32,
        ),
        np.asarray(in_halves.values.view(np.uint8) if spec.is_quantized else in_halves.values, np.float32),
    )


def test_gate_up_block_validation():
    with pytest.raises(ValueError, match="gate_up_block"):
        hj.ActivationSpec("swigluoai", gate_up_block=32)  # its own pairs
    with pytest.raises(ValueError, match="gate_up_block"):
        hj.ActivationSpec("relu2_no_mul", gate_up_block=32)
    with pytest.raises(ValueError, match="gate_up_block"):
        hj.ActivationSpec("silu", gate_up_block=-1)
    with pytest.raises(ValueError, match="gate/up block pairs"):
        hj.process_input(jnp.ones((2, 96), jnp.bfloat16), activation=hj.ActivationSpec("silu", gate_up_block=32))
