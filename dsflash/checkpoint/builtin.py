"""The built-in checkpoint `dsflash serve` and `dsflash generate` use when no model is given.

It is the trained small V4.1 model shipped inside the package (`TRAINED`, dsflash/checkpoint/trained/,
package data: `python3 -m dsflash.train.ship` puts a training run's checkpoint there, with `SHA256SUMS` of
every file, written last) when that directory holds a complete one: every file its `SHA256SUMS` lists with
that digest, no file it does not list, and weights that open against config.json (the index, every shard's
header, every tensor's name, dtype and shape). A damaged or partial one is refused with the reason.

Otherwise (none shipped, or refused) it is the seeded one: Tiny-A geometry (every V4.1 block type once, the
golden configuration) with seeded weights and a small trained tokenizer, so text works end to end, though
as noise. Made once into a cache directory; the same seed always gives the same bytes. Either way one line on
stderr says which model it is and why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

from dsflash.checkpoint.make import make_with_tokenizer
from dsflash.checkpoint.reader import CheckpointError, open_checkpoint
from dsflash.config import PRESETS, ConfigError

BUILTIN_SEED = 0
TRAINED = Path(__file__).with_name("trained")
SUMS = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` in the directory checks it too
HELDOUT = "heldout.npz"  # the test-split sample the quality gates and `bench dspark` read (train/quality.py)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write_sums(path: Path) -> Path:
    """`path/SHA256SUMS`: every other file of the directory, in sha256sum's format."""
    files = sorted(f.name for f in path.iterdir() if f.is_file() and f.name != SUMS)
    out = path / SUMS
    out.write_text("".join(f"{file_digest(path / name)}  {name}\n" for name in files))
    return out


def shipped(path: Path) -> bool:
    """Whether a trained checkpoint was put at `path` at all (complete or not: see `check_trained`)."""
    return path.is_dir() and any(path.iterdir())


def check_trained(path: Path) -> None:
    """Refuse (CheckpointError, with the reason) a shipped checkpoint that is not complete and intact."""
    try:
        lines = (path / SUMS).read_text().splitlines()
    except OSError as e:
        raise CheckpointError(f"{path}: no readable {SUMS} (an interrupted copy?): {e}") from e
    listed = {}
    for line in lines:
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name or "/" in name:
            raise CheckpointError(f"{path / SUMS}: not a line of sha256sum's format: {line!r}")
        listed[name] = digest
    present = {f.name for f in path.iterdir()} - {SUMS}
    if present - listed.keys():
        raise CheckpointError(f"{path}: {sorted(present - listed.keys())[0]} is not listed in {SUMS}")
    for name, digest in sorted(listed.items()):
        if name not in present:
            raise CheckpointError(f"{path}: {name} is missing ({SUMS} lists it)")
        if file_digest(path / name) != digest:
            raise CheckpointError(f"{path / name}: damaged: its SHA-256 differs from the one {SUMS} lists")
    try:
        open_checkpoint(path)
    except ConfigError as e:  # config.json itself (load_config)
        raise CheckpointError(f"{path}: {e}") from e


def seeded_checkpoint(root: str | Path | None = None) -> Path:
    """The seeded Tiny-A checkpoint, made under `root` (default $DSFLASH_HOME or ~/.cache/dsflash) once."""
    root = Path(root or os.environ.get("DSFLASH_HOME", Path.home() / ".cache" / "dsflash"))
    out = root / f"builtin-tiny-a-s{BUILTIN_SEED}-v3"  # v3: the manifest says "seeded"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    # the preset's max_seq_len sized DeepSeek's reference caches; our state grows, so allow real chats
    made = make_with_tokenizer(dataclasses.replace(PRESETS["tiny-a"], max_seq_len=16384), BUILTIN_SEED, out)
    assert made is not None  # tiny-a's 512 ids are within the tiny corpus's range
    return made


def builtin_checkpoint(root: str | Path | None = None) -> Path:
    """The shipped trained checkpoint when it is complete, else the seeded one (made under `root`); one line
    on stderr says when and why it is the seeded one."""
    if shipped(TRAINED):
        try:
            check_trained(TRAINED)
            return TRAINED
        except CheckpointError as e:
            why = f"the trained checkpoint is refused: {e}"
    else:
        why = f"no trained checkpoint is shipped in {TRAINED}"
    print(f"dsflash: {why}; using the seeded random Tiny-A instead (its text is noise)", file=sys.stderr)
    return seeded_checkpoint(root)
