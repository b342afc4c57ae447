"""The training mode (issue 21): data splits, the straight-through training forward against the CPU
reference on the exported checkpoint, a few steps that lower the NLL, and the saved checkpoint loading and
decoding (DSpark output equal to plain decoding) through the engine."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsflash.checkpoint.make import make_checkpoint
from dsflash.checkpoint.reader import Checkpoint
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import DecodeStats, decode
from dsflash.kernels import cpu
from dsflash.model.common import Selections
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Debug, Tokens, Transformer
from dsflash.numerics.codecs import E2M1_VALUES, dequant_fp4_rows, quantize_fp4_rows
from dsflash.tokenizer import BOS_ID, EOS_ID, TINY_CORPUS, build_tiny_tokenizer, compressed_token_map, load_tokenizer
from dsflash.train import data, vocab
from dsflash.train.backend import (
    ENGRAM,
    FP4,
    FP8,
    GROUP_ROWS,
    Masters,
    TrainState,
    _SparseAttention,
    dequantised,
    fake_values,
    grouped_slots,
    kv_sums,
    kv_sums_fixed_point,
    quantised,
)
from dsflash.train.export import export_weights, stored_tensors
from dsflash.train.indexer import attention_picks, attention_target, query_rows
from dsflash.train.loop import (
    FAR_VOCAB,
    REPEAT_VOCAB_GROWTH,
    REPEAT_VOCAB_LEARNT,
    REPEAT_VOCAB_STEPS,
    TWICE_TOKENS,
    Plan,
    Trainer,
    draft_logits,
    drop_unrouted_grads,
    greedy_chain,
    learning_rate,
    smoke_args,
)
from dsflash.train.plot import POINTS, block_means
from dsflash.train.quality import NEEDLE_WORDS
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


def trainer(data_dir, window_size: int | None = None, **plan) -> Trainer:
    token_map, classes = data.load_engram_map(data_dir)
    args = smoke_args(len(token_map), classes)
    args = dataclasses.replace(args, window_size=window_size) if window_size else args
    return Trainer(args, token_map, data.load_tokens(data_dir, "train"), data.load_tokens(data_dir, "validation"),
                   Plan(**plan), "cpu")


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


def _awkward_weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows over 60 binades, an all-zero block, negative zeros, and values on the E2M1 / E4M3 rounding ties."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-25, 25, rows).unsqueeze(1)
    w[0, :32] = 0
    w[1, :7] = -0.0
    w[2] = torch.randint(-25, 26, (cols,), generator=g) * 0.25  # E2M1 ties at a scale of 1
    w[3] = (torch.randint(0, 2**7, (cols,), generator=g) * 2 + 1) * 2.0**-9  # E4M3 mantissa ties
    return w


@pytest.mark.parametrize("kind,shape", [(FP4, (64, 128)), (FP8, (70, 100)), (ENGRAM, (40, 64))])
def test_batched_fake_quantiser_gives_the_codecs_bits(kind, shape):
    """The training forward's weights (one call over a stack of same-shape weights, no host reads) are the
    values the export's codecs write and the loader decodes, bit for bit, sign of zero included."""
    stack = torch.stack([_awkward_weights(*shape, seed) for seed in range(3)])
    got = fake_values(kind, stack)
    for w, values in zip(stack, got, strict=True):
        assert torch.equal(values.view(torch.int32), dequantised(kind, *quantised(kind, w)).view(torch.int32))


def test_masters_requantise_a_weight_only_after_it_changed(data_dir):
    t = trainer(data_dir, seq_len=96)
    m = t.masters
    names = [n for n, k in m.kinds.items() if k == FP4][:2]
    before = [m.values(n).detach().clone() for n in names]
    with torch.no_grad():
        m.params[names[0]].mul_(3.0)  # an optimiser step's in-place update bumps the version
    after = [m.values(n) for n in names]
    want = dequantised(FP4, *quantised(FP4, m.params[names[0]].detach())).to(torch.bfloat16)
    assert torch.equal(after[0], want) and not torch.equal(after[0], before[0])
    assert torch.equal(after[1], before[1])
    after[0].float().sum().backward()  # straight through to the master
    assert torch.equal(m.params[names[0]].grad, torch.ones_like(m.params[names[0]]))


def test_grouped_expert_gemm_is_the_per_slot_linear(data_dir):
    """expert_linear's grouped layout (slots by bank entry, padded groups) gives every slot the training linear
    of its row and entry, with the gradients of that loop."""
    t = trainer(data_dir, seq_len=96)
    k, a = t.k, t.args
    bank = [k.weight(FP4, t.masters.get(f"layers.0.ffn.experts.{e}.w1.weight"), None)
            for e in range(a.n_routed_experts)]
    experts = torch.tensor([[3, 0], [3, 5], [7, 3], [0, 5], [5, 3]])  # entries 1, 2, 4, 6 unused
    slot_of_row, row_of_slot, ends = grouped_slots(experts.flatten(), len(bank))
    assert torch.equal(slot_of_row[row_of_slot], torch.arange(experts.numel()))
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    assert bool((starts % GROUP_ROWS == 0).all()) and bool((ends >= starts).all())
    x = torch.randn(experts.size(0), a.dim, dtype=torch.bfloat16, requires_grad=True)
    y = k.expert_linear(x, bank, experts, 2)
    rows = torch.arange(experts.numel()) // 2
    ref_x = x.detach().clone().requires_grad_(True)
    ref = torch.cat([k.linear(ref_x[rows[s]].unsqueeze(0), bank[int(e)]) for s, e in enumerate(experts.flatten())])
    assert torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-3)
    probe = torch.randn_like(y, dtype=torch.float32)
    grads = torch.autograd.grad((y.float() * probe).sum(), [x, bank[3].master])
    ref_grads = torch.autograd.grad((ref.float() * probe).sum(), [ref_x, bank[3].master])
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g.float(), r.float(), rtol=2e-2, atol=2e-2 * float(r.abs().max()))


def test_sparse_attention_backward_is_the_exact_softmaxs_gradient():
    """The training backend's sparse attention: the reference's output bits, and gradients of q, kv and the
    sinks closer to those of an exact float64 softmax than autograd's through the reference (which gives NaN
    for a query with no valid index); duplicated rows across queries, -1 padding, a query with none."""
    g = torch.Generator().manual_seed(0)
    n, h, d, r, k = 50, 4, 32, 70, 150
    q, kv = torch.randn(n, h, d, generator=g).bfloat16(), torch.randn(r, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.stack([torch.cat([torch.randperm(r, generator=g), torch.full((k - r,), -1)]) for _ in range(n)])
    idx[3], idx[5, 10:] = -1, -1
    probe = torch.randn(n, h, d, generator=g)

    def exact(qq, kk, ss):
        rows = kk[idx.clamp_min(0)]
        s = torch.where((idx >= 0).unsqueeze(1), torch.einsum("nhd,nkd->nhk", qq, rows) * d ** -0.5, -torch.inf)
        p = torch.softmax(torch.cat([s, ss.view(1, h, 1).expand(n, h, 1)], -1), -1)[..., :-1]
        return torch.einsum("nhk,nkd->nhd", p, rows)

    def grads(fn, dtype=None):
        leaves = [(t.to(dtype) if dtype else t.clone()).requires_grad_() for t in (q, kv, sink)]
        out = fn(*leaves) if dtype else fn(*leaves, idx, d ** -0.5)
        (out.double() * probe).sum().backward()
        return out, [t.grad.double() for t in leaves]

    (out, got), (ref_out, ref) = grads(_SparseAttention.apply), grads(cpu.sparse_attn)
    truth = grads(exact, torch.float64)[1]
    assert torch.equal(out, ref_out)
    rel = [float((a - t).norm() / t.norm()) for a, t in zip(got, truth, strict=True)]
    assert all(e < 0.01 for e in rel), rel
    for a, b, t in zip(got[:2], ref[:2], truth[:2], strict=True):  # the sinks' reference gradient is NaN here
        assert float((a - t).norm()) <= float((b - t).norm())
    assert not torch.isfinite(ref[2]).all()


def test_fixed_point_kv_sums_do_not_depend_on_the_order():
    """The GPU's kv-gradient sums (train/backend.py kv_sums_fixed_point, here with torch's integer adds standing
    in for the kernel's atomics): the same bits whatever order the contributions arrive in, within the fixed
    point's resolution of the CPU's float sums, over magnitudes 1e-6 .. 1e3 and -1 indices."""
    g = torch.Generator().manual_seed(1)
    src = torch.randn(400, 24, generator=g) * torch.logspace(-6, 3, 400).unsqueeze(-1)
    idx = torch.randint(-1, 9, (400,), generator=g)
    src[idx < 0] = 0  # what sparse_attn_grads gives at -1

    def add_rows(dst, rows_of, part, factor):
        dst.index_add_(0, rows_of.clamp_min(0), (part * factor).to(torch.int64))

    kv = torch.zeros(9, 24)
    sums = [kv_sums_fixed_point([(idx[o[:150]], src[o[:150]]), (idx[o[150:]], src[o[150:]])], kv, add_rows)
            for o in (torch.arange(400), torch.randperm(400, generator=g), torch.arange(399, -1, -1))]
    assert torch.equal(sums[0], sums[1]) and torch.equal(sums[0], sums[2])
    exact = torch.zeros(9, 24, dtype=torch.float64).index_add_(0, idx.clamp_min(0), src.double())
    assert ((sums[0].double() - exact).abs() <= exact.abs() * 2.0 ** -24 + 400 * 2.0 ** -(62 - 9 - 12)).all()
    # closer than the CPU's sequential fp32 adds
    assert (sums[0].double() - exact).norm() <= (kv_sums([(idx, src)], kv).double() - exact).norm()


def test_an_unrouted_expert_gets_no_gradient(data_dir):
    t = trainer(data_dir, seq_len=96)
    n = t.args.n_routed_experts
    for p in t.masters.params.values():
        p.grad = torch.zeros_like(p)
    load = torch.ones(n, dtype=torch.int64)
    load[2] = 0
    drop_unrouted_grads(t.masters, {0: load})
    for e in range(n):
        for w in ("w1", "w2", "w3"):
            assert (t.masters.params[f"layers.0.ffn.experts.{e}.{w}.weight"].grad is None) == (e == 2), (e, w)
    assert t.masters.params["layers.1.ffn.experts.2.w1.weight"].grad is not None  # another layer's expert 2


def find(x: list[int], part: list[int], start: int = 0) -> int:
    return next((i for i in range(start, len(x) - len(part) + 1) if x[i:i + len(part)] == part), -1)


def test_windows_carry_recall_facts_apart_and_the_text_elsewhere(data_dir):
    """Each 512-token span of a window states one made-up fact and asks for it again >= 64 tokens later (the
    needle gate's words never among them); every other token is the train text's."""
    tok = load_tokenizer(data_dir)
    facts = vocab.recall_facts(tok, vocab.answer_words([data.Document("kjv", "x", TINY_CORPUS)]), 50, seed=1)
    assert all(not tok.decode(f["answer"]).strip().lower().startswith(tuple(w.lower() for w in NEEDLE_WORDS))
               for f in facts)
    token_map, classes = data.load_engram_map(data_dir)
    make = lambda facts: Trainer(smoke_args(len(token_map), classes), token_map,  # noqa: E731
                                 data.load_tokens(data_dir, "train"), data.load_tokens(data_dir, "validation"),
                                 Plan(seq_len=2047, fact_span=512), "cpu", facts)
    (x, answers, *_), (plain, none, *_) = make(facts).window(), make([]).window()
    x, plain = x.tolist(), plain.tolist()
    assert none.numel() == 0 and answers.numel() == 4
    written = np.zeros(len(x), dtype=bool)
    for s0 in range(0, 2048, 512):
        fact = next(f for f in facts if s0 <= find(x, f["statement"], s0) < s0 + 128)
        a = find(x, fact["statement"], s0)
        b = find(x, fact["cue"] + fact["answer"], a + len(fact["statement"]) + 64)
        assert a + len(fact["statement"]) + 64 <= b <= s0 + 512 - len(fact["cue"] + fact["answer"])
        assert int(answers[s0 // 512]) + 1 == b + len(fact["cue"])  # where the answer's first token is predicted
        written[a:a + len(fact["statement"])] = written[b:b + len(fact["cue"] + fact["answer"])] = True
    assert all(u == v for u, v, w in zip(x, plain, written, strict=True) if not w)


@pytest.mark.parametrize(("progress", "ids"), [(0.0, "text"), (1.0, "text"), (1.0, "window"), (1.0, "vocabulary")])
def test_windows_repeat_passages_at_the_curriculums_gaps(data_dir, progress, ids):
    """A window's repeats: passages of 16-64 tokens written again 8 tokens to the curriculum's longest gap after
    their end (half the attention window at the start, `repeat_reach` from halfway on) until the share is
    copied; the copy positions are the ones whose targets a repeat gives (all but its first token), the far ones
    those more than a window after their source; every other token is the train text's. With `ids` "window" or
    "vocabulary", a passage and its copy are ids drawn from the window or the train text's distinct tokens,
    not the text there."""
    t = trainer(data_dir, seq_len=2047, repeat_share=0.3, repeat_reach=512, repeat_ids=ids)
    plain = trainer(data_dir, seq_len=2047).window()[0]
    x, _, copies, far = t.window(progress)
    top = t.repeat_gap_max(progress)
    assert top == (t.args.window_size // 2 if progress == 0 else 512)
    runs = np.split(copies.numpy(), np.flatnonzero(np.diff(copies.numpy()) != 1) + 1)
    assert 0.3 * 2048 <= sum(r.size + 1 for r in runs) < 0.3 * 2048 + 64
    written, sources, far_expected = np.zeros(x.numel(), dtype=bool), np.zeros(x.numel(), dtype=bool), []
    for run in runs:
        b, n = int(run[0]), run.size + 1
        assert 16 <= n <= 64
        a = next(a for a in range(b - n - 8, -1, -1) if torch.equal(x[a:a + n], x[b:b + n]))
        assert b - (a + n) <= top, (a, b, n, top)
        written[a:a + n] = written[b:b + n] = sources[a:a + n] = True
        far_expected.extend(run.tolist() if b - a > t.args.window_size else [])
    assert sorted(far.tolist()) == sorted(far_expected) and (progress == 0 or len(far_expected) > copies.numel() / 2)
    assert torch.equal(plain[torch.from_numpy(~written)], x[torch.from_numpy(~written)])
    changed = float((plain[torch.from_numpy(sources)] != x[torch.from_numpy(sources)]).float().mean())
    assert changed > 0.8 if ids != "text" else changed == 0, changed
    pool = torch.unique(x) if ids == "window" else t.vocabulary if ids == "vocabulary" else None
    if pool is not None:  # drawn from the window, or from the text's distinct tokens, which are many more
        assert bool(torch.isin(x[torch.from_numpy(sources)], pool).all())
    if ids != "text":  # from the window, ids come as often as the text has them; from the vocabulary, uniformly
        top = int(torch.bincount(x[torch.from_numpy(sources)]).max())
        assert top <= 12 if ids == "vocabulary" else top >= 20, top  # 626 ids: 31 the text's most common, 7


def test_vocabulary_repeats_start_from_a_few_ids_and_grow_as_they_are_learnt(data_dir):
    """Plan.repeat_vocab: passages drawn from the first ids of the seeded order only, REPEAT_VOCAB_GROWTH times
    more once the last REPEAT_VOCAB_STEPS steps' mean copy accuracy reaches REPEAT_VOCAB_LEARNT, never past the
    train text's distinct ids; a backbone step logs the count it drew from."""
    t = trainer(data_dir, seq_len=255, repeat_share=0.5, repeat_ids="vocabulary", repeat_vocab=8, steps=1,
                eval_every=1000)
    x, _, copies, _ = t.window(1.0)
    assert set(x[copies + 1].tolist()) <= set(t.vocabulary[:8].tolist()) and copies.numel() > 30
    for acc in [0.9] * (REPEAT_VOCAB_STEPS - 1):
        t.grow_copy_curriculum(acc)
    assert t.repeat_vocab == 8  # fewer than REPEAT_VOCAB_STEPS steps seen
    t.grow_copy_curriculum(1.0 - REPEAT_VOCAB_LEARNT)
    assert t.repeat_vocab == 8 * REPEAT_VOCAB_GROWTH
    for acc in [REPEAT_VOCAB_LEARNT - 0.01] * (3 * REPEAT_VOCAB_STEPS):
        t.grow_copy_curriculum(acc)
    assert t.repeat_vocab == 8 * REPEAT_VOCAB_GROWTH  # not learnt: no growth
    for _ in range(20 * REPEAT_VOCAB_STEPS):
        t.grow_copy_curriculum(1.0)
    assert t.repeat_vocab == t.vocabulary.numel() == torch.unique(t.train_tokens).numel()
    t.backbone(deadline=math.inf)
    assert t.log.rows[-1]["repeat_vocab"] == t.vocabulary.numel()


def test_copy_warmup_windows_are_passages_of_the_curriculums_ids_written_twice(data_dir):
    """Plan.copy_warmup: over its share of the phase a window is ids alone, each passage of TWICE_TOKENS written
    twice, drawn from the curriculum's first `repeat_vocab` ids, its copies the positions whose target is a second
    copy's token after its first; after it, the text with its repeats; without vocabulary ids, refused."""
    t = trainer(data_dir, seq_len=255, repeat_share=0.3, repeat_ids="vocabulary", repeat_vocab=8, copy_warmup=0.5)
    x, answers, copies, far = t.window(0.2)
    h = TWICE_TOKENS
    assert x.numel() == 256 and answers.numel() == 0
    assert torch.equal(far, copies)  # TWICE_TOKENS back: beyond the smoke model's window
    assert set(x.tolist()) <= set(t.vocabulary[:8].tolist())
    assert all(torch.equal(x[p + h:p + 2 * h], x[p:p + h]) for p in range(0, 256, 2 * h))  # no gap at first
    expected = [p + h + i for p in range(0, 256, 2 * h) for i in range(h - 1)]
    assert copies.tolist() == expected and torch.equal(x[copies + 1], x[copies + 1 - h])
    text = t.window(0.7)[0]
    assert len(set(text.tolist()) - set(t.vocabulary[:8].tolist())) > 50  # the text, not the warm-up's ids
    with pytest.raises(ValueError, match="copy_warmup"):
        trainer(data_dir, seq_len=255, copy_warmup=0.5)


def test_the_copy_curriculum_grows_the_gap_between_a_passage_and_its_copy_then_the_ids_then_the_gap(data_dir):
    """Among the first ids, the curriculum's levels vary the copy warm-up's distance from a copy to its passage (0,
    1, REPEAT_VOCAB_GROWTH-fold up to half the window): no fixed offset then predicts a copy, only the earlier
    occurrence of the current id (`twice_window`). Each copy's target follows the current id a passage and a gap
    back. Then the ids grow; with every id copied, among FAR_VOCAB ids again the gap grows on beyond the window to
    the repeats' reach, those copies reported as far, and then the ids; once that is learnt the warm-up ends, before
    its share of the phase; a backbone step logs the gap and whether it warmed up."""
    t = trainer(data_dir, window_size=64, seq_len=2047, repeat_share=0.3, repeat_ids="vocabulary", repeat_vocab=16,
                copy_warmup=1.0, repeat_reach=600, steps=1, eval_every=1000)
    half, every = t.args.window_size // 2, t.vocabulary.numel()
    levels = [(t.twice_gap, t.repeat_vocab)]
    while t.warming and len(levels) < 30:
        for _ in range(REPEAT_VOCAB_STEPS):
            t.grow_copy_curriculum(REPEAT_VOCAB_LEARNT)
        levels.append((t.twice_gap, t.repeat_vocab))
    gaps, ids = zip(*levels, strict=True)
    assert gaps[:3] == (0, 1, REPEAT_VOCAB_GROWTH) and ids[:3] == (16, 16, 16)
    top = gaps.index(half)  # every gap to half the window before a second id
    assert set(ids[:top + 1]) == {16} and ids[top + 1] == 16 * REPEAT_VOCAB_GROWTH and set(gaps[top:]) > {half}
    beyond = ids.index(FAR_VOCAB, ids.index(every))  # every id copied within the window, then few ids again
    assert gaps[beyond] == half and every > FAR_VOCAB
    assert gaps[beyond + 1] == half * REPEAT_VOCAB_GROWTH and ids[beyond + 1] == FAR_VOCAB
    assert gaps[-1] == 600 and ids[-1] == every and levels[-1] == levels[-2]
    assert gaps.index(600) < ids.index(every, beyond)  # the far gaps among few ids first, then the ids
    assert sorted(gaps) == list(gaps) and all(sorted(part) == list(part) for part in (ids[:beyond], ids[beyond:]))
    assert not t.warming  # the last level learnt: the warm-up ends before its share of the phase
    t.warming, t.repeat_vocab, t.twice_gap = True, 16, half
    x, _, copies, far = t.window(0.5)
    assert len(set(x.tolist())) <= 16 and far.numel() == 0
    offsets = set()
    for c in copies.tolist():  # the passage's id and the one after it, a passage to a passage and half back
        back = [d for d in range(TWICE_TOKENS, TWICE_TOKENS + half + 1)
                if x[c - d] == x[c] and x[c + 1 - d] == x[c + 1]]
        assert back, c
        offsets.add(back[0])
    assert len(offsets) > half // 2  # the gap varies
    assert copies.numel() > 0.3 * x.numel()
    t.twice_gap = 2 * TWICE_TOKENS  # a copy from 32 to 96 back: beyond the 64-token window half the time
    x, _, copies, far = t.window(0.5)
    far, copies = set(far.tolist()), copies.tolist()
    assert 0 < len(far) < len(copies)
    for first in range(0, len(copies) - TWICE_TOKENS + 2, TWICE_TOKENS - 1):  # each copy's targets, whole
        c = copies[first]
        run = x[c:c + TWICE_TOKENS]
        back = next(d for d in range(TWICE_TOKENS, c + 1) if torch.equal(x[c - d:c - d + TWICE_TOKENS], run))
        assert {(back > t.args.window_size) == (i in far) for i in copies[first:first + TWICE_TOKENS - 1]} == {True}
    t.twice_gap = 600
    t.backbone(deadline=math.inf)
    assert t.log.rows[-1]["twice_gap"] == 600 and t.log.rows[-1]["warm_up"] == 1
    t.twice_window = lambda rng: pytest.fail("a warm-up window after the warm-up")
    t.warming = False
    assert t.window(0.5)[0].numel() == 2048


def test_a_few_steps_lower_the_validation_nll(data_dir):
    t = trainer(data_dir, seq_len=96, steps=16, warmup=2, lr=1e-2, eval_every=1000)
    before = t.nll(t.validation, 2)
    assert t.backbone(deadline=math.inf) == 16
    after = t.nll(t.validation, 2)
    assert after < before - 0.25, (before, after)
    biases = [p for n, p in t.masters.params.items() if n.endswith(".gate.bias")]
    assert any(bool(b.abs().sum() > 0) for b in biases)  # the balancing moved the routers' biases


def test_the_indexer_learns_the_main_attentions_distribution(data_dir):
    """The next-token loss cannot reach the indexer (its scores only pick indices); its KL to the main attention
    gives gradients to the indexer's own weights and to nothing else, and steps on it lower it."""
    t = trainer(data_dir, seq_len=96, steps=1, index_rows=64)
    x = t.window()[0]
    model, state, trace = t.model(), TrainState(device="cpu"), {}
    out = model.forward(state, Tokens(x[:-1]), debug=Debug(trace=trace))
    F.cross_entropy(out.logits, x[1:]).backward()
    index_params = {n for n in t.masters.params if ".indexer." in n}
    assert {n.split(".")[1] for n in index_params} == {str(i) for i in t.args.index_source_layers}
    assert all(t.masters.params[n].grad is None for n in index_params)
    opt = torch.optim.Adam([t.masters.params[n] for n in sorted(index_params)], lr=3e-3)
    kls = []
    for _ in range(12):
        for p in t.masters.params.values():
            p.grad = None
        model, state, trace = t.model(), TrainState(device="cpu"), {}
        model.forward(state, Tokens(x[:-1]), debug=Debug(trace=trace))
        kl = t.indexer_loss(model, state, trace, query_rows(96, 64, t.args.window_size, torch.Generator(), "cpu"))
        kl.backward()
        if not kls:
            assert {n for n, p in t.masters.params.items() if p.grad is not None and p.grad.abs().sum() > 0} == \
                index_params
        kls.append(float(kl))
        opt.step()
    assert kls[0] > 0 and kls[-1] < 0.8 * kls[0], kls


def test_the_warm_up_picks_what_the_main_attention_weighs_most(data_dir):
    """attention_picks as the index layers' picker: every query row past the first groups gets the
    `index_topk` visible entries holding the most of the main attention's weight -- at least as much as the
    indexer's picks of the same forward, and more on most rows (the seeded indexer picks by other scores) --
    and the forward attends to them (its logits differ from the indexer-picked forward's)."""
    t = trainer(data_dir, seq_len=192, steps=1)
    x = t.window()[0][:-1]
    got: dict[int, list[tuple]] = {}

    def recording(pick):
        def picker(attn, xs, qr, chunk):
            topk = pick(attn, xs, qr, chunk)
            got.setdefault(attn.layer, []).append((attn, qr, chunk.positions, topk))
            return topk
        return picker

    def indexer(attn, xs, qr, chunk):  # what an index layer does without a picker
        return attn.indexer.select(xs, qr, attn.kv_source, chunk, attn.rope)

    with torch.no_grad():
        plain = t.model().forward(TrainState(device="cpu"), Tokens(x)).logits
        logits, weights = {}, {}
        for name, pick in (("attention", attention_picks), ("indexer", indexer)):
            got.clear()
            model, state = t.model(), TrainState(device="cpu")
            logits[name] = model.forward(state, Tokens(x), debug=Debug(select=Selections(
                picker=recording(pick)))).logits
            weights[name] = {}
            for layer, [(attn, qr, positions, topk)] in got.items():
                entries = state.compressed[attn.kv_source].rows
                hidden = torch.arange(entries.size(0)) >= ((positions + 1) // attn.ratio).unsqueeze(-1)
                target = attention_target(attn, qr, positions, entries, hidden).nan_to_num(0.0)  # rows seeing none
                weights[name][layer] = torch.where(topk >= 0, target.gather(1, topk.clamp_min(0)), 0.0).sum(1)
                best = target.topk(min(t.args.index_topk, entries.size(0)), dim=1).values.sum(1)
                if name == "attention":
                    assert torch.allclose(weights[name][layer], best)
    assert torch.equal(logits["indexer"], plain)
    assert set(weights["attention"]) == set(t.args.index_source_layers)
    for layer, w in weights["attention"].items():
        late = (torch.arange(w.numel()) >= t.args.index_topk * 2)  # rows with more visible entries than picks
        assert bool((w >= weights["indexer"][layer] - 1e-6).all())
        assert (w[late] > weights["indexer"][layer][late] + 1e-6).float().mean() > 0.5, layer
    assert not torch.equal(logits["attention"], logits["indexer"])


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


def test_an_untrained_tensor_goes_out_as_it_came_in(tmp_path):
    """Exporting masters loaded from a checkpoint (`--init`) writes every quantised tensor no step changed with
    the checkpoint's own bytes (re-quantising its values gives the same values, but in some blocks other
    codes and scales); a tensor a step changed is its master quantised again."""
    args = smoke_args(VOCAB, 100)
    make_checkpoint(args, 0, tmp_path)
    ckpt = Checkpoint(tmp_path)
    masters = Masters(ckpt, "cpu")
    name = "layers.1.attn.wo_b.weight"
    codes, scale = quantised(masters.kinds[name], masters.params[name].detach())
    assert not (torch.equal(codes.view(torch.uint8), ckpt.get(name).view(torch.uint8))
                and torch.equal(scale.view(torch.uint8), ckpt.get(name[:-6] + "scale").view(torch.uint8)))
    u8 = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
    assert all(torch.equal(u8(t), u8(ckpt.get(n))) for n, t in stored_tensors(masters).items())
    with torch.no_grad():
        masters.params[name].mul_(1.5)
    codes, scale = quantised(masters.kinds[name], masters.params[name].detach())
    out = stored_tensors(masters)
    assert torch.equal(u8(out[name]), codes.view(torch.uint8)) and torch.equal(u8(out[name[:-6] + "scale"]), scale)


@pytest.mark.slow  # three smoke runs, one of them two processes: ~40-60 s on 2 cores
def test_two_ranks_train_as_one_process_with_two_windows_a_step(data_dir, tmp_path):
    """Data parallel (`--ranks 2`: two processes, gloo) leaves the masters one process gets from the same two
    windows a step (`--batch 2`), bit for bit, through both phases; the second window changes them."""
    def train(name: str, *extra: str) -> dict[str, bytes]:
        out = tmp_path / name
        assert train_main(["--data", str(data_dir), "--out", str(out), "--smoke", "--seq-len", "64", "--steps", "2",
                           "--dspark-steps", "2", "--eval-every", "1000", "--eval-windows", "1", "--device", "cpu",
                           "--repeat-share", "0.3", "--budget", "900", *extra]) == 0
        summary = json.loads((out / "train.json").read_text())
        assert (summary["backbone_steps"], summary["dspark_steps"]) == (2, 2)
        assert summary["tokens_seen"] == 2 * 64 * (1 if name == "one" else 2)
        return {f.name: f.read_bytes() for f in sorted((out / "checkpoint").glob("*.safetensors"))}

    threads = torch.get_num_threads()
    try:  # one CPU thread a process in every run: a CPU GEMM's bits depend on its thread count
        torch.set_num_threads(2)
        ranks = train("ranks", "--ranks", "2")  # each rank gets half of this process's threads
        torch.set_num_threads(1)
        batch, one = train("batch", "--batch", "2"), train("one")
    finally:
        torch.set_num_threads(threads)
    assert ranks and ranks == batch
    assert ranks != one


def test_the_loss_plot_draws_training_losses_as_block_means():
    """A step's loss is one window's: the plot draws means of consecutive steps, each at its last step."""
    series = [(step, 1.0 if step % 2 else 3.0) for step in range(1, 4 * POINTS + 1)]
    means, span = block_means(series)
    assert span == 4 and len(means) == POINTS and means[0] == (4, 2.0) and {v for _, v in means} == {2.0}
    assert block_means(series[:7]) == (series[:7], 1)


@pytest.mark.slow  # ~12 s on 2 cores
def test_the_saved_checkpoint_decodes_and_drafts_like_plain_decoding(data_dir, tmp_path):
    out = tmp_path / "run"
    assert train_main(["--data", str(data_dir), "--out", str(out), "--smoke", "--seq-len", "96", "--steps", "6",
                       "--dspark-steps", "3", "--eval-every", "3", "--eval-windows", "1", "--device", "cpu",
                       "--dspark-lr", "3e-3", "--anchors", "32"]) == 0
    summary = json.loads((out / "train.json").read_text())
    assert summary["backbone_steps"] == 6 and summary["dspark_steps"] == 3 and summary["test_nll"] > 0
    assert (summary["plan"]["lr"], summary["plan"]["dspark_lr"], summary["plan"]["anchors"]) == (Plan.lr, 3e-3, 32)
    rows = (out / "loss.csv").read_text().splitlines()
    assert rows[0].startswith("phase,step") and len(rows) == 1 + 6 + 3
    head, *logged = (line.split(",") for line in rows)
    dspark_lr = max(float(r[head.index("lr")]) for r in logged if r[0] == "dspark")  # its warm-up's third step
    assert dspark_lr == pytest.approx(learning_rate(3e-3, 2, 2 / 3, Plan.warmup))
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    engine = Engine.load(out / "checkpoint", max_context=1024)
    ids = load_tokenizer(out / "checkpoint").encode("Why is the sky blue?").ids
    outputs = []
    for k in (0, 3):
        s = engine.session()
        stats = DecodeStats()
        outputs.append(list(decode(s, s.prefill(ids), 16, SamplingParams(), stop=set(), dspark=k, stats=stats)))
    assert outputs[0] == outputs[1] and stats.drafted > 0
    s, fixed = engine.session(), DecodeStats()  # the gates' fixed depth: every cycle drafts all 3
    assert list(decode(s, s.prefill(ids), 16, SamplingParams(), stop=set(), dspark=3, stats=fixed,
                       adaptive=False)) == outputs[0]
    assert fixed.cycles > 0 and fixed.drafted == 3 * fixed.cycles


def test_dspark_chain_labels_each_block_with_the_targets_own_greedy_continuation(data_dir):
    """Plan.dspark_labels "chain" (`greedy_chain`): the rows after each anchor become the target's greedy chain --
    each the token a forward of the rewritten window up to it predicts, as decoding verifies drafts -- every other
    row keeps the text; a row whose chain holds gets weight 1 and its label (the final forward's greedy token) is
    what a forward of its prefix alone predicts; the first row of a block always counts. The text agrees with
    the greedy tokens on fewer rows than the chain holds on (without the rewrite, fewer would count)."""
    t = trainer(data_dir, seq_len=255, dspark_labels="chain")
    x = t.window(0.5)[0][:-1]
    b = t.args.dspark_block_size
    anchors = torch.tensor([9, 60, 131, 200])
    model = t.model()

    def next_token(prefix: torch.Tensor) -> int:
        return int(model.forward(TrainState(), Tokens(prefix)).logits[-1].argmax())

    with torch.no_grad():
        text_greedy = model.forward(TrainState(), Tokens(x)).logits.argmax(-1)
        chain, out, weights = greedy_chain(model, x, anchors)
        greedy, w = out.logits.argmax(-1), weights.view(-1, b)
        rows = (anchors.unsqueeze(1) + torch.arange(1, b)).flatten()
        kept = torch.ones(x.numel(), dtype=torch.bool)
        kept[rows] = False
        assert torch.equal(chain[kept], x[kept]) and not torch.equal(chain[rows], x[rows])
        assert bool((w[:, 0] == 1).all()) and float(w[:, 1:].sum()) >= b
        assert float((x[rows] == text_greedy[rows - 1]).float().mean()) < float(w[:, 1:].mean())
        for q, row in zip(anchors.tolist(), w, strict=True):
            for i in range(b):
                if row[i]:
                    assert int(greedy[q + i]) == next_token(chain[:q + i + 1]), (q, i)
                    if i:
                        assert int(chain[q + i]) == next_token(chain[:q + i]), (q, i)
    loss = t.draft_loss(t.window(0.5)[0][:-1], anchors)[0]  # the trainer's DSpark step takes the chain's labels
    assert torch.isfinite(loss)


def test_agreeing_labels_are_the_chains_where_the_text_is_the_chain(data_dir):
    """Plan.dspark_labels "agreeing" (`greedy_chain` without the rewrite): one forward, the text unchanged; a block
    row counts while the text before it is the target's greedy chain, and there its label is the chain's (what the
    rewriting chain gives a lone anchor); the rows after the first disagreement count for nothing. The trainer's
    DSpark loss is the mean over those rows, so it differs from the text labels' over every row."""
    t = trainer(data_dir, seq_len=255, dspark_labels="agreeing")
    b = t.args.dspark_block_size
    anchors = torch.arange(1, 255 - b, b + 1)
    model = t.model()
    with torch.no_grad():  # a window whose text is the chain after every other anchor (an untrained model's never is)
        x = greedy_chain(model, t.window(0.5)[0][:-1], anchors[::2])[0]
        same, out, weights = greedy_chain(model, x, anchors, rewrite=False)
        greedy, w = out.logits.argmax(-1), weights.view(-1, b)
        at = anchors.unsqueeze(1) + torch.arange(b)
        agree = (x[at[:, 1:]] == greedy[at[:, :-1]]).float()
        assert torch.equal(same, x) and bool((w[:, 0] == 1).all())
        assert torch.equal(w[:, 1:], agree.cumprod(dim=1)) and 0 < float(w[:, 1:].sum()) < w[:, 1:].numel()
        for q, row in zip(anchors.tolist(), w, strict=True):
            if row[1]:  # a lone anchor's rewritten chain: the same labels on the rows that count
                chain_greedy = greedy_chain(model, x, torch.tensor([q]))[1].logits.argmax(-1)
                kept = int(row.sum())
                assert torch.equal(chain_greedy[q:q + kept], greedy[q:q + kept]), q
    losses = [run.draft_loss(x, anchors)[0] for run in (t, trainer(data_dir, seq_len=255, dspark_labels="text"))]
    assert all(torch.isfinite(v) for v in losses) and float(losses[0]) != float(losses[1])
    with pytest.raises(ValueError, match="dspark_labels"):
        trainer(data_dir, dspark_labels="chains")


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
            plain.dspark.write_context(state, prefix.main_hidden, 0)
            _, logits, _ = plain.dspark.draft(state, int(x[q]))
            first = trained[m * b]
            assert int(first.argmax()) == int(logits[0].argmax())
            assert float((first - logits[0]).abs().max()) < 1e-2 * float(logits[0].abs().max()), q
