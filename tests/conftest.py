import os
from pathlib import Path

import pytest

# the golden cases live beside the checkout (../shared/golden); DSFLASH_GOLDEN_DIR points elsewhere
GOLDEN = Path(os.environ.get("DSFLASH_GOLDEN_DIR") or Path(__file__).resolve().parents[1].parent / "shared" / "golden")
GOLDEN_CASES = sorted(p for p in GOLDEN.glob("*") if (p / "golden.safetensors").exists())


@pytest.fixture(scope="session")
def golden_cases() -> list[Path]:
    assert GOLDEN_CASES, f"no golden cases under {GOLDEN}"
    return GOLDEN_CASES
