"""The GEMM reference in every layout and weight format against a float64
NumPy loop over rows, plus quantized inputs and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import humming_jax as hj
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax.configs import supported_input_specs
from pallas_kernels.gemm import triton

import np_ref
from sweep import examples, sweep

E, N, K = 4, 64, 256


def _weight(rng, fmt, e=E, n=N, k=K):
    w = rng.normal(0, 0.05, (e, n, k)).astype(np.float32)
    bias = rng.normal(size=(e, n)).astype(np.float32) if fmt.has_bias else None
    return F.quantize_weight(jnp.asarray(w), fmt, bias=None if bias is None else jnp.asarray(bias))


def _layout(kind, rng, m_in, top_k=2, block_size=16):
    """A layout with an empty expert and a partly unowned row range."""
    if kind == "dense":
        return hj.Dense(), {}
    if kind == "grouped_contiguous":
        counts = np.array([3, 0, m_in - 6, 1])
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return hj.GroupedContiguous(jnp.asarray(offsets, jnp.int32)), dict(offsets=offsets)
    if kind == "grouped_masked":
        counts = np.array([0, m_in // E, 2, m_in])  # empty, full, partial, over-full
        return hj.GroupedMasked(jnp.asarray(counts, jnp.int32)), dict(counts=counts)
    ids = rng.integers(0, E, size=(m_in, top_k)).astype(np.int32)
    ids[0, 0] = E + 3  # an invalid slot: its output row is never written
    sorted_ids, expert_ids, padded = hj.moe_align_block_size(jnp.asarray(ids), block_size, E)
    layout = hj.Indexed(sorted_ids, expert_ids, padded, top_k=top_k, block_size=block_size)
    return layout, dict(sorted_ids=sorted_ids, expert_ids=expert_ids, padded=padded, top_k=top_k, block_size=block_size)


LAYOUTS = ["dense", "grouped_contiguous", "grouped_masked", "indexed"]
FORMATS = sorted(F.PRESETS) + ["int4_g128+bias", "nvfp4+bias"]


# Every format on the grouped layout; the other layouts' row logic with formats of each kind.
_OTHER_LAYOUT_FORMATS = ["bf16", "int4_g128+bias", "uint4_zp_g128", "fp8_block128", "nvfp4+bias", "mxfp4"]
_CASES = [(f, "grouped_contiguous") for f in FORMATS] + [
    (f, layout) for layout in LAYOUTS if layout != "grouped_contiguous" for f in _OTHER_LAYOUT_FORMATS
]


# make test: every format on the grouped layout, two of different kinds on each other one.
@pytest.mark.parametrize(
    "fmt_name,layout_kind",
    sweep(_CASES, lambda case: case[1] == "grouped_contiguous" or case[0] in ("int4_g128+bias", "nvfp4+bias")),
)
def test_every_layout_every_format(layout_kind, fmt_name, rng):
    fmt = F.get_format(fmt_name)
    e = 1 if layout_kind == "dense" else E
    weight = _weight(rng, fmt, e=e)
    m_in = 16
    x = jnp.asarray(rng.normal(size=(m_in, K)), jnp.bfloat16)
    layout, layout_np = _layout(layout_kind, rng, m_in)
    out = hj.gemm(x, weight, layout, out_dtype=jnp.float32, backend="reference")
    w64 = np_ref.dequantize_weight(weight)
    b64 = None if weight.bias is None else np.asarray(weight.bias, np.float64)
    expected = np_ref.gemm(np.asarray(x, np.float64), w64, b64, layout_kind, **layout_np)
    assert out.shape == expected.shape
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())
    if layout_kind != "dense":  # rows no group owns are exactly zero
        owned = np.any(expected != 0, axis=1)
        assert np.all(np.asarray(out)[~owned] == 0)


QUANT_CASES = [(f, s) for f in sorted(F.PRESETS) for s in supported_input_specs(F.PRESETS[f]) if s.is_quantized]


# make test: each format with its first quantized input, each input at least once.
_QUANT_CASES_CI = [case for i, case in enumerate(QUANT_CASES) if i == 0 or QUANT_CASES[i - 1][0] != case[0]] + [
    next(case for case in QUANT_CASES if case[1] == spec) for spec in dict.fromkeys(s for _, s in QUANT_CASES)
]


@pytest.mark.parametrize("fmt_name,spec", sweep(QUANT_CASES, _QUANT_CASES_CI), ids=lambda c: getattr(c, "name", c))
def test_quantized_inputs(fmt_name, spec, rng):
    fmt = F.PRESETS[fmt_name]
    weight = _weight(rng, fmt)
    m_in = 12
    x = rng.normal(size=(m_in, K)).astype(np.float32)
    static = jnp.asarray([np.abs(x).max() / 400], jnp.float32) if spec.mode.is_static else None
    q = Q.quantize_input(jnp.asarray(x), spec, static_scale=static)
    layout, layout_np = _layout("grouped_contiguous", rng, m_in)
    out = hj.gemm(q, weight, layout, out_dtype=jnp.float32, backend="reference")
    expected = np_ref.gemm(
        np_ref.dequantize_input(q), np_ref.dequantize_weight(weight), None, "grouped_contiguous", **layout_np
    )
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())
    assert out.dtype == jnp.float32
    # The default output dtype for quantized inputs (traced only: the default backend's kernel is tested elsewhere).
    assert jax.eval_shape(lambda: hj.gemm(q, weight, layout)).dtype == jnp.bfloat16


@settings(max_examples=examples(3, 2))  # two interpreted gemm calls and the routing an example
@given(
    st.integers(1, 40),
    st.sampled_from([1, 2, 8]),
    st.sampled_from([16, 32, 64]),
    st.integers(0, 2**31 - 1),
    st.sampled_from(np_ref.ROUTING_SHAPES),
)
def test_indexed_matches_grouped_over_random_routings(num_tokens, top_k, block_size, seed, shape):
    """The indexed layout (w13: top_k=k reading [T, K]) equals the grouped layout
    on the permuted input, slot by slot, for any routing."""
    rng = np.random.default_rng(seed)
    ids, emap, local = np_ref.small_routing(rng, num_tokens, top_k, shape)
    emap = None if emap is None else jnp.asarray(emap)
    num_experts = np_ref.SMALL_EXPERTS
    weight = F.quantize_weight(jnp.asarray(rng.normal(size=(local, 32, 64)), jnp.float32), F.INT4_G32)
    x = jnp.asarray(rng.normal(size=(num_tokens, 64)), jnp.float32)
    sorted_ids, expert_ids, padded = hj.moe_align_block_size(
        jnp.asarray(ids), block_size, num_experts, emap, True, local
    )
    indexed = hj.gemm(x, weight, hj.Indexed(sorted_ids, expert_ids, padded, top_k=top_k, block_size=block_size))
    permuted = hj.moe_permute(x, jnp.asarray(ids), num_experts, emap, local)
    grouped = hj.gemm(permuted.permuted_hidden_states, weight, hj.GroupedContiguous(permuted.expert_first_token_offset))
    by_slot = np.asarray(grouped)[np.asarray(permuted.inv_permuted_idx)]
    valid = np.asarray(permuted.inv_permuted_idx) < int(permuted.expert_first_token_offset[-1])
    np.testing.assert_allclose(np.asarray(indexed)[valid], by_slot[valid], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(indexed)[~valid] == 0)


def test_gemm_bad_input(rng):
    weight = _weight(rng, F.INT4_G128)
    layout = hj.GroupedContiguous(jnp.asarray([0, 4, 8, 12, 16], jnp.int32))
    x = jnp.ones((16, K), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"x: K=128 does not match the weight's K=256"):
        hj.gemm(jnp.ones((16, 128), jnp.bfloat16), weight, layout)
    with pytest.raises(ValueError, match=r"x: expected \[M, K\]"):
        hj.gemm(jnp.ones((2, 16, K), jnp.bfloat16), weight, layout)
    with pytest.raises(TypeError, match="x: an unquantized input must be"):
        hj.gemm(jnp.ones((16, K), jnp.int32), weight, layout)
    with pytest.raises(ValueError, match="layout.expert_offsets"):
        hj.gemm(x, weight, hj.GroupedContiguous(jnp.asarray([0, 16], jnp.int32)))
    with pytest.raises(ValueError, match="dense layout takes a weight with one expert"):
        hj.gemm(x, weight, hj.Dense())
    with pytest.raises(ValueError, match="not supported with weight format 'int4_g128'"):
        hj.gemm(Q.quantize_input(x, Q.MXFP4_DYNAMIC), weight, layout)
    with pytest.raises(ValueError, match="not supported with weight format 'bf16'"):
        hj.gemm(Q.quantize_input(x, Q.FP8_DYNAMIC_TOKEN), F.quantize_weight(jnp.ones((4, 8, K)), F.BF16), layout)
    with pytest.raises(ValueError, match="use_f16_accum"):
        hj.gemm(x, weight, layout, use_f16_accum=True)
    with pytest.raises(ValueError, match="split_k"):
        hj.gemm(x, weight, layout, batch_invariant=True, tuning=triton.Tiles(split_k=4))
    with pytest.raises(ValueError, match=r"weight\.scale"):
        hj.gemm(x, dataclasses.replace(weight, scale=weight.scale[:, :1]), layout)
    with pytest.raises(ValueError, match="layout.expert_ids"):
        hj.gemm(
            x, weight, hj.Indexed(jnp.zeros(32, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(1, jnp.int32), 1, 16)
        )
    with pytest.raises(ValueError, match="grouped_masked input"):
        hj.gemm(jnp.ones((18, K), jnp.bfloat16), weight, hj.GroupedMasked(jnp.ones(4, jnp.int32)))
    with pytest.raises(TypeError, match="gemm: out_dtype: expected one of bfloat16, float16, float32, got int8"):
        hj.gemm(x, weight, layout, out_dtype=jnp.int8)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="gemm: valid_shape_m: expected a row count"):
            hj.gemm(x, weight, layout, valid_shape_m=bad)
    assert hj.gemm(x, weight, layout, valid_shape_m=np.int64(16), backend="reference").shape == (16, weight.n)


_INT32 = st.integers(-(2**31), 2**31 - 1)
_NEAR = st.integers(-3, 43)  # around the 40 rows


@settings(max_examples=8)
@given(st.lists(st.one_of(_NEAR, _INT32), min_size=5, max_size=5))
def test_hostile_grouped_offsets(offsets):
    """Any int32 offsets (decreasing, outside the rows, at the extremes): row r
    belongs to the last expert e with ``owned[e] <= r`` and ``r < owned[e+1]``
    of the clipped running maximum — written here as a loop — and rows no
    expert owns are zero."""
    m, n, k = 40, 8, 16
    rng = np.random.default_rng(abs(sum(offsets)) % 2**32)
    w = rng.normal(size=(4, n, k))
    x = rng.normal(size=(m, k))
    weight = F.quantize_weight(jnp.asarray(w, jnp.float32), F.BF16)
    out = hj.gemm(
        jnp.asarray(x, jnp.bfloat16),
        weight,
        hj.GroupedContiguous(jnp.asarray(offsets, jnp.int32)),
        out_dtype=jnp.float32,
        backend="reference",
    )
    owned, high = [], 0
    for offset in offsets:
        high = max(high, min(max(offset, 0), m))
        owned.append(high)
    want = np.zeros((m, n))
    xb, wb = np_ref.to64(jnp.asarray(x, jnp.bfloat16)), np_ref.to64(weight.values)
    for e in range(4):
        for r in range(owned[e], owned[e + 1]):
            want[r] = xb[r] @ wb[e].T
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)
