"""The checkpoint as shipped: an index's weight_map picks each tensor's shard, shards open on first use,
and an index that disagrees with its shards is refused naming the file and the tensor."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dsflash.checkpoint import reader
from dsflash.checkpoint.make import make_checkpoint, shard_names
from dsflash.checkpoint.manifest import verify_weights
from dsflash.checkpoint.reader import INDEX, Checkpoint, CheckpointError, open_checkpoint
from dsflash.cli import main
from dsflash.config import TINY_A, TINY_B
from dsflash.engine.session import Engine
from dsflash.model.load import load_model

SHARDS = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """The same tiny-A checkpoint as one file and as SHARDS indexed shards."""
    root = tmp_path_factory.mktemp("sharded")
    return make_checkpoint(TINY_A, 4, root / "one"), make_checkpoint(TINY_A, 4, root / "sharded", shards=SHARDS)


@pytest.fixture
def sharded_copy(pair, tmp_path) -> Path:
    return Path(shutil.copytree(pair[1], tmp_path / "copy"))


def test_sharded_layout_is_the_hf_one(pair):
    _, sharded = pair
    index = json.loads((sharded / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == shard_names(SHARDS) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(
        e - b for name in index["weight_map"] for _, b, e in [Checkpoint(sharded).byte_range(name)])
    assert not (sharded / "model.safetensors").exists()
    for name, file in index["weight_map"].items():  # a scale sits in its weight's shard
        if name.endswith(".scale"):
            assert index["weight_map"][name[: -len("scale")] + "weight"] == file


def test_sharded_tensors_equal_single_file(pair):
    one, sharded = open_checkpoint(pair[0]), open_checkpoint(pair[1])
    assert one.names() == sharded.names()
    assert len({sharded.file_of(n) for n in sharded.names()}) == SHARDS
    for name in one.names():
        assert one.dtype_shape(name) == sharded.dtype_shape(name)
        assert torch.equal(one.get(name).view(torch.uint8), sharded.get(name).view(torch.uint8)), name
        path, begin, end = sharded.byte_range(name)  # pread of a shard's rows finds the same bytes
        with open(path, "rb") as f:
            f.seek(begin)
            assert f.read(end - begin) == one.get(name).contiguous().view(torch.uint8).numpy().tobytes()
    assert verify_weights(pair[1]) == len(one.names())


def test_sharded_logits_bit_identical(pair):
    prompt = [0, 5, 17, 99, 3, 250, 41, 7, 8, 300, 12, 64, 2, 77, 150, 9, 18]
    logits = [Engine.load(p).session().sync(prompt, chunk=8).logits for p in pair]
    assert torch.equal(logits[0], logits[1])


def test_shards_open_on_first_use(pair):
    ckpt = Checkpoint(pair[1])
    assert ckpt.opened() == []  # headers only
    name = "layers.0.attn.wq_a.weight"
    ckpt.get(name)
    assert ckpt.opened() == [ckpt.file_of(name)]
    ckpt.get(name)
    assert ckpt.opened() == [ckpt.file_of(name)]


def test_untouched_shard_is_not_opened(pair, monkeypatch):
    opened = []
    real = reader.safe_open
    monkeypatch.setattr(reader, "safe_open", lambda path, **kw: opened.append(Path(path).name) or real(path, **kw))
    ckpt = open_checkpoint(pair[1])
    assert opened == []
    ckpt.get("embed.weight")
    assert opened == [ckpt.file_of("embed.weight")]
    ckpt.get("norm.weight")
    ckpt.get("embed.weight")  # a shard is opened once
    assert sorted(set(opened)) == sorted(opened)


def test_missing_shard_is_refused_with_its_name(sharded_copy):
    gone = shard_names(SHARDS)[1]
    (sharded_copy / gone).unlink()
    with pytest.raises(CheckpointError, match=rf"{gone}: missing shard"):
        Checkpoint(sharded_copy)


def _index(path: Path) -> dict:
    return json.loads((path / INDEX).read_text())


def test_index_listing_a_tensor_its_shard_lacks_is_refused(sharded_copy):
    index = _index(sharded_copy)
    index["weight_map"]["layers.0.attn.bogus.weight"] = shard_names(SHARDS)[0]
    (sharded_copy / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{shard_names(SHARDS)[0]}: tensor 'layers.0.attn.bogus.weight' is "
                                              "not in this shard's header"):
        Checkpoint(sharded_copy)


def test_shard_tensor_the_index_does_not_list_is_refused(sharded_copy):
    index = _index(sharded_copy)
    file = index["weight_map"].pop("norm.weight")
    (sharded_copy / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{file}: tensor 'norm.weight' is in this shard, but .* does not list"):
        Checkpoint(sharded_copy)


def test_tensor_the_index_puts_in_another_shard_is_refused(sharded_copy):
    index = _index(sharded_copy)
    names = shard_names(SHARDS)
    file = index["weight_map"]["norm.weight"]
    index["weight_map"]["norm.weight"] = next(n for n in names if n != file)
    (sharded_copy / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="tensor 'norm.weight'"):
        Checkpoint(sharded_copy)


@pytest.mark.parametrize("body", ["{", "[]", '{"weight_map": {}}', '{"weight_map": {"x": 3}}'])
def test_damaged_index_is_refused(sharded_copy, body):
    (sharded_copy / INDEX).write_text(body)
    with pytest.raises(CheckpointError, match=INDEX):
        Checkpoint(sharded_copy)


def test_without_index_every_file_is_a_shard(sharded_copy):
    (sharded_copy / INDEX).unlink()
    assert open_checkpoint(sharded_copy).names() == Checkpoint(sharded_copy).names()


def test_make_checkpoint_shards_cli(tmp_path, capsys):
    assert main(["make-checkpoint", "--preset", "tiny-b", "--out", str(tmp_path), "--shards", "4"]) == 0
    assert "4 file(s)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == shard_names(4)
    # the tiny tokenizer is written too, and the Engram class count set to the count it gives
    assert (tmp_path / "tokenizer.json").exists()
    assert open_checkpoint(tmp_path).args == replace(TINY_B, engram_compressed_vocab_size=open_checkpoint(
        tmp_path).args.engram_compressed_vocab_size)
    # rewriting as one file leaves no stale shard or index behind
    assert main(["make-checkpoint", "--preset", "tiny-b", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / INDEX).exists()
    assert main(["make-checkpoint", "--preset", "tiny-b", "--out", str(tmp_path / "x"), "--shards", "0"]) == 2
    assert "--shards" in capsys.readouterr().err


def test_engram_class_mismatch_names_the_tokenizer_and_both_counts(tmp_path):
    out = make_checkpoint(TINY_A, 0, tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["engram_compressed_vocab_size"] = TINY_A.engram_compressed_vocab_size + 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        load_model(out, half="encoder")
    message = str(e.value)
    assert "\n" not in message and f"no tokenizer.json in {out}" in message
    assert f"gives {TINY_A.vocab_size // 2} Engram token classes" in message
    assert f"engram_compressed_vocab_size is {TINY_A.engram_compressed_vocab_size + 1}" in message


def test_engram_class_mismatch_names_the_tokenizer_file(tmp_path):
    from dsflash.tokenizer import build_tiny_tokenizer, compressed_token_map

    out = make_checkpoint(TINY_A, 0, tmp_path)
    tokenizer = build_tiny_tokenizer(TINY_A.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    classes = compressed_token_map(tokenizer)[1]
    if classes == TINY_A.engram_compressed_vocab_size:  # then the check passes: make the config disagree
        config = json.loads((out / "config.json").read_text())
        config["engram_compressed_vocab_size"] = classes + 1
        (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"the tokenizer {out / 'tokenizer.json'} gives {classes} Engram "
                                              r"token classes, but config.json engram_compressed_vocab_size is \d+"):
        load_model(out, half="encoder")
