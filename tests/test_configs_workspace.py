"""Configs (validation, hashing), backend choice, and plan_workspace against
vLLM's buffer rules."""

import dataclasses
import math

import jax.numpy as jnp
import pytest

import humming_jax as hj
from humming_jax import backend as B
from humming_jax import formats as F
from humming_jax import input_quant as Q

# ---- configs ---------------------------------------------------------------------


def test_configs_are_frozen_and_hashable():
    config = hj.ExpertsConfig(8, 256, 128, 2, weight_format="mxfp4", input_quant="mxfp8_dynamic")
    assert hash(config) == hash(hj.ExpertsConfig(8, 256, 128, 2, weight_format="mxfp4", input_quant="mxfp8_dynamic"))
    with pytest.raises(AttributeError):
        config.top_k = 3  # type: ignore[misc]
    assert config.w13.shape_n == 256 and config.w2.shape_k == 128
    assert hj.ExpertsConfig(8, 256, 128, 2, activation="silu_no_mul").w13.shape_n == 128


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts=0), "num_experts"),
        (dict(top_k=2.0), "top_k"),
        (dict(weight_format="int4_g128", intermediate_size=96), "groups of 128"),
        (dict(weight_format="mxfp4", intermediate_size=33), "K must be even"),
        (dict(weight_format="bf16", input_quant="fp8_dynamic_token"), "not supported with weight format 'bf16'"),
        (dict(weight_format="int4_g128", input_quant="nvfp4_dynamic"), "supported: none, fp8_dynamic_token"),
        (dict(hadamard_block_size=96), "hadamard_block_size"),
        (dict(hadamard_block_size=1024), "hadamard_block_size"),
        (dict(compute_dtype="float32"), "compute_dtype"),
        (dict(use_f16_accum=True), "use_f16_accum"),
        (dict(global_num_experts=4), "global_num_experts"),
        (dict(top_k=9), "top_k: 9 experts a token"),
        (dict(num_experts=2, global_num_experts=4, top_k=8), r"global_num_experts=4\)"),
        (dict(activation="tanh"), "kind"),
    ],
)
def test_experts_config_rejects(kwargs, match):
    base = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2)
    with pytest.raises(ValueError, match=match):
        hj.ExpertsConfig(**{**base, **kwargs})


def test_layer_config_padding_and_errors():
    layer = hj.LayerConfig(256, 2944, 4, "int4_g128", pad_shape_k=64)
    assert layer.real_k == 2880
    with pytest.raises(ValueError, match="pad_shape_k"):
        hj.LayerConfig(256, 256, 4, pad_shape_k=256)
    with pytest.raises(ValueError, match="shape_n"):
        hj.LayerConfig(-1, 256, 4)


def test_tile_and_compute_configs():
    from pallas_kernels.gemm import triton

    with pytest.raises(ValueError, match="triton.Tiles.block_m"):
        triton.Tiles(block_m=48)
    with pytest.raises(ValueError, match="block_k"):
        triton.Tiles(block_k=8)
    with pytest.raises(ValueError, match="num_warps"):
        triton.Tiles(num_warps=3)
    with pytest.raises(ValueError, match="layout"):
        hj.ComputeConfig(layout="ragged")
    table = {"dense/16bit": (hj.tuning.Entry(0, 64, triton.Tiles(16)), hj.tuning.Entry(64, 1 << 30, triton.Tiles()))}
    assert hj.tuning.Entry.from_json(table["dense/16bit"][0].to_json()) == table["dense/16bit"][0]


def test_every_weight_format_takes_unquantized_inputs():
    for fmt in F.PRESETS.values():
        assert Q.NONE in hj.supported_input_specs(fmt)
        hj.check_supported(fmt, Q.NONE)


# ---- backend -----------------------------------------------------------------------


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    assert B.default_backend() == "reference"  # CPU: XLA runs the reference faster than the interpreted kernels
    monkeypatch.setenv(B.ENV_VAR, "interpret")
    assert B.default_backend() == "interpret"
    monkeypatch.setenv(B.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=B.ENV_VAR):
        B.default_backend()
    monkeypatch.delenv(B.ENV_VAR)
    with pytest.raises(ValueError, match="backend"):
        B.resolve_backend("triton", "gemm")
    assert B.resolve_backend("reference", "gemm") == "reference"
    assert B.resolve_backend(None, "gemm") == "reference"


def test_no_kernel_policy(monkeypatch):
    """A call no kernel takes: an explicit kernel backend raises; on a GPU the
    default raises too unless the user opted in (then a one-time warning);
    off a GPU the default warns once and runs the reference."""
    monkeypatch.delenv(B.FALLBACK_ENV_VAR, raising=False)
    monkeypatch.setattr(B, "_WARNED", set())
    with pytest.raises(B.NoKernelError, match="op: no kernel takes this call \\(why\\); backend 'pallas'"):
        B.no_kernel("op", "why", "pallas")
    with pytest.warns(UserWarning, match="op: no kernel takes this call \\(a reason\\)"):
        B.no_kernel("op", "a reason", None)
    monkeypatch.setattr(B.jax, "default_backend", lambda: "gpu")
    with pytest.raises(B.NoKernelError, match="on the GPU.*HUMMING_JAX_REFERENCE_FALLBACK=1"):
        B.no_kernel("op", "another reason", None)
    monkeypatch.setenv(B.FALLBACK_ENV_VAR, "1")
    with pytest.warns(UserWarning, match="another reason"):
        B.no_kernel("op", "another reason", None)


# ---- plan_workspace (vLLM's get_buffer_metas / _workspace_shapes rules) ------------


def _nbytes(buffer):
    return math.prod(buffer.shape) * jnp.dtype(buffer.dtype).itemsize


@pytest.mark.parametrize("pipeline", ["grouped", "indexed"])
@pytest.mark.parametrize("activation", ["silu", "relu2_no_mul"])
def test_plan_standard_pipelines(pipeline, activation):
    e, h, i, k, m = 8, 256, 128, 4, 33
    config = hj.ExpertsConfig(e, h, i, k, activation=activation, weight_format="int4_g128")
    plan = hj.plan_workspace(config, m, k, pipeline)
    gated = activation == "silu"
    b = plan.buffers
    assert b["quanted_gate_up_input"].shape == ((m, h) if pipeline == "indexed" else (m * k, h))
    assert b["gate_up_output"].shape == (m * k, 2 * i if gated else i)
    assert b["quanted_down_input"].shape == (m * k, i)
    assert b["down_output"].shape == (m * k, h)
    assert b["output"].shape == (m, h)
    assert all(buf.dtype == jnp.bfloat16 for buf in b.values())
    assert plan.required == ("quanted_gate_up_input", "gate_up_output", "quanted_down_input", "down_output", "output")
    # Walking the chain backwards, neighbours alternate workspaces.
    assert [plan.workspace_of[n] for n in reversed(plan.required)] == [1, 2, 1, 2, 1]
    ws1 = max(_nbytes(b[n]) for n in ("output", "quanted_down_input", "quanted_gate_up_input"))
    ws2 = max(_nbytes(b[n]) for n in ("down_output", "gate_up_output"))
    assert (plan.workspace1_bytes, plan.workspace2_bytes) == (ws1, ws2)
    assert plan.peak_bytes == ws1 + ws2


def test_plan_batched_and_quantized_dtypes():
    e, h, i, max_tokens, dispatchers = 4, 256, 128, 16, 2
    config = hj.ExpertsConfig(
        e, h, i, 2, weight_format="nvfp4", input_quant="nvfp4_dynamic_token", w2_input_quant="fp8_dynamic_token"
    )
    plan = hj.plan_workspace(config, 5, 2, "batched", max_num_tokens=max_tokens, num_dispatchers=dispatchers)
    rows = e * max_tokens * dispatchers
    b = plan.buffers
    assert b["quanted_gate_up_input"].shape == (rows, h // 2) and b["quanted_gate_up_input"].dtype == jnp.uint8
    assert b["quanted_down_input"].shape == (rows, i) and b["quanted_down_input"].dtype == jnp.float8_e4m3fn
    assert b["down_output"].shape == (e, max_tokens * dispatchers, h)
    assert plan.required[-1] == "down_output"  # the batched output is down_output itself
    assert [plan.workspace_of[n] for n in reversed(plan.required)] == [1, 2, 1, 2]


def test_plan_errors():
    config = hj.ExpertsConfig(4, 256, 128, 2)
    with pytest.raises(ValueError, match="pipeline"):
        hj.plan_workspace(config, 4, 2, "masked")
    with pytest.raises(ValueError, match="max_num_tokens"):
        hj.plan_workspace(config, 4, 2, "batched")
    with pytest.raises(ValueError, match="w2 takes K"):
        hj.plan_workspace(config, 4, 2, "grouped", activation="silu_no_mul")
    with pytest.raises(ValueError, match="num_tokens: expected a non-negative int"):
        hj.plan_workspace(config, -1, 2, "grouped")
    assert hj.plan_workspace(config, 0, 2, "grouped").buffers["output"].shape == (0, 256)  # an empty batch


def test_experts_config_hash_is_cached_and_travels():
    """A jitted layer hashes its static config every call: the hash is computed
    once and equals an equal config's; a pickled config (string hashes differ
    between processes) carries no hash and hashes anew."""
    import pickle

    a = hj.ExpertsConfig(8, 256, 128, 2, weight_format="int4_g128")
    b = hj.ExpertsConfig(8, 256, 128, 2, weight_format="int4_g128")
    c = dataclasses.replace(a, batch_invariant=True)
    assert hash(a) == hash(b) and a == b and a != c and hash(a) != hash(c)
    assert "_hash" in a.__dict__  # cached after the first hash
    restored = pickle.loads(pickle.dumps(a))
    assert "_hash" not in restored.__dict__ and restored == a and hash(restored) == hash(a)
