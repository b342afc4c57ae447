"""Experiment (GPU): the FP8/FP4 GEMM's tiles under CUDA numerics 6.cuda1 (one MMA chain per K range over
dequantised operands), per V4.1 layer shape: which tiles give the large calls' bits, and what they cost.

    PYTHONPATH=$PWD python bench/experiments/decode_tiles.py

For M = 1, 8, 16 rows: the decode tiles (16 rows as the N of a wgmma whose M is 64 weight rows, `swap`), the
64-row wgmma tiles and the 16-row mma.sync tiles, each against the rows of a 1,100-row call (the in-memory
dequantised route) -- the number of differing outputs -- and the GPU time of a call (CUDA-graph replays)."""

from __future__ import annotations

import torch

from dsflash.bench.kernels import LINEARS, bench_graph
from dsflash.kernels import cuda as kc
from dsflash.kernels.cuda import configs
from tests.test_kernels_cuda import rand_act, rand_weight

TILES = {
    "swap 16x64 w4": configs.LinearConfig(BM=16, BN=64, BK=32, num_warps=4, num_stages=4, swap=True),
    "wgmma 64x64 w4": configs.LinearConfig(BM=64, BN=64, BK=32, num_warps=4, num_stages=4),
    "mma.sync 16x64 w2": configs.LinearConfig(BM=16, BN=64, BK=32, num_warps=2, num_stages=4),
}


def main() -> None:
    g = torch.Generator().manual_seed(7)
    print("| shape | M | tiles | outputs differing from the 1,100-row call | us |")
    print("|---|---:|---|---:|---:|")
    for name, kind, n, k in LINEARS:
        if kind not in ("fp8", "fp4"):
            continue
        wc = kc.to_cuda_weight(rand_weight(kind, n, k, g), "cuda")
        x = rand_act(1100, k, g).cuda()
        full = kc.linear(x, wc)
        for m in (1, 8, 16):
            for label, cfg in TILES.items():
                y = kc.linear(x[:m], wc, config=cfg)
                diff = int((y != full[:m]).sum())
                us = 1000 * bench_graph(lambda xm=x[:m], w=wc, cfg=cfg: kc.linear(xm, w, config=cfg))
                print(f"| {name} {k}->{n} | {m} | {label} | {diff} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
