"""A model half as the engine runs it: its forwards and DSpark drafts, short ones replayed from CUDA graphs
on the Triton backend (engine/graphs.py), one at a time."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

import torch

from dsflash.config import ModelArgs
from dsflash.engine.graphs import SegmentGraphs
from dsflash.model.state import SequenceState, StatePool
from dsflash.model.transformer import ForwardOutput, Streams, Tokens, Transformer


class Runner:
    def __init__(self, model: Transformer, cuda_graphs: bool = True, graphs: SegmentGraphs | None = None):
        """`cuda_graphs`: short forwards replay captured segments (the Triton backend only; with routed
        experts off the device, one segment per layer, the routing read on the host between them);
        `graphs` gives the store explicitly (e.g. `SegmentGraphs(capture=False)`: the graphed arithmetic,
        uncaptured)."""
        self.model = model
        if graphs is None and cuda_graphs and model.k.name == "cuda":
            graphs = SegmentGraphs()
        self.graphs = graphs
        # with graphs, a sequence's state comes from the buffers ended ones held (model/state.StatePool): the
        # graphs those captured read them by address, so the next sequence replays them instead of its own
        self.pool = StatePool() if graphs is not None else None
        # the server runs generations on two threads; a graph may only be replayed (and a RoPE table grown
        # under it) by one forward at a time
        self.lock: AbstractContextManager = threading.RLock() if graphs is not None else nullcontext()

    def state(self) -> SequenceState:
        """A new sequence's state on this half's device (and pool: give it back with `release`)."""
        return SequenceState(device=self.device, pool=self.pool)

    @property
    def args(self) -> ModelArgs:
        return self.model.args

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, state: SequenceState, x: Tokens | Streams | torch.Tensor, *, tail_only: bool = False
                ) -> ForwardOutput:
        with self.lock:
            return self.model.forward(state, x, tail_only=tail_only, graphs=self.graphs)

    def write_context(self, state: SequenceState, main_hidden: torch.Tensor, first: int) -> None:
        with self.lock, self.model.on_head():
            self.model.dspark.write_context(state, main_hidden, first, graphs=self.graphs)

    def draft(self, state: SequenceState, anchor: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        with self.lock, self.model.on_head():
            return self.model.dspark.draft(state, anchor, graphs=self.graphs)
