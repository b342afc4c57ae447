"""CUDA graphs for the static parts of a short forward (decode steps, drafts, verification).

The model describes a segment of its work (`dsflash.model.common.Replayer`: a function of tensors alone
and a key naming everything it reads in place); this store captures it once per key (and input shapes)
and replays it: a replay runs the same kernels on the same shapes as the eager call, so the bits are those
of the eager forward. A short forward of the backbone is one segment, its state read and written in place
(model/transformer.py); so is a DSpark draft's stages and head once a whole window of context exists
(model/dspark.py). Graphs that read a session's state name its tensors by address and size in their keys:
a session on the buffers an ended one held (model/state.StatePool) replays that one's graphs.

Lifetime rules: a replay overwrites its outputs, so a forward copies out what it returns; graphs read
the RoPE tables by address, so they are dropped when a table grows (`begin`). One forward at a time per
model half: engine/runner.py holds the lock.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

GRAPH_MAX_ROWS = 8  # forwards of up to this many rows (padding included) replay captured segments
# graphs kept, the least recently replayed dropped first: a forward's graph reads its session's state by
# address, so each session (and each growth of its buffers) has graphs of its own, which ended sessions and
# outgrown buffers would otherwise leave behind. Safe to drop any one: no graph reads another's outputs
GRAPH_MAX_KEPT = 256


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


class SegmentGraphs:
    """One model's captured segments, keyed by the caller's key and the inputs' shapes; see the module
    docstring."""

    def __init__(self, max_rows: int = GRAPH_MAX_ROWS, max_kept: int = GRAPH_MAX_KEPT, capture: bool = True):
        # capture=False runs every segment directly, on the shapes a graph would have (any backend): for
        # telling a capture problem from an arithmetic one, and for testing the graphed arithmetic on a CPU
        self.max_rows, self.max_kept, self.capture = max_rows, max_kept, capture
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()  # least recently replayed first
        self._warm: OrderedDict[Hashable, tuple[torch.Tensor, ...]] = OrderedDict()
        self._pools: dict[int, tuple] = {}
        self._epoch: Hashable = None
        self.captures = 0  # graphs captured so far (what a workload cost in captures)

    def begin(self, rows: int, epoch: Hashable, eligible: bool = True) -> bool:
        """Start a forward of `rows` rows; `epoch` names everything the graphs read by address besides
        weights (the RoPE tables' versions); `eligible` is False for forwards whose segments read more
        than their tensor inputs (traces, forced selections, image routing). Returns whether this
        forward replays graphs."""
        if epoch != self._epoch:
            self._graphs.clear()
            self._warm.clear()
            self._epoch = epoch
        return eligible and rows <= self.max_rows

    def run(self, key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
        """fn(*inputs) (a tuple of tensors), from a graph. The first call of a key runs eagerly on the
        inputs' future static copies (compiling kernels for exactly the alignments the capture will
        see); the second captures; later calls replay, the inputs copied into the static ones."""
        if not self.capture:
            return fn(*inputs)
        key = (key, tuple(t.shape for t in inputs))
        entry = self._graphs.get(key)
        if entry is None:
            static = self._warm.pop(key, None)
            if static is None:
                static = tuple(t.clone() for t in inputs)
                self._warm[key] = static
                if len(self._warm) > self.max_kept:
                    self._warm.popitem(last=False)
                return fn(*static)
            entry = self._capture(key, fn, static, inputs[0].size(0))
            if len(self._graphs) > self.max_kept:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        for dst, src in zip(entry.inputs, inputs, strict=True):
            dst.copy_(src)
        entry.graph.replay()
        return entry.outputs

    def _capture(self, key: Hashable, fn: Callable, static: tuple[torch.Tensor, ...], rows: int) -> _Captured:
        # one memory pool per row count: a forward replays one graph and copies out what it returns before
        # another graph of the pool runs, so graphs may share the memory of each other's intermediates
        pool = self._pools.get(rows)
        if pool is None:
            pool = self._pools[rows] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other engine thread may run CUDA work meanwhile (another model half).
        # No garbage collection inside: a collected cycle holding an earlier model's graphs frees their
        # memory pool, a call a capture may not make (the suspected cause of one failed capture in ~20 GPU
        # test runs: "operation failed due to a previous error during capture")
        with _no_gc(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = fn(*static)
        entry = self._graphs[key] = _Captured(graph, static, tuple(outputs))
        self.captures += 1
        return entry


@contextmanager
def _no_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
