"""Every public golden case through `dsflash check-golden`: the engine must PASS DeepSeek's reference
forward (and reach FAITHFUL where the reference's index layout equals ours and this CPU stack sums the
router as the golden arrays' machine did, see docs/numerics.md and tests/golden_stack.py)."""

import json
import os
import warnings

import pytest
import torch

from dsflash.cli import main
from tests.conftest import CPU_TIERS, GOLDEN_CASES, TEXT_CASE
from tests.golden_stack import MAX_ROUTER_ULPS, assert_faithful, load_golden, replay_outputs, router_probe

# tinyA_s0_T40's window (16) and top-k fit one softmax block, so the reference's call-length-dependent
# index layout coincides with ours and the one-shot prefill is bit-identical (FAITHFUL); tinyA-w128_s1_T200's
# 128-token window does not (PASS: battery bit-identical, the one-shot prefill within the tolerances)


# the 200-token case (~34 s) runs with the slow set; the default run checks the FAITHFUL one
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.name == "tinyA-w128_s1_T200" else c
                                  for c in GOLDEN_CASES], ids=lambda p: p.name)
def test_check_golden_case(case, tmp_path):
    out = tmp_path / "result.json"
    status = main(["check-golden", str(case), "--json", str(out)])
    (entry,) = json.loads(out.read_text())["cases"]
    assert status == 0 and entry["error"] is None and not entry["failed"], entry
    if case.name in CPU_TIERS:  # a public case: exactly its tier, neither lower nor (unnoticed) higher
        want = CPU_TIERS[case.name]
        probe = router_probe(case)
        if want == "FAITHFUL" and not probe.reproduced:
            warnings.warn(f"{case.name}: {probe.reason()}", stacklevel=1)
            want = "PASS"
        assert entry["tier"] == want, entry["tier"]
        # the check counts the replayed routing weights that are not the reference's, as the probe does, and
        # says why FAITHFUL is out of reach when some are
        info = entry["rules"]["faithful(info)"]
        assert (info["routing_weights_differ"], info["routing_weights"]) == (probe.differ, probe.total)
    else:  # another case set (DSFLASH_GOLDEN_DIR): PASS is required, FAITHFUL reported
        assert entry["tier"] in ("FAITHFUL", "PASS"), entry["tier"]


def test_the_public_cases_all_have_an_expected_tier():
    if "DSFLASH_GOLDEN_DIR" not in os.environ:
        assert [c.name for c in GOLDEN_CASES] == ["tinyA-w128_s1_T200", "tinyA_s0_T40"]


def test_faithful_with_the_reference_routing_weights():
    """tinyA_s0_T40 on any CPU stack: the replay's routing weights within a few ulps of the reference's on
    every layer whose input is bit-identical, and with the reference's weights replayed too, FAITHFUL."""
    probe = router_probe(TEXT_CASE)
    assert probe.layers >= 1 and probe.max_ulps <= MAX_ROUTER_ULPS, probe
    golden = load_golden(TEXT_CASE)
    assert_faithful(replay_outputs(TEXT_CASE, weights=True), golden)


def test_replay_does_not_depend_on_the_thread_count():
    """MKL's pinned code path (kernels/cpu.py, MKL_CODE_PATH) sums every GEMM the same way on 1 and 2
    threads: the replay's logits and hand-off are the same bytes."""
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(replay_outputs(TEXT_CASE, weights=False))
    finally:
        torch.set_num_threads(threads)
    for key in outs[0]:
        assert outs[0][key].tobytes() == outs[1][key].tobytes(), key
