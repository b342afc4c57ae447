"""Whether this machine's CPU stack computes the golden arrays' bits (docs/numerics.md, "CPU stacks").

The golden arrays are DeepSeek's reference forward run on one CPU stack. Our CPU backend computes the
reference's arithmetic (DeepSeek's reference run on this machine gives our bits exactly), but some of the
reference's own bits depend on the stack: MKL's GEMM kernels differ by CPU. The one place measured to matter
on the public cases is the router's fp32 GEMM (x @ gate.weight^T, N = 4 experts): its logits, hence the routing
weights, come out one fp32 ulp apart on some rows, and a weight one ulp off moves a bf16 rounding now and then.
The reference recorded those weights (`full.moe_expert_weights`), so they tell whether this stack sums the
router as the golden machine did: where every weight is identical, FAITHFUL is owed; where some are not, the
routing weights must be within MAX_ROUTER_ULPS of the reference's (on the layers whose input the engine
reproduces bit for bit) and, with the reference's weights replayed, everything else must be bit-identical
(FAITHFUL). Text cases only (an image case's replay needs its image rows)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsflash.golden.adapter import GoldenEngine, selections_from_arrays
from dsflash.golden.case import load_case, replay_selections
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Debug

FAITHFUL_LOGITS_ABS = 1e-5  # the golden FAITHFUL rule's allowance on the logits (the head's summation order)
# another summation order of the router's 256-term fp32 dot products moves a routing weight by a few ulps
# (measured on an AVX-512/AMX Xeon: at most 2 on tinyA_s0_T40, 3 on tinyA-w128_s1_T200's layer 0); a wrong
# router formula moves them by far more
MAX_ROUTER_ULPS = 4


@dataclass(frozen=True)
class RouterProbe:
    differ: int  # routing weights (layer, row, pick) of the replay that are not the reference's, all layers
    total: int
    max_ulps: int  # the largest distance in fp32 ulps, over the layers whose input is bit-identical
    layers: int  # how many layers that is (the leading ones)

    @property
    def reproduced(self) -> bool:
        return self.differ == 0

    def reason(self) -> str:
        return (f"this CPU stack does not sum the router's fp32 GEMM as the golden arrays' machine did: "
                f"{self.differ} of {self.total} replayed routing weights differ from the reference's (at most "
                f"{self.max_ulps} ulp on the first {self.layers} layers, whose inputs are bit-identical), so "
                f"FAITHFUL is not owed; PASS is, and FAITHFUL with the reference's routing weights replayed")


def _forward(case_dir: Path, weights: bool, trace: dict | None = None):
    case = load_case(case_dir)
    assert "full.token_types" not in case.golden, f"{case_dir} is an image case"
    select = selections_from_arrays(replay_selections(case, "full.", weights=weights))
    ids = torch.from_numpy(case.golden["full.input_ids"]).long()
    return GoldenEngine(case_dir).model.forward(SequenceState(), ids, debug=Debug(select, trace)), case.golden


@functools.cache
def router_probe(case_dir: Path) -> RouterProbe:
    """The engine's routing weights in replay mode against the reference's (a text case)."""
    trace: dict = {}
    _, g = _forward(case_dir, weights=False, trace=trace)
    ref = g["full.moe_expert_weights"]
    ours = np.stack([trace["moe_weights"][layer].numpy() for layer in range(len(ref))])
    # a layer's input is the output of the layer below; without per-layer arrays only layer 0's is known
    streams = g.get("full.layer_out_streams_bf16bits")
    layers = 1
    while streams is not None and layers < len(ref):
        out = trace["layer_out"][layers - 1][0].contiguous().view(torch.int16).numpy().view(np.uint16)
        if not np.array_equal(out, streams[layers - 1]):
            break
        layers += 1
    ulps = np.abs(ours[:layers].view(np.int32).astype(np.int64) - ref[:layers].view(np.int32).astype(np.int64))
    return RouterProbe(int((ours != ref).sum()), ref.size, int(ulps.max()), layers)


def replay_outputs(case_dir: Path, weights: bool) -> dict[str, np.ndarray]:
    """Logits and hand-off of the replay (selections forced), with the reference's routing weights when
    `weights`."""
    out, _ = _forward(case_dir, weights)
    return {"logits": out.logits.numpy(), "handoff_streams": out.handoff_streams.float().numpy(),
            "handoff_pre_mix": out.handoff_pre_mix.numpy()}


def assert_faithful(out: dict[str, np.ndarray], g: dict) -> None:
    """The golden FAITHFUL rule's replay half: hand-off and pre-mix bit-identical, logits within 1e-5."""
    assert np.array_equal(out["handoff_streams"], g["full.handoff_streams"])
    assert np.array_equal(out["handoff_pre_mix"], g["full.handoff_pre_mix"])
    assert float(np.abs(out["logits"].astype(np.float64) - g["full.logits"]).max()) <= FAITHFUL_LOGITS_ABS


def load_golden(case_dir: Path) -> dict:
    return load_case(case_dir).golden
