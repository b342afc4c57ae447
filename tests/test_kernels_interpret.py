"""CUDA-backend kernel logic without a GPU: Triton's interpreter (TRITON_INTERPRET=1) runs the kernels
on the CPU. Triton 3.9's interpreter rounds fp32 -> bf16/fp8 conversions wrongly (the GEMM, attention
and quantisation kernels give garbage there, on any input), so only the fp32 kernels are checked here;
the rest are checked on the GPU machine by tests/test_kernels_cuda.py (results in kernels/FIDELITY.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the dev extras install triton for these tests")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import torch
from dsflash.kernels import cuda
g = torch.Generator().manual_seed(0)
for rows, width in ((1, 5), (7, 300), (64, 1024), (3, 20480)):
    x = torch.randn(rows, width, generator=g)
    for square in (False, True):
        got = cuda.row_sum(x, square=square)
        ref = (x.double() ** (2 if square else 1)).sum(-1)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5), (rows, width, square)
        # a row's sum does not depend on the other rows of the call
        assert torch.equal(cuda.row_sum(x[rows // 2:rows // 2 + 1], square=square), got[rows // 2:rows // 2 + 1])
h = torch.randn(5, 4, 33, generator=g)
assert torch.equal(cuda.small_sum(h, 1), ((h[:, 0] + h[:, 1]) + h[:, 2]) + h[:, 3])
print("ok")
"""


def test_row_reductions_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
