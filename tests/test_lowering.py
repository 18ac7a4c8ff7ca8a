"""The GPU-only paths of the GEMM (the inline-PTX word decoders, which
interpret mode replaces by jnp) lower to Triton IR for sm_90 on the CPU:
what the kernel tests cannot see without a GPU."""

import pytest

from benchmarks.inspect_gemm import parse_config
from benchmarks.lower_sm90 import gemm_ttir

SHAPE = (4, 256, 512)
# Lowering for the GPU backend warns that Pallas's Triton backend is deprecated (our GPU path today).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.mark.parametrize(
    "fmt,config,pack",
    [
        ("int4_g128", "16,64,256,4,3,word_decode,fold_scales", 1),
        ("int4_g128", "16,32,256,2,3,word_decode,fold_scales,pair_decode", 2),
        ("mxfp4", "16,64,256,4,3,swap_ab,word_decode,fold_scales,pair_decode", 2),
        ("uint4_zp_g128", "64,64,128,4,3,swap_ab,word_decode,pair_decode", 2),
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
