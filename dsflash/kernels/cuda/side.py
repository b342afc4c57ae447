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
import threading
from collections.abc import Callable
from typing import Any

import torch

from .configs import SIDE_MAX_ROWS

# off with `DSFLASH_SIDE_STREAMS=0` (everything in place on the caller's stream: the A/B of the bench and tests)
SIDE_STREAMS = os.environ.get("DSFLASH_SIDE_STREAMS", "1") == "1"

# per thread (two threads may each run a forward on one device, the model halves of one process: a thread's
# current stream is its own, but the legacy default stream is every thread's): a side stream per caller stream
# and lane (forks of different lanes run beside each other and are joined apart), and the (caller, lane) pairs
# whose forked work no join has waited for yet. A join with nothing forked waits for nothing (a graph capture
# may not wait on work launched outside it, as a segment after one that joined would)
_LOCAL = threading.local()


def _state() -> tuple[dict[tuple[int, int], torch.cuda.Stream], set[tuple[int, int]]]:
    if not hasattr(_LOCAL, "side"):
        _LOCAL.side, _LOCAL.forked = {}, set()
    return _LOCAL.side, _LOCAL.forked


def fork(fn: Callable[..., Any], *args: Any, lane: int = 0) -> Any:
    """fn(*args) launched on the side stream of the caller's stream and `lane`, after everything launched on
    the caller's; in place when its first tensor argument has more than SIDE_MAX_ROWS rows."""
    if next((a.size(0) for a in args if isinstance(a, torch.Tensor)), 0) > SIDE_MAX_ROWS:
        return fn(*args)
    sides, forked = _state()
    caller = torch.cuda.current_stream()
    key = (caller.cuda_stream, lane)
    side = sides.get(key)
    if side is None:
        side = sides[key] = torch.cuda.Stream(caller.device)
    side.wait_stream(caller)
    forked.add(key)
    with torch.cuda.stream(side):
        return fn(*args)


def join(lane: int = 0) -> None:
    """The caller's stream waits for everything this thread forked from it in `lane` since that lane's last
    join."""
    sides, forked = _state()
    caller = torch.cuda.current_stream()
    key = (caller.cuda_stream, lane)
    if key in forked:
        forked.discard(key)
        caller.wait_stream(sides[key])
