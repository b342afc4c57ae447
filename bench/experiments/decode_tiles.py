"""Experiment (GPU): the FP8/FP4 GEMM's tiles under CUDA numerics 6.cuda1 (one MMA chain per K range over
dequantised operands), per V4.1 layer shape: which tiles give the large calls' bits, and what they cost.

    PYTHONPATH=$PWD python bench/experiments/decode_tiles.py

For M = 1 and 8 rows: decode tiles (16 or 8 rows as the N of a wgmma whose M is 64 or 128 weight rows, `swap`) with
MMA steps of 32 to 128 columns and 2-4 pipeline stages, and the 64-row wgmma tiles, with the K ranges as separate
programs or not (and the default tiles with the activation quantised by a launch of its own), each against the
rows of a 1,100-row call (the in-memory dequantised route) -- the number of differing outputs -- and the GPU time
of a call (CUDA-graph replays); then the routed experts' slot programs over a 48-expert FP4 bank for a one- and a
five-row step (6 and 30 slots)."""

from __future__ import annotations

import functools

import torch

from dsflash.bench.kernels import LINEARS, bench_graph
from dsflash.kernels import cuda as kc
from dsflash.kernels.cuda import configs
from tests.test_kernels_cuda import rand_act, rand_weight

TILES = {
    "swap 16x64 k128 s4": configs.LinearConfig(BM=16, BN=64, BK=128, num_warps=4, num_stages=4, swap=True),
    "swap 16x64 k128 s2": configs.LinearConfig(BM=16, BN=64, BK=128, num_warps=4, num_stages=2, swap=True),
    "swap 16x64 k64 s3": configs.LinearConfig(BM=16, BN=64, BK=64, num_warps=4, num_stages=3, swap=True),
    "swap 16x64 k32 s4": configs.LinearConfig(BM=16, BN=64, BK=32, num_warps=4, num_stages=4, swap=True),
    "swap 16x128 k128 s3": configs.LinearConfig(BM=16, BN=128, BK=128, num_warps=4, num_stages=3, swap=True),
    # 8 rows as a wgmma's N (m64n8k16): half the activation work of the 16-row tiles (SASS loop body of the FP8
    # decode tile 480 -> 403 instructions, compiled here), for steps of at most 8 rows
    "swap 8x64 k128 s4": configs.LinearConfig(BM=8, BN=64, BK=128, num_warps=4, num_stages=4, swap=True),
    "wgmma 64x64 k32 s4": configs.LinearConfig(BM=64, BN=64, BK=32, num_warps=4, num_stages=4),
}
EXPERTS = 48  # the bench preset's bank; slots: a one-row step's 6 and a five-row step's 30


def main() -> None:
    g = torch.Generator().manual_seed(7)
    print("| shape | M | tiles | K ranges apart | outputs differing from the 1,100-row call | us |")
    print("|---|---:|---|---|---:|---:|")
    for name, kind, n, k in LINEARS:
        if kind not in ("fp8", "fp4"):
            continue
        wc = kc.to_cuda_weight(rand_weight(kind, n, k, g), "cuda")
        x = rand_act(1100, k, g).cuda()
        full = kc.linear(x, wc)
        for m in (1, 8):
            for label, cfg in TILES.items():
                for spread in (None, False):
                    y = kc.linear(x[:m], wc, config=cfg, spread=spread)
                    diff = int((y != full[:m]).sum())
                    us = 1000 * bench_graph(functools.partial(kc.linear, x[:m], wc, config=cfg, spread=spread))
                    print(f"| {name} {k}->{n} | {m} | {label} | {spread is None} | {diff} | {us:.1f} |", flush=True)
            # the default tiles over E4M3 codes quantised by a launch of their own, not in every program
            y = kc.linear(x[:m], wc, fuse_quant=False)
            us = 1000 * bench_graph(functools.partial(kc.linear, x[:m], wc, fuse_quant=False))
            print(f"| {name} {k}->{n} | {m} | default, quantised apart | True | {int((y != full[:m]).sum())} | "
                  f"{us:.1f} |", flush=True)
    print()
    print("| expert bank | slots | tiles | K ranges apart | us |")
    print("|---|---:|---|---|---:|")
    for name, kind, n, k in LINEARS:
        if not name.startswith("expert"):
            continue
        bank = kc.expert_bank([kc.to_cuda_weight(rand_weight(kind, n, k, g), "cuda") for _ in range(EXPERTS)])
        for rows in (1, 5):
            x = rand_act(rows, k, g).cuda()
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:6] for _ in range(rows)]).cuda()
            for label, cfg in TILES.items():
                if not cfg.swap:
                    continue
                for spread in (None, False):
                    us = 1000 * bench_graph(functools.partial(kc.expert_linear, x, bank, ids, 6, config=cfg,
                                                              spread=spread))
                    print(f"| {name} {k}->{n} | {6 * rows} | {label} | {spread is None} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
