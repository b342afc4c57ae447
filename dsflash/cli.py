"""`dsflash` console command. Each subcommand lives beside the code it drives and registers itself
through a `register(subparsers)` function; this file only lists them."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterator

import torch

from dsflash.checkpoint.reader import CheckpointError
from dsflash.config import ConfigError
from dsflash.engine.plan import PlacementError
from dsflash.engine.session import ContextLengthError
from dsflash.parallel.group import Unavailable
from dsflash.split.link import BoxRefused

# the module of each subcommand, whose `register(subparsers)` adds it
COMMANDS = [
    "dsflash.golden.check",  # check-golden
    "dsflash.checkpoint.make",  # make-checkpoint
    "dsflash.golden.logits_cmd",  # logits
    "dsflash.engine.generate_cmd",  # generate
    "dsflash.engine.follow_cmd",  # follow (a follower rank of --ep/--tp)
    "dsflash.engine.plan_cmd",  # plan
    "dsflash.server.serve_cmd",  # serve
    "dsflash.server.chat_cmd",  # chat
    "dsflash.split.box",  # box
    "dsflash.bench.model",  # bench
    "dsflash.train.train_cmd",  # train-data, train
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsflash", description="DeepSeek-V4.1-Flash inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).register(sub)
    for command in sub.choices.values():
        command.add_argument("--threads", type=int, default=None, metavar="N",
                             help=f"CPU threads for torch (default: the cores this process may run on, "
                                  f"{cpu_threads()} here)")
    for p in parsers(parser):
        p.formatter_class = DefaultsHelp
    return parser


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


class DefaultsHelp(argparse.HelpFormatter):
    """Each option's help with its default, unless the help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or any(action.default is v for v in (None, False)) \
                or action.default == argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


def cpu_threads() -> int:
    """The cores this process may run on (its CPU affinity), which torch's default (the machine's physical
    cores) can exceed: oversubscribed threads made a CPU decode 40x slower beside another busy process."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(n: int | None) -> None:
    if n is not None and n < 1:
        raise SystemExit(f"dsflash: --threads must be at least 1, got {n}")
    torch.set_num_threads(n or cpu_threads())


# what a user can cause (a missing or damaged file, a prompt too long, a box down or refusing, Ctrl-C): said in
# one line, with a non-zero exit, rather than a traceback
EXPECTED = (ConfigError, CheckpointError, PlacementError, ContextLengthError, Unavailable, BoxRefused,
            FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    try:
        return int(args.func(args) or 0)
    except EXPECTED as e:
        print(f"dsflash {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dsflash {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
