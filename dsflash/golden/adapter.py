"""The engine as `dsflash check-golden` drives it: one fresh sequence per prefill, selections forced
through the engine's general override facility (replay) or chosen by its own lowest-index rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dsflash.engine.state import SequenceState
from dsflash.model.common import Selections
from dsflash.model.load import load_model


def selections_from_arrays(sel: dict) -> Selections:
    return Selections(
        index_topk={int(k): torch.from_numpy(np.asarray(v)).long() for k, v in sel["index_topk"].items()},
        moe_ids={layer: torch.from_numpy(np.asarray(v)).long() for layer, v in enumerate(sel["moe_expert_ids"])},
    )


class GoldenEngine:
    def __init__(self, case_dir: str | Path, device: str = "cpu"):
        self.model = load_model(case_dir, device=device)
        self.device = self.model.device

    def prefill(self, ids: np.ndarray, selections: dict | None) -> dict[str, np.ndarray]:
        select = selections_from_arrays(selections) if selections is not None else None
        ids = torch.from_numpy(np.asarray(ids)).long().to(self.device)
        out = self.model.forward(SequenceState(device=self.device), ids, select=select)
        return {
            "logits": out.logits.cpu().numpy(),
            "handoff_streams": out.handoff_streams.float().cpu().numpy(),
            "handoff_pre_mix": out.handoff_pre_mix.cpu().numpy(),
        }

    def draft(self, prefill_main_hidden: np.ndarray, anchors: np.ndarray, ctx_rows: np.ndarray,
              start_pos: np.ndarray) -> np.ndarray:
        dspark, dev = self.model.dspark, self.device
        state = SequenceState(device=dev)
        hidden = torch.from_numpy(prefill_main_hidden).to(device=dev, dtype=torch.bfloat16)
        dspark.write_context(state, hidden, torch.arange(hidden.size(0), device=dev))
        out = []
        for anchor, row, pos in zip(anchors, ctx_rows, start_pos, strict=True):
            row = torch.from_numpy(row).to(device=dev, dtype=torch.bfloat16).unsqueeze(0)
            dspark.write_context(state, row, torch.tensor([int(pos)], device=dev))
            out.append(dspark.draft(state, int(anchor))[1].cpu().numpy())
        return np.stack(out)
