"""Does a model learn to copy inside its window, and how soon? (issue 21: needles need copying.) Windows of random
ids (`--ids` of them; a list with `--switch` or `--mix` is a curriculum) or of the train text (`--background text`)
in which the trainer's repeats of random ids (`Trainer.write_repeats`, `--repeat-ids`, `--repeat-vocab`) make
`--share` of the tokens copies of a passage 8 to window/2 tokens after it, so only copying predicts them; greedy
copy accuracy (chance: 1/ids; one figure an id count, over its last 25 windows) and loss every 25 steps, for the
trained schedule at smoke width (`--model v41`, its own window `--window`) or a plain pre-norm GPT of the same
width on the same windows (`--model plain`, 4 layers, learnt positions, full causal attention), both with the
trainer's AdamW and schedule.

`PYTHONPATH=$PWD python bench/experiments/copy_probe.py --data .train-data --model plain --ids 64 --batch 32` (CPU).
"""

import argparse
import collections
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from dsflash.train import data
from dsflash.train.loop import Plan, Trainer, learning_rate, smoke_args


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int = 4, heads: int = 4, positions: int = 4096):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        h = (self.embed(x) + self.pos(torch.arange(n)))[None]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path(".train-data"), help="for the vocabulary and Engram map")
    ap.add_argument("--model", choices=("v41", "plain"), default="v41")
    ap.add_argument("--ids", type=lambda v: [int(x) for x in v.split(",")], default=[64],
                    help="distinct ids the windows are drawn from; a list (64,1024) is a curriculum: the next count "
                         "from each of --switch's steps on, or with --mix each window's count drawn from the list")
    ap.add_argument("--switch", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="steps at which --ids moves to its next count")
    ap.add_argument("--mix", action="store_true", help="each window's id count drawn uniformly from --ids")
    ap.add_argument("--seq", type=int, default=256, help="tokens a window")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=1, help="windows a step (plain only)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--window", type=int, default=64, help="the V4.1 model's attention window")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--share", type=float, default=0.5, help="of a window's tokens, copies")
    ap.add_argument("--task", choices=("repeats", "twice"), default="repeats")
    ap.add_argument("--gaps", action="store_true",
                    help="--task twice: the trainer's copy warm-up, the gap between a passage and its copy grown "
                         "by the curriculum (Trainer.twice_gap) as the copies are learnt")
    ap.add_argument("--repeat-ids", choices=("window", "vocabulary"), default="window",
                    help="--task repeats: a passage's ids drawn from the window or from the background's distinct ids")
    ap.add_argument("--repeat-vocab", type=int, default=0,
                    help="--repeat-ids vocabulary: the trainer's id curriculum (Plan.repeat_vocab) from this many ids")
    ap.add_argument("--reach", type=int, default=0,
                    help="--task repeats: the longest gap from a passage to its copy (default: half the window; "
                         "beyond the window, copies are read from the compressed entries)")
    ap.add_argument("--copy-warmup", type=float, default=0.0,
                    help="--task repeats with --repeat-ids vocabulary: the trainer's copy warm-up (Plan.copy_warmup, "
                         "its gap grown by the curriculum) over this share of the steps, then the repeats")
    ap.add_argument("--background", choices=("ids", "text"), default="ids",
                    help="windows of random ids (--ids of them) or of the train text")
    ns = ap.parse_args()
    torch.manual_seed(0)
    token_map, classes = data.load_engram_map(ns.data)
    args = dataclasses.replace(smoke_args(len(token_map), classes), window_size=ns.window, dim=ns.dim)
    twice = ns.task == "twice"  # the trainer's copy warm-up windows (`twice_window`) over the stream's distinct ids
    stream = (data.load_tokens(ns.data, "train") if ns.background == "text"
              else np.random.default_rng(0).integers(10, 10 + (max(ns.ids) if twice else ns.ids[0]), 2_000_000))
    plan = Plan(seq_len=ns.seq, fact_span=0, index_rows=0, repeat_share=ns.share,
                repeat_reach=ns.reach or ns.window // 2, repeat_ids="vocabulary" if twice else ns.repeat_ids,
                repeat_vocab=ns.repeat_vocab, copy_warmup=float(ns.gaps) if twice else ns.copy_warmup, lr=ns.lr,
                steps=ns.steps, graphs=False)
    trainer = Trainer(args, token_map, stream, stream[:10_000], plan, "cpu")
    plain = PlainGPT(len(token_map), ns.dim) if ns.model == "plain" else None
    params = list(plain.parameters()) if plain else trainer.masters.trainable()
    opt = torch.optim.AdamW(params, lr=ns.lr, betas=(0.9, 0.95), weight_decay=0.1)
    started, hits = time.time(), collections.defaultdict(list)
    rng = np.random.default_rng(1)

    def ids_at(step: int) -> int:
        if ns.mix:
            return int(rng.choice(ns.ids))
        return ns.ids[sum(step >= s for s in ns.switch)]

    def window(step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A window, the positions whose next token is a copy, and the count of ids it was drawn from."""
        if not twice:
            x, _, copies, _ = trainer.window(step / ns.steps)
            return x, copies, ns.ids[0] if trainer.repeat_vocab is None else trainer.repeat_vocab
        trainer.repeat_vocab = ids_at(step)
        x, _, copies, _ = trainer.twice_window(rng)
        return x, copies, trainer.repeat_vocab

    for step in range(ns.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(ns.lr, step, step / ns.steps, 30)
        x, copies, ids = window(step)
        if plain:
            logits = plain(x[:-1])
            loss = F.cross_entropy(logits, x[1:])
            (loss / ns.batch).backward()
            for _ in range(ns.batch - 1):
                xb = window(step)[0]
                (F.cross_entropy(plain(xb[:-1]), xb[1:]) / ns.batch).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
        else:
            loss, _, logits, loads = trainer.window_loss(x, torch.zeros(x.numel() - 1),
                                                         torch.zeros(0, dtype=torch.int64), False)
            trainer._update(opt, params, loads)
        hits[ids].append(float((logits[copies].argmax(-1) == x[1:][copies]).float().mean()) if copies.numel() else 0.0)
        if ns.repeat_vocab and not twice or ns.gaps:
            trainer.grow_copy_curriculum(hits[ids][-1])
        if (step + 1) % 25 == 0:
            accuracy = " ".join(f"{np.mean(h[-25:]):.3f}" for h in hits.values() if h)
            gap = f" gap {trainer.twice_gap}" if ns.gaps else ""
            if ns.copy_warmup:
                gap = f" gap {trainer.twice_gap} ({'warm-up' if trainer.warming else 'repeats'})"
            print(f"{ns.model} step {step + 1} ids {ids}{gap} loss {float(loss):.3f} copy accuracy {accuracy} "
                  f"{time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
