"""The model's invariants on the CUDA backend (Triton kernels): the golden cases PASS, and chunked
prefill, steps with rollbacks and DSpark decoding are bit-identical to one prefill, as on the CPU."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dsflash.cli import main
from dsflash.engine.graphs import SegmentGraphs
from dsflash.engine.runner import Runner
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import DecodeStats, decode
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Debug
from dsflash.split.link import box_half
from tests.conftest import GOLDEN_CASES, TEXT_CASE, interleaved_steps, partly_right_drafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run on the GPU machine")
CASE = TEXT_CASE


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: p.name)
def test_golden_case_passes_on_cuda(case, tmp_path):
    out = tmp_path / "r.json"
    status = main(["check-golden", str(case), "--device", "cuda", "--json", str(out)])
    (entry,) = json.loads(out.read_text())["cases"]
    print(case.name, entry["tier"])
    assert status == 0 and entry["tier"] in ("PASS", "FAITHFUL"), entry


def test_chunking_steps_and_dspark_are_bit_identical_on_cuda():
    model = load_model(CASE, device="cuda")
    ids = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(0)).cuda()
    trace_whole: dict = {}
    whole = model.forward(SequenceState(device="cuda"), ids, debug=Debug(trace=trace_whole)).logits
    for size in (1, 7, 64):
        state, parts, layers = SequenceState(device="cuda"), [], []
        for i in range(0, ids.numel(), size):
            trace: dict = {}
            parts.append(model.forward(state, ids[i:i + size], debug=Debug(trace=trace)).logits)
            layers.append(trace["layer_out"])
        # name the first layer whose output moved, to say where invariance broke
        moved = [layer for layer, (h, _) in trace_whole["layer_out"].items()
                 if not torch.equal(torch.cat([t[layer][0] for t in layers]), h)]
        assert torch.equal(torch.cat(parts), whole), (size, moved)
    engine = Engine.load(CASE, device="cuda", max_context=4096)
    s = engine.session()
    logits = s.prefill(ids[:40].tolist(), chunk=16)
    assert torch.equal(logits, whole[39])
    p = s.pos
    got = s.step(p, ids[40:43].tolist() + [9, 9])[:3]
    assert torch.equal(got, whole[40:43])
    s.rollback(p + 3)
    outs = []
    for k in (0, 2):
        x = engine.session()
        outs.append(list(decode(x, x.prefill(ids[:50].tolist()), 10, SamplingParams(), stop=set(), dspark=k)))
    assert outs[0] == outs[1]
    x = engine.session()  # partly accepted drafts: rollback inside a verify on the GPU
    x.draft = partly_right_drafter(x, 50, outs[0])
    stats = DecodeStats()
    assert list(decode(x, x.prefill(ids[:50].tolist()), 10, SamplingParams(), stop=set(), dspark=4,
                       stats=stats, adaptive=False)) == outs[0]
    assert 0 < stats.accepted < stats.drafted


def test_resume_split_and_restart_are_bit_identical_on_cuda(tmp_path):
    """resume == fresh, split == single and restart == uninterrupted, with both halves on the GPU."""
    from dsflash.engine.session import Session
    from tests.test_split import BoxProcess, decode_across_box_restart, free_port

    local = Engine.load(CASE, device="cuda", max_context=4096)
    ids = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    fresh = local.session()
    fresh_logits = fresh.prefill(ids, chunk=16)
    expected = list(decode(fresh, fresh_logits, 10, SamplingParams(), stop=set(), dspark=2))
    first = local.session()
    first.prefill(ids[:41])
    resumed = Session.restore(local, first.snapshot())
    assert torch.equal(resumed.prefill(ids[41:]), fresh_logits)
    assert list(decode(resumed, resumed.last_logits, 10, SamplingParams(), stop=set(), dspark=2)) == expected

    box = BoxProcess(free_port(), cache_dir=tmp_path / "cache", device="cuda").start()
    try:
        split = Engine.load(CASE, device="cuda", max_context=4096, encoder=box_half(f"127.0.0.1:{box.port}"))
        s = split.session()
        assert torch.equal(s.prefill(ids, chunk=16), fresh_logits)
        out = decode_across_box_restart(box, s, s.last_logits, 10, restart_after=3, dspark=2)
        assert out == expected and split.encoder.link.reconnects >= 1
    finally:
        box.kill()


LAUNCH_RUN = """
import hashlib
import torch
from dsflash.engine.session import Engine
from dsflash.kernels.cuda.common import PDL_LAUNCH
from tests.conftest import TEXT_CASE
ids = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(2)).tolist()
engine = Engine.load(TEXT_CASE, device="cuda")
digest = hashlib.sha256()
for _ in range(3):  # eager forwards, captures, replays
    s = engine.session()
    digest.update(s.prefill(ids[:40], chunk=16).float().cpu().numpy().tobytes())
    for i in range(40, 52):
        digest.update(s.step(s.pos, ids[i:i + 1 + i % 3]).float().cpu().numpy().tobytes())
        s.rollback(i + 1)
    s.close()
print(PDL_LAUNCH, digest.hexdigest())
"""


def launch_digests(flag: str) -> dict[str, list[str]]:
    """LAUNCH_RUN's output (the flag it reports, the digest) with the environment variable `flag` at 0 and 1."""
    root = Path(__file__).resolve().parents[1]
    runs = {}
    for value in ("0", "1"):
        env = {**os.environ, flag: value, "PYTHONPATH": str(root)}
        r = subprocess.run([sys.executable, "-c", LAUNCH_RUN], env=env, capture_output=True, text=True, timeout=400,
                           cwd=root)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[value] = r.stdout.split()[-2:]
    return runs


def test_programmatic_dependent_launch_keeps_every_bit():
    """Programmatic dependent launch (kernels/cuda/common.py, on unless `DSFLASH_PDL=0`): each kernel may start
    while the one before it finishes and waits in `grid_entry` for its writes, so prefills, graphed steps of 1-3
    rows and rollbacks give the bits of plain launches (a kernel reading before the wait would race and
    differ)."""
    runs = launch_digests("DSFLASH_PDL")
    hopper = str(torch.cuda.get_device_capability()[0] >= 9)
    assert runs["0"][0] == "False" and runs["1"][0] == hopper, runs
    assert runs["0"][1] == runs["1"][1]


def test_side_streams_keep_every_bit():
    """The mHC mixes forked onto a side stream beside each sub-layer and the shared expert beside the routed
    ones (kernels/cuda/side.py, on unless `DSFLASH_SIDE_STREAMS=0`): eager prefills, captured and replayed
    steps and rollbacks give the bits of everything in place on one stream (a kernel of either chain reading
    before its join would race)."""
    runs = launch_digests("DSFLASH_SIDE_STREAMS")
    assert runs["0"][1] == runs["1"][1]


def test_fork_runs_beside_the_caller_until_join():
    """`fork` launches on a side stream that starts after the caller's work (work on more than SIDE_MAX_ROWS
    rows in place); `join` makes the caller wait for it, also inside a CUDA graph capture; a join with nothing
    forked adds no wait (a capture may not wait on work outside it), and another thread's join leaves this
    thread's fork pending."""
    from dsflash.kernels.cuda import side

    caller = torch.cuda.current_stream()
    x = torch.ones(4, 1 << 18, device="cuda")  # rows of a decode step: forked
    torch.cuda._sleep(50_000_000)  # the caller busy: the forked work must wait for it
    y = x + 1
    forked_on, z = side.fork(lambda t: (torch.cuda.current_stream(), t * 2), y)
    assert forked_on != caller
    other = threading.Thread(target=side.join)  # another thread's join: nothing of its own to wait for
    other.start()
    other.join()
    assert (caller.cuda_stream, 0) in side._state()[1]  # this thread's fork still waits for its join
    wide = torch.zeros(side.SIDE_MAX_ROWS + 1, 4, device="cuda")
    assert side.fork(lambda t: torch.cuda.current_stream(), wide) == caller  # a prefill's rows: in place
    side.join()
    side.join()  # nothing forked since: no wait
    assert torch.equal(z, torch.full_like(x, 4.0))
    graph, out = torch.cuda.CUDAGraph(), {}
    side.join()
    with torch.cuda.graph(graph):
        w = side.fork(lambda t: t * 3, x)
        v = side.fork(lambda t: t * 5, x, lane=1)  # another lane: joined apart
        side.join(1)
        out["v"] = v + 1
        side.join()
        out["w"] = w + 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["w"], torch.full_like(x, 4.0)) and torch.equal(out["v"], torch.full_like(x, 6.0))


def test_cuda_graph_replays_equal_eager_forwards():
    """Steps of 1-8 rows replaying a captured forward give the eager forward's bits, across captures,
    replays, row counts that come and go, two sessions taking turns (each reads and writes its own state
    through its own graphs), the sources' buffers growing (a new graph) and RoPE table rebuilds (which retire
    the graphs)."""
    eager = load_model(CASE, device="cuda")
    graphed = Runner(load_model(CASE, device="cuda"))
    outs = [interleaved_steps(model, "cuda") for model in (eager, graphed)]
    runs = [key for key in graphed.graphs._graphs if key[0][0] == "layers"]
    # a whole forward is one graph, per row count, p0 % ratio and session (its state's buffers by address)
    assert len({key[0][3] for key in runs}) >= 2, "each session replays graphs of its own"
    assert torch.equal(outs[0], outs[1])


def test_a_session_after_an_ended_one_replays_its_graphs_with_the_same_tokens():
    """A session holds the buffers the ended one before it held (model/state.StatePool), so its steps and
    drafts replay that one's CUDA graphs instead of capturing graphs of their own: the tokens of eager
    forwards, and once every key has been captured, no capture more."""
    ids = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(1)).tolist()

    def run(engine: Engine, k: int) -> list[int]:
        s = engine.session()
        out = list(decode(s, s.prefill(ids), 12, SamplingParams(), stop=set(), dspark=k, adaptive=False))
        s.close()
        return out

    def captures(engine: Engine) -> int:
        return engine.decoder.graphs.captures + engine.encoder.runner.graphs.captures

    eager, graphed = Engine.load(CASE, device="cuda", cuda_graphs=False), Engine.load(CASE, device="cuda")
    want = [run(eager, k) for k in (0, 3)]
    for _ in range(3):  # a key's first call runs eagerly, its second captures
        assert [run(graphed, k) for k in (0, 3)] == want
    before = captures(graphed)
    assert before > 0 and [run(graphed, k) for k in (0, 3)] == want
    assert captures(graphed) == before


def test_graphed_drafts_are_bit_identical_on_cuda():
    """DSpark drafts from CUDA graphs -- a step's context rows written by one, the stages and the head run by
    another, the Markov chain by a third -- give the eager drafts' tokens, logits and confidences, whether a
    key's call warms up, captures or replays (the same rows rewritten each time: the state stays put)."""
    model = load_model(CASE, device="cuda")
    window = model.args.window_size
    ids = torch.randint(3, 500, (window + 3,), generator=torch.Generator().manual_seed(4)).to("cuda")
    state = SequenceState(device="cuda")
    hidden = model.forward(state, ids).main_hidden
    model.dspark.write_context(state, hidden[:window], 0)
    graphs = SegmentGraphs()
    results = []
    for g in (None, graphs, graphs, graphs):
        model.dspark.write_context(state, hidden[window:], window, graphs=g)
        results.append([model.dspark.draft(state, anchor, graphs=g) for anchor in (5, 17)])
    assert graphs.captures == 3  # the context write, the stages and head, the chain
    for other in results[1:]:
        for (tokens, logits, confidence), (tokens2, logits2, confidence2) in zip(results[0], other, strict=True):
            assert tokens == tokens2 and torch.equal(logits, logits2) and torch.equal(confidence, confidence2)


def test_cuda_graphs_dropped_least_recently_replayed_keep_the_bits():
    """With room for 3 graphs, two interleaved sessions keep dropping and recapturing graphs (the least
    recently replayed first): still the eager forward's bits, and never more than 3 kept."""
    eager = load_model(CASE, device="cuda")
    graphed = Runner(load_model(CASE, device="cuda"))
    graphed.graphs.max_kept = 3
    assert torch.equal(interleaved_steps(eager, "cuda"), interleaved_steps(graphed, "cuda"))
    assert len(graphed.graphs._graphs) <= 3


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_engram_tiers_are_bit_identical_on_cuda(tier):
    """Engram in page-locked host memory or read from disk, its rows gathered on the host and uploaded on a
    side stream: the resident table's bits on the GPU, in CUDA-graph replays (the rows a static input,
    gathered before the graph) and through the engine (a chunked prefill fetching the next chunk's rows
    ahead, steps, a rollback)."""
    from dsflash.model.engram_tables import HostTable
    from dsflash.model.tiers import Tiers

    eager = load_model(CASE, device="cuda")
    graphed = Runner(load_model(CASE, device="cuda", tiers=Tiers(engram=tier)))
    assert graphed.model.engram_staged
    if tier == "host":
        assert all(isinstance(e.table, HostTable) and e.table.table.is_pinned() for e in graphed.model.engram.values())
    assert torch.equal(interleaved_steps(eager, "cuda"), interleaved_steps(graphed, "cuda"))
    # replayed forwards with the staged rows among their inputs (positions, ids, 3 per Engram layer)
    assert any(key[0][0] == "layers" and len(key[1]) == 2 + 3 * len(graphed.model.engram)
               for key in graphed.graphs._graphs)
    ids = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for tiers in (Tiers(), Tiers(engram=tier)):
        s = Engine.load(CASE, device="cuda", max_context=4096, tiers=tiers).session()
        out = [s.prefill(ids[:45], chunk=16)]
        p = s.pos
        out.append(s.step(p, ids[45:48]))
        s.rollback(p + 1)
        out += [s.step(p + 1, ids[48:49]), s.step(p + 2, ids[49:55])]
        outs.append(torch.cat([o.reshape(-1, o.size(-1)) for o in out]))
    assert torch.equal(*outs)
    stats = graphed.model.tier_stats()["engram"]
    assert stats["rows_requested"] > stats["rows_unique"] > 0
    assert (stats["rows_read"] > 0) == (tier == "disk")
