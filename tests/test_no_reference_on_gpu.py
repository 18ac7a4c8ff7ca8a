"""On a GPU no pipeline reaches a reference by accident: for every weight
format and every input quantization a kernel takes with it
(``hj.kernel_input_specs``), each expert pipeline traced for the GPU
(``backend="pallas"``, ``jax.eval_shape``: no GPU needed) gets a kernel from
every op it calls — the kernels' ``supports`` answer, the references are
poisoned. The grouped pipeline traces every kernel body it reaches for the
GPU; the indexed and batched ones, which reach the same GEMM kernels, get a
stand-in of the output's shape once the kernel has taken the call (tracing
each body three times was a tenth of the CPU suite). The pairs without a
kernel raise on a GPU, naming the op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import backend as B
from humming_jax import formats as F
from humming_jax import input_quant as Q
from pallas_kernels import gemm as kernels

E, H, INTER, TOP_K, T = 4, 256, 128, 2, 8
FORMATS = sorted(F.PRESETS) + ["int4_g128+bias", "mxfp4+bias"]


@pytest.fixture
def no_references(monkeypatch):
    """Every reference the pipelines could fall back to raises when called."""
    import importlib

    for module, name in (
        ("humming_jax.gemm", "gemm_reference"),
        ("humming_jax.process_input", "process_input_reference"),
    ):
        mod = importlib.import_module(module)

        def poisoned(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} reached on the GPU path")

        monkeypatch.setattr(mod, name, poisoned)


@pytest.fixture
def gemm_stand_ins(monkeypatch):
    """``use()``: from then on each GEMM kernel, once it ``supports`` the call,
    returns zeros of the call's output shape instead of tracing its body;
    ``calls`` counts them."""
    calls = []

    def use():
        for module in kernels.KERNELS.values():

            def stand_in(call, tiles, *arrays, _module=module):
                assert _module.supports(tiles, call) is None
                calls.append(call)
                n = call.weight.n if call.activation is None else call.activation.out_n(call.weight.n)
                return jnp.zeros((call.layout.m_out, n), call.out_dtype)

            monkeypatch.setattr(module, "expert_gemm", stand_in)

    return use, calls


def _weights(config: hj.ExpertsConfig) -> hj.ExpertWeights:
    fmt = config.weight_format
    w13 = jax.ShapeDtypeStruct((E, config.w13_n, H), jnp.float32)
    w2 = jax.ShapeDtypeStruct((E, H, INTER), jnp.float32)
    bias = {}
    if fmt.has_bias:
        bias = dict(
            w13_bias=jax.ShapeDtypeStruct((E, config.w13_n), jnp.float32),
            w2_bias=jax.ShapeDtypeStruct((E, H), jnp.float32),
        )
    if config.input_quant.mode.is_static:
        bias.update(
            w13_input_scale=jax.ShapeDtypeStruct((1,), jnp.float32),
            w2_input_scale=jax.ShapeDtypeStruct((1,), jnp.float32),
        )
    return jax.eval_shape(lambda w13, w2, **b: hj.quantize_experts(w13, w2, config, **b), w13, w2, **bias)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_every_advertised_pair_has_a_kernel_in_every_pipeline(fmt_name, no_references, gemm_stand_ins):
    fmt = F.get_format(fmt_name)
    specs = hj.kernel_input_specs(fmt)
    assert Q.NONE in specs
    configs = [hj.ExpertsConfig(E, H, INTER, TOP_K, weight_format=fmt, input_quant=spec) for spec in specs]
    weights = [_weights(config) for config in configs]
    x = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
    tw = jax.ShapeDtypeStruct((T, TOP_K), jnp.float32)
    ids = jax.ShapeDtypeStruct((T, TOP_K), jnp.int32)
    use_stand_ins, calls = gemm_stand_ins
    for pipeline in (hj.humming_grouped_experts, hj.humming_indexed_experts):
        if pipeline is hj.humming_indexed_experts:
            use_stand_ins()
        for config, w in zip(configs, weights, strict=True):
            if pipeline is hj.humming_indexed_experts:  # inputs written multiplied out repeat a call: count each
                hj.gemm.clear_cache()
            out = jax.eval_shape(
                lambda x, w, tw, ids, p=pipeline, c=config: p(x, w, tw, ids, c, backend="pallas"), x, w, tw, ids
            )
            assert out.shape == (T, H)
    xb = jax.ShapeDtypeStruct((E, 4, H), jnp.bfloat16)
    counts = jax.ShapeDtypeStruct((E,), jnp.int32)
    for config, w in zip(configs, weights, strict=True):
        hj.gemm.clear_cache()
        out = jax.eval_shape(
            lambda x, n, w, c=config: hj.batched_humming_grouped_experts(x, n, w, c, backend="pallas"), xb, counts, w
        )
        assert out.shape == (E, 4, H)
    assert len(calls) == 4 * len(configs)  # w13 and w2 of the indexed and batched pipelines, each on a kernel


def test_moonep_experts_have_a_kernel(no_references):
    g, nvs = 5, 24
    shapes = [
        jax.ShapeDtypeStruct((nvs, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, INTER, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, INTER, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, H, INTER), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((nvs,), jnp.float32),
    ]
    out = jax.eval_shape(lambda *a: hj.moonep_experts(*a, backend="pallas"), *shapes)
    assert out.shape == (nvs, H)
    # The module's form: gate and up as one interleaved w13, the activation in its tiles.
    w13 = jax.eval_shape(hj.moonep_w13, shapes[1], shapes[2])
    rest = (shapes[3], shapes[4], shapes[5])
    run = lambda x, w, *a: hj.moonep_interleaved_experts(x, w, *a, backend="pallas")  # noqa: E731
    out = jax.eval_shape(run, shapes[0], w13, *rest)
    assert out.shape == (nvs, H)


def test_every_advertised_pair_has_a_kernel():
    """Every (weight format, input quantization) pair the library lists runs on a kernel."""
    for name in FORMATS:
        fmt = F.get_format(name)
        assert hj.kernel_input_specs(fmt) == hj.supported_input_specs(fmt), name


def test_a_call_without_a_kernel_raises_on_the_gpu(monkeypatch, rng):
    """An indexed layout aligned to 24 rows has no kernel (a tile is a block of
    a power of two): on a GPU the call raises naming the op and why; with the
    opt-in it runs the reference after a one-time warning; ``backend="reference"``
    runs it silently."""
    monkeypatch.delenv(B.FALLBACK_ENV_VAR, raising=False)
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    monkeypatch.setattr(B, "_WARNED", set())  # the warning is once a process: another test may have had it
    fmt = F.FP8_BLOCK128
    weight = F.quantize_weight(jnp.asarray(rng.normal(0, 0.05, (E, 256, H)), jnp.float32), fmt)
    x = hj.quantize_input(jnp.asarray(rng.normal(size=(T, H)), jnp.float32), Q.FP8_DYNAMIC_GROUP128)
    ids = jnp.asarray(rng.integers(0, E, size=(T, 1)), jnp.int32)
    layout = hj.Indexed(*hj.moe_align_block_size(ids, 24, E), top_k=1, block_size=24)
    want = np.asarray(hj.gemm(x, weight, layout, backend="reference"))
    monkeypatch.setattr(B.jax, "default_backend", lambda: "gpu")
    with pytest.raises(B.NoKernelError, match="gemm: no kernel takes this call.*block_size of 24"):
        hj.gemm(x, weight, layout, valid_shape_m=7)  # a new static argument: traced anew
    monkeypatch.setenv(B.FALLBACK_ENV_VAR, "1")
    with pytest.warns(UserWarning, match="gemm: no kernel takes this call"):
        got = hj.gemm(x, weight, layout, valid_shape_m=9)
    np.testing.assert_array_equal(np.asarray(got), want)
