"""Experiment (CPU is enough): is the drafter's acceptance in decoding what its training measures? For held-out
Python prompts the engine decodes greedily with DSpark drafts of a fixed depth (the quality gate's
measurement: accepted drafts a verify cycle). The prompt and its plain greedy continuation then go through
the trainer's forward and its teacher-forced drafts (train/loop.py `draft_logits`, as a DSpark training step
scores them) at every position of the continuation, and the drafts accepted per block are counted the same
way. In a block's accepted prefix both see the same tokens, so the two agree up to which positions start a
cycle (the same cycles replayed on the teacher-forced drafts give the measured acceptance back); a gap
beyond that is a mismatch between training and decoding.

`--cuts C...` replays the cycles with drafts cut at the first row whose confidence head is under C (ds4's
`--dspark-confidence`): accepted drafts a cycle against drafted ones.

`--drafters DIR...` scores more drafters of the same backbone (DSpark-only runs from it) teacher-forced on the same
continuations: a comparison of drafters without decoding each.

`PYTHONPATH=$PWD python3 bench/experiments/draft_gap.py [--prompts 4 --tokens 64] [--cuts 0.2 0.3 ...]
[--drafters RUN/checkpoint ...]`
"""

import argparse

import numpy as np
import torch

from dsflash.bench.drafts import python_prompts
from dsflash.checkpoint.builtin import HELDOUT, TRAINED
from dsflash.checkpoint.reader import Checkpoint
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import DecodeStats, decode
from dsflash.model.load import engram_token_map
from dsflash.model.transformer import Tokens, Transformer
from dsflash.train.backend import Masters, TrainState, training_kernels
from dsflash.train.loop import draft_logits


def teacher_forced(model_dir: str, runs: list[tuple[list[int], list[int]]], b: int
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """A checkpoint's drafts teacher-forced on (prompt, greedy continuation) pairs, an anchor at every position of
    each continuation from the prompt's last token: per pair, whether each block row's draft is its label and the
    confidence head's sigmoid there ([anchors, b] each), and the share of the continuations' tokens the trainer's
    forward predicts too."""
    ckpt = Checkpoint(model_dir)
    masters = Masters(ckpt, "cpu")
    model = Transformer(ckpt.args, masters, engram_token_map(ckpt.path, ckpt.args), kernels=training_kernels(masters))
    rights, confidences, agree = [], [], []
    for ids, plain in runs:
        x = torch.tensor(ids + plain)
        with torch.no_grad():
            out = model.forward(TrainState(device="cpu"), Tokens(x))
            greedy = out.logits.argmax(-1)
            # the trainer's forward gives the engine's greedy tokens where the continuation was decoded
            agree.append(float((greedy[len(ids) - 1:-1] == x[len(ids):]).float().mean()))
            anchors = torch.arange(len(ids) - 1, x.numel() - b)
            logits, y, embeds, labels = draft_logits(model, masters, out.main_hidden, x, greedy, anchors)
            confidence = model.k.linear(torch.cat([y, embeds], dim=-1).float(), model.dspark.confidence)[:, 0]
        rights.append((logits.argmax(-1) == labels).view(-1, b))
        confidences.append(torch.sigmoid(confidence).view(-1, b))
    return rights, confidences, float(np.mean(agree))


def cycles(rights: list[torch.Tensor], confidences: list[torch.Tensor], tokens: int, cut: float = 0.0
           ) -> list[tuple[int, int]]:
    """Decoding's cycles replayed on teacher-forced drafts, (drafted, accepted) each: the first anchor is the first
    token decoded (the prefill's logits gave it: row 1 of `teacher_forced`'s); a cycle drafts a block's rows up to
    the first whose confidence is under `cut`, accepts them up to the first wrong one, and the target's own next
    token moves the anchor on past the accepted ones."""
    out = []
    for right, confidence in zip(rights, confidences, strict=True):
        lead = right.long().cumprod(1).sum(1)
        drafted = (confidence >= cut).long().cumprod(1).sum(1)
        q = 1
        while q < tokens:
            k = int(drafted[q])
            out.append((k, min(int(lead[q]), k)))
            q += out[-1][1] + 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(TRAINED))
    p.add_argument("--heldout", default=str(TRAINED / HELDOUT))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--cuts", type=float, nargs="*", default=[],
                   help="confidence cuts to replay --model's cycles with (a cycle drafts the rows up to the first "
                        "whose confidence head's sigmoid is under the cut), and its calibration by tenths")
    p.add_argument("--drafters", nargs="*", default=[],
                   help="more checkpoints with --model's backbone (a DSpark-only run from it): their drafts "
                        "teacher-forced on the same continuations")
    ns = p.parse_args()
    engine = Engine.load(ns.model)
    with np.load(ns.heldout) as f:
        prompts = python_prompts(f["code"], ns.prompts, ns.prompt_len)
    b = engine.args.dspark_block_size
    stats, runs = DecodeStats(), []
    for ids in prompts:
        s = engine.session()
        # b more tokens than drafted: labels for the last cycles' blocks
        plain = list(decode(s, s.prefill(ids), ns.tokens + b, SamplingParams(), stop=set()))
        s = engine.session()
        drafted = list(decode(s, s.prefill(ids), ns.tokens, SamplingParams(), stop=set(), dspark=b, stats=stats,
                              adaptive=False))
        assert drafted == plain[:ns.tokens]
        runs.append((ids, plain))
    print(f"{ns.prompts} prompts x {ns.tokens} tokens, depth {b}")
    print(f"decoding: {stats.accept_rate:.4f} of drafts accepted, {stats.tokens_per_cycle:.3f} tokens a cycle "
          f"({stats.tokens_per_cycle - 1:.3f} drafts accepted a cycle)")
    for model_dir in [ns.model, *ns.drafters]:
        rights, confidences, agree = teacher_forced(model_dir, runs, b)
        right, replayed = torch.cat(rights).float(), cycles(rights, confidences, ns.tokens)
        taught = float(right.cumprod(dim=1).sum(dim=1).mean())
        print(f"{model_dir}: trainer's greedy == engine's on the continuations {agree:.4f}; teacher-forced, at "
              f"decoding's cycle anchors: {np.mean([a for _, a in replayed]):.3f} drafts accepted a cycle "
              f"({len(replayed)} cycles; decoding had {stats.cycles}); every position: {taught:.3f} a block "
              f"({taught / b:.4f} of drafts); each slot right: {[round(float(v), 3) for v in right.mean(0)]}, "
              f"given the slots before it: {[round(float(v), 3) for v in right.cumprod(1).mean(0)]}")
        if model_dir != ns.model or not ns.cuts:
            continue
        confidence = torch.cat(confidences)
        for lo in np.arange(0.0, 1.0, 0.1):
            rows = (confidence >= lo) & (confidence < lo + 0.1)
            print(f"  confidence {lo:.1f}-{lo + 0.1:.1f}: {int(rows.sum())} rows, {float(right[rows].mean()):.3f} right"
                  if rows.any() else f"  confidence {lo:.1f}-{lo + 0.1:.1f}: no rows")
        for cut in ns.cuts:
            replayed = cycles(rights, confidences, ns.tokens, cut)
            drafted, accepted = (sum(v) for v in zip(*replayed, strict=True))
            depths = np.bincount([k for k, _ in replayed], minlength=b + 1).tolist()
            print(f"  cut {cut:.2f}: {drafted / len(replayed):.3f} drafted and {accepted / len(replayed):.3f} "
                  f"accepted a cycle ({accepted / max(drafted, 1):.3f} of drafts), {len(replayed)} cycles by drafts "
                  f"{depths}")

if __name__ == "__main__":
    main()
