"""One engine FP8/FP4 GEMM for Nsight Compute: by default wo_b 8192->5120 at M = 8,192 (the prefill's 128x128
tiles); `python bench/experiments/ncu_gemm.py KIND N K M` another shape and row count (M <= 16: a decode's
swapped 16-row tiles with the K ranges as separate programs, then their in-order sum).

Run on the GPU machine from the repository root (bench/results/ncu-bs-gemm-2026-12-01.txt):
    ncu --kernel-name regex:_bs_gemm_kernel --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy \
        python bench/experiments/ncu_gemm.py
    (stall reasons and pipe use: --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,
     regex:sm__pipe_.*_cycles_active\\.avg\\.pct_of_peak_sustained_active")
"""

import sys

import torch

from dsflash.bench.kernels import random_cuda_weight
from dsflash.kernels import cuda as kc

kind, n, k, m = (sys.argv[1], *map(int, sys.argv[2:5])) if len(sys.argv) > 4 else ("fp8", 5120, 8192, 8192)
w = random_cuda_weight(kind, n, k)
x = torch.randn(m, k, device="cuda").bfloat16()
for _ in range(2):
    kc.linear(x, w)
torch.cuda.synchronize()
