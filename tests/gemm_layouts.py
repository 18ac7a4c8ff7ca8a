"""The four GEMM layouts over ``m`` rows and ``e`` experts, with the edge
cases every kernel test wants: an empty expert, rows past the last group, an
over-full masked expert and an invalid slot."""

import jax.numpy as jnp
import numpy as np

import humming_jax as hj


def layouts(rng, e: int, m: int, block_size: int = 16) -> dict:
    """Every layout (``e`` = 4 experts, ``m`` = 40 rows); the indexed one aligned to
    ``block_size`` (a tile's rows)."""
    assert (e, m) == (4, 40), "the grouped offsets and masked counts are written for 4 experts and 40 rows"
    ids = rng.integers(0, e, size=(m, 2)).astype(np.int32)
    ids[0, 0] = e + 5  # an invalid slot: its output row is never written
    sorted_ids, expert_ids, padded = hj.moe_align_block_size(jnp.asarray(ids), block_size, e)
    return {
        "dense": hj.Dense(),
        "grouped_contiguous": hj.GroupedContiguous(jnp.asarray([0, 7, 7, 30, 33], jnp.int32)),  # empty, tail rows
        "grouped_masked": hj.GroupedMasked(jnp.asarray([0, 10, 3, 40], jnp.int32)),  # empty, over-full
        # The dropped slot is listed past the padded blocks: the kernel zeroes its row (no zero fill).
        "indexed": hj.Indexed(sorted_ids, expert_ids, padded, top_k=2, block_size=block_size, lists_dropped=True),
    }
