"""The trained model's quality gates, measured through the engine's own loading and decoding (issue 21
item 5): test-split NLL per token, a needle recalled from several windows and compression groups back, and
DSpark acceptance on held-out Python with the output checked token-identical to plain decoding.
`dsflash quality` prints them; tests/test_quality.py holds them to bounds.

They read the test split of `dsflash train-data`, or a sample of it (`checkpoint.builtin.HELDOUT`) that ships
beside the built-in checkpoint, so that the gates run on a fresh clone with no download. The drafting
measurement is `dsflash bench dspark`'s (bench/drafts.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dsflash.bench.drafts import drafting, python_prompts
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import decode
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Tokens

NEEDLE = "The secret password of the old lighthouse keeper is {word}."
NEEDLE_CUE = "\nThe secret password of the old lighthouse keeper is"
NEEDLE_WORDS = ("marigold", "Tuesday", "copper", "Jonathan", "seventeen")
SAMPLE_TOKENS = 16384  # of each part of a sample: 32 KB of uint16 ids (the gates read at most 8K of each)


@dataclass
class Heldout:
    """What the gates read of the test split, as token ids: the split itself (NLL), its Shakespeare as one text
    (the needles' filler) and its Python as one text (the drafting prompts)."""

    tokens: np.ndarray
    filler: np.ndarray
    code: np.ndarray

    @classmethod
    def from_data(cls, data_dir: Path, tokenizer) -> Heldout:
        from dsflash.train.data import load_tokens, read_split

        docs = read_split(data_dir, "test")

        def ids(source: str) -> np.ndarray:
            text = "\n".join(d.text for d in docs if d.source == source)
            return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.uint16)

        return cls(load_tokens(data_dir, "test"), ids("shakespeare"), ids("python"))

    @classmethod
    def read(cls, path: Path, tokenizer) -> Heldout:
        """A `dsflash train-data` directory's test split, or a saved sample (a file)."""
        path = Path(path)
        if path.is_dir():
            return cls.from_data(path, tokenizer)
        with np.load(path) as f:
            return cls(f["tokens"], f["filler"], f["code"])

    def sample(self, n: int = SAMPLE_TOKENS, runs: int = 4) -> Heldout:
        """n ids of each part: the first n of the filler and the code, and of the split `runs` evenly spaced runs
        (its documents are by source, so its first n ids would be one source's; each of the default NLL's
        4 windows of 2048 falls in one run)."""
        starts = np.linspace(0, max(0, self.tokens.size - n // runs), runs).astype(int)
        tokens = np.concatenate([self.tokens[s:s + n // runs] for s in starts]) if self.tokens.size > n else self.tokens
        return Heldout(tokens, self.filler[:n], self.code[:n])

    def save(self, path: Path) -> None:
        with open(path, "wb") as f:  # a file object: np.savez would add ".npz" to another name
            np.savez_compressed(f, tokens=self.tokens, filler=self.filler, code=self.code)


def nll(model_dir: Path, tokens: np.ndarray, windows: int, seq_len: int, device: str = "cpu") -> float:
    """Mean next-token NLL (nats per token) of `windows` evenly spaced windows of seq_len + 1 tokens, each a
    fresh sequence prefilled in one chunk by the checkpoint's model on `device`'s backend."""
    model = load_model(model_dir, device=device)
    ids = torch.from_numpy(tokens.astype(np.int64))
    total = 0.0
    for s in np.linspace(0, ids.numel() - seq_len - 1, windows).astype(int):
        x = ids[s:s + seq_len + 1].to(model.device)
        with torch.no_grad():
            logits = model.forward(SequenceState(device=model.device), Tokens(x[:-1])).logits
        total += float(F.cross_entropy(logits.float(), x[1:]))
    return total / windows


@dataclass
class Needle:
    word: str
    distance: int  # tokens between the needle and the cue
    answer: str  # the greedy continuation of the cue
    recalled: bool


def needles(engine: Engine, tokenizer, filler: np.ndarray, distance: int, n: int = 8) -> list[Needle]:
    """Each of NEEDLE_WORDS stated once, then `distance` tokens of the `filler` ids (fewer when it has fewer),
    then the cue: whether greedy decoding names the word."""
    fill = filler[:distance].astype(np.int64).tolist()
    out = []
    for word in NEEDLE_WORDS:
        ids = [0, *tokenizer.encode(NEEDLE.format(word=word) + "\n", add_special_tokens=False).ids, *fill,
               *tokenizer.encode(NEEDLE_CUE, add_special_tokens=False).ids]
        s = engine.session()
        answer = tokenizer.decode(list(decode(s, s.prefill(ids), n, SamplingParams(), stop=set())))
        out.append(Needle(word, len(fill), answer, answer.strip().lower().startswith(word.lower())))
    return out


def report(model_dir: Path, data: Path, device: str = "cpu", seq_len: int = 2048, windows: int = 4,
           needle_distance: int = 1500, prompts: int = 4, n: int = 64, depth: int = 4) -> dict:
    """Every gate's measurement of the checkpoint at model_dir against `data`: the directory of `dsflash
    train-data`, or a held-out sample (`Heldout.read`)."""
    from dsflash.tokenizer import load_tokenizer

    engine = Engine.load(model_dir, device=device)
    tokenizer = load_tokenizer(model_dir)
    heldout = Heldout.read(data, tokenizer)
    found = needles(engine, tokenizer, heldout.filler, needle_distance)
    # a fixed depth: the drafter's own acceptance (the adaptive depth's choices follow the machine's load)
    d = drafting(engine, python_prompts(heldout.code, prompts, 256), n, depth, adaptive=False)
    return {"test_nll": nll(model_dir, heldout.tokens, windows, seq_len, device),
            "needles": [asdict(x) for x in found], "needles_recalled": sum(x.recalled for x in found),
            "drafting": {**asdict(d), "speedup": d.speedup}}
