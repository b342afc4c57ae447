"""The CUDA backend's launch rules, read from its source (no GPU needed): every Triton kernel begins with
`grid_entry()`, once (with programmatic dependent launch it waits for the previous kernel before touching
memory, so a kernel started early never reads a value its predecessor has not written), and every launch names
its choices -- FMA contraction (a Triton upgrade cannot change a kernel's bits) and programmatic dependent
launch (a kernel launched early without the wait would race)."""

import ast
import importlib
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the dev extras install triton for these tests")
SOURCES = sorted((Path(__file__).resolve().parents[1] / "dsflash" / "kernels" / "cuda").glob("*.py"))


def _kernels_and_launches() -> tuple[list[tuple[str, ast.FunctionDef]], list[tuple[str, ast.Call]]]:
    kernels, launches = [], []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d) for d in node.decorator_list) \
                    and node.name.endswith("_kernel"):
                kernels.append((f"{path.name}:{node.name}", node))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel"):
                launches.append((f"{path.name}:{node.lineno}", node))
    return kernels, launches


def test_every_kernel_enters_through_grid_entry_and_every_launch_names_its_choices():
    kernels, launches = _kernels_and_launches()
    assert len(kernels) >= 20 and len(launches) >= len(kernels), (len(kernels), len(launches))
    for name, fn in kernels:
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
            else fn.body
        first = ast.unparse(body[0])
        assert first == "grid_entry()", f"{name} starts with {first!r}, not grid_entry()"
        entries = sum(isinstance(n, ast.Call) and ast.unparse(n) == "grid_entry()" for n in ast.walk(fn))
        assert entries == 1, f"{name} enters through grid_entry() {entries} times"
    for where, call in launches:
        named = {k.arg for k in call.keywords}
        assert {"enable_fp_fusion", "launch_pdl"} <= named, f"the launch at {where} names only {sorted(named)}"
        pdl = next(k.value for k in call.keywords if k.arg == "launch_pdl")
        assert ast.unparse(pdl) == "PDL_LAUNCH", f"the launch at {where} decides launch_pdl itself"


@pytest.mark.parametrize("env, want", [({}, True), ({"DSFLASH_PDL": "0"}, False), ({"DSFLASH_PDL": "1"}, True),
                                       ({"DSFLASH_PDL": "prefetch"}, False), ({"DSFLASH_PDL": "yes"}, False),
                                       ({"DSFLASH_PDL": "1", "TRITON_INTERPRET": "1"}, False)])
def test_programmatic_dependent_launch_is_asked_for_and_never_interpreted(monkeypatch, env, want):
    common = importlib.import_module("dsflash.kernels.cuda.common")
    for name in ("DSFLASH_PDL", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # without a GPU the choice is the request (for compiling); a GPU before sm_90 never gets it
    assert common._pdl_wanted() is want
