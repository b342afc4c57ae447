"""The command-line tools as a user runs them (real subprocesses, real files)."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from dsflash.checkpoint.builtin import TRAINED
from dsflash.config import preset
from dsflash.numerics.packing import packed_width
from tests.conftest import TEXT_CASE
from tests.golden_stack import replay_outputs, router_probe

ROOT = Path(__file__).resolve().parents[1]
CASE = TEXT_CASE
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def dsflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsflash.cli", *args], env=ENV, capture_output=True, text=True,
                          timeout=600)


# four CLI processes (~11 s on 2 cores); tests/test_engine.py checks drafts == plain decoding by default
@pytest.mark.slow
def test_generate_json_same_tokens_with_and_without_dspark(tmp_path):
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps([int(t) for t in np.random.default_rng(1).integers(3, 511, 30)]))
    runs = []
    for extra in ([], ["--dspark", "2"], ["--temperature", "0.7", "--seed", "5"],
                  ["--temperature", "0.7", "--seed", "5", "--dspark", "2"]):
        r = dsflash("generate", "--model", str(CASE), "--prompt-tokens", str(prompt), "-n", "10", "--json", *extra)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout))
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[2]["tokens"] == runs[3]["tokens"]
    for run in runs:
        assert (run["prompt_tokens"], run["cached_tokens"], run["generated"], len(run["tokens"])) == (30, 0, 10, 10)
    # the report of what was decoded: without DSpark one token per cycle after the prefill's (10 in 9 cycles),
    # no drafts; with it the tiny checkpoint's seeded drafter is never right on this prompt (no draft equals
    # the greedy or the seeded sample), so nothing is accepted and the cycles are the same. Acceptance that is
    # counted where the verify rejected, or a cycle count that is off, shows here (real acceptance: test_engine)
    for run in runs:
        assert (run["accept_rate"], run["tokens_per_cycle"]) == (0.0, 10 / 9), run


def test_logits_command_replays_a_golden_case_bit_for_bit(tmp_path):
    """Chunked (20 rows), in a subprocess on all the cores: the same bytes as the in-process one-shot replay,
    and the reference's own where this CPU stack sums the router as the golden machine did
    (tests/golden_stack.py)."""
    golden = load_file(str(CASE / "golden.safetensors"))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(golden["full.input_ids"].tolist()))
    out = tmp_path / "out.safetensors"
    r = dsflash("logits", "--model", str(CASE), "--prompt-tokens", str(ids), "--out", str(out),
                "--replay", f"{CASE}:full.", "--chunk", "20")
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    one_shot = replay_outputs(CASE, weights=False)
    assert np.array_equal(got["logits"], one_shot["logits"])
    assert np.array_equal(got["handoff_streams"], one_shot["handoff_streams"])
    probe = router_probe(CASE)
    if not probe.reproduced:
        warnings.warn(probe.reason(), stacklevel=1)
        return
    assert np.array_equal(got["logits"], golden["full.logits"])
    assert np.array_equal(got["handoff_streams"], golden["full.handoff_streams"])


@pytest.mark.slow  # ~8 s on 2 cores: the default run keeps make-checkpoint's own tests (test_make_checkpoint.py)
def test_make_checkpoint_then_check_golden_refuses_a_non_case(tmp_path):
    r = dsflash("make-checkpoint", "--preset", "tiny-b", "--seed", "3", "--out", str(tmp_path / "tb"))
    assert r.returncode == 0, r.stderr
    r = dsflash("check-golden", str(tmp_path / "tb"))
    assert r.returncode != 0 and "unreadable case" in (r.stdout + r.stderr)


@pytest.mark.slow  # ~13 s on 2 cores: every bench command once
def test_bench_commands_write_results(tmp_path):
    r = dsflash("bench", "all", "--preset", "tiny-a", "--device", "cpu", "--context", "80", "--rows", "1,3",
                "--lengths", "300", "--reps", "1", "--compare-full", "--reference-layers", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    (result,) = tmp_path.glob("engine-all-tiny-a-*.json")
    data = json.loads(result.read_text())
    for key in ("gpu", "commit", "command", "checkpoint", "box_step_ms", "back_step_ms", "prefill_tok_s",
                "full_tok_s", "snapshot_bytes_per_token", "reference_speedup"):
        assert key in data, key
    assert set(data["prefill_tok_s"]) == {"300"}  # by prompt length (--lengths), not by step context
    assert data["decoder_rows"]["300"] < 300  # the encoder-only prefill ran the decoder on the tail only
    # (300 tokens: the tail triangle, window + 64 rollback rows + a window a layer, is longer than 100)
    # the growing caches are held packed: per source, a 288/68-B-style entry and key per `ratio` tokens
    a = preset("tiny-a")
    want = sum((packed_width(a.head_dim, 16) + packed_width(a.index_head_dim, 32)) * (300 // a.compress_ratios[s])
               for s in a.kv_source_layers) / 300
    assert data["cache_bytes_per_token"]["300"] == want
    assert data["cuda_graphs"] is True
    (report,) = tmp_path.glob("engine-all-tiny-a-*.md")
    text = report.read_text()  # the seed's published numbers and the targets under ours
    assert "7.2-7.8 ms" in text and "13,812" in text and "20,000 tok/s" in text
    for args, name in ((["--prefill"], "engine-profile-prefill-tiny-a-*.md"), ([], "engine-profile-tiny-a-*.md")):
        r = dsflash("bench", "profile", "--preset", "tiny-a", "--device", "cpu", "--context", "70", "--rows", "2",
                    *args, "--out", str(tmp_path))
        assert r.returncode == 0, r.stderr
        (report,) = tmp_path.glob(name)
        assert "aten::" in report.read_text()


def test_generate_without_a_model_uses_the_built_in_checkpoint(tmp_path):
    """`dsflash generate` works with no --model, as `serve` does: the built-in checkpoint and its tokenizer."""
    def generate(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dsflash.cli", "generate", "--prompt", "Hello there", "-n", "4",
                               *extra], env={**ENV, "DSFLASH_HOME": str(tmp_path)}, capture_output=True, text=True,
                              timeout=600)

    r = generate("--json")
    assert r.returncode == 0, r.stderr
    # the shipped trained checkpoint, or the seeded one made under DSFLASH_HOME
    used = Path(r.stderr.partition("using the built-in tiny checkpoint at ")[2].splitlines()[0])
    assert (used / "tokenizer.json").is_file() and used in (TRAINED, tmp_path / "builtin-tiny-a-s0-v3")
    out = json.loads(r.stdout)
    assert out["generated"] == 4 and isinstance(out["text"], str)
    # the text streamed, then one summary line; drafts reported only where DSpark drafted
    for extra, drafted in (([], False), (["--dspark", "2"], True)):
        r = generate(*extra)
        summary = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 0 and "decode" in summary and ("draft acceptance" in summary) == drafted, r.stderr


def test_threads_default_to_the_cores_this_process_may_use():
    """torch's CPU threads: --threads N on every command, else the process's CPU affinity (not the machine's
    cores); 0 is refused in one line."""
    import argparse

    import torch

    from dsflash import cli

    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert commands and all("--threads" in c.format_help() for c in commands.values()), list(commands)
    before = torch.get_num_threads()
    try:
        cli.set_threads(1)
        assert torch.get_num_threads() == 1
        cli.set_threads(None)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        r = dsflash("generate", "--model", str(CASE), "--prompt-tokens", "x.json", "--threads", "0")
        assert r.returncode != 0 and "Traceback" not in r.stderr and "--threads must be at least 1" in r.stderr
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # ~13 s on 2 cores: the default run keeps the tiers == resident at the engine (test_layer_ranges)
def test_generate_with_engram_and_experts_on_disk_gives_the_resident_tokens(tmp_path):
    """The placement flags end to end: `--engram disk --experts disk` with caches smaller than what the prompt
    touches (rows and experts read, experts evicted) give the resident run's tokens, and `--json` reports the
    tiers' counters; a cache that holds no expert is one line, not a traceback."""
    case = str(CASE.parent / "tinyA-w128_s1_T200")
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps([int(t) for t in np.random.default_rng(4).integers(3, 511, 40)]))
    common = ("generate", "--model", case, "--prompt-tokens", str(prompt), "-n", "8", "--json")
    plain = dsflash(*common)
    tiered = dsflash(*common, "--engram", "disk", "--engram-cache", "0", "--experts", "disk", "--expert-cache",
                     "120000")
    assert plain.returncode == 0 and tiered.returncode == 0, plain.stderr + tiered.stderr
    a, b = json.loads(plain.stdout), json.loads(tiered.stdout)
    assert a["tokens"] == b["tokens"] and "tiers" not in a
    assert b["tiers"]["experts"]["evictions"] > 0 and b["tiers"]["engram"]["rows_read"] > 0
    tiny = dsflash(*common, "--experts", "disk", "--expert-cache", "1000")
    assert tiny.returncode != 0 and "Traceback" not in tiny.stderr and "--expert-cache" in tiny.stderr


def test_weights_load_and_prefill_show_a_live_bar():
    """`Engine.load(loaded=...)` reports every layer of both halves once (the bar `generate`, `serve` and `box`
    show on stderr while the weights load), and the prefill bar counts the tokens to the prompt's end."""
    import io

    from dsflash.engine.progress import LayerCount, ProgressBar, local_layers
    from dsflash.engine.session import Engine

    out = io.StringIO()
    loading = LayerCount(local_layers(CASE, split=False), after_s=0, stream=out)
    seen = []
    engine = Engine.load(CASE, loaded=lambda i: (seen.append(i), loading(i)))
    loading.close()
    n = engine.args.n_layers
    assert sorted(seen) == list(range(n)) and local_layers(CASE, split=True) == n - engine.args.first_decoder_layer
    assert out.getvalue().rstrip("\n").split("\r")[-1].startswith(f"loading weights [{'#' * 24}] {n}/{n} layers")
    bar = ProgressBar("prefill", "tokens", after_s=0, stream=out)
    engine.session().sync(list(range(3, 43)), chunk=16, progress=bar)
    bar.close()
    assert "] 40/40 tokens" in out.getvalue().split("\r")[-1]
