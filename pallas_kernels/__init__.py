"""Pallas kernels of humming_jax (no Flax, no checkpoint logic).

Kernels only: formats, configs, references and the jitted ops that call these
kernels live in ``humming_jax``.
"""
