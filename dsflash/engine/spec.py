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

from dsflash.engine.depth import DraftDepth, FixedDepth
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
