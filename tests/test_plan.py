"""The memory plan: its totals are the checkpoint's stored bytes, its state is the model's state layout, the
released layouts fit, sizes parse, and a command whose plan does not fit stops before reading a tensor."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsflash.checkpoint import reader
from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.make import make_checkpoint
from dsflash.checkpoint.reader import Checkpoint, read_layout
from dsflash.cli import main
from dsflash.config import TINY_A, preset
from dsflash.engine.plan import WEIGHT_PARTS, GiB, PlacementError, Request, layer_ranges, parse_size, plan, state_bytes
from dsflash.engine.session import Engine
from dsflash.model.tiers import Tiers
from tests.conftest import TEXT_CASE as CASE

ROOT = Path(__file__).resolve().parents[1]
# bytes per element, written out here rather than taken from dsflash
ELEMENT = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}
V41 = preset("v41-flash")
TIB = 1 << 40


def _stored(args) -> dict[str, int]:
    return {name: math.prod(shape) * ELEMENT[dtype] for name, (dtype, shape) in expected_tensors(args).items()}


@pytest.mark.parametrize("engram,experts", [("gpu", "gpu"), ("host", "host"), ("disk", "disk"), ("host", "disk")])
def test_v41_totals_are_the_stored_bytes(engram, experts):
    stored = _stored(V41)
    placed = plan(V41, Request(half="all", gpu_memory=(TIB,), host_memory=TIB, engram=engram, experts=experts))
    totals = placed.totals()
    assert sum(totals[p] for p in WEIGHT_PARTS) == sum(stored.values())
    # each part on its tier, nothing counted twice
    experts_bytes = sum(n for name, n in stored.items() if name.startswith("layers.") and ".ffn.experts." in name)
    engram_bytes = sum(n for name, n in stored.items() if ".engram.embed." in name)
    assert totals["experts"] == experts_bytes and totals["engram"] == engram_bytes
    where = {"gpu": placed.gpus[0], "host": placed.host, "disk": placed.disk}
    assert where[experts].parts["experts"] == experts_bytes and where[engram].parts["engram"] == engram_bytes
    # one process holding both halves loads the embedding (and layer 20's attention norm) twice
    d = V41.first_decoder_layer
    assert totals["copies"] == stored["embed.weight"] + stored[f"layers.{d}.attn_norm.weight"]


def test_halves_split_the_weights():
    stored = _stored(V41)
    halves = {h: plan(V41, Request(half=h, gpu_memory=(TIB,), host_memory=TIB, engram="gpu", experts="gpu")).totals()
              for h in ("box", "back")}
    weights = {h: sum(t.get(p, 0) for p in WEIGHT_PARTS) for h, t in halves.items()}
    d = V41.first_decoder_layer
    assert weights["box"] + weights["back"] == sum(stored.values()) + stored["embed.weight"] + \
        stored[f"layers.{d}.attn_norm.weight"]
    assert "engram" in halves["box"] and "engram" not in halves["back"]
    assert "dspark" in halves["back"] and "vision" in halves["box"]
    # the measurements of the released layout (GiB, one decimal)
    assert round(halves["box"]["engram"] / GiB, 1) == 188.8 and round(halves["box"]["experts"] / GiB, 1) == 134.5


def test_state_is_the_model_state_layout(tmp_path):
    """The plan's per-session state (growing buffers at their rows) equals what a prefill of that many tokens
    leaves in the encoder's and the decoder's SequenceState, ring by ring."""
    ckpt = make_checkpoint(TINY_A, 3, tmp_path)
    context = 100
    session = Engine.load(ckpt).session()
    session.sync(list(range(1, context + 1)), chunk=32)
    states = [session.encoder.state, session.state]
    actual = sum(r.data.nbytes for s in states for table in (s.window, s.raw) for r in table.values())
    actual += sum(r.rows.nbytes for s in states for table in (s.compressed, s.index_keys) for r in table.values())
    actual += session.encoder.state.engram_ids.rows.nbytes
    planned = state_bytes(TINY_A, "all", context, growth=1)
    head = planned.pop("head")  # the DSpark rings: made by the first draft; the session's input ring: now
    assert sum(planned.values()) == actual
    dspark = TINY_A.n_mtp_layers * (TINY_A.window_size + 64) * TINY_A.head_dim * 2
    assert head == dspark + session._main_hidden.data.nbytes
    split = state_bytes(TINY_A, "box", context, growth=1), state_bytes(TINY_A, "back", context, growth=1)
    assert sum(split[0].values()) == sum(r.data.nbytes for t in (states[0].window, states[0].raw) for r in t.values()) \
        + sum(r.rows.nbytes for t in (states[0].compressed, states[0].index_keys) for r in t.values()) \
        + states[0].engram_ids.rows.nbytes


@pytest.mark.parametrize("text,n", [("140GiB", 140 * GiB), ("512GiB", 512 * GiB), ("256KiB", 256 << 10),
                                    ("1.5TiB", 3 << 39), ("4096", 4096), ("8 mib", 8 << 20), ("12B", 12)])
def test_sizes_parse(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "140GB", "1.5", "-3GiB", "12x", "1e3", "3 GiB extra"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(PlacementError, match="expected a byte count or a number with KiB, MiB, GiB or TiB"):
        parse_size(text)


def test_bad_size_flag_is_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "v41-flash", "--gpu-memory", "140GB"])
    assert "--gpu-memory: size '140GB'" in capsys.readouterr().err


LAYOUTS = {
    "a-host": "--half all --gpus 1 --gpu-memory 140GiB --host-memory 512GiB --experts host",
    "a-disk": "--half all --gpus 1 --gpu-memory 140GiB --host-memory 512GiB --experts disk",
    "b-box": "--half box --gpus 2 --gpu-memory 140GiB --host-memory 512GiB --engram host",
    "b-back": "--half back --gpus 1 --gpu-memory 140GiB --host-memory 512GiB",
    "c": "--half all --gpus 8 --gpu-memory 140GiB --host-memory 64GiB",
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_released_layouts_fit_and_print(name, capsys):
    argv = ["plan", "--preset", "v41-flash", *LAYOUTS[name].split()]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert table.rstrip().endswith("fits") and "routed experts" in table and "KV/state" in table
    assert main([*argv, "--json"]) == 0
    placed = json.loads(capsys.readouterr().out)
    assert placed["fits"] and placed["problem"] is None
    for g in placed["gpus"]:
        assert g["used"] <= g["capacity"] == 140 * GiB
    assert placed["host"]["used"] <= placed["host"]["capacity"]
    covered = [i for g in placed["gpus"] if "layers" in g for i in range(g["layers"][0], g["layers"][1] + 1)]
    d = V41.first_decoder_layer
    want = {"box": range(0, d), "back": range(d, V41.n_layers), "all": range(V41.n_layers)}[placed["half"]]
    assert covered == list(want)  # each layer on one GPU, in order


def test_eight_gpus_spread_the_layers(capsys):
    assert main(["plan", "--preset", "v41-flash", *LAYOUTS["c"].split(), "--json"]) == 0
    placed = json.loads(capsys.readouterr().out)
    assert placed["experts"] == "gpu" and sum("layers" in g for g in placed["gpus"]) >= 3


def test_layout_that_does_not_fit_names_the_fix(capsys):
    argv = ["plan", "--preset", "v41-flash", "--gpus", "1", "--gpu-memory", "140GiB", "--host-memory", "512GiB"]
    assert main([*argv, "--experts", "gpu"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("does not fit: ") and " GiB of the plan does not fit on 1 GPU(s)" in last
    assert "--experts host would fix it" in last
    assert main([*argv, "--experts", "host", "--engram", "host", "--host-memory", "300GiB"]) == 1
    assert "--experts disk would fix it" in capsys.readouterr().out


def test_plan_of_a_checkpoint_reads_headers_only(tmp_path, monkeypatch, capsys):
    ckpt = make_checkpoint(TINY_A, 0, tmp_path, shards=2)
    monkeypatch.setattr(reader, "safe_open", _forbidden)
    assert main(["plan", "--model", str(ckpt), "--device", "cpu", "--host-memory", "8GiB", "--json"]) == 0
    placed = json.loads(capsys.readouterr().out)
    stored = sum(e - b for f in ckpt.glob("*.safetensors") for b, e in read_layout(f)[1].values())
    assert sum(placed["totals"].get(p, 0) for p in WEIGHT_PARTS) == stored


def _forbidden(*_, **__):
    raise AssertionError("a tensor was read")


def test_refused_before_any_tensor_is_read(tmp_path, monkeypatch, capsys):
    ckpt = make_checkpoint(TINY_A, 0, tmp_path)
    prompt = tmp_path / "prompt.json"
    prompt.write_text("[0, 5, 6, 7]")
    reads = []
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: reads.append(name))
    monkeypatch.setattr(reader, "safe_open", _forbidden)
    assert main(["generate", "--model", str(ckpt), "--prompt-tokens", str(prompt), "--device", "cpu",
                 "--host-memory", "512MiB"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert reads == []
    assert err[-1].startswith("dsflash generate: ") and " GiB of the plan does not fit in host memory" in err[-1]
    assert "--host-memory would fix it" in err[-1]
    assert any(line.startswith("dsflash generate: plan: half all, cpu") for line in err)  # the plan, printed first
    assert main(["box", "--model", str(ckpt), "--device", "cpu", "--host-memory", "1MiB"]) == 2
    assert "does not fit in host memory" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["serve", "--model", str(ckpt), "--device", "cpu", "--host-memory", "1MiB"]) == 1
    assert "does not fit in host memory" in capsys.readouterr().err.strip().splitlines()[-1]
    assert reads == []


def test_refused_in_a_subprocess_on_garbage_weights(tmp_path):
    """Valid headers over a data region of 0xFF bytes (NaN in every FP8 tensor): a run that reads any
    tensor fails on the NaN; the refused one never gets there."""
    ckpt = make_checkpoint(TINY_A, 0, tmp_path)
    path = ckpt / "model.safetensors"
    data_start = min(b for b, _ in read_layout(path)[1].values())
    with open(path, "r+b") as f:
        f.seek(data_start)
        f.write(b"\xff" * (path.stat().st_size - data_start))
    prompt = tmp_path / "prompt.json"
    prompt.write_text("[0, 5, 6, 7]")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "dsflash.cli", "generate", "--model", str(ckpt), "--prompt-tokens", str(prompt),
            "--device", "cpu", "-n", "1"]
    refused = subprocess.run([*base, "--host-memory", "512MiB"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr and "NaN" not in refused.stderr
    assert "does not fit in host memory" in refused.stderr.strip().splitlines()[-1]
    loaded = subprocess.run([*base, "--host-memory", "64GiB"], capture_output=True, text=True, env=env, timeout=120)
    assert loaded.returncode == 1 and "holds NaN" in loaded.stderr  # the garbage is found once a tensor is read


def test_runs_this_build_cannot_do_are_refused_with_the_plan_pointer(tmp_path, capsys):
    ckpt = make_checkpoint(TINY_A, 0, tmp_path)
    assert main(["box", "--model", str(ckpt), "--device", "cpu", "--gpus", "2"]) == 2
    assert "--gpus 2: the CPU backend has one device" in capsys.readouterr().err
    assert main(["box", "--model", str(ckpt), "--device", "cpu",
                 "--pp", "2", "--tp", "2"]) == 1  # before a rank starts: the box's 3 layers do not divide
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dsflash box: --pp 2: the 3 layers 0-2 do not " \
        "divide into 2 equal ranges"


def test_cpu_backend_defaults_to_resident_tiers():
    placed = plan(TINY_A, Request(half="all", backend="cpu", host_memory=64 * GiB))
    assert (placed.engram, placed.experts) == ("gpu", "gpu") and placed.fits
    assert placed.gpus[0].name == "cpu" and "experts" in placed.gpus[0].parts


def test_cuda_defaults_offload_what_does_not_fit():
    roomy = plan(V41, Request(half="back", gpu_memory=(140 * GiB,), host_memory=512 * GiB))
    assert (roomy.experts, roomy.fits) == ("host", True)  # the back's experts alone exceed one H200
    tight = plan(V41, Request(half="all", gpu_memory=(140 * GiB,), host_memory=64 * GiB))
    assert (tight.engram, tight.experts, tight.fits) == ("disk", "disk", True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA device's free memory")
def test_cuda_default_is_the_free_device_memory(capsys):
    free = torch.cuda.mem_get_info(0)[0]
    assert main(["plan", "--preset", "tiny-a", "--device", "cuda", "--host-memory", "8GiB", "--json"]) == 0
    placed = json.loads(capsys.readouterr().out)
    assert abs(placed["gpus"][0]["capacity"] - free) < 256 << 20  # what the device had free (less what torch took)


@pytest.mark.parametrize("host,fix", [(384, "(--experts disk would fix it)"), (256, "(--experts disk --engram disk "
                                      "would fix it)"), (16, "(--host-memory would fix it)")])
def test_cpu_refusal_names_the_fewest_flags(host, fix):
    placed = plan(V41, Request(half="all", backend="cpu", host_memory=host * GiB, context=65536))
    assert not placed.fits and placed.problem().endswith(fix)


def test_generate_context_is_the_planned_and_the_engine_limit(tmp_path, capsys):
    ckpt = make_checkpoint(TINY_A, 0, tmp_path)
    prompt = tmp_path / "prompt.json"
    prompt.write_text("[0, 5, 6]")
    assert main(["generate", "--model", str(ckpt), "--prompt-tokens", str(prompt), "--device", "cpu", "-n", "4",
                 "--context", "5", "--json"]) == 1
    err = capsys.readouterr().err
    assert "plan: half all, cpu, context 5 x 1 session(s)" in err
    # 3 prompt tokens and 4 to generate: 7, refused before any is computed (as the server counts max_tokens)
    assert err.strip().splitlines()[-1] == "dsflash generate: this request needs 7 tokens of context; the model's " \
        "limit is 5"


# Parallel layouts: the per-rank bytes are recomputed here from the expected tensors with the rules written out
# (TP splits these tensors equally over the ranks; EP gives rank e the experts of ids [e*n/ep, (e+1)*n/ep); rank 0
# holds everything else and the state)
TP_SPLIT_HERE = (".attn.wq_b.", ".attn.attn_sink", ".attn.wo_a.", ".attn.wo_b.", ".attn.wq_a.", ".attn.wkv.",
                 ".shared_experts.")
GPUS8 = (140 * GiB,) * 8


def _routed(name: str) -> bool:
    return name.startswith("layers.") and ".ffn.experts." in name


def test_expert_parallel_gives_each_rank_its_slice_of_experts():
    stored = _stored(V41)
    placed = plan(V41, Request(half="all", gpu_memory=GPUS8, host_memory=512 * GiB, ep=8))
    assert placed.fits and placed.experts == "gpu" and len(placed.gpus) == 8
    total = sum(n for name, n in stored.items() if _routed(name))
    per_rank = [g.parts["experts"] for g in placed.gpus]
    assert per_rank[0] * 8 == total and len(set(per_rank)) == 1
    for e, g in enumerate(placed.gpus):  # rank e: experts 48e .. 48e+47 of every layer
        mine = sum(n for name, n in stored.items() if _routed(name) and int(name.split(".")[4]) // 48 == e)
        assert g.parts["experts"] == mine
    # the dense weights and the state are rank 0's, which runs the model
    dense = sum(n for name, n in stored.items() if name.startswith(("layers.", "norm", "head", "embed"))
                and not _routed(name) and ".engram.embed." not in name)
    assert placed.gpus[0].parts["dense"] == dense and "state" in placed.gpus[0].parts
    assert all(set(g.parts) == {"experts", "dspark", "workspace"} for g in placed.gpus[1:])


def test_tensor_parallel_splits_heads_columns_and_vocabulary():
    stored = _stored(V41)
    box = [name for name in stored if name.startswith("layers.") and int(name.split(".")[1]) < 20]
    placed = plan(V41, Request(half="box", gpu_memory=(140 * GiB,) * 2, host_memory=512 * GiB, tp=2, engram="host",
                               experts="host"))
    g0, g1 = placed.gpus
    assert placed.fits
    split = {n for n in box if any(p in n for p in TP_SPLIT_HERE)}
    assert not any(_routed(n) for n in split) and g1.parts["dense"] == sum(stored[n] for n in split) // 2
    whole = sum(stored[n] for n in box if n not in split and not _routed(n) and ".engram.embed." not in n)
    layer20 = sum(stored[n] for n in ("layers.20.attn_norm.weight", "layers.20.attn.indexer.k_norm.weight",
                                      "layers.20.attn.indexer.wk.weight") if n in stored)
    layer20 += sum(n for name, n in stored.items() if name.startswith("layers.20.attn.compressor."))
    # rank 0 holds its half of every split tensor, the rest whole (the embedding, the box's layer-20 cache write)
    assert g0.parts["dense"] == g1.parts["dense"] + whole + stored["embed.weight"] + layer20
    # the routed experts are not split by --tp: rank 0's, here from host memory through its expert cache
    assert placed.host.parts["experts"] == sum(stored[n] for n in box if _routed(n))
    assert g0.parts["cache"] > 0 and "cache" not in g1.parts
    one = plan(V41, Request(half="box", gpu_memory=(140 * GiB,), host_memory=512 * GiB, engram="host",
                            experts="host"))
    assert g0.parts["dense"] < one.gpus[0].parts["dense"] and g0.parts["state"] == one.gpus[0].parts["state"]
    assert "state" not in g1.parts


def test_layer_ranges_hold_each_stage_once():
    stored = _stored(V41)
    placed = plan(V41, Request(half="all", gpu_memory=GPUS8[:4], host_memory=512 * GiB, pp=4, engram="host"))
    assert [g.layers[0] for g in placed.gpus] == [0, 10, 20, 30] and [len(g.layers) for g in placed.gpus] == [10] * 4
    totals = placed.totals()
    assert sum(totals[p] for p in WEIGHT_PARTS) == sum(stored.values())  # nothing replicated with --pp alone
    for g, first in zip(placed.gpus, (0, 10, 20, 30), strict=True):
        want = sum(n for name, n in stored.items() if _routed(name) and first <= int(name.split(".")[1]) < first + 10)
        assert g.parts["experts"] == want
    assert "vision" in placed.gpus[0].parts and "dspark" in placed.gpus[3].parts
    assert "dspark" not in placed.gpus[0].parts


def test_layer_ranges_hold_an_expert_cache_on_each_gpu():
    """`--pp` with the routed experts in host memory: none on a GPU, and each GPU the cache of its range (one
    layer's bank by default, else --expert-cache); a range across the split (--pp 5: layers 16-23) holds one
    for each half's model."""
    stored = _stored(V41)
    bank = sum(n for name, n in stored.items() if name.startswith("layers.0.ffn.experts."))
    for pp, caches, size in ((4, [1, 1, 1, 1], None), (5, [1, 1, 2, 1, 1], None), (4, [1, 1, 1, 1], 8 * GiB)):
        placed = plan(V41, Request(half="all", gpu_memory=(140 * GiB,) * pp, host_memory=512 * GiB, pp=pp,
                                   engram="host", experts="host", expert_cache=size))
        assert [g.parts["cache"] for g in placed.gpus] == [(size or bank) * c for c in caches]
        assert not any("experts" in g.parts for g in placed.gpus) and placed.fits
        assert placed.host.parts["experts"] == sum(n for name, n in stored.items() if _routed(name))


@pytest.mark.parametrize("pp", [1, 3])
def test_the_planned_expert_caches_are_the_engines(pp):
    """On the CPU backend the plan's expert cache is what the engine allocates: a store for each half's part
    of each layer range, one layer's bank each (tiny-a without --pp: one a half; --pp 3: four, the middle
    range 2-3 spanning the split at 3)."""
    placed = plan(Checkpoint(CASE), Request(half="all", backend="cpu", host_memory=64 * GiB, experts="disk", pp=pp))
    ranges = [(r, "cpu") for r in layer_ranges(range(TINY_A.n_layers), pp)] if pp > 1 else None
    engine = Engine.load(CASE, tiers=Tiers(experts="disk"), ranges=ranges)
    stores = [s for m in (engine.encoder.runner.model, engine.decoder.model) for s in m.expert_stores]
    assert len(stores) == {1: 2, 3: 4}[pp]
    assert placed.gpus[0].parts["cache"] == sum(s.slots * s.slot_bytes for s in stores)


@pytest.mark.parametrize("flags,line", [
    ("--pp 3", "--pp 3: the 40 layers 0-39 do not divide into 3 equal ranges"),
    ("--half back --pp 3", "--pp 3: the 20 layers 20-39 do not divide into 3 equal ranges"),
    ("--tp 3", "--tp 3: the model's 64 attention heads do not divide by 3"),
    ("--gpus 16 --tp 16", "--tp 16: the model's 8 output groups (o_groups) do not divide by 16"),
    ("--gpus 5 --ep 5", "--ep 5: the 384 routed experts of layers.0.ffn.experts do not divide by 5"),
    ("--gpus 4 --ep 8", "--gpus: 4 GPU(s) for --pp 1 x --tp 1 x --ep 8 = 8 ranks (one GPU a rank)"),
    ("--gpus 0,0", "--gpus 0,0: a GPU named twice needs a layout (--pp, --tp or --ep) to give each rank its part"),
])
def test_layouts_that_do_not_divide_are_refused_naming_the_flag(flags, line, capsys):
    argv = ["plan", "--preset", "v41-flash", "--gpu-memory", "140GiB", "--host-memory", "512GiB", *flags.split()]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"dsflash plan: {line}"


@pytest.mark.slow  # ~7 s on 2 cores (a plan per GPU layout)
def test_gpus_take_a_count_or_a_list(capsys):
    base = ["plan", "--preset", "v41-flash", "--gpu-memory", "140GiB", "--host-memory", "512GiB", "--json"]
    for flags, ids in (("--gpus 3", [0, 1, 2]), ("--gpus 0", [0]), ("--gpus 4,", [4]), ("--gpus 2,5 --pp 2", [2, 5]),
                       ("--pp 2", [0, 1]), ("--half box --tp 2 --ep 2", [0, 1])):  # no --gpus: one a rank
        assert main([*base, *flags.split()]) == 0
        assert [g["name"] for g in json.loads(capsys.readouterr().out)["gpus"]] == [f"GPU {i}" for i in ids]
    assert main([*base, "--gpus", "2,5,7", "--pp", "4"]) == 2
    assert "--gpus: 3 GPU(s) for --pp 4 x --tp 1 x --ep 1 = 4 ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--gpus", "0,x"])
    assert "--gpus: '0,x': expected a GPU count (2) or a list of GPU ids (0,1,2)" in capsys.readouterr().err


def test_one_gpu_named_for_two_ranges_holds_both():
    """`--gpus 0,0 --pp 2`: one GPU column with both stages (its capacity counted once)."""
    req = dict(half="back", host_memory=512 * GiB, experts="host")
    twice = plan(V41, Request(gpu_memory=(140 * GiB,) * 2, gpu_ids=(0, 0), pp=2, **req))
    (g,) = twice.gpus
    assert g.capacity == 140 * GiB and g.layers == list(range(20, 40))
    two = plan(V41, Request(gpu_memory=(140 * GiB,) * 2, pp=2, **req))
    for part in ("dense", "dspark", "state", "workspace", "cache"):
        assert g.parts[part] == sum(x.parts.get(part, 0) for x in two.gpus)


PARALLEL = {
    "ep8": "--half all --gpus 8 --ep 8 --gpu-memory 140GiB --host-memory 512GiB",
    "box-tp2-ep2": "--half box --gpus 2 --tp 2 --ep 2 --gpu-memory 140GiB --host-memory 256GiB --engram host",
    "box-ep2": "--half box --gpus 2 --ep 2 --gpu-memory 140GiB --host-memory 256GiB --engram host",
}


@pytest.mark.parametrize("name", list(PARALLEL))
def test_parallel_layouts_of_the_note_fit(name, capsys):
    """The layouts docs/placement.md quotes: each fits, the experts on the GPUs, rank 0 (the driver) holding the
    state and the most."""
    assert main(["plan", "--preset", "v41-flash", *PARALLEL[name].split(), "--json"]) == 0
    placed = json.loads(capsys.readouterr().out)
    assert placed["fits"] and placed["experts"] == "gpu"
    driver, *followers = placed["gpus"]
    assert len({json.dumps(g["parts"]) for g in followers}) == 1  # the followers of one stage alike
    assert "state" in driver["parts"] and all(g["used"] < driver["used"] for g in followers)
