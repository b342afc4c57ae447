"""Tiny tokenizer, checkpoint tokenizer loading, and the Engram compressed-token map."""

import subprocess
import sys
from pathlib import Path

import pytest

from dsflash.server.encoding import encode_messages
from dsflash.tokenizer import (
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    compressed_token_map,
    load_tokenizer,
)


class PairStub:
    """Token 2k decodes to "w{k}" and token 2k+1 to " W{k}": each pair normalizes to one key."""

    def __init__(self, size: int):
        self.size = size

    def decode(self, ids: list[int]) -> str:
        (token_id,) = ids
        return f"w{token_id // 2}" if token_id % 2 == 0 else f" W{token_id // 2}"

    def id_to_token(self, token_id: int) -> str:
        return f"raw{token_id}"

    def __len__(self) -> int:
        return self.size


class TableStub:
    """Decoded texts and raw token strings given as lists."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def decode(self, ids: list[int]) -> str:
        return self.texts[ids[0]]

    def id_to_token(self, token_id: int) -> str:
        return f"raw{token_id}"

    def __len__(self) -> int:
        return len(self.texts)


class TokenizerAsStub:
    """A tokenizers.Tokenizer seen only through the stub interface."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer(512)


def test_pair_stub_gives_one_class_per_pair():
    token_map, classes = compressed_token_map(PairStub(512))
    assert token_map == [k for k in range(256) for _ in range(2)]
    assert classes == 256


def test_normalization_keys():
    texts = [
        "Hello",  # 0 -> "hello"
        " hello",  # 1 -> "hello"
        "HÉLLO\n",  # 2 -> "hello"
        " ",  # 3 -> " " (a lone space survives the strip)
        "\n\n",  # 4 -> " "
        "\t \r",  # 5 -> " "
        "",  # 6 -> "" (empty keys by the original text)
        "ﬁ",  # 7 -> "fi" (NFKC)
        " FI ",  # 8 -> "fi"
        "a\ufffd",  # 9 -> raw token string "raw9"
        "\ufffd",  # 10 -> "raw10"
        "raw9",  # 11 -> "raw9": same key as the undecodable token 9
        "\u3000",  # 12 -> NFKC gives " " -> " "
    ]
    token_map, classes = compressed_token_map(TableStub(texts))
    assert token_map == [0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 4, 1]
    assert classes == 6


def test_tokenizer_and_stub_interfaces_give_the_same_map(tiny):
    token_map, classes = compressed_token_map(tiny)
    assert (token_map, classes) == compressed_token_map(TokenizerAsStub(tiny))
    assert len(token_map) == 512
    assert classes == max(token_map) + 1 < 512


def test_tiny_tokenizer_has_exactly_the_requested_size(tiny):
    assert tiny.get_vocab_size(with_added_tokens=True) == 512
    assert build_tiny_tokenizer(300).get_vocab_size(with_added_tokens=True) == 300


def test_special_tokens_have_fixed_ids_and_encode_to_single_ids(tiny):
    for token_id, (token, _) in enumerate(SPECIAL_TOKENS):
        assert tiny.token_to_id(token) == token_id
        assert tiny.encode(token).ids == [token_id]
    bos_eos_pad = [token for token, _ in SPECIAL_TOKENS[:3]]
    assert bos_eos_pad == ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]


def test_prompt_markers_are_single_ids(tiny):
    prompt = encode_messages([{"role": "system", "content": "Hi"}, {"role": "user", "content": "2+2?"}])
    ids = tiny.encode(prompt).ids
    assert ids[:2] == [0, 3]  # BOS, <｜System｜>
    assert ids[-2:] == [5, 6]  # <｜Assistant｜>, <think>
    assert 4 in ids  # <｜User｜>


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! How are you today?",
        "def f(x):\n    return x * 2\n\n\tTabs\r\nand CRLF",
        "Ünïcödé, 中文, emoji 🙂, and a lone combining mark \u0301",
        '<｜User｜>What is 2+2?<｜Assistant｜><think>Add.</think>4<｜DSML｜ calls>"x"<｜end▁of▁sentence｜>',
        "",
    ],
)
def test_tiny_tokenizer_round_trips_text(tiny, text):
    assert tiny.decode(tiny.encode(text).ids, skip_special_tokens=False) == text


def test_markers_survive_skipping_special_tokens(tiny):
    ids = tiny.encode("<｜begin▁of▁sentence｜>a</think>b<｜end▁of▁sentence｜>").ids
    assert tiny.decode(ids, skip_special_tokens=True) == "a</think>b"


def test_tiny_tokenizer_is_deterministic(tiny):
    assert build_tiny_tokenizer(512).to_str() == tiny.to_str()
    # Another process has other hash seeds (Python and Rust); the JSON must not change.
    code = "from dsflash.tokenizer import build_tiny_tokenizer; print(build_tiny_tokenizer(512).to_str())"
    repo = Path(__file__).resolve().parents[1]
    other = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True).stdout
    assert other.rstrip("\n") == tiny.to_str()


@pytest.mark.parametrize("size", [264, 5000])
def test_sizes_the_corpus_cannot_give_are_refused(size):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(size)


def test_load_tokenizer_reads_tokenizer_json(tmp_path, tiny):
    tiny.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).to_str() == tiny.to_str()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "missing")
