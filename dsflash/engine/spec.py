"""Decoding loop with DSpark speculative decoding (spec §10).

Each cycle verifies [anchor, d_1..d_k] in one `step`; the target samples every row with the
position-keyed sampler, drafts are accepted while they equal the target's own sample, and the first
disagreement (or the row after the last draft) gives the next anchor. Output is therefore exactly the
tokens of plain decoding, greedy or seeded. The draft depth is chosen from measured costs: the time of
a whole cycle at each depth and the observed acceptance of each draft slot.
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
    depths: dict[int, int] = field(default_factory=dict)  # cycles by their number of DSpark drafts

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
    """Chooses k to maximise expected tokens per second of a cycle, from each depth's measured cycle time
    and the acceptance seen at each draft slot (Laplace's rule of succession).

    A cycle is timed whole -- draft, verify, sampling, rollback -- because on a GPU the parts run
    asynchronously: the verify's kernels finish inside the sampling's read-back. A depth's time is the
    least of its last SAMPLES cycles, and every PROBE_EVERY cycles one other depth is run for two cycles (in
    turn: plain decoding, then the deepest drafts down). On a GPU a session's first dozen cycles cost 10-20x
    a warm one (its CUDA graphs' warm-ups and captures for each row count; engine/graphs.py), and so does the
    first cycle after a switch of depth when the session's buffers have grown since that row count last ran:
    a depth measured only then, or by one cycle, would be priced out for good -- on the H200 plain decoding
    was, and drafting at 0.5-0.65x of plain speed went on for the whole answer. Plain decoding and the
    deepest drafts are measured first; the depths between only by the probes, as each new depth costs a
    session slow cycles of its own.

    One DraftDepth serves an engine's sessions one after another (`Engine.draft_depths`): a session takes
    the CUDA graphs the last one captured (model/state.StatePool), so the cycle times measured are the
    machine's, not a session's; the acceptance counts forget at the rate of MEMORY drafted cycles, so they
    follow the text being written (a new prompt's, within tens of cycles) from the last one's estimate
    rather than from nothing. The server's two generation threads share it: a record is a few list updates,
    and one lost to a race costs a sample, never a token (the depth never changes the output)."""

    max_k: int
    seconds: dict[int, list[float]] = field(default_factory=dict)  # the last SAMPLES cycle times by depth
    tried: list[float] = field(default_factory=list)  # per draft slot, cycles that drafted it (decayed)
    hits: list[float] = field(default_factory=list)  # and of those, the ones that accepted it (decayed)
    cycles: int = 0
    probes: int = 0
    probing: int | None = None  # the depth a probe's second cycle runs
    SAMPLES = 3
    PROBE_EVERY = 32
    MEMORY = 64

    def __post_init__(self) -> None:
        self.tried = [0.0] * self.max_k
        self.hits = [0.0] * self.max_k

    def _rate(self, k: int) -> float:
        return (1 + sum(self._reach(i) for i in range(1, k + 1))) / min(self.seconds[k])

    def choose(self) -> int:
        for k in (self.max_k, 0):
            if len(self.seconds.get(k, ())) < self.SAMPLES:
                return k
        if self.probing is not None:
            k, self.probing = self.probing, None
            return k
        best = max(self.seconds, key=self._rate)
        if self.cycles % self.PROBE_EVERY == 0:
            others = [k for k in (0, *range(self.max_k, 0, -1)) if k != best]
            self.probing = others[self.probes % len(others)]
            self.probes += 1
            return self.probing
        return best

    def _reach(self, i: int) -> float:
        """P(the i-th draft is accepted) by Laplace's rule of succession: of the cycles that drafted it, the
        share that accepted it -- already the chance of reaching it, as a draft is accepted only after the
        ones before it (a product over the slots before would count each earlier rejection again)."""
        return (self.hits[i - 1] + 1) / (self.tried[i - 1] + 2)

    def record(self, k: int, seconds: float, accepted: int) -> None:
        self.cycles += 1
        self.seconds[k] = [*self.seconds.get(k, ()), seconds][-self.SAMPLES:]
        keep = 1 - 1 / self.MEMORY
        for i in range(k):
            self.tried[i] = self.tried[i] * keep + 1
            self.hits[i] = self.hits[i] * keep + (i < accepted)


@dataclass
class FixedDepth:
    """Always k drafts: what the drafter alone achieves, independent of the machine's timings (the quality
    gates' measurement; DraftDepth's choices follow measured step times, so its acceptance moves with load)."""

    max_k: int

    def choose(self) -> int:
        return self.max_k

    def record(self, k: int, seconds: float, accepted: int) -> None:
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
        k = min(dspark, session.engine.args.dspark_block_size)
        depth = session.engine.draft_depths.setdefault(k, DraftDepth(k)) if adaptive else FixedDepth(k)
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
        t_cycle = time.perf_counter()
        drafts = forced or (session.draft(tok)[:k] if k else [])
        p = session.pos
        logits = session.step(p, [tok] + drafts)
        accepted = 0
        for j, d in enumerate(drafts):
            target = sample(logits[j], p + j + 1, params, history, constraint)
            if target != d:
                break
            accepted += 1
            emitted_token(d)
        new_anchor = sample(logits[accepted], p + accepted + 1, params, history, constraint)
        session.rollback(p + accepted + 1)
        session.last_logits = logits[accepted]
        stats.cycles += 1
        if not forced:  # DSpark's own drafts: its acceptance and the depth's measurements
            stats.drafted += len(drafts)
            stats.accepted += accepted
            stats.depths[len(drafts)] = stats.depths.get(len(drafts), 0) + 1
            if depth:
                depth.record(len(drafts), time.perf_counter() - t_cycle, accepted)
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
