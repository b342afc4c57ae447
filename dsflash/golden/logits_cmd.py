"""`dsflash logits`: run prompts through the model and write every position's logits and hand-off, so
anyone can compare this engine with another implementation without our checker."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from dsflash.golden.adapter import selections_from_arrays
from dsflash.golden.case import load_case, replay_selections
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Debug


def read_prompts(path: Path) -> tuple[list[list[int]], bool]:
    """A JSON array of ids, or an array of such arrays; returns (sequences, is_batch)."""
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON array of token ids or of arrays of ids")
    batch = isinstance(data[0], list)
    seqs = data if batch else [data]
    for n, s in enumerate(seqs):
        if not s or not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
            raise ValueError(f"{path}: sequence {n} must be a non-empty array of integer token ids")
    if batch and len({len(s) for s in seqs}) != 1:
        raise ValueError(f"{path}: batch sequences must have equal lengths to form [B, T, V]")
    return seqs, batch


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    seqs, batch = read_prompts(Path(args.prompt_tokens))
    vocab = model.args.vocab_size
    for n, s in enumerate(seqs):
        bad = [t for t in s if not 0 <= t < vocab]
        if bad:
            raise SystemExit(f"error: sequence {n} has token ids outside [0, {vocab}): {bad[:5]}")
    case, prefix = None, "full."
    if args.replay:
        case_dir, _, p = args.replay.partition(":")
        case, prefix = load_case(case_dir), p or "full."
    outs = []
    for n, s in enumerate(seqs):
        select = None
        if case is not None:
            seq = n if prefix.startswith("battery") else None
            select = selections_from_arrays(replay_selections(case, prefix, seq=seq))
        state, ids, parts = SequenceState(), torch.tensor(s), []
        step = args.chunk or len(s)
        for i in range(0, len(s), step):
            parts.append(model.forward(state, ids[i:i + step], debug=Debug(select)))
        outs.append({
            "logits": torch.cat([p.logits for p in parts]).numpy(),
            "handoff_streams": torch.cat([p.handoff_streams for p in parts]).float().numpy(),
            "handoff_pre_mix": torch.cat([p.handoff_pre_mix for p in parts]).numpy(),
        })
    arrays = {k: np.stack([o[k] for o in outs]) if batch else outs[0][k] for k in outs[0]}
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in arrays.items()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logits", help="write logits and hand-off of every position to a safetensors file")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--prompt-tokens", required=True, help="JSON array of ids, or an array of such arrays")
    p.add_argument("--out", required=True, help="output .safetensors")
    p.add_argument("--replay", help="CASE_DIR[:PREFIX]: force the selections stored in a golden case")
    p.add_argument("--chunk", type=int, default=0, help="process each sequence in chunks of N rows")
    p.set_defaults(func=run)
