"""humming_jax: Mixture-of-Experts expert kernels for JAX (Pallas GPU kernels,
jitted pure functions, Flax NNX modules).

Public API: weight formats and quantization (:mod:`formats`), activation
quantization (:mod:`input_quant`), activations, configs, layouts, the routing
ops, ``process_input``, ``gemm``, the expert pipelines and ``plan_workspace``.
"""

from humming_jax import formats, input_quant, numerics
from humming_jax.activations import Activation, ActivationSpec, apply_activation
from humming_jax.backend import BACKENDS, default_backend, resolve_backend
from humming_jax.configs import (
    ComputeConfig,
    ExpertsConfig,
    GemmLayout,
    LayerConfig,
    check_supported,
    supported_input_specs,
)
from humming_jax.experts import (
    ExpertWeights,
    batched_humming_grouped_experts,
    estimate_valid_shape_m,
    humming_grouped_experts,
    humming_indexed_experts,
    moonep_experts,
    moonep_grouped_gemm,
    moonep_interleaved_experts,
    moonep_w13,
    quantize_experts,
    to_kernel_order,
)
from humming_jax.formats import (
    QuantizedWeight,
    WeightFormat,
    dequantize_weight,
    gate_up_halves,
    get_format,
    interleave_gate_up,
    quantize_weight,
    to_k_order,
    to_planar,
)
from humming_jax.gemm import gemm, kernel_input_specs
from humming_jax.input_quant import (
    InputQuantMode,
    InputQuantSpec,
    QuantizedInput,
    dequantize_input,
    get_input_spec,
    hadamard_rotate,
    quantize_input,
)
from humming_jax.layouts import Dense, GroupedContiguous, GroupedMasked, Indexed
from humming_jax.process_input import process_input
from humming_jax.routing import (
    moe_align_block_size,
    moe_fused_mul_sum,
    moe_permute,
    moe_prepare_scatter,
    moe_slot_blocks,
    moe_unpermute,
)
from humming_jax.workspace import WorkspacePlan, plan_workspace

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "Activation",
    "ActivationSpec",
    "ComputeConfig",
    "Dense",
    "ExpertWeights",
    "ExpertsConfig",
    "GemmLayout",
    "GroupedContiguous",
    "GroupedMasked",
    "Indexed",
    "InputQuantMode",
    "InputQuantSpec",
    "LayerConfig",
    "QuantizedInput",
    "QuantizedWeight",
    "WeightFormat",
    "WorkspacePlan",
    "apply_activation",
    "batched_humming_grouped_experts",
    "check_supported",
    "default_backend",
    "dequantize_input",
    "dequantize_weight",
    "estimate_valid_shape_m",
    "gate_up_halves",
    "formats",
    "gemm",
    "get_format",
    "get_input_spec",
    "hadamard_rotate",
    "interleave_gate_up",
    "humming_grouped_experts",
    "humming_indexed_experts",
    "input_quant",
    "kernel_input_specs",
    "moe_align_block_size",
    "moe_fused_mul_sum",
    "moe_permute",
    "moe_prepare_scatter",
    "moe_slot_blocks",
    "moe_unpermute",
    "moonep_experts",
    "to_k_order",
    "to_planar",
    "moonep_grouped_gemm",
    "moonep_interleaved_experts",
    "moonep_w13",
    "numerics",
    "plan_workspace",
    "process_input",
    "quantize_experts",
    "to_kernel_order",
    "quantize_input",
    "quantize_weight",
    "resolve_backend",
    "supported_input_specs",
]

_SUBMODULES = ("nn", "checkpoints")  # imported on first use (nn brings Flax)


def __getattr__(name: str):
    """``hj.nn`` and ``hj.checkpoints`` without importing them at ``import humming_jax``."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"humming_jax.{name}")
    raise AttributeError(f"module 'humming_jax' has no attribute {name!r}")
