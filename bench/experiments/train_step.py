"""Cost of one backbone training step (dsflash/train): seconds per step, the aten ops one step dispatches by
phase (forward, backward, optimiser; compute ops apart from views and metadata ops: on a GPU each compute op
is about one kernel launch), and with `--profile` torch.profiler's table of the step's device time by op
with the device's busy time beside the wall time (host-bound or device-bound, and where).

`OMP_NUM_THREADS=1 python bench/experiments/train_step.py --data /work/main/.train-data --config trained
--seq-len 512` (a CPU proxy of the host overhead), or on the H200 `--device cuda --seq-len 16384 --profile`;
`--cuda-select` A/Bs the CUDA backend's selection kernels in the trainer (issue 21's next speed-up).
"""

import argparse
import collections
import dataclasses
import functools
import statistics
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsflash.train import data
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


def labelled(fn, name: str):
    """fn inside a profiler range of its name (the forward's device time by kernel-record entry)."""
    @functools.wraps(fn)
    def call(*a, **kw):
        with torch.profiler.record_function("k." + name):
            return fn(*a, **kw)
    return call


class HostCopies(TorchDispatchMode):
    """Every op of a GPU step that copies from the host or reads back to it (what a CUDA graph cannot
    capture), with where in dsflash it was called from."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        to_gpu = name in ("_to_copy", "copy_") and any(a.device.type == "cpu" and a.numel() > 1 or
                                                       a.device.type == "cpu" and name == "_to_copy"
                                                       for a in tensors[-1:]) and (
            (kwargs or {}).get("device", None) is not None or any(a.device.type == "cuda" for a in tensors[:1]))
        if to_gpu or name in HOST_READS:
            stack = [f"{f.filename.split('dsflash/')[-1]}:{f.lineno}" for f in traceback.extract_stack()
                     if "/dsflash/" in f.filename][-3:]
            self.sites[(name, " < ".join(reversed(stack)))] += 1
        return func(*args, **(kwargs or {}))


def window(t: Trainer) -> None:
    """One eager backbone window (Trainer.window_loss: no answers, the last 256 rows as the indexer's)."""
    n = t.plan.seq_len
    t.window_loss(t.window()[0], torch.zeros(n, device=t.device), torch.arange(n - 256, n, device=t.device), False)


def step(t: Trainer, opt: torch.optim.Optimizer, params: list) -> None:
    """Trainer.backbone's step body (one window, the indexer's picks)."""
    loss, kl, loads, _ = t.backbone_window(1.0, 0, False)
    t._update(opt, params, loads)
    if t.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True)
    p.add_argument("--config", choices=("smoke", "trained"), default="trained")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rows", type=int, default=40, help="ops in the profile's table")
    p.add_argument("--compile", default="", help="kernel-record entries to wrap in torch.compile, comma-separated")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (Plan.graphs)")
    p.add_argument("--cuda-select", action="store_true",
                   help="the CUDA backend's index scores and candidate blocks in the forward's selection, which no "
                        "gradient flows through (other picks' bits than the reference's; with TRITON_INTERPRET=1 on "
                        "a CPU too)")
    p.add_argument("--host-copies", action="store_true", help="list the eager window's host copies and reads")
    ns = p.parse_args()
    token_map, classes = data.load_engram_map(ns.data)
    args = (smoke_args if ns.config == "smoke" else trained_args)(len(token_map), classes)
    train = data.load_tokens(ns.data, "validation")  # any tokens do: the step's cost does not depend on them
    t = Trainer(args, token_map, train, train, Plan(seq_len=ns.seq_len, fact_span=0, graphs=not ns.eager), ns.device)
    compiled = {n: torch.compile(getattr(t.k, n)) for n in ns.compile.split(",") if n}
    t.k = dataclasses.replace(t.k, **compiled)
    if ns.cuda_select:
        from dsflash.kernels import cuda

        t.k = dataclasses.replace(t.k, index_scores=torch.no_grad()(cuda.index_scores),
                                  candidate_blocks=cuda.candidate_blocks)
    params = t.masters.trainable()
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if ns.host_copies:
        with HostCopies() as found:
            window(t)
        print("host copies and reads in an eager window:")
        for (name, where), n in sorted(found.sites.items()):
            print(f"  {n:5d} {name:22s} {where}")
        opt.zero_grad(set_to_none=True)
    step(t, opt, params)  # warm-up (eager), then the capture
    times = []
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        step(t, opt, params)
        times.append(time.perf_counter() - t0)
    print(f"config={ns.config} seq_len={ns.seq_len} step_s median={statistics.median(times):.3f} "
          f"min={min(times):.3f} tokens/s={ns.seq_len / statistics.median(times):,.0f}", flush=True)
    if t.device.type == "cuda":
        print(f"  peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    count = OpCount()
    with count:
        window(t)
    print(f"  forward+backward: {count.ops[('forward', 'compute')]} compute ops, "
          f"{count.ops[('forward', 'host reads')]} host reads")
    opt.zero_grad(set_to_none=True)
    if ns.profile:
        fields = [f.name for f in dataclasses.fields(t.k) if callable(getattr(t.k, f.name)) and f.name != "weight"]
        t.k = dataclasses.replace(t.k, **{n: labelled(getattr(t.k, n), n) for n in fields})
        acts = [torch.profiler.ProfilerActivity.CPU]
        if t.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            step(t, opt, params)
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        key = "self_device_time_total" if t.device.type == "cuda" else "self_cpu_time_total"
        busy = sum(getattr(e, key) for e in events) / 1e6
        kernels = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        syncs = sum(e.count for e in events if "Synchronize" in e.key)
        print(f"  profiled step: wall {wall:.3f} s, device busy {busy:.3f} s, {kernels} launches, {syncs} syncs")
        print(events.table(sort_by=key, row_limit=ns.rows, max_name_column_width=60))
        ranges = sorted((e for e in events if e.key.startswith("k.")), key=lambda e: -e.device_time_total
                        if t.device.type == "cuda" else -e.cpu_time_total)
        print("forward by kernel-record entry (device total, calls):")
        for e in ranges:
            total = e.device_time_total if t.device.type == "cuda" else e.cpu_time_total
            print(f"  {e.key:28s} {total / 1e3:9.1f} ms {e.count:6d}")


if __name__ == "__main__":
    main()
