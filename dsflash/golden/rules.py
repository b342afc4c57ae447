"""Tolerance rules of the golden cases (`shared/golden/README.md`, section "Tolerances"), our own implementation.

Δ = engine - reference, in float64. A row is one position's V logits. The engine is run in two modes:
replay (selections forced to `full.*` / `battery.*`) and own selection (lowest index wins among equal
scores; compared with `full_lowtie.*` / `battery_lowtie.*`).

- (a) clean rows: at least CLEAN_MIN_SHARE of the battery rows have max |Δ| <= CLEAN_TOL (both modes).
- (b) envelope on the one-shot logits: max |Δ|, mean |Δ| and the top-1 agreement on the rows whose reference
  top-1 minus top-2 gap exceeds TOP1_GAP, within REPLAY_ENVELOPE (own selection: OWN_ENVELOPE).
- (c) hand-off, at every one-shot and battery position t: max |Δ| of the streams <= rel x RMS_t of the
  reference streams, pre-mix max |Δ| <= an absolute bound (REPLAY_HANDOFF; own selection: OWN_HANDOFF).
- (d) drafter fed the stored hand-off: REPLAY_ENVELOPE on `draft_logits`.
- FAITHFUL (reported, not required): replay logits within FAITHFUL_LOGITS_ABS of `full.logits`, replay
  hand-off streams and pre-mix bit-identical; and every required rule passes.

The own-selection bounds of (b) and (c) are the README's calibration change: a harmless engine decides some
near-ties differently there, and every later row then moves as much as under another tie rule.

Tier: FAITHFUL, PASS, or FAIL (any required rule failed or its input missing). Image cases (recognised by
`full.token_types`) are out of scope for now: they get the tier UNSUPPORTED_IMAGE, which counts as a failure.
Rule names and number keys are those of the reference checker `load_case.check_engine`, so results compare
one to one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from dsflash.golden.case import GoldenCase

CLEAN_TOL = 1e-3  # (a) a battery row is clean when its max |Δ| <= CLEAN_TOL
CLEAN_MIN_SHARE = 0.25  # (a) share of clean battery rows needed (both modes)
ENV_MAX_ABS = 0.5  # (b) replay mode, (d)
ENV_MEAN_ABS = 0.06  # (b) replay mode, (d)
TOP1_GAP = 0.02  # (b), (d): rows whose reference top-1 minus top-2 logit exceeds this are top-1 checked
TOP1_MIN_SHARE = 0.85  # (b) replay mode, (d)
HANDOFF_REL_RMS = 0.3  # (c) replay mode
PREMIX_ABS = 0.03  # (c) replay mode
OWN_ENV_MAX_ABS = 4.0  # (b) own-selection mode
OWN_ENV_MEAN_ABS = 0.35  # (b) own-selection mode
OWN_TOP1_MIN_SHARE = 0.50  # (b) own-selection mode
OWN_HANDOFF_REL_RMS = 2.0  # (c) own-selection mode
OWN_PREMIX_ABS = 0.2  # (c) own-selection mode
FAITHFUL_LOGITS_ABS = 1e-5  # FAITHFUL: logits (head summation order); hand-off and pre-mix bit-identical
REPORT_TOL = 0.02  # reported only: share of rows within this

FAITHFUL = "FAITHFUL"
PASS = "PASS"
FAIL = "FAIL"
UNSUPPORTED_IMAGE = "UNSUPPORTED (image case)"

REQUIRED = (
    "replay.a_clean_rows", "replay.b_envelope", "replay.c_handoff", "replay.c_handoff_battery",
    "own_selection.a_clean_rows", "own_selection.b_envelope", "own_selection.c_handoff",
    "own_selection.c_handoff_battery", "drafter.d_envelope",
)

# engine prefill output: "logits" [..., V], "handoff_streams" [..., hc, D], "handoff_pre_mix" [..., hc]
PrefillArrays = Mapping[str, np.ndarray]
Number = float | int | bool | None


@dataclass(frozen=True)
class EnvelopeBounds:
    max_abs: float
    mean_abs: float
    top1_share: float


@dataclass(frozen=True)
class HandoffBounds:
    streams_max_rel_rms: float
    pre_mix_max_abs: float


REPLAY_ENVELOPE = EnvelopeBounds(ENV_MAX_ABS, ENV_MEAN_ABS, TOP1_MIN_SHARE)
OWN_ENVELOPE = EnvelopeBounds(OWN_ENV_MAX_ABS, OWN_ENV_MEAN_ABS, OWN_TOP1_MIN_SHARE)
REPLAY_HANDOFF = HandoffBounds(HANDOFF_REL_RMS, PREMIX_ABS)
OWN_HANDOFF = HandoffBounds(OWN_HANDOFF_REL_RMS, OWN_PREMIX_ABS)


@dataclass(frozen=True)
class RuleResult:
    passed: bool | None  # None: a reported-only quantity
    numbers: dict[str, Number]
    bounds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"pass": self.passed, "bounds": self.bounds, **self.numbers}


@dataclass(frozen=True)
class CaseVerdict:
    tier: str
    failed: list[str]  # required rules that did not pass
    missing: list[str]  # required rules whose engine input was not given (count as failed)
    rules: dict[str, RuleResult]

    @property
    def ok(self) -> bool:
        return self.tier in (FAITHFUL, PASS)

    def to_dict(self) -> dict:
        return {"tier": self.tier, "failed": self.failed, "missing": self.missing,
                "rules": {name: r.to_dict() for name, r in self.rules.items()}}


def _same_shape(test: np.ndarray, ref: np.ndarray, what: str) -> None:
    if test.shape != ref.shape:
        raise ValueError(f"{what}: engine shape {test.shape} != reference shape {ref.shape}")


def logit_numbers(test_logits: np.ndarray, ref_logits: np.ndarray) -> dict[str, Number]:
    """Row statistics of Δ for logits of any shape [..., V]: max and mean |Δ|, clean rows (max |Δ| <= CLEAN_TOL),
    top-1 agreement on the rows whose reference top-1/top-2 gap exceeds TOP1_GAP, bit-identical rows, and the
    share within REPORT_TOL. For battery logits [N, S, V] also the sequences with every row clean and row 0's
    clean share."""
    test, ref = np.asarray(test_logits, np.float64), np.asarray(ref_logits, np.float64)
    _same_shape(test, ref, "logits")
    a, b = test.reshape(-1, test.shape[-1]), ref.reshape(-1, ref.shape[-1])
    d = np.abs(a - b)
    row_max = d.max(-1)
    ranked = np.sort(b, axis=-1)
    decided = (ranked[:, -1] - ranked[:, -2]) > TOP1_GAP
    same_top1 = a.argmax(-1) == b.argmax(-1)
    n_decided = int(decided.sum())
    flips = np.nonzero(decided & ~same_top1)[0]
    over_report = np.nonzero(row_max > REPORT_TOL)[0]
    clean = row_max <= CLEAN_TOL
    numbers: dict[str, Number] = {
        "max_abs": float(row_max.max()),
        "mean_abs": float(d.mean()),
        "rows": int(len(b)),
        "clean_rows": int(clean.sum()),
        "clean_share": float(clean.mean()),
        "top1_share": float(same_top1[decided].mean()) if n_decided else 1.0,
        "top1_checked_rows": n_decided,
        "top1_mismatch_rows": int(len(flips)),
        "first_top1_mismatch_row": int(flips[0]) if len(flips) else None,
        "top1_agree_all_rows": int(same_top1.sum()),
        "bit_identical_rows": int((row_max == 0).sum()),
        "share_within_0.02": float((row_max <= REPORT_TOL).mean()),
        "first_row_over_0.02": int(over_report[0]) if len(over_report) else None,
        "worst_row": int(row_max.argmax()),
    }
    if test.ndim == 3:  # battery [N, S, V]
        per_seq = clean.reshape(test.shape[0], -1)
        numbers["sequences_all_rows_clean"] = int(per_seq.all(-1).sum())
        numbers["row0_clean_share"] = float(per_seq[:, 0].mean())
    return numbers


def clean_rows_rule(test_logits: np.ndarray, ref_logits: np.ndarray) -> RuleResult:
    """(a) battery logits [N, S, V]: passes when at least CLEAN_MIN_SHARE of the rows are clean."""
    numbers = logit_numbers(test_logits, ref_logits)
    return RuleResult(passed=bool(numbers["clean_share"] >= CLEAN_MIN_SHARE), numbers=numbers,
                      bounds={"clean_share": CLEAN_MIN_SHARE, "row_max_abs": CLEAN_TOL})


def envelope_rule(test_logits: np.ndarray, ref_logits: np.ndarray,
                  bounds: EnvelopeBounds = REPLAY_ENVELOPE) -> RuleResult:
    """(b) one-shot logits [S, V] (any [..., V]): max |Δ|, mean |Δ| and top-1 agreement within `bounds`."""
    n = logit_numbers(test_logits, ref_logits)
    passed = (n["max_abs"] <= bounds.max_abs and n["mean_abs"] <= bounds.mean_abs
              and n["top1_share"] >= bounds.top1_share)
    return RuleResult(passed=bool(passed), numbers=n, bounds=vars(bounds).copy())


def handoff_rule(test: PrefillArrays, ref_streams: np.ndarray, ref_pre_mix: np.ndarray,
                 bounds: HandoffBounds = REPLAY_HANDOFF) -> RuleResult:
    """(c) hand-off streams [..., hc, D]: at every position, max |Δ| over (stream, dim) <= bounds x RMS of the
    reference streams there; pre-mix [..., hc]: max |Δ| <= the absolute bound."""
    a, b = np.asarray(test["handoff_streams"], np.float64), np.asarray(ref_streams, np.float64)
    _same_shape(a, b, "handoff_streams")
    a, b = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    rms = np.sqrt((b**2).mean(axis=(1, 2)))
    streams_max = np.abs(a - b).max(axis=(1, 2))
    rel = streams_max / rms
    pa, pb = np.asarray(test["handoff_pre_mix"], np.float64), np.asarray(ref_pre_mix, np.float64)
    _same_shape(pa, pb, "handoff_pre_mix")
    pre_mix_max = np.abs(pa - pb).reshape(len(rel), -1).max(-1)
    numbers: dict[str, Number] = {
        "streams_max_rel_rms": float(rel.max()),
        "streams_max_abs": float(streams_max.max()),
        "worst_position": int(rel.argmax()),
        "pre_mix_max_abs": float(pre_mix_max.max()),
        "positions": int(len(rel)),
        "positions_bit_identical": int(((streams_max == 0) & (pre_mix_max == 0)).sum()),
    }
    passed = rel.max() <= bounds.streams_max_rel_rms and pre_mix_max.max() <= bounds.pre_mix_max_abs
    return RuleResult(passed=bool(passed), numbers=numbers, bounds=vars(bounds).copy())


def drafter_rule(test_logits: np.ndarray, ref_logits: np.ndarray) -> RuleResult:
    """(d) drafter logits [rounds, B, V] fed the stored hand-off: the replay envelope over rounds x B rows; the
    number of rows proposing the reference's token is reported as proposal_agree."""
    r = envelope_rule(test_logits, ref_logits, REPLAY_ENVELOPE)
    numbers = dict(r.numbers)
    numbers["proposal_agree"] = numbers.pop("top1_agree_all_rows")
    return RuleResult(passed=r.passed, numbers=numbers, bounds=r.bounds)


def faithful_rule(replay: PrefillArrays, golden: Mapping[str, np.ndarray]) -> RuleResult:
    """FAITHFUL condition, reported (passed=None; the verdict is numbers["faithful"]): replay logits within
    FAITHFUL_LOGITS_ABS of full.logits, hand-off streams and pre-mix bit-identical to full.handoff_*."""
    logits_max = float(np.abs(np.asarray(replay["logits"], np.float64) - golden["full.logits"]).max())
    streams_equal = np.array_equal(np.asarray(replay["handoff_streams"], np.float32), golden["full.handoff_streams"])
    pre_mix_equal = np.array_equal(np.asarray(replay["handoff_pre_mix"], np.float32), golden["full.handoff_pre_mix"])
    faithful = logits_max <= FAITHFUL_LOGITS_ABS and streams_equal and pre_mix_equal
    return RuleResult(passed=None, bounds={"logits_max_abs": FAITHFUL_LOGITS_ABS},
                      numbers={"faithful": bool(faithful), "logits_max_abs": logits_max,
                               "handoff_streams_bit_identical": bool(streams_equal),
                               "handoff_pre_mix_bit_identical": bool(pre_mix_equal)})


def greedy_rule(logits: np.ndarray, golden: Mapping[str, np.ndarray]) -> RuleResult:
    """Reported: argmax of one-shot rows T-1.. against the reference's greedy continuation."""
    T = len(golden["prompt_ids"])
    agree = np.asarray(logits)[T - 1 :].argmax(-1) == golden["continuation_ids"]
    diverged = np.nonzero(~agree)[0]
    return RuleResult(passed=None, numbers={"agree": int(agree.sum()), "of": int(len(agree)),
                                            "first_divergence_k": int(diverged[0]) if len(diverged) else None})


def judge_case(case: GoldenCase, replay: PrefillArrays | None, own: PrefillArrays | None,
               battery: PrefillArrays | None, battery_own: PrefillArrays | None,
               draft_logits: np.ndarray | None) -> CaseVerdict:
    """Apply every rule to one text case and give its tier.

    replay / own: the engine's one-shot prefill of full.input_ids ([S, V], [S, hc, D], [S, hc]), selections forced
    to full.* (replay) or its own lowest-index selection (own). battery / battery_own: the same keys with a
    leading sequence dimension, each battery sequence prefilled alone. draft_logits: [rounds, B, V] of the drafter
    fed the stored hand-off. An input given as None makes its rules missing, hence FAIL. An image case gets
    UNSUPPORTED_IMAGE without looking at the inputs."""
    if case.is_image_case:
        return image_case_verdict()
    g = case.golden
    rules: dict[str, RuleResult] = {}
    modes = (
        ("replay", replay, battery, "full.", "battery.", REPLAY_ENVELOPE, REPLAY_HANDOFF),
        ("own_selection", own, battery_own, "full_lowtie.", "battery_lowtie.", OWN_ENVELOPE, OWN_HANDOFF),
    )
    for mode, one_shot, bat, prefix, bprefix, envelope, handoff in modes:
        if bat is not None:
            rules[f"{mode}.a_clean_rows"] = clean_rows_rule(bat["logits"], g[bprefix + "logits"])
            rules[f"{mode}.c_handoff_battery"] = handoff_rule(bat, g[bprefix + "handoff_streams"],
                                                              g[bprefix + "handoff_pre_mix"], handoff)
        if one_shot is not None:
            rules[f"{mode}.b_envelope"] = envelope_rule(one_shot["logits"], g[prefix + "logits"], envelope)
            rules[f"{mode}.c_handoff"] = handoff_rule(one_shot, g[prefix + "handoff_streams"],
                                                      g[prefix + "handoff_pre_mix"], handoff)
            rules[f"{mode}.greedy_vs_continuation(info)"] = greedy_rule(one_shot["logits"], g)
    if draft_logits is not None:
        rules["drafter.d_envelope"] = drafter_rule(draft_logits, g["draft_logits"])
    if replay is not None:
        rules["faithful(info)"] = faithful_rule(replay, g)
    missing = [r for r in REQUIRED if r not in rules]
    failed = [r for r in REQUIRED if r in rules and not rules[r].passed]
    if missing or failed:
        tier = FAIL
    elif rules["faithful(info)"].numbers["faithful"]:
        tier = FAITHFUL
    else:
        tier = PASS
    return CaseVerdict(tier=tier, failed=failed, missing=missing, rules=rules)


def image_case_verdict() -> CaseVerdict:
    """Image cases are not checked yet; their tier is UNSUPPORTED_IMAGE and counts as a failure."""
    return CaseVerdict(tier=UNSUPPORTED_IMAGE, failed=[], missing=[], rules={})
