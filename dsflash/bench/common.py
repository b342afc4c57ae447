"""What the engine benchmarks share: device syncs around timings, interleaved timed rounds, seeded prompts,
and the machine and commit every result names."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(fns: dict[object, Callable[[], None]], device: torch.device, reps: int,
                 warmup_s: float = 0.0, warmup: int = 2) -> dict[object, float]:
    """Median wall ms of each fn, device work included, timed in `reps` rounds that each run every fn once:
    a machine that speeds up during the run (a freshly started one measured up to 5 ms slower per step at
    first) then shifts every fn alike, and differences between them (the back step) stay fair. Untimed
    rounds first: `warmup` (the first call compiles, the second captures the CUDA graphs), then more until
    `warmup_s` seconds have passed."""
    start, rounds = time.perf_counter(), 0
    while rounds < warmup or time.perf_counter() - start < warmup_s:
        for fn in fns.values():
            fn()
        rounds += 1
    times: dict[object, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1000)
    return {name: statistics.median(v) for name, v in times.items()}


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab - 2, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def machine(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def command(argv: list[str], program: str = "dsflash bench") -> str:
    """The command that reproduces a result, with the environment switches that change the kernels' launches
    (kernels/cuda/common.py) in front."""
    switches = [f"{name}={os.environ[name]}" for name in ("DSFLASH_PDL",) if os.environ.get(name)]
    return " ".join([*switches, program, *argv])


def commit() -> str:
    if os.environ.get("DSFLASH_COMMIT"):
        return os.environ["DSFLASH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
