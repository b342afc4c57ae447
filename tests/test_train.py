"""The training mode (issue 21): data splits, the straight-through training forward against the CPU
reference on the exported checkpoint, a few steps that lower the NLL, and the saved checkpoint loading and
decoding (DSpark output equal to plain decoding) through the engine."""

import json
import math

import numpy as np
import pytest
import torch

from dsflash.checkpoint.reader import Checkpoint
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import DecodeStats, decode
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Tokens, Transformer
from dsflash.numerics.codecs import E2M1_VALUES, dequant_fp4_rows, quantize_fp4_rows
from dsflash.tokenizer import BOS_ID, EOS_ID, TINY_CORPUS, build_tiny_tokenizer, compressed_token_map, load_tokenizer
from dsflash.train import data
from dsflash.train.backend import TrainState
from dsflash.train.export import export_weights
from dsflash.train.loop import Plan, Trainer, draft_logits, smoke_args
from dsflash.train.train_cmd import main as train_main

VOCAB = 512


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data directory as `dsflash train-data` lays it out, from the tiny tokenizer and corpus."""
    d = tmp_path_factory.mktemp("train-data")
    tok = build_tiny_tokenizer(VOCAB)
    tok.save(str(d / "tokenizer.json"))
    token_map, classes = compressed_token_map(tok)
    (d / data.ENGRAM_MAP).write_text(json.dumps({"classes": classes, "map": token_map}))
    lines = TINY_CORPUS.splitlines()
    for split, part in (("train", lines[: len(lines) * 3 // 4]), ("validation", lines[len(lines) * 3 // 4:]),
                        ("test", lines[len(lines) * 3 // 4:])):
        ids = [BOS_ID, *tok.encode("\n".join(part)).ids, EOS_ID]
        np.save(d / f"{split}.tokens.npy", np.asarray(ids * 4, dtype=np.uint16))
    return d


def trainer(data_dir, **plan) -> Trainer:
    token_map, classes = data.load_engram_map(data_dir)
    return Trainer(smoke_args(len(token_map), classes), token_map, data.load_tokens(data_dir, "train"),
                   data.load_tokens(data_dir, "validation"), Plan(**plan), "cpu")


def test_splits_hold_out_whole_documents_by_name():
    docs = [data.Document(source, f"{source}-{i}", f"text {i}") for source in ("a", "b") for i in range(30)]
    splits = data.assign_splits(docs)
    again = data.assign_splits(list(reversed(docs)))  # by name, not by the order they come in
    assert all({d.name for d in splits[s]} == {d.name for d in again[s]} for s in data.SPLITS)
    names = [{d.name for d in splits[s]} for s in data.SPLITS]
    assert not (names[0] & names[1]) and not (names[0] & names[2]) and not (names[1] & names[2])
    assert sum(map(len, names)) == len(docs)
    for s in ("validation", "test"):  # every source is held out in both
        assert {d.source for d in splits[s]} == {"a", "b"}
    with pytest.raises(ValueError, match="source 'c'"):
        data.assign_splits([data.Document("c", "only", "")])


def test_fp4_rows_quantiser_gives_e2m1_values_on_power_of_two_scales():
    w = torch.randn(64, 128) * 0.05
    w[3, :32] = 0  # an all-zero block keeps a usable scale
    packed, scale = quantize_fp4_rows(w)
    assert packed.shape == (64, 64) and scale.shape == (64, 4)
    values = dequant_fp4_rows(packed, scale)
    step = values.view(64, 4, 32).abs().amax(-1) / 6 * 2  # the coarsest E2M1 spacing of a block is 2 x scale
    assert bool(((values - w).abs().view(64, 4, 32) <= step.unsqueeze(-1)).all())
    codes = values.view(64, 4, 32) / torch.tensor(2.0) ** (scale.float().view(64, 4, 1) - 127)
    assert set(codes.flatten().tolist()) <= set(E2M1_VALUES.tolist())
    assert bool((values[3, :32] == 0).all())


def test_a_few_steps_lower_the_validation_nll(data_dir):
    t = trainer(data_dir, seq_len=96, steps=16, warmup=2, lr=1e-2, eval_every=1000)
    before = t.nll(t.validation, 2)
    assert t.backbone(deadline=math.inf) == 16
    after = t.nll(t.validation, 2)
    assert after < before - 0.25, (before, after)
    biases = [p for n, p in t.masters.params.items() if n.endswith(".gate.bias")]
    assert any(bool(b.abs().sum() > 0) for b in biases)  # the balancing moved the routers' biases


def test_training_forward_is_the_reference_forward_of_the_exported_checkpoint(data_dir, tmp_path):
    t = trainer(data_dir, seq_len=96, steps=3, warmup=1, lr=5e-3)
    t.backbone(deadline=math.inf)
    ckpt = export_weights(t.masters, t.args, tmp_path / "ckpt")
    x = t.validation[:200]
    with torch.no_grad():
        trained = t.model().forward(TrainState(), Tokens(x)).logits
    reference = Transformer(t.args, Checkpoint(ckpt), t.token_map).forward(SequenceState(), Tokens(x)).logits
    # the same weights, quantisers and kernels but the GEMMs: one bf16 matmul of the same exact products,
    # against the reference's sums by K block (a summation order, on the CPU often the same bits)
    assert (trained.argmax(-1) == reference.argmax(-1)).float().mean() > 0.99
    nll = [float(torch.nn.functional.cross_entropy(logits[:-1], x[1:])) for logits in (trained, reference)]
    assert abs(nll[0] - nll[1]) < 1e-3 * nll[1], nll


def test_the_saved_checkpoint_decodes_and_drafts_like_plain_decoding(data_dir, tmp_path):
    out = tmp_path / "run"
    assert train_main(["--data", str(data_dir), "--out", str(out), "--smoke", "--seq-len", "96", "--steps", "6",
                       "--dspark-steps", "3", "--eval-every", "3", "--eval-windows", "1", "--device", "cpu"]) == 0
    summary = json.loads((out / "train.json").read_text())
    assert summary["backbone_steps"] == 6 and summary["dspark_steps"] == 3 and summary["test_nll"] > 0
    rows = (out / "loss.csv").read_text().splitlines()
    assert rows[0].startswith("phase,step") and len(rows) == 1 + 6 + 3
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    engine = Engine.load(out / "checkpoint", max_context=1024)
    ids = load_tokenizer(out / "checkpoint").encode("Why is the sky blue?").ids
    outputs = []
    for k in (0, 3):
        s = engine.session()
        stats = DecodeStats()
        outputs.append(list(decode(s, s.prefill(ids), 16, SamplingParams(), stop=set(), dspark=k, stats=stats)))
    assert outputs[0] == outputs[1] and stats.drafted > 0


def test_side_by_side_blocks_draft_as_decoding_drafts(data_dir):
    """The training layout of many anchors' blocks gives each block's first draft the logits DSpark.draft gives
    after a prefill of the text before its anchor (rows attend to their own block and its anchor's window)."""
    t = trainer(data_dir, seq_len=96)
    x = t.validation[:90]
    anchors = torch.tensor([5, 17, 40, 63])  # within, at and past the first window of 16
    with torch.no_grad():
        model = t.model()
        out = model.forward(TrainState(), Tokens(x))
        greedy = out.logits.argmax(-1)
        trained = draft_logits(model, t.masters, out.main_hidden, x, greedy, anchors)[0]
        b = t.args.dspark_block_size
        for m, q in enumerate(anchors.tolist()):
            plain = t.model()
            state = TrainState()
            prefix = plain.forward(state, Tokens(x[:q]))
            plain.dspark.write_context(state, prefix.main_hidden, torch.arange(q))
            _, logits, _ = plain.dspark.draft(state, int(x[q]))
            first = trained[m * b]
            assert int(first.argmax()) == int(logits[0].argmax())
            assert float((first - logits[0]).abs().max()) < 1e-2 * float(logits[0].abs().max()), q
