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

import np_ref


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


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("activation,block", [(None, None), ("silu", None), ("swigluoai", 128), (None, 64)])
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


def test_process_input_bad_arguments():
    x = jnp.ones((8, 256))
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
INTERPRETED = KERNEL_BACKEND == "interpret"
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
        # An e4m3 group scale whose target sits on a midpoint may round either way
        # (XLA's GPU f32 divide is not correctly rounded): then its group's values follow it.
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
    assert np.all(np.abs(dg - dr) <= bound)


@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize(
    "activation,block",
    [
        (None, None),
        ("silu", None),
        ("gelu", None),
        ("swigluoai", None),
        ("silu_no_mul", None),
        (None, 128),
        ("gelu_tanh", 32),
    ],
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


@pytest.mark.parametrize("k", [256, 384])  # 384: two column blocks (256 + 128)
@pytest.mark.parametrize("spec", [Q.NONE, Q.FP8_DYNAMIC_GROUP128, Q.NVFP4_DYNAMIC_TOKEN], ids=lambda s: s.name)
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


@pytest.mark.parametrize(
    "spec,k_out,activation,block",
    [
        (Q.FP8_DYNAMIC_GROUP128, 384, "silu", None),  # 256 + 128
        (Q.FP8_DYNAMIC_GROUP128, 384, None, 128),  # Hadamard blocks in both column blocks
        (Q.FP8_DYNAMIC_TOKEN, 176, "swigluoai", None),  # 128 + 32 + 16: the row amax spans three blocks
        (Q.MXFP8_DYNAMIC, 352, "gelu", None),  # 256 + 64 + 32
        (Q.NVFP4_DYNAMIC_TOKEN, 176, None, None),  # packed values and e4m3 scales per block
        (Q.INT8_DYNAMIC_TOKEN, 200, None, None),  # not a multiple of 16: one padded block
        (Q.NONE, 176, "silu", None),
    ],
    ids=str,
)
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


@pytest.mark.parametrize("tiles", ["1x1", "8x8", "32x2"])
def test_tiles_change_only_the_tiling(tiles, rng):
    """``tiles`` (rows per program, warps) gives the default tiling's output
    bit for bit: SILU + MXFP8 over 19 rows (a ragged last block), K=384."""
    x = jnp.asarray(_inputs(rng, 19, 768), jnp.bfloat16)
    kw = dict(activation="silu", num_valid_tokens=jnp.asarray([17], jnp.int32), backend=KERNEL_BACKEND)
    want = hj.process_input(x, Q.MXFP8_DYNAMIC, **kw)
    got = hj.process_input(x, Q.MXFP8_DYNAMIC, tiles=hj.ProcessTilesConfig.parse(tiles), **kw)
    for a, b in ((got.values, want.values), (got.scale, want.scale)):
        np.testing.assert_array_equal(np.asarray(a.view(jnp.uint8)), np.asarray(b.view(jnp.uint8)))


@pytest.mark.parametrize(
    "tiles,case",
    [("2x4x1x3", "silu"), ("4x4x1x2", "swigluoai"), ("8x4x1x2", "hadamard"), ("2x4x1x4", "scatter")],
)
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
    got = hj.process_input(x, spec, tiles=hj.ProcessTilesConfig.parse(tiles), **kw)
    for a, b in ((got.values, want.values), (got.scale, want.scale)):
        np.testing.assert_array_equal(np.asarray(a.view(jnp.uint8)), np.asarray(b.view(jnp.uint8)))


def test_row_blocks_config():
    assert hj.ProcessTilesConfig.parse("4x4x1x8") == hj.ProcessTilesConfig(4, 4, row_blocks=8)
    for text in ("8x8", "64x8x2", "4x4x1x8", "0x0r", "4x8x1x8r"):
        assert hj.ProcessTilesConfig.parse(text).text() == text
    with pytest.raises(ValueError, match="row_blocks"):
        hj.ProcessTilesConfig(16, 4, two_pass=True, row_blocks=2)
    with pytest.raises(ValueError, match="row_blocks"):
        hj.ProcessTilesConfig(4, 4, row_blocks=-1)
    assert hj.ProcessTilesConfig.parse("4x4").row_blocks == 0  # chosen


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
    assert kernel.chosen_row_blocks(dataclasses.replace(hadamard, two_pass=True), 32768) == 1
    silu = kernel.ProcessConfig(k_in=4096, k_out=2048, activation="silu", mode="dynamic_group")
    assert kernel.chosen_row_blocks(silu, 32768) == 1
    # K=768 (512 + 256 columns): products of 32 and 16 rows run on 4 warps and loop over 4 blocks.
    narrow = kernel.ProcessConfig(k_in=768, k_out=768, hadamard=128, mode="dynamic_token")
    assert (narrow.rows, narrow.smallest_product_rows, narrow.warps) == (8, 16, 4)
    assert kernel.chosen_row_blocks(narrow, 32768) == 4
    assert (hadamard.smallest_product_rows, hadamard.warps) == (64, 8)


def test_tiles_too_few_rows_for_the_hadamard_products():
    x = jnp.ones((8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="tiles.block_rows"):
        hj.process_input(x, hadamard_block_size=128, tiles=hj.ProcessTilesConfig(4, 4), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="num_warps"):
        hj.ProcessTilesConfig(4, 3)


@pytest.mark.parametrize(
    "spec", [Q.NONE, Q.FP8_DYNAMIC_TOKEN, Q.MXFP8_DYNAMIC, Q.NVFP4_DYNAMIC_TOKEN], ids=lambda s: s.name
)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_hadamard_two_pass(spec, activation, rng):
    """``tiles.two_pass``: 128-column blocks of 16 rows, the per-token max from a
    first pass; against the reference like the one-pass kernel (19 rows: a ragged
    last block; K=384: three blocks). Without activation (one bf16 product of
    exact inputs) it equals the one-pass output; after SILU the two high/low
    products may sum in another order for another tile shape."""
    x = jnp.asarray(_inputs(rng, 19, 768 if activation else 384), jnp.bfloat16)
    static = jnp.asarray([0.02], jnp.float32) if spec.mode.is_static else None
    kw = dict(activation=activation, hadamard_block_size=128, static_scale=static)
    kw["num_valid_tokens"] = jnp.asarray([17], jnp.int32)
    two = hj.process_input(x, spec, tiles=hj.ProcessTilesConfig(16, 4, two_pass=True), backend=KERNEL_BACKEND, **kw)
    ref = hj.process_input(x, spec, backend="reference", **kw)
    _check_against_reference(two, ref, False, np.asarray(x, np.float64))
    if activation is not None:
        return
    one = hj.process_input(x, spec, backend=KERNEL_BACKEND, **kw)
    for a, b in ((two.values, one.values), (two.scale, one.scale), (two.scale_2, one.scale_2)):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize(
    "spec,activation,sub",
    [
        (Q.FP8_DYNAMIC_TOKEN, None, 64),
        (Q.FP8_DYNAMIC_TOKEN, None, 32),
        (Q.MXFP8_DYNAMIC, "silu", 32),  # f32 values: two products a sub-block; groups of 32 in each
        (Q.NVFP4_DYNAMIC_TOKEN, None, 64),
        (Q.NONE, "silu", 64),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_hadamard_two_pass_sub_block_products(spec, activation, sub, rng):
    """Two passes with sub-block products (tiles ``16x4x2h{sub}``): each
    128-column block loaded as 128/sub tiles, one product each and f32
    butterflies; the reference's values and scales (up to f32 summation
    order), and without activation the one-pass kernel's output with the
    same sub-blocks, bit for bit."""
    x = jnp.asarray(_inputs(rng, 19, 768 if activation else 384), jnp.bfloat16)
    kw = dict(activation=activation, hadamard_block_size=128, num_valid_tokens=jnp.asarray([17], jnp.int32))
    tiles = hj.ProcessTilesConfig.parse(f"16x4x2h{sub}")
    assert tiles == hj.ProcessTilesConfig(16, 4, True, hadamard_sub=sub)
    two = hj.process_input(x, spec, tiles=tiles, backend=KERNEL_BACKEND, **kw)
    _check_against_reference(
        two, hj.process_input(x, spec, backend="reference", **kw), False, np.asarray(x, np.float64)
    )
    assert not np.asarray(two.values).view(np.uint8)[17:].any()  # rows past the valid tokens are zero
    if activation is not None or spec.mode.value != "dynamic_token":
        return
    one = hj.process_input(x, spec, tiles=hj.ProcessTilesConfig(hadamard_sub=sub), backend=KERNEL_BACKEND, **kw)
    np.testing.assert_array_equal(np.asarray(two.values).view(np.uint8), np.asarray(one.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(two.scale), np.asarray(one.scale))


def test_two_pass_needs_a_hadamard_and_fitting_groups():
    x = jnp.ones((16, 256), jnp.bfloat16)
    two = hj.ProcessTilesConfig(two_pass=True)
    with pytest.raises(ValueError, match="two_pass"):
        hj.process_input(x, Q.FP8_DYNAMIC_TOKEN, tiles=two, backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="two_pass"):
        hj.process_input(x, Q.FP8_DYNAMIC_GROUP128, hadamard_block_size=64, tiles=two, backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="block_rows"):
        hj.process_input(x, hadamard_block_size=64, tiles=hj.ProcessTilesConfig(8, 4, True), backend=KERNEL_BACKEND)
    assert hj.ProcessTilesConfig.parse("64x8x2") == hj.ProcessTilesConfig(64, 8, True)
    with pytest.raises(ValueError, match="sub-block products of 32"):  # groups of 128 over two 32-column products
        hj.process_input(
            x,
            Q.FP8_DYNAMIC_GROUP128,
            hadamard_block_size=128,
            tiles=hj.ProcessTilesConfig(16, 4, True, hadamard_sub=32),
            backend=KERNEL_BACKEND,
        )


def test_hadamard_two_pass_scatter(rng):
    """Two passes with the scatter layout (the grouped path's permute, 3 copies
    per token, bounded by num_valid_tokens): the one-pass kernel's output."""
    t, top_k = 21, 3
    ids = rng.integers(0, 8, size=(t, top_k)).astype(np.int32)
    ids[0, 1] = -1
    offsets, scatter_idx = hj.moe_prepare_scatter(jnp.asarray(ids), 8)
    x = jnp.asarray(_inputs(rng, t, 256), jnp.bfloat16)
    kw = dict(hadamard_block_size=64, layout="scatter", scatter_idx=scatter_idx, num_valid_tokens=offsets[-1:])
    two = hj.process_input(
        x, Q.FP8_DYNAMIC_TOKEN, tiles=hj.ProcessTilesConfig(two_pass=True), backend=KERNEL_BACKEND, **kw
    )
    one = hj.process_input(x, Q.FP8_DYNAMIC_TOKEN, backend=KERNEL_BACKEND, **kw)
    np.testing.assert_array_equal(np.asarray(two.values).view(np.uint8), np.asarray(one.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(two.scale), np.asarray(one.scale))
    assert np.all(np_ref.dequantize_input(two)[int(offsets[-1]) :] == 0)


@pytest.mark.parametrize("layout", ["normal", "grouped_mask", "scatter"])
@pytest.mark.parametrize(
    "spec,k,block",
    [
        (Q.FP8_DYNAMIC_TOKEN, 768, 128),  # two column blocks (512 + 256)
        (Q.INT8_DYNAMIC_TOKEN, 256, 64),
        (Q.FP8_STATIC_TENSOR, 384, 128),
        (Q.NONE, 256, 32),
    ],
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
    assert not kernel.rotates_blocks(dataclasses.replace(cfg, operand_blocks=False), jnp.bfloat16)
    # Bit for bit where the products are the same: the row-block loop against the
    # chosen tiles (the same sub-blocks), the rows-then-reshape path (one product a
    # Hadamard block) against whole-block operand products — the chosen 64-column
    # products and butterflies sum in another f32 order (on the GPU a scale moved
    # by 2 ulps against the reshaped path).
    looped = hj.ProcessTilesConfig(0, 0, row_blocks=3)
    reshaped = hj.ProcessTilesConfig(0, 0, operand_blocks=False)
    whole = hj.process_input(x, spec, backend=KERNEL_BACKEND, tiles=hj.ProcessTilesConfig(hadamard_sub=block), **kw)
    for tiles, base in ((looped, got), (reshaped, whole)):
        other = hj.process_input(x, spec, backend=KERNEL_BACKEND, tiles=tiles, **kw)
        for a, b in ((other.values, base.values), (other.scale, base.scale)):
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize(
    "case,tiles",
    [("silu", "0x0p"), ("swigluoai", "4x4p"), ("hadamard", "0x0p"), ("hadamard", "8x4x1x2p"), ("nvfp4", "0x0p")],
)
@pytest.mark.parametrize("layout", ["normal", "scatter"])
def test_one_block_rows(case, tiles, layout, rng):
    """``one_block`` (tiles text ``…p``): K=384 as one 512-wide block whose
    last 128 lanes are masked, instead of 256 + 128 — the same output bit for
    bit (the Hadamard blocks loaded as the product's operand included)."""
    x = jnp.asarray(_inputs(rng, 19, 768), jnp.bfloat16)
    kw = dict(num_valid_tokens=jnp.asarray([17], jnp.int32), backend=KERNEL_BACKEND)
    spec = {"silu": Q.FP8_DYNAMIC_GROUP128, "swigluoai": Q.MXFP8_DYNAMIC, "nvfp4": Q.NVFP4_DYNAMIC_TOKEN}.get(
        case, Q.FP8_DYNAMIC_TOKEN
    )
    if case in ("silu", "swigluoai"):
        kw["activation"] = case
    else:
        x = x[:, :384]
        kw["hadamard_block_size"] = 128 if case == "hadamard" else None
    if layout == "scatter":
        kw.update(layout="scatter", scatter_idx=jnp.asarray(rng.permutation(38).reshape(19, 2), jnp.int32))
        kw["num_valid_tokens"] = jnp.asarray([30], jnp.int32)
    parsed = hj.ProcessTilesConfig.parse(tiles)
    assert parsed.one_block and parsed.text() == tiles
    from pallas_kernels import process_input as kernel

    padded = kernel.ProcessConfig(k_in=384, k_out=384, hadamard=128, mode="dynamic_token", one_block=True)
    assert padded.segments == ((0, 512),) and kernel.rotates_blocks(padded, jnp.bfloat16)
    want = hj.process_input(x, spec, **kw)
    got = hj.process_input(x, spec, tiles=parsed, **kw)
    for a, b in ((got.values, want.values), (got.scale, want.scale)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    _check_against_reference(got, hj.process_input(x, spec, **dict(kw, backend="reference")), False)


@pytest.mark.parametrize(
    "spec,k,sub,tiles",
    [
        (Q.FP8_DYNAMIC_TOKEN, 768, 32, "0x0"),  # 512 + 256: two column blocks of 4 sub-products a Hadamard block
        (Q.FP8_DYNAMIC_TOKEN, 384, 64, "8x4x1x2p"),  # one masked 512-wide block, looped row blocks
        (Q.INT8_DYNAMIC_TOKEN, 256, 16, "0x0"),
        (Q.FP8_STATIC_TENSOR, 384, 64, "0x0"),
        (Q.NONE, 256, 32, "0x0"),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
@pytest.mark.parametrize("layout", ["normal", "scatter"])
def test_hadamard_sub_block_products(spec, k, sub, tiles, layout, rng):
    """``hadamard_sub`` (tiles text ``…hS``): each Hadamard block of 128 rotated
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
    parsed = hj.ProcessTilesConfig.parse(f"{tiles}h{sub}")
    assert parsed.hadamard_sub == sub and parsed.text() == f"{tiles}h{sub}"
    whole = hj.process_input(x, spec, backend=KERNEL_BACKEND, tiles=hj.ProcessTilesConfig.parse(f"{tiles}h128"), **kw)
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
    assert columns(128, hadamard_sub=32) == 32 and columns(128, hadamard_sub=128) == 128
    assert columns(128, two_pass=True) == 128 and columns(128, operand_blocks=False) == 128
    silu = kernel.ProcessConfig(k_in=4096, k_out=2048, hadamard=128, activation="silu", mode="dynamic_token")
    assert kernel.product_columns(silu, jnp.bfloat16) == 128
    cfg = kernel.ProcessConfig(k_in=2048, k_out=2048, hadamard=128, mode="dynamic_token")
    assert kernel.product_columns(cfg, jnp.float32) == 128


def test_hadamard_sub_refusals(rng):
    x = jnp.asarray(_inputs(rng, 8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="hadamard_sub: the products need 16 columns"):
        hj.ProcessTilesConfig(hadamard_sub=8)
    with pytest.raises(ValueError, match="hadamard_sub"):
        hj.ProcessTilesConfig(hadamard_sub=48)
    sub = hj.ProcessTilesConfig(hadamard_sub=32)
    for kw in (
        dict(hadamard_block_size=128, activation="silu"),  # activations take the rows path
        dict(hadamard_block_size=16),  # not under the block
        dict(),  # no rotation
    ):
        kw = {"tiles": sub, **kw}
        with pytest.raises(ValueError, match="tiles.hadamard_sub=32"):
            hj.process_input(x, Q.FP8_DYNAMIC_TOKEN, backend=KERNEL_BACKEND, **kw)
    with pytest.raises(ValueError, match="tiles.hadamard_sub=32"):  # f32 input: two products a block
        hj.process_input(x.astype(jnp.float32), hadamard_block_size=128, tiles=sub, backend=KERNEL_BACKEND)


_MOSAIC_SHAPES = [
    (70, 256, 128, 61),  # a partial second tile, rows past the valid tokens
    (19, 128, 64, 19),  # one tile, blocks of 64: no butterflies
    (1, 768, 128, 1),  # T=1: one row of six blocks
    (200, 768, 128, 200),  # the measured width, four tiles
    (128, 384, 64, 5),  # a second tile with no valid row: zeros only
    (96, 384, 128, 90),  # three blocks: two warpgroups take 2 + 1
    (300, 256, 128, 290),  # 5 tiles; interpreted (4 SMs): 3 programs of 2 steps, the last step past the end
]


def _mosaic_cases():
    """Each shape with each tiling that has a Hadamard block for every quantizing
    warpgroup (fewer are refused: test_mosaic_rotation_refusals)."""
    texts = ["0x0m", "0x0m2", "0x0m3", "0x0m2x", "0x0m3x", "0x0m2r", "0x0m3r", "0x0m4r", "0x0m4rs", "0x0m3o", "0x0m2o"]
    for tiles_text in texts:
        tiles = hj.ProcessTilesConfig.parse(tiles_text)
        # The ring-only forms have tests of their own over several tiles a program: here T=1 and partial tiles.
        shapes = (
            _MOSAIC_SHAPES[2:3] + _MOSAIC_SHAPES[4:6] if tiles.mosaic_self_loads or tiles.mosaic_own else _MOSAIC_SHAPES
        )
        for m, k, block, valid in shapes:
            if k // block >= tiles.mosaic - (tiles.mosaic_max or tiles.mosaic_reread):
                yield m, k, block, valid, tiles_text


@pytest.mark.parametrize("m,k,block,valid,tiles_text", list(_mosaic_cases()))
def test_mosaic_rotation(m, k, block, valid, tiles_text, rng):
    """``tiles.mosaic``: the Mosaic kernel (its interpreter here) against the
    reference (values up to f32 summation order, scales to 1e-6), and its codes
    equal to the Triton kernel's with the same 64-column products; rows at or
    past the valid tokens zero (values +0 and scales). The interpreter fills
    outputs with NaN: a row the kernel leaves unstored fails. Two or three
    compute warpgroups split each tile's Hadamard blocks and combine the row
    max; ``x``: the first takes the row max of every tile a step ahead of the
    others, which quantize (two steps a program: its slots and barriers reused)."""
    tiles = hj.ProcessTilesConfig.parse(tiles_text)
    x = jnp.asarray(_inputs(rng, max(m, 3), k)[:m], jnp.bfloat16)
    kw = dict(hadamard_block_size=block, num_valid_tokens=jnp.asarray([valid], jnp.int32))
    assert tiles.text() == tiles_text
    got = hj.process_input(x, Q.FP8_DYNAMIC_TOKEN, tiles=tiles, backend=KERNEL_BACKEND, **kw)
    ref = hj.process_input(x, Q.FP8_DYNAMIC_TOKEN, backend="reference", **kw)
    assert got.values.shape == (m, k) and got.scale.shape == (m, 1)
    _check_against_reference(got, ref, False, np.asarray(x, np.float64))
    assert not np.asarray(got.values).view(np.uint8)[valid:].any() and not np.asarray(got.scale)[valid:].any()
    triton = hj.process_input(
        x, Q.FP8_DYNAMIC_TOKEN, tiles=hj.ProcessTilesConfig(hadamard_sub=block), backend=KERNEL_BACKEND, **kw
    )
    # The same products in f32: equal codes (interpreted, all of them; on the GPU wgmma and
    # mma.sync may sum a product's 64 terms in another order: a rare code one step off). The
    # ring forms fold 1/sqrt(b) into the row's reciprocal scale: one rounding less, a code
    # one step off where a value sits within an f32 ulp of an e4m3 midpoint (~3e-7 measured).
    a, b = np_ref.to64(got.values), np_ref.to64(triton.values)
    off = a != b
    folded = tiles.mosaic_reread or tiles.mosaic_own
    assert off.mean() <= (1e-3 if KERNEL_BACKEND != "interpret" else 1e-4 if folded else 0)
    assert np.all(np.abs(a - b)[off] <= np.maximum(np.abs(a), np.abs(b))[off] * 2.0**-3 + 2.0**-9)  # e4m3 steps
    # The max is taken before the 1/sqrt(b) factor (exact on the GPU; interpreted, XLA may
    # fold the factor into the division by 448: one ulp).
    np.testing.assert_allclose(np.asarray(got.scale), np.asarray(triton.scale), rtol=1e-6)


def test_mosaic_block_magnitudes_equal_the_butterflies(rng):
    """The max pass's ``|a| + |b|`` (one f32 add) is exactly ``max(|a + b|, |a - b|)``
    as f32 rounds them (float64 NumPy, rounded once to f32): random products with
    equal and opposite pairs, zeros and values whose sum rounds."""
    from pallas_kernels import process_input_mosaic as mosaic

    a = (rng.standard_t(df=3, size=(64, 64)) * 2.0 ** rng.integers(-20, 20, size=(64, 64))).astype(np.float32)
    b = (rng.standard_t(df=3, size=(64, 64)) * 2.0 ** rng.integers(-20, 20, size=(64, 64))).astype(np.float32)
    b[0] = a[0]
    b[1] = -a[1]
    b[2] = 0.0
    b[3] = a[3] * np.float32(1 + 2**-23)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = np.maximum(np.abs((a64 + b64).astype(np.float32)), np.abs((a64 - b64).astype(np.float32)))
    (got,) = mosaic.block_magnitudes([jnp.asarray(a), jnp.asarray(b)])
    np.testing.assert_array_equal(np.asarray(got), want)
    (one,) = mosaic.block_magnitudes([jnp.asarray(a)])
    np.testing.assert_array_equal(np.asarray(one), np.abs(a))


def test_mosaic_reread_rings():
    """The re-read form's rings: the max warpgroup's 48 KB (3 blocks of 128, 6 of 64,
    never past a tile), the quantizing warpgroups' the rest (up to two tiles' share);
    ``first_ring`` overrides; a width whose rings do not fit is refused."""
    from pallas_kernels import process_input_mosaic as mosaic

    def rings(k, block, warpgroups, **kw):
        cfg = mosaic.MosaicRotation(k, block, warpgroups=warpgroups, max_warpgroup=True, reread=True, **kw)
        assert mosaic.refusal(cfg) is None and cfg.smem_bytes <= mosaic.SMEM_LIMIT
        return cfg.rings()

    assert rings(768, 128, 4) == (3, 2)
    assert rings(768, 64, 4) == (6, 5)
    assert rings(768, 128, 3) == (3, 4)
    assert rings(256, 128, 2) == (2, 4)  # a tile of two blocks: two tiles' share for the one quantizer
    assert rings(768, 128, 4, first_ring=5, output_slots=1) == (5, 2)
    wide = mosaic.MosaicRotation(8192, 128, warpgroups=4, max_warpgroup=True, reread=True, first_ring=14)
    assert "ring of Hadamard blocks" in mosaic.refusal(wide)


def test_mosaic_rotation_refusals():
    x = jnp.ones((64, 256), jnp.bfloat16)
    mosaic = hj.ProcessTilesConfig(mosaic=True)

    def run(x=x, spec=Q.FP8_DYNAMIC_TOKEN, **kw):
        kw.setdefault("hadamard_block_size", 128)
        return hj.process_input(x, spec, tiles=mosaic, backend=KERNEL_BACKEND, **kw)

    for kw, what in [
        (dict(activation="silu"), "activation silu"),
        (dict(x=x.astype(jnp.float32)), "input float32"),
        (dict(spec=Q.MXFP8_DYNAMIC), "spec mxfp8_dynamic"),
        (dict(spec=Q.INT8_DYNAMIC_TOKEN), "spec int8_dynamic_token"),
        (dict(hadamard_block_size=256), "blocks of 64 or 128"),
        (dict(hadamard_block_size=None), "no Hadamard rotation"),
        (dict(x=jnp.ones((64, 1024), jnp.bfloat16)), "exceed"),  # two 64 x 1024 tiles: 256 KB
    ]:
        with pytest.raises(ValueError, match=f"tiles.mosaic.*{what}"):
            run(**kw)
    copies = jnp.asarray(np.random.default_rng(0).permutation(128).reshape(64, 2), jnp.int32)
    with pytest.raises(ValueError, match="layout scatter"):
        run(layout="scatter", scatter_idx=copies)
    with pytest.raises(ValueError, match="mosaic"):
        hj.ProcessTilesConfig(8, 4, mosaic=True)
    with pytest.raises(ValueError, match="mosaic: 1 to 3"):
        hj.ProcessTilesConfig(mosaic=4)
    with pytest.raises(ValueError, match="mosaic_max: a warpgroup for the row max"):
        hj.ProcessTilesConfig(mosaic=1, mosaic_max=True)
    assert hj.ProcessTilesConfig.parse("0x0m3x") == hj.ProcessTilesConfig(mosaic=3, mosaic_max=True)
    for text, tiles in [
        ("0x0m4rs", hj.ProcessTilesConfig(mosaic=4, mosaic_reread=True, mosaic_self_loads=True)),
        ("0x0m3o", hj.ProcessTilesConfig(mosaic=3, mosaic_own=True)),
        ("0x0m4o", hj.ProcessTilesConfig(mosaic=4, mosaic_own=True)),
    ]:
        assert hj.ProcessTilesConfig.parse(text) == tiles and tiles.text() == text
    with pytest.raises(ValueError, match="mosaic_self_loads"):
        hj.ProcessTilesConfig(mosaic=3, mosaic_self_loads=True)
    with pytest.raises(ValueError, match="mosaic_own: a form of its own"):
        hj.ProcessTilesConfig(mosaic=3, mosaic_own=True, mosaic_max=True)
    with pytest.raises(ValueError, match="a Hadamard block for each of 2 warpgroups"):
        hj.process_input(
            x[:, :128],
            Q.FP8_DYNAMIC_TOKEN,
            hadamard_block_size=128,
            tiles=hj.ProcessTilesConfig(mosaic=2),
            backend=KERNEL_BACKEND,
        )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "block,warpgroups,max_warpgroup,reread",
    [
        (64, 1, False, False),
        (128, 1, False, False),
        (128, 2, False, False),
        (128, 3, True, False),
        (64, 3, False, False),
        (128, 3, True, True),
        (64, 2, True, True),
        (128, 4, True, True),
    ],
)
def test_mosaic_rotation_lowers_for_the_gpu(block, warpgroups, max_warpgroup, reread):
    """The Mosaic kernel lowers for the GPU on the CPU (what the interpreter
    cannot check: the swizzled e4m3 output slots, TMA boxes, layouts): two
    products a 128-column block (one for 64), each taken twice (the max, then
    the values), four k16 wgmmas a product; a TMA store a 64-column part and
    one a tile's scales (with two warpgroups each takes half the blocks, in
    its own branch: the same counts; with a max warpgroup, it takes every
    block's first products and the others the second; re-read, the same with
    the loads of both passes in the memory warpgroup)."""
    from benchmarks import mosaic_ir
    from pallas_kernels import process_input_mosaic as mosaic

    cfg = mosaic.MosaicRotation(768, block, warpgroups=warpgroups, max_warpgroup=max_warpgroup, reread=reread)
    x = jax.ShapeDtypeStruct((4096, 768), jnp.bfloat16)
    h = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    valid = jax.ShapeDtypeStruct((1,), jnp.int32)
    with mosaic_ir.capture_mosaic_modules() as texts:
        jax.jit(lambda x, h, v: mosaic.rotate_quantize(x, h, v, cfg)).trace(x, h, valid).lower(
            lowering_platforms=("cuda",)
        )
    counts = mosaic_ir.key_counts(texts[-1])
    assert counts["wgmma.mma_async"] == 2 * (768 // 64) * 4
    assert counts["nvvm.cp.async.bulk.tensor"] >= 768 // 64 + 1  # the stores (and loads)


def test_mosaic_rotation_needs_hopper(monkeypatch):
    """Compiled, the Mosaic kernel needs TMA and wgmma: elsewhere the error names the device."""
    import importlib

    ops = importlib.import_module("humming_jax.process_input")
    monkeypatch.setattr(ops, "hopper_gpu", lambda: False)
    x = jnp.ones((64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="tiles.mosaic.*Hopper GPU"):
        hj.process_input(
            x, Q.FP8_DYNAMIC_TOKEN, hadamard_block_size=128, tiles=hj.ProcessTilesConfig(mosaic=True), backend="pallas"
        )


def test_default_tiles_take_the_mosaic_rotation_for_its_case(monkeypatch):
    """Without ``tiles``, a Hopper GPU takes the Mosaic rotation (own-rings form, 2
    compute warpgroups) for a bf16 Hadamard rotation quantized to fp8 per token
    from 16384 rows up to 768 columns; smaller or wider inputs, other cases,
    other devices and the interpreter keep the Triton kernel's chosen tiling."""
    import importlib

    ops = importlib.import_module("humming_jax.process_input")
    x = jax.ShapeDtypeStruct((16384, 768), jnp.bfloat16)

    def steps(spec=Q.FP8_DYNAMIC_TOKEN, activation=None, block=128, layout="normal"):
        activation = ops.get_activation(activation)
        return ops.ProcessSteps(Q.get_input_spec(spec), activation, block, layout, jnp.dtype(jnp.bfloat16))

    monkeypatch.setattr(ops, "hopper_gpu", lambda: True)
    mosaic = hj.ProcessTilesConfig(mosaic=2, mosaic_own=True)
    assert ops.default_tiles(x, steps(), interpret=False) == mosaic
    assert ops.default_tiles(x, steps(block=64), interpret=False) == mosaic
    chosen = hj.ProcessTilesConfig()
    for case in [
        dict(x=jax.ShapeDtypeStruct((16383, 768), jnp.bfloat16)),
        dict(x=jax.ShapeDtypeStruct((16384, 1024), jnp.bfloat16)),  # measured at 768 only
        dict(x=jax.ShapeDtypeStruct((16384, 768), jnp.float32)),
        dict(steps=steps(spec=Q.INT8_DYNAMIC_TOKEN)),
        dict(steps=steps(activation="silu")),
        dict(steps=steps(block=256)),
        dict(steps=steps(block=None)),
        dict(interpret=True),
    ]:
        kw = dict(x=x, steps=steps(), interpret=False) | case
        assert ops.default_tiles(**kw) == chosen, case
    monkeypatch.setattr(ops, "hopper_gpu", lambda: False)
    assert ops.default_tiles(x, steps(), interpret=False) == chosen


_PLAIN_ROTATIONS: dict = {}  # case -> (x, valid, the plain re-read form's outputs)


def _assert_rotation_variant(cases, options: dict, exact: bool = True) -> None:
    """The re-read form with ``options`` against the plain form, for each ``(m,
    k, block, warpgroups, valid)``: equal codes and scales (``exact=False``:
    scales within 1e-6 and a code one e4m3 step apart in at most 1e-4 of the
    values — interpreted, XLA may fuse the max's ``1/sqrt(b)`` into the division
    by 448 in one form and not the other: an ulp), rows past the valid tokens
    +0 (interpreted: outputs start as NaN; on the GPU compiled)."""
    import dataclasses

    from pallas_kernels import process_input as kernel
    from pallas_kernels import process_input_mosaic as mosaic

    h = jnp.asarray(kernel.hadamard_signs(mosaic.SUB), jnp.bfloat16)
    for case in cases:
        m, k, block, warpgroups, valid = case
        plain = mosaic.MosaicRotation(k, block, warpgroups=warpgroups, max_warpgroup=True, reread=True)
        cfg = dataclasses.replace(plain, **options)
        assert mosaic.refusal(cfg) is None
        if case not in _PLAIN_ROTATIONS:  # inputs drawn once a case: the plain form runs once a worker
            x = jnp.asarray(_inputs(np.random.default_rng(list(case)), m, k), jnp.bfloat16)
            v = jnp.asarray([valid], jnp.int32)
            _PLAIN_ROTATIONS[case] = x, v, mosaic.rotate_quantize(x, h, v, plain, interpret=INTERPRETED)
        x, v, want = _PLAIN_ROTATIONS[case]
        got = mosaic.rotate_quantize(x, h, v, cfg, interpret=INTERPRETED)
        assert not np.asarray(got[0]).view(np.uint8)[valid:].any() and not np.asarray(got[1])[valid:].any()
        if exact:
            np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8))
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
            continue
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
        a, b = np_ref.to64(got[0]), np_ref.to64(want[0])
        off = a != b
        assert off.mean() <= 1e-4
        assert np.all(np.abs(a - b)[off] <= np.maximum(np.abs(a), np.abs(b))[off] * 2.0**-3 + 2.0**-9)


def _lowered_rotation(form) -> str:
    """The Mosaic module ``form`` lowers to for the GPU (x ``[4096, K]`` bf16), as text."""
    from benchmarks import mosaic_ir
    from pallas_kernels import process_input_mosaic as mosaic

    shapes = [
        jax.ShapeDtypeStruct(s, d)
        for s, d in [((4096, form.k), jnp.bfloat16), ((64, 64), jnp.bfloat16), ((1,), jnp.int32)]
    ]
    with mosaic_ir.capture_mosaic_modules() as captured:
        jax.jit(lambda x, h, v: mosaic.rotate_quantize(x, h, v, form)).trace(*shapes).lower(
            lowering_platforms=("cuda",)
        )
    return captured[-1]


def test_mosaic_reread_self_loads():
    """The re-read form without a memory warpgroup (each compute warpgroup
    issues its own ring's loads, refilling a slot once its products are
    taken): the same codes and scales as the plain form over several tiles a
    program (the rings wrap across tiles), rows past the valid tokens +0;
    it lowers with one warpgroup fewer and no register reallocation."""
    from benchmarks import mosaic_ir
    from pallas_kernels import process_input as kernel
    from pallas_kernels import process_input_mosaic as mosaic

    cases = [(700, 768, 128, 4, 650), (600, 384, 64, 3, 590), (832, 256, 128, 2, 832)]
    _assert_rotation_variant(cases, dict(self_loads=True, auto_barriers=False, select_store=True))
    texts = {
        self_loads: _lowered_rotation(
            mosaic.MosaicRotation(768, 128, warpgroups=4, max_warpgroup=True, reread=True, self_loads=self_loads)
        )
        for self_loads in (False, True)
    }
    assert mosaic_ir.key_counts(texts[True])["wgmma.mma_async"] == 2 * (768 // 64) * 4
    assert "setmaxnreg" in texts[False] and "setmaxnreg" not in texts[True]
    x = jnp.ones((128, 384), jnp.bfloat16)
    h = jnp.asarray(kernel.hadamard_signs(mosaic.SUB), jnp.bfloat16)
    with pytest.raises(ValueError, match="self_loads"):
        pipelined = mosaic.MosaicRotation(384, 64, warpgroups=3, max_warpgroup=True, self_loads=True)
        mosaic.rotate_quantize(x, h, jnp.asarray([128], jnp.int32), pipelined, interpret=INTERPRETED)


def test_mosaic_own_rings():
    """The own-rings form (every compute warpgroup takes both passes over its
    share of each tile's Hadamard blocks from a ring it fills itself, the row
    max combined through shared memory; no max or memory warpgroup): the same
    codes and scales as the re-read form (compiled; interpreted, up to an ulp of
    the scale, see _assert_rotation_variant) over several tiles a program (rings
    wrapping across tiles, uneven shares at 4 warpgroups, a partial last tile),
    rows past the valid tokens +0; it lowers (two products a 128-block a pass,
    no register reallocation); a width whose shares do not fit is refused."""
    from benchmarks import mosaic_ir
    from pallas_kernels import process_input_mosaic as mosaic

    own = dict(own_rings=True, max_warpgroup=False, reread=False, auto_barriers=False, select_store=True)
    cases = [(700, 768, 128, 3, 650), (600, 384, 64, 3, 590), (832, 256, 128, 2, 832), (500, 768, 128, 4, 500)]
    _assert_rotation_variant(cases, own, exact=not INTERPRETED)
    form = mosaic.MosaicRotation(768, 128, warpgroups=3, own_rings=True)
    assert (form.own_ring(), form.slots) == (3, 2)  # 2 blocks a tile each: one tile held, a block loading
    text = _lowered_rotation(form)
    assert mosaic_ir.key_counts(text)["wgmma.mma_async"] == 2 * (768 // 64) * 4 and "setmaxnreg" not in text
    assert "a form of its own" in mosaic.refusal(mosaic.MosaicRotation(768, 128, warpgroups=3, own_rings=True,
                                                                       max_warpgroup=True))  # fmt: skip
    assert "a tile's share" in mosaic.refusal(mosaic.MosaicRotation(4096, 128, warpgroups=2, own_rings=True))


@pytest.mark.parametrize(
    "blocks_per_slot,select_store,output_slots,auto_barriers",
    [(2, False, 0, True), (1, True, 0, True), (2, True, 1, True), (1, False, 0, False), (2, True, 0, False)],
)
def test_mosaic_reread_write_variants(blocks_per_slot, select_store, output_slots, auto_barriers):
    """The re-read form's write-path options (several Hadamard blocks a slot:
    one fence and copy group for them; one select store instead of branches;
    one output slot; without the compiler's barriers around each shared-memory
    store) write the same codes and scales as the plain form, rows past the
    valid tokens +0 (interpreted: outputs start as NaN; on the GPU compiled);
    and lower (without the compiler's barriers, with fewer warpgroup barriers)."""
    import dataclasses

    from benchmarks import mosaic_ir
    from pallas_kernels import process_input as kernel
    from pallas_kernels import process_input_mosaic as mosaic

    options = dict(
        blocks_per_slot=blocks_per_slot, select_store=select_store, output_slots=output_slots,
        auto_barriers=auto_barriers,
    )  # fmt: skip
    _assert_rotation_variant([(200, 768, 128, 4, 190), (128, 384, 64, 3, 70)], options)
    wide = mosaic.MosaicRotation(768, 128, warpgroups=4, max_warpgroup=True, reread=True, **options)
    texts = {
        barriers: _lowered_rotation(dataclasses.replace(wide, auto_barriers=barriers)) for barriers in (True, False)
    }
    assert mosaic_ir.key_counts(texts[auto_barriers])["wgmma.mma_async"] == 2 * (768 // 64) * 4
    assert texts[False].count("bar.sync") < texts[True].count("bar.sync") / 3
    x = jnp.ones((128, 384), jnp.bfloat16)
    h = jnp.asarray(kernel.hadamard_signs(mosaic.SUB), jnp.bfloat16)
    v = jnp.asarray([128], jnp.int32)
    with pytest.raises(ValueError, match="blocks an output slot"):
        pipelined = mosaic.MosaicRotation(384, 64, warpgroups=3, max_warpgroup=True, blocks_per_slot=2)
        mosaic.rotate_quantize(x, h, v, pipelined, interpret=INTERPRETED)
    with pytest.raises(ValueError, match="auto_barriers"):
        pipelined = mosaic.MosaicRotation(384, 64, warpgroups=3, max_warpgroup=True, auto_barriers=False)
        mosaic.rotate_quantize(x, h, v, pipelined, interpret=INTERPRETED)
