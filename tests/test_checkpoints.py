"""Loading real checkpoint layouts. Each test writes a small safetensors file in
the layout with its own writer (NumPy packing written from the format's
definition, saved with the ``safetensors`` package), loads it with
``load_experts`` and checks the loaded layer against float64 math on the
writer's dequantized weights."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import humming_jax as hj
from humming_jax import checkpoints
from humming_jax import formats as F
from humming_jax.checkpoints import SafetensorsCheckpoint, load_experts, read_safetensors

import np_ref

E, H, I = 2, 256, 256  # noqa: E741
PREFIX = "model.layers.0.mlp.experts"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _pack_int32(nibbles: np.ndarray, axis: int) -> np.ndarray:
    """8 nibbles -> one int32 along ``axis`` (nibble j at bits 4j)."""
    nibbles = np.moveaxis(nibbles.astype(np.uint32), axis, -1)
    words = nibbles.reshape(*nibbles.shape[:-1], -1, 8)
    packed = np.zeros(words.shape[:-1], np.uint32)
    for j in range(8):
        packed |= words[..., j] << np.uint32(4 * j)
    return np.moveaxis(packed.view(np.int32), -1, axis)


def _asym_groups(w: np.ndarray, groups_of_k: np.ndarray, num_groups: int):
    """Per (column n, group) min/max quantization of ``w [N, K]``: q [N, K], zero [N, G], scale [N, G] (f16)."""
    n, k = w.shape
    q = np.zeros((n, k), np.int64)
    zero = np.zeros((n, num_groups), np.int64)
    scale = np.zeros((n, num_groups), np.float16)
    for g in range(num_groups):
        cols = groups_of_k == g
        lo, hi = np.minimum(w[:, cols].min(1), 0), np.maximum(w[:, cols].max(1), 0)
        s = ((hi - lo) / 15).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float64)), 0, 15).astype(np.int64)
        q[:, cols] = np.clip(np.round(w[:, cols] / s.astype(np.float64)[:, None]) + z[:, None], 0, 15)
        zero[:, g], scale[:, g] = z, s
    return q, zero, scale


def _dequant_asym(q, zero, scale, groups_of_k):
    return (q - zero[:, groups_of_k]) * scale.astype(np.float64)[:, groups_of_k]


def write_gptq(rng, n, k, act_order, g_idx=None):
    w = rng.normal(0, 0.05, (n, k))
    if g_idx is None:
        g_idx = (np.arange(k) // 128) if not act_order else (rng.permutation(k) // 128)
    q, zero, scale = _asym_groups(w, g_idx, k // 128)
    tensors = {
        "qweight": _pack_int32(q.T, 0),  # [K/8, N]
        "qzeros": _pack_int32(((zero - 1) & 0xF).T, 1),  # [G, N/8], stored as z - 1
        "scales": scale.T.copy(),  # [G, N]
        "g_idx": g_idx.astype(np.int32),
    }
    return tensors, _dequant_asym(q, zero, scale, g_idx)


def write_awq(rng, n, k):
    w = rng.normal(0, 0.05, (n, k))
    groups = np.arange(k) // 128
    q, zero, scale = _asym_groups(w, groups, k // 128)

    def pack_awq(m):  # [R, N] -> [R, N/8] with column 8w + AWQ_ORDER[j] in nibble j
        r = m.shape[0]
        words = m.reshape(r, n // 8, 8)[:, :, AWQ_ORDER]
        return _pack_int32(words.reshape(r, n), 1)

    return {"qweight": pack_awq(q.T), "qzeros": pack_awq(zero.T), "scales": scale.T.copy()}, _dequant_asym(
        q, zero, scale, groups
    )


def write_compressed_tensors(rng, n, k):
    w = rng.normal(0, 0.05, (n, k))
    amax = np.abs(w.reshape(n, k // 128, 128)).max(-1)
    scale = (amax / 7).astype(np.float16)
    s = np.repeat(scale.astype(np.float64), 128, axis=1)
    q = np.clip(np.round(w / s), -8, 7).astype(np.int64)
    return {"weight_packed": _pack_int32(q + 8, 1), "weight_scale": scale}, q * s


def write_fp8_block(rng, n, k):
    w = rng.normal(0, 0.05, (n, k))
    blocks = np.abs(w.reshape(n // 128, 128, k // 128, 128)).max(axis=(1, 3))
    s = (blocks / 448).astype(np.float32)
    full = np.repeat(np.repeat(s, 128, 0), 128, 1).astype(np.float64)
    weight = (w / full).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return {"weight": weight, "weight_scale_inv": s}, weight.astype(np.float64) * full


def _e2m1_codes(v: np.ndarray) -> np.ndarray:
    """Round to e2m1 with NumPy's float4 type and read back the 4-bit codes."""
    return np.asarray(v, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def write_nvfp4(rng, n, k):
    w = rng.normal(0, 0.05, (n, k))
    s2 = np.float32(np.abs(w).max() / (448 * 6))
    amax = np.abs(w.reshape(n, k // 16, 16)).max(-1)
    sb = (amax / 6 / s2).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    full = np.repeat(sb.astype(np.float64), 16, 1) * float(s2)
    codes = _e2m1_codes(w / full)
    deq = np_ref.E2M1_TABLE[codes] * full
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return {
        "weight": packed,
        "weight_scale": sb,
        "weight_scale_2": np.array(s2, np.float32),
        "input_scale": np.array(0.01 + rng.random(), np.float32),
    }, deq


def write_gpt_oss(rng, e, n, k):
    w = rng.normal(0, 0.05, (e, n, k))
    amax = np.abs(w.reshape(e, n, k // 32, 32)).max(-1)
    exponent = np.floor(np.log2(amax)) - 2  # OCP MX: 2^(floor(log2 amax) - emax)
    full = np.repeat(2.0**exponent, 32, -1)
    codes = _e2m1_codes(w / full)
    deq = np_ref.E2M1_TABLE[codes] * full
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    bias = rng.normal(size=(e, n)).astype(np.float32)
    return (
        {"blocks": packed.reshape(e, n, k // 32, 16), "scales": (exponent + 127).astype(np.uint8), "bias": bias},
        deq,
        bias,
    )


def _save(tmp_path, tensors):
    path = str(tmp_path / "experts.safetensors")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path)
    return read_safetensors(path)


def _per_expert(rng, writer, **kw):
    tensors, w13, w2 = {}, [], []
    for x in range(E):
        parts = {}
        if kw.get("act_order"):  # gate and up see the same input: the same act-order
            kw["g_idx"] = rng.permutation(H) // 128
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            if proj == "down_proj" and "g_idx" in kw:
                kw["g_idx"] = rng.permutation(I) // 128
            t, deq = writer(rng, n, k, **kw)
            tensors.update({f"{PREFIX}.{x}.{proj}.{name}": v for name, v in t.items()})
            parts[proj] = deq
        w13.append(np.concatenate([parts["gate_proj"], parts["up_proj"]]))
        w2.append(parts["down_proj"])
    return tensors, np.stack(w13), np.stack(w2)


def _moe_float(x, w13, w2, ids, weights, activation, b13=None, b2=None):
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gate_up = x[t] @ w13[e].T + (0 if b13 is None else b13[e])
            act = np_ref.activation(gate_up[None], activation)[0]
            out[t] += weights[t, j] * (act @ w2[e].T + (0 if b2 is None else b2[e]))
    return out


def _run_layer(config, loaded, w13, w2, rng, b13=None, b2=None):
    x = jnp.asarray(rng.normal(size=(5, H)), jnp.bfloat16)
    ids = np.stack([rng.permutation(E)[:2] for _ in range(5)]).astype(np.int32)
    weights = rng.random((5, 2)).astype(np.float32)
    out = hj.humming_grouped_experts(x, loaded, jnp.asarray(weights), jnp.asarray(ids), config)
    expected = _moe_float(np.asarray(x, np.float64), w13, w2, ids, weights, config.activation.kind.value, b13, b2)
    assert np_ref.relative_error(out, expected) < 2e-2


F16_SCALES = {"scale_type": "float16"}


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq(tmp_path, rng, act_order):
    tensors, w13, w2 = _per_expert(rng, write_gptq, act_order=act_order)
    fmt = dataclasses.replace(F.UINT4_ZP_G128, name="uint4_zp_g128_f16", **F16_SCALES)
    config = hj.ExpertsConfig(E, H, I, 2, weight_format=fmt)
    loaded = load_experts(_save(tmp_path, tensors), PREFIX, config, "gptq")
    np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w13), w13, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w2), w2, rtol=1e-6, atol=1e-12)
    assert (loaded.w13.group_index is not None) == act_order
    _run_layer(config, loaded, w13, w2, rng)


def test_awq_and_compressed_tensors(tmp_path, rng):
    for writer, layout, base in (
        (write_awq, "awq", F.UINT4_ZP_G128),
        (write_compressed_tensors, "compressed_tensors", F.INT4_G128),
    ):
        tensors, w13, w2 = _per_expert(rng, writer)
        fmt = dataclasses.replace(base, name=base.name + "_f16", **F16_SCALES)
        config = hj.ExpertsConfig(E, H, I, 2, weight_format=fmt)
        loaded = load_experts(_save(tmp_path, tensors), PREFIX, config, layout)
        np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w13), w13, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w2), w2, rtol=1e-6, atol=1e-12)
        _run_layer(config, loaded, w13, w2, rng)


def test_fp8_block_and_nvfp4(tmp_path, rng):
    tensors, w13, w2 = _per_expert(rng, write_fp8_block)
    config = hj.ExpertsConfig(E, H, I, 2, weight_format="fp8_block128")
    loaded = load_experts(_save(tmp_path, tensors), PREFIX, config, "fp8_block")
    np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w13), w13, rtol=1e-6, atol=1e-12)
    _run_layer(config, loaded, w13, w2, rng)

    tensors, w13, w2 = _per_expert(rng, write_nvfp4)
    for x in range(E):  # one global scale per expert and weight (ModelOpt fuses gate/up that way)
        tensors[f"{PREFIX}.{x}.up_proj.weight_scale_2"] = tensors[f"{PREFIX}.{x}.gate_proj.weight_scale_2"]
    tensors, w13, w2 = _rewrite_nvfp4_with_shared_global(rng, tensors)
    config = hj.ExpertsConfig(
        E, H, I, 2, weight_format="nvfp4", input_quant="nvfp4_dynamic", w2_input_quant="nvfp4_dynamic"
    )
    loaded = load_experts(_save(tmp_path, tensors), PREFIX, config, "modelopt_nvfp4")
    np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w13), w13, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w2), w2, rtol=1e-6, atol=1e-12)
    gate_up_scales = [
        float(tensors[f"{PREFIX}.{x}.{p}.input_scale"]) for x in range(E) for p in ("gate_proj", "up_proj")
    ]
    assert float(loaded.w13_input_scale[0]) == pytest.approx(max(gate_up_scales))


def _rewrite_nvfp4_with_shared_global(rng, tensors):
    """Re-quantize gate and up of each expert with one global scale (as ModelOpt stores fused w13)."""
    w13, w2 = [], []
    for x in range(E):
        rows = {}
        ws = {
            p: rng.normal(0, 0.05, (n, k))
            for p, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))
        }
        shared = np.float32(max(np.abs(ws["gate_proj"]).max(), np.abs(ws["up_proj"]).max()) / (448 * 6))
        for proj, w in ws.items():
            s2 = shared if proj != "down_proj" else np.float32(np.abs(w).max() / (448 * 6))
            n, k = w.shape
            amax = np.abs(w.reshape(n, k // 16, 16)).max(-1)
            sb = (amax / 6 / s2).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            full = np.repeat(sb.astype(np.float64), 16, 1) * float(s2)
            codes = _e2m1_codes(w / full)
            rows[proj] = np_ref.E2M1_TABLE[codes] * full
            tensors[f"{PREFIX}.{x}.{proj}.weight"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
            tensors[f"{PREFIX}.{x}.{proj}.weight_scale"] = sb
            tensors[f"{PREFIX}.{x}.{proj}.weight_scale_2"] = np.array(s2, np.float32)
        w13.append(np.concatenate([rows["gate_proj"], rows["up_proj"]]))
        w2.append(rows["down_proj"])
    return tensors, np.stack(w13), np.stack(w2)


def test_gpt_oss_mxfp4(tmp_path, rng):
    t13, w13, b13 = write_gpt_oss(rng, E, 2 * I, H)
    t2, w2, b2 = write_gpt_oss(rng, E, H, I)
    tensors = {f"{PREFIX}.gate_up_proj_{k}": v for k, v in t13.items()}
    tensors.update({f"{PREFIX}.down_proj_{k}": v for k, v in t2.items()})
    config = hj.ExpertsConfig(E, H, I, 2, activation="swigluoai", weight_format="mxfp4+bias")
    loaded = load_experts(_save(tmp_path, tensors), PREFIX, config, "gpt_oss_mxfp4")
    assert loaded.w13.nibble_unit and loaded.w13.half_bits  # in the order the bf16 kernels read
    np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w13), w13, rtol=1e-6, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(loaded.w13.bias), b13)
    _run_layer(config, loaded, w13, w2, rng, b13=b13.astype(np.float64), b2=b2.astype(np.float64))


def test_bad_checkpoints_name_the_tensor(tmp_path, rng):
    tensors, _, _ = _per_expert(rng, write_fp8_block)
    config = hj.ExpertsConfig(E, H, I, 2, weight_format="fp8_block128")
    missing = dict(tensors)
    del missing[f"{PREFIX}.1.up_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.mlp.experts.1.up_proj.weight_scale_inv'"):
        load_experts(missing, PREFIX, config, "fp8_block")
    wrong_shape = dict(tensors)
    wrong_shape[f"{PREFIX}.0.down_proj.weight"] = tensors[f"{PREFIX}.0.down_proj.weight"][:, :128]
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.0.down_proj.weight' has shape"):
        load_experts(wrong_shape, PREFIX, config, "fp8_block")
    wrong_dtype = dict(tensors)
    wrong_dtype[f"{PREFIX}.0.gate_proj.weight"] = np.zeros((I, H), np.float16)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.0.gate_proj.weight' has dtype float16"):
        load_experts(wrong_dtype, PREFIX, config, "fp8_block")
    with pytest.raises(ValueError, match="layout"):
        load_experts(tensors, PREFIX, config, "bitsandbytes")


def test_a_sharded_folder_is_read_lazily(tmp_path, rng):
    """``SafetensorsCheckpoint`` over a folder of shards and its index: a
    layer's tensors split over three files (and another layer's, never read),
    loaded as from one file; each tensor memory-mapped on first use."""
    tensors, w13, w2 = _per_expert(rng, write_fp8_block)
    other = {
        f"model.layers.1.mlp.experts.{x}.up_proj.weight": rng.normal(size=(4, 4)).astype(np.float32) for x in (0, 1)
    }
    names = sorted(tensors) + sorted(other)
    shards = [names[0::3], names[1::3], names[2::3]]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: np.ascontiguousarray({**tensors, **other}[n]) for n in shard}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(shard, file))
    (tmp_path / SafetensorsCheckpoint.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert set(checkpoint) == set(names) and len(checkpoint) == len(names)
    first = checkpoint[names[0]]
    assert isinstance(first.base, np.memmap) or isinstance(first, np.memmap)
    np.testing.assert_array_equal(first, tensors[names[0]])
    config = hj.ExpertsConfig(E, H, I, 2, weight_format="fp8_block128")
    lazy = load_experts(checkpoint, PREFIX, config, "fp8_block")
    (tmp_path / "one").mkdir()
    whole = load_experts(_save(tmp_path / "one", tensors), PREFIX, config, "fp8_block")
    for a, b in zip(jax.tree.leaves(lazy), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(KeyError, match="no tensor 'absent'"):
        checkpoint["absent"]
    (tmp_path / SafetensorsCheckpoint.INDEX).unlink()  # without the index: every file of the folder
    assert set(SafetensorsCheckpoint(tmp_path)) == set(names)


HF = {
    "mixtral": dict(num_local_experts=8, intermediate_size=256, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=128, num_experts_per_tok=4, norm_topk_prob=False),
    "deepseek_v3": dict(
        n_routed_experts=8,
        moe_intermediate_size=128,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_shared_experts=1,
        norm_topk_prob=True,
        quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128], activation_scheme="dynamic"),
    ),
    "gpt_oss": dict(
        num_local_experts=8, intermediate_size=128, num_experts_per_tok=4, quantization_config={"quant_method": "mxfp4"}
    ),
}


@pytest.mark.parametrize("model_type", sorted(HF))
def test_hugging_face_configs(model_type, tmp_path):
    """A model's ``config.json`` gives its experts' config, its checkpoint
    layout, tensor names and router; the MoEBlock builds from them."""
    from flax import nnx

    from humming_jax.checkpoints import from_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type=model_type, hidden_size=128, **HF[model_type])))
    hf = from_hf_config(path)
    want = {"mixtral": (8, 256, 2), "qwen3_moe": (8, 128, 4), "deepseek_v3": (8, 128, 4), "gpt_oss": (8, 128, 4)}
    assert (hf.experts.num_experts, hf.experts.intermediate_size, hf.experts.top_k) == want[model_type]
    assert hf.layout == {"deepseek_v3": "fp8_block", "gpt_oss": "gpt_oss_mxfp4"}.get(model_type)
    assert hf.prefix.format(layer=3).startswith("model.layers.3.")
    if model_type == "deepseek_v3":
        assert hf.experts.weight_format.name == "fp8_block128" and hf.experts.input_quant.name == "fp8_dynamic_group128"
        assert hf.block["num_groups"] == 4 and hf.block["routed_scaling_factor"] == 2.5 and hf.block["correction_bias"]
    if model_type == "gpt_oss":
        assert hf.experts.activation.kind.value == "swigluoai" and hf.block["router_bias"]
    assert hf.block["renormalize"] == (model_type != "qwen3_moe")
    block = hj.nn.MoEBlock(hj.nn.HummingGroupedExperts(hf.experts, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1), **hf.block)
    assert block.top_k == hf.experts.top_k


def test_a_gptq_config_loads_its_checkpoint_bit_exact(tmp_path, rng):
    """GPTQ's ``quantization_config`` gives fp16 scales (the checkpoint's):
    the loaded weights dequantize to the checkpoint's values exactly."""
    from humming_jax.checkpoints import from_hf_config

    tensors, w13, w2 = _per_expert(rng, write_gptq, act_order=False)
    config = dict(model_type="qwen3_moe", hidden_size=H, num_experts=E, moe_intermediate_size=I, num_experts_per_tok=2)
    config["quantization_config"] = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=False)
    hf = from_hf_config(config)
    loaded = load_experts(_save(tmp_path, tensors), PREFIX, hf.experts, hf.layout, hf.names)
    np.testing.assert_allclose(np_ref.dequantize_weight(loaded.w13), w13, rtol=1e-6, atol=1e-12)
    renamed = {("num_local_experts" if key == "num_experts" else key): v for key, v in config.items()}
    assert from_hf_config(renamed).experts == hf.experts  # transformers 5 writes num_local_experts
    with pytest.raises(ValueError, match="the number of experts"):
        from_hf_config({key: v for key, v in config.items() if key != "num_experts"})
    with pytest.raises(ValueError, match="weight_format: the checkpoint is quantized"):
        checkpoints.with_weight_format(hf, "int4_g128")
    with pytest.raises(ValueError, match="no layout reads 'bitsandbytes'"):
        from_hf_config({**config, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ValueError, match="model_type"):
        from_hf_config({**config, "model_type": "llama"})


def _bf16(rng, *shape, scale=0.05):
    return rng.normal(0, scale, shape).astype(ml_dtypes.bfloat16)


def _float_experts(rng, prefix, names, e, h, i):
    """Per-expert bf16 weights as Mixtral / Qwen3 / DeepSeek-V3 store them; (tensors, w13 [E, 2I, H], w2 [E, H, I])."""
    tensors, w13, w2 = {}, [], []
    for x in range(e):
        gate, up, down = _bf16(rng, i, h), _bf16(rng, i, h), _bf16(rng, h, i)
        tensors.update({f"{prefix}.{x}.{name}.weight": w for name, w in zip(names, (gate, up, down), strict=True)})
        w13.append(np.concatenate([gate, up]).astype(np.float64))
        w2.append(down.astype(np.float64))
    return tensors, np.stack(w13), np.stack(w2)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "gpt_oss_float"])
def test_a_moe_block_loads_from_a_checkpoint_folder(model_type, tmp_path, rng):
    """``MoEBlock.from_checkpoint(folder, layer)``: config, experts, router (the
    ``[E, H]`` weight transposed to NNX's kernel, gpt-oss's bias, DeepSeek-V3's
    correction bias) and shared expert from a folder (Mixtral's in two shards
    with an index) — the block's output against float64 math on the stored
    weights, routed in NumPy as each model routes."""
    e, h, i, k, layer = 8, 128, 128, 2, 1
    # gpt_oss_float: gpt-oss's float experts, x @ gate_up_proj [E, H, 2I] (gate, up interleaved), with biases
    fused = model_type == "gpt_oss_float"
    model_type = "gpt_oss" if fused else model_type
    config = dict(model_type=model_type, hidden_size=h, num_experts_per_tok=k)
    config.update(
        {
            "mixtral": dict(num_local_experts=e, intermediate_size=i),
            "qwen3_moe": dict(num_experts=e, moe_intermediate_size=i, norm_topk_prob=False),
            "deepseek_v3": dict(
                n_routed_experts=e, moe_intermediate_size=i, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                scoring_func="sigmoid", topk_method="noaux_tc", n_shared_experts=1, norm_topk_prob=True,
            ),
            "gpt_oss": dict(num_local_experts=e, intermediate_size=i)
            | ({} if fused else dict(quantization_config={"quant_method": "mxfp4"})),
        }[model_type]
    )  # fmt: skip
    mlp = f"model.layers.{layer}." + ("block_sparse_moe" if model_type == "mixtral" else "mlp")
    b13 = b2 = None
    if fused:
        w13, w2, b13, b2 = _bf16(rng, e, 2 * i, h), _bf16(rng, e, h, i), _bf16(rng, e, 2 * i), _bf16(rng, e, h)
        tensors = {
            f"{mlp}.experts.gate_up_proj": np.swapaxes(w13, 1, 2),
            f"{mlp}.experts.down_proj": np.swapaxes(w2, 1, 2),
        }
        tensors.update({f"{mlp}.experts.gate_up_proj_bias": b13, f"{mlp}.experts.down_proj_bias": b2})
        w13, w2, b13, b2 = (a.astype(np.float64) for a in (w13, w2, b13, b2))
    elif model_type == "gpt_oss":
        t13, w13, b13 = write_gpt_oss(rng, e, 2 * i, h)
        t2, w2, b2 = write_gpt_oss(rng, e, h, i)
        tensors = {f"{mlp}.experts.gate_up_proj_{name}": v for name, v in t13.items()}
        tensors.update({f"{mlp}.experts.down_proj_{name}": v for name, v in t2.items()})
        b13, b2 = b13.astype(np.float64), b2.astype(np.float64)
    else:
        names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        tensors, w13, w2 = _float_experts(rng, f"{mlp}.experts", names, e, h, i)
    router = "router" if model_type == "gpt_oss" else "gate"
    tensors[f"{mlp}.{router}.weight"] = router_w = _bf16(rng, e, h, scale=0.3)
    router_b = correction = shared = None
    if model_type == "gpt_oss":
        tensors[f"{mlp}.router.bias"] = router_b = _bf16(rng, e, scale=0.3)
    if model_type == "deepseek_v3":
        tensors[f"{mlp}.gate.e_score_correction_bias"] = correction = rng.normal(0, 0.1, e).astype(np.float32)
        shared = [_bf16(rng, *shape) for shape in ((i, h), (i, h), (h, i))]
        tensors.update({f"{mlp}.shared_experts.{n}.weight": w for n, w in zip(_GATE_UP_DOWN, shared, strict=True)})
    (tmp_path / "config.json").write_text(json.dumps(config))
    names_sorted = sorted(tensors)
    shards = [names_sorted[::2], names_sorted[1::2]] if model_type == "mixtral" else [names_sorted]
    index = {}
    for n, shard in enumerate(shards):
        file = f"model-{n:05d}.safetensors"
        save_file({name: np.ascontiguousarray(tensors[name]) for name in shard}, str(tmp_path / file))
        index.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))

    block = hj.nn.MoEBlock.from_checkpoint(tmp_path, layer, backend="reference")
    np.testing.assert_array_equal(np.asarray(block.router.kernel.get_value()), router_w.astype(np.float32).T)
    x = rng.normal(size=(6, h)).astype(ml_dtypes.bfloat16)
    out = np.asarray(block(jnp.asarray(x)), np.float64)

    x64 = x.astype(np.float64)
    logits = x64 @ router_w.astype(np.float64).T + (0 if router_b is None else router_b.astype(np.float64))
    if model_type == "deepseek_v3":
        weights, ids = np_ref.deepseek_v3_route(logits, correction.astype(np.float64), k, 4, 2, 2.5)
    else:
        weights, ids = np_ref.softmax_route(logits, k, renormalize=model_type != "qwen3_moe")
    activation = "swigluoai" if model_type == "gpt_oss" else "silu"
    expected = _moe_float(x64, w13, w2, ids, weights, activation, b13, b2)
    if shared is not None:
        gate, up, down = (w.astype(np.float64) for w in shared)
        expected += np_ref.silu(x64 @ gate.T) * (x64 @ up.T) @ down.T
    assert np_ref.relative_error(out, expected) < 2e-2
    if model_type == "deepseek_v3":  # the expert-parallel module from the same folder, its experts on two devices
        mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
        ep = hj.nn.MoEBlock.from_checkpoint(
            tmp_path, layer, experts=hj.nn.ExpertParallelExperts, backend="reference", mesh=mesh
        )
        np.testing.assert_array_equal(np.asarray(ep(jnp.asarray(x)), np.float64), out)


_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
