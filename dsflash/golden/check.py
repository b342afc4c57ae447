"""`dsflash check-golden DIR [DIR ...] [--json OUT]`: run the engine on golden cases and apply the tolerance rules.

Per text case the engine runs (README "Tolerances" -> "What the engine runs for one case"):
- replay: one prefill of full.input_ids with the full.* selections forced;
- own selection: the same prefill with the engine's own lowest-index selection, compared with full_lowtie.*;
- the battery: each battery.input_ids[n] prefilled alone, replayed with battery.* sequence n and with its own
  selection (compared with battery_lowtie.*);
- the drafter, fed the stored DSpark context (README "How replay is meant").

Per image case (README "Image cases" -> "Rules for image cases"):
- the vision tower on every stored image<k>.pixels (ViT and aligner rows);
- replay: one prefill of full.input_ids with full.token_types and those aligner rows, full.* selections forced;
- own selection: the same prefill with the engine's own lowest-index selection, compared with full_lowtie.*.

One line per case and quantity, then the case's tier. The exit status is non-zero when any case is FAIL,
unreadable, or its engine raised.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from dsflash.golden.case import GoldenCase, GoldenCaseError, load_case, replay_selections
from dsflash.golden.rules import (
    FAITHFUL_LOGITS_ABS,
    IMAGE,
    CaseVerdict,
    RuleResult,
    case_images,
    judge_case,
    judge_image_case,
)

PREFILL_KEYS = ("logits", "handoff_streams", "handoff_pre_mix")
ROUTING_KEYS = ("moe_expert_weights",)  # reported where an engine gives them (faithful_rule)


class GoldenEngine(Protocol):
    """What check_case needs from an engine (implemented by dsflash.golden.adapter.GoldenEngine)."""

    def prefill(self, ids: np.ndarray, selections: dict | None) -> dict[str, np.ndarray]:
        """One prefill of ids (int64 [S]) at start_pos 0 from a fresh state; selections None = own selection
        (lowest index wins), else the dict of replay_selections. Returns "logits" float32 [S, V],
        "handoff_streams" float32 [S, hc, D], "handoff_pre_mix" float32 [S, hc]."""
        ...

    def draft(self, prefill_main_hidden: np.ndarray, anchors: np.ndarray, ctx_rows: np.ndarray,
              start_pos: np.ndarray) -> np.ndarray:
        """Draft rounds fed the stored DSpark context: prefill_main_hidden [T, n_taps*D] for positions 0..T-1,
        then round r with anchor anchors[r] and context row ctx_rows[r] at start_pos[r]. Returns float32
        [R, B, V]."""
        ...

    def encode_image(self, pixels: np.ndarray, n_vit_h: int, n_vit_w: int) -> dict[str, np.ndarray]:
        """The vision tower on one image's pixel tensor [n_vit_h * n_vit_w, 3, p, p]: "vit_out" float32
        [n_patch, vision_dim], "aligner_out" float32 [n_llm_h * n_llm_w, dim]."""
        ...

    def prefill_image(self, ids: np.ndarray, token_types: np.ndarray, image_rows: np.ndarray,
                      selections: dict | None) -> dict[str, np.ndarray]:
        """One prefill of an image sequence at start_pos 0 from a fresh state: ids, token_types int64 [S],
        image_rows float32 [number of IMAGE positions, dim] (aligner rows of every image, span order). Returns
        the prefill keys plus "input_embeds" [S, dim], "engram_hash_ids" [S, n_engram, cols] and
        "moe_expert_ids" [L, S, k]."""
        ...


@dataclass
class CaseCheck:
    """Outcome of checking one case directory: a verdict, or the error that stopped it."""

    case_dir: str
    name: str
    verdict: CaseVerdict | None = None
    error: str | None = None
    not_run: list[str] = field(default_factory=list)  # engine steps that raised NotImplementedError
    image_case: bool = False  # checked by the image rules (README "Image cases")

    @property
    def ok(self) -> bool:
        return self.error is None and self.verdict is not None and self.verdict.ok

    def attempt(self, step: str, run: Callable[[], object]):
        """run(), or None with the step recorded in not_run when the engine raises NotImplementedError."""
        try:
            return run()
        except NotImplementedError as e:
            self.not_run.append(f"{step}: {e}" if str(e) else step)
            return None

    def to_dict(self) -> dict:
        out = {"case_dir": self.case_dir, "case": self.name, "ok": self.ok, "error": self.error,
               "not_run": self.not_run, "image_case": self.image_case}
        if self.verdict is not None:
            out.update(self.verdict.to_dict())
        return out


def _prefill_arrays(out: dict, optional: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """The arrays the rules read, and those of `optional` the engine gave."""
    return {k: np.asarray(out[k], np.float32) for k in (*PREFILL_KEYS, *(k for k in optional if k in out))}


def _battery_prefills(case: GoldenCase, engine: GoldenEngine, replay: bool) -> dict[str, np.ndarray]:
    """Every battery sequence prefilled alone; outputs stacked to [N, S, ...]."""
    outs = []
    for n, ids in enumerate(case.golden["battery.input_ids"]):
        selections = replay_selections(case, "battery.", seq=n) if replay else None
        outs.append(_prefill_arrays(engine.prefill(ids, selections)))
    return {k: np.stack([o[k] for o in outs]) for k in PREFILL_KEYS}


IMAGE_PREFILL_KEYS = ("logits", "handoff_streams", "handoff_pre_mix", "moe_expert_ids")
_IMAGE_ARRAYS = ("full.input_embeds", "full.engram_hash_ids", "image0.pixels")
_IMAGE_ARRAYS_PER_IMAGE = ("pixels", "grid", "span", "vit_out", "aligner_out")


def check_image_arrays(case: GoldenCase) -> None:
    """Every array an image case's check reads is present and consistent; GoldenCaseError otherwise."""
    g, a = case.golden, case.args
    needed = list(_IMAGE_ARRAYS)
    for prefix in ("full.", "full_lowtie."):
        needed += [prefix + n for n in IMAGE_PREFILL_KEYS]
    needed += [f"full.index_topk_L{i}" for i in case.index_source_layers]
    k = 0
    while f"image{k}.pixels" in g:
        needed += [f"image{k}.{n}" for n in _IMAGE_ARRAYS_PER_IMAGE]
        k += 1
    missing = [n for n in needed if n not in g]
    if missing:
        raise GoldenCaseError(f"golden.safetensors incomplete (image case): missing {', '.join(missing)}")
    if not a.vision_enabled:
        raise GoldenCaseError("image case, but config.json has no vision tower (vision_n_layers = 0)")
    types = g["full.token_types"]
    S = len(g["full.input_ids"])
    if types.shape != (S,):
        raise GoldenCaseError(f"full.token_types: shape {types.shape}, expected ({S},)")
    n_image_rows = sum(len(im["aligner_out"]) for im in case_images(case))
    if int((types == IMAGE).sum()) != n_image_rows:
        raise GoldenCaseError(f"{int((types == IMAGE).sum())} IMAGE positions, {n_image_rows} aligner rows stored")


def image_case_check(case: GoldenCase, engine: GoldenEngine) -> CaseCheck:
    """Run the engine on an image case (vision tower from the stored pixels, replay and own-selection prefills)
    and apply the image rules."""
    check_image_arrays(case)
    check = CaseCheck(case_dir=str(case.path), name=case.name, image_case=True)
    g = case.golden

    def encode_all() -> list[dict[str, np.ndarray]]:
        out = []
        for im in case_images(case):
            n_vit_h, n_vit_w = im["grid"][:2]
            rows = engine.encode_image(im["pixels"], n_vit_h, n_vit_w)
            out.append({k: np.asarray(rows[k], np.float32) for k in ("vit_out", "aligner_out")})
        return out

    vision = check.attempt("vision", encode_all)

    def prefill(selections: dict | None) -> dict[str, np.ndarray]:
        if vision is None:
            raise NotImplementedError("no image rows without the vision tower")
        image_rows = np.concatenate([v["aligner_out"] for v in vision])
        return dict(engine.prefill_image(g["full.input_ids"], g["full.token_types"], image_rows, selections))

    replay = check.attempt("replay", lambda: prefill(replay_selections(case, "full.")))
    own = check.attempt("own selection", lambda: prefill(None))
    check.verdict = judge_image_case(case, replay, own, vision)
    return check


def check_case(case: GoldenCase | str | os.PathLike, engine: GoldenEngine) -> CaseCheck:
    """Run the engine on one case (path or loaded GoldenCase) and apply the rules. An engine step raising
    NotImplementedError is recorded in not_run and its rules count as missing (FAIL). An image case gets the
    image rules (image_case_check). Raises GoldenCaseError for an unreadable or incomplete case."""
    if not isinstance(case, GoldenCase):
        case = load_case(case)
    if case.is_image_case:
        return image_case_check(case, engine)
    check = CaseCheck(case_dir=str(case.path), name=case.name)
    g = case.golden

    full_ids = g["full.input_ids"]
    forced = replay_selections(case, "full.")
    replay = check.attempt("replay", lambda: _prefill_arrays(engine.prefill(full_ids, forced), ROUTING_KEYS))
    own = check.attempt("own selection", lambda: _prefill_arrays(engine.prefill(full_ids, None)))
    battery = check.attempt("battery replay", lambda: _battery_prefills(case, engine, replay=True))
    battery_own = check.attempt("battery own selection", lambda: _battery_prefills(case, engine, replay=False))
    draft_logits = check.attempt("drafter", lambda: np.asarray(engine.draft(
        g["prefill_dspark_main_hidden"], g["decode_next_ids"], g["decode_dspark_main_hidden"], g["draft_start_pos"]),
        np.float32))
    check.verdict = judge_case(case, replay, own, battery, battery_own, draft_logits)
    return check


def _verdict_mark(rule: RuleResult | None) -> str:
    if rule is None:
        return "[missing]"
    return "[pass]" if rule.passed else "[FAIL]"


def _line(label: str, rule: RuleResult | None, describe: Callable[[dict], str]) -> str:
    """One quantity: its label, `describe(numbers)` (or not run, when the rule is missing), its mark."""
    return f"{label:<40} {'not run' if rule is None else describe(rule.numbers)} {_verdict_mark(rule)}"


def _logits_line(label: str, rule: RuleResult | None) -> str:
    return _line(label, rule, lambda n: (
        f"max |Δ| {n['max_abs']:.3g}  mean |Δ| {n['mean_abs']:.3g}  clean {n['clean_share']:.1%}  "
        f"top-1 {n['top1_share']:.1%}  bit-identical rows {n['bit_identical_rows']}/{n['rows']}"))


def _handoff_line(label: str, rule: RuleResult | None) -> str:
    return _line(label, rule, lambda n: (
        f"max |Δ|/RMS {n['streams_max_rel_rms']:.3g}  max |Δ| {n['streams_max_abs']:.3g}  "
        f"pre-mix max |Δ| {n['pre_mix_max_abs']:.3g}  bit-identical positions "
        f"{n['positions_bit_identical']}/{n['positions']}"))


def report_lines(check: CaseCheck) -> list[str]:
    """One line per quantity (logits: max / mean |Δ|, clean-row share, top-1 agreement; hand-off: max/RMS,
    pre-mix max), then the tier line."""
    head = check.name
    if check.error is not None:
        return [f"{head}  ERROR  {check.error}"]
    verdict = check.verdict
    r = verdict.rules
    lines = [f"{head}  not run: {step}" for step in check.not_run]
    if check.image_case:
        return lines + _image_lines(head, r) + [_tier_line(head, verdict)]
    for mode, full, bat in (("replay", "full.", "battery."), ("own_selection", "full_lowtie.", "battery_lowtie.")):
        lines += [
            f"{head}  {_logits_line(f'{mode} {full}logits', r.get(f'{mode}.b_envelope'))}",
            f"{head}  {_logits_line(f'{mode} {bat}logits', r.get(f'{mode}.a_clean_rows'))}",
            f"{head}  {_handoff_line(f'{mode} {full}hand-off', r.get(f'{mode}.c_handoff'))}",
            f"{head}  {_handoff_line(f'{mode} {bat}hand-off', r.get(f'{mode}.c_handoff_battery'))}",
        ]
    lines.append(f"{head}  {_logits_line('drafter draft_logits', r.get('drafter.d_envelope'))}")
    if "faithful(info)" in r:
        logits_max = r["faithful(info)"].numbers["logits_max_abs"]
        lines.append(f"{head}  replay logits max |Δ| vs full.logits {logits_max:.3g} "
                     f"(FAITHFUL needs <= {FAITHFUL_LOGITS_ABS:g} and a bit-identical hand-off)")
        lines += _stack_lines(head, r["faithful(info)"].numbers)
    lines.append(_tier_line(head, verdict))
    return lines


def _stack_lines(head: str, numbers: dict) -> list[str]:
    """Why FAITHFUL is out of reach where the replayed routing weights are not the reference's."""
    differ = numbers.get("routing_weights_differ")
    if not differ:
        return []
    return [f"{head}  replayed routing weights: {differ} of {numbers['routing_weights']} differ from the reference's: "
            "this CPU stack's fp32 GEMMs sum the router in another order than the golden machine's, so FAITHFUL "
            "is out of reach here (docs/numerics.md, CPU stacks)"]


def _tier_line(head: str, verdict: CaseVerdict) -> str:
    tier = f"{head}  tier {verdict.tier}"
    if verdict.failed:
        tier += "  failed: " + ", ".join(verdict.failed)
    if verdict.missing:
        tier += "  missing: " + ", ".join(verdict.missing)
    return tier


def _image_lines(head: str, r: dict[str, RuleResult]) -> list[str]:
    """The image-case quantities: (b), (c) per mode, (e) vision, (e') merged input rows, (f) image routing,
    (g) Engram hash ids, the image rows' replay envelope (reported) and the FAITHFUL distance."""
    lines = []
    for mode, full in (("replay", "full."), ("own_selection", "full_lowtie.")):
        lines += [f"{head}  {_logits_line(f'{mode} {full}logits', r.get(f'{mode}.b_envelope'))}",
                  f"{head}  {_handoff_line(f'{mode} {full}hand-off', r.get(f'{mode}.c_handoff'))}"]
    def line(label: str, key: str, describe: Callable[[dict], str]) -> str:
        return f"{head}  {_line(label, r.get(key), describe)}"

    lines += [
        line("vision ViT + aligner rows", "vision.e_vit_aligner", lambda n: (
            f"max |Δ|/row RMS {n['max_rel_rms']:.3g}  bit-identical rows {n['rows_bit_identical']}/{n['rows']}")),
        line("replay merged input rows", "replay.e_input_embeds", lambda n: (
            f"text/delimiter rows differing {n['non_image_rows_differing']}  IMAGE rows max |Δ|/RMS "
            f"{n['image_rows_max_rel_rms']:.3g}  bit-identical {n['bit_identical']}")),
        line("own_selection image-row routing", "own_selection.f_image_routing", lambda n: (
            f"image-row picks equal {n['share']:.1%} of (layer, row)  text rows "
            f"{n['text_rows_share(info)']:.1%} (info)")),
        line("replay Engram hash ids", "replay.g_engram_hash", lambda n: (
            f"text positions differing {n.get('text_positions_differing', 'shape mismatch')}  image "
            f"positions differing {n.get('image_positions_differing(info)', '-')} (info)")),
    ]
    info = r.get("replay.image_rows_envelope(info)")
    if info is not None:
        lines.append(f"{head}  {'replay image rows of full.logits (info)':<40} max |Δ| {info.numbers['max_abs']:.3g}  "
                     f"mean |Δ| {info.numbers['mean_abs']:.3g}  bit-identical rows "
                     f"{info.numbers['bit_identical_rows']}/{info.numbers['rows']}")
    if "faithful(info)" in r:
        f = r["faithful(info)"].numbers
        lines.append(f"{head}  replay logits max |Δ| vs full.logits {f['logits_max_abs']:.3g}, hand-off streams "
                     f"bit-identical {f['handoff_streams_bit_identical']}, "
                     f"pre-mix {f['handoff_pre_mix_bit_identical']} "
                     f"(FAITHFUL needs <= {FAITHFUL_LOGITS_ABS:g}, both, and bit-identical ViT, aligner and merged "
                     "input rows)")
    return lines


def golden_engine(case_dir: Path) -> GoldenEngine:
    # imported here: the adapter brings in the model (torch); reading cases and applying rules needs only numpy
    from dsflash.golden.adapter import GoldenEngine as AdapterEngine

    return AdapterEngine(case_dir)


def check_golden(case_dirs: Sequence[str | os.PathLike], json_out: str | os.PathLike | None = None,
                 make_engine: Callable[[Path], GoldenEngine] = golden_engine) -> int:
    """Check every case directory, print the report, optionally write every number as JSON; returns the exit
    status (0 only when every case is PASS or FAITHFUL). A case that cannot be read or whose engine raises is
    reported and the remaining cases are still checked."""
    checks = []
    for case_dir in case_dirs:
        try:
            case = load_case(case_dir)
            if case.is_image_case:
                check_image_arrays(case)  # before building the engine
            check = check_case(case, make_engine(case.path))
        except GoldenCaseError as e:
            check = CaseCheck(case_dir=str(case_dir), name=str(case_dir), error=f"unreadable case: {e}")
        except Exception as e:  # one broken engine run must not hide the other cases' results
            traceback.print_exc()
            check = CaseCheck(case_dir=str(case_dir), name=str(case_dir), error=f"{type(e).__name__}: {e}")
        for line in report_lines(check):
            print(line, flush=True)
        checks.append(check)
    all_ok = all(c.ok for c in checks)
    if json_out is not None:
        Path(json_out).write_text(json.dumps({"ok": all_ok, "cases": [c.to_dict() for c in checks]}, indent=1))
    return 0 if all_ok else 1


def _run(args: argparse.Namespace) -> int:
    from dsflash.golden.adapter import GoldenEngine as AdapterEngine

    return check_golden(args.case_dirs, args.json_out, make_engine=lambda d: AdapterEngine(d, args.device))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check-golden", help="check the engine against golden case directories",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case_dirs", nargs="+", metavar="DIR",
                   help="golden case directory (config.json, model.safetensors, golden.safetensors, meta.json)")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write every number of every case to this JSON file")
    p.add_argument("--device", default="cpu", help="run the engine on this device (cpu: the reference backend)")
    p.set_defaults(func=_run)
