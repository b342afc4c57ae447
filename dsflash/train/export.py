"""The trained masters as a checkpoint in the official layout: every tensor of `expected_tensors` in its stored
format (FP8 tiles, FP4 rows, FP8 Engram rows with their E8M0 scales, BF16, F32) -- the formats the training
forward re-quantised to at every step -- with config.json and the weight manifest. The weights are cut into
shards of at most a given size (`model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`, as the
released checkpoint ships), so that a run's output comes back from the GPU machine file by file, within its
per-file limit, and is committed as it is."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.make import split_at_most, write_shards, write_tensors
from dsflash.checkpoint.manifest import write_manifest
from dsflash.config import ModelArgs
from dsflash.train.backend import PLAIN, Masters

SHARD_BYTES = 15 << 20  # under the 16 MiB a file may have to come back from the GPU machine


def stored_tensors(masters: Masters) -> dict[str, torch.Tensor]:
    """name -> the tensor as the checkpoint stores it (on the CPU)."""
    out = {}
    with torch.no_grad():
        for name, master in masters.params.items():
            if masters.kinds[name] == PLAIN:
                out[name] = master.detach().to(masters.stored_dtype[name]).cpu()
                continue
            out[name], out[name[: -len("weight")] + "scale"] = masters.stored(name)
    return out


def export_weights(masters: Masters, args: ModelArgs, out_dir: Path, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the weights (shards of at most `shard_bytes` each; one model.safetensors when they fit in one),
    config.json and model.manifest.json into out_dir (the caller adds the tokenizer.json the model was trained
    with). Raises ConfigError when one tensor alone is larger than `shard_bytes`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = stored_tensors(masters)
    expected = expected_tensors(args)
    missing = sorted(set(expected) ^ set(tensors))
    if missing:
        raise ValueError(f"the masters and the config disagree on tensor {missing[0]!r} ({len(missing)} such)")
    write_shards(out, split_at_most(expected, shard_bytes), lambda path, part: write_tensors(path, part, tensors))
    (out / "config.json").write_text(json.dumps(args.to_dict(), indent=2) + "\n")
    write_manifest(out, thinks=False)  # its chat turns are all rendered with thinking off (vocab.chat_turns)
    return out
