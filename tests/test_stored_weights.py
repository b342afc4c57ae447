"""The CPU reference holds FP8/FP4 weights in their stored formats (issue 17: ~1 or 0.5 B a parameter, not the
4 B of widened fp32 code values), decoding them inside each GEMM with the widened weights' bits."""

import dataclasses

import torch

import dsflash.model.transformer as transformer
from dsflash.checkpoint.reader import open_checkpoint
from dsflash.kernels import cpu, load_kernels
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from tests.conftest import TEXT_CASE


def held_weights(root) -> list:
    """Every Weight reachable from the model object (its modules' attributes, lists and dicts), once."""
    seen, found, todo = set(), [], [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, torch.Tensor | str | int | float | bool | type(None)):
            continue
        seen.add(id(obj))
        if isinstance(obj, cpu.Weight):
            found.append(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple):
            todo.extend(obj)
        elif type(obj).__module__.startswith("dsflash.model"):
            todo.extend(vars(obj).values())
    return found


def test_resident_fp8_fp4_bytes_are_the_stored_bytes():
    model = load_model(TEXT_CASE)
    held = [w for w in held_weights(model) if w.kind in ("fp8", "fp4")]
    assert held and all(isinstance(w, cpu.StoredWeight) for w in held)
    ckpt = open_checkpoint(TEXT_CASE)
    # the checkpoint's FP8/FP4 linear weights and their scales (the Engram tables are rows, not a linear)
    stored = 0
    for name in ckpt.names():
        if name.endswith(".weight") and ".engram.embed." not in name and ckpt.get(name).dtype in (
                torch.float8_e4m3fn, torch.int8, torch.uint8):
            stored += ckpt.get(name).nbytes + ckpt.get(name[: -len("weight")] + "scale").nbytes
    assert sum(w.nbytes for w in held) == stored
    params = sum(w.out_features * w.in_features for w in held)
    assert stored < 1.1 * params  # about a byte a parameter or less, against 4 B widened


def test_stored_weights_give_the_widened_weights_bits(monkeypatch):
    """The same forward with every FP8/FP4 weight widened to fp32 code values and scales at load (what the
    reference held before): bit-identical logits and hand-off."""
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))
    stored = load_model(TEXT_CASE).forward(SequenceState(), ids)
    k = load_kernels("cpu")

    def widened(kind, tensor, scale):
        w = k.weight(kind, tensor, scale)
        return cpu.Weight(kind, w.values, w.scale) if isinstance(w, cpu.StoredWeight) else w

    monkeypatch.setattr(transformer, "load_kernels", lambda device, reference=False: dataclasses.replace(
        k, weight=widened))
    wide = load_model(TEXT_CASE).forward(SequenceState(), ids)
    assert torch.equal(stored.logits, wide.logits)
    assert torch.equal(stored.handoff_streams, wide.handoff_streams)
