"""Sampling as a pure function of (seed, absolute position, logits, tokens so far).

The noise for a position comes from a counter-based hash of (seed, position, token id), never from a
stateful generator, so the same seed gives the same text whether tokens were drafted, resumed from a
cache or rebuilt after a box restart. Sampling is Gumbel-max over the filtered, tempered logits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt and output, logits > 0 divided, others multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI: (token id, bias in [-100, 100]) added last
    min_tokens: int = 0  # vLLM: the end tokens below are banned until this many tokens were generated
    end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {token}: {bias}")

    @property
    def adjusted(self) -> bool:
        """Whether the logits are changed before sampling (penalties or biases)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or (self.min_tokens and self.end_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def uniform_noise(seed: int, position: int, n: int) -> torch.Tensor:
    """float64 uniforms in (0, 1) for token ids 0..n-1 at one position."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
        key = _splitmix64(key ^ np.uint64(position & 0xFFFFFFFFFFFFFFFF))
        bits = _splitmix64(key + np.arange(n, dtype=np.uint64))
    return torch.from_numpy(((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53)


def filtered_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Tempered fp64 logits with top-k, top-p and min-p applied (-inf outside)."""
    x = logits.double() / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, -torch.inf)
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        x = x.masked_fill(probs < p.min_p * probs.max(), -torch.inf)
        probs = torch.softmax(x, dim=-1)
    if p.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
        x[order[drop]] = -torch.inf
    return x


class History:
    """The tokens the penalties look at: which ids were seen in the prompt or output (a mask over the
    vocabulary, kept up to date so a long prompt is not re-scanned per token) and the output's counts.
    Both follow from the token sequence alone, so penalised sampling stays exact across drafts, resumes
    and restarts."""

    def __init__(self, prompt: Iterable[int], vocab_size: int) -> None:
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        self.seen[torch.tensor(list(prompt), dtype=torch.long)] = True
        self.output: Counter[int] = Counter()

    def add(self, token: int) -> None:
        self.output[token] += 1
        self.seen[token] = True

    def adjust(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """fp64 logits with the repetition penalty, then the frequency and presence penalties, then the
        logit biases applied, and the end tokens banned while the output is shorter than min_tokens."""
        x = logits.double().clone()
        if p.repetition_penalty != 1:
            v = x[self.seen]
            x[self.seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if self.output and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self.output), dtype=torch.long)
            counts = torch.tensor([self.output[t] for t in self.output], dtype=torch.float64)
            x[ids] -= counts * p.frequency_penalty + p.presence_penalty
        for token, bias in p.logit_bias:
            x[token] += bias
        if self.output.total() < p.min_tokens:
            x[list(p.end_ids)] = -torch.inf
        return x


class Constraint(Protocol):
    """What the output may be (a forced tool call, JSON mode). Its state follows the emitted tokens only
    (`advance`), never drafts, so speculative decoding and plain decoding see the same constraint."""

    def allowed(self) -> list[int] | torch.Tensor | None:
        """The tokens allowed next (ids, or a bool mask over the vocabulary), or None for any."""

    def determined(self, limit: int) -> list[int]:
        """The next tokens there is no choice about (at most `limit`): drafts that verify for sure."""

    def advance(self, token: int) -> None: ...


class AfterReasoning:
    """Thinking mode's answer constraint: the reasoning is free until its end (`trigger`, the `</think>`
    token), which is forced once `budget` reasoning tokens were produced (None: no cap); after it, `inner`
    restricts the answer (None: nothing does). Its state follows the emitted tokens only (`advance`)."""

    def __init__(self, trigger: int, inner: Constraint | None = None, budget: int | None = None):
        self.trigger, self.inner, self.budget = trigger, inner, budget
        self.reasoning = 0  # reasoning tokens so far
        self.waiting = True

    def _capped(self) -> bool:
        return self.budget is not None and self.reasoning >= self.budget

    def allowed(self) -> list[int] | torch.Tensor | None:
        if self.waiting:
            return [self.trigger] if self._capped() else None
        return self.inner.allowed() if self.inner is not None else None

    def determined(self, limit: int) -> list[int]:
        if self.waiting:
            return [self.trigger] if self._capped() and limit else []
        return self.inner.determined(limit) if self.inner is not None else []

    def advance(self, token: int) -> None:
        if not self.waiting:
            if self.inner is not None:
                self.inner.advance(token)
        elif token == self.trigger:
            self.waiting = False
        else:
            self.reasoning += 1


def sample(logits: torch.Tensor, position: int, p: SamplingParams, history: History | None = None,
           constraint: Constraint | None = None) -> int:
    """The token at `position` given its fp32 logits [V] (and, for the penalties, the tokens so far;
    with a `constraint`, only the tokens it allows)."""
    allowed = constraint.allowed() if constraint is not None else None
    if isinstance(allowed, list) and len(allowed) == 1:
        return allowed[0]
    logits = logits.cpu()
    if p.adjusted:
        if history is None:
            raise ValueError("penalties and biases need the token history")
        logits = history.adjust(logits, p)
    if isinstance(allowed, torch.Tensor):
        logits = logits.masked_fill(~allowed, -torch.inf)
    elif allowed is not None:
        logits = torch.full_like(logits, -torch.inf).index_copy_(0, torch.tensor(allowed), logits[allowed])
    if p.greedy:
        return int(torch.argmax(logits))
    x = filtered_logits(logits, p)
    gumbel = -torch.log(-torch.log(uniform_noise(p.seed, position, x.numel())))
    return int(torch.argmax(x + gumbel))


def logprobs(logits: torch.Tensor, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token` under the untempered distribution, and the `top` most likely tokens."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    best = []
    if top:
        v, i = torch.topk(lp, top)
        best = list(zip(i.tolist(), v.tolist(), strict=True))
    return float(lp[token]), best
