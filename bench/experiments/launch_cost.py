"""Host cost of a CUDA graph launch by node count, and a box step's host (enqueue) time against its wall time.

Run on the GPU machine from the repository root: `python bench/experiments/launch_cost.py`. Answers whether
a step pair is host-bound after the layer runs were captured (perf-record, seventh pass): if a graph's
launch costs the host time in proportion to its kernels, fewer and larger graphs do not cut the launch
cost, only the eager work between them.
"""

import statistics
import time

import torch

from dsflash.bench.model import build_engine, prompt
from dsflash.config import preset


def graph_launch_us(nodes: int, reps: int = 50) -> float:
    x = torch.zeros(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(nodes):
            x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    for nodes in (1, 10, 100, 300, 1000):
        print(f"graph of {nodes:5d} kernels: launch {graph_launch_us(nodes):8.1f} µs of host time")
    import dataclasses
    args = dataclasses.replace(preset("bench"), n_routed_experts=48)
    engine = build_engine(args, "cuda")
    s = engine.session()
    s.prefill(prompt(2048, args.vocab_size))
    keep = s.pos
    enc = s.encoder
    new = prompt(1, args.vocab_size, seed=1)
    for _ in range(5):
        list(enc.append(new, keep, 8, 1))
        enc.rollback(keep)
    torch.cuda.synchronize()
    ids = torch.tensor(new, device="cuda")
    host, wall = [], []
    for _ in range(15):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc.runner.forward(enc.state, ids)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
        enc.rollback(keep)
    print(f"box forward of 1 row at 2K: host enqueue {statistics.median(host):.2f} ms, "
          f"wall {statistics.median(wall):.2f} ms")


def host_profile() -> None:
    """cProfile of the box forward's host side (where the enqueue time goes), by cumulative and own time."""
    import cProfile
    import dataclasses
    import pstats

    args = dataclasses.replace(preset("bench"), n_routed_experts=48)
    engine = build_engine(args, "cuda")
    s = engine.session()
    s.prefill(prompt(2048, args.vocab_size))
    keep, enc = s.pos, s.encoder
    ids = torch.tensor(prompt(1, args.vocab_size, seed=1), device="cuda")
    for _ in range(5):
        enc.runner.forward(enc.state, ids)
        enc.rollback(keep)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(5):
        prof.enable()
        enc.runner.forward(enc.state, ids)
        prof.disable()
        torch.cuda.synchronize()
        enc.rollback(keep)
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    import sys

    host_profile() if sys.argv[1:] == ["host"] else main()
