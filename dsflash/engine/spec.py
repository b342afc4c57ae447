"""Decoding loop with DSpark speculative decoding (spec §10).

Each cycle verifies [anchor, d_1..d_k] in one `step`; the target samples every row with the
position-keyed sampler, drafts are accepted while they equal the target's own sample, and the first
disagreement (or the row after the last draft) gives the next anchor. Output is therefore exactly the
tokens of plain decoding, greedy or seeded. The draft depth is chosen from measured costs: the time of
a verify of L rows and the observed acceptance of each draft slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dsflash.engine.sampling import Constraint, History, SamplingParams, sample
from dsflash.engine.session import MAX_STEP_ROWS, Session


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    generated: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        return self.generated / self.cycles if self.cycles else 0.0

    def as_dict(self) -> dict:
        prefilled = self.prompt_tokens - self.cached_tokens
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "ttft_s": self.ttft_s, "prefill_tok_s": prefilled / self.prefill_s if self.prefill_s else 0.0,
            "decode_tok_s": (self.generated - 1) / self.decode_s if self.decode_s and self.generated > 1 else 0.0,
            "generated": self.generated, "accept_rate": self.accept_rate,
            "tokens_per_cycle": self.tokens_per_cycle,
        }


@dataclass
class DraftDepth:
    """Chooses k to maximise expected tokens per second of a cycle, from measured verify times by row
    count and the acceptance seen at each draft slot (Laplace-smoothed). Every depth, plain decoding (k = 0)
    included, is first run twice, deepest first, so that each is weighed by its own measured time: a first
    step of a row count may carry its CUDA graph's capture, so the second sample replaces it. (Weighing an
    unmeasured depth by a flat second kept plain decoding from ever being tried once drafting had been, on
    a GPU where drafts cost more than they save.)"""

    max_k: int
    # seconds of a verify step by its row count, and under 0 of the draft itself; how many samples each had
    seconds: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    tried: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tried = [0] * self.max_k
        self.hits = [0] * self.max_k

    def choose(self) -> int:
        for k in range(self.max_k, -1, -1):
            if self.samples.get(k + 1, 0) < 2:
                return k
        best_k, best_rate = 0, 0.0
        for k in range(self.max_k + 1):
            expected = 1 + sum(self._reach(i) for i in range(1, k + 1))
            rate = expected / (self.seconds[k + 1] + (self.seconds[0] if k else 0.0))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _reach(self, i: int) -> float:
        """P(the i-th draft is accepted), Laplace-smoothed: of the cycles that drafted it, the share that
        accepted it -- already the chance of reaching it, as a draft is accepted only after the ones before
        it (a product over the slots before would count each earlier rejection again)."""
        return (self.hits[i - 1] + 1) / (self.tried[i - 1] + 1)

    def _time(self, key: int, seconds: float) -> None:
        n = self.samples.get(key, 0)
        self.samples[key] = n + 1
        self.seconds[key] = seconds if n < 2 else 0.8 * self.seconds[key] + 0.2 * seconds

    def record(self, rows: int, seconds: float, drafted: int, accepted: int, draft_s: float) -> None:
        self._time(rows, seconds)
        if drafted:
            self._time(0, draft_s)
        for i in range(drafted):
            self.tried[i] += 1
            self.hits[i] += i < accepted


@dataclass
class FixedDepth:
    """Always k drafts: what the drafter alone achieves, independent of the machine's timings (the quality
    gates' measurement; DraftDepth's choices follow measured step times, so its acceptance moves with load)."""

    max_k: int

    def choose(self) -> int:
        return self.max_k

    def record(self, rows: int, seconds: float, drafted: int, accepted: int, draft_s: float) -> None:
        pass


def decode(session: Session, first_logits, max_new: int, params: SamplingParams, stop: set[int],
           dspark: int = 0, stats: DecodeStats | None = None,
           stopped: Callable[[], bool] | None = None, constraint: Constraint | None = None,
           adaptive: bool = True) -> Iterator[int]:
    """Yield up to `max_new` tokens after the session's last row (whose logits are `first_logits`);
    a `constraint` restricts them (a forced tool call, JSON mode). `dspark`: drafts a cycle, at most; chosen
    each cycle by measured rates (DraftDepth), or all of them when not `adaptive`."""
    stats = stats or DecodeStats()
    depth = None
    if dspark and session.decoder.model.dspark:
        depth = (DraftDepth if adaptive else FixedDepth)(min(dspark, session.engine.args.dspark_block_size))
    t0 = time.perf_counter()
    history = History(session.tokens, first_logits.numel()) if params.adjusted else None

    def emitted_token(t: int) -> None:  # what the sampler of the next position depends on
        if history is not None:
            history.add(t)
        if constraint is not None:
            constraint.advance(t)

    tok = sample(first_logits, session.pos, params, history, constraint)
    emitted = 0
    while True:
        emitted_token(tok)
        yield tok
        emitted += 1
        stats.generated += 1
        if tok in stop or emitted >= max_new or (stopped and stopped()):
            break
        # tokens the constraint leaves no choice about are drafts that verify for sure: one step for all of them
        forced = constraint.determined(MAX_STEP_ROWS - 1) if constraint is not None else []
        k = 0 if forced or not depth else depth.choose()
        td = time.perf_counter()
        drafts = forced or (session.draft(tok)[:k] if k else [])
        td = time.perf_counter() - td
        p = session.pos
        ts = time.perf_counter()
        logits = session.step(p, [tok] + drafts)
        ts = time.perf_counter() - ts
        accepted = 0
        for j, d in enumerate(drafts):
            target = sample(logits[j], p + j + 1, params, history, constraint)
            if target != d:
                break
            accepted += 1
            emitted_token(d)
        new_anchor = sample(logits[accepted], p + accepted + 1, params, history, constraint)
        stats.cycles += 1
        if not forced:  # DSpark's own drafts: its acceptance and the depth's measurements
            stats.drafted += len(drafts)
            stats.accepted += accepted
            if depth:
                depth.record(len(drafts) + 1, ts, len(drafts), accepted, td)
        session.rollback(p + accepted + 1)
        session.last_logits = logits[accepted]
        done = False
        for d in drafts[:accepted]:
            yield d
            emitted += 1
            stats.generated += 1
            if d in stop or emitted >= max_new or (stopped and stopped()):
                done = True
                break
        if done:
            break
        tok = new_anchor
    stats.decode_s = time.perf_counter() - t0
