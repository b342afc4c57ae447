"""The built-in checkpoint `dsflash serve` uses when no model is given: Tiny-A geometry (every V4.1
block type once, the golden configuration) with seeded weights and a small trained tokenizer, so text
works end to end. Made once into a cache directory; the same seed always gives the same bytes."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from dsflash.checkpoint.make import make_with_tokenizer
from dsflash.config import PRESETS

BUILTIN_SEED = 0


def builtin_checkpoint(root: str | Path | None = None) -> Path:
    root = Path(root or os.environ.get("DSFLASH_HOME", Path.home() / ".cache" / "dsflash"))
    out = root / f"builtin-tiny-a-s{BUILTIN_SEED}-v3"  # v3: the manifest says "seeded"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    # the preset's max_seq_len sized DeepSeek's reference caches; our state grows, so allow real chats
    made = make_with_tokenizer(dataclasses.replace(PRESETS["tiny-a"], max_seq_len=16384), BUILTIN_SEED, out)
    assert made is not None  # tiny-a's 512 ids are within the tiny corpus's range
    return made
