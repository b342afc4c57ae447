"""Damaged weights (issue 19): the manifest of tensor hashes `make-checkpoint` writes and `--verify-weights`
checks, and the NaN scan of 8-bit floats that every load runs. Real files and processes; the damage is a
byte written into a copy of a checkpoint."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.make import make_checkpoint
from dsflash.checkpoint.manifest import MANIFEST, verify_weights
from dsflash.checkpoint.reader import CheckpointError, open_checkpoint, read_layout
from dsflash.config import TINY_A
from dsflash.model.load import load_model
from tests.conftest import after_plan, free_port
from tests.test_split import CASE, ROOT, prompt

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
# FP4 codes and their scales: any byte there loads, so only the manifest can tell a flipped one
FP4 = "layers.1.ffn.experts.0.w2.weight"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    return make_checkpoint(TINY_A, 0, tmp_path_factory.mktemp("made"))


def copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("config.json", "model.safetensors", MANIFEST):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)  # contents only: the golden files are read-only
    return dst


def poke(ckpt: Path, name: str, at: int = 0, value: int | None = None) -> None:
    """Write `value` into byte `at` of tensor `name` (None: flip its lowest bit)."""
    begin, _ = read_layout(ckpt / "model.safetensors")[1][name]
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.seek(begin + at)
        old = f.read(1)[0]
        f.seek(begin + at)
        f.write(bytes([old ^ 1 if value is None else value]))


def test_make_checkpoint_writes_a_manifest_that_verify_checks(made, tmp_path):
    assert verify_weights(made) == len(expected_tensors(TINY_A))
    flipped = copy(made, tmp_path / "flipped")
    poke(flipped, FP4, at=100)
    open_checkpoint(flipped)  # loads: nothing else sees it
    with pytest.raises(CheckpointError, match=rf"tensor '{FP4}' is damaged"):
        verify_weights(flipped)
    other = copy(made, tmp_path / "config")
    (other / "config.json").write_text((other / "config.json").read_text().replace('"n_heads": 4', '"n_heads": 8'))
    with pytest.raises(CheckpointError, match="config.json differs"):
        verify_weights(other)
    (other / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"no {MANIFEST}"):
        verify_weights(other)


@pytest.mark.parametrize("name,byte", [("layers.0.attn.wkv.weight", 0x7F), ("layers.0.attn.wkv.weight", 0xFF),
                                       ("layers.0.attn.wkv.scale", 0xFF)])
def test_a_nan_in_an_fp8_weight_or_an_e8m0_scale_is_refused_at_load(tmp_path, name, byte):
    ckpt = copy(CASE, tmp_path / "nan")
    poke(ckpt, name, at=5, value=byte)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds NaN \(1 values, the first at element 5\)"):
        load_model(ckpt, half="encoder")


@pytest.mark.slow
def test_damaged_weights_stop_generate_and_box_with_the_tensor_named(made, tmp_path):
    ids = tmp_path / "p.json"
    ids.write_text(json.dumps(prompt(8, seed=3)))
    flipped = copy(made, tmp_path / "flipped")
    poke(flipped, FP4, at=100)
    nan = copy(CASE, tmp_path / "nan")
    poke(nan, "layers.0.attn.wkv.weight", value=0x7F)

    def generate(model: Path, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dsflash.cli", "generate", "--model", str(model),
                               "--prompt-tokens", str(ids), "-n", "2", "--json", *flags], env=ENV,
                              capture_output=True, text=True, timeout=300)

    assert generate(made, "--verify-weights").returncode == 0
    for r, tensor in ((generate(flipped, "--verify-weights"), FP4), (generate(nan), "layers.0.attn.wkv.weight")):
        assert r.returncode == 1 and len(after_plan(r.stderr).strip().splitlines()) == 1, r.stderr
        assert f"tensor '{tensor}'" in r.stderr
    box = subprocess.run([sys.executable, "-m", "dsflash.cli", "box", "--model", str(flipped), "--listen",
                          f"127.0.0.1:{free_port()}", "--verify-weights"], env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert box.returncode == 2 and f"tensor '{FP4}' is damaged" in box.stderr, box.stderr
