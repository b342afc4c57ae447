"""Does a trained checkpoint copy? (issue 21: needles and DSpark acceptance both need it.) A segment of held-out
text, held-out Python or random ids is fed twice, with 0, 40 or 300 filler tokens between the copies; the mean
per-token loss on the second copy against the first says how much the model reads back what it saw. A model with
induction heads predicts most of a repeated segment (random ids included, whose first copy is unpredictable);
one without them gains only what the text's own statistics give, and nothing on random ids.

`python bench/experiments/induction.py --model dsflash/checkpoint/trained` (CPU, about a minute).
"""

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Tokens
from dsflash.tokenizer import load_tokenizer
from dsflash.train.quality import Heldout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("dsflash/checkpoint/trained"))
    ap.add_argument("--length", type=int, default=60, help="tokens a segment")
    ns = ap.parse_args()
    held = Heldout.read(ns.model / "heldout.npz", load_tokenizer(ns.model))
    model = load_model(ns.model, device="cpu")
    rng = np.random.default_rng(0)
    n = ns.length
    segments = {"text": held.filler[1000:1000 + n], "code": held.code[500:500 + n],
                "random ids": rng.integers(10, model.args.vocab_size - 10, n)}
    print(f"{ns.model}: mean loss (nats/token) on a {n}-token segment's first and second copy")
    print("| segment | gap | first copy | second copy |\n|---|---:|---:|---:|")
    for name, seg in segments.items():
        for gap in (0, 40, 300):
            ids = torch.tensor(np.concatenate([[0], seg, held.filler[5000:5000 + gap], seg]).astype(np.int64))
            with torch.no_grad():
                logits = model.forward(SequenceState(device=model.device), Tokens(ids[:-1])).logits
            loss = F.cross_entropy(logits.float(), ids[1:], reduction="none")
            print(f"| {name} | {gap} | {loss[:n - 1].mean():.2f} | {loss[-(n - 1):].mean():.2f} |", flush=True)


if __name__ == "__main__":
    main()
