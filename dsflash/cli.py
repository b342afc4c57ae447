"""`dsflash` console command. Each subcommand lives beside the code it drives and registers itself
through a `register(subparsers)` function; this file only lists them."""

from __future__ import annotations

import argparse
import importlib
import sys

# the module of each subcommand, whose `register(subparsers)` adds it
COMMANDS = [
    "dsflash.golden.check",  # check-golden
    "dsflash.checkpoint.make",  # make-checkpoint
    "dsflash.golden.logits_cmd",  # logits
    "dsflash.engine.generate_cmd",  # generate
    "dsflash.server.serve_cmd",  # serve
    "dsflash.server.chat_cmd",  # chat
    "dsflash.split.box",  # box
    "dsflash.bench.model",  # bench
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsflash", description="DeepSeek-V4.1-Flash inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
