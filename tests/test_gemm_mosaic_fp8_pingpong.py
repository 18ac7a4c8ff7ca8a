"""The ping-pong fp8 kernel (W8A8: group-scaled e4m3 inputs, block-scaled
e4m3 weights) against float64 NumPy in interpret mode, which checks its
barriers' phases: every tile of a program alternating between the two compute
warpgroups, each fed by its own ring, taking turns on the tensor cores."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import formats as F
from humming_jax import input_quant as Q
from pallas_kernels import gemm as gemm_kernels
from pallas_kernels.gemm import mosaic_fp8_pingpong as kernel

import gemm_layouts
import np_ref
from np_ref import relative_error

KERNEL_BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
BOUND = 1e-5 if KERNEL_BACKEND == "interpret" else 1e-3
E, N, K, M = 4, 256, 384, 40


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """The kernel as a family the op dispatches to (an experiment: not in the package's table)."""
    monkeypatch.setitem(gemm_kernels.KERNELS, kernel.Tiles, kernel)
    monkeypatch.setitem(gemm_kernels.IMPLS, "mosaic_fp8_pingpong", kernel.Tiles)


def _operands(rng, e: int = E, m: int = M):
    w = jnp.asarray(rng.normal(0, 0.05, (e, N, K)), jnp.float32)
    weight = F.quantize_weight(w, F.get_format("fp8_block128"))
    x = Q.quantize_input(jnp.asarray(rng.normal(size=(m, K)), jnp.float32), Q.get_input_spec("fp8_dynamic_group128"))
    return x, weight


@pytest.mark.parametrize("layout_kind", ["grouped_contiguous", "indexed", "grouped_masked"])
@pytest.mark.parametrize("tiles", [kernel.Tiles(64, 128, stages=2, group_m=2), kernel.Tiles(64, 64, stages=3)])
def test_against_numpy(layout_kind, tiles, rng):
    """An empty expert, rows past the last range, several tiles a program (both warpgroups' turns)."""
    x, weight = _operands(rng)
    layout = gemm_layouts.layouts(rng, E, M, block_size=tiles.block_m)[layout_kind]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    want = np_ref.gemm_of(x, weight, layout)
    got = np.asarray(out, np.float64)
    assert np.all(np.isfinite(got)), "a row left unwritten reads as NaN in the interpreter"
    assert relative_error(got, want) < BOUND
    assert np.all(got[np.all(want == 0, axis=1)] == 0), "rows no expert owns must be zero"


@pytest.mark.parametrize("layout_kind", ["grouped_contiguous", "indexed"])
def test_mxfp4_through_its_e4m3_copy(layout_kind, rng):
    """W4A8 from many rows an expert: MXFP4 (planar, the pair decoder's bits,
    scales [E, K/32, N] as the modules store them; groups' scales up to 2**12
    apart in a row) decoded to its e4m3 copy, then the ping-pong loop with a
    scale a column."""
    spread = np.exp2(rng.integers(-12, 1, (E, N, K // 32))).repeat(32, axis=-1)
    w = jnp.asarray(rng.normal(0, 0.05, (E, N, K)) * spread, jnp.float32)
    weight = F.to_planar(F.quantize_weight(w, F.get_format("mxfp4")), half_bits=True, k_major_scales=True)
    x, _ = _operands(rng)
    tiles = kernel.Tiles(64, 128, stages=2, group_m=2, dequantize_first=True)
    layout = gemm_layouts.layouts(rng, E, M, block_size=tiles.block_m)[layout_kind]
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, tuning=tiles, backend=KERNEL_BACKEND)
    want = np_ref.gemm_of(x, weight, layout)
    got = np.asarray(out, np.float64)
    assert np.all(np.isfinite(got)) and relative_error(got, want) < BOUND
    assert np.all(got[np.all(want == 0, axis=1)] == 0)
    with pytest.raises(ValueError, match="without dequantize_first"):
        hj.gemm(x, weight, layout, tuning=kernel.Tiles(), backend=KERNEL_BACKEND)


def test_what_it_refuses(rng):
    x, weight = _operands(rng)
    layout = gemm_layouts.layouts(rng, E, M)["grouped_contiguous"]
    with pytest.raises(ValueError, match="at most 8192 values twice"):
        hj.gemm(x, weight, layout, tuning=kernel.Tiles(128, 128), backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="shared-memory buffers"):
        hj.gemm(x, weight, layout, tuning=kernel.Tiles(64, 128, stages=6), backend=KERNEL_BACKEND)
    channel = F.quantize_weight(jnp.ones((E, N, K), jnp.float32), F.get_format("fp8_channel"))
    with pytest.raises(ValueError, match="block-scaled weights"):
        hj.gemm(x, channel, layout, tuning=kernel.Tiles(), backend=KERNEL_BACKEND)


@pytest.mark.parametrize("tiles", [kernel.Tiles(), kernel.Tiles(64, 128, stages=3)])
def test_lowers_for_the_gpu_with_the_counted_shared_memory(tiles):
    """The kernel lowers for sm_90 on the CPU (warp specialization, its rings'
    barriers, the register split) and launches with exactly the shared memory
    ``supports()`` counts."""
    from benchmarks.mosaic_ir import capture_mosaic_modules, shared_memory_size

    e, n, k, rows = 8, 2048, 768, 4096
    specs = (
        jax.ShapeDtypeStruct((rows, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((rows, k // 128), jnp.float32),
        jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((e, n // 128, k // 128), jnp.float32),
        jax.ShapeDtypeStruct((e + 1,), jnp.int32),
    )

    def run(*args):
        return kernel.expert_gemm_fp8_pingpong(*args, tiles, out_dtype=jnp.bfloat16)

    with capture_mosaic_modules() as texts:
        jax.jit(run).trace(*specs).lower(lowering_platforms=("cuda",))
    assert shared_memory_size(texts[-1]) == kernel.shared_memory_bytes(tiles, jnp.bfloat16)
    assert texts[-1].count("setmaxnreg") == 2  # the memory warpgroup's registers to the compute pair
    # MXFP4 through its e4m3 copy: the decode pass, then the loop with a scale a column on the sum
    copy = dataclasses.replace(tiles, dequantize_first=True)
    mx = (*specs[:2], jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((e, k // 32, n), jnp.uint8))

    def run_mx(*args):
        return kernel.expert_gemm_fp8_pingpong(*args, copy, out_dtype=jnp.bfloat16)

    with capture_mosaic_modules() as texts:
        jax.jit(run_mx).trace(*mx, specs[-1]).lower(lowering_platforms=("cuda",))
    assert len(texts) == 2 and shared_memory_size(texts[-1]) == kernel.shared_memory_bytes(copy, jnp.bfloat16)
