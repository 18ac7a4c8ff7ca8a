"""Loading expert weights from real checkpoint layouts (safetensors).

``read_safetensors`` reads the file format directly (NumPy + ml_dtypes: fp8
and bf16 load too), ``SafetensorsCheckpoint`` a sharded folder lazily;
``load_experts`` turns one MoE layer's tensors into
:class:`ExpertWeights` for an :class:`ExpertsConfig`, converting the
checkpoint's packing to this library's without requantizing: GPTQ (act-order
included), AWQ, compressed-tensors int4, DeepSeek FP8-block, ModelOpt NVFP4,
gpt-oss MXFP4. The tensors each layout reads: docs/DESIGN.md, appendix B. A
missing tensor, or one with the wrong shape or dtype, raises ``ValueError``
naming it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import struct
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from humming_jax import formats as F
from humming_jax.configs import ExpertsConfig
from humming_jax.experts import ExpertWeights, check_weights, quantize_experts, to_kernel_order

__all__ = [
    "LAYOUTS",
    "HFMoE",
    "RouterWeights",
    "SafetensorsCheckpoint",
    "from_hf_config",
    "load_experts",
    "load_router",
    "read_safetensors",
    "with_weight_format",
]

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
LAYOUTS = ("gptq", "awq", "compressed_tensors", "fp8_block", "modelopt_nvfp4", "gpt_oss_mxfp4", "gpt_oss_float")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ int32 holds column AWQ_ORDER[j]


def read_safetensors(paths: str | Sequence[str]) -> dict[str, np.ndarray]:
    """Every tensor of one or more ``.safetensors`` files (or a checkpoint folder).

    Args:
        paths: a file, a folder or a list of files.

    Returns:
        ``{name: array}``, read-only memory-mapped NumPy arrays (fp8, fp4 and
        e8m0 as ``ml_dtypes`` types).
    """
    return dict(SafetensorsCheckpoint(paths))


def _header(path: str) -> tuple[dict, int]:
    """(the header of a ``.safetensors`` file, the offset of its data)."""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(header_size)), 8 + header_size


class SafetensorsCheckpoint(Mapping[str, np.ndarray]):
    """A sharded checkpoint read lazily, as a mapping ``{name: array}``. Only
    the headers are read up front; a tensor is memory-mapped from its file when
    asked for, so :func:`load_experts` on one layer reads that layer's bytes only.

    Args:
        path: a folder (its ``model.safetensors.index.json`` when there is
            one, else every ``*.safetensors`` in it), a file or a list of files.
    """

    INDEX = "model.safetensors.index.json"

    def __init__(self, path: str | os.PathLike | Sequence[str | os.PathLike]):
        if isinstance(path, str | os.PathLike) and os.path.isdir(path):
            index = os.path.join(path, self.INDEX)
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted({os.path.join(path, name) for name in weight_map.values()})
            else:
                files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise ValueError(f"SafetensorsCheckpoint: no .safetensors files in {os.fspath(path)!r}")
        else:
            files = [os.fspath(path)] if isinstance(path, str | os.PathLike) else [os.fspath(p) for p in path]
        self._where: dict[str, tuple[str, dict, int]] = {}
        for file in files:
            header, data_start = _header(file)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
                self._where[name] = (file, info, data_start)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"checkpoint: no tensor {name!r}")
        file, info, data_start = self._where[name]
        dtype, shape = np.dtype(_DTYPES[info["dtype"]]), tuple(info["shape"])
        start, end = info["data_offsets"]
        if end == start:
            return np.empty(shape, dtype)
        raw = np.memmap(file, dtype=np.uint8, mode="r", offset=data_start + start, shape=(end - start,))
        return raw.view(dtype).reshape(shape)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class _Tensors:
    """Checked access to a checkpoint's tensors."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors = tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtypes=None, optional: bool = False):
        if name not in self.tensors:
            if optional:
                return None
            raise ValueError(f"checkpoint: missing tensor {name!r}")
        array = np.asarray(self.tensors[name])
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise ValueError(f"checkpoint: tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)}")
        if dtypes is not None and array.dtype not in [np.dtype(d) for d in dtypes]:
            names = ", ".join(np.dtype(d).name for d in dtypes)
            raise ValueError(f"checkpoint: tensor {name!r} has dtype {array.dtype}, expected {names}")
        return array


_FLOATS = (np.float16, np.float32, ml_dtypes.bfloat16)


def _int32_nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """Split int32 words into their 8 nibbles (low first) along ``axis``."""
    words = packed.astype(np.uint32)
    nibbles = np.stack([(words >> (4 * j)) & 0xF for j in range(8)], axis=axis + 1)
    shape = list(words.shape)
    shape[axis] *= 8
    return nibbles.reshape(shape).astype(np.uint8)


def _pack_k(codes: np.ndarray) -> np.ndarray:
    """``[..., K]`` 4-bit codes -> this library's bytes along K (low nibble first)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _pack_groups(zero: np.ndarray) -> np.ndarray:
    """``[N, G]`` 4-bit zero points -> ``[N, ceil(G/2)]`` bytes along the group axis."""
    if zero.shape[-1] % 2:
        zero = np.concatenate([zero, np.zeros_like(zero[..., :1])], axis=-1)
    return _pack_k(zero)


def _gptq_expert(t: _Tensors, name: str, n: int, k: int, group: int):
    """One GPTQ projection as (codes [N, K], zero [N, G], scale [N, G], g_idx [K] or None)."""
    groups = k // group
    qweight = t.get(f"{name}.qweight", (k // 8, n), (np.int32,))
    qzeros = t.get(f"{name}.qzeros", (groups, n // 8), (np.int32,))
    scales = t.get(f"{name}.scales", (groups, n), _FLOATS)
    g_idx = t.get(f"{name}.g_idx", (k,), (np.int32, np.int64), optional=True)
    codes = _int32_nibbles(qweight, 0).T  # [N, K]
    zero = ((_int32_nibbles(qzeros, 1) + 1) & 0xF).T  # stored as z - 1: [N, G]
    if g_idx is not None and np.all(g_idx == np.arange(k) // group):
        g_idx = None  # plain groups
    if g_idx is not None and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise ValueError(f"checkpoint: tensor {name + '.g_idx'!r} holds groups outside [0, {groups})")
    return codes, zero, scales.astype(np.float32).T, g_idx


def _awq_expert(t: _Tensors, name: str, n: int, k: int, group: int):
    groups = k // group
    qweight = t.get(f"{name}.qweight", (k, n // 8), (np.int32,))
    qzeros = t.get(f"{name}.qzeros", (groups, n // 8), (np.int32,))
    scales = t.get(f"{name}.scales", (groups, n), _FLOATS)
    order = np.argsort(AWQ_ORDER)  # position of column c inside a word

    def unpack(words):  # [R, N/8] -> [R, N] in column order
        nib = _int32_nibbles(words, 1).reshape(words.shape[0], n // 8, 8)
        return nib[:, :, order].reshape(words.shape[0], n)

    return unpack(qweight).T, unpack(qzeros).T, scales.astype(np.float32).T, None


def _uint4_weight(experts, fmt: F.WeightFormat, n: int, k: int, scale_dtype, group_index=None) -> F.QuantizedWeight:
    codes = np.stack([e[0] for e in experts])
    zero = np.stack([e[1] for e in experts])
    scale = np.stack([e[2] for e in experts])
    return F.QuantizedWeight(
        values=jnp.asarray(_pack_k(codes)),
        scale=jnp.asarray(scale, scale_dtype),
        zero_point=jnp.asarray(_pack_groups(zero)),
        format=fmt,
        shape=(len(experts), n, k),
        group_index=None if group_index is None else jnp.asarray(group_index, jnp.int32),
    )


def _rows_of(config: ExpertsConfig) -> dict[str, tuple[int, int]]:
    h, i = config.hidden_size, config.intermediate_size
    return {"gate": (i, h), "up": (i, h), "down": (h, i)}


def load_experts(
    tensors: Mapping[str, np.ndarray],
    prefix: str,
    config: ExpertsConfig,
    layout: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> ExpertWeights:
    """The expert weights of one MoE layer, converted from a checkpoint's
    packing without requantizing (the tensors each layout reads: docs/DESIGN.md,
    appendix B).

    Args:
        tensors: ``{name: array}``, e.g. a :class:`SafetensorsCheckpoint`.
        prefix: the layer's experts' prefix (``"model.layers.3.mlp.experts"``).
        config: the layer's :class:`ExpertsConfig`; its weight formats must be
            the ones ``layout`` converts to (:func:`from_hf_config` derives both).
        layout: one of :data:`LAYOUTS` (``"gptq"``, ``"awq"``, ``"fp8_block"``, …),
            or None for float weights (``{prefix}.{e}.{name}.weight``), quantized
            here to the config's formats.
        names: the gate, up and down projections' names in the checkpoint.

    Returns:
        The :class:`ExpertWeights`, in the kernels' order.

    Raises:
        ValueError: a missing tensor or one of the wrong shape or dtype (named),
            or formats the layout does not give (naming the preset to use).
    """
    if layout is None:
        return _load_float(_Tensors(tensors), prefix, config, names)
    if layout == "gpt_oss_float":
        return _load_gpt_oss_float(_Tensors(tensors), prefix, config)
    if layout not in LAYOUTS:
        raise ValueError(f"load_experts: layout: expected one of {LAYOUTS} or None (float), got {layout!r}")
    t = _Tensors(tensors)
    e = config.num_experts
    rows = _rows_of(config)
    weights: dict[str, object] = {}
    if layout == "gpt_oss_mxfp4":
        weights = _load_gpt_oss(t, prefix, config)
    elif layout in ("gptq", "awq"):
        loader = _gptq_expert if layout == "gptq" else _awq_expert
        per_proj = {}
        for proj, name in zip(("gate", "up", "down"), names, strict=True):
            fmt = config.w2_weight_format if proj == "down" else config.weight_format
            n, k = rows[proj]
            per_proj[proj] = [loader(t, f"{prefix}.{x}.{name}", n, k, fmt.group_size) for x in range(e)]
        weights = _assemble_uint4(per_proj, config, prefix, names)
    else:
        per_proj = {}
        for proj, name in zip(("gate", "up", "down"), names, strict=True):
            n, k = rows[proj]
            per_proj[proj] = [_load_plain(t, f"{prefix}.{x}.{name}", n, k, layout) for x in range(e)]
        weights = _assemble_plain(per_proj, config, layout)
    result = ExpertWeights(**weights)
    check_weights(result, config)
    for name in ("w13", "w2"):
        F.check_folded_scale_range(getattr(result, name), f"{prefix}.{name}")
    return to_kernel_order(result, config)


def _load_float(t: _Tensors, prefix: str, config: ExpertsConfig, names) -> ExpertWeights:
    """Float per-expert weights (``[N, K]`` each), quantized to the config's formats."""
    rows = _rows_of(config)

    def stack(proj: str, name: str) -> np.ndarray:
        n, k = rows[proj]
        return np.stack(
            [
                t.get(f"{prefix}.{x}.{name}.weight", (n, k), _FLOATS).astype(np.float32)
                for x in range(config.num_experts)
            ]
        )

    gate, up, down = (stack(proj, name) for proj, name in zip(("gate", "up", "down"), names, strict=True))
    w13 = np.concatenate([gate, up], axis=1) if config.activation.is_gated else up
    return quantize_experts(jnp.asarray(w13), jnp.asarray(down), config)


def _load_gpt_oss_float(t: _Tensors, prefix: str, config: ExpertsConfig) -> ExpertWeights:
    """gpt-oss's float experts, all experts in one tensor each and multiplied
    from the left (``x @ gate_up_proj [E, H, 2I]``, gate and up interleaved
    along 2I as ``swigluoai`` reads them; ``down_proj [E, I, H]``), with
    biases; quantized to the config's formats."""
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    gate_up = t.get(f"{prefix}.gate_up_proj", (e, h, 2 * i), _FLOATS).astype(np.float32)
    down = t.get(f"{prefix}.down_proj", (e, i, h), _FLOATS).astype(np.float32)
    biases = {}
    for key, name, n in (("w13_bias", "gate_up_proj_bias", 2 * i), ("w2_bias", "down_proj_bias", h)):
        bias = t.get(f"{prefix}.{name}", (e, n), _FLOATS, optional=True)
        if bias is not None:
            biases[key] = jnp.asarray(bias.astype(np.float32))
    if biases and not config.weight_format.has_bias:
        raise ValueError(
            f"load_experts: the checkpoint has expert biases but weight_format {config.weight_format.name!r} "
            f"has none: use '{config.weight_format.name}+bias'"
        )
    w13, w2 = (jnp.asarray(np.swapaxes(w, 1, 2)) for w in (gate_up, down))
    return quantize_experts(w13, w2, config, **biases)


def _group_index(projections, names: list[str], k: int, group: int):
    """``[E, K]`` act-order group index of a weight (None when every g_idx is plain).
    The projections fused into one weight (gate, up) must share their g_idx."""
    experts = len(projections[0])
    if all(p[x][3] is None for p in projections for x in range(experts)):
        return None
    plain = np.arange(k) // group
    rows = []
    for x in range(experts):
        first = projections[0][x][3]
        first = plain if first is None else first
        for p, name in zip(projections[1:], names[1:], strict=True):
            other = plain if p[x][3] is None else p[x][3]
            if not np.array_equal(other, first):
                raise ValueError(
                    f"checkpoint: tensor '{name.format(x)}.g_idx' differs from the gate's: "
                    "fused gate/up need the same act-order"
                )
        rows.append(first)
    return np.stack(rows)


def _join_rows(parts, what: str) -> np.ndarray:
    """The gate and up parts of one fused tensor stacked along the rows; every
    other axis must agree (e.g. the same scale groups along K)."""
    shapes = [tuple(p.shape[1:]) for p in parts]
    if len(set(shapes)) > 1:
        raise ValueError(
            f"checkpoint: {what}: gate and up differ past the rows ({' vs '.join(map(str, shapes))}): "
            "fused gate/up need the same columns and scale groups"
        )
    return np.concatenate(parts)


def _assemble_uint4(per_proj, config: ExpertsConfig, prefix: str, names) -> dict:
    h, i = config.hidden_size, config.intermediate_size
    gate, up, down = per_proj["gate"], per_proj["up"], per_proj["down"]
    fmt13, fmt2 = config.weight_format, config.w2_weight_format
    w13 = [
        tuple(_join_rows([g[j], u[j]], f"expert {x} {part}") for j, part in enumerate(("values", "scales", "zeros")))
        for x, (g, u) in enumerate(zip(gate, up, strict=True))
    ]
    proj_names = [f"{prefix}.{{}}.{name}" for name in names]
    return dict(
        w13=_uint4_weight(
            w13,
            fmt13,
            2 * i,
            h,
            jnp.dtype(fmt13.scale_dtype),
            _group_index([gate, up], proj_names[:2], h, fmt13.group_size),
        ),
        w2=_uint4_weight(
            down, fmt2, h, i, jnp.dtype(fmt2.scale_dtype), _group_index([down], proj_names[2:], i, fmt2.group_size)
        ),
    )


def _load_plain(t: _Tensors, name: str, n: int, k: int, layout: str) -> dict:
    if layout == "compressed_tensors":
        packed = t.get(f"{name}.weight_packed", (n, k // 8), (np.int32,))
        groups = t.get(f"{name}.weight_scale", None, _FLOATS)
        if groups.ndim != 2 or groups.shape[0] != n:
            raise ValueError(
                f"checkpoint: tensor {name + '.weight_scale'!r} has shape {groups.shape}, expected [{n}, G]"
            )
        return dict(values=_pack_k(_int32_nibbles(packed, 1)), scale=groups.astype(np.float32))
    if layout == "fp8_block":
        weight = t.get(f"{name}.weight", (n, k), (ml_dtypes.float8_e4m3fn,))
        scale = t.get(f"{name}.weight_scale_inv", (-(-n // 128), -(-k // 128)), (np.float32,))
        return dict(values=weight, scale=scale)
    weight = t.get(f"{name}.weight", (n, k // 2), (np.uint8,))
    scale = t.get(f"{name}.weight_scale", (n, k // 16), (ml_dtypes.float8_e4m3fn,))
    second = t.get(f"{name}.weight_scale_2", None, (np.float32,)).reshape(-1)
    input_scale = t.get(f"{name}.input_scale", None, (np.float32,), optional=True)
    return dict(
        values=weight,
        scale=scale,
        second=float(second[0]),
        input_scale=None if input_scale is None else float(np.asarray(input_scale).reshape(-1)[0]),
    )


def _stack_scales(experts, key: str) -> np.ndarray:
    """``[E, N, groups]`` weight scales of every expert, gate and up rows joined."""
    return np.stack(
        [_join_rows([part["scale"] for part in parts], f"{key} expert {x} scales") for x, parts in enumerate(experts)]
    )


def _assemble_plain(per_proj, config: ExpertsConfig, layout: str) -> dict:
    h, i = config.hidden_size, config.intermediate_size
    out = {}
    for key, fmt, projs, (n, k) in (
        ("w13", config.weight_format, ("gate", "up"), (2 * i, h)),
        ("w2", config.w2_weight_format, ("down",), (h, i)),
    ):
        experts = [[per_proj[p][x] for p in projs] for x in range(config.num_experts)]
        values = np.stack(
            [
                _join_rows([part["values"] for part in parts], f"{key} expert {x} values")
                for x, parts in enumerate(experts)
            ]
        )
        if layout == "modelopt_nvfp4":
            seconds = [[part["second"] for part in parts] for parts in experts]
            if any(len(set(s)) > 1 for s in seconds):  # one global scale per expert and weight
                raise ValueError(f"checkpoint: {key}: weight_scale_2 of gate and up must be equal per expert")
            scale = _stack_scales(experts, key)
            weight = F.QuantizedWeight(
                values=jnp.asarray(values),
                scale=jnp.asarray(scale),
                second_scale=jnp.asarray([s[0] for s in seconds], jnp.float32),
                format=fmt,
                shape=(len(experts), n, k),
            )
            layer = config.w13 if key == "w13" else config.w2
            input_scales = [part["input_scale"] for parts in experts for part in parts]
            if layer.input_quant.mode.is_static and None not in input_scales:
                # One static activation scale for the layer: the largest covers every expert's range.
                out[f"{key}_input_scale"] = jnp.asarray([max(input_scales)], jnp.float32)
        elif layout == "fp8_block":
            if len(projs) == 2 and i % 128:
                raise ValueError(f"checkpoint: {key}: gate/up rows ({i}) must be a multiple of the 128-row scale block")
            scale = _stack_scales(experts, key)
            weight = F.QuantizedWeight(
                values=jnp.asarray(values), scale=jnp.asarray(scale), format=fmt, shape=(len(experts), n, k)
            )
        else:
            scale = _stack_scales(experts, key)
            weight = F.QuantizedWeight(
                values=jnp.asarray(values),
                scale=jnp.asarray(scale, fmt.scale_dtype),
                format=fmt,
                shape=(len(experts), n, k),
            )
        out[key] = weight
    return out


def _load_gpt_oss(t: _Tensors, prefix: str, config: ExpertsConfig) -> dict:
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    out = {}
    for key, proj, (n, k), fmt in (
        ("w13", "gate_up_proj", (2 * i, h), config.weight_format),
        ("w2", "down_proj", (h, i), config.w2_weight_format),
    ):
        blocks = t.get(f"{prefix}.{proj}_blocks", (e, n, k // 32, 16), (np.uint8,))
        scales = t.get(f"{prefix}.{proj}_scales", (e, n, k // 32), (np.uint8,))
        bias = t.get(f"{prefix}.{proj}_bias", (e, n), _FLOATS, optional=not fmt.has_bias)
        out[key] = F.QuantizedWeight(
            values=jnp.asarray(blocks.reshape(e, n, k // 2)),
            scale=jnp.asarray(scales),
            bias=None if bias is None or not fmt.has_bias else jnp.asarray(bias.astype(np.float32)),
            format=fmt,
            shape=(e, n, k),
        )
    return out


@dataclasses.dataclass(frozen=True)
class HFMoE:
    """What a Hugging Face ``config.json`` says about its MoE layers.

    Attributes:
        experts: the :class:`ExpertsConfig`.
        layout: the :func:`load_experts` layout of its quantization, None for float weights.
        names: the gate, up and down tensor names of an expert.
        prefix: the experts' tensor prefix, ``{layer}`` to fill.
        block: the :class:`~humming_jax.nn.MoEBlock` router arguments.
        router: the router's tensor prefix (``{prefix}.weight [E, H]``, a bias,
            a correction bias), ``{layer}`` to fill.
        shared: the shared expert's tensor prefix, ``{layer}`` to fill; None: none.
    """

    experts: ExpertsConfig
    layout: str | None
    names: tuple[str, str, str]
    prefix: str
    block: dict
    router: str = ""
    shared: str | None = None


_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
# model_type -> (router prefix, shared expert prefix)
_HF_ROUTERS = {
    "mixtral": ("model.layers.{layer}.block_sparse_moe.gate", None),
    "qwen3_moe": ("model.layers.{layer}.mlp.gate", None),
    "deepseek_v3": ("model.layers.{layer}.mlp.gate", "model.layers.{layer}.mlp.shared_experts"),
    "gpt_oss": ("model.layers.{layer}.mlp.router", None),
}
# model_type -> (experts key, intermediate key, expert prefix, tensor names)
_HF_MODELS = {
    "mixtral": (
        "num_local_experts",
        "intermediate_size",
        "model.layers.{layer}.block_sparse_moe.experts",
        ("w1", "w3", "w2"),
    ),
    # (transformers 5 writes num_local_experts where the released Qwen3 configs say num_experts)
    "qwen3_moe": (
        ("num_experts", "num_local_experts"),
        "moe_intermediate_size",
        "model.layers.{layer}.mlp.experts",
        _GATE_UP_DOWN,
    ),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size", "model.layers.{layer}.mlp.experts", _GATE_UP_DOWN),
    "gpt_oss": ("num_local_experts", "intermediate_size", "model.layers.{layer}.mlp.experts", _GATE_UP_DOWN),
}


def _hf_quantization(quant: dict | None, model_type: str) -> tuple[str | None, dict]:
    """(layout, ExpertsConfig fields) of a ``quantization_config``."""
    if not quant:
        return None, {}
    method = quant.get("quant_method")
    if method == "fp8" and list(quant.get("weight_block_size") or []) == [128, 128]:
        return "fp8_block", dict(weight_format="fp8_block128", input_quant="fp8_dynamic_group128")
    if method == "mxfp4" and model_type == "gpt_oss":
        return "gpt_oss_mxfp4", dict(weight_format="mxfp4+bias")
    if method in ("gptq", "awq") and quant.get("bits") == 4:
        group = quant.get("group_size", 128)
        fmt = dataclasses.replace(
            F.UINT4_ZP_G128, name=f"uint4_zp_g{group}_f16", group_size=group, scale_type="float16"
        )
        return method, dict(weight_format=fmt)
    raise ValueError(
        f"from_hf_config: quantization_config: no layout reads {method!r} "
        f"({', '.join(repr(k) + '=' + repr(v) for k, v in sorted(quant.items()) if k != 'quant_method')}); "
        f"known: fp8 with weight_block_size [128, 128], gpt-oss mxfp4, 4-bit gptq/awq"
    )


def with_weight_format(hf: HFMoE, weight_format: str) -> HFMoE:
    """``hf`` with its float experts quantized on load to ``weight_format``
    (a preset name; gpt-oss's expert biases kept: ``+bias`` added).

    Args:
        hf: a float checkpoint's :class:`HFMoE`.
        weight_format: the format's name.

    Returns:
        The :class:`HFMoE` with both weights' formats replaced.

    Raises:
        ValueError: the checkpoint is quantized (its own layout fixes the format).
    """
    if hf.layout not in (None, "gpt_oss_float"):
        raise ValueError(
            f"weight_format: the checkpoint is quantized ({hf.layout!r}): it loads in its own format, "
            f"{hf.experts.weight_format.name!r}"
        )
    fmt = F.get_format(weight_format)
    if hf.experts.weight_format.has_bias:
        fmt = fmt.with_bias()
    experts = dataclasses.replace(hf.experts, weight_format=fmt, w2_weight_format=None)
    return dataclasses.replace(hf, experts=experts)


def from_hf_config(config: Mapping | str | os.PathLike) -> HFMoE:
    """The MoE layer of a Hugging Face model config (Mixtral, Qwen3-MoE,
    DeepSeek-V3, gpt-oss; float, GPTQ, AWQ, compressed-tensors, FP8, MXFP4, NVFP4).

    Args:
        config: a ``config.json`` as a dict, its path or its folder.

    Returns:
        The :class:`HFMoE`.
    """
    if not isinstance(config, Mapping):
        with open(config) as f:
            config = json.load(f)
    model_type = config.get("model_type")
    if model_type not in _HF_MODELS:
        raise ValueError(f"from_hf_config: model_type: expected one of {sorted(_HF_MODELS)}, got {model_type!r}")
    experts_key, intermediate_key, prefix, names = _HF_MODELS[model_type]
    layout, fields = _hf_quantization(config.get("quantization_config"), model_type)
    if model_type == "gpt_oss":
        fields["activation"] = "swigluoai"
        if layout is None:  # its float experts: fused tensors with biases
            layout, fields["weight_format"] = "gpt_oss_float", "bf16+bias"
    keys = (experts_key,) if isinstance(experts_key, str) else experts_key
    found = [key for key in keys if key in config]
    if not found:
        raise ValueError(f"from_hf_config: config.json has no {' or '.join(map(repr, keys))} (the number of experts)")
    experts = ExpertsConfig(
        config[found[0]], config["hidden_size"], config[intermediate_key], config["num_experts_per_tok"], **fields
    )
    block: dict = dict(renormalize=bool(config.get("norm_topk_prob", True)))
    if model_type == "deepseek_v3":
        block.update(
            scoring=config.get("scoring_func", "sigmoid"),
            correction_bias=config.get("topk_method", "noaux_tc") == "noaux_tc",
            num_groups=config.get("n_group", 1),
            topk_groups=config.get("topk_group"),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            shared_intermediate_size=config["moe_intermediate_size"] * config.get("n_shared_experts", 0) or None,
        )
    if model_type == "qwen3_moe" and config.get("shared_expert_intermediate_size"):
        raise ValueError(
            "from_hf_config: shared_expert_intermediate_size: a Qwen2-MoE-style gated shared expert is not supported"
        )
    if model_type == "gpt_oss":
        block["router_bias"] = True
    router, shared = _HF_ROUTERS[model_type]
    return HFMoE(
        experts, layout, names, prefix, block, router, shared if block.get("shared_intermediate_size") else None
    )


@dataclasses.dataclass(frozen=True)
class RouterWeights:
    """A MoE layer's router and shared expert as a checkpoint stores them
    (PyTorch's ``[out, in]`` linear layout, f32).

    Attributes:
        weight: ``[E, H]``, logits = ``x @ weight.T``.
        bias: ``[E]`` or None (gpt-oss).
        correction_bias: ``[E]`` or None (DeepSeek-V3's ``e_score_correction_bias``).
        shared: the shared expert's ``(gate [Is, H], up [Is, H], down [H, Is])`` or None.
    """

    weight: np.ndarray
    bias: np.ndarray | None = None
    correction_bias: np.ndarray | None = None
    shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def load_router(tensors: Mapping[str, np.ndarray], hf: HFMoE, layer: int) -> RouterWeights:
    """The router (and shared expert) of one MoE layer.

    Args:
        tensors: ``{name: array}``, e.g. a :class:`SafetensorsCheckpoint`.
        hf: the model's :class:`HFMoE` (:func:`from_hf_config`).
        layer: the layer's index.

    Returns:
        The :class:`RouterWeights`, float32.

    Raises:
        ValueError: a missing tensor or one of the wrong shape or dtype (named).
    """
    t = _Tensors(tensors)
    e, h = hf.experts.global_num_experts, hf.experts.hidden_size
    prefix = hf.router.format(layer=layer)

    def get(name, shape, optional=False):
        array = t.get(name, shape, _FLOATS, optional=optional)
        return None if array is None else array.astype(np.float32)

    bias = get(f"{prefix}.bias", (e,)) if hf.block.get("router_bias") else None
    correction = get(f"{prefix}.e_score_correction_bias", (e,)) if hf.block.get("correction_bias") else None
    shared = None
    if hf.shared is not None:
        shared_prefix, width = hf.shared.format(layer=layer), hf.block["shared_intermediate_size"]
        shared = tuple(
            get(f"{shared_prefix}.{name}.weight", shape)
            for name, shape in (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width)))
        )
    return RouterWeights(get(f"{prefix}.weight", (e, h)), bias, correction, shared)
