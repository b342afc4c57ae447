"""Where a needle's recall breaks, in a trained checkpoint (issue 21's needle gate): for each needle prompt of
the quality report (dsflash/train/quality.py: the statement, `--distance` filler tokens, the cue), at the cue's
last position -- where the answer's first token is predicted -- and for every index layer:
- the compressed entries covering the needle's word: their rank in the main attention's own distribution over
  every visible entry (attention_target: what it would read if it could see all), and the weight it gives them;
- whether the indexer's top-k picks include them (what the attention can read);
and the model's probability of the word's first token. Recall needs all three: the attention wanting the
entry, the indexer picking it, and the head turning the read value into the word.

`python bench/experiments/needle_reach.py --model dsflash/checkpoint/trained` (CPU, about a minute).
"""

import argparse
from pathlib import Path

import torch

from dsflash.checkpoint.builtin import HELDOUT
from dsflash.checkpoint.reader import Checkpoint
from dsflash.model.attention import visible_entries
from dsflash.model.common import Selections
from dsflash.model.transformer import Debug, Tokens, Transformer
from dsflash.tokenizer import compressed_token_map, load_tokenizer
from dsflash.train.backend import Masters, TrainState, training_kernels
from dsflash.train.indexer import attention_target
from dsflash.train.quality import NEEDLE, NEEDLE_CUE, NEEDLE_WORDS, Heldout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=Path("dsflash/checkpoint/trained"))
    p.add_argument("--distance", type=int, default=1500)
    ns = p.parse_args()
    tok = load_tokenizer(ns.model)
    heldout = Heldout.read(ns.model / HELDOUT, tok)
    ckpt = Checkpoint(ns.model)
    masters = Masters(ckpt, "cpu")
    token_map, _ = compressed_token_map(tok)
    fill = heldout.filler[: ns.distance].astype("int64").tolist()
    print(f"# {ns.model}, needle at distance {ns.distance}: per index layer, at the cue's last position")
    print("# word | layer (ratio) | entries of the word | attention rank of the best / of visible | its weight"
          " | picked by the indexer | p(word's first token)")
    for word in NEEDLE_WORDS:
        head = tok.encode(NEEDLE.format(word=""), add_special_tokens=False).ids
        stated = tok.encode(NEEDLE.format(word=word), add_special_tokens=False).ids
        ids = [0, *tok.encode(NEEDLE.format(word=word) + "\n", add_special_tokens=False).ids, *fill,
               *tok.encode(NEEDLE_CUE, add_special_tokens=False).ids]
        word_ids = tok.encode(" " + word, add_special_tokens=False).ids
        # the word's positions: where the statement stops matching the statement without it
        start = 1 + next(i for i, (a, b) in enumerate(zip(stated, head, strict=False)) if a != b)
        span = range(start, start + len(word_ids))
        got = {}

        def indexer(attn, xs, qr, chunk, got=got):  # the index layer's own picks, recorded
            topk = attn.indexer.select(xs, qr, attn.kv_source, chunk, attn.rope)
            got[attn.layer] = (attn, qr, chunk.positions, topk)
            return topk

        model = Transformer(ckpt.args, masters, token_map, kernels=training_kernels(masters))
        state = TrainState(device="cpu")
        x = torch.tensor(ids)
        with torch.no_grad():
            logits = model.forward(state, Tokens(x), debug=Debug(select=Selections(picker=indexer))).logits
            prob = logits[-1].float().softmax(-1)[word_ids[0]].item()
            for layer, (attn, qr, positions, topk) in sorted(got.items()):
                entries = state.compressed[attn.kv_source].rows
                last = slice(len(ids) - 1, len(ids))
                visible = int(visible_entries(positions[last], attn.ratio))
                hidden = torch.arange(entries.size(0)) >= visible
                target = attention_target(attn, qr[last], positions[last], entries, hidden.unsqueeze(0))[0]
                covering = sorted({p // attn.ratio for p in span if (p + 1) // attn.ratio <= visible})
                order = torch.argsort(target, descending=True)
                ranks = [int((order == e).nonzero()) for e in covering]
                picked = any(e in set(topk[-1].tolist()) for e in covering)
                print(f"{word:10s} | {layer} ({attn.ratio}) | {covering} | {min(ranks)} / {visible} | "
                      f"{float(target[covering].sum()):.4f} | {picked} | {prob:.4f}")


if __name__ == "__main__":
    main()
