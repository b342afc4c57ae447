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

Tier: FAITHFUL, PASS, or FAIL (any required rule failed or its input missing).

Image cases (recognised by `full.token_types`; README "Image cases" -> "Rules for image cases") have no
battery and no drafter: (b) and (c) in both modes with the mode's bounds, and
- (e) vision: every ViT and aligner row within VISION_REL_RMS x the RMS of the reference row;
- (e') merged input rows: text and delimiter rows bit-identical to `full.input_embeds`, IMAGE rows within (e);
- (f) own-selection router picks (as sets) on the image rows equal to `full_lowtie.moe_expert_ids` on at least
  IMAGE_ROUTE_MIN_SHARE of the (layer, image row) pairs (only this rule sees a `bias_vl` error);
- (g) Engram hash ids identical to `full.engram_hash_ids` on every text position;
- FAITHFUL: the text FAITHFUL condition, and ViT, aligner and merged input rows bit-identical.

Rule names and number keys are those of the reference checker `load_case.check_engine`, so results compare
one to one (its nested per-image and per-layer lists appear here flattened: `image0.vit_out.max_rel_rms`,
`per_layer_image_rows_agree.3`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
VISION_REL_RMS = 0.06  # (e), (e'): ViT / aligner / merged IMAGE rows, max |Δ| <= this x RMS of the reference row
IMAGE_ROUTE_MIN_SHARE = 0.75  # (f) share of (layer, image row) pairs whose own-selection picks equal full_lowtie's

FAITHFUL = "FAITHFUL"
PASS = "PASS"
FAIL = "FAIL"

REQUIRED = (
    "replay.a_clean_rows", "replay.b_envelope", "replay.c_handoff", "replay.c_handoff_battery",
    "own_selection.a_clean_rows", "own_selection.b_envelope", "own_selection.c_handoff",
    "own_selection.c_handoff_battery", "drafter.d_envelope",
)
REQUIRED_IMAGE = (
    "replay.b_envelope", "replay.c_handoff", "own_selection.b_envelope", "own_selection.c_handoff",
    "vision.e_vit_aligner", "replay.e_input_embeds", "own_selection.f_image_routing", "replay.g_engram_hash",
)
TEXT = -1  # full.token_types of a text position; span positions are >= 0
IMAGE = 1  # full.token_types of an IMAGE slot (0, 2, 3: start, new line, end delimiters)

# engine prefill output: "logits" [..., V], "handoff_streams" [..., hc, D], "handoff_pre_mix" [..., hc]
PrefillArrays = Mapping[str, np.ndarray]
Number = float | int | bool | str | None


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
    FAITHFUL_LOGITS_ABS of full.logits, hand-off streams and pre-mix bit-identical to full.handoff_*. Where the
    engine reports its replayed routing weights (router order) and the case holds the reference's, how many
    differ: a CPU stack whose fp32 GEMMs sum the router in another order than the golden machine's cannot be
    FAITHFUL (docs/numerics.md, "CPU stacks"), and this number says so."""
    logits_max = float(np.abs(np.asarray(replay["logits"], np.float64) - golden["full.logits"]).max())
    streams_equal = np.array_equal(np.asarray(replay["handoff_streams"], np.float32), golden["full.handoff_streams"])
    pre_mix_equal = np.array_equal(np.asarray(replay["handoff_pre_mix"], np.float32), golden["full.handoff_pre_mix"])
    faithful = logits_max <= FAITHFUL_LOGITS_ABS and streams_equal and pre_mix_equal
    numbers = {"faithful": bool(faithful), "logits_max_abs": logits_max,
               "handoff_streams_bit_identical": bool(streams_equal),
               "handoff_pre_mix_bit_identical": bool(pre_mix_equal)}
    if "moe_expert_weights" in replay and "full.moe_expert_weights" in golden:
        ours, ref = np.asarray(replay["moe_expert_weights"], np.float32), golden["full.moe_expert_weights"]
        numbers["routing_weights_differ"], numbers["routing_weights"] = int((ours != ref).sum()), int(ref.size)
    return RuleResult(passed=None, bounds={"logits_max_abs": FAITHFUL_LOGITS_ABS}, numbers=numbers)


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
    fed the stored hand-off. An input given as None makes its rules missing, hence FAIL. Image cases are judged by
    judge_image_case."""
    if case.is_image_case:
        raise ValueError(f"{case.name} is an image case: judge it with judge_image_case")
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
    return _verdict(rules, REQUIRED, [("faithful(info)", "faithful")])


def _verdict(rules: dict[str, RuleResult], required: Sequence[str],
             faithful_marks: Sequence[tuple[str, str]]) -> CaseVerdict:
    """FAIL when a required rule is missing or failed, else FAITHFUL when every (rule, number) mark is
    true, else PASS."""
    missing = [r for r in required if r not in rules]
    failed = [r for r in required if r in rules and not rules[r].passed]
    if missing or failed:
        tier = FAIL
    elif all(rules[r].numbers[k] for r, k in faithful_marks):
        tier = FAITHFUL
    else:
        tier = PASS
    return CaseVerdict(tier=tier, failed=failed, missing=missing, rules=rules)


def case_images(case: GoldenCase) -> list[dict]:
    """Per image k of an image case (span order): start, length, grid (n_vit_h, n_vit_w, n_llm_h, n_llm_w),
    pixels (the ViT input, float32 [n_patch, 3, p, p]), vit_out and aligner_out (the reference's rows)."""
    g, out = case.golden, []
    while f"image{len(out)}.pixels" in g:
        k = len(out)
        start, length = (int(v) for v in g[f"image{k}.span"])
        out.append({"start": start, "length": length, "grid": tuple(int(v) for v in g[f"image{k}.grid"]),
                    "pixels": g[f"image{k}.pixels"], "vit_out": g[f"image{k}.vit_out"],
                    "aligner_out": g[f"image{k}.aligner_out"]})
    return out


def _row_rel_rms(test: np.ndarray, ref: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Per row of [..., width]: (max |Δ| / RMS of the reference row, max |Δ|)."""
    a, b = np.asarray(test, np.float64), np.asarray(ref, np.float64)
    _same_shape(a, b, what)
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    d = np.abs(a - b).max(-1)
    return d / np.sqrt((b**2).mean(-1)), d


def vision_rule(test_vision: list[Mapping[str, np.ndarray]], case: GoldenCase) -> RuleResult:
    """(e) one dict per image (span order) with 'vit_out' [n_patch, vision_dim] and 'aligner_out' [n_tok, dim] from
    the stored pixels: every row's max |Δ| <= VISION_REL_RMS x the RMS of the reference row."""
    imgs = case_images(case)
    if len(test_vision) != len(imgs):
        raise ValueError(f"vision: {len(test_vision)} engine images, the case has {len(imgs)}")
    numbers: dict[str, Number] = {}
    worst, rows, bit_rows = 0.0, 0, 0
    for k, (mine, ref) in enumerate(zip(test_vision, imgs, strict=True)):
        for key in ("vit_out", "aligner_out"):
            rel, d = _row_rel_rms(mine[key], ref[key], f"image{k}.{key}")
            same = int((d == 0).sum())
            numbers.update({f"image{k}.{key}.max_rel_rms": float(rel.max()), f"image{k}.{key}.max_abs": float(d.max()),
                            f"image{k}.{key}.rows": int(len(d)), f"image{k}.{key}.rows_bit_identical": same,
                            f"image{k}.{key}.worst_row": int(rel.argmax())})
            worst, rows, bit_rows = max(worst, float(rel.max())), rows + len(d), bit_rows + same
    numbers.update({"max_rel_rms": worst, "rows": rows, "rows_bit_identical": bit_rows,
                    "bit_identical": bool(bit_rows == rows)})
    return RuleResult(passed=bool(worst <= VISION_REL_RMS), numbers=numbers, bounds={"max_rel_rms": VISION_REL_RMS})


def input_embeds_rule(test_embeds: np.ndarray, case: GoldenCase) -> RuleResult:
    """(e') the engine's LM input rows [S, dim] after the image merge: text and delimiter rows bit-identical to
    full.input_embeds (table rows), IMAGE rows within the (e) bound (they are the engine's aligner rows)."""
    g = case.golden
    types = g["full.token_types"]
    a, b = np.asarray(test_embeds, np.float32), g["full.input_embeds"]
    _same_shape(a, b, "input_embeds")
    exact = types != IMAGE
    differing = np.nonzero((a[exact] != b[exact]).any(-1))[0]
    rel, d = _row_rel_rms(a[~exact], b[~exact], "input_embeds")
    worst = float(rel.max()) if len(rel) else 0.0
    numbers: dict[str, Number] = {
        "non_image_rows_differing": int(len(differing)),
        "first_differing_position": int(np.nonzero(exact)[0][differing[0]]) if len(differing) else None,
        "image_rows_max_rel_rms": worst,
        "bit_identical": bool(len(differing) == 0 and (d == 0).all()),
    }
    return RuleResult(passed=bool(len(differing) == 0 and worst <= VISION_REL_RMS), numbers=numbers,
                      bounds={"image_rows_max_rel_rms": VISION_REL_RMS})


def image_routing_rule(test_ids: np.ndarray, case: GoldenCase) -> RuleResult:
    """(f) own-selection router picks [L, S, k] compared as sets with full_lowtie.moe_expert_ids on the image rows
    (token_types >= 0, which pick with scores + gate.bias_vl)."""
    g = case.golden
    img = g["full.token_types"] != TEXT
    a, b = np.sort(np.asarray(test_ids), -1), np.sort(g["full_lowtie.moe_expert_ids"], -1)
    _same_shape(a, b, "moe_expert_ids")
    same = (a == b).all(-1)  # [L, S]
    share = float(same[:, img].mean())
    numbers: dict[str, Number] = {"share": share, "image_rows": int(img.sum()),
                                  "text_rows_share(info)": float(same[:, ~img].mean())}
    for layer, agree in enumerate(same[:, img].sum(-1)):
        numbers[f"per_layer_image_rows_agree.{layer}"] = int(agree)
    return RuleResult(passed=bool(share >= IMAGE_ROUTE_MIN_SHARE), numbers=numbers,
                      bounds={"share": IMAGE_ROUTE_MIN_SHARE})


def engram_hash_rule(test_hash: np.ndarray, case: GoldenCase) -> RuleResult:
    """(g) Engram table row ids [S, n_engram, cols] equal full.engram_hash_ids on every text position; image positions
    are reported only (their gate is zeroed, so an engine may hash them any way)."""
    g = case.golden
    ref, text = g["full.engram_hash_ids"], g["full.token_types"] == TEXT
    t = np.asarray(test_hash)
    if t.shape != ref.shape:
        return RuleResult(passed=False, numbers={"equal": False, "shape": str(list(t.shape)),
                                                 "expected_shape": str(list(ref.shape))})
    diff = (t != ref).reshape(len(ref), -1).any(-1)
    rows = np.nonzero(diff & text)[0]
    return RuleResult(passed=not len(rows), numbers={
        "equal": not len(rows), "text_positions_differing": int(len(rows)),
        "first_position": int(rows[0]) if len(rows) else None,
        "image_positions_differing(info)": int((diff & ~text).sum())})


def judge_image_case(case: GoldenCase, replay: PrefillArrays | None, own: PrefillArrays | None,
                     vision: list[Mapping[str, np.ndarray]] | None) -> CaseVerdict:
    """Apply the image-case rules and give the tier.

    replay: the engine's one-shot prefill of full.input_ids / full.token_types (stored pixels, selections forced to
    full.*): 'logits', 'handoff_streams', 'handoff_pre_mix', 'input_embeds' [S, dim], 'engram_hash_ids'. own: the
    same prefill with its own lowest-index selections: 'logits', 'handoff_streams', 'handoff_pre_mix',
    'moe_expert_ids' [L, S, k]. vision: per image 'vit_out' and 'aligner_out'. Missing inputs make their rules
    missing, hence FAIL."""
    g = case.golden
    rules: dict[str, RuleResult] = {}
    if replay is not None:
        rules["replay.b_envelope"] = envelope_rule(replay["logits"], g["full.logits"], REPLAY_ENVELOPE)
        rules["replay.c_handoff"] = handoff_rule(replay, g["full.handoff_streams"], g["full.handoff_pre_mix"],
                                                 REPLAY_HANDOFF)
        if "input_embeds" in replay:
            rules["replay.e_input_embeds"] = input_embeds_rule(replay["input_embeds"], case)
        if "engram_hash_ids" in replay:
            rules["replay.g_engram_hash"] = engram_hash_rule(replay["engram_hash_ids"], case)
        img = g["full.token_types"] != TEXT
        info = envelope_rule(np.asarray(replay["logits"])[img], g["full.logits"][img], REPLAY_ENVELOPE)
        rules["replay.image_rows_envelope(info)"] = RuleResult(passed=None, numbers=info.numbers, bounds=info.bounds)
        rules["faithful(info)"] = faithful_rule(replay, g)
    if own is not None:
        rules["own_selection.b_envelope"] = envelope_rule(own["logits"], g["full_lowtie.logits"], OWN_ENVELOPE)
        rules["own_selection.c_handoff"] = handoff_rule(own, g["full_lowtie.handoff_streams"],
                                                        g["full_lowtie.handoff_pre_mix"], OWN_HANDOFF)
        if "moe_expert_ids" in own:
            rules["own_selection.f_image_routing"] = image_routing_rule(own["moe_expert_ids"], case)
    if vision is not None:
        rules["vision.e_vit_aligner"] = vision_rule(vision, case)
    return _verdict(rules, REQUIRED_IMAGE, [("faithful(info)", "faithful"), ("vision.e_vit_aligner", "bit_identical"),
                                            ("replay.e_input_embeds", "bit_identical")])
