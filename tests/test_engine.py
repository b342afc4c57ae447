"""The engine's bit-exact invariants on the tiny golden checkpoint (CPU reference backend):
step == prefill, rollback == never drafted, resume == fresh, DSpark == plain decoding."""

import dataclasses
import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsflash.engine import snapshot
from dsflash.engine.depth import DraftDepth
from dsflash.engine.graphs import SegmentGraphs
from dsflash.engine.halves import LocalHalf
from dsflash.engine.runner import Runner
from dsflash.engine.sampling import AfterReasoning, History, SamplingParams, sample
from dsflash.engine.session import MAX_STEP_ROWS, Engine, Session, engine_identity
from dsflash.engine.snapshot import SnapshotError
from dsflash.engine.spec import DecodeStats, decode
from dsflash.kernels import cpu
from dsflash.model.load import load_model
from dsflash.model.state import ROLLBACK_ROWS, TABLES, GrowingRows, RollbackError, SequenceState, StatePool
from dsflash.numerics import numerics_version
from tests.conftest import TEXT_CASE, partly_right_drafter

CASE = TEXT_CASE


@pytest.fixture(scope="module")
def engine():
    return Engine.load(CASE)


@pytest.fixture(scope="module")
def whole_model():
    return load_model(CASE)


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 511) for _ in range(n)]


def test_steps_with_rollbacks_equal_one_prefill(engine, whole_model):
    rng = random.Random(1)
    ids = prompt(60, seed=1)
    whole_logits = whole_model.forward(SequenceState(), torch.tensor(ids)).logits
    s = engine.session()
    s.prefill(ids[:20], chunk=7)
    while s.pos < len(ids):
        # append real rows plus junk rows, then roll the junk back, as a rejected draft would
        real = ids[s.pos:s.pos + rng.randint(1, 4)]
        junk = [rng.randrange(3, 511) for _ in range(rng.randint(0, 8 - len(real)))]
        p = s.pos
        logits = s.step(p, real + junk)
        assert torch.equal(logits[: len(real)], whole_logits[p:p + len(real)])
        s.rollback(p + len(real))
    assert s.tokens == ids


def test_growing_rows_write_at_device_offsets_and_keep_their_spare_capacity_zero():
    """What a CUDA graph relies on: rows written at a position tensor land there, a growth keeps the rows
    and zero-fills the spare capacity, and a truncated row is rewritten in place."""
    rows = GrowingRows((3,), torch.int64)
    rows.put(torch.tensor([0]), torch.arange(12).view(4, 3), 4)
    assert rows.n == 4 and torch.equal(rows.rows, torch.arange(12).view(4, 3))
    assert rows.buffer.size(0) == 64 and not rows.buffer[4:].any()
    rows.reserve(100)  # the power of two above: a prefill's append leaves room for the steps after it
    assert rows.buffer.size(0) == 128 and torch.equal(rows.rows, torch.arange(12).view(4, 3))
    assert not rows.buffer[4:].any()
    rows.reserve(128)  # fits
    assert rows.buffer.size(0) == 128
    rows.reserve(129)  # at most twice what is asked
    assert rows.buffer.size(0) == 256
    rows.truncate(2)
    rows.put(torch.tensor([2]), torch.full((3, 3), -1), 5)
    assert rows.n == 5 and torch.equal(rows.rows[2:], torch.full((3, 3), -1))
    assert torch.equal(rows.rows[:2], torch.arange(6).view(2, 3))


def test_a_state_pool_hands_back_a_buffer_to_its_role_and_shape_zeroed_within_its_bounds():
    pool = StatePool(max_bytes=3 * 64 * 8, per_role=2)
    a = pool.take(("window", 0), (8, 8), torch.int64, "cpu")
    a.fill_(7)
    pool.give(("window", 0), a)
    assert pool.take(("window", 1), (8, 8), torch.int64, "cpu") is not a  # another role
    assert pool.take(("window", 0), (4, 8), torch.int64, "cpu") is not a  # another shape
    b = pool.take(("window", 0), (8, 8), torch.int64, "cpu")
    assert b is a and not b.any() and pool.bytes == 0
    kept = [torch.ones(8, 8, dtype=torch.int64) for _ in range(4)]
    for t in kept:
        pool.give(("raw", 2), t)
    assert pool.bytes == 2 * 64 * 8  # two a role and shape
    pool.give(("raw", 3), kept[2])
    pool.give(("raw", 4), kept[3])
    assert pool.bytes == 3 * 64 * 8  # and no more than max_bytes in all
    assert pool.take(("raw", 2), (8, 8), torch.int64, "cpu") is kept[1]  # the last given back first


def graph_shaped_engine(case) -> Engine:
    """An engine whose halves run short forwards the way CUDA graphs do (uncaptured: any backend), so their
    states come from a StatePool as on a GPU."""
    def half(name: str) -> Runner:
        return Runner(load_model(case, half=name), graphs=SegmentGraphs(max_rows=cpu.ROW_TILE, capture=False))

    decoder = half("decoder")
    return Engine(decoder, LocalHalf(half("encoder")), decoder.args.max_seq_len, engine_identity(decoder.model))


def state_buffers(s: Session) -> dict[tuple[str, str, int], int]:
    """(half, table, layer or stage) -> the address of the buffer holding it, for a session of one process."""
    return {(half, name, key): (t.data if hasattr(t, "data") else t.buffer).data_ptr()
            for half, state in (("decoder", s.state), ("encoder", s.encoder.state))
            for name in TABLES for key, t in getattr(state, name).items()}


def test_a_resumed_session_takes_an_ended_ones_buffers_and_goes_on_the_same(engine):
    """A session restored from a snapshot (the prefix cache's next turn) is made of pooled buffers too, in the
    roles and sizes the ended session held, and decodes on as a restore onto fresh buffers does."""
    shaped, ids = graph_shaped_engine(CASE), prompt(70, seed=6)
    s = shaped.session()
    list(decode(s, s.prefill(ids), 8, SamplingParams(), stop=set()))
    blob, held = s.snapshot(), state_buffers(s)
    s.close()
    resumed = Session.restore(shaped, blob)
    assert state_buffers(resumed) == held
    fresh = Session.restore(engine, blob)
    assert list(decode(resumed, resumed.last_logits, 8, SamplingParams(), stop=set(), dspark=2)) == \
        list(decode(fresh, fresh.last_logits, 8, SamplingParams(), stop=set()))


@pytest.mark.slow  # ~11 s
def test_a_new_session_takes_an_ended_ones_buffers_and_decodes_the_same_tokens(engine):
    """With graphs, a session's state is made of the buffers the sessions before it held, in the same roles --
    what lets it replay their CUDA graphs, which read the state by address -- zeroed: its tokens, drafted or
    not, are those of a session on fresh buffers."""
    shaped, ids = graph_shaped_engine(CASE), prompt(90)

    def run(e: Engine, k: int) -> tuple[list[int], dict]:
        s = e.session()
        # drafts at a fixed depth: the adaptive one picks by measured times, and a session that never drafts
        # holds no DSpark buffer (seen on a loaded machine)
        out = list(decode(s, s.prefill(ids), 12, SamplingParams(), stop=set(), dspark=k, adaptive=False))
        held = state_buffers(s)
        s.close()
        return out, held

    fresh = [run(engine, k)[0] for k in (0, 3)]
    (first, held), (second, held_again) = run(shaped, 3), run(shaped, 3)
    assert fresh[0] == fresh[1] == first == second == run(shaped, 0)[0]
    assert held == held_again and {name for _, name, _ in held} >= {"window", "compressed", "dspark"}
    assert shaped.decoder.pool.bytes > 0 and engine.decoder.pool is None  # no graphs, no pool


def test_rollback_beyond_the_rings_is_refused(engine):
    s = engine.session()
    s.prefill(prompt(100))
    with pytest.raises(RollbackError):
        s.rollback(10)


PENALISED = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
SLOW = pytest.mark.slow  # ~7 s each on 2 cores: the default run keeps greedy, seeded nucleus and min_tokens
DECODING = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=3),
            pytest.param(PENALISED, marks=SLOW), pytest.param(dataclasses.replace(PENALISED, temperature=0.7, seed=5),
                                                                marks=SLOW),
            SamplingParams(min_tokens=10, end_ids=tuple(range(0, 512, 2)))]  # odd tokens only, at first


# ~8.5 s each on 2 cores: the default run drafts greedily here (test_accepted_drafts covers the samplers)
@pytest.mark.parametrize("params", [DECODING[0], pytest.param(DECODING[1], marks=SLOW), *DECODING[2:4],
                                    pytest.param(DECODING[4], marks=SLOW)])
def test_dspark_output_equals_plain_decoding(engine, params):
    for seed in range(4):
        ids = prompt(20 + 9 * seed, seed=seed)
        outputs = []
        for k in (0, 2):
            s = engine.session()
            stats = DecodeStats()
            # every cycle drafts (the engine's DraftDepth may have settled on plain decoding for this model)
            outputs.append(list(decode(s, s.prefill(ids), 12, params, stop=set(), dspark=k, stats=stats,
                                       adaptive=False)))
            if k:
                assert stats.drafted > 0
        assert outputs[0] == outputs[1]


@pytest.mark.parametrize("params", DECODING)
def test_accepted_drafts_give_plain_decoding(engine, params):
    """The tiny checkpoint's random drafter is almost never right, so this test drafts from the known plain
    output with one wrong token in some slot (a drafter stand-in, said so): the verifier must accept the
    right prefix, reject the rest and still give exactly the plain tokens."""
    ids = prompt(25, seed=2)
    s = engine.session()
    plain = list(decode(s, s.prefill(ids), 24, params, stop=set()))
    s = engine.session()
    s.draft = partly_right_drafter(s, len(ids), plain)
    stats = DecodeStats()
    assert list(decode(s, s.prefill(ids), 24, params, stop=set(), dspark=4, stats=stats, adaptive=False)) == plain
    assert stats.accepted > 0 and stats.accepted < stats.drafted


@pytest.mark.parametrize("params", [pytest.param(DECODING[0], marks=SLOW), pytest.param(DECODING[1], marks=SLOW)],
                         ids=["greedy", "seeded"])  # ~9 s each
def test_capped_reasoning_and_drafts(engine, params):
    """A reasoning budget forces the reasoning's end token after that many tokens (a draft sure to verify),
    and the tokens after it, one per step by hand or with partly right drafts, are the same."""
    ids = prompt(25, seed=4)
    s = engine.session()
    free = list(decode(s, s.prefill(ids), 12, params, stop=set()))
    trigger = next(t for t in range(3, 500) if t not in free[:3])
    s = engine.session()
    capped = list(decode(s, s.prefill(ids), 20, params, stop=set(), constraint=AfterReasoning(trigger, None, 3)))
    assert capped[:3] == free[:3] and capped[3] == trigger
    s, by_hand, cap = engine.session(), [], AfterReasoning(trigger, None, 3)
    logits = s.prefill(ids)
    for _ in range(20):
        t = sample(logits, s.pos, params, None, cap)
        cap.advance(t)
        by_hand.append(t)
        logits = s.step(s.pos, [t])[0]
    assert capped == by_hand
    s = engine.session()
    s.draft = partly_right_drafter(s, len(ids), capped)
    stats = DecodeStats()
    again = list(decode(s, s.prefill(ids), 20, params, stop=set(), dspark=4, stats=stats,
                        constraint=AfterReasoning(trigger, None, 3), adaptive=False))
    assert again == capped and 0 < stats.accepted < stats.drafted


def test_penalties_and_biases_by_hand():
    h = History([4, 7], 10)
    h.add(7)
    h.add(9)
    h.add(9)
    logits = torch.tensor([1.0, -1.0, 2.0, 0.5, 3.0, 0.0, 0.0, -2.0, 0.0, 4.0])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                       logit_bias=((2, -1.5), (9, 0.25)))
    want = logits.double().clone()
    want[2] = 2.0 - 1.5
    want[4] = 3.0 / 2  # prompt only: repetition penalty
    want[7] = -2.0 * 2 - 0.25 - 0.5  # prompt and output once
    want[9] = 4.0 / 2 - 2 * 0.25 - 0.5 + 0.25  # output twice, then the bias
    assert torch.equal(h.adjust(logits, p), want)
    ends = dict(min_tokens=4, end_ids=(1, 5))
    assert torch.equal(h.adjust(logits, SamplingParams(**ends))[[1, 5]], torch.full((2,), -torch.inf).double())
    assert torch.equal(h.adjust(logits, SamplingParams(**{**ends, "min_tokens": 3})), logits.double())
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 200.0),))


@pytest.mark.slow  # ~11 s; test_server's completions check penalties end to end
def test_penalised_decoding_equals_a_token_by_token_loop(engine):
    """decode() keeps the penalties' history right; the hand loop recomputes it from the tokens."""
    ids = prompt(30, seed=7)
    s = engine.session()
    got = list(decode(s, s.prefill(ids), 20, PENALISED, stop=set(), dspark=2))
    s = engine.session()
    logits, out = s.prefill(ids), []
    for _ in range(20):
        h = History(ids, logits.numel())
        for t in out:
            h.add(t)
        out.append(int(torch.argmax(h.adjust(logits, PENALISED))))
        logits = s.step(s.pos, [out[-1]])[0]
    assert got == out
    s = engine.session()
    assert list(decode(s, s.prefill(ids), 20, SamplingParams(), stop=set())) != out  # the penalties do act


def test_resume_from_snapshot_equals_fresh(engine):
    ids = prompt(50, seed=4)
    fresh = engine.session()
    fresh_logits = fresh.prefill(ids)
    fresh_out = list(decode(fresh, fresh.last_logits, 8, SamplingParams(), stop=set(), dspark=2))
    first = engine.session()
    first.prefill(ids[:33])
    resumed = type(first).restore(engine, first.snapshot())
    resumed.prefill(ids[33:])
    assert torch.equal(resumed.last_logits, fresh_logits)
    assert list(decode(resumed, resumed.last_logits, 8, SamplingParams(), stop=set(), dspark=2)) == fresh_out


def test_bad_snapshots_are_refused(engine):
    s = engine.session()
    s.prefill(prompt(20))
    blob = s.snapshot()
    with pytest.raises(SnapshotError, match="truncated"):
        type(s).restore(engine, blob[:-10])
    with pytest.raises(SnapshotError, match="checksum"):
        type(s).restore(engine, blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(SnapshotError, match="magic"):
        type(s).restore(engine, b"XXXXXXXX" + blob[8:])
    other = dataclasses.replace(engine, identity="another-model")
    with pytest.raises(SnapshotError, match="belongs to model"):
        type(s).restore(other, blob)


def test_a_snapshot_of_the_other_backend_is_refused_naming_both_versions(engine):
    """The CPU reference and the CUDA backend sum in other orders, so each has its own numerics version and
    neither resumes a state the other computed; a snapshot written as a build before the per-backend versions
    wrote the CPU's (the number 6) still resumes on the CPU."""
    cpu_version, cuda_version = numerics_version("cpu"), numerics_version(torch.device("cuda", 0))
    assert cpu_version != cuda_version and engine.numerics == cpu_version
    assert numerics_version("cuda") == cuda_version and numerics_version(torch.device("cpu")) == cpu_version
    with pytest.raises(ValueError, match="meta"):
        numerics_version("meta")
    s = engine.session()
    s.prefill(prompt(20))
    states, tokens, extras = snapshot.decode(s.snapshot(), engine.identity, engine.numerics)
    blob = snapshot.encode(states, tokens, engine.identity, cuda_version, extras)  # as a GPU would have made it
    with pytest.raises(SnapshotError) as refused:
        type(s).restore(engine, blob)
    assert str(refused.value).endswith(f"numerics version {cuda_version}, the loaded model computes version "
                                       f"{cpu_version}")
    old = snapshot.encode(states, tokens, engine.identity, int(cpu_version), extras)  # the JSON number 6
    assert type(s).restore(engine, old).tokens == s.tokens


def test_prefix_cache_resume_equals_fresh(engine, tmp_path):
    from dsflash.engine.prefix_cache import PrefixCache

    ids = prompt(40, seed=5)
    cache = PrefixCache(engine.identity, engine.numerics, disk_dir=tmp_path)
    fresh = engine.session().sync(ids[:30], cache=cache, chunk=8)
    assert fresh.reused == 0
    # a fresh cache object reads the disk entries; the longest cached prefix of the new prompt is 30
    cache = PrefixCache(engine.identity, engine.numerics, disk_dir=tmp_path)
    resumed = engine.session().sync(ids, cache=cache, chunk=8)
    assert resumed.reused == 30
    plain = engine.session()
    assert torch.equal(resumed.logits, plain.prefill(ids))
    # a corrupt cache file is dropped and treated as a miss
    for f in tmp_path.glob("*.dsnap"):
        f.write_bytes(f.read_bytes()[:100])
    cache = PrefixCache(engine.identity, engine.numerics, disk_dir=tmp_path)
    again = engine.session().sync(ids, cache=cache, chunk=8)
    assert again.reused == 0 and torch.equal(again.logits, resumed.logits)


def test_sync_keeps_the_sessions_own_prefix(engine):
    """A session synced to a prompt that continues, shortens or changes its tokens keeps what it can (its
    own prefix within rollback reach) and gives a fresh prefill's logits."""
    ids = prompt(60, seed=9)
    s = engine.session()
    assert s.sync(ids[:40], chunk=16).reused == 0
    grown = s.sync(ids[:50], chunk=16)
    assert grown.reused == 40 and torch.equal(grown.logits, engine.session().prefill(ids[:50]))
    shorter = s.sync(ids[:45], chunk=16)  # a rollback; the last row is computed again for its logits
    assert shorter.reused == 44 and torch.equal(shorter.logits, engine.session().prefill(ids[:45]))
    changed = [*ids[:20], 7, 8, 9]
    other = s.sync(changed, chunk=16)
    assert other.reused == 20 and torch.equal(other.logits, engine.session().prefill(changed))
    assert s.tokens == changed


def test_prefill_runs_the_decoder_on_the_tail_only_and_matches_a_full_prefill(engine, whole_model):
    ids = prompt(120, seed=6)
    s = engine.session()
    logits = s.prefill(ids, chunk=37)
    assert s.tail_rows() < len(ids)
    full = whole_model.forward(SequenceState(), torch.tensor(ids)).logits
    assert torch.equal(logits, full[-1])
    # and the state it leaves decodes exactly like the full prefill's
    nxt = [7, 8, 9]
    ref = whole_model.forward(SequenceState(), torch.tensor(ids + nxt)).logits[-3:]
    assert torch.equal(s.step(len(ids), nxt), ref)


def test_rollback_into_a_prefill_re_steps_a_full_prefills_rows(engine, whole_model):
    """A rollback of up to ROLLBACK_ROWS into a prefill's own rows (sync does one when a prompt changes near its
    end) re-steps them as a full prefill's rows and drafts from the full prefill's taps: the tail triangle
    keeps the rows a rollback reaches back to, not only those the last row needs."""
    ids = prompt(120, seed=8)
    n = len(ids)
    whole = whole_model.forward(SequenceState(), torch.tensor(ids)).logits
    for back in (2, 9, ROLLBACK_ROWS):
        s = engine.session()
        s.prefill(ids, chunk=50)
        s.rollback(n - back)
        fresh = engine.session()
        fresh.prefill(ids[:n - back])
        assert s.draft(ids[n - back - 1]) == fresh.draft(ids[n - back - 1])
        while s.pos < n:
            p = s.pos
            rows = ids[p:p + MAX_STEP_ROWS]
            assert torch.equal(s.step(p, rows), whole[p:p + len(rows)])
    s = engine.session()  # and sync's way there: a prompt changed 20 tokens before the end of the last one
    s.sync(ids)
    changed = [*ids[:n - 20], 7, 8, 9]
    assert torch.equal(s.sync(changed).logits, engine.session().prefill(changed))


@pytest.fixture(scope="module")
def tiny_b(tmp_path_factory):
    from dsflash.checkpoint.make import make_checkpoint
    from dsflash.config import PRESETS

    ckpt = make_checkpoint(PRESETS["tiny-b"], 11, tmp_path_factory.mktemp("tinyb"))
    return Engine.load(ckpt, max_context=4096), load_model(ckpt)


@pytest.mark.slow  # ~45 s on 2 cores; test_steps_with_rollbacks_equal_one_prefill stays in the default set
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_random_step_and_rollback_sequences_on_tiny_b(tiny_b, data):
    """Window 8 (rings wrap), three ratio-2 sources (rollbacks land mid-group), 3 DSpark stages."""
    engine, whole_model = tiny_b
    n = data.draw(st.integers(30, 90))
    ids = data.draw(st.lists(st.integers(3, 500), min_size=n, max_size=n))
    whole = whole_model.forward(SequenceState(), torch.tensor(ids)).logits
    s = engine.session()
    first = data.draw(st.integers(1, 25))
    assert torch.equal(s.prefill(ids[:first], chunk=data.draw(st.integers(1, 16))), whole[first - 1])
    while s.pos < n:
        real = ids[s.pos:s.pos + data.draw(st.integers(1, 4))]
        junk = data.draw(st.lists(st.integers(3, 500), max_size=8 - len(real)))
        p = s.pos
        logits = s.step(p, real + junk)
        assert torch.equal(logits[: len(real)], whole[p:p + len(real)])
        s.rollback(p + len(real))
        if data.draw(st.booleans()) and s.pos < n:  # resume from a snapshot at this point
            s = type(s).restore(engine, s.snapshot())
    assert s.tokens == ids


def test_prefill_passes_report_progress_and_keep_the_bits(engine):
    """`sync(pass_rows=...)`: the encoder runs in smaller passes, each followed by progress; the logits and
    the snapshot are the same bits as with passes of a whole chunk."""
    ids = prompt(40, seed=7)
    a = engine.session()
    whole = a.sync(ids, chunk=32).logits
    b, seen = engine.session(), []
    passes = b.sync(ids, chunk=32, pass_rows=5, progress=lambda done, total: seen.append((done, total))).logits
    assert torch.equal(whole, passes) and a.snapshot() == b.snapshot()
    assert seen == [(d, 40) for d in (5, 10, 15, 20, 25, 30, 32, 37, 40)]


def test_draft_depth_is_given_each_cycles_whole_time(monkeypatch):
    """On a GPU a verify's kernels finish inside the sampler's read-back of its logits, after the step call
    returns: DraftDepth must be given the whole cycle (draft, verify, sampling, rollback), or a depth's GPU
    time goes unweighed. Here each sample call costs 20 ms, as such a read-back can: every recorded cycle
    holds at least its own samples' time (one more than the drafts it accepted)."""
    from dsflash.engine import spec
    records, real_sample = [], spec.sample

    def slow_sample(*a, **kw):
        time.sleep(0.02)
        return real_sample(*a, **kw)

    class Spy(DraftDepth):
        def record(self, k, seconds, accepted):
            records.append((k, seconds, accepted))
            super().record(k, seconds, accepted)

    monkeypatch.setattr(spec, "sample", slow_sample)
    monkeypatch.setattr(spec, "DraftDepth", Spy)
    s = Engine.load(CASE).session()  # an engine of its own: an engine keeps its DraftDepth
    list(decode(s, s.prefill(prompt(12, seed=3)), 16, SamplingParams(), stop=set(), dspark=2))
    assert {0, 2} <= {k for k, _, _ in records}  # plain decoding and the deepest drafts, at least
    for k, seconds, accepted in records:
        assert seconds >= 0.02 * (min(accepted + 1, k) + 1), (k, seconds, accepted)


@pytest.mark.slow  # ~12 s
def test_sessions_of_an_engine_share_its_draft_depth():
    """The second session goes on from the first one's measurements: the same DraftDepth, its cycles counted
    on and its prices kept (so a session does not measure plain decoding and the deepest drafts afresh);
    the tokens are plain decoding's either way."""
    engine, ids = Engine.load(CASE), prompt(30, seed=5)
    k = engine.args.dspark_block_size
    outs, counted, seconds = [], [], []
    for _ in range(2):
        s = engine.session()
        outs.append(list(decode(s, s.prefill(ids), 24, SamplingParams(), stop=set(), dspark=k)))
        counted.append(engine.draft_depths[k].cycles)
        seconds.append({d: list(t) for d, t in engine.draft_depths[k].seconds.items()})
    plain = engine.session()
    assert outs[0] == outs[1] == list(decode(plain, plain.prefill(ids), 24, SamplingParams(), stop=set()))
    assert list(engine.draft_depths) == [k] and 6 <= counted[0] < counted[1]
    assert all(len(t) == DraftDepth.SAMPLES for t in (seconds[0][0], seconds[0][k]))


def test_draft_depth_follows_a_change_of_acceptance():
    """The acceptance counts forget (MEMORY drafted cycles): after 200 cycles of drafts that pay (80 %
    accepted, cheap drafts, a step growing with its rows), text the drafter gets wrong (5 %) sends it back
    to plain decoding within a few dozen cycles -- undecayed counts would hold 200 cycles of 80 % against it."""
    depth, rng, chosen = DraftDepth(4), random.Random(1), []
    for cycle in range(400):
        k = depth.choose()
        accept = 0.8 if cycle < 200 else 0.05
        accepted = next((i for i in range(k) if rng.random() > accept), k)
        depth.record(k, 10e-3 + 1e-3 * (k + 1) + (2e-3 if k else 0.0), accepted)
        chosen.append(k)
    assert chosen[150:200].count(4) >= 45
    assert chosen[300:].count(0) >= 90


@pytest.mark.parametrize("machine", ["drafts-cost-more", "drafts-pay"])
def test_draft_depth_falls_back_to_plain_decoding_where_drafts_do_not_pay(machine):
    """DraftDepth measures plain decoding and the deepest drafts first, re-measures the other depths now and
    then, and keeps to the fastest: on a machine whose verify step costs the same for any row count and whose
    draft costs nearly a step (a GPU running a small model), 30 % acceptance does not pay and it decodes
    plainly; where a step's cost grows slowly with its rows and drafts are cheap and mostly right, it drafts
    all the way. A session's first dozen cycles cost 20x a warm one, and a switch of depth costs its first
    cycle a recapture (graph warm-ups and captures): neither may decide anything."""
    k_max = 4
    depth = DraftDepth(k_max)
    step, draft, accept = {"drafts-cost-more": (lambda rows: 2.6e-3, 2.5e-3, 0.3),
                           "drafts-pay": (lambda rows: 10e-3 + 1e-3 * rows, 2e-3, 0.8)}[machine]
    rng, chosen = random.Random(0), [None]
    for cycle in range(300):
        k = depth.choose()
        accepted = next((i for i in range(k) if rng.random() > accept), k)
        warming = 0.05 if cycle < 12 else 0.02 if k != chosen[-1] else 0.0
        depth.record(k, step(k + 1) + (draft if k else 0.0) + warming, accepted)
        chosen.append(k)
    chosen = chosen[1:]
    assert chosen[:6] == [k_max] * 3 + [0] * 3 and set(chosen) == set(range(k_max + 1))
    best = 0 if machine == "drafts-cost-more" else k_max
    assert chosen[-100:].count(best) >= 90
