"""Seeded checkpoints: valid layout, determinism, weight statistics, chunked writing, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dsflash.checkpoint import make
from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.make import make_checkpoint
from dsflash.checkpoint.reader import DTYPE_SIZES, Checkpoint, open_checkpoint, read_header
from dsflash.cli import main
from dsflash.config import PRESETS, TINY_A, TINY_B, bench_preset, load_config
from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import decode_e4m3, decode_e8m0, dequant_fp4_rows, dequant_fp8_blocks, dequant_fp8_rows


@pytest.fixture(scope="module")
def tiny_b(tmp_path_factory) -> Checkpoint:
    return open_checkpoint(make_checkpoint(TINY_B, 0, tmp_path_factory.mktemp("tiny_b")))


def _model_bytes(out: Path) -> bytes:
    return (out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ["tiny-a", "tiny-b"])
def test_written_checkpoint_opens_and_validates(tmp_path, name):
    out = make_checkpoint(PRESETS[name], 1, tmp_path)
    ckpt = open_checkpoint(out)
    assert load_config(out) == PRESETS[name]
    assert set(ckpt.names()) == set(expected_tensors(PRESETS[name]))
    assert not (out / "model.safetensors.partial").exists()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = _model_bytes(make_checkpoint(TINY_A, 7, tmp_path / "a"))
    assert _model_bytes(make_checkpoint(TINY_A, 7, tmp_path / "b")) == a
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()
    other = make_checkpoint(TINY_A, 8, tmp_path / "c")
    assert _model_bytes(other) != a
    first, second = Checkpoint(tmp_path / "a"), Checkpoint(other)
    weights = [n for n in first.names() if not n.endswith(".scale")]  # tile scales may coincide, values may not
    assert not any(torch.equal(first.get(n).view(torch.uint8), second.get(n).view(torch.uint8)) for n in weights)


def test_each_tensor_depends_on_seed_and_name_only(tmp_path, tiny_b):
    a = Checkpoint(make_checkpoint(TINY_A, 0, tmp_path))
    for name in ("embed.weight", "layers.0.attn.wq_a.weight", "layers.1.attn.wo_a.weight"):
        assert torch.equal(a.get(name).view(torch.uint8), tiny_b.get(name).view(torch.uint8))


def _rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


def test_statistics_follow_the_released_checkpoint(tiny_b):
    c = tiny_b
    assert _rms(c.get("embed.weight")) == pytest.approx(0.12, rel=0.02)
    assert _rms(c.get("mtp.2.markov_head.embed.weight")) == pytest.approx(0.12, rel=0.02)
    means = {"layers.0.attn_norm.weight": 0.025, "layers.0.ffn_norm.weight": 0.2, "layers.3.attn.q_norm.weight": 0.97,
             "layers.0.attn.kv_norm.weight": 0.4, "layers.2.attn.compressor.norm.weight": 0.6,
             "layers.6.attn.indexer.k_norm.weight": 0.5, "norm.weight": 1.0, "mtp.0.main_norm.weight": 1.0}
    for name, mean in means.items():
        w = c.get(name).float()
        assert w.mean().item() == pytest.approx(mean, rel=0.03), name
        assert (w.std() / w.mean()).item() == pytest.approx(0.1, rel=0.25), name
    gains = {"layers.0.attn.wq_a": 1.6, "layers.0.attn.wq_b": 0.95, "layers.0.attn.wkv": 1.8, "layers.0.attn.wo_b": 1.9,
             "layers.0.ffn.shared_experts.w1": 1.5, "layers.0.ffn.shared_experts.w2": 1.05, "mtp.0.main_proj": 1.0,
             "layers.1.engram.wkv": 1.8, "layers.2.attn.indexer.wq_b": 0.95}
    for name, gain in gains.items():
        w = dequant_fp8_blocks(c.get(name + ".weight"), c.get(name + ".scale"))
        assert _rms(w) == pytest.approx(w.shape[1] ** -0.5 * gain, rel=0.05), name
    for name in ("layers.0.attn.wo_a.weight", "layers.0.ffn.gate.weight", "layers.0.hc_attn_fn",
                 "mtp.2.confidence_head.proj.weight"):
        gain = {"wo_a": 1.6, "gate": 2.9}.get(name.split(".")[-2], 1.0)
        assert _rms(c.get(name)) == pytest.approx(c.get(name).shape[1] ** -0.5 * gain, rel=0.1), name
    for name in ("layers.0.ffn.experts.0.w1", "layers.5.ffn.experts.7.w2", "mtp.1.ffn.experts.3.w3"):
        w = dequant_fp4_rows(c.get(name + ".weight"), c.get(name + ".scale"))
        gain = 1.05 if name.endswith("w2") else 1.5
        assert 0.6 < _rms(w) / (w.shape[1] ** -0.5 * gain) < 1.6, name  # powers of two: within sqrt(2)
    assert _rms(dequant_fp8_rows(c.get("layers.4.engram.embed.weight"), c.get("layers.4.engram.embed.scale"))) == (
        pytest.approx(1.0, rel=0.05))
    assert _rms(c.get("layers.0.attn.attn_sink")) < 2 and c.get("layers.0.hc_ffn_base").dtype == torch.float32


def _check_scales_fit(ckpt: Checkpoint) -> int:
    """Each FP8 tile / Engram row block uses its power-of-two scale tightly (largest |code| in [224, 448]),
    which holds only when every scale was written next to its own weights."""
    checked = 0
    for name in ckpt.names():
        dtype, shape = ckpt.dtype_shape(name)
        if dtype != "F8_E4M3":
            continue
        rows, cols = shape
        codes = decode_e4m3(ckpt.get(name)).abs()
        if ".engram.embed." in name:
            top = codes.unflatten(1, (-1, BLOCK)).amax(-1)
        else:
            padded = torch.nn.functional.pad(codes, (0, -cols % BLOCK, 0, -rows % BLOCK))
            top = padded.unflatten(0, (-1, BLOCK)).unflatten(-1, (-1, BLOCK)).amax(dim=(1, 3))
        assert ((top >= 224) & (top <= 448)).all(), name
        checked += 1
    return checked


def test_chunked_writing(tmp_path, monkeypatch, tiny_b):
    """Tiny chunks split every tensor into many pieces written at their offsets: still a valid file
    with every scale beside its weights."""
    monkeypatch.setattr(make, "CHUNK_VALUES", 1000)
    ckpt = open_checkpoint(make_checkpoint(TINY_B, 0, tmp_path))
    assert _check_scales_fit(ckpt) == _check_scales_fit(tiny_b) > 0
    exponents = torch.log2(decode_e8m0(ckpt.get("layers.0.ffn.experts.2.w2.scale")))
    assert exponents.max() - exponents.min() == 2  # one exponent, jittered by -1/0/+1


def test_bench_checkpoint_fits_one_h200():
    """The bench preset is never written in tests (tens of GB); its layout is checked by size."""
    total = sum(math.prod(shape) * DTYPE_SIZES[dtype] for dtype, shape in expected_tensors(bench_preset()).values())
    assert 30 * 2**30 < total < 80 * 2**30


def test_cli(tmp_path, capsys):
    assert main(["make-checkpoint", "--preset", "tiny-a", "--seed", "3", "--out", str(tmp_path / "cli")]) == 0
    assert "with tokenizer.json" in capsys.readouterr().out
    # the tiny presets come with the tiny tokenizer, and the Engram class count it gives
    assert _model_bytes(tmp_path / "cli") == _model_bytes(make.make_with_tokenizer(TINY_A, 3, tmp_path / "api"))
    assert (tmp_path / "cli" / "tokenizer.json").read_bytes() == (tmp_path / "api" / "tokenizer.json").read_bytes()
    assert read_header(tmp_path / "cli" / "model.safetensors")["embed.weight"] == ("BF16", [512, 256])
    assert main(["make-checkpoint", "--preset", "tiny-a", "--experts", "8", "--out", str(tmp_path / "x")]) == 2
    assert "only the bench preset takes an expert count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["make-checkpoint", "--preset", "nope", "--out", str(tmp_path / "y")])


@pytest.mark.slow  # ~8 s
def test_make_checkpoint_output_takes_text_prompts(tmp_path):
    """`make-checkpoint` then `generate --prompt` on its output, as a user would (subprocesses): before,
    no tokenizer.json was written and the prompt failed."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "dsflash.cli"]
    out = tmp_path / "ckpt"
    subprocess.run([*cli, "make-checkpoint", "--preset", "tiny-a", "--out", str(out)], env=env, check=True,
                   capture_output=True, timeout=300)
    r = subprocess.run([*cli, "generate", "--model", str(out), "--prompt", "Hello there", "-n", "3", "--json",
                        "--device", "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 3
