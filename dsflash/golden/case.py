"""Reader for one golden case directory (format: `shared/golden/README.md`, "Files in each case").

A case directory holds `config.json` (the reference's `ModelArgs` fields), `model.safetensors` (the tiny
checkpoint; read by the engine, only its presence is checked here), `golden.safetensors` (what the
reference forward computed; plain numpy dtypes) and `meta.json` (provenance and calibration numbers).

This is our own reader: the reference's `load_case.py` lives outside the package and is not installed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from dsflash.config import ModelArgs

FULL_PREFIXES = ("full.", "full_lowtie.")
BATTERY_PREFIXES = ("battery.", "battery_lowtie.")

# arrays every text case must hold for `dsflash check-golden` (the index_topk_L<i> arrays are checked per layer)
_ONE_SHOT_ARRAYS = ("logits", "handoff_streams", "handoff_pre_mix", "moe_expert_ids")
_TEXT_ARRAYS = (
    "prompt_ids", "continuation_ids", "full.input_ids", "battery.input_ids",
    "draft_logits", "draft_start_pos", "decode_next_ids", "prefill_dspark_main_hidden", "decode_dspark_main_hidden",
)
_IMAGE_ARRAYS = ("full.input_ids", "full.token_types")


class GoldenCaseError(Exception):
    """A golden case directory is unreadable or incomplete; the message says why."""


@dataclass(frozen=True)
class GoldenCase:
    path: Path
    config: dict  # config.json exactly as stored
    args: ModelArgs  # the same config as our dataclass
    meta: dict
    golden: dict[str, np.ndarray]

    @property
    def name(self) -> str:
        return str(self.meta.get("case", self.path.name))

    @property
    def is_image_case(self) -> bool:
        """Image cases (README "Image cases") are recognised by their token-type array."""
        return "full.token_types" in self.golden

    @property
    def index_source_layers(self) -> list[int]:
        """Backbone layers with their own indexer, i.e. the layers with stored `index_topk_L<i>` arrays."""
        return [i for i in self.args.index_source_layers if i < self.args.n_layers]


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise GoldenCaseError(f"missing {path.name}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GoldenCaseError(f"{path.name} unreadable: {e}") from e
    if not isinstance(value, dict):
        raise GoldenCaseError(f"{path.name}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_golden(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise GoldenCaseError(f"missing {path.name}")
    try:
        return load_file(path)
    except (OSError, SafetensorError) as e:
        raise GoldenCaseError(f"{path.name} unreadable: {e}") from e


def _expect_shape(golden: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> None:
    if golden[name].shape != shape:
        raise GoldenCaseError(f"{name}: shape {golden[name].shape}, expected {shape}")


def _check_text_case(case: GoldenCase) -> None:
    """Every array check-golden reads is present and shaped consistently with config.json."""
    g, a = case.golden, case.args
    needed = list(_TEXT_ARRAYS)
    for prefix in FULL_PREFIXES + BATTERY_PREFIXES:
        needed += [prefix + n for n in _ONE_SHOT_ARRAYS]
        needed += [f"{prefix}index_topk_L{i}" for i in case.index_source_layers]
    missing = [n for n in needed if n not in g]
    if missing:
        raise GoldenCaseError(f"golden.safetensors incomplete: missing {', '.join(missing)}")
    V, L, hc, D = a.vocab_size, a.n_layers, a.hc_mult, a.dim
    S = len(g["full.input_ids"])
    N, Sb = g["battery.input_ids"].shape
    k = a.n_activated_experts
    for prefix, lead in (("full.", (S,)), ("full_lowtie.", (S,)), ("battery.", (N, Sb)), ("battery_lowtie.", (N, Sb))):
        _expect_shape(g, prefix + "logits", (*lead, V))
        _expect_shape(g, prefix + "handoff_streams", (*lead, hc, D))
        _expect_shape(g, prefix + "handoff_pre_mix", (*lead, hc))
        moe_shape = (L, S, k) if len(lead) == 1 else (N, L, Sb, k)
        _expect_shape(g, prefix + "moe_expert_ids", moe_shape)
        for i in case.index_source_layers:
            if g[f"{prefix}index_topk_L{i}"].shape[: len(lead)] != lead:
                raise GoldenCaseError(f"{prefix}index_topk_L{i}: shape {g[f'{prefix}index_topk_L{i}'].shape}, "
                                      f"expected leading {lead}")
    rounds = len(g["decode_next_ids"])
    T = len(g["prompt_ids"])
    hidden = g["prefill_dspark_main_hidden"].shape[-1]
    _expect_shape(g, "draft_logits", (rounds, a.dspark_block_size, V))
    _expect_shape(g, "draft_start_pos", (rounds,))
    _expect_shape(g, "prefill_dspark_main_hidden", (T, hidden))
    _expect_shape(g, "decode_dspark_main_hidden", (rounds, hidden))
    _expect_shape(g, "continuation_ids", (S - T + 1,))


def load_case(case_dir: str | os.PathLike) -> GoldenCase:
    """Read a golden case directory; raise GoldenCaseError when it is unreadable or incomplete."""
    path = Path(case_dir)
    if not path.is_dir():
        raise GoldenCaseError(f"{path}: not a directory")
    config = _read_json(path / "config.json")
    args = ModelArgs.from_dict(config)  # what dsflash.config.load_config gives, without reading the file twice
    meta = _read_json(path / "meta.json")
    if not (path / "model.safetensors").is_file():
        raise GoldenCaseError("missing model.safetensors")
    golden = _read_golden(path / "golden.safetensors")
    case = GoldenCase(path=path, config=config, args=args, meta=meta, golden=golden)
    if case.is_image_case:
        missing = [n for n in _IMAGE_ARRAYS if n not in golden]
        if missing:
            raise GoldenCaseError(f"golden.safetensors incomplete: missing {', '.join(missing)}")
    else:
        _check_text_case(case)
    return case


def replay_selections(case: GoldenCase, prefix: str, seq: int | None = None, weights: bool = False) -> dict:
    """The selections an engine forces in replay mode (README "How replay is meant"):
    {"index_topk": {layer: int32 [S, k_layer]}, "moe_expert_ids": int64 [L, S, k]}; with `weights` also
    "moe_expert_weights": float32 [L, S, k], the reference's routing weights (not part of replay mode: a
    debugging aid that takes the router's fp32 arithmetic out of the comparison, docs/numerics.md).

    index_topk rows list compressed-cache rows of that layer's ratio, ascending, -1 as trailing padding.
    prefix "full." (or "full_lowtie.") selects the one-shot prefill of full.input_ids; "battery." (or
    "battery_lowtie.") with seq=n selects battery sequence n (the stored arrays carry a leading sequence
    dimension, which is removed here)."""
    if prefix in BATTERY_PREFIXES:
        n_seq = len(case.golden["battery.input_ids"])
        if seq is None or not 0 <= seq < n_seq:
            raise ValueError(f"{prefix} selections are per sequence: seq must be in 0..{n_seq - 1}, got {seq}")
    elif prefix in FULL_PREFIXES:
        if seq is not None:
            raise ValueError(f"{prefix} selections have no sequence index (got seq={seq})")
    else:
        raise ValueError(f"unknown prefix {prefix!r}; expected one of {FULL_PREFIXES + BATTERY_PREFIXES}")

    def pick(name: str) -> np.ndarray:
        array = case.golden[prefix + name]
        return array if seq is None else array[seq]

    index_topk = {i: pick(f"index_topk_L{i}").astype(np.int32, copy=False) for i in case.index_source_layers}
    out = {"index_topk": index_topk, "moe_expert_ids": pick("moe_expert_ids").astype(np.int64, copy=False)}
    if weights:
        out["moe_expert_weights"] = pick("moe_expert_weights").astype(np.float32, copy=False)
    return out
