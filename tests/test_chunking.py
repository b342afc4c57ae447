"""A position's results must not depend on how the prompt was chunked (bit for bit)."""

import pytest
import torch

from dsflash.engine.graphs import SegmentGraphs
from dsflash.engine.runner import Runner
from dsflash.kernels import cpu
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from tests.conftest import TEXT_CASE, interleaved_steps


@pytest.fixture(scope="module")
def model_and_ids():
    from safetensors.numpy import load_file

    case = TEXT_CASE
    ids = torch.from_numpy(load_file(str(case / "golden.safetensors"))["full.input_ids"])
    return load_model(case), ids


def run_chunks(model, ids, size):
    state, parts = SequenceState(), []
    for i in range(0, ids.numel(), size):
        parts.append(model.forward(state, ids[i:i + size]))
    return [torch.cat([getattr(p, k) for p in parts]) for k in ("logits", "handoff_streams", "handoff_pre_mix",
                                                               "main_hidden")]


@pytest.mark.parametrize("size", [pytest.param(1, marks=pytest.mark.slow), 7, 64])  # 1: ~11 s
def test_chunked_prefill_is_bit_identical(model_and_ids, size):
    model, ids = model_and_ids
    whole = run_chunks(model, ids, ids.numel())
    chunked = run_chunks(model, ids, size)
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow  # ~10 s on 2 cores: the default run keeps chunked == one pass (test_chunked_prefill_is_bit_identical)
def test_tiny_b_chunking_tail_prefill_and_dspark(tmp_path_factory):
    """Tiny-B (12 layers, window 8 so rings wrap, 3 DSpark stages): chunked == whole, the encoder-only
    prefill == the full one, and DSpark decoding == plain decoding."""
    from dsflash.checkpoint.make import make_checkpoint
    from dsflash.config import PRESETS
    from dsflash.engine.sampling import SamplingParams
    from dsflash.engine.session import Engine
    from dsflash.engine.spec import decode

    ckpt = make_checkpoint(PRESETS["tiny-b"], 7, tmp_path_factory.mktemp("tinyb"))
    model = load_model(ckpt)
    ids = torch.randint(3, 500, (120,), generator=torch.Generator().manual_seed(0))
    whole = run_chunks(model, ids, ids.numel())
    for a, b in zip(whole, run_chunks(model, ids, 9), strict=True):
        assert torch.equal(a, b)
    engine = Engine.load(ckpt, max_context=1024)
    s = engine.session()
    assert s.tail_rows() < ids.numel()
    assert torch.equal(s.prefill(ids.tolist(), chunk=31), whole[0][-1])
    outs = []
    for k in (0, 3):
        s = engine.session()
        outs.append(list(decode(s, s.prefill(ids.tolist()), 10, SamplingParams(), stop=set(), dspark=k)))
    assert outs[0] == outs[1]


@pytest.mark.slow  # ~17 s; the CUDA graph shapes are CUDA-tested in test_cuda_model.py
def test_graph_shaped_forwards_are_bit_identical_on_cpu(model_and_ids):
    """A short forward the way a CUDA graph runs it (SegmentGraphs without capture: the indexer scoring the
    sources' whole buffers, picks by gather, state written at device offsets) gives the eager forward's bits:
    the graphed arithmetic, checked where CI runs (tests/test_cuda_model.py replays real graphs)."""
    case = TEXT_CASE
    eager, _ = model_and_ids
    shaped = Runner(load_model(case), graphs=SegmentGraphs(max_rows=cpu.ROW_TILE, capture=False))  # rows pad to a tile
    assert torch.equal(interleaved_steps(eager, "cpu"), interleaved_steps(shaped, "cpu"))


def test_graph_shaped_drafts_are_bit_identical_on_cpu(model_and_ids):
    """A DSpark draft the way its CUDA graphs run it (a whole window of context: the context write of a
    step's rows, the stages and the head on device positions, the Markov chain) gives the eager draft's tokens,
    logits and confidences."""
    model, ids = model_and_ids
    window = model.args.window_size
    assert ids.numel() > window + 2
    results = []
    for graphs in (None, SegmentGraphs(max_rows=cpu.ROW_TILE, capture=False)):
        state = SequenceState()
        out = model.forward(state, ids[: window + 2])
        model.dspark.write_context(state, out.main_hidden[:window], 0)
        model.dspark.write_context(state, out.main_hidden[window:], window, graphs=graphs)  # a step's 2 rows
        results.append([model.dspark.draft(state, anchor, graphs=graphs) for anchor in (5, 17)])
    for (tokens, logits, confidence), (tokens2, logits2, confidence2) in zip(*results, strict=True):
        assert tokens == tokens2 and torch.equal(logits, logits2) and torch.equal(confidence, confidence2)
