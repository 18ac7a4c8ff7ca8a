"""Flax NNX modules of humming_jax (imports go one way: nn -> ops -> kernels)."""

from humming_jax.nn.calls import jit_frozen
from humming_jax.nn.experts import (
    BatchedHummingGroupedExperts,
    ExpertParallelExperts,
    ExpertWeight,
    HummingGroupedExperts,
    HummingIndexedExperts,
    InputScale,
    MoonEPExperts,
)
from humming_jax.nn.moe_block import MoEBlock, SharedExpert, route

__all__ = [
    "BatchedHummingGroupedExperts",
    "ExpertParallelExperts",
    "ExpertWeight",
    "HummingGroupedExperts",
    "HummingIndexedExperts",
    "InputScale",
    "MoEBlock",
    "MoonEPExperts",
    "SharedExpert",
    "jit_frozen",
    "route",
]
