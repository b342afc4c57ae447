"""Experiment (no GPU needed): the launches of one decode step on the CUDA backend, counted on a CPU. The
CUDA kernels run under Triton's interpreter (with tests/interpreter_fixes.py) on CPU tensors, the model eager
(no CUDA graph): every Triton kernel call is one launch, every torch op that computes (not views, not
allocations) one more. Issue 22 asks for a few hundred launches a half-step at most; this counts them per
kernel and, for the torch ops, per line of dsflash that issued them, on a tiny checkpoint that has every V4.1
block type (launches a layer hardly depend on the widths).

`TRITON_INTERPRET=1 PYTHONPATH=$PWD:$PWD/tests python3 bench/experiments/launch_count.py [checkpoint]`
"""

import collections
import sys
import traceback
from pathlib import Path

import interpreter_fixes  # noqa: F401  (before any kernel runs)
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

import dsflash.model.transformer as transformer
from dsflash.engine.session import Engine
from dsflash.kernels import cuda

# torch ops that launch nothing on a GPU: views, metadata, allocations
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "permute", "transpose", "t",
             "select", "slice", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "narrow",
             "lift_fresh", "diagonal", "unflatten", "flatten", "_reshape_alias", "lift_fresh_copy",
             "_local_scalar_dense", "sym_size", "is_same_size", "view_as_real", "view_as_complex", "empty",
             "empty_like", "new_empty", "empty_strided"}


class Launches(TorchDispatchMode):
    """Counts the torch ops that compute, by (op, the dsflash line that issued it), and the Triton kernels by
    name; the interpreter's own torch ops inside a kernel are not counted."""

    def __init__(self):
        super().__init__()
        self.kernels, self.sites = collections.Counter(), collections.Counter()
        self.inside = False
        run = interpreter.GridExecutor.__call__

        def launch(executor, *args, **kwargs):
            self.kernels[executor.fn.__name__] += 1
            self.inside, was = True, self.inside
            try:
                return run(executor, *args, **kwargs)
            finally:
                self.inside = was

        interpreter.GridExecutor.__call__ = launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in NO_LAUNCH:
            line = next((f"{f.filename.split('/dsflash/')[1]}:{f.lineno}" for f in reversed(traceback.extract_stack())
                         if "/dsflash/" in f.filename), "?")
            self.sites[(name, line)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    from tests.conftest import TEXT_CASE

    case = sys.argv[1] if len(sys.argv) > 1 else TEXT_CASE
    k = cuda.kernels(torch.device("cpu"))
    transformer.load_kernels = lambda device, reference=False: k
    engine = Engine.load(case, cuda_graphs=False)
    s = engine.session()
    tok = int(s.prefill(list(range(3, 12))).argmax())
    s.step(s.pos, [tok])  # the first step after a prefill grows state buffers: count the second
    counter = Launches()
    with counter:
        s.step(s.pos, [tok])
    layers = engine.args.n_layers
    triton_total, torch_total = sum(counter.kernels.values()), sum(counter.sites.values())
    print(f"{Path(case).name}: {layers} layers, one decode step of one row (both halves, the head)")
    print(f"launches: {triton_total + torch_total} ({triton_total} Triton kernels, {torch_total} torch ops), "
          f"{(triton_total + torch_total) / layers:.0f} a layer")
    print("\nTriton kernels:")
    for name, n in counter.kernels.most_common():
        print(f"{n:6d}  {name}")
    print("\ntorch ops, by the line that issued them:")
    for (name, line), n in counter.sites.most_common():
        print(f"{n:6d}  {name:<14} {line}")


if __name__ == "__main__":
    main()
