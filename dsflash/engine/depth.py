"""How many DSpark drafts a cycle verifies (engine/spec.decode asks each cycle): DraftDepth from the machine's
measured cycle times and the drafts' acceptance, FixedDepth always the most (the quality gates)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftDepth:
    """Chooses k to maximise expected tokens per second of a cycle, from each depth's measured cycle time
    and the acceptance seen at each draft slot (Laplace's rule of succession).

    A cycle is timed whole -- draft, verify, sampling, rollback -- because on a GPU the parts run
    asynchronously: the verify's kernels finish inside the sampling's read-back. A depth's time is the
    least of its last SAMPLES cycles, and every PROBE_EVERY cycles one other depth is run for two cycles (in
    turn: plain decoding, then the deepest drafts down). On a GPU the first sessions' first cycles cost 10-20x
    a warm one (the CUDA graphs' warm-ups and captures for each row count; engine/graphs.py), and so does the
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
