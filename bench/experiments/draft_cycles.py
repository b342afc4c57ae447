"""Each DSpark decode cycle's depth, wall time and accepted drafts, as DraftDepth (engine/spec.py) records them,
beside plain decoding of the same prompts: where a drafted decode's time goes (warm-up cycles, recaptures
after a switch of depth, warm cycles by depth).

`PYTHONPATH=$PWD python3 bench/experiments/draft_cycles.py dsflash/checkpoint/trained cuda
dsflash/checkpoint/trained/heldout.npz`
"""

import argparse
import time

import numpy as np

from dsflash.bench.drafts import python_prompts
from dsflash.engine import spec
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("device")
    p.add_argument("heldout")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    ns = p.parse_args()
    engine = Engine.load(ns.model, device=ns.device)
    with np.load(ns.heldout) as f:
        prompts = python_prompts(f["code"], ns.prompts, 256)
    cycles = []

    class Recorded(spec.DraftDepth):
        def record(self, k: int, seconds: float, accepted: int) -> None:
            cycles.append((k, round(seconds * 1e3, 2), accepted))
            super().record(k, seconds, accepted)

    spec.DraftDepth = Recorded
    for ids in prompts:
        for k in (ns.depth, 0):
            s = engine.session()
            first = s.prefill(ids)
            cycles.clear()
            t0 = time.perf_counter()
            list(spec.decode(s, first, ns.tokens, SamplingParams(), stop=set(), dspark=k))
            print(f"dspark={k}: {time.perf_counter() - t0:.3f} s", cycles if k else "")


if __name__ == "__main__":
    main()
