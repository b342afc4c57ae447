"""The trained model's tokenizer and token files: a byte-level BPE trained on the train split with the V4.1
markers (dsflash/tokenizer.train_bpe), and each split as one uint16 array (`{split}.tokens.npy`): every
document as BOS, its text, EOS.

The train split also gets chat turns cut from its own documents (a user asks for the continuation of a
passage, the assistant gives it, in the V4.1 chat template with thinking off), so that `dsflash chat`
prompts look like something the model has read.

And `facts.json`: made-up facts ("The lucky number of the young sailor is Rome.") with the cue that asks for
each again, which the trainer writes into its windows a few hundred to a couple of thousand tokens apart
(loop.Trainer.window): nothing in three old corpora asks a model to recall a fact stated windows and
compression groups back, which is what the needle gate measures. The gate's own needle (the lighthouse
keeper's password, train/quality.py) is in none of them: its subject, attribute and words are held out.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from dsflash.server.encoding import encode_messages
from dsflash.tokenizer import BOS_ID, EOS_ID, compressed_token_map, train_bpe
from dsflash.train.data import ENGRAM_MAP, FACTS, SPLITS, Document, read_split, sha256
from dsflash.train.quality import NEEDLE_WORDS

VOCAB_SIZE = 8192
CHAT_SHARE = 0.1  # of the train documents' lines, also rendered as chat turns
CHAT_LINES = 12  # lines a user turn quotes, and the assistant continues with
ASKS = ("Continue this text:\n\n", "What comes next?\n\n", "Please continue:\n\n", "Go on from here:\n\n")
FACT_COUNT = 8192
# the facts' parts; "secret", "password" and "lighthouse keeper" are the needle gate's and stay out
FACT_QUALITIES = ("lucky", "hidden", "true", "favourite", "old", "chosen", "first", "last", "missing", "private")
FACT_THINGS = ("number", "colour", "name", "word", "city", "key", "song", "river", "flower", "stone", "motto", "sign")
FACT_OWNERS = ("young sailor", "king's steward", "blind miller", "second daughter", "tall soldier", "village priest",
               "river pilot", "queen's gardener", "quiet scholar", "night watchman", "old shepherd", "court jester",
               "ship's cook", "travelling merchant", "duke's archer", "widow's son")
FACT_FORMS = (("The {q} {t} of the {o} is {w}.", "The {q} {t} of the {o} is"),
              ("Remember this: the {q} {t} of the {o} is {w}.", "So the {q} {t} of the {o} is"),
              ("Note that the {o}'s {q} {t} is {w}.", "The {o}'s {q} {t} is"))


def chat_turns(docs: list[Document], seed: int) -> list[str]:
    """Chat renderings of passages of `docs` (about CHAT_SHARE of their lines), chosen by `seed`."""
    rng = random.Random(seed)
    out = []
    for d in docs:
        lines = d.text.splitlines()
        for start in range(0, len(lines) - 2 * CHAT_LINES, 2 * CHAT_LINES):
            if rng.random() >= CHAT_SHARE:
                continue
            ask = "\n".join(lines[start:start + CHAT_LINES])
            answer = "\n".join(lines[start + CHAT_LINES:start + 2 * CHAT_LINES])
            if ask.strip() and answer.strip():
                messages = [{"role": "user", "content": rng.choice(ASKS) + ask},
                            {"role": "assistant", "content": answer}]
                out.append(encode_messages(messages, thinking=False, add_generation_prompt=False))
    return out


def answer_words(docs: list[Document]) -> list[str]:
    """Words a fact can name: alphabetic words of 4-10 letters from the prose of `docs` (not the needle gate's)."""
    held_out = {w.lower() for w in NEEDLE_WORDS}
    words = {w for d in docs if d.source != "python" for w in re.findall(r"\b[A-Za-z]{4,10}\b", d.text)}
    return sorted(w for w in words if w.lower() not in held_out)


def recall_facts(tokenizer: Tokenizer, words: list[str], n: int, seed: int) -> list[dict[str, list[int]]]:
    """n made-up facts as ids: the statement (ending in a newline), the cue (after a newline) and the answer (the
    word with its leading space, and the full stop)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        state, cue = rng.choice(FACT_FORMS)
        parts = {"q": rng.choice(FACT_QUALITIES), "t": rng.choice(FACT_THINGS), "o": rng.choice(FACT_OWNERS),
                 "w": rng.choice(words)}
        ids = [e.ids for e in tokenizer.encode_batch(
            [state.format(**parts) + "\n", "\n" + cue.format(**parts), f" {parts['w']}."], add_special_tokens=False)]
        out.append(dict(zip(("statement", "cue", "answer"), ids, strict=True)))
    return out


def encode_documents(tokenizer: Tokenizer, texts: list[str], framed: bool) -> np.ndarray:
    """The texts' ids, concatenated; `framed`: each as BOS, text, EOS (chat renderings carry their own)."""
    ids = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += [BOS_ID, *enc.ids, EOS_ID] if framed else enc.ids
    return np.asarray(ids, dtype=np.uint16)


def build(data_dir: Path, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> dict:
    """tokenizer.json and `{split}.tokens.npy` in data_dir (beside the splits), and their SHA-256s and the
    Engram class count in `tokens.json`."""
    data_dir = Path(data_dir)
    train = read_split(data_dir, "train")
    tokenizer = train_bpe([d.text for d in train], vocab_size, "the train split")
    tokenizer.save(str(data_dir / "tokenizer.json"))
    token_map, classes = compressed_token_map(tokenizer)
    # the trainer runs where `tokenizers` may be missing: it reads the map, not the tokenizer
    (data_dir / ENGRAM_MAP).write_text(json.dumps({"classes": classes, "map": token_map}) + "\n")
    info = {"vocab_size": vocab_size, "engram_classes": classes,
            "tokenizer_sha256": sha256((data_dir / "tokenizer.json").read_bytes()), "splits": {}}
    for split in SPLITS:
        docs = train if split == "train" else read_split(data_dir, split)
        ids = encode_documents(tokenizer, [d.text for d in docs], framed=True)
        if split == "train":
            ids = np.concatenate([ids, encode_documents(tokenizer, chat_turns(docs, seed), framed=False)])
        np.save(data_dir / f"{split}.tokens.npy", ids)
        info["splits"][split] = {"tokens": int(ids.size), "sha256": sha256(ids.tobytes())}
    facts = json.dumps(recall_facts(tokenizer, answer_words(train), FACT_COUNT, seed)).encode()
    (data_dir / FACTS).write_bytes(facts)
    info["facts"] = {"count": FACT_COUNT, "sha256": sha256(facts)}
    (data_dir / "tokens.json").write_text(json.dumps(info, indent=2) + "\n")
    return info

