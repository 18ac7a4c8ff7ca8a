"""The Mosaic GEMM without warp specialization (``mosaic_mid``: one
warpgroup a program, a program per output tile) in the Mosaic GPU
interpreter on the CPU against float64 NumPy; its refusals, its name in
tile texts and the tuning table, its lowering for the GPU (the swap form
the interpreter cannot run). Its epilogue activation and bias cases are in
``test_gemm_mosaic.py::test_activation_in_the_epilogue``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import formats as F
from humming_jax import tiles_text
from humming_jax import tuning as T
from pallas_kernels.gemm import mosaic, mosaic_mid

from sweep import FULL
from test_gemm_mosaic import KERNEL_BACKEND, ON_GPU_ONLY, _check_many_tiles, _expected, _many_tiles_product

# The qwen3 T=512 entries' tiles (32 rows an expert): 48 rows, the decoded pieces as the register operand.
MID_W13 = mosaic_mid.Tiles(48, 128, 128, stages=2, swap_ab=True, word_decode=True)
MID_W2 = mosaic_mid.Tiles(48, 256, 128, stages=3, swap_ab=True, word_decode=True)


@pytest.mark.parametrize(
    "counts,weight_kind,tuning",
    [
        # an empty expert, ragged tiles, two column tiles: a program each
        ((7, 0, 23, 3), "bf16", mosaic_mid.Tiles(64, 128, 64, stages=2)),
        ((1, 70, 0, 30), "int4", mosaic_mid.Tiles(64, 256, 128, stages=3)),  # staged decode, 3 row tiles on one expert
        pytest.param((0, 0, 40, 0), "mxfp4", mosaic_mid.Tiles(64, 128, 128, stages=2), marks=FULL),  # one hot expert
        pytest.param((7, 0, 23, 3), "uint4", mosaic_mid.Tiles(64, 256, 128, stages=2), marks=FULL),  # zero points
        pytest.param((5, 40, 0, 19), "int4", MID_W13, marks=ON_GPU_ONLY),
        pytest.param((5, 40, 0, 19), "mxfp4", MID_W2, marks=ON_GPU_ONLY),
    ],
    ids=["bf16", "int4-staged", "mxfp4-one-hot", "uint4", "int4-swap-48", "mxfp4-swap-48"],
)
def test_grouped_rows_against_numpy(counts, weight_kind, tuning, rng):
    """Each output tile its own program: every expert's rows against the
    float64 product of the rounded operands; rows past the last range (5)
    zero (the interpreter fills fresh memory with NaN)."""
    fmt = {"bf16": None, "int4": F.INT4_G128, "uint4": F.UINT4_ZP_G128, "mxfp4": F.MXFP4}[weight_kind]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    m, n, k = int(offsets[-1]) + 5, 256, 256
    _check_many_tiles(*_many_tiles_product(fmt, tuning, offsets, m, n, k, rng), offsets)


def test_what_the_kernel_refuses(rng):
    """No cluster (each program loads its own x), and the warp-specialized
    kernel's checks on the one warpgroup's tile, each named."""
    x = jnp.asarray(rng.normal(size=(16, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.05, (2, 256, 256)), jnp.bfloat16)
    grouped = hj.GroupedContiguous(jnp.asarray([0, 8, 16], jnp.int32))
    with pytest.raises(ValueError, match="tuning.*cluster_n=2 .a program per output tile"):
        hj.gemm(x, w, grouped, tuning=mosaic_mid.Tiles(64, 128, 64, cluster_n=2), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="block_n=512 .at most 256"):
        hj.gemm(x, w, grouped, tuning=mosaic_mid.Tiles(64, 512, 64), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="block_n=96 .a multiple of 64"):  # one warpgroup: whole 64-column slots
        mosaic.check_tiles(mosaic_mid.Tiles(64, 96, 64), 768, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="accumulator"):  # the whole tile in one warpgroup's registers
        mosaic.check_tiles(
            mosaic_mid.Tiles(176, 256, 128, swap_ab=True), 512, 256, jnp.bfloat16, mosaic.NibbleDecode(2)
        )
    assert mosaic_mid.supports(mosaic.Tiles(64, 128, 64), None).startswith("tiles of type Tiles")


def test_one_warpgroup_allocates_one_slot_set():
    """Shared memory counted for one warpgroup's store slots: a 48-row tile of
    128 columns on two stages is small enough for several programs an SM."""
    decode = mosaic.NibbleDecode(16)
    mid = mosaic.shared_memory_bytes(MID_W13, jnp.bfloat16, jnp.bfloat16, decode)
    specialized = mosaic.shared_memory_bytes(
        mosaic.Tiles(48, 128, 128, stages=2, swap_ab=True), jnp.bfloat16, jnp.bfloat16, decode
    )
    assert specialized - mid == 48 * mosaic.EPILOGUE_COLUMNS * 2  # the second warpgroup's slot
    assert 4 * mid < mosaic.SHARED_MEMORY_BYTES


def test_named_apart_from_the_warp_specialized_kernel():
    """Its tiles compare, print and load from the table as its own kernel's
    (a subclass of mosaic.Tiles with the same fields)."""
    fields = dataclasses.asdict(MID_W13)
    assert MID_W13 != mosaic.Tiles(**fields)
    text = tiles_text.gemm_to_text(MID_W13)
    assert text.startswith("mosaic_mid:") and tiles_text.gemm_from_text(text) == MID_W13
    assert tiles_text.gemm_to_text(mosaic.Tiles(**fields)).startswith("mosaic:")
    entry = T.Entry(2048, 4096, MID_W2)
    assert T.Entry.from_json(entry.to_json()).tiles == MID_W2


def test_the_table_runs_it_at_32_rows_an_expert():
    """qwen3-30b-a3b's grouped int4 GEMMs at T=512 (4,096 rows over 128
    experts) list this kernel first; T=1024 does not."""
    for n, k in ((1536, 2048), (2048, 768)):
        first = T.candidates("grouped_contiguous", F.INT4_G128, 4096, 128, n, k)[0]
        assert isinstance(first, mosaic_mid.Tiles), (n, k, first)
        assert not isinstance(T.candidates("grouped_contiguous", F.INT4_G128, 8192, 128, n, k)[0], mosaic_mid.Tiles)
    assert isinstance(T.candidates("grouped_contiguous", F.MXFP4, 4096, 128, 2048, 768)[0], mosaic_mid.Tiles)


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("tiles", [MID_W13, MID_W2], ids=["48x128x2", "48x256x3"])
def test_swap_tiles_lower_for_the_gpu(tiles):
    """The entries' swap tiles (int4 and MXFP4, one with the gated
    activation) lower for sm_90 with every TMA box on a 128-byte multiple,
    a program per output tile and no warp specialization in the module."""
    from benchmarks.mosaic_ir import capture_tma_copies, misaligned, mosaic_ir

    for fmt in ("int4_g128", "mxfp4"):
        with capture_tma_copies() as copies:
            text = mosaic_ir(fmt, (8, 512, 1024), 300, tiles)
        assert copies and not misaligned(copies)
        assert "moe_gemm_mosaic_mid" in text
        assert "setmaxnreg" not in text  # warp specialization hands registers between warpgroups
    jax.clear_caches()


def test_rows_no_expert_owns_stay_zero_with_nan_input(rng):
    """Rows past the last range hold NaN in x: their tiles must store zeros,
    and no NaN reaches a row an expert owns."""
    offsets = np.asarray([0, 9, 9, 30], np.int32)
    m, n, k = 40, 128, 128
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[30:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.05, (3, n, k)), jnp.bfloat16)
    out = hj.gemm(
        x,
        w,
        hj.GroupedContiguous(jnp.asarray(offsets)),
        out_dtype=jnp.float32,
        tuning=mosaic_mid.Tiles(64, 128, 64, stages=2),
        backend=KERNEL_BACKEND,
    )
    got = np.asarray(out, np.float64)
    want = _expected(x[:30], w, offsets, 30)
    assert np.all(got[30:] == 0) and np.all(np.isfinite(got))
    assert np.linalg.norm(got[:30] - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_activation_on_the_swap_tile_lowers_for_the_gpu():
    """The w13 entry's swap tile with the gated activation in its epilogue
    (rows r and r + 64 of the one warpgroup's out.T, half-width stores)
    lowers for sm_90: the form the layer's w13 runs at 32 rows an expert."""
    import functools

    from pallas_kernels.gemm.spec import EpilogueActivation

    e, n, k = 3, 512, 256
    x = jax.ShapeDtypeStruct((300, k), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    w = jax.ShapeDtypeStruct((e, n, k // mosaic.PIECES), jnp.uint16)
    scales = jax.ShapeDtypeStruct((e, k // mosaic.UNIT, n), jnp.bfloat16)
    run = functools.partial(
        mosaic.expert_gemm_mosaic,
        tiles=MID_W13,
        out_dtype=jnp.bfloat16,
        act=EpilogueActivation("silu", gate_up_block=64),
        decode=mosaic.NibbleDecode(k // mosaic.UNIT),
    )
    traced = jax.jit(lambda x, w, o, s: run(x, w, o, scales=s)).trace(x, w, offsets, scales)
    assert "moe_gemm_mosaic_mid" in traced.lower(lowering_platforms=("cuda",)).as_text()
    assert traced.out_info.shape == (300, n // 2)
    jax.clear_caches()


def test_the_qwen3_layer_plans_it_at_t512(monkeypatch):
    """On a Hopper GPU, qwen3-30b-a3b's grouped int4 GEMMs at T=512 (4,096
    rows, 32 an expert) run the entries — w13 with the gated activation in
    its tiles —, MXFP4's w2 too; shapes only (no weight is built)."""
    G = __import__("importlib").import_module("humming_jax.gemm")
    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    layout = hj.GroupedContiguous(jnp.arange(129, dtype=jnp.int32) * 32)
    spec = hj.ActivationSpec("silu", gate_up_block=64)
    for fmt, n, k, want in (
        (F.INT4_G128, 1536, 2048, MID_W13),
        (F.INT4_G128, 2048, 768, MID_W2),
        (F.MXFP4, 2048, 768, MID_W13),
    ):
        mx = fmt is F.MXFP4

        def planar(w, fmt=fmt, mx=mx):
            return hj.to_planar(F.quantize_weight(w, fmt), half_bits=mx, k_major_scales=True)

        weight = jax.eval_shape(planar, jax.ShapeDtypeStruct((128, n, k), jnp.float32))
        x = G.as_quantized_input(jnp.zeros((4096, k), jnp.bfloat16))
        assert G.plan(x, weight, layout, out_dtype=jnp.bfloat16) == (want, [])
        if n == 1536:
            gated = jax.eval_shape(lambda w: hj.interleave_gate_up(w, 64), weight)
            assert G.plan(x, gated, layout, out_dtype=jnp.bfloat16, activation=spec) == (want, [])
