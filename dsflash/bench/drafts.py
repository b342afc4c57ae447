"""`dsflash bench dspark`: what DSpark drafts buy a trained checkpoint -- greedy decoding of held-out Python
prompts plainly and with drafts of up to `depth`, the outputs checked token-identical, acceptance, tokens
per verify cycle and both decode rates. The trained model's quality gates (dsflash/train/quality.py) hold the
acceptance to a bound; this writes the speed to bench/results/ with the machine and the commit."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dsflash.bench.common import command, commit, machine
from dsflash.checkpoint.builtin import HELDOUT, TRAINED
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import DecodeStats, decode

WARMUP_TOKENS = 24  # of one prompt, each way, before timing: kernels compiled, CUDA graphs captured


@dataclass
class Drafting:
    prompts: int
    generated: int
    accept_rate: float
    tokens_per_cycle: float
    plain_s: float
    dspark_s: float
    identical: bool  # every prompt's drafted output equals its plain decoding
    depths: dict[int, int]  # the drafted decodes' cycles by how many drafts each verified (DraftDepth's choices)

    @property
    def speedup(self) -> float:
        return self.plain_s / self.dspark_s if self.dspark_s else 0.0


def drafting(engine: Engine, prompts: list[list[int]], n: int, depth: int, adaptive: bool = True) -> Drafting:
    """Greedy decoding of each prompt plainly and with DSpark drafts of up to `depth` (exactly `depth` when not
    `adaptive`, spec.FixedDepth): acceptance, tokens per verify cycle, both decode times (prefills not
    counted), and whether the outputs are token-identical."""
    stats, identical, times = DecodeStats(), True, [0.0, 0.0]
    for ids in prompts:
        outputs = []
        for i, k in enumerate((0, depth)):
            s = engine.session()
            first = s.prefill(ids)
            t0 = time.perf_counter()
            outputs.append(list(decode(s, first, n, SamplingParams(), stop=set(), dspark=k,
                                       stats=stats if k else None, adaptive=adaptive)))
            times[i] += time.perf_counter() - t0
            s.close()  # as the server does: the next session takes its buffers (and their CUDA graphs)
        identical &= outputs[0] == outputs[1]
    return Drafting(len(prompts), stats.generated, stats.accept_rate, stats.tokens_per_cycle, times[0], times[1],
                    identical, dict(sorted(stats.depths.items())))


def python_prompts(tokens: np.ndarray, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, evenly spaced through a split's tokens."""
    starts = np.linspace(0, tokens.size - length - 1, count).astype(int)
    return [tokens[s:s + length].astype(np.int64).tolist() for s in starts]


def run(ns: argparse.Namespace) -> int:
    engine = Engine.load(ns.model, device=ns.device)
    with np.load(ns.data) as f:
        prompts = python_prompts(f["code"], ns.prompts, ns.prompt_len)
    drafting(engine, prompts[:1], WARMUP_TOKENS, max(ns.depths))
    r = {"date": time.strftime("%Y-%m-%d"), "gpu": machine(ns.device), "commit": commit(), "torch": torch.__version__,
         "command": command(sys.argv[2:]), "model": str(ns.model), "device": ns.device,
         "prompts": ns.prompts, "prompt_len": ns.prompt_len, "tokens": ns.tokens, "depths": {}}
    for depth in ns.depths:
        d = drafting(engine, prompts, ns.tokens, depth)
        r["depths"][depth] = {**asdict(d), "speedup": d.speedup,
                              "plain_tok_s": d.generated / d.plain_s, "dspark_tok_s": d.generated / d.dspark_s}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"engine-dspark-{ns.device.split(':')[0]}-{r['date']}"
    stem.with_suffix(".json").write_text(json.dumps(r, indent=1))
    stem.with_suffix(".md").write_text(to_markdown(r))
    print(to_markdown(r))
    return 0 if all(d["identical"] for d in r["depths"].values()) else 1


def to_markdown(r: dict) -> str:
    lines = [f"# DSpark drafts on {r['model']}", "",
             f"{r['gpu']}, commit {r['commit']}, torch {r['torch']}: `{r['command']}`", "",
             f"Greedy decoding of {r['prompts']} held-out Python prompts of {r['prompt_len']} tokens, {r['tokens']} "
             "new tokens each, plainly and with drafts (prefills not timed).", "",
             "| depth | accepted | tokens/cycle | plain tok/s | DSpark tok/s | speed-up | identical "
             "| cycles by drafts |",
             "|---|---|---|---|---|---|---|---|"]
    for depth, d in r["depths"].items():
        lines.append(f"| {depth} | {d['accept_rate']:.1%} | {d['tokens_per_cycle']:.2f} | {d['plain_tok_s']:.1f} | "
                     f"{d['dspark_tok_s']:.1f} | {d['speedup']:.2f}x | {d['identical']} | "
                     + " ".join(f"{k}: {n}" for k, n in d["depths"].items()) + " |")
    return "\n".join(lines) + "\n"


def add_parser(bsub: argparse._SubParsersAction) -> None:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    p = bsub.add_parser("dspark", help="decode speed-up from DSpark drafts on a trained checkpoint")
    p.add_argument("--model", type=Path, default=TRAINED, help="checkpoint (default: the built-in trained one)")
    p.add_argument("--data", type=Path, default=TRAINED / HELDOUT,
                   help="a held-out sample with a 'code' part (default: the built-in checkpoint's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--prompts", type=int, default=8, help="prompts")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--depths", type=ints, default=[4], help="draft depths, comma-separated")
    p.add_argument("--out", default="bench/results", help="directory for the results (.json, .md)")
    p.set_defaults(func=run)
