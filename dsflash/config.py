"""Model configuration: one dataclass whose field names are the official `inference/config.json` keys.

Runtime limits (`max_batch_size`, `max_seq_len`, `temperature`) are read for compatibility but are not
model shape; the engine sizes its state from `RuntimeArgs`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path


class ConfigError(ValueError):
    """A config value is missing or violates a constraint; the message names the field."""


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16_000_000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    vision_n_layers: int = 0
    image_token_id: int = 129264
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # read for compatibility with the official file; sampling and cache sizes belong to the runtime
    max_batch_size: int = 1
    max_seq_len: int = 1 << 20
    temperature: float = 0.0
    dtype: str = "fp8"
    expert_dtype: str = "fp4"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived layer roles (spec §2.2; general rules, valid for any schedule) ----
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int:
        """The latest KV source at or before `layer` (its compressed cache is what the layer reads)."""
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source_of(self, layer: int) -> int:
        return max(s for s in self.index_source_layers if s <= layer)

    def moe_experts(self, layer: int) -> tuple[int, int]:
        """(routed, activated) for a backbone layer or a DSpark stage (layer >= n_layers)."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def first_decoder_layer(self) -> int:
        """The first ratio-1 layer: where the model splits (layer 20 in V4.1)."""
        return min(i for i in range(self.n_layers) if self.compress_ratios[i] == 1)

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        names = {f.name for f in fields(cls)} - {"extra"}
        kw, extra = {}, {}
        for k, v in d.items():
            if k in names:
                kw[k] = tuple(v) if isinstance(v, list) else v
            else:
                extra[k] = v
        return cls(**kw, extra=extra)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        out.update(self.extra)
        return out


def load_config(path: str | Path) -> ModelArgs:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"no config.json at {p}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from e
    return ModelArgs.from_dict(d)
