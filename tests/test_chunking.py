"""A position's results must not depend on how the prompt was chunked (bit for bit)."""

import pytest
import torch

from dsflash.engine.state import SequenceState
from dsflash.model.load import load_model
from tests.conftest import GOLDEN_CASES


@pytest.fixture(scope="module")
def model_and_ids():
    from safetensors.numpy import load_file

    case = next(c for c in GOLDEN_CASES if c.name == "tinyA_s0_T40")
    ids = torch.from_numpy(load_file(str(case / "golden.safetensors"))["full.input_ids"])
    return load_model(case), ids


def run_chunks(model, ids, size):
    state, parts = SequenceState(), []
    for i in range(0, ids.numel(), size):
        parts.append(model.forward(state, ids[i:i + size]))
    return [torch.cat([getattr(p, k) for p in parts]) for k in ("logits", "handoff_streams", "handoff_pre_mix",
                                                               "main_hidden")]


@pytest.mark.parametrize("size", [1, 7, 64])
def test_chunked_prefill_is_bit_identical(model_and_ids, size):
    model, ids = model_and_ids
    whole = run_chunks(model, ids, ids.numel())
    chunked = run_chunks(model, ids, size)
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)
