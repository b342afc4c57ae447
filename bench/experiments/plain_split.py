"""Experiment (GPU): the plain bf16/fp32 GEMMs of a decode step by their K split and tile (issue 22). A one-row
6.cuda1 step pair spends ~3 ms in 177 of them at ~17 µs each (the mHC mixes 20480 -> 24 and the router 5120 ->
384, fp32 weights as 3xTF32; the indexer's 5120 -> 128 in bf16) against well under a microsecond of weight bytes:
is it the K chain of each program, the in-order sum of 64-160 range partials, or the TF32x3 products? Times each
shape at M = 1 (CUDA-graph replays over rotating weights, so the weights come from HBM as in a step) with
the shape's own K ranges and with others, tiles and precisions; other ranges give other bits (a numerics
change), so this only prices the choices.

    python bench/experiments/plain_split.py > $OUT/plain-split.txt
"""

import torch
import triton

from dsflash.bench.kernels import _rotating, bench_graph
from dsflash.kernels import cuda as kc
from dsflash.kernels.cpu import Weight
from dsflash.kernels.cuda import configs, gemm

SHAPES = [("mHC fn", "fp32", 24, 20480), ("gate", "fp32", 384, 5120), ("indexer.wk", "bf16", 128, 5120)]
ROTATE_BYTES = 256 << 20  # more weight copies than L2 holds


def time_call(kind: str, n: int, k: int, m: int, cfg: configs.LinearConfig, k_per_split: int, prec: str) -> float:
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    copies = max(2, ROTATE_BYTES // (n * k * (4 if kind == "fp32" else 2)))
    weights = [kc.to_cuda_weight(Weight(kind, (torch.randn(n, k, device="cuda") / 64).to(dtype)), "cuda")
               for _ in range(copies)]
    x = torch.randn(m, k, device="cuda").to(dtype)
    original = gemm.plain_k_per_split
    gemm.plain_k_per_split = lambda *_: k_per_split
    try:
        fn = _rotating([lambda w=w: kc.linear(x, w, config=cfg, fp32_precision=prec) for w in weights])
        return bench_graph(fn) * 1e3
    finally:
        gemm.plain_k_per_split = original


def main() -> None:
    print(f"# plain GEMMs at decode sizes: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"Triton {triton.__version__}")
    print("| shape | M | tile BMxBNxBK w s | precision | K per range | ranges | µs (graph) | weight-bytes floor µs |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    bandwidth = 3.35e12 if "H100" in torch.cuda.get_device_name(0) else 4.8e12
    for name, kind, n, k in SHAPES:
        own = configs.linear_config(kind, n, k)
        own_split = configs.plain_k_per_split(own, n, k)
        floor = n * k * (4 if kind == "fp32" else 2) / bandwidth * 1e6
        others = [(bn, bk) for bn, bk in ((32, 64), (64, 64), (16, 128)) if bn <= max(32, n)]
        tiles = [own] + [configs.LinearConfig(BM=16, BN=bn, BK=bk, num_warps=4, num_stages=3) for bn, bk in others
                         if (bn, bk) != (own.BN, own.BK)]
        precisions = ["tf32x3", "ieee", "tf32"] if kind == "fp32" else ["tf32"]
        for m in (1,):
            for cfg in tiles:
                for split in sorted({own_split, 1024, 4096, k}):
                    if split % cfg.BK or split > k:
                        continue
                    for prec in precisions if cfg is own else precisions[:1]:
                        us = time_call(kind, n, k, m, cfg, split, prec)
                        mark = " (own)" if cfg is own and split == own_split and prec == precisions[0] else ""
                        print(f"| {name}{mark} | {m} | {cfg.BM}x{cfg.BN}x{cfg.BK} w{cfg.num_warps} s{cfg.num_stages} | "
                              f"{prec} | {split} | {-(-k // split)} | {us:.1f} | {floor:.2f} |", flush=True)


if __name__ == "__main__":
    main()
