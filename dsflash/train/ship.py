"""Ship a training run's checkpoint as the built-in one (issue 21 item 4):

    python3 -m dsflash.train.ship build/trained --data build/train-data

checks the run's checkpoint (the weights against their manifest, the tokenizer against the data's and its
V4.1 markers as single ids, a CPU reference forward and a short greedy continuation of a prompt), then copies
it into the package (checkpoint.builtin.TRAINED, dsflash/checkpoint/trained/) with the run's train.json, a
held-out sample of the test split for the quality gates (builtin.HELDOUT) and SHA256SUMS of every file,
written last. The copy is made beside the old one and checked as the built-in loader checks it before it
replaces it, so an interrupted ship leaves the old one (or none), never half of each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

from dsflash.checkpoint import builtin
from dsflash.checkpoint.builtin import HELDOUT
from dsflash.checkpoint.manifest import MANIFEST, verify_weights
from dsflash.checkpoint.reader import INDEX, Checkpoint, CheckpointError
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import decode
from dsflash.tokenizer import BOS_ID, SPECIAL_TOKENS, load_tokenizer
from dsflash.train.quality import Heldout

PROMPT = "To be, or not to be, that is the question:\n"
CONTINUATION = 24  # greedy tokens shown after PROMPT


class ShipError(Exception):
    """The run's checkpoint cannot be shipped; the message says why."""


def check(ckpt: Path, data_dir: Path) -> str:
    """Refuse (ShipError, CheckpointError) a checkpoint that cannot be the built-in one; returns the greedy
    continuation of PROMPT (for a person to read)."""
    verify_weights(ckpt)
    if builtin.file_digest(ckpt / "tokenizer.json") != builtin.file_digest(data_dir / "tokenizer.json"):
        raise ShipError(f"{ckpt}/tokenizer.json is not {data_dir}/tokenizer.json: the held-out sample's ids "
                        "would stand for other text")
    tokenizer = load_tokenizer(ckpt)
    engine = Engine.load(ckpt, max_context=256, device="cpu")
    if tokenizer.get_vocab_size() != engine.args.vocab_size:
        raise ShipError(f"{ckpt}: tokenizer.json has {tokenizer.get_vocab_size()} ids, config.json's vocab_size "
                        f"is {engine.args.vocab_size}")
    for i, (token, _) in enumerate(SPECIAL_TOKENS):  # the chat encoding's markers must stay whole
        ids = tokenizer.encode(token, add_special_tokens=False).ids
        if ids != [i]:
            raise ShipError(f"{ckpt}/tokenizer.json: {token!r} encodes as {ids}, expected the single id {i}")
    s = engine.session()
    logits = s.prefill([BOS_ID, *tokenizer.encode(PROMPT, add_special_tokens=False).ids])
    if not bool(torch.isfinite(logits).all()):
        raise ShipError(f"{ckpt}: the forward of a short prompt gives non-finite logits")
    return tokenizer.decode(list(decode(s, logits, CONTINUATION, SamplingParams(), stop=set())))


def ship(ckpt: Path, data_dir: Path, dest: Path) -> str:
    """Check `ckpt` and put it at `dest` (see the module's docstring); returns `check`'s continuation."""
    ckpt, dest = Path(ckpt), Path(dest)
    text = check(ckpt, data_dir)
    weights = Checkpoint(ckpt)
    files = sorted({weights.file_of(name) for name in weights.names()})
    files += [name for name in (INDEX, "config.json", MANIFEST, "tokenizer.json") if (ckpt / name).is_file()]
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in files:
        shutil.copyfile(ckpt / name, partial / name)
    if (ckpt.parent / "train.json").is_file():  # the run's summary: parameters, steps, time, NLLs
        shutil.copyfile(ckpt.parent / "train.json", partial / "train.json")
    Heldout.from_data(data_dir, load_tokenizer(ckpt)).sample().save(partial / HELDOUT)
    builtin.write_sums(partial)
    builtin.check_trained(partial)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(partial, dest)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m dsflash.train.ship", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the training run's --out directory (or its checkpoint/)")
    parser.add_argument("--data", required=True, type=Path, help="the directory `dsflash train-data` wrote")
    parser.add_argument("--dest", type=Path, default=builtin.TRAINED, help="where it goes (default: the package's)")
    ns = parser.parse_args(argv)
    ckpt = ns.run / "checkpoint" if (ns.run / "checkpoint").is_dir() else ns.run
    try:
        text = ship(ckpt, ns.data, ns.dest)
    except (ShipError, CheckpointError, OSError) as e:
        print(f"dsflash ship: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in ns.dest.iterdir())
    print(f"shipped {ckpt} to {ns.dest}: {len(list(ns.dest.iterdir()))} files, {size:,} bytes; greedy after "
          f"{PROMPT!r}: {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
