"""Quality gates (issue 21 item 5). The measurements (dsflash/train/quality.py) are checked here on a
smoke-trained checkpoint. The gates of the trained model (slow) hold the checkpoint shipped as the built-in one
(dsflash/checkpoint/trained/) to its bounds on the held-out sample shipped beside it, so a fresh clone needs no
download; DSFLASH_TRAINED_MODEL and DSFLASH_TRAIN_DATA (a `dsflash train-data` directory) measure another run
before it is shipped."""

import json
import operator
import os
from pathlib import Path

import numpy as np
import pytest

from dsflash.bench import drafts
from dsflash.checkpoint import builtin
from dsflash.engine.session import Engine
from dsflash.tokenizer import load_tokenizer
from dsflash.train import data, quality
from dsflash.train.train_cmd import main as train_main
from tests.test_train import data_dir  # noqa: F401 (the fixture)

# the trained model's bounds, set from its measured values with a small margin (None: not measured yet)
# (the shipped model of 2026-12-07, run 13: run B's backbone -- run 11 of 2026-12-04, then on the H100 the copy
# warm-up with the gap first (bench/results/train-h100-gapfirst-warmup-2026-12-07.json), the repeats' reach to
# 4,096, facts and 1,581 DSpark steps -- its DSpark stages 3,798 more steps on the CPU (run 12,
# bench/results/train-cpu-run12-dspark-2026-12-07.json), then 610 on the chain's agreeing labels (run 13,
# bench/results/dspark-agreeing-cpu-2026-12-07.txt). CPU reference on a 2-core AMD EPYC: test NLL 3.556, DSpark
# acceptance at a fixed depth 4 30.4 % (2.23 tokens a cycle), needles 0 of 5; run 12: 3.556, 27.3 %, 0 of 5; run B:
# 3.556, 25.4 %, 0 of 5; run 11: 3.642, 21.2 % (23.8 % on an Intel Xeon), 0 of 5). Acceptance moves with the CPU:
# torch's kernels for another instruction set sum in another order, and greedy near-ties follow -- the margin
# covers the 2.6 points seen between the two
TEST_NLL_MAX: float | None = 3.65  # nats per token on the shipped sample (16K test-split tokens), CPU reference
ACCEPT_MIN: float | None = 0.27  # DSpark acceptance on held-out Python at depth 4 (aim >= 0.5)
# of the 5 needles, 1500 tokens back (12 windows, 750 ratio-2 groups): unset while the shipped model recalls
# none (it copies within its window, bench/results/induction-gapfirst-runB-cpu-2026-12-07.md, not from 1,500
# tokens back): test_trained_model_recalls_needles is a strict xfail
NEEDLES_MIN: int | None = None


@pytest.fixture(scope="module")
def smoke_checkpoint(data_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("smoke-run")
    assert train_main(["--data", str(data_dir), "--out", str(out), "--smoke", "--seq-len", "96", "--steps", "8",
                       "--dspark-steps", "4", "--eval-every", "100", "--eval-windows", "1", "--device", "cpu"]) == 0
    return out / "checkpoint"


@pytest.mark.slow  # the smoke run and its decodings: ~20-30 s each on 2 cores
def test_nll_of_the_checkpoint_is_the_trainers(data_dir, smoke_checkpoint):  # noqa: F811
    """The CPU reference's NLL of the saved weights is the one training measured on the same window."""
    measured = quality.nll(smoke_checkpoint, data.load_tokens(data_dir, "test"), 1, 96)
    summary = json.loads((smoke_checkpoint.parent / "train.json").read_text())
    assert abs(measured - summary["test_nll"]) < 1e-3 * summary["test_nll"], (measured, summary["test_nll"])
    assert 0 < measured < np.log(512) + 1


@pytest.mark.slow  # the smoke run and its decodings: ~20-30 s each on 2 cores
def test_drafting_is_measured_on_output_identical_to_plain_decoding(data_dir, smoke_checkpoint):  # noqa: F811
    engine = Engine.load(smoke_checkpoint, max_context=1024)
    prompts = drafts.python_prompts(data.load_tokens(data_dir, "test"), 2, 24)
    d = drafts.drafting(engine, prompts, 10, 3)
    assert d.identical and d.prompts == 2 and d.generated == 20
    assert 1.0 <= d.tokens_per_cycle <= 4.0 and 0.0 <= d.accept_rate <= 1.0 and d.speedup > 0


@pytest.mark.slow  # with the two above: the smoke run's fixture then runs in the slow set only
def test_needles_sit_the_asked_distance_back(smoke_checkpoint):
    engine = Engine.load(smoke_checkpoint, max_context=1024)
    tokenizer = load_tokenizer(smoke_checkpoint)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    filler = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids)
    found = quality.needles(engine, tokenizer, filler, 120, n=4)
    assert [f.word for f in found] == list(quality.NEEDLE_WORDS)
    assert all(f.distance == 120 for f in found)
    assert all(f.recalled == f.answer.strip().lower().startswith(f.word.lower()) for f in found)


def gate_failures(r: dict, bounds: dict[str, float | None]) -> list[str]:
    """The gates a `quality.report` fails, an unset bound counting as failed (it holds the model to nothing)."""
    out = [] if r["drafting"]["identical"] else ["the drafted output differs from plain decoding"]
    for name, value, holds in (("TEST_NLL_MAX", r["test_nll"], operator.le),
                               ("NEEDLES_MIN", r["needles_recalled"], operator.ge),
                               ("ACCEPT_MIN", r["drafting"]["accept_rate"], operator.ge)):
        if bounds[name] is None:
            out.append(f"{name} is unset: set it from the measured {value} with a small margin")
        elif not holds(value, bounds[name]):
            out.append(f"{name} = {bounds[name]}, measured {value}")
    return out


def test_a_gate_with_no_bound_fails():
    r = {"test_nll": 3.0, "needles_recalled": 4, "drafting": {"identical": True, "accept_rate": 0.6}}
    bounds = {"TEST_NLL_MAX": 3.1, "NEEDLES_MIN": 4, "ACCEPT_MIN": 0.5}
    assert gate_failures(r, bounds) == []
    assert gate_failures(r, {**bounds, "ACCEPT_MIN": None}) == [
        "ACCEPT_MIN is unset: set it from the measured 0.6 with a small margin"]
    assert gate_failures({**r, "test_nll": 3.2}, bounds) == ["TEST_NLL_MAX = 3.1, measured 3.2"]
    assert len(gate_failures({**r, "drafting": {"identical": False, "accept_rate": 0.6}}, bounds)) == 1


@pytest.fixture(scope="module")
def trained_report() -> dict:
    """quality.report of the shipped checkpoint (or $DSFLASH_TRAINED_MODEL) on its held-out sample; skipped only
    while none is shipped, and a damaged one fails."""
    model = Path(os.environ.get("DSFLASH_TRAINED_MODEL", builtin.TRAINED))
    if model == builtin.TRAINED:
        if not builtin.shipped(model):
            pytest.skip(f"no trained checkpoint is shipped in {model} (python3 -m dsflash.train.ship RUN --data "
                        "DATA puts one there)")
        builtin.check_trained(model)
    r = quality.report(model, Path(os.environ.get("DSFLASH_TRAIN_DATA", model / builtin.HELDOUT)))
    print(json.dumps(r, indent=2))
    return r


@pytest.mark.slow
def test_trained_model_passes_its_gates(trained_report):
    """Test NLL and DSpark acceptance within their bounds, drafted output identical to plain decoding."""
    failures = gate_failures(trained_report, {"TEST_NLL_MAX": TEST_NLL_MAX, "NEEDLES_MIN": 0, "ACCEPT_MIN": ACCEPT_MIN})
    assert not failures, failures


@pytest.mark.slow
@pytest.mark.xfail(NEEDLES_MIN is None, strict=True,
                   reason="the shipped model recalls 0 of 5 needles (issue 21); one that recalls any sets NEEDLES_MIN")
def test_trained_model_recalls_needles(trained_report):
    assert trained_report["needles_recalled"] >= (NEEDLES_MIN or 1), trained_report["needles"]


@pytest.mark.slow
def test_serve_without_a_model_continues_shakespeare_in_english(tmp_path):
    """`dsflash serve` with no arguments serves the shipped model: through the real `openai` client, greedy
    continuations of three passages (two of Shakespeare, one of the King James Bible) are mostly words the
    held-out Shakespeare uses (random token ids: 5-20 %). Three passages, not one: a single 40-token answer
    swung the share by +-10 % between models of like quality (a run of stage directions names characters the
    sample lacks)."""
    import re

    import openai

    from tests.conftest import free_port, start_server

    if not builtin.shipped(builtin.TRAINED):
        pytest.skip(f"no trained checkpoint is shipped in {builtin.TRAINED}")
    tokenizer = load_tokenizer(builtin.TRAINED)
    sample = quality.Heldout.read(builtin.TRAINED / builtin.HELDOUT, tokenizer)
    known = set(re.findall(r"[a-z]+", tokenizer.decode(sample.filler.tolist()).lower()))
    passages = ("Friends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him.\n",
                "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.\n",
                "In the beginning God created the heaven and the earth.\n")
    port = free_port()
    proc = start_server(["-m", "dsflash.cli", "serve", "--port", str(port)], port, timeout=300)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answers = [client.chat.completions.create(
            model="deepseek-v4.1-flash", max_tokens=64, temperature=0,
            messages=[{"role": "user", "content": "Continue this text:\n\n" + passage}]).choices[0].message.content
            for passage in passages]
    finally:
        proc.kill()
    words = re.findall(r"[a-z]+", " ".join(answers).lower())
    assert len(words) >= 30 and sum(w in known for w in words) >= 0.6 * len(words), answers
