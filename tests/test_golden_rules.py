"""Our golden reader and tolerance rules against the reference checker `tests/golden/golden/load_case.py`.

The reference checker is imported by the tests only (tests/conftest.py); dsflash itself never imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from dsflash import cli
from dsflash.golden.case import GoldenCase, GoldenCaseError, load_case, replay_selections
from dsflash.golden.check import check_case, check_golden
from dsflash.golden.rules import FAIL, FAITHFUL, PASS, CaseVerdict, judge_case
from tests.conftest import GOLDEN, TEXT_CASE, reference
from tests.golden_reference import assert_same_as_reference

CASES = ["tinyA_s0_T40", "tinyA-w128_s1_T200"]
PREFILL_KEYS = ("logits", "handoff_streams", "handoff_pre_mix")


@pytest.fixture(scope="module", params=CASES)
def cases(request) -> tuple[GoldenCase, dict]:
    case_dir = GOLDEN / request.param
    return load_case(case_dir), reference.load_case(str(case_dir))


def stored_outputs(golden: dict) -> dict:
    """Copies of the reference's own arrays, shaped as engine outputs (replay, own, battery, battery_own, drafts)."""
    def prefill(prefix: str) -> dict[str, np.ndarray]:
        return {k: golden[prefix + k].copy() for k in PREFILL_KEYS}

    return {"replay": prefill("full."), "own": prefill("full_lowtie."), "battery": prefill("battery."),
            "battery_own": prefill("battery_lowtie."), "draft_logits": golden["draft_logits"].copy()}


class StoredArraysEngine:
    """Stand-in engine for the rules test only: it computes nothing and answers each prefill / draft call with
    the given arrays (by default the reference's own), after checking that check_case asked for the right
    sequence with the right selections."""

    def __init__(self, case: GoldenCase, outputs: dict):
        self.case, self.outputs = case, outputs
        self.calls: list[str] = []

    def prefill(self, ids: np.ndarray, selections: dict | None) -> dict[str, np.ndarray]:
        g = self.case.golden
        if np.array_equal(ids, g["full.input_ids"]):
            self.calls.append("full")
            expected, source, seq = replay_selections(self.case, "full."), "replay", None
        else:
            (matches,) = np.nonzero((g["battery.input_ids"] == ids).all(-1))
            seq = int(matches[0])
            self.calls.append(f"battery{seq}")
            expected, source = replay_selections(self.case, "battery.", seq=seq), "battery"
        if selections is None:
            source = "own" if source == "replay" else "battery_own"
        else:
            assert selections["index_topk"].keys() == expected["index_topk"].keys()
            for layer, picks in expected["index_topk"].items():
                assert np.array_equal(selections["index_topk"][layer], picks)
            assert np.array_equal(selections["moe_expert_ids"], expected["moe_expert_ids"])
        out = self.outputs[source]
        return {k: out[k] if seq is None else out[k][seq] for k in PREFILL_KEYS}

    def draft(self, prefill_main_hidden, anchors, ctx_rows, start_pos) -> np.ndarray:
        g = self.case.golden
        assert np.array_equal(prefill_main_hidden, g["prefill_dspark_main_hidden"])
        assert np.array_equal(anchors, g["decode_next_ids"])
        assert np.array_equal(ctx_rows, g["decode_dspark_main_hidden"])
        assert np.array_equal(start_pos, len(g["prompt_ids"]) + np.arange(len(anchors)))
        self.calls.append("draft")
        return self.outputs["draft_logits"]


def judge_both(case: GoldenCase, ref_case: dict, outputs: dict) -> tuple[CaseVerdict, dict]:
    ours = judge_case(case, outputs["replay"], outputs["own"], outputs["battery"], outputs["battery_own"],
                      outputs["draft_logits"])
    theirs = reference.check_engine(ref_case, replay=outputs["replay"], own=outputs["own"], battery=outputs["battery"],
                                    battery_own=outputs["battery_own"], draft_logits=outputs["draft_logits"])
    return ours, theirs


def test_reference_arrays_are_faithful(cases):
    case, ref_case = cases
    ours, theirs = judge_both(case, ref_case, stored_outputs(case.golden))
    assert ours.tier == FAITHFUL
    assert_same_as_reference(ours, theirs)


def test_check_case_runs_every_step(cases):
    case, ref_case = cases
    engine = StoredArraysEngine(case, stored_outputs(case.golden))
    result = check_case(case, engine)
    n_battery = len(case.golden["battery.input_ids"])
    assert engine.calls == ["full", "full"] + [f"battery{n}" for n in range(n_battery)] * 2 + ["draft"]
    assert result.ok and result.error is None and result.not_run == []
    assert result.verdict.tier == FAITHFUL
    _, theirs = judge_both(case, ref_case, stored_outputs(case.golden))
    assert_same_as_reference(result.verdict, theirs)


def test_tiny_logit_change_passes_but_is_not_faithful(cases):
    case, ref_case = cases
    outputs = stored_outputs(case.golden)
    outputs["replay"]["logits"][[0, 5, 17]] += np.float32(1e-4)
    outputs["battery"]["logits"][2, [1, 6]] += np.float32(1e-4)
    ours, theirs = judge_both(case, ref_case, outputs)
    assert ours.tier == PASS
    assert not ours.rules["faithful(info)"].numbers["faithful"]
    assert_same_as_reference(ours, theirs)


def test_noise_on_every_row_fails_clean_rows(cases):
    case, ref_case = cases
    outputs = stored_outputs(case.golden)
    rng = np.random.default_rng(0)
    for arrays in (outputs["replay"], outputs["own"], outputs["battery"], outputs["battery_own"]):
        arrays["logits"] += rng.uniform(-0.01, 0.01, arrays["logits"].shape).astype(np.float32)
    outputs["draft_logits"] += rng.uniform(-0.01, 0.01, outputs["draft_logits"].shape).astype(np.float32)
    ours, theirs = judge_both(case, ref_case, outputs)
    assert ours.tier == FAIL
    assert ours.failed == ["replay.a_clean_rows", "own_selection.a_clean_rows"]
    assert_same_as_reference(ours, theirs)


def test_engine_step_not_implemented_is_missing(cases):
    case, _ = cases

    class NoDrafterEngine(StoredArraysEngine):
        def draft(self, *args) -> np.ndarray:
            raise NotImplementedError("drafter not written yet")

    result = check_case(case, NoDrafterEngine(case, stored_outputs(case.golden)))
    assert result.verdict.tier == FAIL and result.verdict.missing == ["drafter.d_envelope"]
    assert result.not_run == ["drafter: drafter not written yet"] and not result.ok


def test_replay_selections_shapes():
    case = load_case(TEXT_CASE)
    full = replay_selections(case, "full.")
    assert {i: a.shape for i, a in full["index_topk"].items()} == {1: (72, 8), 3: (72, 8), 5: (72, 8)}
    assert all(a.dtype == np.int32 for a in full["index_topk"].values())
    assert full["moe_expert_ids"].shape == (6, 72, 2) and full["moe_expert_ids"].dtype == np.int64
    seq = replay_selections(case, "battery.", seq=3)
    assert {i: a.shape for i, a in seq["index_topk"].items()} == {1: (8, 4), 3: (8, 8), 5: (8, 8)}
    assert np.array_equal(seq["moe_expert_ids"], case.golden["battery.moe_expert_ids"][3])
    with pytest.raises(ValueError):
        replay_selections(case, "battery.")
    with pytest.raises(ValueError):
        replay_selections(case, "full.", seq=0)


def copy_case(tmp_path: Path, name: str, skip: tuple[str, ...] = ()) -> Path:
    src, dst = TEXT_CASE, tmp_path / name
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).symlink_to(f)
    return dst


def image_case(tmp_path: Path) -> Path:
    """A case in the image format without its image arrays: recognised by full.token_types, refused as incomplete
    (complete image cases: tests/test_golden_vision.py)."""
    dst = copy_case(tmp_path, "image_case", skip=("golden.safetensors",))
    ids = np.arange(3, 13, dtype=np.int64)
    types = np.array([-1, -1, 0, 1, 2, 3, -1, -1, -1, -1], np.int64)
    save_file({"full.input_ids": ids, "full.token_types": types}, str(dst / "golden.safetensors"))
    return dst


def test_missing_golden_file_is_unreadable(tmp_path):
    with pytest.raises(GoldenCaseError, match="missing golden.safetensors"):
        load_case(copy_case(tmp_path, "no_golden", skip=("golden.safetensors",)))


def test_corrupt_and_incomplete_cases(tmp_path):
    corrupt = copy_case(tmp_path, "corrupt", skip=("golden.safetensors",))
    (corrupt / "golden.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(GoldenCaseError, match="golden.safetensors unreadable"):
        load_case(corrupt)
    incomplete = copy_case(tmp_path, "incomplete", skip=("golden.safetensors",))
    g = dict(load_case(TEXT_CASE).golden)
    del g["battery_lowtie.logits"]
    save_file(g, str(incomplete / "golden.safetensors"))
    with pytest.raises(GoldenCaseError, match="missing battery_lowtie.logits"):
        load_case(incomplete)


class NeverCalledEngine:
    def prefill(self, ids, selections):
        raise AssertionError("an image case must not run the engine")

    def draft(self, prefill_main_hidden, anchors, ctx_rows, start_pos):
        raise AssertionError("an image case must not run the engine")


def test_incomplete_image_case_is_unreadable(tmp_path):
    with pytest.raises(GoldenCaseError, match=r"incomplete \(image case\): missing full.input_embeds"):
        check_case(image_case(tmp_path), NeverCalledEngine())


def test_check_golden_reports_every_case(tmp_path, capsys):
    good = TEXT_CASE
    unreadable = copy_case(tmp_path, "no_golden", skip=("golden.safetensors",))
    out = tmp_path / "result.json"

    def stored_engine(case_dir: Path) -> StoredArraysEngine:
        case = load_case(case_dir)
        return StoredArraysEngine(case, stored_outputs(case.golden))

    assert check_golden([good], out, make_engine=stored_engine) == 0
    assert json.loads(out.read_text())["cases"][0]["tier"] == FAITHFUL
    status = check_golden([unreadable, good, image_case(tmp_path)], out, make_engine=stored_engine)
    assert status == 1
    report = json.loads(out.read_text())
    assert [c["tier"] if c["error"] is None else "error" for c in report["cases"]] == ["error", FAITHFUL, "error"]
    assert report["cases"][1]["rules"]["replay.b_envelope"]["max_abs"] == 0.0
    printed = capsys.readouterr().out
    assert "missing golden.safetensors" in printed
    assert "tinyA_s0_T40  tier FAITHFUL" in printed
    assert "incomplete (image case)" in printed


def test_cli_subcommand_unreadable_case(tmp_path, capsys):
    assert cli.main(["check-golden", str(tmp_path / "absent")]) == 1
    assert "not a directory" in capsys.readouterr().out
