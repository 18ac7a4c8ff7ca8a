"""Parity with Hugging Face ``transformers`` (``make test-interop``: its own
virtualenv with PyTorch and transformers). For a tiny random Mixtral,
Qwen3-MoE, DeepSeek-V3 and gpt-oss, the HF model's checkpoint as
``save_pretrained`` writes it (config.json, safetensors under the
checkpoint's names) loads through ``MoEBlock.from_checkpoint`` and gives the
HF MoE block's output within bf16 rounding: with bf16 experts, and with int4
experts (quantized on load) against HF run on the same weights dequantized."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from humming_jax import formats as F  # noqa: E402
from humming_jax import nn  # noqa: E402

H, INTER, E, TOP_K, T = 64, 32, 8, 2, 12
QUANTIZED = "int4_g32"


def _common(**kw):
    return dict(vocab_size=32, hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, **kw)


MODELS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **_common(intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=TOP_K)
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_common(
            intermediate_size=INTER,
            moe_intermediate_size=INTER,
            num_experts=E,
            num_experts_per_tok=TOP_K,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **_common(
            intermediate_size=INTER,
            moe_intermediate_size=INTER,
            n_routed_experts=E,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **_common(
            intermediate_size=INTER,
            num_local_experts=E,
            num_experts_per_tok=TOP_K,
            head_dim=16,
            sliding_window=8,
            layer_types=["full_attention"],
        )
    ),
}


def _saved_model(name: str, folder):
    """A one-layer HF model of ``name`` with random MoE parameters (biases and
    the correction bias too), saved to ``folder``; its MoE block."""
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(MODELS[name]()).eval()
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model


def _moe_output(model, h: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model.model.layers[0].mlp(torch.from_numpy(h)[None])
    return (out[0] if isinstance(out, tuple) else out).float().numpy().reshape(T, H)


def _dequantized_copy(src, dst, fmt: str) -> None:
    """``src``'s checkpoint with every routed expert's weight replaced by its
    ``fmt`` round trip (rows quantized along the input dimension, as the
    loader quantizes them)."""
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for key, value in tensors.items():
        w = value.astype(np.float32)
        if ".experts." in key and key.endswith(".weight"):  # [N, K] an expert
            tensors[key] = np.asarray(F.dequantize_weight(F.quantize_weight(jnp.asarray(w), fmt))[0])
        elif key.endswith(("experts.gate_up_proj", "experts.down_proj")):  # gpt-oss: [E, K, N], x @ w
            rows = np.asarray(F.dequantize_weight(F.quantize_weight(jnp.asarray(np.swapaxes(w, 1, 2)), fmt)))
            tensors[key] = np.swapaxes(rows, 1, 2)
        # (C order: safetensors writes an array's buffer as it lies in memory)
        tensors[key] = np.ascontiguousarray(tensors[key], value.dtype)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            with open(os.path.join(src, name)) as f, open(os.path.join(dst, name), "w") as g:
                json.dump(json.load(f), g)


@pytest.mark.parametrize("weight_format", [None, QUANTIZED], ids=["bf16", QUANTIZED])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_moe_block_equals_the_hugging_face_block(name, weight_format, tmp_path):
    model = _saved_model(name, tmp_path / "hf")
    h = np.random.default_rng(0).normal(size=(T, H)).astype(np.float32)
    if weight_format is not None:
        _dequantized_copy(tmp_path / "hf", tmp_path / "dequantized", weight_format)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized").eval()
    want = _moe_output(model, h)
    block = nn.MoEBlock.from_checkpoint(tmp_path / "hf", 0, backend="reference", weight_format=weight_format)
    got = np.asarray(block(jnp.asarray(h, jnp.bfloat16)), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
