"""Experiment (GPU): do 16-row tiles (mma.sync) give the bits of the 64-row wgmma tiles, and how fast is
each tile config, its K ranges in one program or spread, at decode sizes? Decides whether steps of <= 16
rows may use narrow tiles.

    python bench/experiments/mma_tiles.py > $OUT/mma_tiles.txt
"""

import torch

from dsflash.bench.kernels import LINEARS, _rotating, bench_graph, random_cuda_weight, weight_bytes
from dsflash.kernels import cuda as kc
from dsflash.kernels.cuda.configs import LinearConfig
from dsflash.numerics import BLOCK

SHAPES = [shape for shape in LINEARS if shape[1] in ("fp8", "fp4")]  # the block-scaled layers
BASE = LinearConfig(64, 64, 32, 4, 4)
CANDIDATES = [BASE, LinearConfig(16, 64, 32, 4, 4), LinearConfig(16, 128, 32, 4, 4),
              LinearConfig(16, 64, 32, 2, 4), LinearConfig(16, 32, 32, 2, 4), LinearConfig(64, 128, 32, 4, 4)]


def act(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, device="cuda")
    mag = torch.exp2(torch.randint(-6, 7, (m, k // BLOCK), device="cuda").float()).repeat_interleave(BLOCK, 1)
    return (x * mag).bfloat16()


def name(c: LinearConfig) -> str:
    return f"BM{c.BM}/BN{c.BN}/w{c.num_warps}"


def main() -> None:
    torch.manual_seed(0)
    for label, kind, n, k in SHAPES:
        w = random_cuda_weight(kind, n, k)
        copies = [w] + [random_cuda_weight(kind, n, k) for _ in range(max(1, (256 << 20) // weight_bytes(w)))]
        x16 = act(16, k)
        ref = kc.linear(x16, w, config=BASE, spread=False)
        for cfg in CANDIDATES:
            got = kc.linear(x16, w, config=cfg, spread=False)
            one = kc.linear(x16[3:4], w, config=cfg, spread=False)
            diff = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
            times = []
            for spread in (False, True):
                for m in (1, 8):
                    x = x16[:m]
                    fns = [lambda w=c, x=x, cfg=cfg, s=spread: kc.linear(x, w, config=cfg, spread=s) for c in copies]
                    times.append(f"{'spread' if spread else 'one'}/M{m} {bench_graph(_rotating(fns)) * 1e3:6.1f}")
            print(f"{label:<10} {name(cfg):<14} bits differ {diff:>6}/{ref.numel()} row3 "
                  f"{'same' if torch.equal(one, ref[3:4]) else 'DIFF'} | " + " ".join(times), flush=True)
        del copies, w
        torch.cuda.empty_cache()
    for label, n, k, per_row in (("expert w1 slots", 2304, 5120, 6), ("expert w2 slots", 5120, 2304, 1)):
        banks = [kc.expert_bank([random_cuda_weight("fp4", n, k) for _ in range(48)]) for _ in range(3)]
        for rows in (1, 8):
            ids = torch.stack([torch.randperm(48)[:6] for _ in range(rows)]).cuda()
            x = act(rows * 6 // per_row, k)
            ref = kc.expert_linear(x, banks[0], ids, per_row, config=BASE)
            for cfg in CANDIDATES:
                got = kc.expert_linear(x, banks[0], ids, per_row, config=cfg)
                same = torch.equal(got, ref)
                fns = [lambda b=b, cfg=cfg, ids=ids, x=x, r=per_row: kc.expert_linear(x, b, ids, r, config=cfg)
                       for b in banks]
                print(f"{label:<16} rows {rows} {name(cfg):<14} {'same' if same else 'DIFF'} "
                      f"{bench_graph(_rotating(fns)) * 1e3:7.1f} us", flush=True)
        del banks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
