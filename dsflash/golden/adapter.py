"""The engine as `dsflash check-golden` drives it: one fresh sequence per prefill, selections forced
through the engine's general override facility (replay) or chosen by its own lowest-index rule. Image
cases: the vision tower fed the stored pixel tensors, then one prefill with the token types and the
aligner rows (the merged input rows, Engram hash ids and router picks read from the forward's trace)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dsflash.model.common import Selections
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Debug, Tokens


def selections_from_arrays(sel: dict) -> Selections:
    return Selections(
        index_topk={int(k): torch.from_numpy(np.asarray(v)).long() for k, v in sel["index_topk"].items()},
        moe_ids={layer: torch.from_numpy(np.asarray(v)).long() for layer, v in enumerate(sel["moe_expert_ids"])},
        moe_weights={layer: torch.from_numpy(np.asarray(v)).float()
                     for layer, v in enumerate(sel.get("moe_expert_weights", ()))},
    )


class GoldenEngine:
    def __init__(self, case_dir: str | Path, device: str = "cpu"):
        self.model = load_model(case_dir, device=device)
        self.device = self.model.device

    def prefill(self, ids: np.ndarray, selections: dict | None) -> dict[str, np.ndarray]:
        select = selections_from_arrays(selections) if selections is not None else None
        ids = torch.from_numpy(np.asarray(ids)).long().to(self.device)
        trace: dict = {}
        out = self.model.forward(SequenceState(device=self.device), ids, debug=Debug(select, trace))
        weights = trace["moe_weights"]
        return {
            "logits": out.logits.cpu().numpy(),
            "handoff_streams": out.handoff_streams.float().cpu().numpy(),
            "handoff_pre_mix": out.handoff_pre_mix.cpu().numpy(),
            # the router's weights per layer, in its own order (the reference's full.moe_expert_weights)
            "moe_expert_weights": torch.stack([weights[i] for i in sorted(weights)]).float().cpu().numpy(),
        }

    def encode_image(self, pixels: np.ndarray, n_vit_h: int, n_vit_w: int) -> dict[str, np.ndarray]:
        """One image's ViT and aligner rows from its (stored) pixel tensor [n_patch, 3, p, p]."""
        if self.model.vision is None:
            raise NotImplementedError("the model has no vision tower")
        vit_out, aligner_out = self.model.vision.encode(torch.from_numpy(np.asarray(pixels, np.float32)),
                                                        int(n_vit_h), int(n_vit_w))
        return {"vit_out": vit_out.float().cpu().numpy(), "aligner_out": aligner_out.float().cpu().numpy()}

    def prefill_image(self, ids: np.ndarray, token_types: np.ndarray, image_rows: np.ndarray,
                      selections: dict | None) -> dict[str, np.ndarray]:
        """One prefill of an image sequence at start_pos 0 from a fresh state: ids and token_types [S], image_rows
        [number of IMAGE positions, dim] (the aligner rows of every image, in span order). Returns the prefill
        arrays plus "input_embeds" [S, dim] (the merged input rows), "engram_hash_ids" [S, n_engram, cols],
        "moe_expert_ids" [L, S, k] (the router picks, forced ones in replay) and "moe_expert_weights" [L, S, k]
        (their routing weights)."""
        select = selections_from_arrays(selections) if selections is not None else None
        dev = self.device
        trace: dict = {}
        x = Tokens(torch.from_numpy(np.asarray(ids)).long().to(dev),
                   torch.from_numpy(np.asarray(token_types)).long().to(dev),
                   torch.from_numpy(np.asarray(image_rows, np.float32)).to(device=dev, dtype=torch.bfloat16))
        out = self.model.forward(SequenceState(device=dev), x, debug=Debug(select, trace))
        moe, weights = trace["moe_ids"], trace["moe_weights"]
        result = {
            "logits": out.logits.cpu().numpy(),
            "handoff_streams": out.handoff_streams.float().cpu().numpy(),
            "handoff_pre_mix": out.handoff_pre_mix.cpu().numpy(),
            "input_embeds": trace["input_embeds"].float().cpu().numpy(),
            "moe_expert_ids": torch.stack([moe[i] for i in sorted(moe)]).cpu().numpy(),
            "moe_expert_weights": torch.stack([weights[i] for i in sorted(weights)]).cpu().numpy(),
        }
        if "engram_hash_ids" in trace:
            result["engram_hash_ids"] = trace["engram_hash_ids"].cpu().numpy()
        return result

    def draft(self, prefill_main_hidden: np.ndarray, anchors: np.ndarray, ctx_rows: np.ndarray,
              start_pos: np.ndarray) -> np.ndarray:
        dspark, dev = self.model.dspark, self.device
        state = SequenceState(device=dev)
        hidden = torch.from_numpy(prefill_main_hidden).to(device=dev, dtype=torch.bfloat16)
        dspark.write_context(state, hidden, 0)
        out = []
        for anchor, row, pos in zip(anchors, ctx_rows, start_pos, strict=True):
            row = torch.from_numpy(row).to(device=dev, dtype=torch.bfloat16).unsqueeze(0)
            dspark.write_context(state, row, int(pos))
            out.append(dspark.draft(state, int(anchor))[1].cpu().numpy())
        return np.stack(out)
