"""Tokenizers: the checkpoint's `tokenizer.json`, a tiny deterministic one for the built-in tiny checkpoints,
and the Engram compressed-token map (spec §8, §12).

The tiny tokenizer is a byte-level BPE trained on `TINY_CORPUS` with the V4.1 special tokens at fixed ids
(`SPECIAL_TOKENS`): BOS 0, EOS 1, PAD 2 as in the release, then the role, think and DSML markers that
the chat encoding writes (`dsflash.tokens`), so prompts rendered for a tiny model tokenize with each marker as one id.
The release's role and think ids (around 128,800) are not reproduced; only their strings are.

`compressed_token_map` follows `build_compressed_token_map` of DeepSeek's `inference/engram.py` (as carried
by SGLang and others): same `tokenizers.normalizers` pipeline, same keying and first-seen numbering.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Protocol

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from dsflash.tokens import ASSISTANT, BOS, DSML, EOS, PAD, SYSTEM, THINK_END, THINK_START, USER

# (token, special). Special tokens are dropped by decode(skip_special_tokens=True); the markers are not,
# because the output parser needs to see `</think>` and DSML tags.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS, True),
    (EOS, True),
    (PAD, True),
    (SYSTEM, False),
    (USER, False),
    (ASSISTANT, False),
    (THINK_START, False),
    (THINK_END, False),
    (DSML, False),
)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# Chat-like English and code, written for this project. Its size bounds the tiny vocabulary: see
# `build_tiny_tokenizer`.
TINY_CORPUS = r'''You are a helpful assistant. Answer the question clearly and keep the reply short.
What is the capital of France? The capital of France is Paris.
Can you explain what a hash table is? A hash table maps keys to values. It computes a hash of the
key and uses it to pick a bucket, so lookups take constant time on average.
Thanks! That was helpful. You're welcome. Let me know if you have any other questions.
How do I reverse a list in Python? Use slicing: items[::-1] returns a new list, and items.reverse()
reverses the list in place.
Please summarize the following text in two sentences.
The weather today is sunny with a light breeze. Tomorrow there will be rain in the morning and
clouds in the afternoon.
Let me think about this step by step. First, we need to find the total. Then we divide by the number
of items to get the average.
The answer is 42. I checked the result twice, and both times the numbers matched.
Write a function that returns the sum of the squares of a list of numbers.

def sum_of_squares(numbers):
    """Return the sum of the squares of the numbers."""
    total = 0
    for number in numbers:
        total += number * number
    return total


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value


if __name__ == "__main__":
    counter = Counter()
    for index in range(10):
        print(index, counter.increment())

import json

def load_config(path):
    with open(path, "r", encoding="utf-8") as handle:
        return json.load(handle)

for (int i = 0; i < n; i++) {
    sum += values[i];
}
return sum;

## Tools

You have access to a set of tools to help answer the user's question.
{
  "name": "get_weather",
  "description": "Get the current weather for a city",
  "parameters": {
    "type": "object",
    "properties": {
      "city": {
        "type": "string",
        "description": "The name of the city"
      },
      "days": {
        "type": "integer"
      }
    },
    "required": [
      "city"
    ]
  }
}
{
  "name": "search",
  "description": "Search the web for a query",
  "parameters": {
    "type": "object",
    "properties": {
      "query": {
        "type": "string"
      }
    },
    "required": [
      "query"
    ]
  }
}
invoke name="get_weather"
parameter name="city" string="true">Paris</
parameter name="days" string="false">3</
parameter name="query" string="true">latest news</
<tool_result>{"temperature": 21, "condition": "sunny"}</tool_result>
Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)
The user wants to know the weather in Paris. I should call the weather tool with the city name.
It is 21 degrees and sunny in Paris right now.
Here is a list of steps:
1. Open the file.
2. Read each line.
3. Count the words.
4. Print the result.
Sure, here is an example in JavaScript:
const add = (a, b) => a + b;
console.log(add(2, 3));
function greet(name) {
  return `Hello, ${name}!`;
}
SELECT name, count(*) FROM users WHERE active = true GROUP BY name ORDER BY name;
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Could you translate "good morning" into Spanish? "Good morning" in Spanish is "buenos días".
What time is it in Tokyo? I cannot check the current time, but Tokyo is nine hours ahead of UTC.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered more than red
light because it has a shorter wavelength.
Error: file not found. Check that the path is correct and that you have permission to read the file.
git commit -m "Fix the parser" && git push origin main
pip install numpy tokenizers pytest
$ python -m pytest tests -q
3 passed in 0.12s
Is 17 a prime number? Yes, 17 is prime because it has no divisors other than 1 and itself.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.718 -1 1e-6
In conclusion, the model reads the prompt, thinks about the problem, and then writes the answer.
'''

# Sentinel from engram.py: a private-use character that keeps a lone-space token from being stripped to "".
_LONE_SPACE_SENTINEL = "\ue000"
_ENGRAM_NORMALIZER = normalizers.Sequence(
    [
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
    ]
)


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    """The checkpoint's `tokenizer.json`."""
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json in the checkpoint directory")
    return Tokenizer.from_file(str(path))


def build_tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE over `TINY_CORPUS` with exactly `vocab_size` ids: `SPECIAL_TOKENS` at ids 0..8, the
    256 byte symbols, then merges. The corpus supports sizes from 265 to 1,139; other sizes raise
    ValueError. Building twice gives the same JSON (the trainer breaks count ties by the pair itself)."""
    return train_bpe([TINY_CORPUS], vocab_size, "the tiny corpus")


def train_bpe(texts: Iterable[str], vocab_size: int, what: str = "the corpus") -> Tokenizer:
    """A byte-level BPE trained on `texts` with exactly `vocab_size` ids: `SPECIAL_TOKENS` at ids 0..8, the 256
    byte symbols, then merges; ValueError naming `what` when the texts support fewer merges."""
    smallest = len(SPECIAL_TOKENS) + 256
    if vocab_size < smallest:
        raise ValueError(f"vocab_size: a byte-level BPE with the V4.1 markers needs at least {smallest} ids, "
                         f"got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[token for token, _ in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # The trainer registers every listed token as special; mark the markers as ordinary added tokens.
    markers = [AddedToken(token, special=False, normalized=False) for token, special in SPECIAL_TOKENS if not special]
    tokenizer.add_tokens(markers)
    # A reload rebuilds the special-token set, which add_tokens leaves stale.
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    built = tokenizer.get_vocab_size(with_added_tokens=True)
    if built != vocab_size:
        raise ValueError(f"vocab_size: {what} supports at most {built} ids, got {vocab_size}")
    return tokenizer


class TokenDecoder(Protocol):
    """What `compressed_token_map` needs from a tokenizer other than `tokenizers.Tokenizer`."""

    def decode(self, ids: list[int]) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def __len__(self) -> int: ...


def compressed_token_map(tokenizer: Tokenizer | TokenDecoder) -> tuple[list[int], int]:
    """Engram's token id -> compressed id map and the number of compressed ids (spec §8).

    Each id is decoded alone (special tokens kept). Text with U+FFFD (a partial UTF-8 sequence) is keyed by
    the raw token string; other text by its normalized form (NFKC, NFD, accents stripped, lowercased,
    whitespace runs collapsed to one space, stripped unless it is exactly one space), or by the text itself
    when that is empty. Equal keys share an id, numbered in order of first appearance by token id.
    """
    if isinstance(tokenizer, Tokenizer):
        size = tokenizer.get_vocab_size(with_added_tokens=True)

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)
    else:
        size = len(tokenizer)

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id])

    key_to_class: dict[str, int] = {}
    token_map = []
    for token_id in range(size):
        text = decode(token_id)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = _ENGRAM_NORMALIZER.normalize_str(text) or text
        token_map.append(key_to_class.setdefault(key, len(key_to_class)))
    return token_map, len(key_to_class)


def _byte_level_alphabet() -> dict[str, int]:
    """The printable character byte-level BPE writes for each byte (printable ASCII and Latin-1 stand for
    themselves, the other bytes for characters from U+0100 on, in byte order) -> the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, markers: Collection[str] = ()) -> list[bytes | None]:
    """Each token's bytes under a byte-level BPE tokenizer; None for added tokens (specials, markers) except
    the `markers` named, whose bytes are their text's."""
    alphabet = _byte_level_alphabet()
    added = tokenizer.get_added_tokens_decoder()
    out: list[bytes | None] = []
    for i in range(tokenizer.get_vocab_size()):
        piece = tokenizer.id_to_token(i)
        if i in added and added[i].content in markers:
            out.append(added[i].content.encode())
        elif piece is None or i in added:
            out.append(None)
        elif all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        else:
            out.append(piece.encode())
    return out
