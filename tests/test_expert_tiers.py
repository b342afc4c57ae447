"""Routed experts on the host and disk tiers (model/expert_cache.py): a device cache of expert slots smaller
than one layer's bank gives the resident bits for a prefill, steps, a rollback and DSpark drafts, with its
evictions, hits and bytes read counted."""

import json

import pytest
import torch

from dsflash.checkpoint.reader import Checkpoint
from dsflash.engine.graphs import SegmentGraphs
from dsflash.engine.runner import Runner
from dsflash.engine.session import Engine
from dsflash.kernels import cpu
from dsflash.model import expert_cache
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.model.tiers import Tiers
from tests.conftest import TEXT_CASE

CASE = TEXT_CASE  # tiny-a: 4 routed experts a layer, top-2; 6 layers and one DSpark stage
IDS = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(0))


def expert_bytes(ckpt: Checkpoint, prefix: str = "layers.0.ffn.experts.0.") -> int:
    """One expert's stored bytes (w1, w3, w2 and their scales): its slot's size on the reference backend."""
    total = 0
    for name in ("w1", "w3", "w2"):
        for suffix in (".weight", ".scale"):
            _, begin, end = ckpt.byte_range(prefix + name + suffix)
            total += end - begin
    return total


def run(engine: Engine) -> list[torch.Tensor]:
    """Prefill logits, two steps, a rollback inside them and a step after it, then DSpark drafts."""
    s = engine.session()
    out = [s.prefill(IDS[:70].tolist(), chunk=64)]
    p = s.pos
    out.append(s.step(p, IDS[70:73].tolist()))
    out.append(s.step(p + 3, IDS[73:74].tolist()))
    s.rollback(p + 1)
    out.append(s.step(p + 1, IDS[80:82].tolist()))
    out.append(torch.tensor(s.draft(int(IDS[81]))))
    return out


@pytest.fixture(scope="module")
def resident() -> list[torch.Tensor]:
    return run(Engine.load(CASE, max_context=512))


@pytest.mark.parametrize("tier", ["disk", "host"])
@pytest.mark.parametrize("slots,wide", [(3, True), (3, False), (9, False)], ids=["3-slots-wide", "3-slots", "9-slots"])
def test_cached_experts_are_bit_identical_to_resident(resident, monkeypatch, tier, slots, wide):
    """3 slots (fewer than a layer's 4 experts: every call in groups, evicting) and 9 (one group a call):
    wide calls (on the reference backend every chunk pads to 64 rows, 128 picks) split into two groups and
    read ahead; with the threshold out of reach a call that fits is one group, the resident calls over slots."""
    if not wide:
        monkeypatch.setattr(expert_cache, "WIDE_PICKS_PER_EXPERT", 1 << 30)
    tiers = Tiers(experts=tier, expert_cache=slots * expert_bytes(Checkpoint(CASE)))
    engine = Engine.load(CASE, max_context=512, tiers=tiers)
    got = run(engine)
    for i, (a, b) in enumerate(zip(got, resident, strict=True)):
        assert torch.equal(a, b), i
    stats = [half.model.tier_stats()["experts"] for half in (engine.decoder, engine.encoder.runner)]
    # each half's MoE layers hold 12 or 16 experts: more than the cache, so slots are reused; 9 slots keep
    # some experts from call to call
    assert all(s["misses"] > 0 and s["evictions"] > 0 and (s["hits"] > 0) == (slots == 9) for s in stats), stats
    assert all(s["bytes_read"] >= s["misses"] * expert_bytes(Checkpoint(CASE)) for s in stats), stats


def test_disk_reads_count_the_bytes(monkeypatch):
    """A cache that holds every expert: each (layer, expert) is read once, its stored bytes exactly, and a
    second forward over the same rows reads nothing."""
    monkeypatch.setattr(expert_cache, "WIDE_PICKS_PER_EXPERT", 1 << 30)  # no reads ahead: only what is routed to
    ckpt = Checkpoint(CASE)
    model = load_model(CASE, tiers=Tiers(experts="disk", expert_cache=64 * expert_bytes(ckpt)))
    resident = load_model(CASE)
    for m in (model, resident):
        m.out = m.forward(SequenceState(), IDS[:40]).logits
    assert torch.equal(model.out, resident.out)
    stats = model.tier_stats()["experts"]
    used = stats["misses"]
    assert 0 < used <= 6 * 4 and stats["evictions"] == 0 and stats["prefetched"] == 0
    assert stats["bytes_read"] == used * expert_bytes(ckpt)
    model.forward(SequenceState(), IDS[:40])
    again = model.tier_stats()["experts"]
    assert (again["bytes_read"], again["misses"], again["hits"]) == (stats["bytes_read"], used, stats["hits"] + used)
    assert resident.tier_stats() == {}


def test_reads_ahead_count_and_a_cache_too_small_is_refused():
    """A wide call reads its next group's and the next layer's experts ahead, and the loads take those reads;
    a cache smaller than one expert is refused with the size it needs."""
    ckpt = Checkpoint(CASE)
    model = load_model(CASE, tiers=Tiers(experts="disk", expert_cache=2 * expert_bytes(ckpt)))
    model.forward(SequenceState(), IDS[:40])
    for store in model.expert_stores:
        store.close()  # the reads in flight finished (and counted)
    stats = model.tier_stats()["experts"]
    # each loaded expert read once (a read ahead taken, not repeated), plus the reads ahead not routed to
    assert stats["prefetched"] > stats["ahead_unused"], stats
    assert stats["bytes_read"] == (stats["misses"] + stats["ahead_unused"]) * expert_bytes(ckpt), stats
    with pytest.raises(ValueError, match="holds no expert"):
        load_model(CASE, tiers=Tiers(experts="disk", expert_cache=expert_bytes(ckpt) - 1))


def test_tier_stats_reach_metrics_and_generate_json(capsys, monkeypatch, tmp_path):
    """The expert cache's counters, summed over the halves, in /metrics' text and in `generate --json`."""
    from dsflash.cli import main
    from dsflash.server.metrics import Metrics

    engine = Engine.load(CASE, max_context=512, tiers=Tiers(experts="disk"))
    engine.session().prefill(IDS[:20].tolist())
    m = Metrics()
    m.tier_stats = engine.tier_stats
    text = m.render()
    total = engine.tier_stats()["experts"]
    assert f"dsflash_experts_misses_total {total['misses']}" in text and "dsflash_experts_hit_rate " in text
    halves = [h.model.tier_stats()["experts"]["bytes_read"] for h in (engine.decoder, engine.encoder.runner)]
    assert total["bytes_read"] == sum(halves) > 0
    assert Engine.load(CASE, max_context=512).tier_stats() == {}
    # generate's placement flags come from engine/placement.py; here its Engine.load is given the disk tier
    load = Engine.load
    monkeypatch.setattr(Engine, "load", lambda *a, **kw: load(*a, **{**kw, "tiers": Tiers(experts="disk")}))
    (tmp_path / "p.json").write_text(str(IDS[:12].tolist()))
    assert main(["generate", "--model", str(CASE), "--prompt-tokens", str(tmp_path / "p.json"), "-n", "3",
                 "--json", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["tokens"]) == 3 and report["tiers"]["experts"]["misses"] > 0, report


def test_bench_tiers_writes_a_checkpoint_and_compares_the_tiers(tmp_path):
    """`dsflash bench tiers` on the tiny preset: the slice written as real safetensors files, each tier's
    prefill streams the resident's bits, the disk tier's bytes counted, the results file written."""
    from dsflash.cli import main

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["bench", "--threads", "1", "tiers", "--preset", "tiny-a", "--layers", "2", "--dir", str(ckpt),
                 "--lengths", "64", "--context", "64", "--rows", "1", "--reps", "1", "--device", "cpu",
                 "--tiers", "gpu,host,disk,engram-disk", "--out", str(out)]) == 0
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["bench-0.safetensors", "bench-1.safetensors",
                                                                  "bench-rest.safetensors"]
    (result,) = out.glob("tiers-tiny-a-e4-l2-*.json")
    r = json.loads(result.read_text())
    assert list(r["tiers"]) == ["gpu", "host", "disk", "engram-disk"] and r["commit"] and r["machine"]
    streams = {t["prefill"]["64"]["streams"] for t in r["tiers"].values()}
    assert len(streams) == 1
    disk = r["tiers"]["disk"]
    assert disk["prefill"]["64"]["bytes_per_token"] > 0 and disk["steps"]["1"]["ms"] > 0
    # the Engram rows went through the disk tier's row cache (read in the warm-up, hits since)
    assert r["tiers"]["engram-disk"]["prefill"]["64"]["hit_rate"] == 1.0
    assert "| disk |" in result.with_suffix(".md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run on the GPU machine")
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cached_experts_are_bit_identical_on_cuda(tier):
    """On the Triton backend: host (pinned memory, side-stream copies) and disk (pread into pinned staging,
    codes converted on the device) through a 3-slot cache give the resident bits for a prefill (two groups
    a layer), steps (one group: the resident calls over slots) and a rollback; both engines' one-row steps
    replay CUDA graphs, the tiered one's one graph per layer with its experts loaded between them (its
    3-row steps route to more experts than the cache holds: eager)."""
    resident = Engine.load(CASE, device="cuda", max_context=512)
    probe = load_model(CASE, device="cuda", tiers=Tiers(experts=tier))
    slot_bytes = probe.expert_stores[0].slot_bytes
    del probe
    engine = Engine.load(CASE, device="cuda", max_context=512, tiers=Tiers(experts=tier, expert_cache=3 * slot_bytes))
    assert engine.decoder.graphs is not None and resident.decoder.graphs is not None
    outs = []
    for e in (resident, engine):
        s = e.session()
        out = [s.prefill(IDS[:70].tolist(), chunk=32)]
        p = s.pos
        for n in (3, 1):
            for _ in range(3):  # a graph is captured on the second step and replayed on the third
                out.append(s.step(p, IDS[70:70 + n].tolist()))
                s.rollback(p)
        out.append(s.step(p, IDS[70:71].tolist()))
        s.rollback(p + 1)
        out.append(s.step(p + 1, IDS[80:85].tolist()))
        outs.append(out)
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        assert torch.equal(a, b), i
    # segments past the first were captured: the layers' graphs resumed after their routing
    assert max(key[0][-1] for key in engine.decoder.graphs._graphs) == len(engine.decoder.model.layers)
    stats = engine.tier_stats()["experts"]
    # per miss: a host expert's copy in the kernels' layout, a disk expert's stored bytes
    per_expert = slot_bytes if tier == "host" else expert_bytes(Checkpoint(CASE))
    assert stats["evictions"] > 0 and stats["bytes_read"] >= stats["misses"] * per_expert > 0, stats


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_segmented_steps_with_cached_experts_are_bit_identical_on_cpu(tier):
    """Steps the way CUDA graphs run them with the experts off the device: one segment per layer, each
    stopping after its routing, the experts loaded into a 4-slot cache between segments (every layer
    evicts the previous one's), run uncaptured on the CPU: the eager resident forward's bits."""
    eager = load_model(CASE)
    tiers = Tiers(experts=tier, expert_cache=4 * expert_bytes(Checkpoint(CASE)))
    shaped = Runner(load_model(CASE, tiers=tiers), graphs=SegmentGraphs(max_rows=cpu.ROW_TILE, capture=False))
    segments = []
    run = shaped.graphs.run
    shaped.graphs.run = lambda key, fn, *inputs: (segments.append(key[-1]), run(key, fn, *inputs))[1]
    outs = []
    for model in (eager, shaped):
        state, out = SequenceState(), []
        model.forward(state, IDS[:70])
        for n in (1, 3, 8, 2):
            if n == 8:
                state.truncate(state.pos - 2, dict(enumerate(shaped.args.compress_ratios)))
            step = model.forward(state, IDS[state.pos:state.pos + n])
            out.append(torch.cat([step.logits, step.streams.flatten(1).float(), step.main_hidden.float()], 1))
        outs.append(torch.cat(out))
    assert torch.equal(*outs)
    layers = shaped.args.n_layers
    assert segments == list(range(layers + 1)) * 4  # every step replayed, one segment per layer and a last
    stats = shaped.model.tier_stats()["experts"]
    assert stats["evictions"] > 0 and stats["misses"] > 0, stats


@pytest.mark.parametrize("ranges", [None, [(range(0, 3), "cpu"), (range(3, 6), "cpu")]], ids=["one", "pp2"])
def test_segmented_drafts_with_cached_experts_are_bit_identical_on_cpu(ranges):
    """A DSpark draft the way its CUDA graphs run it with the stages' experts off the device (a graph per
    stage, the experts loaded between them), uncaptured on the CPU: the eager resident draft's tokens,
    logits and confidences, with one segment per stage and a last. Over two layer ranges (--pp 2: the
    forwards eager) the stages' experts come from the last range's store."""
    eager = load_model(CASE)
    tiers = Tiers(experts="disk", expert_cache=4 * expert_bytes(Checkpoint(CASE)))
    model = load_model(CASE, tiers=tiers, ranges=ranges)
    graphs = SegmentGraphs(max_rows=cpu.ROW_TILE, capture=False)
    segments = []
    run = graphs.run
    graphs.run = lambda key, fn, *inputs: (segments.append(key[0] if key[0] != "dspark" else key[-1]),
                                           run(key, fn, *inputs))[1]
    context = model.args.window_size + 2
    results = []
    for m, g in ((eager, None), (model, graphs)):
        state = SequenceState()
        out = m.forward(state, IDS[:context])
        m.dspark.write_context(state, out.main_hidden, 0)
        results.append([m.dspark.draft(state, anchor, graphs=g) for anchor in (5, 17)])
    for (tokens, logits, confidence), (tokens2, logits2, confidence2) in zip(*results, strict=True):
        assert tokens == tokens2 and torch.equal(logits, logits2) and torch.equal(confidence, confidence2)
    assert segments == [*range(model.args.n_mtp_layers + 1), "dspark-chain"] * 2
    assert model.dspark.stages[0].ffn.store is model.ranges[-1].w.experts
