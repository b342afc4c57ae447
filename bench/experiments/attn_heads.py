"""Experiment (GPU): does sparse attention give the same bits with fewer heads per program (16 heads:
mma.sync tiles and another reduction layout for the softmax sums), and how fast is each at decode
sizes? One program per query uses one SM at M=1 (52 µs per layer); 16-head programs would use four.

    python bench/experiments/attn_heads.py > $OUT/attn_heads.txt
"""

import torch

from dsflash.bench.kernels import bench_graph
from dsflash.kernels import cuda as kc

H, D, K, R = 64, 512, 640, 8192 + 128  # the bench preset's heads and channels, window + picks, an 8K cache


def decode_inputs(n: int, idx_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q [n, H, D], kv [R, D], sink [H] and indices [n, K] (600 valid, then -1) of a decode's sparse attention."""
    q = torch.randn(n, H, D, device="cuda").bfloat16()
    kv = torch.randn(R, D, device="cuda").bfloat16()
    sink = torch.randn(H, device="cuda")
    idx = torch.randint(0, R, (n, K), device="cuda", dtype=idx_dtype)
    idx[:, 600:] = -1  # the model's layout: valid entries first, -1 padding last
    return q, kv, sink, idx


def main() -> None:
    torch.manual_seed(0)
    for n in (1, 8, 512):
        q, kv, sink, idx = decode_inputs(n, torch.int32)
        ref = kc.sparse_attn(q, kv, sink, idx, D ** -0.5)
        for block_h in (64, 32, 16):
            got = kc.sparse_attn(q, kv, sink, idx, D ** -0.5, block_h=block_h)
            diff = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
            us = bench_graph(lambda b=block_h, q=q, kv=kv, sink=sink, idx=idx:
                             kc.sparse_attn(q, kv, sink, idx, D ** -0.5, block_h=b)) * 1e3
            print(f"n={n:<4} heads/program {block_h:<3} bits differ {diff:>8}/{ref.numel()}  {us:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
