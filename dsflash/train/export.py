"""The trained masters as a checkpoint in the official layout: every tensor of `expected_tensors` in its stored
format (FP8 tiles, FP4 rows, FP8 Engram rows with their E8M0 scales, BF16, F32) -- the formats the training
forward re-quantised to at every step -- with config.json and the weight manifest."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.make import write_tensors
from dsflash.checkpoint.manifest import write_manifest
from dsflash.config import ModelArgs
from dsflash.train.backend import PLAIN, Masters, quantised


def stored_tensors(masters: Masters) -> dict[str, torch.Tensor]:
    """name -> the tensor as the checkpoint stores it (on the CPU)."""
    out = {}
    with torch.no_grad():
        for name, master in masters.params.items():
            kind = masters.kinds[name]
            if kind == PLAIN:
                out[name] = master.detach().to(masters.stored_dtype[name]).cpu()
                continue
            codes, scale = quantised(kind, master.detach())
            out[name] = codes.view(masters.stored_dtype[name]).cpu()
            out[name[: -len("weight")] + "scale"] = scale.view(torch.float8_e8m0fnu).cpu()
    return out


def export_weights(masters: Masters, args: ModelArgs, out_dir: Path) -> Path:
    """Write model.safetensors, config.json and model.manifest.json into out_dir (the caller adds the
    tokenizer.json the model was trained with)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = stored_tensors(masters)
    expected = expected_tensors(args)
    missing = sorted(set(expected) ^ set(tensors))
    if missing:
        raise ValueError(f"the masters and the config disagree on tensor {missing[0]!r} ({len(missing)} such)")
    write_tensors(out / "model.safetensors", expected, {name: tensors[name] for name in expected})
    (out / "config.json").write_text(json.dumps(args.to_dict(), indent=2) + "\n")
    write_manifest(out)
    return out
