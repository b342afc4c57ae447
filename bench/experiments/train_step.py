"""Host cost of one backbone training step (dsflash/train): seconds per step, and the aten ops one step
dispatches (torch.profiler on the CPU: a proxy for the CUDA kernel launches), with the ops that read the
device back to the host (`aten::_local_scalar_dense`: `.item()`, `bool()`, `.tolist()`) counted apart.

`OMP_NUM_THREADS=1 python bench/experiments/train_step.py --data /work/main/.train-data --config trained
--seq-len 512` (the CPU proxy of the H200 run's per-step host overhead), or `--config smoke` (the tests').
"""

import argparse
import collections
import statistics
import time

import torch
import torch.nn.functional as F

from dsflash.model.transformer import Debug, Tokens
from dsflash.train import data
from dsflash.train.backend import TrainState
from dsflash.train.loop import Plan, Trainer, smoke_args, trained_args


def step(t: Trainer, opt: torch.optim.Optimizer, params: list) -> None:
    x, trace = t.window(), {}
    out = t.model().forward(TrainState(device=t.device), Tokens(x[:-1]), debug=Debug(trace=trace))
    t._update(opt, params, F.cross_entropy(out.logits, x[1:]), trace)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True)
    p.add_argument("--config", choices=("smoke", "trained"), default="trained")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    ns = p.parse_args()
    token_map, classes = data.load_engram_map(ns.data)
    args = (smoke_args if ns.config == "smoke" else trained_args)(len(token_map), classes)
    train = data.load_tokens(ns.data, "test")  # any tokens do: the step's cost does not depend on them
    t = Trainer(args, token_map, train, train, Plan(seq_len=ns.seq_len), ns.device)
    params = t.masters.trainable()
    opt = torch.optim.AdamW(params, lr=1e-3)
    step(t, opt, params)  # warm-up
    times = []
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        step(t, opt, params)
        times.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(t, opt, params)
    counts = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    print(f"config={ns.config} seq_len={ns.seq_len} step_s median={statistics.median(times):.3f} "
          f"min={min(times):.3f} aten_ops={sum(counts.values())} host_reads={counts['aten::_local_scalar_dense']} "
          f"nonzero={counts['aten::nonzero']} index_put={counts['aten::index_put_']} copy_={counts['aten::copy_']}")
    print("top ops:", ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in counts.most_common(16)))


if __name__ == "__main__":
    main()
