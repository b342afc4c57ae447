"""Experiment (GPU): a decode row's sparse attention (the bench preset's 64 heads of 512 channels, a 128-row window
and 512 picks over an 8K cache) at 1, 5 and 8 queries, with 128, 64 and 32 (the engine's) output channels a
program: microseconds a call from CUDA-graph replays and outputs differing from the engine's default (run before
and after a patch of the kernel to time it; bench/results/side-kv-attn-h100-2026-12-06.md).

    PYTHONPATH=$PWD python bench/experiments/attn_decode.py > $OUT/attn-decode.txt
"""

import functools

import torch
from attn_heads import D, decode_inputs

from dsflash.bench.kernels import bench_graph
from dsflash.kernels import cuda as kc


def main() -> None:
    torch.manual_seed(0)
    print("| queries | channels a program | outputs differing | us |")
    print("|---:|---:|---:|---:|")
    for n in (1, 5, 8):
        q, kv, sink, idx = decode_inputs(n, torch.int64)
        ref = kc.sparse_attn(q, kv, sink, idx, D ** -0.5)
        for block_o in (128, 64, 32):
            call = functools.partial(kc.sparse_attn, q, kv, sink, idx, D ** -0.5, block_o=block_o)
            diff = int((call().view(torch.int16) != ref.view(torch.int16)).sum())
            print(f"| {n} | {block_o} | {diff} | {bench_graph(call) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
