"""A training window's forward and backward as one CUDA graph (`CapturedStep`).

On the H200 a backbone step of the shipped model's width is host-bound: ~19,000 small kernels a step, each
launched from Python, leave the GPU idle a quarter of the time (docs/perf-record.md). A window's shapes are the
same every step (seq_len rows, fixed top-k widths, the MoE's grouped rows padded to a fixed count), its forward
reads nothing back to the host, and the model built for it copies nothing from the host once the RoPE tables
and Engram layout are reused (model/transformer.py `HostTables`): so the whole window -- the model's build from
the masters (the casts and the fake quantisation of every weight), the forward, the losses and the backward
-- is captured once and replayed, the optimiser step staying eager in between. A replay launches the same
kernels on the same values as the eager window: the same bits (tests/test_train_cuda.py).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import torch


class CapturedStep:
    """`fn(**inputs)` -- device tensors of fixed shapes in, a tuple of tensors out, gradients left on `params`
    -- run eagerly on its first call (the warm-up: cuBLAS handles, the RoPE tables, the lazy buffers), captured
    on its second and replayed from then on. The outputs of a replay are the graph's own tensors, overwritten
    by the next replay; the gradients of a replay add to those already on `params` (as a backward's do), or
    become them. `before_capture` runs just before the capture (the masters' cached values forgotten, so the
    graph quantises the weights itself). Off CUDA, every call is eager."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], params: list[torch.Tensor],
                 before_capture: Callable[[], None] = lambda: None):
        self.fn, self.params, self.before_capture = fn, params, before_capture
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.failed = False

    def __call__(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls += 1
        on_cuda = all(t.device.type == "cuda" for t in inputs.values())
        if not on_cuda or self.calls == 1 or self.failed:
            return self.fn(**inputs)
        if self.graph is None:
            try:
                self._capture(inputs)
            except RuntimeError as e:  # a budgeted run goes on eagerly, and says why
                print(f"CUDA graph capture failed, windows run eagerly: {e}", file=sys.stderr, flush=True)
                self.failed, self.graph = True, None
                return self.fn(**inputs)
        for p, g in self.grads:  # gradients a replay of this step left aliased: kept from the next one
            if p.grad is g:
                p.grad = g.clone()
        for name, t in inputs.items():
            self.inputs[name].copy_(t)
        self.graph.replay()
        for p, g in self.grads:
            if p.grad is None:  # aliased until the optimiser has read it, or another replay comes first
                p.grad = g
            else:
                p.grad.add_(g)
        return self.outputs

    def _capture(self, inputs: dict[str, torch.Tensor]) -> None:
        held = [p.grad for p in self.params]
        for p in self.params:  # the backward allocates the gradients in the graph's memory
            p.grad = None
        try:
            self.inputs = {name: t.clone() for name, t in inputs.items()}
            self.before_capture()
            # an earlier forward's autograd nodes still alive (a model in a reference cycle) would tie the
            # captured backward to the stream they were made on
            gc.collect()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self.fn(**self.inputs)
            self.grads = [(p, p.grad) for p in self.params if p.grad is not None]
        finally:
            for p, g in zip(self.params, held, strict=True):
                p.grad = g
