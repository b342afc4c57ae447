"""One engine FP8 GEMM (wo_b 8192->5120 at M = 8,192: the prefill's 128x128 tiles) for Nsight Compute.

Run on the GPU machine from the repository root (bench/results/ncu-bs-gemm-2026-12-01.txt):
    ncu --kernel-name regex:_bs_gemm_kernel --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy \
        python bench/experiments/ncu_gemm.py
    (stall reasons and pipe use: --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,
     regex:sm__pipe_.*_cycles_active\\.avg\\.pct_of_peak_sustained_active")
"""

import torch

from dsflash.bench.kernels import random_cuda_weight
from dsflash.kernels import cuda as kc

w = random_cuda_weight("fp8", 5120, 8192)
x = torch.randn(8192, 8192, device="cuda").bfloat16()
for _ in range(2):
    kc.linear(x, w)
torch.cuda.synchronize()
