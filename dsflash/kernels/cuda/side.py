"""Work beside the critical path (`Kernels.fork` / `Kernels.join`): a decode step is a chain of small kernels,
most of which fill a few SMs, and some of its work feeds only a later point of the chain (a site's mHC mixes,
which only the sub-layer's output needs; the shared expert, which only the MoE's sum needs). `fork` launches
such work on a side stream that first waits for everything the caller's stream has launched; `join` makes the
caller's stream wait for all of it. Captured in a CUDA graph the two become a branch and a join of the graph,
so a replay runs both chains at once. The kernels and their inputs are those of the call in place: the same
bits.

Memory: what the side stream allocates comes from its own part of the caching allocator (in a capture, the
graph's pool), and it reuses a freed block only in a later fork, behind that fork's wait for every kernel the
caller launched before it (the readers of the block included). Tensors the caller allocated and the forked work
reads must stay alive until `join` (the model's residual stream and the MoE's input do)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .configs import SIDE_MAX_ROWS

# off with `DSFLASH_SIDE_STREAMS=0` (everything in place on the caller's stream: the A/B of the bench and tests)
SIDE_STREAMS = os.environ.get("DSFLASH_SIDE_STREAMS", "1") == "1"

# one side stream per caller stream (the engine's halves and a graph capture each launch on their own), and the
# caller streams whose forked work no join has waited for yet: a join with nothing forked waits for nothing (a
# graph capture may not wait on work launched outside it, as a segment after one that joined would)
_SIDE: dict[int, torch.cuda.Stream] = {}
_FORKED: set[int] = set()


def fork(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) launched on the caller stream's side stream, after everything launched on the caller's; in place
    when its first tensor argument has more than SIDE_MAX_ROWS rows."""
    if next((a.size(0) for a in args if isinstance(a, torch.Tensor)), 0) > SIDE_MAX_ROWS:
        return fn(*args)
    caller = torch.cuda.current_stream()
    key = caller.cuda_stream
    side = _SIDE.get(key)
    if side is None:
        side = _SIDE[key] = torch.cuda.Stream(caller.device)
    side.wait_stream(caller)
    _FORKED.add(key)
    with torch.cuda.stream(side):
        return fn(*args)


def join() -> None:
    """The caller's stream waits for everything forked from it since the last join."""
    caller = torch.cuda.current_stream()
    if caller.cuda_stream in _FORKED:
        _FORKED.discard(caller.cuda_stream)
        caller.wait_stream(_SIDE[caller.cuda_stream])
