"""Shipping a trained checkpoint as the built-in one (issue 21 item 4): the export's shards within a size limit,
the ship step's checks and copy (into a temporary package directory: no checkpoint goes into the repository),
the built-in loader taking a complete one and refusing a damaged one with the reason, and the chat encoding
with a trained tokenizer's markers."""

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from dsflash.checkpoint import builtin
from dsflash.checkpoint.manifest import MANIFEST, thinks, verify_weights
from dsflash.checkpoint.reader import INDEX, Checkpoint, CheckpointError
from dsflash.config import ConfigError
from dsflash.server.encoding import encode_messages
from dsflash.tokenizer import SPECIAL_TOKENS, TINY_CORPUS, load_tokenizer
from dsflash.tokens import EOS, THINK_END, THINK_START
from dsflash.train import data, quality, ship, vocab
from dsflash.train.export import export_weights
from dsflash.train.train_cmd import main as train_main
from tests.test_train import data_dir, trainer  # noqa: F401 (data_dir: the fixture)

SHARD = 300 << 10  # the smoke model's 1.4 MB of weights in several shards


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):  # noqa: F811
    """A smoke training run's --out directory, its weights in shards of at most SHARD bytes."""
    out = tmp_path_factory.mktemp("smoke-run")
    assert train_main(["--data", str(data_dir), "--out", str(out), "--smoke", "--seq-len", "96", "--steps", "4",
                       "--dspark-steps", "2", "--eval-every", "100", "--eval-windows", "1", "--device", "cpu",
                       "--shard-size", "300KiB"]) == 0
    return out


@pytest.fixture(scope="module")
def ship_data(data_dir, tmp_path_factory):  # noqa: F811
    """data_dir with the test split's documents too (test.jsonl), whose Shakespeare and Python the held-out
    sample holds as ids."""
    out = tmp_path_factory.mktemp("ship-data")
    shutil.copytree(data_dir, out, dirs_exist_ok=True)
    lines = TINY_CORPUS.splitlines()
    docs = [data.Document("shakespeare", "prose", "\n".join(lines[:12])), data.Document("kjv", "none", ""),
            data.Document("python", "code", "\n".join(lines[14:40]))]
    (out / "test.jsonl").write_text("".join(json.dumps(asdict(d)) + "\n" for d in docs))
    return out


@pytest.fixture(scope="module")
def seeded_home(tmp_path_factory):
    """Where the seeded fallback is made (once for the module)."""
    home = tmp_path_factory.mktemp("home")
    builtin.seeded_checkpoint(home)
    return home


@pytest.fixture(scope="module")
def shipped_once(run, ship_data, tmp_path_factory):
    dest = tmp_path_factory.mktemp("pkg") / "trained"
    assert ship.main([str(run), "--data", str(ship_data), "--dest", str(dest)]) == 0
    return dest


@pytest.fixture
def shipped(shipped_once, tmp_path, monkeypatch):
    """The run shipped into a temporary package directory (a test's own copy), which the built-in loader then
    reads."""
    dest = tmp_path / "trained"
    shutil.copytree(shipped_once, dest)
    monkeypatch.setattr(builtin, "TRAINED", dest)
    return dest


def test_export_cuts_the_weights_into_shards_of_at_most_the_limit(data_dir, tmp_path):  # noqa: F811
    t = trainer(data_dir, seq_len=96)
    whole = export_weights(t.masters, t.args, tmp_path / "whole")
    assert [f.name for f in whole.glob("*.safetensors")] == ["model.safetensors"] and not (whole / INDEX).exists()
    limit = (whole / "model.safetensors").stat().st_size // 3
    cut = export_weights(t.masters, t.args, tmp_path / "cut", limit)
    shards = sorted(cut.glob("*.safetensors"))
    assert len(shards) >= 3 and all(f.stat().st_size <= limit for f in shards)
    assert [f.name for f in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)]
    index = json.loads((cut / INDEX).read_text())
    a, b = Checkpoint(whole), Checkpoint(cut)
    assert set(index["weight_map"]) == set(a.names()) == set(b.names())
    assert index["metadata"]["total_size"] == sum(a.byte_range(n)[2] - a.byte_range(n)[1] for n in a.names())
    assert all(a.digest(n) == b.digest(n) for n in a.names())  # the same bytes, however cut
    assert all(b.file_of(n[: -len("scale")] + "weight") == b.file_of(n) for n in b.names() if n.endswith(".scale"))
    assert verify_weights(cut) == len(a.names())
    biggest = max(a.names(), key=lambda n: a.byte_range(n)[2] - a.byte_range(n)[1])
    with pytest.raises(ConfigError, match=f"tensor {biggest!r} alone needs a file of"):
        export_weights(t.masters, t.args, tmp_path / "tiny", 4096)


def test_training_writes_shards_within_shard_size(run):
    ckpt = run / "checkpoint"
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) > 1 and (ckpt / INDEX).is_file() and all(f.stat().st_size <= SHARD for f in shards)
    assert verify_weights(ckpt) > 0


def test_the_shipped_checkpoint_is_the_built_in_one(shipped, run, ship_data, seeded_home, capsys):
    assert builtin.builtin_checkpoint(seeded_home) == shipped and capsys.readouterr().err == ""
    ckpt = run / "checkpoint"
    for f in ckpt.iterdir():  # every file of the run's checkpoint, as it was
        assert (shipped / f.name).read_bytes() == f.read_bytes(), f.name
    sums = dict(reversed(line.split("  ")) for line in (shipped / builtin.SUMS).read_text().splitlines())
    assert set(sums) == {f.name for f in shipped.iterdir()} - {builtin.SUMS}
    assert {"train.json", builtin.HELDOUT} <= set(sums)
    sample = quality.Heldout.read(shipped / builtin.HELDOUT, None)
    full = quality.Heldout.from_data(ship_data, load_tokenizer(ckpt))
    for part in ("filler", "code"):
        got, want = getattr(sample, part), getattr(full, part)
        assert got.size == min(want.size, quality.SAMPLE_TOKENS) and np.array_equal(got, want[:got.size]), part
    assert np.array_equal(sample.tokens, full.tokens)  # the smoke split is smaller than a sample


def test_the_sample_spreads_over_the_test_split():
    tokens = np.arange(60_000, dtype=np.uint16)
    part = quality.Heldout(tokens, tokens, tokens).sample(32, runs=4)
    assert part.tokens.tolist() == [*range(8), *range(19997, 20005), *range(39994, 40002), *range(59992, 60_000)]
    assert part.filler.tolist() == part.code.tolist() == list(range(32))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: next(d.glob("model-*.safetensors")).write_bytes(b"\0" * 100), "damaged"),
    (lambda d: d.joinpath("tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda d: d.joinpath("model-00009-of-00009.safetensors").write_bytes(b""), "is not listed"),
    (lambda d: d.joinpath(builtin.SUMS).unlink(), "no readable SHA256SUMS"),
])
def test_a_damaged_shipped_checkpoint_is_refused_for_the_seeded_one(shipped, seeded_home, capsys, damage, reason):
    damage(shipped)
    with pytest.raises(CheckpointError, match=reason):
        builtin.check_trained(shipped)
    assert builtin.builtin_checkpoint(seeded_home) == builtin.seeded_checkpoint(seeded_home)
    (line,) = capsys.readouterr().err.splitlines()
    assert "the trained checkpoint is refused" in line and reason in line and "seeded random Tiny-A" in line


def test_without_a_shipped_checkpoint_the_built_in_one_is_seeded(tmp_path, seeded_home, monkeypatch, capsys):
    monkeypatch.setattr(builtin, "TRAINED", tmp_path / "trained")
    assert not builtin.shipped(builtin.TRAINED)
    out = builtin.builtin_checkpoint(seeded_home)
    assert out == seeded_home / "builtin-tiny-a-s0-v3" and (out / "tokenizer.json").is_file()
    (line,) = capsys.readouterr().err.splitlines()
    assert f"no trained checkpoint is shipped in {tmp_path / 'trained'}" in line


def test_ship_refuses_a_checkpoint_of_another_tokenizer_or_damaged(run, ship_data, tmp_path, capsys):
    other = tmp_path / "data"
    shutil.copytree(ship_data, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")  # another file
    dest = tmp_path / "trained"
    assert ship.main([str(run), "--data", str(other), "--dest", str(dest)]) == 1
    assert "is not" in capsys.readouterr().err and not dest.exists()
    broken = tmp_path / "run"
    shutil.copytree(run, broken)
    (broken / "checkpoint" / "config.json").write_text((run / "checkpoint" / "config.json").read_text() + " ")
    assert ship.main([str(broken), "--data", str(ship_data), "--dest", str(dest)]) == 1
    assert "config.json differs" in capsys.readouterr().err and not dest.exists()


def trained_tokenizer(tmp_path: Path):
    """A tokenizer made as `dsflash train-data` makes the trained one (vocab.build over split documents)."""
    lines = [x for x in (Path(data.__file__).read_text() + Path(vocab.__file__).read_text()).splitlines()]
    docs = [data.Document(source, f"{source}-{i}", "\n".join(lines[i::30]))
            for source in ("shakespeare", "python") for i in range(30)]
    data.write_splits(docs, tmp_path, {})
    vocab.build(tmp_path, 700)
    return load_tokenizer(tmp_path)


CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a play."},
        {"role": "assistant", "content": "Hamlet.", "reasoning_content": "One of Shakespeare's."},
        {"role": "user", "content": "And a module?"},
        {"role": "assistant", "content": "json", "reasoning_content": "The standard library has it."}]


@pytest.mark.parametrize("thinking", [True, False])
def test_a_chat_renders_its_markers_as_single_ids_of_the_trained_tokenizer(tmp_path, thinking):
    tok = trained_tokenizer(tmp_path)
    for prompt in (True, False):  # a request's prompt (ends with the generation prompt), a training example
        messages = CHAT[:-1] if prompt else CHAT
        text = encode_messages(messages, None, thinking, add_generation_prompt=prompt)
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        for i, (marker, _) in enumerate(SPECIAL_TOKENS):  # each marker is its one id, wherever the text has it
            assert ids.count(i) == text.count(marker), marker
        # BOS, the system turn, two user turns, two assistant headers, an EOS after each finished reply
        assert [ids.count(i) for i in range(6)] == [1, 1 + (not prompt), 0, 1, 2, 2]
        # thinking on: the last reply's reasoning (or the generation prompt) opens <think>; off: none does
        assert text.count(THINK_START) == thinking and ("Reasoning Effort" in text) == thinking
        if not prompt:
            reply = f"{THINK_START}The standard library has it." if thinking else ""
            assert text.endswith(f"{reply}{THINK_END}json{EOS}")


def test_the_server_chats_with_the_trained_checkpoint(run):
    from fastapi.testclient import TestClient

    from dsflash.engine.session import Engine
    from dsflash.server.app import create_app

    ckpt = run / "checkpoint"
    tok = load_tokenizer(ckpt)
    app = create_app(Engine.load(ckpt, max_context=1024), tok, prefix_cache=False, model_name="tiny")
    with TestClient(app) as client:
        for thinking in (True, False):
            body = {"messages": CHAT[:-1], "max_tokens": 3, "chat_template_kwargs": {"thinking": thinking}}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            want = tok.encode(encode_messages(CHAT[:-1], None, thinking), add_special_tokens=False).ids
            assert r.json()["usage"]["prompt_tokens"] == len(want)


def test_a_trained_model_does_not_reason_unless_asked(run, seeded_home, tmp_path):
    """The server's thinking default (serve --thinking auto): off for the trained model, whose chat turns were all
    rendered with thinking off, and for seeded weights; on for a checkpoint whose manifest says neither."""
    assert not thinks(run / "checkpoint") and not thinks(builtin.seeded_checkpoint(seeded_home))
    other = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoint", other)
    manifest = json.loads((other / MANIFEST).read_text())
    del manifest["thinks"]
    (other / MANIFEST).write_text(json.dumps(manifest))
    assert thinks(other)
