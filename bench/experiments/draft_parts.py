"""Experiment: where a warm DSpark cycle's time goes on a GPU. After a plain decode has captured the CUDA graphs,
one session at one position times (median of --reps, each ended by a read-back as decoding's sampler ends it)
a plain step of one row, a verify step of 1 + depth rows, the draft (the context write of the rows since the
last draft, the stages and head, the Markov chain) and its context write alone, then profiles a few drafts with
torch.profiler: the host-side ops by total time and the counts of launches, graph replays and synchronisations.

`PYTHONPATH=$PWD python3 bench/experiments/draft_parts.py [--model DIR] [--depth 4]`
"""

import argparse
import statistics
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from dsflash.bench.drafts import python_prompts
from dsflash.checkpoint.builtin import HELDOUT, TRAINED
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import decode


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls, each synchronised."""
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(TRAINED))
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--device", default="cuda")
    ns = p.parse_args()
    engine = Engine.load(ns.model, device=ns.device)
    with np.load(TRAINED / HELDOUT) as f:
        (ids,) = python_prompts(f["code"], 1, 256)
    for k in (0, ns.depth):  # captures every graph a decode at this depth uses
        s = engine.session()
        list(decode(s, s.prefill(ids), 48, SamplingParams(), stop=set(), dspark=k, adaptive=False))
        s.close()
    s = engine.session()
    s.prefill(ids)
    p0, tok = s.pos, ids[-1]
    drafts = s.draft(tok)[: ns.depth]
    rows = [tok] + drafts

    def step(n: int):
        return lambda: int(s.step(p0, rows[:n])[0].argmax())

    def draft():
        s.state.dspark_pos = p0 - 1  # the row the last verify added: a context write of one row, as in decoding
        s.draft(tok)

    def write():
        positions = torch.arange(p0 - 1, p0, device=s.device)
        s.decoder.write_context(s.state, s._main_hidden.read(positions), p0 - 1)

    for name, fn in (("plain step (1 row)", step(1)), (f"verify step ({len(rows)} rows)", step(len(rows))),
                     ("draft incl. context write", draft), ("context write of 1 row", write)):
        fn()
        print(f"{name}: {timed(fn, ns.reps):.3f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            draft()
        sync()
    table = prof.key_averages()
    print(table.table(sort_by="cpu_time_total", row_limit=30))
    for op in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch", "cudaStreamSynchronize", "cudaMemcpyAsync",
               "aten::item"):
        n = sum(e.count for e in table if e.key == op)
        print(f"{op}: {n / 10:.1f} a draft")


if __name__ == "__main__":
    main()
