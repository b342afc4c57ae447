"""Experiment (GPU): decode-size FP8/FP4 GEMMs with the shape-fixed K ranges -- which of the bit-neutral
choices is fastest at M = 1 and 8 (the weight tile as the MMA's A operand, the activation quantisation fused
into the GEMM), do they keep the default's bits, and is the large-M path as fast as before?

    python bench/experiments/decode_gemm.py > $OUT/decode-gemm.txt
"""

import dataclasses

import torch

from dsflash.bench.kernels import LINEARS, _rotating, bench_graph, random_cuda_weight, weight_bytes
from dsflash.kernels import cuda as kc

SHAPES = [shape for shape in LINEARS if shape[1] in ("fp8", "fp4")]


def act(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, device="cuda")
    mag = torch.exp2(torch.randint(-6, 7, (m, k // 32), device="cuda").float()).repeat_interleave(32, 1)
    return (x * mag).bfloat16()


def variants(kind: str, n: int, k: int, m: int) -> dict[str, dict]:
    cfg = kc.linear_config(kind, n, k, m)
    swapped = dataclasses.replace(cfg, weight_first=True)
    return {"default": {"config": cfg}, "weight-first": {"config": swapped},
            "fused": {"config": cfg, "fuse_quant": True}, "weight-first+fused": {"config": swapped, "fuse_quant": True}}


def main() -> None:
    torch.manual_seed(0)
    for label, kind, n, k in SHAPES:
        w = random_cuda_weight(kind, n, k)
        copies = [w] + [random_cuda_weight(kind, n, k) for _ in range(max(1, (256 << 20) // weight_bytes(w)))]
        for m in (1, 8, 8192):
            x = act(m, k)
            ref = kc.linear(x, w)
            out = []
            for name, kw in variants(kind, n, k, m).items():
                if m > 16 and "fused" in name:
                    continue
                same = torch.equal(kc.linear(x, w, **kw), ref)
                fns = [lambda w=c, x=x, kw=kw: kc.linear(x, w, **kw) for c in copies]
                out.append(f"{name} {bench_graph(_rotating(fns)) * 1e3:7.1f}{'' if same else ' DIFF'}")
            print(f"{label:<24} M={m:<5} " + " | ".join(out), flush=True)
        del copies, w
        torch.cuda.empty_cache()
    for label, n, k, per_row in (("expert w1/w3 slots", 2304, 5120, 12), ("expert w2 slots", 5120, 2304, 1)):
        banks = [kc.expert_bank([random_cuda_weight("fp4", n, k) for _ in range(96 if per_row > 1 else 48)])
                 for _ in range(3)]
        for rows in (1, 5, 8):
            ids = torch.stack([torch.randperm(48)[:6] for _ in range(rows)]).cuda()
            if per_row > 1:
                ids = torch.cat([ids, ids + 48], 1)
            x = act(rows * ids.size(1) // per_row, k)
            ref = kc.expert_linear(x, banks[0], ids, per_row)
            out = []
            for name, kw in variants("fp4", n, k, 1).items():
                kc.FUSE_QUANT_MAX_M = 16 if kw.pop("fuse_quant", False) else 0
                same = torch.equal(kc.expert_linear(x, banks[0], ids, per_row, **kw), ref)
                fns = [lambda b=b, kw=kw, x=x, ids=ids, r=per_row: kc.expert_linear(x, b, ids, r, **kw) for b in banks]
                out.append(f"{name} {bench_graph(_rotating(fns)) * 1e3:7.1f}{'' if same else ' DIFF'}")
                kc.FUSE_QUANT_MAX_M = 0
            print(f"{label:<24} rows={rows} " + " | ".join(out), flush=True)
        del banks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
