"""The experimental Mosaic rotation (``pallas_kernels.experimental.rotation_mosaic``,
the own-rings form; no op reaches it) in the Mosaic GPU interpreter: against the
reference and the Triton kernel's codes, rows past the valid tokens +0, its
lowering for the GPU and its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_process_input import _check_against_reference, _inputs

import humming_jax as hj
from humming_jax import input_quant as Q
from pallas_kernels import process_input as kernel
from pallas_kernels.experimental import rotation_mosaic as mosaic

import np_ref
from sweep import FULL

INTERPRETED = jax.default_backend() != "gpu"


@pytest.mark.parametrize(
    "m,k,block,warpgroups,valid",
    [
        (70, 256, 128, 2, 61),  # a partial second tile, rows past the valid tokens
        # the measured width; interpreted (4 SMs) programs of 2 steps: rings wrap
        pytest.param(300, 768, 128, 2, 290, marks=FULL),
        # blocks of 64 (no butterflies), three warpgroups, uneven shares
        pytest.param(96, 384, 64, 3, 90, marks=FULL),
    ],
)
def test_own_rings_rotation(m, k, block, warpgroups, valid, rng):
    """Values up to f32 summation order and scales to 1e-6 against the
    reference; codes equal to the Triton kernel's with the same 64-column
    products but for a rare one-step difference (the ring form folds 1/sqrt(b)
    into the row's reciprocal scale: one rounding less); rows at or past the
    valid tokens zero (the interpreter fills outputs with NaN: a row left
    unstored fails)."""
    x = jnp.asarray(_inputs(rng, m, k), jnp.bfloat16)
    valid_tokens = jnp.asarray([valid], jnp.int32)
    cfg = mosaic.MosaicRotation(k, block, warpgroups=warpgroups)
    assert mosaic.refusal(cfg) is None
    h = jnp.asarray(kernel.hadamard_signs(mosaic.SUB), jnp.bfloat16)
    values, scale = mosaic.rotate_quantize(x, h, valid_tokens, cfg, interpret=INTERPRETED)
    got = Q.QuantizedInput(values=values, scale=scale, scale_2=None, spec=Q.FP8_DYNAMIC_TOKEN, k=k)
    kw = dict(hadamard_block_size=block, num_valid_tokens=valid_tokens)
    ref = hj.process_input(x, Q.FP8_DYNAMIC_TOKEN, backend="reference", **kw)
    _check_against_reference(got, ref, False, np.asarray(x, np.float64))
    assert not np.asarray(values).view(np.uint8)[valid:].any() and not np.asarray(scale)[valid:].any()
    tiles = kernel.Tiles(hadamard_sub=block)
    triton = hj.process_input(
        x, Q.FP8_DYNAMIC_TOKEN, tiles=tiles, backend="pallas" if not INTERPRETED else "interpret", **kw
    )
    a, b = np_ref.to64(values), np_ref.to64(triton.values)
    off = a != b
    assert off.mean() <= 1e-3
    assert np.all(np.abs(a - b)[off] <= np.maximum(np.abs(a), np.abs(b))[off] * 2.0**-3 + 2.0**-9)  # e4m3 steps
    np.testing.assert_allclose(np.asarray(scale), np.asarray(triton.scale), rtol=1e-6)


def test_block_magnitudes_equal_the_butterflies(rng):
    """The max pass's ``|a| + |b|`` (one f32 add) is exactly ``max(|a + b|, |a - b|)``
    as f32 rounds them (float64 NumPy, rounded once to f32)."""
    a = (rng.standard_t(df=3, size=(64, 64)) * 2.0 ** rng.integers(-20, 20, size=(64, 64))).astype(np.float32)
    b = (rng.standard_t(df=3, size=(64, 64)) * 2.0 ** rng.integers(-20, 20, size=(64, 64))).astype(np.float32)
    b[0], b[1], b[2], b[3] = a[0], -a[1], 0.0, a[3] * np.float32(1 + 2**-23)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = np.maximum(np.abs((a64 + b64).astype(np.float32)), np.abs((a64 - b64).astype(np.float32)))
    (got,) = mosaic.block_magnitudes([jnp.asarray(a), jnp.asarray(b)])
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_lowers_and_refuses():
    """It lowers for the GPU (two products a 128-block a pass, no register
    reallocation: no memory warpgroup); widths whose shares do not fit and
    too many warpgroups are refused with the reason."""
    from benchmarks import mosaic_ir

    form = mosaic.MosaicRotation(768, 128, warpgroups=3)
    assert (form.own_ring(), form.slots) == (3, 2)  # 2 blocks a tile each: one tile held, a block loading
    shapes = [
        jax.ShapeDtypeStruct(s, d)
        for s, d in [((4096, 768), jnp.bfloat16), ((64, 64), jnp.bfloat16), ((1,), jnp.int32)]
    ]
    with mosaic_ir.capture_mosaic_modules() as captured:
        jax.jit(lambda x, h, v: mosaic.rotate_quantize(x, h, v, form)).trace(*shapes).lower(
            lowering_platforms=("cuda",)
        )
    text = captured[-1]
    assert mosaic_ir.key_counts(text)["wgmma.mma_async"] == 2 * (768 // 64) * 4 and "setmaxnreg" not in text
    assert "a tile's share" in mosaic.refusal(mosaic.MosaicRotation(4096, 128, warpgroups=2))
    assert "1 to 4" in mosaic.refusal(mosaic.MosaicRotation(768, 128, warpgroups=5))
    assert "whole Hadamard blocks" in mosaic.refusal(mosaic.MosaicRotation(700, 128))
