"""Encoder-only prefill speed and peak device memory by chunk size (rows per encoder forward).

Run on the GPU machine from the repository root: `python bench/experiments/prefill_chunk.py [LENGTH ...]`
(default 32768 and 131072 tokens). Chunking never changes bits (step == prefill, tested), so the chunk is a
pure speed/memory choice: larger chunks give each routed expert more rows per tile and fewer launches, and
cost activation and index-score memory in proportion.
"""

import sys
import time

import torch

from dsflash.bench.model import build_engine, prompt
from dsflash.config import preset

CHUNKS = (4096, 8192, 16384)


def main() -> None:
    lengths = [int(a) for a in sys.argv[1:]] or [32768, 131072]
    engine = build_engine(preset("bench", 48), "cuda")
    for chunk in CHUNKS:  # compile every chunk's kernels first: they must not count
        engine.session().prefill(prompt(chunk, engine.args.vocab_size), chunk=chunk)
    torch.cuda.synchronize()
    print("| tokens | chunk | tok/s | peak GiB |\n|---:|---:|---:|---:|")
    for n in lengths:
        ids = prompt(n, engine.args.vocab_size)
        for chunk in CHUNKS:
            s = engine.session()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            s.prefill(ids, chunk=chunk)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(f"| {n} | {chunk} | {n / dt:,.0f} | {torch.cuda.max_memory_allocated() / 2**30:.1f} |", flush=True)
            del s


if __name__ == "__main__":
    main()
