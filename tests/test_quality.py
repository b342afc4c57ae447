"""Quality gates (issue 21 item 5). The measurements (dsflash/train/quality.py) are checked here on a
smoke-trained checkpoint; the gates of the trained model run with `-m quality` (deselected by default: they
need the trained checkpoint, DSFLASH_TRAINED_MODEL, and the data of `dsflash train-data`,
DSFLASH_TRAIN_DATA)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dsflash.engine.session import Engine
from dsflash.tokenizer import load_tokenizer
from dsflash.train import data, quality
from dsflash.train.train_cmd import main as train_main
from tests.test_train import data_dir  # noqa: F401 (the fixture)

# the trained model's bounds, set from its measured values with a small margin (None: not measured yet)
TEST_NLL_MAX: float | None = None  # nats per token on the test split, CPU reference
NEEDLES_MIN: int | None = None  # of the 5 needles, 1500 tokens back (12 windows, 750 ratio-2 groups)
ACCEPT_MIN: float | None = None  # DSpark acceptance on held-out Python (aim >= 0.5)


@pytest.fixture(scope="module")
def smoke_checkpoint(data_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("smoke-run")
    assert train_main(["--data", str(data_dir), "--out", str(out), "--smoke", "--seq-len", "96", "--steps", "8",
                       "--dspark-steps", "4", "--eval-every", "100", "--eval-windows", "1", "--device", "cpu"]) == 0
    return out / "checkpoint"


def test_nll_of_the_checkpoint_is_the_trainers(data_dir, smoke_checkpoint):  # noqa: F811
    """The CPU reference's NLL of the saved weights is the one training measured on the same window."""
    measured = quality.nll(smoke_checkpoint, data.load_tokens(data_dir, "test"), 1, 96)
    summary = json.loads((smoke_checkpoint.parent / "train.json").read_text())
    assert abs(measured - summary["test_nll"]) < 1e-3 * summary["test_nll"], (measured, summary["test_nll"])
    assert 0 < measured < np.log(512) + 1


def test_drafting_is_measured_on_output_identical_to_plain_decoding(data_dir, smoke_checkpoint):  # noqa: F811
    engine = Engine.load(smoke_checkpoint, max_context=1024)
    prompts = quality.python_prompts(data.load_tokens(data_dir, "test"), 2, 24)
    d = quality.drafting(engine, prompts, 10, 3)
    assert d.identical and d.prompts == 2 and d.generated == 20
    assert 1.0 <= d.tokens_per_cycle <= 4.0 and 0.0 <= d.accept_rate <= 1.0 and d.speedup > 0


def test_needles_sit_the_asked_distance_back(smoke_checkpoint):
    engine = Engine.load(smoke_checkpoint, max_context=1024)
    tokenizer = load_tokenizer(smoke_checkpoint)
    found = quality.needles(engine, tokenizer, "The quick brown fox jumps over the lazy dog. " * 40, 120, n=4)
    assert [f.word for f in found] == list(quality.NEEDLE_WORDS)
    assert all(f.distance == 120 for f in found)
    assert all(f.recalled == f.answer.strip().lower().startswith(f.word.lower()) for f in found)


@pytest.mark.quality
def test_trained_model_passes_its_gates():
    model = Path(os.environ.get("DSFLASH_TRAINED_MODEL", "build/trained/checkpoint"))
    data_root = Path(os.environ.get("DSFLASH_TRAIN_DATA", "build/train-data"))
    assert (model / "model.safetensors").is_file(), f"{model}: no trained checkpoint (python3 -m dsflash.train." \
        "train_cmd --data build/train-data --out build/trained)"
    r = quality.report(model, data_root)
    print(json.dumps(r, indent=2))
    assert r["drafting"]["identical"]
    for name, bound in (("TEST_NLL_MAX", TEST_NLL_MAX), ("NEEDLES_MIN", NEEDLES_MIN), ("ACCEPT_MIN", ACCEPT_MIN)):
        assert bound is not None, f"{name}: set it from the measured values printed above"
    assert r["test_nll"] <= TEST_NLL_MAX
    assert r["needles_recalled"] >= NEEDLES_MIN
    assert r["drafting"]["accept_rate"] >= ACCEPT_MIN
