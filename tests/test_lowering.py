"""The kernels lower to Triton IR for sm_90 on the CPU — the GPU-only paths
(the GEMM's inline-PTX word decoders, which interpret mode replaces by jnp)
and the loops and launches interpret mode runs differently: what the kernel
tests cannot see without a GPU. The Mosaic kernels' TMA copies, lowered the
same way, are checked against TMA's shared-memory alignment."""

import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import pytest

import humming_jax as hj
from benchmarks.inspect_gemm import parse_config
from benchmarks.lower_sm90 import capture_triton_modules, gemm_ttir, loads_in_loops, process_ttir, ttir_of
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax.tiles_text import from_text, gemm_from_text
from pallas_kernels.process_input import Tiles

from sweep import FULL

SHAPE = (4, 256, 512)
# Lowering for the GPU backend warns that Pallas's Triton backend is deprecated (our GPU path today).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.parametrize(
    "fmt,config,pack",
    [
        (
            "int4_g128",
            "triton:block_m=16,block_n=64,block_k=256,num_warps=4,num_stages=3,word_decode=1,fold_scales=1",
            1,
        ),
        (
            "int4_g128",
            "triton:block_m=16,block_n=32,block_k=256,num_warps=2,num_stages=3,word_decode=1,fold_scales=1,pair_decode=1",
            2,
        ),
        (
            "mxfp4",
            "triton:block_m=16,block_n=64,block_k=256,num_warps=4,num_stages=3,swap_ab=1,word_decode=1,fold_scales=1,pair_decode=1",
            2,
        ),
        (
            "uint4_zp_g128",
            "triton:block_m=64,block_n=64,block_k=128,num_warps=4,num_stages=3,swap_ab=1,word_decode=1,pair_decode=1",
            2,
        ),
    ],
)
def test_word_decoders_lower_for_sm90(fmt, config, pack):
    """One kernel whose K tile (one span here) has 8 inline-asm decoders (one
    per nibble position) or 4 (one per nibble pair, ``pack=2``), each feeding
    its own product."""
    (text,) = gemm_ttir(fmt, 8, parse_config(config), SHAPE)
    pieces = 8 // pack
    assert text.count("tt.elementwise_inline_asm") == pieces and text.count("tt.dot") == pieces
    assert f"packed_element = {pack}" in text
    if pack == 2:  # the pair decoder reads 16-bit halves (two per 32-bit operand)
        assert "tensor<" in text and "xi16>" in text.split("tt.elementwise_inline_asm")[1].split("->")[0]


@pytest.mark.parametrize(
    "fmt,config",
    [
        (
            "int4_g128",
            "triton:block_m=16,block_n=64,block_k=256,num_warps=4,num_stages=3,swap_ab=1,word_decode=1,fold_scales=1,pair_decode=1",
        ),
        (
            "int4_g128",
            "triton:block_m=128,block_n=128,block_k=128,num_warps=8,num_stages=3,swap_ab=1,group_m=8,word_decode=1,fold_scales=1,pair_decode=1",
        ),
        (
            "mxfp4",
            "triton:block_m=16,block_n=128,block_k=256,num_warps=4,num_stages=3,word_decode=1,fold_scales=1,pair_decode=1",
        ),
    ],
)
def test_planar_weights_lower_for_sm90(fmt, config):
    """Planar weights (``to_planar``) lower with 4 pair decoders per span."""
    (text,) = gemm_ttir(fmt, 64, parse_config(config), SHAPE, planar=True)
    assert text.count("tt.elementwise_inline_asm") % 4 == 0 and "packed_element = 2" in text


@pytest.mark.parametrize(
    "case,tiles",
    [
        ("silu", "block_rows=4,num_warps=4,row_blocks=8"),
        ("hadamard", "block_rows=8,num_warps=8,row_blocks=4"),
        ("swigluoai", "default"),
        ("silu", "block_rows=4,num_warps=4,row_blocks=1"),
        ("hadamard", "block_rows=8,num_warps=4,row_blocks=4,hadamard_sub=32"),  # four 32-column products a block
    ],
)
def test_process_input_lowers_for_sm90(case, tiles):
    """One kernel; the row-block loop carries the next block's input tiles."""
    k_in = {"silu": 1536, "hadamard": 768, "swigluoai": 1536}[case]
    x = jax.ShapeDtypeStruct((512, k_in), jnp.bfloat16)
    kw = dict(backend="pallas", tiles=None if tiles == "default" else from_text(Tiles, tiles))
    if case == "hadamard":
        kw["hadamard_block_size"] = 128
    else:
        kw["activation"] = case
    spec = Q.FP8_DYNAMIC_TOKEN if case == "hadamard" else Q.FP8_DYNAMIC_GROUP128
    (text,) = ttir_of(lambda x: hj.process_input(x, spec, **kw), x)
    looped = tiles != "default" and "row_blocks=1" not in tiles
    assert ("scf.for" in text) == looped


def test_gate_up_blocks_index_their_columns_as_halves_do():
    """W8A8's w2 input at decode (gate and up interleaved by 64 columns) lowers with no
    more selects than the halves' case: jnp's floor division and remainder on
    the column indices added six, and compiled (standalone Triton, sm_90) each
    input load then fell from 16-byte vectors to 2-byte scalars (process_input.md,
    sixty-second session)."""
    ((halves, _, _),) = process_ttir("silu+fp8_group128", 768, 4096, None)
    ((blocks, _, _),) = process_ttir("silu_gub64+fp8_group128", 768, 4096, None)
    assert blocks.count("arith.select") == halves.count("arith.select")
    assert blocks.count("tt.load") == halves.count("tt.load")


@pytest.mark.parametrize(
    "tiles,warps,stages",
    [(None, 4, 3), ("block_rows=8,num_warps=4,row_blocks=1", 4, 1), ("block_rows=16,num_warps=8", 8, 3)],
)
def test_process_input_launch_configuration(tiles, warps, stages):
    """The offline compile takes each launch's warps and stages from the lowered
    module: the row-block loop in 3 stages (K=768 at T=4096 by default: 4
    blocks of 8 rows on 4 warps), one block a program 1."""
    ((text, got_warps, got_stages),) = process_ttir("hadamard128+fp8_token", 768, 4096, tiles)
    assert (got_warps, got_stages) == (warps, stages) and "moe_process_input" in text


@pytest.mark.parametrize("tokens,launches", [(64, 3), (2048, 4)])
def test_grouping_lowers_for_sm90(tokens, launches):
    """prepare_scatter at E=256: chunk counts by each bin's last slot (a zeroed,
    aliased row), then one prefix program (few chunks) or a grid of them and
    the bin-starts launch (2048 tokens x 8 = 128 chunks)."""
    ids = jax.ShapeDtypeStruct((tokens, 8), jnp.int32)
    texts = ttir_of(lambda ids: hj.moe_prepare_scatter(ids, 256, backend="pallas"), ids)
    assert len(texts) == launches


@pytest.mark.parametrize("block_size", [24, 384])
def test_alignment_to_any_block_size_lowers_for_sm90(block_size):
    """``moe_align_block_size`` to a block that is no power of two: Triton
    vectors are, so the fill labels a power of two of blocks per program
    apart from its 256 positions (found on the H200: blocks of 24 failed to
    lower, 256 // 24 = 10 block labels)."""
    ids = jax.ShapeDtypeStruct((300, 2), jnp.int32)  # 600 slots: the three-launch grouping
    assert len(ttir_of(lambda ids: hj.moe_align_block_size(ids, block_size, 8, backend="pallas"), ids)) == 3


@pytest.mark.parametrize(
    "tokens,top_k,num_experts,block_size,kernels",
    [
        (16, 8, 128, 16, ("slot_space", "slot_space", "one_launch")),  # the scatter: 128 slots, 8 local bins
        (1, 8, 256, 24, ("slot_space",) * 3),
        (40, 2, 8, 384, ("one_launch",) * 3),
    ],
)
def test_few_slots_group_in_one_launch_for_sm90(tokens, top_k, num_experts, block_size, kernels):
    """At most 128 slots (decode) group in one launch, for the aligned layout
    (with an expert map too) and the scatter destinations: in slot space when
    the slots are few against the bins, else counting every bin."""
    ids = jax.ShapeDtypeStruct((tokens, top_k), jnp.int32)
    expert_map = jax.ShapeDtypeStruct((num_experts,), jnp.int32)
    calls = [
        lambda ids, m: hj.moe_align_block_size(ids, block_size, num_experts, backend="pallas"),
        lambda ids, m: hj.moe_align_block_size(ids, block_size, num_experts, expert_map=m, backend="pallas"),
        lambda ids, m: hj.moe_prepare_scatter(ids, num_experts, expert_map=m, num_local_experts=8, backend="pallas"),
    ]
    for call, kernel in zip(calls, kernels, strict=True):
        (text,) = ttir_of(call, ids, expert_map)
        assert f"moe_group_slots_{kernel}" in text


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16])
def test_permute_lowers_for_sm90(dtype):
    """The row scatter of a pre-quantized (fp8) input and its f32 block scales:
    the rows move as bits (a masked load cannot fill an fp8 tile with zeros in
    Triton; the H200 run of the sixth session's code failed there)."""
    x = jax.ShapeDtypeStruct((64, 256), dtype)
    scale = jax.ShapeDtypeStruct((64, 2), jnp.float32)
    ids = jax.ShapeDtypeStruct((64, 2), jnp.int32)
    texts = ttir_of(lambda x, s, ids: hj.moe_permute(x, ids, 8, a1q_scale=s, backend="pallas"), x, scale, ids)
    scatters = [t for t in texts if "moe_scatter_rows" in t]
    assert len(scatters) == 2 and all("f8E4M3FN" not in t for t in scatters)


@pytest.mark.parametrize(
    "config",
    [
        "triton:block_m=16,block_n=64,block_k=256,num_warps=4,num_stages=3,word_decode=1,fold_scales=1,pair_decode=1",
        "triton:block_m=64,block_n=64,block_k=128,num_warps=4,num_stages=3,swap_ab=1,word_decode=1,pair_decode=1",
    ],
)
def test_folded_mxfp4_decoder_has_no_multiply(config):
    """MXFP4 in bf16 with its scales in the weights (folded, or the exact
    e2m1 x e8m0 product on 64-row tiles): the pair decoder leaves out its
    normalizing multiply (the folded scale carries it: E2M1_FOLDED_EXPONENT)
    and the scale decode its NaN-byte check."""
    (text,) = gemm_ttir("mxfp4", 16, parse_config(config), SHAPE)
    asm = [part.split("->")[0] for part in text.split("tt.elementwise_inline_asm")[1:]]
    assert len(asm) == 4 and not any("mul.rn" in a for a in asm)
    # Nor a compare and select for the NaN byte (the loaded scales are bounded: E8M0_FOLD_MAX).
    assert "arith.constant 255 : i32" not in text


def test_mxfp4_half_bits_decoder_lowers_for_sm90():
    """Planar e2m1 codes in the decoder's bit order (``to_planar(half_bits=True)``):
    4 pair decoders per span with 11 integer instructions among them (the
    nibble order needs 15), no multiply (folded scales)."""
    (text,) = gemm_ttir(
        "mxfp4",
        16,
        parse_config(
            "triton:block_m=16,block_n=64,block_k=256,num_warps=4,num_stages=3,word_decode=1,fold_scales=1,pair_decode=1"
        ),
        SHAPE,
        True,
        True,
    )
    asm = [part.split("->")[0] for part in text.split("tt.elementwise_inline_asm")[1:]]
    ops = sum(a.count(f"{op}.b32 ") for a in asm for op in ("shl", "shr", "and", "lop3"))
    assert len(asm) == 4 and ops == 11 and not any("mul.rn" in a for a in asm)


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.parametrize(
    "fmt,quant,operand,accumulator",
    [
        ("fp8_block128", "fp8_dynamic_group128", "f8E4M3FN", "f32"),
        ("int8_channel", "int8_dynamic_token", "i8", "i32"),
    ],
)
def test_eight_bit_inputs_lower_to_eight_bit_mmas(fmt, quant, operand, accumulator):
    """W8A8 lowers to 8-bit ``tt.dot`` operands: e4m3 with the tensor cores'
    own sums promoted every 128 columns (``maxNumImpreciseAcc``; left at 0,
    Triton converts the operands to f16 for ``mma.sync``), int8 with int32 sums;
    e4m3 weight values loaded as e4m3 (no uint8 bitcast before the product)."""
    from humming_jax import formats as F
    from humming_jax import layouts as L
    from pallas_kernels.gemm import fp8_dot
    from pallas_kernels.gemm import triton as kernel

    e, n, k = SHAPE
    w = F.quantize_weight(jnp.ones((e, n, k), jnp.float32) * 0.02, F.get_format(fmt))
    x = Q.quantize_input(jnp.ones((64, k), jnp.float32), Q.get_input_spec(quant))
    layout = L.GroupedContiguous(jnp.asarray([0, 16, 32, 48, 64], jnp.int32))
    tiles = kernel.Tiles(64, 128, 128, 4, 4)
    (text,) = ttir_of(lambda x, w, lay: hj.gemm(x, w, lay, tuning=tiles, backend="pallas"), x, w, layout)
    dots = [line for line in text.splitlines() if "tt.dot" in line]
    assert dots and all(f"x{operand}> * tensor<" in d and f"x{accumulator}>" in d for d in dots)
    if operand == "f8E4M3FN":
        assert all(f"maxNumImpreciseAcc = {fp8_dot.PROMOTE_K}" in d for d in dots)
        loads = [line for line in text.splitlines() if "tt.load" in line]
        assert any("128x128x!tt.ptr<f8E4M3FN>>" in line for line in loads)  # the weight tile, unmasked


@pytest.mark.parametrize(
    "fmt,config,half_bits",
    [
        (
            "mxfp4",
            "triton:block_m=16,block_n=64,block_k=256,num_warps=4,num_stages=3,word_decode=1,fold_scales=1,pair_decode=1",
            True,
        ),
        (
            "mxfp4@fp8_dynamic_group128",
            "triton:block_m=64,block_n=128,block_k=128,swap_ab=1,word_decode=1,fold_scales=1,pair_decode=1",
            False,
        ),
    ],
)
def test_k_major_scales_lower_for_sm90(fmt, config, half_bits):
    """MXFP4 scales stored ``[E, K/32, N]`` (what the modules store) lower as
    the ``[E, N, K/32]`` ones do, on the decode tile (folded scales) and on
    fp8 inputs (the span's top and the shifted factors): as many loads, MMAs
    and decoders."""
    tuning = parse_config(config)
    (major,) = gemm_ttir(fmt, 16, tuning, SHAPE, planar=True, half_bits=half_bits, k_major_scales=True)
    (minor,) = gemm_ttir(fmt, 16, tuning, SHAPE, planar=True, half_bits=half_bits)
    for op in ("tt.load", "tt.dot ", "tt.elementwise_inline_asm"):
        assert major.count(op) == minor.count(op) > 0, op


def test_four_bit_weights_with_fp8_inputs_chain_their_products():
    """int4 × fp8 per token on e4m3 MMAs: the four nibble pieces of a span
    accumulate in one chain (each ``tt.dot`` takes the previous one's result),
    not in their own registers summed by f32 adds; the codes decode to e4m3
    bytes with integer ops, four halves a call (no 16-bit float in between)."""
    config = parse_config("triton:block_m=64,block_n=128,block_k=128,word_decode=1,pair_decode=1")
    (text,) = gemm_ttir("int4_g128@fp8_dynamic_token", 512, config, SHAPE, planar=True)
    dots = [line.strip() for line in text.splitlines() if "= tt.dot " in line]
    assert len(dots) == 4 and all("maxNumImpreciseAcc" in d for d in dots)
    results = [d.split(" = ")[0] for d in dots]
    accumulators = [d.split("tt.dot ")[1].split(",")[2].strip() for d in dots]
    assert accumulators[1:] == results[:-1]
    assert text.count("packed_element = 4") == 4 and "prmt.b32" in text and "xf16>" not in text


def test_byte_pairs_lower_to_e4m3_mmas(monkeypatch):
    """e4m3 weights read as uint16 byte pairs (past 2**31 values, see
    ``triton.reads_byte_pairs``) still meet fp8 inputs on e4m3 MMAs: the pair
    words load as i16 and each 128-column span is two 64-deep products."""
    from pallas_kernels.gemm import triton as kernel

    monkeypatch.setattr(kernel, "WRAPPING_ELEMENTS", SHAPE[0] * SHAPE[1] * SHAPE[2] - 1)
    jax.clear_caches()
    config = parse_config("triton:block_m=16,block_n=64,block_k=256")
    (text,) = gemm_ttir("fp8_block128@fp8_dynamic_group128", 64, config, SHAPE)
    dots = [line for line in text.splitlines() if "= tt.dot " in line]
    assert len(dots) == 4 and all("x64xf8E4M3FN> * tensor<64x" in d for d in dots)
    assert any("tt.ptr<i16>" in line for line in text.splitlines() if "tt.load" in line)
    jax.clear_caches()


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
def test_grouped_layer_reads_its_offsets_as_the_routing_returns_them():
    """The grouped int4 layer past decode (T·k = 256 slots) lowers for sm_90
    with no running maximum over its offsets (a ``reduce_window`` launch a
    GEMM): the routing's offsets are already in range and non-decreasing
    (``GroupedContiguous(normalized=True)``); a caller's layout keeps it."""
    config = hj.ExpertsConfig(8, 256, 128, 2, weight_format="int4_g128")
    e, n, k = config.num_experts, config.w13_n, config.hidden_size
    weights = hj.quantize_experts(
        jnp.ones((e, n, k), jnp.float32), jnp.ones((e, k, config.intermediate_size), jnp.float32), config
    )
    x = jax.ShapeDtypeStruct((128, k), jnp.bfloat16)
    tw = jax.ShapeDtypeStruct((128, 2), jnp.float32)
    ids = jax.ShapeDtypeStruct((128, 2), jnp.int32)

    def lowered(fn, *args):
        with capture_triton_modules():
            return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    grouped = functools.partial(hj.humming_grouped_experts, config=config, backend="pallas")
    layer = lowered(lambda x, tw, ids: grouped(x, weights, tw, ids), x, tw, ids)
    assert "moe_gemm" in layer and "reduce_window" not in layer
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    rows = jax.ShapeDtypeStruct((256, k), jnp.bfloat16)
    caller = lowered(lambda x, o: hj.gemm(x, weights.w13, hj.GroupedContiguous(o), backend="pallas"), rows, offsets)
    assert "reduce_window" in caller


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.parametrize(
    "pipeline,experts,top_k,tokens", [("grouped", 128, 8, 1), ("indexed", 128, 8, 1), ("indexed", 8, 2, 16)]
)
def test_decode_layer_launches_for_sm90(pipeline, experts, top_k, tokens):
    """The int4 layer at decode lowers to three Triton launches — w13 with the
    activation in its epilogue (gate and up rows interleaved by
    ``quantize_experts``), w2, the fused sum — and no grouping: at T=1 each
    slot its own block, the GEMMs reading the blocks' experts (the ids) alone;
    with a few experts and two slots an expert the same arrays tiled by
    expert, each GEMM finding an expert's tokens in the ids."""
    config = hj.ExpertsConfig(experts, 256, 128, top_k, weight_format="int4_g128")
    e, n, k = config.num_experts, config.w13_n, config.hidden_size
    weights = hj.quantize_experts(
        jnp.ones((e, n, k), jnp.float32), jnp.ones((e, k, config.intermediate_size), jnp.float32), config
    )
    fn = hj.humming_grouped_experts if pipeline == "grouped" else hj.humming_indexed_experts
    x = jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16)
    tw = jax.ShapeDtypeStruct((tokens, top_k), jnp.float32)
    ids = jax.ShapeDtypeStruct((tokens, top_k), jnp.int32)
    texts = ttir_of(lambda x, tw, ids: fn(x, weights, tw, ids, config, backend="pallas"), x, tw, ids)
    assert len(texts) == 3
    assert not any("moe_group_slots" in text for text in texts)
    gemms = [text for text in texts if "moe_gemm_indexed" in text]
    assert len(gemms) == 2
    assert sum("tt.split" in text for text in gemms) == 1  # w13 parts its gate and up sums


# Layout-only ops (no copy): the 4-bit codes' bytes viewed as the kernels' words.
VIEW_OPS = ("stablehlo.reshape", "stablehlo.bitcast_convert")


def _ops_over_every_expert(text: str, num_experts: int) -> set[str]:
    """The ops of a lowered program, outside its kernels and views, with an
    operand or result of at least 2**20 elements whose first axis is the
    experts' (a pass over every expert's weights or scales)."""
    found = set()
    for line in text.splitlines():
        op = re.search(r"=\s*\"?([a-z_]+\.[a-z_]+)", line)
        if op is None or "custom_call" in line or op.group(1) in VIEW_OPS:
            continue
        for dims in re.findall(r"tensor<([0-9x]+)x[a-z]+[0-9]*[A-Za-z0-9]*>", line):
            shape = [int(d) for d in dims.split("x")]
            if len(shape) >= 3 and shape[0] == num_experts and math.prod(shape) >= 2**20:
                found.add(op.group(1))
    return found


_DECODE_FORMATS = ["bf16", "int4_g128", "mxfp4", "fp8_block128@fp8_dynamic_group128", "mxfp4@fp8_dynamic_group128"]


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.parametrize(
    "fmt,pipeline", [(fmt, pipeline) for fmt in _DECODE_FORMATS for pipeline in ("grouped", "indexed")]
)
def test_decode_layer_passes_over_no_experts_weights(fmt, pipeline, monkeypatch):
    """At decode (T=16, qwen3-30b-a3b's shapes) the layer lowered for the GPU
    reads the weights only in its kernels, which read the experts that got
    rows: no op outside them runs over every expert's weights or scales (at
    T=16 such a pass would cost more than the GEMMs' own weight reads)."""
    text = _qwen3_layer_for_the_gpu(fmt, pipeline, 16, monkeypatch)
    assert "custom_call" in text
    assert _ops_over_every_expert(text, 128) == set()
    jax.clear_caches()


def _qwen3_layer_for_the_gpu(fmt: str, pipeline: str, tokens: int, monkeypatch) -> str:
    """The text of qwen3-30b-a3b's layer (``fmt``: ``WEIGHT@INPUT``; the grouped
    or indexed pipeline) at ``tokens`` tokens lowered for the GPU, the Mosaic
    kernels told they are on the H200 the table is for; weights abstract."""
    from humming_jax import bench
    from pallas_kernels.gemm import mosaic

    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    weight_format, input_quant = bench.split_format(fmt)
    config = hj.ExpertsConfig(128, 2048, 768, 8, weight_format=weight_format, input_quant=input_quant)
    floats = (
        jax.ShapeDtypeStruct((128, config.w13_n, 2048), jnp.float32),
        jax.ShapeDtypeStruct((128, 2048, 768), jnp.float32),
    )
    weights = jax.eval_shape(lambda w13, w2: hj.quantize_experts(w13, w2, config), *floats)
    fn = hj.humming_grouped_experts if pipeline == "grouped" else hj.humming_indexed_experts
    x = jax.ShapeDtypeStruct((tokens, 2048), jnp.bfloat16)
    tw = jax.ShapeDtypeStruct((tokens, 8), jnp.float32)
    ids = jax.ShapeDtypeStruct((tokens, 8), jnp.int32)

    def layer(x, weights, tw, ids):
        return fn(x, weights, tw, ids, config, backend="pallas")

    with capture_triton_modules():
        return jax.jit(layer).trace(x, weights, tw, ids).lower(lowering_platforms=("cuda",)).as_text()


def test_loads_in_loops_finds_the_loads_a_loop_waits_on():
    """The audit of a compiled Triton kernel: ``tt.load`` ops inside an
    ``scf.for`` whose value the iteration uses (the pipeliner turned the others
    into async copies) — not the ones before or after the loop, nor one only
    carried to the next iteration (a prefetch), also with a loop nested in another."""
    ttgir = "\n".join(
        [
            "  tt.func @k() {",
            "    %0 = tt.load %a : !tt.ptr<i32> loc(#l0)",
            "    %1:2 = scf.for %i = %c0 to %c4 step %c1 iter_args(%x = %0) -> (i32) {",
            "      %2 = ttg.async_copy_global_to_local %p, %s : tensor<256x32x!tt.ptr<i16>, #b> -> <256x32xi16>",
            "      %3 = scf.for %j = %c0 to %c2 step %c1 iter_args(%y = %x) -> (i32) {",
            "        %4 = tt.load %q : tensor<128x1x!tt.ptr<bf16>, #b5> loc(#l4)",
            "        scf.yield %y : i32",
            "      }",
            "      %5 = tt.load %r : tensor<16x!tt.ptr<i32>, #b2> loc(#l5)",
            "      %7 = tt.load %u : tensor<16x!tt.ptr<f32>, #b2> loc(#l7)",
            "      %8 = arith.addi %5, %3 : i32",
            "      scf.yield %3, %7 : i32",
            "    }",
            "    %6 = tt.load %t : tensor<8x!tt.ptr<f32>, #b3> loc(#l6)",
            "  }",
        ]
    )
    assert loads_in_loops(ttgir) == ["tensor<128x1x!tt.ptr<bf16>, #b5>", "tensor<16x!tt.ptr<i32>, #b2>"]


SASS_LOOP = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS.64 R2, [R4] ;
.L_x_3:
        /*0020*/                   LOP3.LUT R5, R2, 0xf000f, RZ, 0xc0, !PT ;
        /*0030*/                   HADD2.BF16_V2 R5, R5, -136, -136 ;
        /*0040*/                   HMUL2.BF16_V2 R5, R5, R6 ;
        /*0048*/               @P2 BRA 0x40 ;
        /*0050*/                   HGMMA.64x176x16.F32.BF16 R24, R208, gdesc[UR12], R24 ;
        /*0060*/                   HGMMA.64x176x16.F32.BF16 R112, gdesc[UR4], gdesc[UR12], R112 ;
        /*0070*/               @P0 BRA `(.L_x_3) ;
        /*0080*/                   LOP3.LUT R7, R2, 0xf, RZ, 0xc0, !PT ;
        /*0090*/               @P1 BRA 0x10 ;
        /*00a0*/                   EXIT ;
"""


def test_sass_loop_reads_the_wgmma_loop():
    """The innermost loop that issues wgmma (labels and addresses as targets);
    a register-operand HGMMA.64xNx16 feeds 64 x 16 / 128 = 8 weights a thread."""
    from benchmarks import sass_loop

    instructions = sass_loop.parse(SASS_LOOP)
    assert [i.target for i in instructions if i.opcode == "BRA"] == [0x40, 0x20, 0x10]
    # the loop around it holds a smaller wgmma loop, the one inside it no wgmma: neither counts
    (loop,) = sass_loop.wgmma_loops(instructions)
    assert len(loop.instructions) == 7
    assert loop.histogram()["HADD2.BF16_V2"] == 1 and loop.register_weights() == 8
    assert "0.88 instructions a weight" in sass_loop.report("k", SASS_LOOP)


def test_sass_loop_assembles_newer_ptx(tmp_path, monkeypatch):
    """A PTX dump newer than the ptxas at hand is compiled at the version that
    ptxas names (its error says which), and ptxas's report comes back: here
    a stand-in ptxas that takes PTX 8.7 only."""
    from benchmarks import sass_loop

    fake = tmp_path / "ptxas"
    fake.write_text(
        "#!/bin/sh\n"
        "for a; do case $a in *.ptx) src=$a;; esac; done\n"
        'if grep -qx ".version 9.0" "$src"; then\n'
        "  echo \"ptxas fatal: Unsupported .version 9.0; current version is '8.7'\" >&2; exit 255; fi\n"
        'echo "ptxas info    : Used 168 registers" >&2; exit 0\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    ptx = tmp_path / "k.ptx"
    ptx.write_text("//\n.version 9.0\n.target sm_90a\n.version 9.0 stays in a comment\n")
    cubin, report = sass_loop.assemble(str(ptx))
    assert cubin == str(tmp_path / "k.cubin") and "Used 168 registers" in report
    assert (tmp_path / "k.ptxas.ptx").read_text().splitlines()[1:] == [
        ".version 8.7",
        ".target sm_90a",
        ".version 9.0 stays in a comment",
    ]
    with pytest.raises(RuntimeError, match="ptxas failed"):
        ptx.write_text(".version 9.0\n")
        fake.write_text("#!/bin/sh\necho 'ptxas fatal: syntax error' >&2; exit 1\n")
        sass_loop.assemble(str(ptx))


# What a Mosaic tiling is lowered for in the TMA check: the 16-bit kernel's formats (W4A8
# for the tiles that multiply a scaled input out first) and the fp8 kernel's pairs.
MOSAIC_FORMATS = ("bf16", "int4_g128", "mxfp4", "mxfp4@fp8_dynamic_group128")
FP8_KERNEL_FORMATS = (
    "fp8_block128@fp8_dynamic_group128",
    "fp8_channel@fp8_dynamic_token",
    "mxfp4@fp8_dynamic_group128",
    "mxfp4@fp8_dynamic_token",
)
# (E, N, K) of the problems, for the grid of calls whose candidates are gathered.
PROBLEM_SHAPES = ((128, 1536, 2048), (128, 2048, 768), (8, 28672, 4096), (8, 4096, 14336), (256, 4096, 7168))


def _mosaic_tilings() -> dict:
    """The Mosaic tilings a call can run — the shipped table's entries and
    the heuristic's (as the op lists them over a grid of calls) — each with
    the format classes it runs for (its table key's, the calls' it was listed
    for); and the rest of what ``tune`` can write (the sweep's lists, the
    swap tiles sized to experts of several row counts), for every class (None)."""
    from humming_jax import tuning as T
    from humming_jax.tuning import search
    from pallas_kernels.gemm import mosaic, mosaic_fp8

    found: dict = {}

    def add(tiles, fmt_class):
        if isinstance(tiles, (mosaic.Tiles, mosaic_fp8.Tiles)):
            found.setdefault(tiles, set()).add(fmt_class)

    for key, entries in T.load_table().items():
        for entry in entries:
            add(entry.tiles, key.split("/")[1].split("@")[0])
    for fmt in ("bf16", "int4_g128", "mxfp4", "fp8_block128", "fp8_channel"):
        for inputs in (None, "float8_e4m3"):
            fmt_class = T.format_class(F.get_format(fmt), inputs)
            for e, n, k in PROBLEM_SHAPES:
                for m in (8, 128, 1024, 4096, 16384, 65536):
                    for layout in ("grouped_contiguous", "indexed", "grouped_masked"):
                        for tiles in T.candidates(layout, F.get_format(fmt), m, e, n, k, None, True, inputs):
                            add(tiles, fmt_class)
    for tiles in [*search.DECODE, *search.MID, *search.PREFILL, *search.TALL_TILES]:
        add(tiles, None)
    for rows in (12, 40, 300):  # 16, 48 (cluster pairs) and 168 rows (alone)
        for tiles in search.expert_sized(rows):
            add(tiles, None)
    return found


def _format_class(fmt: str) -> str:
    """The tuning table's class of ``fmt`` (``WEIGHT@INPUT``)."""
    from humming_jax import bench
    from humming_jax import tuning as T

    weight_format, quant = bench.split_format(fmt)
    return T.format_class(weight_format, quant.dtype.value if quant.is_quantized else None)


def _layout_args(layout_kind: str, e: int, m: int, block: int):
    """(abstract route arrays, the layout built from them) of a small call."""
    if layout_kind == "indexed":
        blocks = -(-m // block)
        route = (
            jax.ShapeDtypeStruct((blocks * block,), jnp.int32),
            jax.ShapeDtypeStruct((blocks,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32),
        )
        return route, lambda *r: hj.Indexed(*r, top_k=1, block_size=block)
    if layout_kind == "grouped_masked":
        return (jax.ShapeDtypeStruct((e,), jnp.int32),), hj.GroupedMasked
    return (jax.ShapeDtypeStruct((e + 1,), jnp.int32),), hj.GroupedContiguous


def _gemm_lowering(fmt: str, tiles, layout_kind: str = "grouped_contiguous", n: int = 512, k: int = 512):
    """``(lower, supported)`` of ``gemm`` of ``fmt`` (``WEIGHT@INPUT``) with
    ``tiles`` on a small problem every tiling divides (unless ``n``, ``k``
    say otherwise): ``lower()`` lowers it for the GPU; ``supported``: the
    tiling's kernel takes the call."""
    from humming_jax import bench
    from humming_jax.gemm import as_quantized_input, plan

    weight_format, quant = bench.split_format(fmt)
    e, m = 4, 600
    half_bits, k_major = F.planar_half_bits("bfloat16", quant), F.k_major_scales_preferred(weight_format)

    def make(w, x):
        weight = F.to_planar(F.quantize_weight(w, weight_format), half_bits=half_bits, k_major_scales=k_major)
        return weight, (Q.quantize_input(x, quant) if quant.is_quantized else x)

    floats = (jax.ShapeDtypeStruct((e, n, k), jnp.float32), jax.ShapeDtypeStruct((m, k), jnp.bfloat16))
    weight, x = jax.eval_shape(make, *floats)
    route, layout_of = _layout_args(layout_kind, e, m, tiles.block_m)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (weight, x, route))
    ran, _ = plan(as_quantized_input(zeros[1]), zeros[0], layout_of(*zeros[2]), tuning=tiles)

    def lower():
        fn = jax.jit(lambda w, x, *r: hj.gemm(x, w, layout_of(*r), tuning=tiles, backend="pallas"))
        return fn.trace(weight, x, *route).lower(lowering_platforms=("cuda",))

    return lower, ran is not None


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_mosaic_tma_copies_start_on_128_byte_multiples(monkeypatch):
    """Every Mosaic tiling the table or the heuristic runs, lowered for the GPU
    with each format of the classes it runs for, and the tune sweep's tilings
    with each format their kernel takes: each TMA copy's shared-memory box
    starts on a 128-byte multiple (TMA's rule; a box elsewhere faults on the
    GPU with a misaligned address — how two compiled runs failed before this
    check: a 64-byte e4m3 output row, a 64-byte scale box a stage)."""
    from benchmarks.mosaic_ir import capture_tma_copies, misaligned
    from pallas_kernels.gemm import mosaic, mosaic_fp8

    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    tilings = _mosaic_tilings()
    assert len(tilings) >= 8
    for tiles, classes in tilings.items():
        formats = FP8_KERNEL_FORMATS if isinstance(tiles, mosaic_fp8.Tiles) else MOSAIC_FORMATS
        # Each format of the classes the tiling runs for (a tune-sweep tiling: every format its kernel takes).
        ran = [fmt for fmt in formats if _format_class(fmt) in classes]
        if ran and None not in classes:
            formats = ran
        checked = 0
        for fmt in formats:
            lower, supported = _gemm_lowering(fmt, tiles)
            if not supported:
                continue
            with capture_tma_copies() as copies:
                lower()
            assert copies and not misaligned(copies), (tiles, fmt, misaligned(copies))
            checked += 1
        assert checked, f"no format lowered {tiles}"
    jax.clear_caches()


_OTHER_LAYOUT_TILINGS = [
    ("bf16", "mosaic:stages=3"),
    ("int4_g128", "mosaic:block_m=144,block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2"),
    ("fp8_block128@fp8_dynamic_group128", "mosaic_fp8:block_m=64,block_n=256,stages=4"),
    ("mxfp4@fp8_dynamic_group128", "mosaic_fp8:block_m=64,block_n=256,stages=4,swap_ab=1"),
    ("mxfp4", "mosaic_mid:block_m=48,block_k=128,stages=3,swap_ab=1,word_decode=1"),
]


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "fmt,config,layout_kind",
    [(*t, layout) for t in _OTHER_LAYOUT_TILINGS for layout in ("indexed", "grouped_masked")],
)
def test_mosaic_tma_copies_aligned_on_the_other_layouts(fmt, config, layout_kind, monkeypatch):
    """The same rule on the indexed layout (row tiles from a block table,
    whole-tile stores in block order) and the grouped-masked one, one
    tiling of each kernel form."""
    from benchmarks.mosaic_ir import capture_tma_copies, misaligned
    from pallas_kernels.gemm import mosaic

    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    lower, supported = _gemm_lowering(fmt, gemm_from_text(config), layout_kind)
    assert supported
    with capture_tma_copies() as copies:
        lower()
    assert copies and not misaligned(copies)


def _tiling_space():
    """(format, tiles) over the Mosaic kernels' fields, a few values past
    what they take included (block_n 512, 256-row swap tiles, 5 stages)."""
    import itertools

    from pallas_kernels.gemm import mosaic, mosaic_fp8, mosaic_mid

    space = [
        ("bf16", mosaic.Tiles(bm, bn, bk, stages=st, cluster_n=cn))
        for bm, bn, bk, st, cn in itertools.product((64, 128), (128, 256, 512), (16, 32, 64), (2, 3, 5), (1, 2))
    ]
    rows = (8, 24, 40, 48, 72, 96, 136, 144, 176, 208, 256)
    space += [
        (fmt, mosaic.Tiles(bm, bn, 128, stages=st, cluster_n=cn, swap_ab=True, word_decode=wd))
        for fmt, bm, bn, st, cn, wd in itertools.product(
            ("int4_g128", "mxfp4", "uint4_zp_g128"), rows, (128, 256, 512), (2, 3, 4), (1, 2), (False, True)
        )
    ]
    space += [  # one warpgroup a program: its accumulator the whole tile, no cluster
        (fmt, mosaic_mid.Tiles(bm, bn, bk, stages=st, cluster_n=cn, swap_ab=fmt != "bf16", word_decode=wd))
        for fmt, bm, bn, st, cn, wd in itertools.product(
            ("bf16", "int4_g128", "mxfp4"), (48, 64, 96), (64, 128, 192, 256, 512), (2, 3, 5), (1, 2), (False, True)
        )
        for bk in ((64,) if fmt == "bf16" else (128,))
    ]
    space += [
        (fmt, mosaic_fp8.Tiles(bm, bn, stages=st, swap_ab=sw))
        for fmt, bm, bn, st, sw in itertools.product(
            ("w8a8_fp8_block128", "w4a8_mxfp4"), (64, 128), (128, 256, 512), (2, 4, 5), (False, True)
        )
    ]
    return space


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_mosaic_tiling_its_checks_accept_lowers():
    """A Mosaic tiling the kernel's own checks accept lowers for sm_90 with
    every TMA box on a 128-byte multiple; the others raise the kernel's
    refusal, naming it — never an error from inside Mosaic's lowering (how
    ``block_n = 512`` failed until the sixty-sixth session: a TMA box spans
    at most 256 elements). A seeded sample of the space, with one known
    refusal and one known fit always in it."""
    import random

    from benchmarks.mosaic_ir import capture_tma_copies, misaligned, mosaic_ir
    from pallas_kernels.gemm import mosaic

    space = _tiling_space()
    sample = random.Random(66).sample(space, 160)
    sample += [("int4_g128", mosaic.Tiles(48, 512, 128, swap_ab=True)), ("bf16", mosaic.Tiles(128, 256, 64))]
    lowered = refused = 0
    for fmt, tiles in sample:
        rows = 37 if tiles.block_m < 64 else 300
        try:
            with capture_tma_copies() as copies:
                mosaic_ir(fmt, (4, 512, 1024), rows, tiles)
        except ValueError as error:  # the kernel's own check: "mosaic GEMM: ..." / "mosaic_fp8 GEMM: ..."
            assert re.match(r"mosaic(_fp8)? GEMM: ", str(error)), (fmt, tiles, str(error)[:300])
            refused += 1
            continue
        assert copies and not misaligned(copies), (fmt, tiles, misaligned(copies))
        lowered += 1
    assert lowered and refused
    jax.clear_caches()


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "n,k,config",
    [
        (2880, 2880, "mosaic:block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2"),
        (5760, 2880, "mosaic:block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2"),
        (2880, 2880, "mosaic:block_k=128,stages=3,word_decode=1"),
    ],
)
def test_partial_tiles_lower_for_sm90(n, k, config, monkeypatch):
    """gpt-oss's MXFP4 shapes (K = 2880: half a last step; N = 2880: a
    partial column tile; N = 5760 in cluster pairs: a pair's second program
    past N) lower for the GPU with the output slots past N left unstored,
    every TMA box on a 128-byte multiple."""
    from benchmarks.mosaic_ir import capture_tma_copies, misaligned
    from pallas_kernels.gemm import mosaic

    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    lower, supported = _gemm_lowering("mxfp4", gemm_from_text(config), n=n, k=k)
    assert supported
    with capture_tma_copies() as copies:
        lower()
    assert copies and not misaligned(copies)


@pytest.mark.parametrize("row,scale,alignment", [(0, 0, 1024), (1, 0, 64), (2, 0, 128), (0, 1, 64), (0, 2, 128)])
def test_tma_check_follows_static_and_dynamic_offsets(row, scale, alignment):
    """The check itself: a copy into row ``row + scale · program`` of a
    ``[4, 16]`` f32 shared buffer (64-byte rows) starts at a multiple of
    ``alignment`` — row 1 or a program-indexed row is 64 bytes off a
    128-byte multiple, every other row is not."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from benchmarks.mosaic_ir import capture_tma_copies, misaligned

    def body(x_gmem, o_gmem, smem, barrier):
        plgpu.copy_gmem_to_smem(x_gmem, smem.at[row + jax.lax.axis_index("g") * scale], barrier)
        plgpu.barrier_wait(barrier)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((16,), jnp.float32),
        grid=(2,),
        grid_names=("g",),
        scratch_types=[plgpu.SMEM((4, 16), jnp.float32), plgpu.Barrier(num_arrivals=1)],
    )
    with capture_tma_copies() as copies:
        jax.jit(kernel).trace(jax.ShapeDtypeStruct((16,), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert [c.alignment for c in copies] == [alignment]
    assert bool(misaligned(copies)) == (alignment < 128)


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_mosaic_row_tiles_found_without_a_loop(monkeypatch):
    """The grouped Mosaic call's row-tile table is plain array code around
    the kernel — no ``while`` (a binary search's loop, each step a launch on
    the GPU)."""
    from pallas_kernels.gemm import mosaic

    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    tiles = gemm_from_text("mosaic:block_m=144,block_k=128,stages=3,swap_ab=1,word_decode=1,cluster_n=2")
    lower, supported = _gemm_lowering("int4_g128", tiles)
    assert supported
    text = lower().as_text()
    assert "mosaic_gpu" in text and "stablehlo.while" not in text
    jax.clear_caches()


@FULL  # an sm_90 lowering check: make test's time (test-full, the GPU step)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "fmt,pipeline,tokens",
    [("int4_g128", "grouped", 4096), ("mxfp4@fp8_dynamic_group128", "indexed", 4096), ("bf16", "indexed", 16)],
)
def test_layer_lowers_without_a_loop_outside_its_kernels(fmt, pipeline, tokens, monkeypatch):
    """The layer lowered for the GPU (qwen3-30b-a3b's shapes, the H200's
    table) holds no ``while`` outside its kernels: on the GPU each step of
    such a loop is launched on its own (a binary search's did, around every
    grouped Mosaic GEMM)."""
    text = _qwen3_layer_for_the_gpu(fmt, pipeline, tokens, monkeypatch)
    assert "custom_call" in text and "stablehlo.while" not in text
    jax.clear_caches()
