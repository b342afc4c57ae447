"""Expert and tensor parallelism over gloo (docs/parallel.md): two real ranks, the follower a `dsflash follow`
process that rank 0 (this test process) starts, give one process's bits on tiny-b (prefill logits, random step
and rollback sequences, DSpark decoding), also with layer ranges (--pp 2: two stages, a follower each), and
`dsflash generate --ep 2` (and `--pp 2 --ep 2`) the one-process tokens. Lost ranks:
tests/test_parallel_faults.py (a process belongs to one group at a time)."""

import argparse
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.reader import DTYPE_SIZES
from dsflash.config import PRESETS, ConfigError
from dsflash.engine.plan import WEIGHT_PARTS, GiB, Request, plan
from dsflash.engine.ranks import start_ranks
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import DecodeStats, decode
from dsflash.kernels import load_kernels
from dsflash.kernels.cpu import linear
from dsflash.model.attention import head_outputs
from dsflash.model.load import load_model
from dsflash.model.parallel import Layout, expert_range, shard_rows
from dsflash.model.rope import Rope
from dsflash.model.state import SequenceState
from dsflash.model.tiers import Tiers
from tests.conftest import partly_right_drafter

LAYOUTS = {"ep2": Layout(ep=2), "tp2": Layout(tp=2), "ep2tp2": Layout(ep=2, tp=2),
           "ep2-host": Layout(ep=2), "ep2-disk": Layout(ep=2),  # --experts host / disk
           "pp2tp2": Layout(tp=2), "pp2ep2": Layout(ep=2), "pp2ep2-host": Layout(ep=2)}  # layer ranges, a
# follower each; their stages (tiny-b: 12 layers, the split at 6): --pp 2's halves, a stage each (what the plan
# cuts); and a cut at 4, whose second stage serves both halves' models (the encoder's layers 4-5, the decoder's)
HALVES = [(range(0, 6), "cpu"), (range(6, 12), "cpu")]
STAGES = {"pp2tp2": HALVES, "pp2ep2-host": HALVES, "pp2ep2": [(range(0, 4), "cpu"), (range(4, 12), "cpu")]}


@pytest.fixture(scope="module")
def tiny_b_dir(tmp_path_factory):
    from dsflash.checkpoint.make import make_checkpoint
    from dsflash.config import PRESETS

    return make_checkpoint(PRESETS["tiny-b"], 11, tmp_path_factory.mktemp("tinyb"))


@pytest.fixture(scope="module")
def one(tiny_b_dir):
    return Engine.load(tiny_b_dir, max_context=4096), load_model(tiny_b_dir)


# tp2's forwards broadcast the attended rows and gather heads at every layer: ~20 s a test on 2 cores, so its
# cases (and ep2tp2's, pp2tp2's) run with the slow set; ep2 and pp2ep2 keep the layouts' default coverage
@pytest.fixture(scope="module", params=["ep2", pytest.param("tp2", marks=pytest.mark.slow),
                                        pytest.param("ep2tp2", marks=pytest.mark.slow), "pp2ep2",
                                        pytest.param("pp2tp2", marks=pytest.mark.slow)])
def parallel(request, tiny_b_dir):
    """An engine whose halves are sharded over two gloo ranks (the follower a process of its own), or with
    layer ranges over two stages of two ranks each (rank 0 in both, a follower each: three processes)."""
    ranges = STAGES.get(request.param)
    sharding = start_ranks(LAYOUTS[request.param], tiny_b_dir, "cpu", timeout_s=30, ranges=ranges)
    tiers = Tiers(experts=request.param.partition("-")[2] or "gpu")
    try:
        yield Engine.load(tiny_b_dir, max_context=4096, parallel=sharding, tiers=tiers, ranges=ranges), sharding
    finally:
        sharding.close()


def test_each_rank_holds_only_its_shards(parallel, tiny_b_dir):
    """What each rank holds, and the plan's per-rank bytes of the layout: the follower's own count of the
    checkpoint bytes its shards took, and rank 0's everything else."""
    engine, sharding = parallel
    a = engine.args
    names = set(sharding.shards)
    if sharding.layout.ep > 1:  # every MoE layer of both halves and the DSpark stages, rank 0's experts only
        assert {f"layers.{i}.ffn." for i in range(a.n_layers)} <= names
        moe = engine.decoder.model.blocks[a.n_layers - 1].ffn
        assert not hasattr(moe, "w13") and len(sharding.shards[f"layers.{a.n_layers - 1}.ffn."].w2) == 4
    if sharding.layout.tp > 1:  # attention by heads, the column-parallel linears and the head, half of each
        assert {"head", "layers.0.attn.", "mtp.0.attn.", "layers.0.attn.wq_a", "layers.5.ffn.shared_experts.w2"} \
            <= names
        attn = engine.decoder.model.blocks[a.n_layers - 1].attn
        assert attn.tp is not None and not hasattr(attn, "wo_a") and not hasattr(attn, "wq_b")
        heads = sharding.shards[f"layers.{a.n_layers - 1}.attn."]
        assert heads.sink.numel() == a.n_heads // 2 and heads.wo_a.size(0) == a.o_groups // 2
        assert heads.wq_b.weight.out_features == a.n_heads * a.head_dim // 2
        head = sharding.shards["head"]
        assert head.weight.out_features == a.vocab_size // 2 and head.out == a.vocab_size
    assert expert_range(8, 2, 1) == range(4, 8) and shard_rows(512, 2, 1) == slice(256, 512)
    assert shard_rows(96, 2, 0) is None  # not whole 32-row blocks per rank: kept whole on rank 0
    layout, pp = sharding.layout, len(sharding.stages)

    def weights(pp: int, tp: int = 1, ep: int = 1) -> list[int]:
        """The plan's weight bytes on each GPU of a layout, one GPU a rank (rank = stage x 2 + r)."""
        placed = plan(PRESETS["tiny-b"], Request(half="all", gpu_memory=(GiB,) * pp * max(tp, ep), host_memory=GiB,
                                                 engram="host", experts="gpu", pp=pp, tp=tp, ep=ep))
        if tp * ep > 1:  # the stages' drivers hold the state, the followers none
            assert [("state" in g.parts) for g in placed.gpus] == [True, False] * pp
        return [sum(g.parts.get(p, 0) for p in WEIGHT_PARTS) for g in placed.gpus]

    # each stage's two ranks hold equal halves of what is split, a follower its shards only
    assert all(st.held[0] == st.held[1] > 0 for st in sharding.stages)
    planned = weights(pp, layout.tp, layout.ep)
    if pp == 1 or sharding.stages[0].layers == range(0, 6):  # the plan's stages (--pp cuts equal ranges)
        # per stage: the follower's bytes are the plan's, and the stage's two ranks hold its tensors once
        stage = [sum(math.prod(shape) * DTYPE_SIZES[dtype] for name, (dtype, shape) in expected_tensors(a).items()
                     if ".engram.embed." not in name)] if pp == 1 else weights(pp)  # Engram on the host tier
        for s, st in enumerate(sharding.stages):
            assert planned[2 * s + 1] == st.held[1] and planned[2 * s] == stage[s] - st.held[1]
    else:  # a cut the plan does not make: the stages' followers hold what one follower of one stage would
        assert sum(sharding.held[1:]) == sharding.held[0] == weights(1, layout.tp, layout.ep)[1]


def test_prefill_logits_equal_one_process(parallel, one):
    """Chunks over one 64-row tile (the by-expert MoE path on one device) and under it (the by-slot path)."""
    engine, _ = parallel
    rng = random.Random(3)
    ids = [rng.randrange(3, 500) for _ in range(150)]
    whole = one[1].forward(SequenceState(), torch.tensor(ids)).logits
    for chunk in (150, 37):
        s = engine.session()
        assert torch.equal(s.prefill(ids[:-3], chunk=chunk), whole[-4])
        assert torch.equal(s.step(len(ids) - 3, ids[-3:]), whole[-3:])  # each of the last rows' logits


def test_snapshots_move_between_a_parallel_engine_and_one_device(parallel, one):
    """A parallel layout keeps the one-device numerics, so a snapshot made by either restores on the other and
    the next steps' logits are the one process's."""
    engine, ref = parallel[0], one[0]
    assert engine.identity == ref.identity
    rng = random.Random(6)
    ids = [rng.randrange(3, 500) for _ in range(40)]
    whole = one[1].forward(SequenceState(), torch.tensor(ids)).logits
    for made, restored in ((engine, ref), (ref, engine)):
        s = made.session()
        s.prefill(ids[:30], chunk=16)
        r = type(s).restore(restored, s.snapshot())
        assert torch.equal(r.step(30, ids[30:34]), whole[30:34])
        assert torch.equal(r.step(34, ids[34:]), whole[34:])


# ~11 s for ep2 on 2 cores: every layout runs with the slow set
@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ep2", "tp2", "pp2ep2", "pp2tp2"], indirect=True)
def test_random_step_and_rollback_sequences_equal_one_process(parallel, one):
    """Steps of 1-8 rows with junk rolled back, some sessions resumed from a snapshot, against one process's
    whole-prompt logits (window 8: the rings wrap; ratio-2 sources: rollbacks land mid-group)."""
    engine, _ = parallel
    whole_model = one[1]
    rng = random.Random(5)
    for _ in range(3):
        n = rng.randint(30, 60)
        ids = [rng.randint(3, 500) for _ in range(n)]
        whole = whole_model.forward(SequenceState(), torch.tensor(ids)).logits
        s = engine.session()
        first = rng.randint(1, 20)
        assert torch.equal(s.prefill(ids[:first], chunk=rng.randint(1, 16)), whole[first - 1])
        while s.pos < n:
            real = ids[s.pos:s.pos + rng.randint(1, 4)]
            junk = [rng.randint(3, 500) for _ in range(rng.randint(0, 8 - len(real)))]
            p = s.pos
            assert torch.equal(s.step(p, real + junk)[: len(real)], whole[p:p + len(real)])
            s.rollback(p + len(real))
            if rng.random() < 0.3 and s.pos < n:
                s = type(s).restore(engine, s.snapshot())
        assert s.tokens == ids


# tp2 runs ~110 sharded linears a forward, each a round trip over the group: ~25 s a decoding on 2 cores
# ~11-23 s each: all run with the slow set (the default run's parallel tests check the layouts' plain decoding)
@pytest.mark.parametrize("parallel", [pytest.param(p, marks=pytest.mark.slow)
                                      for p in ("ep2", "tp2", "pp2ep2", "pp2tp2")], indirect=True)
@pytest.mark.parametrize("params", [SamplingParams(), pytest.param(SamplingParams(temperature=0.7, seed=5),
                                                                   marks=pytest.mark.slow)], ids=["greedy", "seeded"])
def test_dspark_decoding_equals_one_process(parallel, one, params):
    engine, ref = parallel[0], one[0]
    rng = random.Random(9)
    ids = [rng.randrange(3, 500) for _ in range(25)]
    s = ref.session()
    plain = list(decode(s, s.prefill(ids), 16, params, stop=set()))
    for drafter in (False, True):  # the tiny drafter (almost never right), then one mostly right
        s = engine.session()
        if drafter:
            s.draft = partly_right_drafter(s, len(ids), plain)
        stats = DecodeStats()
        assert list(decode(s, s.prefill(ids), 16, params, stop=set(), dspark=3, stats=stats,
                           adaptive=False)) == plain
        assert stats.drafted > 0 and (stats.accepted > 0 or not drafter)


def test_a_shard_sums_by_its_whole_weights_k_ranges():
    """A column shard of an FP8 weight whose K ranges follow the output count (8192 outputs over 128 K blocks:
    4 ranges; a 4096-row shard would take 8): with `k_range_out` each output is the whole weight's bits, and
    without it they differ -- the field is what keeps tensor parallelism identical at the released widths."""
    k = load_kernels("cpu")
    g = torch.Generator().manual_seed(0)
    codes = (torch.randn(8192, 4096, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(8192 // 32, 4096 // 32, generator=g) + 0.5
    x = torch.randn(3, 4096, generator=g).to(torch.bfloat16)
    whole = linear(x, k.weight("fp8", codes, scale))
    shard = k.weight("fp8", codes[4096:], scale[128:])
    assert not torch.equal(linear(x, shard), whole[:, 4096:])
    shard.k_range_out = 8192
    assert torch.equal(linear(x, shard), whole[:, 4096:])


@pytest.mark.slow  # ~6 s on 2 cores (the released wq_b's GEMMs); tiny-b's tp2 cases hold one group a rank too
def test_each_ranks_heads_give_their_columns_of_the_whole_layer_at_released_widths():
    """attention.head_outputs over each rank's heads (their wq_b rows with the whole weight's K ranges, sinks and
    wo_a groups), side by side, equals all heads at once at V4.1's widths (64 heads of 512, 8 groups) for 2, 4 and
    8 ranks -- with 8 a rank holds one group, which MKL's batched GEMM computes otherwise (cpu.grouped_linear)."""
    a, k, rows = PRESETS["v41-flash"], load_kernels("cpu"), 64
    g = torch.Generator().manual_seed(1)
    rope = Rope(a, True, k)
    positions = torch.arange(1000, 1000 + rows)
    rope.reserve(1000 + rows, positions.device)
    qr = torch.randn(rows, a.q_lora_rank, generator=g).to(torch.bfloat16)
    source = torch.randn(700, a.head_dim, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, 700, (rows, a.window_size + a.index_topk), generator=g)
    out = a.n_heads * a.head_dim
    codes = (torch.randn(out, a.q_lora_rank, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(out // 32, a.q_lora_rank // 32, generator=g) + 0.5
    sink = torch.randn(a.n_heads, generator=g)
    wo_a = (torch.randn(a.o_groups, a.o_lora_rank, out // a.o_groups, generator=g) / 50).to(torch.bfloat16)

    def heads(world: int, r: int) -> torch.Tensor:
        q_rows, h, grp = shard_rows(out, world, r), a.n_heads // world, a.o_groups // world
        wq_b = k.weight("fp8", codes[q_rows], scale[q_rows.start // 32:q_rows.stop // 32])
        wq_b.k_range_out = out
        return head_outputs(k, rope, qr, source, idx, positions, wq_b, sink[r * h:(r + 1) * h],
                            wo_a[r * grp:(r + 1) * grp], a.head_dim)

    whole = heads(1, 0)
    for world in (2, 4, 8):
        assert torch.equal(torch.cat([heads(world, r) for r in range(world)], dim=1), whole)


def test_bad_layouts_are_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--ep 0"):
        Layout(ep=0)
    with pytest.raises(ConfigError, match="--ep 2 with --tp 4"):
        Layout(ep=2, tp=4)


def test_layer_ranges_with_ranks_under_torchrun_are_refused_on_every_rank(monkeypatch, tiny_b_dir):
    """torchrun numbers its processes for one stage: `--pp 2 --tp 2` there is refused in one line naming the
    flags, on rank 0 and on a follower alike (none is left waiting for a group that never forms)."""
    from dsflash.engine.plan import PlacementError
    from dsflash.engine.ranks import run_ranked

    args = argparse.Namespace(pp=2, tp=2, ep=1, device="cpu", gpus=None)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "3")
        with pytest.raises(PlacementError, match=r"^--pp 2 with --ep 1 --tp 2 under torchrun: "):
            run_ranked(args, tiny_b_dir, "all", lambda parallel: 0)


@pytest.mark.slow  # three or four processes loading tiny-b on 2 cores: ~80 s
@pytest.mark.parametrize("layout", ["--ep 2", "--pp 2 --ep 2"])
def test_generate_with_ep_gives_the_one_process_tokens(tiny_b_dir, tmp_path, layout):
    """The command starts its followers itself (`dsflash follow` processes: one, or one a layer range) and stops
    them on the way out."""
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps([0, 5, 6, 7, 8, 9, 10, 11, 12]))

    def tokens(*flags: str) -> list[int]:
        out = subprocess.run([sys.executable, "-m", "dsflash.cli", "generate", "--model", str(tiny_b_dir),
                              "--prompt-tokens", str(prompt), "-n", "10", "--device", "cpu", "--json", "--dspark", "2",
                              *flags], capture_output=True, text=True, timeout=300, env=os.environ)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])["tokens"]

    assert tokens(*layout.split()) == tokens()


@pytest.mark.slow  # three to four processes at a time: ~30 s on 2 cores
def test_bench_runs_an_expert_parallel_layout(tmp_path):
    """`dsflash bench --ep 2` starts its follower over the same synthetic tensors (drawn by name, so every
    process holds the same ones): the sharded engine's logits are one process's, and the results say the
    layout. The comparison runs in a process of its own: this one may hold a module fixture's rank group."""
    check = """
import torch
from dsflash.bench.model import build_engine
from dsflash.bench.synthetic import synthetic_args
from dsflash.engine.ranks import start_ranks
from dsflash.model.parallel import Layout

args, ids = synthetic_args("tiny-b"), list(range(3, 40))
want = build_engine(args, "cpu", cuda_graphs=False).session().prefill(ids)
sharding = start_ranks(Layout(ep=2), None, "cpu", timeout_s=60, source=["--synthetic", "tiny-b"])
try:
    got = build_engine(args, "cpu", cuda_graphs=False, parallel=sharding).session().prefill(ids)
finally:
    sharding.close()
assert torch.equal(got, want), "the ep2 bench engine's logits differ from one process's"
"""
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=os.environ)
    assert r.returncode == 0, r.stderr
    for pp in (1, 2):  # the ranks of the whole stack, and a stage of them per layer range
        r = subprocess.run([sys.executable, "-m", "dsflash.cli", "bench", "step", "--preset", "tiny-b", "--device",
                            "cpu", "--context", "40", "--rows", "1", "--reps", "1", "--warmup-s", "0", "--pp", str(pp),
                            "--ep", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                           env=os.environ)
        assert r.returncode == 0, r.stderr
        name = "engine-step-tiny-b-" + ("pp2-" if pp > 1 else "") + "ep2-*.json"
        result = json.loads(next(tmp_path.glob(name)).read_text())
        assert result["layout"]["pp"] == pp and result["layout"]["ep"] == 2 and result["box_step_ms"]


@pytest.mark.slow  # a box process with its followers, and a back half: ~10-20 s on 2 cores
@pytest.mark.parametrize("layout", ["--ep", "--tp", "--pp 2 --tp"])
def test_split_with_a_parallel_box_equals_one_process(one, tiny_b_dir, layout):
    """A real `dsflash box --ep 2` (or `--tp 2`, or `--pp 2 --tp 2`: the box's layers 0-5 as two ranges of two
    ranks each) process, its followers started by the box itself, behind a one-process back half: the single
    process's prefill logits, steps and DSpark decoding."""
    from dsflash.split.link import box_half
    from tests.test_parallel_faults import followers_of
    from tests.test_split import BoxProcess, free_port

    box = BoxProcess(free_port(), case=tiny_b_dir, flags=("--max-context", "4096", *layout.split(), "2")).start()
    try:
        assert len(followers_of(box.proc)) == (2 if "--pp" in layout else 1)  # a follower a stage
        split = Engine.load(tiny_b_dir, encoder=box_half(f"127.0.0.1:{box.port}"), max_context=4096)
        plain = one[0]
        ids = random.Random(4).choices(range(3, 500), k=50)
        a, b = plain.session(), split.session()
        assert torch.equal(a.prefill(ids, chunk=16), b.prefill(ids, chunk=16))
        assert torch.equal(a.step(a.pos, [5, 6, 7]), b.step(b.pos, [5, 6, 7]))
        seeded = SamplingParams(temperature=0.7, seed=5)
        x, y = plain.session(), split.session()
        assert list(decode(x, x.prefill(ids), 8, seeded, stop=set())) == \
            list(decode(y, y.prefill(ids), 8, seeded, stop=set(), dspark=2))
        assert box.health()["layout"] == {"pp": 2 if layout.startswith("--pp") else 1,
                                          "ep": 2 if layout.endswith("--ep") else 1,
                                          "tp": 2 if layout.endswith("--tp") else 1}
    finally:
        box.kill()


# ~6-10 s each on 2 cores: all with the slow set (test_layer_ranges runs experts from host and disk stores by default)
@pytest.mark.parametrize("parallel", [pytest.param(p, marks=pytest.mark.slow)
                                      for p in ("ep2-host", "ep2-disk", "pp2ep2-host")], indirect=True)
def test_expert_parallel_ranks_run_their_experts_off_the_device(parallel, one):
    """`--ep 2 --experts host|disk` (and with `--pp 2`): each rank keeps its range of every MoE layer in an expert
    store of its own and runs it from a device cache of its share (4 of the 8 experts: a prefill's wide call takes
    two groups), bit-identical to one process; a follower holds none of the checkpoint's bytes on its device, and
    every rank's cache is the plan's (rank 0 one a model range, a follower one for its stage's layers)."""
    engine, sharding = parallel
    (store,) = engine.decoder.model.expert_stores
    a = engine.args  # rank 0's ranges: experts 0-3 of each layer, 0-1 of each DSpark stage's 4
    assert store.slots == 4 and {(i < a.n_layers, e.n, e.first) for i, e in store.layers.items()} == \
        {(True, 4, 0), (False, 2, 0)}
    assert sharding.held[1:] == [0] * len(sharding.stages)
    pp = len(sharding.stages)
    placed = plan(PRESETS["tiny-b"], Request(half="all", gpu_memory=(GiB,) * 2 * pp, host_memory=GiB, engram="host",
                                             experts=store.tier, ep=2, pp=pp))
    ranges = [rg for m in (engine.encoder.runner.model, engine.decoder.model) for rg in m.ranges]
    for s, st in enumerate(sharding.stages):
        mine = [rg.w.experts for rg in ranges if sharding.stage(rg.layers) is st]
        assert placed.gpus[2 * s].parts["cache"] == sum(x.slots * x.slot_bytes for x in mine) > 0
        assert placed.gpus[2 * s + 1].parts["cache"] == st.caches[0] == store.slots * store.slot_bytes
    rng = random.Random(7)
    ids = [rng.randrange(3, 500) for _ in range(150)]
    whole = one[1].forward(SequenceState(), torch.tensor(ids)).logits
    s = engine.session()
    assert torch.equal(s.prefill(ids[:-3], chunk=150), whole[-4])
    assert torch.equal(s.step(len(ids) - 3, ids[-3:]), whole[-3:])
    assert store.stats.misses > 0 and store.stats.evictions > 0
    x, y = one[0].session(), engine.session()
    assert list(decode(x, x.prefill(ids[:40]), 8, SamplingParams(), stop=set())) == \
        list(decode(y, y.prefill(ids[:40]), 8, SamplingParams(), stop=set(), dspark=3))
