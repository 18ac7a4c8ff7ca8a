"""The GEMM benchmark: the same as ``python -m humming_jax bench`` (see humming_jax/bench.py)."""

import sys

from humming_jax.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
