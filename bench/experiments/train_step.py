"""Host cost of one backbone training step (dsflash/train): seconds per step, and the aten ops one step
dispatches by phase (forward, backward, optimiser), compute ops apart from views and metadata ops: on a GPU
each compute op is about one kernel launch. Host reads count the ops that wait for the device on a GPU
(`.item()`, `bool()`, nonzero, unique).

`OMP_NUM_THREADS=1 python bench/experiments/train_step.py --data /work/main/.train-data --config trained
--seq-len 512` (the CPU proxy of the H200 run's per-step host overhead), or `--config smoke` (the tests').
"""

import argparse
import collections
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dsflash.model.transformer import Debug, Tokens
from dsflash.train import data
from dsflash.train.backend import TrainState
from dsflash.train.loop import Plan, Trainer, smoke_args, trained_args

METADATA = {"view", "t", "expand", "unsqueeze", "squeeze", "detach", "alias", "as_strided", "slice", "select",
            "permute", "transpose", "reshape", "_unsafe_view", "_reshape_alias", "split", "split_with_sizes",
            "unbind", "unflatten", "flatten", "view_as_real", "view_as_complex", "lift_fresh", "empty",
            "empty_like", "empty_strided"}
HOST_READS = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "masked_select"}


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase, self.ops = "forward", collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        kind = "host reads" if name in HOST_READS else "metadata" if name in METADATA else "compute"
        self.ops[(self.phase, kind)] += 1
        return func(*args, **(kwargs or {}))


def step(t: Trainer, opt: torch.optim.Optimizer, params: list, count: OpCount | None = None) -> None:
    with count if count is not None else contextlib.nullcontext():
        x, trace = t.window(), {}
        out = t.model().forward(TrainState(device=t.device), Tokens(x[:-1]), debug=Debug(trace=trace))
        loss = F.cross_entropy(out.logits, x[1:])
        if count is not None:  # Trainer._update's phases: the backward (and the clipping), then the optimiser's
            loss.register_hook(lambda g: setattr(count, "phase", "backward"))
            handle = opt.register_step_pre_hook(lambda *_: setattr(count, "phase", "optimiser"))
        t._update(opt, params, loss, trace)
        if count is not None:
            handle.remove()


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
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)  # the CUDA default
    step(t, opt, params)  # warm-up
    times = []
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        step(t, opt, params)
        times.append(time.perf_counter() - t0)
    count = OpCount()
    step(t, opt, params, count)
    print(f"config={ns.config} seq_len={ns.seq_len} step_s median={statistics.median(times):.3f} min={min(times):.3f}")
    for phase in ("forward", "backward", "optimiser"):
        print(f"  {phase}: " + ", ".join(f"{count.ops[(phase, k)]} {k}" for k in ("compute", "metadata", "host reads")))


if __name__ == "__main__":
    main()
