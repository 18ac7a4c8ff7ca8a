"""Command line: ``python -m humming_jax demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m humming_jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run a small MoE layer through every expert pipeline and check it")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from humming_jax.demo import main as demo_main

        return demo_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
