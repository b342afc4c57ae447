"""Every public golden case through `dsflash check-golden`: the engine must PASS DeepSeek's reference
forward (and reach FAITHFUL where the reference's index layout equals ours, see docs/numerics.md)."""

import json

import pytest

from dsflash.cli import main
from tests.conftest import GOLDEN_CASES

# tinyA_s0_T40's window (16) and top-k fit one softmax block, so the reference's call-length-dependent
# index layout coincides with ours and the one-shot prefill is bit-identical
EXPECTED_TIER = {"tinyA_s0_T40": "FAITHFUL"}


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: p.name)
def test_check_golden_case(case, tmp_path):
    out = tmp_path / "result.json"
    status = main(["check-golden", str(case), "--json", str(out)])
    result = json.loads(out.read_text())
    (entry,) = result if isinstance(result, list) else result["cases"]
    tier = entry["tier"]
    assert status == 0, entry
    assert tier == EXPECTED_TIER.get(case.name, tier) and tier in ("FAITHFUL", "PASS")
