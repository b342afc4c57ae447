"""Experiment (GPU): a decode row's sparse attention (the bench preset's 64 heads of 512 channels, a 128-row window
and 512 picks over an 8K cache) at 1, 5 and 8 queries, with 128, 64 and 32 (the engine's) output channels a
program: microseconds a call from CUDA-graph replays and outputs differing from the engine's default (run before
and after a patch of the kernel to time it; bench/results/side-kv-attn-h100-2026-12-06.md).

    PYTHONPATH=$PWD python bench/experiments/attn_decode.py > $OUT/attn-decode.txt
"""

import functools

import torch

from dsflash.bench.kernels import bench_graph
from dsflash.kernels import cuda as kc


def main() -> None:
    torch.manual_seed(0)
    h, d, k, r = 64, 512, 640, 8192 + 128
    print("| queries | channels a program | outputs differing | us |")
    print("|---:|---:|---:|---:|")
    for n in (1, 5, 8):
        q = torch.randn(n, h, d, device="cuda").bfloat16()
        kv = torch.randn(r, d, device="cuda").bfloat16()
        sink = torch.randn(h, device="cuda")
        idx = torch.randint(0, r, (n, k), device="cuda", dtype=torch.int64)
        idx[:, 600:] = -1  # the model's layout: valid entries first, -1 padding last
        ref = kc.sparse_attn(q, kv, sink, idx, d ** -0.5)
        for block_o in (128, 64, 32):
            call = functools.partial(kc.sparse_attn, q, kv, sink, idx, d ** -0.5, block_o=block_o)
            diff = int((call().view(torch.int16) != ref.view(torch.int16)).sum())
            print(f"| {n} | {block_o} | {diff} | {bench_graph(call) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
