"""Checkpoint layout and refusal of damaged or mismatched checkpoints."""

from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.reader import Checkpoint, CheckpointError, model_identity, open_checkpoint, read_header
from dsflash.config import TINY_A, TINY_B, V41_FLASH, load_config
from tests.conftest import GOLDEN, GOLDEN_CASES, TEXT_CASE, VISION_CASES

CASES = [*GOLDEN_CASES, *VISION_CASES]
CASE = TEXT_CASE


def _raw_header(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return header


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_expected_tensors_match_the_golden_checkpoints_exactly(case):
    stored = {k: (v["dtype"], tuple(v["shape"])) for k, v in _raw_header(case / "model.safetensors").items()}
    assert expected_tensors(load_config(case)) == stored


def test_expected_tensor_roles():
    a = expected_tensors(TINY_B)
    assert a["layers.2.attn.compressor.wgate.weight"] == ("BF16", (64, 256))  # ratio-2 KV source
    assert "layers.6.attn.compressor.wgate.weight" not in a  # ratio 1: no gate
    assert "layers.8.attn.indexer.wq_b.weight" in a and "layers.8.attn.indexer.wk.weight" not in a  # reindex
    assert not any(k.startswith("layers.3.attn.indexer") or k.startswith("layers.3.attn.compressor") for k in a)
    assert a["layers.4.engram.embed.weight"] == ("F8_E4M3", (TINY_B.engram_num_embeddings[1], 32))
    assert a["mtp.0.ffn.experts.3.w2.weight"] == ("I8", (256, 32)) and "mtp.0.ffn.experts.4.w1.weight" not in a
    assert "mtp.0.main_proj.weight" in a and "mtp.0.norm.weight" not in a and "mtp.2.norm.weight" in a
    assert a["mtp.0.main_proj.scale"] == ("F8_E8M0", (8, 24))
    assert not any(".bias_vl" in k or k.startswith("vision.") for k in a)


def test_expected_tensors_of_the_release():
    a = expected_tensors(V41_FLASH)
    assert a["layers.1.engram.embed.weight"] == ("F8_E4M3", (384006168, 256))
    assert a["layers.14.engram.embed.scale"] == ("F8_E8M0", (384016682, 8))
    assert a["layers.14.engram.wkv.weight"] == ("F8_E4M3", (5 * 5120, 24 * 256))
    assert a["layers.0.attn.wo_a.weight"] == ("BF16", (8 * 1024, 4096))
    assert a["layers.5.ffn.experts.383.w1.scale"] == ("F8_E8M0", (2304, 160))
    assert a["mtp.2.ffn.experts.127.w2.weight"] == ("I8", (5120, 1152)) and "mtp.2.ffn.experts.128.w2.weight" not in a
    assert a["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, 5120 + 256))
    assert a["vision.blocks.31.mlp.w1.weight"] == ("BF16", (2 * 2816, 1024))
    assert a["aligner.w1.weight"] == ("BF16", (5120, 9 * 1024)) and a["mtp.0.ffn.gate.bias_vl"] == ("F32", (128,))


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_golden_checkpoints_open(case):
    ckpt = open_checkpoint(case)
    assert ckpt.dtype_shape("embed.weight") == ("BF16", [512, 256])
    assert ckpt.get("layers.0.attn.wkv.weight").dtype == torch.float8_e4m3fn
    assert ckpt.get("layers.0.ffn.experts.0.w1.weight").dtype == torch.int8


# ---------------------------------------------------------------------------------------------
# damaged files and mismatched tensors
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def copy_case(tmp_path) -> Path:
    shutil.copy(CASE / "config.json", tmp_path / "config.json")
    shutil.copy(CASE / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").chmod(0o644)
    return tmp_path


def _edit_bytes(path: Path, edit) -> None:
    path.write_bytes(edit(bytearray(path.read_bytes())))


def _edit_tensors(path: Path, edit) -> None:
    """Rewrite the file through safetensors with `edit` applied to the {name: tensor} dict."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _edit_header(path: Path, edit) -> None:
    """Change header entries in place, keeping the data bytes (the header keeps its length)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw.ljust(n) + data[8 + n :])


SINK = "layers.0.attn.attn_sink"
REFUSALS = {
    "truncated_data": (lambda p: _edit_bytes(p, lambda b: b[:-1000]),
                       r"truncated: tensor data ends at byte \d+ \(tensor '.*'\), the file holds \d+ bytes"),
    "truncated_header": (lambda p: _edit_bytes(p, lambda b: b[:100]), "header length field says"),
    "too_short": (lambda p: _edit_bytes(p, lambda b: b[:5]), "too short for the 8-byte header length"),
    "flipped_length": (lambda p: _edit_bytes(p, lambda b: b[:7] + bytes([b[7] ^ 0xFF]) + b[8:]),
                       "header length field says"),
    "flipped_header": (lambda p: _edit_bytes(p, lambda b: b[:8] + bytes([b[8] ^ 0xFF]) + b[9:]),
                       "header is not valid UTF-8 JSON"),
    "trailing_bytes": (lambda p: _edit_bytes(p, lambda b: b + b"\0" * 24), "24 unexpected bytes after the last tensor"),
    "offsets_vs_shape": (lambda p: _edit_header(p, lambda h: h["embed.weight"].update(shape=[512, 255])),
                         r"tensor 'embed.weight': BF16 \[512, 255\] needs 261120 bytes, its data_offsets span 262144"),
    "unknown_dtype": (lambda p: _edit_header(p, lambda h: h["embed.weight"].update(dtype="Q4")),
                      "tensor 'embed.weight': unknown dtype 'Q4'"),
    "deleted_tensor": (lambda p: _edit_tensors(p, lambda t: t.pop("layers.0.attn.wkv.weight")),
                       r"missing tensor 'layers.0.attn.wkv.weight': expected F8_E4M3 \[64, 256\]"),
    "changed_dtype": (lambda p: _edit_tensors(p, lambda t: t.update({SINK: torch.zeros(4).half()})),
                      r"tensor 'layers.0.attn.attn_sink': expected F32 \[4\], got F16 \[4\]"),
    "relabelled_dtype": (lambda p: _edit_header(p, lambda h: h["layers.0.attn.wkv.weight"].update(dtype="U8")),
                         r"tensor 'layers.0.attn.wkv.weight': expected F8_E4M3 \[64, 256\], got U8 \[64, 256\]"),
    "changed_shape": (lambda p: _edit_tensors(p, lambda t: t.update({"norm.weight": torch.zeros(128).bfloat16()})),
                      r"tensor 'norm.weight': expected BF16 \[256\], got BF16 \[128\]"),
    "extra_tensor": (lambda p: _edit_tensors(p, lambda t: t.update({"layers.0.attn.bogus": torch.zeros(3)})),
                     r"unexpected tensor 'layers.0.attn.bogus' \(F32 \[3\]\): not part of a checkpoint"),
}


@pytest.mark.parametrize("damage", REFUSALS, ids=list(REFUSALS))
def test_damaged_or_mismatched_checkpoint_is_refused(copy_case, damage):
    corrupt, message = REFUSALS[damage]
    corrupt(copy_case / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(copy_case)


def test_every_problem_is_listed(copy_case):
    def edit(t):
        for name in ("layers.0.attn.wkv.weight", "layers.0.attn.wkv.scale", "head.weight"):
            t.pop(name)
        t["spare"] = torch.zeros(1)

    _edit_tensors(copy_case / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=r"\(4 problems\)") as err:
        open_checkpoint(copy_case)
    assert all(name in str(err.value) for name in ("wkv.weight", "wkv.scale", "head.weight", "spare"))


def test_wrong_config_is_refused(copy_case):
    first = r"tensor 'layers.0.ffn.gate.weight': expected BF16 \[8, 256\], got BF16 \[4, 256\]"
    with pytest.raises(CheckpointError, match=rf"\(997 problems\):\n  {first}\n(.*\n){{19}}  \.\.\. and 977 more"):
        open_checkpoint(copy_case, TINY_B)


def test_read_header_of_a_good_file():
    header = read_header(CASE / "model.safetensors")
    assert header["layers.0.engram.embed.scale"] == ("F8_E8M0", [660, 1])


# ---------------------------------------------------------------------------------------------
# model identity
# ---------------------------------------------------------------------------------------------
def test_model_identity():
    ckpt = Checkpoint(CASE)
    identity = model_identity(ckpt.args, ckpt)
    assert re.fullmatch("[0-9a-f]{64}", identity)  # a hex SHA-256
    other_seed = Checkpoint(GOLDEN / "tinyA-w128_s1_T200")
    assert model_identity(TINY_A, other_seed) == identity  # the same layout whatever the weights
    assert model_identity(replace(TINY_A, max_seq_len=4096, temperature=0.7), ckpt) == identity  # runtime only
    assert model_identity(other_seed.args, other_seed) != identity  # window 128 instead of 16
    assert model_identity(replace(TINY_A, route_scale=2.0), ckpt) != identity


def test_model_identity_sees_the_tensor_index(copy_case):
    before = model_identity(TINY_A, Checkpoint(copy_case))
    _edit_tensors(copy_case / "model.safetensors", lambda t: t.update({"spare": torch.zeros(1)}))
    assert model_identity(TINY_A, Checkpoint(copy_case)) != before
