"""Layer ranges over devices in one process (`Transformer(ranges=)`, `--pp N --gpus LIST`): each layer's
weights and state on its range's device, the streams moved at the boundaries, the KV sources read across
them, the routed experts off the device in an expert store a range; bit-identical to one device. On the CPU
every range is on `cpu` and the boundaries run the same code (copies included); the CUDA tests at the end
map the ranges to two GPUs, or to one GPU three times (`--gpus 0,0,0`)."""

import argparse
import json
import random
from pathlib import Path

import pytest
import torch

from dsflash.bench.model import build_engine
from dsflash.checkpoint.reader import Checkpoint
from dsflash.cli import main
from dsflash.config import preset
from dsflash.engine.placement import layer_devices
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine, Session
from dsflash.engine.spec import decode
from dsflash.model import state as state_module
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.model.tiers import Tiers
from dsflash.model.transformer import Transformer
from tests.conftest import TEXT_CASE
from tests.test_expert_tiers import expert_bytes

CASE = TEXT_CASE  # tiny-a: 6 layers, the split at 3, KV sources 1 and 3, Engram at 0 and 1, DSpark taps 4, 5
# uneven on purpose: Engram layer 1 off the hashing range, the taps 4 and 5 in two ranges, source 3 read across
UNEVEN = [(range(0, 1), "cpu"), (range(1, 5), "cpu"), (range(5, 6), "cpu")]
THIRDS = [(range(0, 2), "cpu"), (range(2, 4), "cpu"), (range(4, 6), "cpu")]  # --pp 3: a boundary in each half
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=3)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 511) for _ in range(n)]


@pytest.fixture(scope="module")
def whole():
    return load_model(CASE)


@pytest.fixture(scope="module")
def engines():
    return Engine.load(CASE), Engine.load(CASE, ranges=THIRDS)


@pytest.fixture(scope="module", params=["gpu", "host", "disk"], ids=["resident", "host", "disk"])
def ranged(request, engines) -> Engine:
    """The engine over THIRDS with the routed experts resident, or on the host or disk tier through a 3-slot
    cache a range (fewer than a layer's 4 experts: every range's calls load in groups and evict)."""
    if request.param == "gpu":
        return engines[1]
    tiers = Tiers(experts=request.param, expert_cache=3 * expert_bytes(Checkpoint(CASE)))
    return Engine.load(CASE, ranges=THIRDS, tiers=tiers)


def _tensors(obj, seen: set[int]):
    """The tensors an object of the model holds (its weights), walking attributes and containers; not the
    kernels, the checkpoint, the shared RoPE tables, the config or an expert store (its host tier's banks
    are host memory: a store's device is its kernels')."""
    if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool, range)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, seen)
    elif hasattr(obj, "__dict__"):
        for key, v in vars(obj).items():
            if key not in ("k", "ckpt", "rope", "ropes", "args", "w", "store"):
                yield from _tensors(v, seen)


def test_the_map_is_honoured(whole):
    model = load_model(CASE, ranges=UNEVEN)
    assert model.layer_devices == {i: torch.device("cpu") for i in range(6)}
    for rg, (layers, _) in zip(model.ranges, UNEVEN, strict=True):
        assert rg.layers == layers
        for i in layers:
            block = model.blocks[i]
            # built by its range's kernels (their device is the map's), every weight on that device
            assert block.k is rg.k and block.attn.k is rg.k and block.ffn.k is rg.k
            held = list(_tensors(block, set())) + list(_tensors(model.engram.get(i), set()))
            assert len(held) > 10 and all(t.device == model.layer_devices[i] for t in held)
    assert model.k is model.ranges[-1].k and model.device == model.ranges[-1].device
    assert model.input_device == model.ranges[0].device
    # a range that starts past the first reads source 3 through a copy on its own device
    assert model._reads == [set(), set(), {3}]
    state = SequenceState()
    model.forward(state, torch.tensor(prompt(40)))
    assert state.layers == model.layer_devices
    for table in (state.window, state.raw, state.compressed, state.index_keys):
        for layer, t in table.items():
            data = t.data if hasattr(t, "data") else t.buffer
            assert data.device == model.layer_devices[layer]
    with pytest.raises(ValueError, match=r"ranges \[\(0, 2\), \(3, 6\)\] do not cover layers 0-5 in order"):
        load_model(CASE, ranges=[(range(0, 2), "cpu"), (range(3, 6), "cpu")])


@pytest.mark.slow  # ~14 s on 2 cores
def test_logits_are_one_devices_in_any_chunking(whole, monkeypatch):
    ids = prompt(90, seed=1)
    ref = whole.forward(SequenceState(), torch.tensor(ids))
    copies = []
    real_copy = state_module.GrowingRows.copy_to
    monkeypatch.setattr(state_module.GrowingRows, "copy_to", lambda self, d: copies.append(d) or real_copy(self, d))
    for ranges in (UNEVEN, THIRDS):
        model = load_model(CASE, ranges=ranges)
        for size in (1, 7, 64):
            state, logits, hidden = SequenceState(), [], []
            for i in range(0, len(ids), size):
                out = model.forward(state, torch.tensor(ids[i:i + size]))
                logits.append(out.logits)
                hidden.append(out.main_hidden)
            assert torch.equal(torch.cat(logits), ref.logits), (ranges, size)
            assert torch.equal(torch.cat(hidden), ref.main_hidden)
    assert copies  # the boundaries read the sources of other ranges through copies


def test_halves_over_ranges_hand_off_the_same_streams(engines):
    """The encoder half over two ranges gives the single-device hand-off and layer-3 entries."""
    plain, ranged = (e.encoder.runner.model for e in engines)
    assert [len(r.layers) for r in ranged.ranges] == [2, 1]
    ids = torch.tensor(prompt(50, seed=2))
    a, b = (m.forward(SequenceState(), ids) for m in (plain, ranged))
    for x, y in ((a.handoff_streams, b.handoff_streams), (a.handoff_pre_mix, b.handoff_pre_mix),
                 *zip(a.source_entries, b.source_entries, strict=True)):
        assert torch.equal(x, y)


def test_steps_and_rollbacks_equal_the_unsplit_engine(ranged, whole):
    rng = random.Random(5)
    ids = prompt(70, seed=5)
    ref = whole.forward(SequenceState(), torch.tensor(ids)).logits
    s = ranged.session()
    assert torch.equal(s.prefill(ids[:23], chunk=9), ref[22])
    while s.pos < len(ids):
        real = ids[s.pos:s.pos + rng.randint(1, 4)]
        junk = [rng.randrange(3, 511) for _ in range(rng.randint(0, 8 - len(real)))]
        p = s.pos
        assert torch.equal(s.step(p, real + junk)[: len(real)], ref[p:p + len(real)])
        s.rollback(p + len(real))
    assert s.tokens == ids


# ~18 s on 2 cores: slow; the default run has DSpark == plain decoding (test_engine) and split == one process
@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_dspark_decoding_equals_the_unsplit_plain_decoding(engines, params):
    plain, ranged = engines
    for seed in range(3):
        ids = prompt(20 + 9 * seed, seed=seed)
        s = plain.session()
        want = list(decode(s, s.prefill(ids), 12, params, stop=set()))
        for k in (0, 2):
            s = ranged.session()
            assert list(decode(s, s.prefill(ids), 12, params, stop=set(), dspark=k)) == want, (seed, k)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_each_range_runs_its_experts_from_a_store_on_its_device(tier):
    """Experts off the device over UNEVEN: each range's MoE layers (on the last range also DSpark's stages)
    in a store of its own, built by the range's kernels with a cache of the --expert-cache size each (2
    slots: fewer than the experts any layer here routes to); a prefill in two chunks and DSpark greedy
    decoding (its drafts' experts from the last range's store) give the resident single device's logits and
    tokens, and every store loaded and evicted."""
    tiers = Tiers(experts=tier, expert_cache=2 * expert_bytes(Checkpoint(CASE)))
    engine = Engine.load(CASE, ranges=UNEVEN, tiers=tiers)
    a = engine.args
    halves = (engine.encoder.runner.model, engine.decoder.model)
    for model in halves:
        assert len(model.expert_stores) == len(model.ranges)
        for rg in model.ranges:
            store = rg.w.experts
            assert store.k is rg.k and store.slots == 2
            dspark = range(a.n_layers, a.n_layers + a.n_mtp_layers) if rg is model.ranges[-1] and model.dspark else ()
            assert sorted(store.layers) == [*rg.layers, *dspark]
            assert all(model.blocks[i].ffn.store is store for i in rg.layers)
    plain = Engine.load(CASE)
    ids = prompt(60, seed=4)
    x, y = plain.session(), engine.session()
    assert torch.equal(x.prefill(ids), y.prefill(ids, chunk=32))
    x, y = plain.session(), engine.session()
    assert list(decode(y, y.prefill(ids[:30]), 8, GREEDY, stop=set(), dspark=2)) == \
        list(decode(x, x.prefill(ids[:30]), 8, GREEDY, stop=set()))
    stores = [s for m in halves for s in m.expert_stores]
    assert all(s.stats.misses > 0 and s.stats.evictions > 0 for s in stores), [s.stats for s in stores]
    assert engine.tier_stats()["experts"]["misses"] == sum(s.stats.misses for s in stores)


def test_snapshots_move_between_layouts(engines):
    """A snapshot made over layer ranges restores on one device and the other way round (the identity and
    the bits are the layout's), and the restored state sits on the model's devices."""
    plain, ranged = engines
    assert plain.identity == ranged.identity
    ids = prompt(60, seed=7)
    fresh = plain.session().prefill(ids)
    for made, restored in ((ranged, plain), (plain, ranged)):
        first = made.session()
        first.prefill(ids[:37])
        resumed = Session.restore(restored, first.snapshot())
        resumed.prefill(ids[37:])
        assert torch.equal(resumed.last_logits, fresh)
        model = restored.decoder.model
        assert all(r.data.device == model.layer_devices[i] for i, r in resumed.state.window.items())


@pytest.mark.slow  # ~10 s on 2 cores; the default run keeps test_split_with_ranges_on_both_sides_equals_one_process
def test_tiny_b_over_four_ranges(tmp_path_factory):
    """tiny-b (12 layers, window 8, three ratio-2 sources, three DSpark stages) as --pp 4: steps with
    rollbacks and DSpark decoding equal one device's."""
    from dsflash.checkpoint.make import make_checkpoint
    from dsflash.config import PRESETS

    ckpt = make_checkpoint(PRESETS["tiny-b"], 11, tmp_path_factory.mktemp("tinyb"))
    quarters = [(range(i, i + 3), "cpu") for i in range(0, 12, 3)]
    whole = load_model(ckpt)
    ranged = Engine.load(ckpt, max_context=4096, ranges=quarters)
    assert [len(r.layers) for r in ranged.encoder.runner.model.ranges] == [3, 3]
    rng = random.Random(3)
    ids = [rng.randrange(3, 500) for _ in range(50)]
    ref = whole.forward(SequenceState(), torch.tensor(ids)).logits
    s = ranged.session()
    assert torch.equal(s.prefill(ids[:11], chunk=4), ref[10])
    while s.pos < len(ids):
        real = ids[s.pos:s.pos + rng.randint(1, 4)]
        p = s.pos
        assert torch.equal(s.step(p, real + [7] * rng.randint(0, 8 - len(real)))[: len(real)], ref[p:p + len(real)])
        s.rollback(p + len(real))
    plain = Engine.load(ckpt, max_context=4096)
    x, y = plain.session(), ranged.session()
    want = list(decode(x, x.prefill(ids[:30]), 10, SEEDED, stop=set()))
    assert list(decode(y, y.prefill(ids[:30]), 10, SEEDED, stop=set(), dspark=3)) == want


def test_split_with_ranges_on_both_sides_equals_one_process(engines):
    """A real `dsflash box --pp 3` process (the encoder's three layers, one a range) and a back half over two
    ranges give the single process's logits, steps and DSpark decoding."""
    from dsflash.split.link import box_half
    from tests.test_split import BoxProcess, free_port

    box = BoxProcess(free_port(), flags=("--max-context", "4096", "--pp", "3")).start()
    try:
        split = Engine.load(CASE, encoder=box_half(f"127.0.0.1:{box.port}"),
                            ranges=[(range(3, 4), "cpu"), (range(4, 6), "cpu")])
        assert [len(r.layers) for r in split.decoder.model.ranges] == [1, 2]
        plain = engines[0]
        ids = prompt(60, seed=8)
        a, b = plain.session(), split.session()
        assert torch.equal(a.prefill(ids, chunk=16), b.prefill(ids, chunk=16))
        assert torch.equal(a.step(a.pos, [5, 6, 7]), b.step(b.pos, [5, 6, 7]))
        x, y = plain.session(), split.session()
        assert list(decode(x, x.prefill(ids), 8, SEEDED, stop=set())) == \
            list(decode(y, y.prefill(ids), 8, SEEDED, stop=set(), dspark=2))
    finally:
        box.kill()


def _generate(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["generate", "--model", str(CASE), "-n", "6", "--json", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_runs_layer_ranges(tmp_path, capsys):
    prompt_file = tmp_path / "p.json"
    prompt_file.write_text(json.dumps(prompt(30, seed=9)))
    base = ["--prompt-tokens", str(prompt_file), "--device", "cpu"]
    code, one, _ = _generate(base, capsys)
    assert code == 0
    code, three, err = _generate([*base, "--pp", "3"], capsys)
    assert code == 0 and "pp 3 x tp 1 x ep 1" in err
    assert json.loads(three)["tokens"] == json.loads(one)["tokens"]
    # the routed experts on disk, a store a range
    code, tiered, err = _generate([*base, "--pp", "3", "--experts", "disk"], capsys)
    assert code == 0 and "experts disk" in err
    tiered = json.loads(tiered)
    assert tiered["tokens"] == json.loads(one)["tokens"] and tiered["tiers"]["experts"]["misses"] > 0


@pytest.mark.parametrize("flags,line", [
    ("--device cpu --pp 4", "--pp 4: the 6 layers 0-5 do not divide into 4 equal ranges"),
    ("--device cuda --gpu-memory 8GiB --gpus 0,99 --pp 2", "--gpus 0,99: "),  # + "GPU 99 not on this machine"
    ("--device cuda --gpu-memory 8GiB --gpus 0 --pp 2", "--gpus 0: 1 GPU(s) for --pp 2 layer ranges"),
    # with ranks: one GPU a rank of each range, consecutive from --device (ranks.follower_device), before any starts
    ("--device cuda --gpu-memory 8GiB --gpus 2 --pp 2 --tp 2", "--gpus 0,1: 2 GPU(s) for --pp 2 x --ep 1 --tp 2 "
     "ranks"),
    ("--device cuda --gpu-memory 8GiB --gpus 0,1,3,4 --pp 2 --ep 2", "--gpus 0,1,3,4: ranks run on consecutive GPUs "
     "from --device cuda (--device cuda:0 --gpus 4 for these)"),
])
def test_bad_layer_ranges_are_refused_in_one_line(flags, line, tmp_path, capsys):
    prompt_file = tmp_path / "p.json"
    prompt_file.write_text("[0, 5, 6]")
    code, _, err = _generate(["--prompt-tokens", str(prompt_file), *flags.split()], capsys)
    last = err.strip().splitlines()[-1]
    assert code != 0 and last.startswith(f"dsflash generate: {line}") and "Traceback" not in err
    assert "99" not in flags or "GPU 99 not on this machine (it has" in last


def _cuda_ranges(devices: list[str]) -> list[tuple[range, str]]:
    return [(range(2 * i, 2 * i + 2), d) for i, d in enumerate(devices)]


CUDA_LAYOUTS = [pytest.param(["cuda:0", "cuda:0", "cuda:0"], id="gpus-0,0,0"),
                pytest.param(["cuda:0", "cuda:1", "cuda:0"], id="gpus-0,1,0", marks=pytest.mark.skipif(
                    torch.cuda.device_count() < 2, reason="needs two CUDA devices"))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run on the GPU machine")
@pytest.mark.parametrize("devices", CUDA_LAYOUTS)
@pytest.mark.parametrize("tier", ["gpu", "host", "disk"])
def test_layer_ranges_on_cuda_are_one_devices_bits(devices, tier):
    """On the H200 (one GPU mapped three times) and on a machine with two: the map is honoured, and prefill
    logits, steps with rollbacks and DSpark decoding equal the single-device engine's (CUDA graphs there,
    eager over ranges), with the routed experts resident or off the device (a store a range, its cache on
    the range's GPU; the drafts' graphs load the stages' experts into the last range's)."""
    ranges = _cuda_ranges(devices)
    tiers = Tiers(experts=tier)
    model: Transformer = load_model(CASE, device="cuda:0", ranges=ranges, tiers=tiers)
    for i, dev in model.layer_devices.items():
        assert dev == torch.device(devices[i // 2])
        assert all(t.device == dev for t in _tensors(model.blocks[i], set()))
    assert all(store.k.device == rg.device for rg in model.ranges if (store := rg.w.experts) is not None)
    ids = prompt(80, seed=1)
    ref = load_model(CASE, device="cuda:0").forward(SequenceState(device="cuda:0"), torch.tensor(ids)).logits
    state = SequenceState(device="cuda:0")
    got = torch.cat([model.forward(state, torch.tensor(ids[i:i + 16])).logits for i in range(0, 80, 16)])
    assert torch.equal(got.to(ref.device), ref)
    assert all(r.data.device == model.layer_devices[i] for i, r in state.window.items())
    plain = Engine.load(CASE, device="cuda:0", max_context=4096)
    ranged = Engine.load(CASE, device="cuda:0", max_context=4096, ranges=ranges, tiers=tiers)
    rng = random.Random(2)
    s = ranged.session()
    s.prefill(ids[:20], chunk=7)
    while s.pos < len(ids):
        real = ids[s.pos:s.pos + rng.randint(1, 4)]
        p = s.pos
        step = s.step(p, real + [9] * rng.randint(0, 8 - len(real)))[: len(real)]
        assert torch.equal(step.to(ref.device), ref[p:p + len(real)])
        s.rollback(p + len(real))
    for params in (GREEDY, SEEDED):
        x, y = plain.session(), ranged.session()
        want = list(decode(x, x.prefill(ids[:40]), 10, params, stop=set()))
        assert list(decode(y, y.prefill(ids[:40]), 10, params, stop=set(), dspark=2)) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run on the GPU machine")
def test_generate_on_one_gpu_mapped_thrice(tmp_path, capsys):
    prompt_file = Path(tmp_path) / "p.json"
    prompt_file.write_text(json.dumps(prompt(30, seed=9)))
    base = ["--prompt-tokens", str(prompt_file), "--device", "cuda"]
    code, one, _ = _generate(base, capsys)
    assert code == 0
    code, thrice, err = _generate([*base, "--gpus", "0,0,0", "--pp", "3"], capsys)  # a boundary in each half
    assert code == 0 and "pp 3 x tp 1 x ep 1" in err
    assert json.loads(thrice)["tokens"] == json.loads(one)["tokens"]


@pytest.mark.slow  # three engines and a bench run: ~14 s on 2 cores
def test_bench_runs_layer_ranges(tmp_path):
    """`dsflash bench --pp N` times the halves over N layer ranges: each half cut where the ranges cut it, the
    logits those of one range, the layout in the results."""
    args = preset("tiny-a")
    ns = argparse.Namespace(pp=3, tp=1, ep=1, gpus=None, device="cpu")
    ranged = build_engine(args, "cpu", cuda_graphs=False, ranges=layer_devices(ns, args, "all"))
    d = args.first_decoder_layer
    cuts = [[(rg.layers.start, rg.layers.stop) for rg in runner.model.ranges]
            for runner in (ranged.encoder.runner, ranged.decoder)]
    assert cuts == [[(0, 2), (2, d)], [(d, 4), (4, 6)]]
    ids = list(range(3, 40))
    want = build_engine(args, "cpu", cuda_graphs=False).session().prefill(ids)
    assert torch.equal(ranged.session().prefill(ids), want)
    assert main(["bench", "step", "--preset", "tiny-a", "--device", "cpu", "--context", "40", "--rows", "1",
                     "--reps", "1", "--warmup-s", "0", "--pp", "3", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("engine-step-tiny-a-pp3-*.json")).read_text())
    assert result["layout"] == {"pp": 3, "ep": 1, "tp": 1, "devices": ["cpu"]} and result["box_step_ms"]
