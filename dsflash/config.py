"""Model configuration: one dataclass whose field names are the official `inference/config.json` keys.

Two spellings are read: DeepSeek's official `inference/config.json` (the golden cases' `config.json`)
and the Hugging Face `config.json` with its `text_config` / `vision_config` / `quantization_config`
(spec §2.1 gives both names of every field). Either way the result is validated against the
constraints of spec §2.3 and the structural rules of the layer schedule (§2.2) before anyone sees it.

Runtime limits (`max_batch_size`, `max_seq_len`, `temperature`) are read for compatibility but are not
model shape; the engine sizes its state from `RuntimeArgs`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from dsflash.numerics import BLOCK


class ConfigError(ValueError):
    """A config value is missing or violates a constraint; the message names the field."""


# not model shape: excluded from the model identity
RUNTIME_FIELDS = ("max_batch_size", "max_seq_len", "temperature")
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


@dataclass(frozen=True)
class ModelArgs:
    # read for compatibility with the official file; sampling and cache sizes belong to the runtime
    max_batch_size: int = 1
    max_seq_len: int = 1 << 20
    temperature: float = 0.0
    dtype: str = "fp8"
    expert_dtype: str = "fp4"
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
    candidate_source_layer: int = 20  # negative: no candidate pre-filtering
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
    vision_n_layers: int = 0  # 0: no vision tower (and no `gate.bias_vl`)
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: int | None = None
    image_token_id: int = 129264
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128  # 0: as many as the backbone
    dspark_n_activated_experts: int = 3  # 0: as many as the backbone
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived layer roles (spec §2.2; general rules, valid for any schedule) ----
    def kv_source_of(self, layer: int) -> int:
        """The latest KV source at or before `layer` (its compressed cache is what the layer reads)."""
        return max(s for s in self.kv_source_layers if s <= layer)

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

    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        """Either spelling (official keys, or HF with `text_config`), validated."""
        official = _official_from_hf(d) if _is_hf_spelling(d) else d
        names = {f.name for f in fields(cls)} - {"extra"}
        kw, extra = {}, {}
        for k, v in official.items():
            if k in names:
                kw[k] = tuple(v) if isinstance(v, list) else v
            else:
                extra[k] = v
        args = cls(**kw, extra=extra)
        validate(args)
        return args

    def to_dict(self) -> dict:
        """Official `inference/config.json` spelling."""
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
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: expected a JSON object, got {type(d).__name__}")
    try:
        return ModelArgs.from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Hugging Face spelling -> official keys (spec §2.1)
# ---------------------------------------------------------------------------------------------
HF_TEXT_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "gate_temp": "gate_temp",
    "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "route_scale",
    "swiglu_limit": "swiglu_limit",
    "q_lora_rank": "q_lora_rank",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "compress_rope_theta": "compress_rope_theta",
    "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "max_position_embeddings": "max_seq_len",
}
HF_ROPE_SCALING_KEYS = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "original_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
}
HF_VISION_KEYS = {
    "num_hidden_layers": "vision_n_layers",
    "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size",
    "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio",
    "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels",
    "max_wh_ratio": "vision_max_wh_ratio",
}
# the pad id is spelled three ways: root `engram_pad_token_id` (released), `engram_pad_token_id` or
# `engram_pad_id` inside text_config (HF's class)
HF_PAD_KEYS = ("engram_pad_token_id", "engram_pad_id")
# HF keys with a single value this architecture allows: anything else would be silently misread
HF_FIXED = {"num_key_value_heads": 1, "topk_method": "noaux_tc", "hidden_act": "silu"}
# official names that differ from their HF spelling: their presence in an HF file means a mixed file
_OFFICIAL_ONLY = (set(HF_TEXT_KEYS.values()) - set(HF_TEXT_KEYS)) | set(HF_ROPE_SCALING_KEYS.values())


def _is_hf_spelling(d: dict) -> bool:
    return "text_config" in d or "hidden_size" in d or "num_hidden_layers" in d


def _official_from_hf(d: dict) -> dict:
    """An HF root config (with `text_config`) or a bare HF text config -> official keys."""
    text = d.get("text_config", d)
    if not isinstance(text, dict):
        raise ConfigError(f"text_config: expected an object, got {text!r}")
    mixed = sorted(_OFFICIAL_ONLY & (set(text) | set(d)))
    if mixed:
        raise ConfigError(f"config mixes spellings: HF keys together with official key(s) {mixed}")
    converted = ("text_config", "vision_config", "quantization_config", "rope_scaling", *HF_PAD_KEYS)
    out: dict = {}
    for k, v in text.items():
        if k in HF_TEXT_KEYS:
            out[HF_TEXT_KEYS[k]] = v
        elif k in HF_FIXED:
            if v != HF_FIXED[k]:
                raise ConfigError(f"{k}: expected {HF_FIXED[k]!r} (the only value of this architecture), got {v!r}")
        elif k not in converted:
            out[k] = v  # not model shape (initializer_range, use_cache, ...): kept in `extra`
    if text is not d:
        out.update({k: v for k, v in d.items() if k not in converted})  # image_token_id, bos/eos ids, ...
    out.update(_rope_scaling(text.get("rope_scaling")))
    out.update(_vision(d.get("vision_config")))
    out.update(_quantization(d.get("quantization_config")))
    pads = {v for scope in (d, text) for k, v in scope.items() if k in HF_PAD_KEYS}
    if len(pads) > 1:
        raise ConfigError(f"engram_pad_token_id: expected one value, got {sorted(pads)}")
    if pads:
        out["engram_pad_id"] = pads.pop()
    return out


def _rope_scaling(rs) -> dict:
    if rs is None:
        return {"original_seq_len": 0}  # no YaRN
    if not isinstance(rs, dict):
        raise ConfigError(f"rope_scaling: expected an object, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.rope_type: expected 'yarn', got {kind!r}")
    return {HF_ROPE_SCALING_KEYS[k]: v for k, v in rs.items() if k in HF_ROPE_SCALING_KEYS}


def _vision(vc) -> dict:
    if vc is None:
        return {"vision_n_layers": 0}
    if not isinstance(vc, dict):
        raise ConfigError(f"vision_config: expected an object, got {vc!r}")
    return {HF_VISION_KEYS[k]: v for k, v in vc.items() if k in HF_VISION_KEYS}


def _quantization(qc) -> dict:
    if qc is None:
        return {"dtype": "bf16"}  # HF writes no quantization_config for an unquantised checkpoint
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config: expected an object, got {qc!r}")
    expected = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"}
    for k, want in expected.items():
        if k in qc and qc[k] != want:
            raise ConfigError(f"quantization_config.{k}: expected {want!r}, got {qc[k]!r}")
    return {"dtype": qc.get("quant_method", "fp8"), "expert_dtype": qc.get("expert_dtype")}


# ---------------------------------------------------------------------------------------------
# Engram primes (spec §8 "Static layout")
# ---------------------------------------------------------------------------------------------
# Miller-Rabin with these bases is exact for every n < 3.3e24
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(args: ModelArgs) -> list[list[list[int]]]:
    """[engram layer][n-gram size 2..max][head] -> bucket modulus. For every (layer, n, head), in that
    order, the search restarts at engram_vocab_size - 1 and takes the next prime not used before."""
    used: set[int] = set()
    layers = []
    for _ in args.engram_layer_ids:
        per_ngram = []
        for _ in range(args.engram_max_ngram_size - 1):
            heads, candidate = [], args.engram_vocab_size - 1
            for _ in range(args.engram_n_heads):
                candidate += 1
                while candidate in used or not _is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                heads.append(candidate)
            per_ngram.append(heads)
        layers.append(per_ngram)
    return layers


def engram_table_rows(args: ModelArgs) -> tuple[int, ...]:
    """Rows of each Engram table: the sum of its primes (each (n, head) owns a prime-sized range)."""
    return tuple(sum(sum(heads) for heads in layer) for layer in engram_primes(args))


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
def _check(ok: bool, name: str, expected: str, actual) -> None:
    if not ok:
        raise ConfigError(f"{name}: expected {expected}, got {actual!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_TYPE_CHECKS = {
    "int": _is_int,
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "tuple[int, ...]": lambda v: isinstance(v, tuple) and all(_is_int(x) for x in v),
    "int | None": lambda v: v is None or _is_int(v),
}


def _check_layer_list(layers: tuple[int, ...], name: str, n_layers: int) -> None:
    _check(all(0 <= x < n_layers for x in layers), name, f"backbone layer ids in [0, {n_layers})", list(layers))
    _check(list(layers) == sorted(set(layers)), name, "strictly increasing layer ids", list(layers))


def validate(args: ModelArgs) -> None:
    """Raise ConfigError naming the first field that violates a constraint of spec §2.3 or breaks the
    structure of the layer schedule; the message gives the expected and the actual value."""
    for f in fields(args):
        if f.name != "extra":
            _check(_TYPE_CHECKS[f.type](getattr(args, f.name)), f.name, f.type, getattr(args, f.name))

    a = args
    for name in ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts",
                 "n_activated_experts", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups", "o_lora_rank",
                 "window_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
                 "max_batch_size", "max_seq_len"):
        _check(getattr(a, name) >= 1, name, "a positive integer", getattr(a, name))
    for name in ("norm_eps", "hc_eps", "gate_temp", "route_scale", "rope_theta", "compress_rope_theta",
                 "rope_factor", "beta_fast", "beta_slow"):
        _check(getattr(a, name) > 0, name, "a positive number", getattr(a, name))
    for name in ("n_mtp_layers", "swiglu_limit", "original_seq_len", "temperature", "vision_n_layers"):
        _check(getattr(a, name) >= 0, name, "a non-negative number", getattr(a, name))
    _check(a.dtype == "fp8", "dtype", "'fp8' (FP8 weights with E8M0 32x32 tile scales)", a.dtype)
    _check(a.expert_dtype == "fp4", "expert_dtype", "'fp4' (packed E2M1 experts)", a.expert_dtype)
    _check(a.score_func in SCORE_FUNCS, "score_func", f"one of {SCORE_FUNCS}", a.score_func)
    _check(a.n_shared_experts == 1, "n_shared_experts", "1", a.n_shared_experts)
    _check(a.n_activated_experts <= a.n_routed_experts, "n_activated_experts",
           f"at most n_routed_experts={a.n_routed_experts}", a.n_activated_experts)

    # every linear input is quantised in blocks of 32; head_dim's covers head_dim % 16 (FP4 KV blocks)
    # and the wo_a group width n_heads*head_dim/o_groups, a multiple of head_dim
    _check(a.n_heads % a.o_groups == 0, "n_heads", f"a multiple of o_groups={a.o_groups}", a.n_heads)
    widths = {"dim": a.dim, "q_lora_rank": a.q_lora_rank, "head_dim": a.head_dim,
              "o_groups*o_lora_rank": a.o_groups * a.o_lora_rank, "moe_inter_dim": a.moe_inter_dim,
              "index_head_dim": a.index_head_dim}
    if a.engram_layer_ids:
        widths["engram_head_dim"] = a.engram_head_dim
    for name, width in widths.items():
        _check(width % BLOCK == 0, name, f"a multiple of {BLOCK}", width)
    _check(a.rope_head_dim % 2 == 0, "rope_head_dim", "an even number (RoPE rotates pairs)", a.rope_head_dim)
    _check(a.rope_head_dim <= a.index_head_dim, "rope_head_dim", f"<= index_head_dim={a.index_head_dim}",
           a.rope_head_dim)
    _check(a.rope_head_dim <= a.head_dim, "rope_head_dim", f"<= head_dim={a.head_dim}", a.rope_head_dim)

    _validate_schedule(a)
    _validate_engram(a)
    _validate_dspark(a)
    if a.vision_enabled:
        for name in ("vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                     "vision_downsample_ratio"):
            _check(getattr(a, name) >= 1, name, "a positive integer", getattr(a, name))
        _check(a.vision_dim % a.vision_n_heads == 0, "vision_dim", f"a multiple of vision_n_heads={a.vision_n_heads}",
               a.vision_dim)
        _check(0 <= a.image_token_id < a.vocab_size, "image_token_id", f"a token id < vocab_size={a.vocab_size}",
               a.image_token_id)


def _validate_schedule(a: ModelArgs) -> None:
    n, total = a.n_layers, a.n_layers + a.n_mtp_layers
    ratios = a.compress_ratios
    _check(len(ratios) == total, "compress_ratios", f"{total} entries (n_layers + n_mtp_layers)", len(ratios))
    _check(all(r >= 0 for r in ratios), "compress_ratios", "non-negative ratios", list(ratios))
    _check(all(r == 0 for r in ratios[n:]), "compress_ratios", "0 for every DSpark stage (sliding window only)",
           list(ratios[n:]))
    _check_layer_list(a.kv_source_layers, "kv_source_layers", n)
    _check_layer_list(a.index_source_layers, "index_source_layers", n)
    for name, layers in (("kv_source_layers", a.kv_source_layers), ("index_source_layers", a.index_source_layers)):
        bad = [i for i in layers if ratios[i] == 0]
        _check(not bad, name, "layers with compress ratio > 0", bad)
    # the index keys come from a KV source's compressor, and only an indexer builds them
    missing = [s for s in a.kv_source_layers if s not in a.index_source_layers]
    _check(not missing, "index_source_layers", f"every KV source {list(a.kv_source_layers)} included", missing)
    for i in range(n):
        if ratios[i] == 0:
            continue
        _check(any(s <= i for s in a.kv_source_layers), "kv_source_layers",
               f"a KV source at or before layer {i} (compress ratio {ratios[i]})", list(a.kv_source_layers))
        source = a.kv_source_of(i)
        _check(ratios[i] == ratios[source], f"compress_ratios[{i}]",
               f"{ratios[source]}, the ratio of its KV source layer {source}", ratios[i])

    c = a.candidate_source_layer
    if c < 0:
        return
    _check(c in a.index_source_layers, "candidate_source_layer", f"one of index_source_layers "
           f"{list(a.index_source_layers)}", c)
    _check(a.candidate_block_size >= 1, "candidate_block_size", "a positive integer", a.candidate_block_size)
    _check(a.candidate_topk_blocks >= 1, "candidate_topk_blocks", "a positive integer", a.candidate_topk_blocks)
    # fewer candidate rows than index_topk would let masked picks leak into the top-k
    _check(a.candidate_topk_blocks * a.candidate_block_size >= a.index_topk, "candidate_topk_blocks",
           f"candidate_topk_blocks*candidate_block_size >= index_topk={a.index_topk}",
           a.candidate_topk_blocks * a.candidate_block_size)
    # the candidate mask is laid over the candidate source's cache, so later indexers must read that cache
    later = [i for i in a.index_source_layers if i > c and a.kv_source_of(i) != a.kv_source_of(c)]
    _check(not later, "index_source_layers", f"index sources after candidate_source_layer={c} reading the KV "
           f"source {a.kv_source_of(c)}", later)


def _validate_engram(a: ModelArgs) -> None:
    if not a.engram_layer_ids:
        _check(not a.engram_num_embeddings, "engram_num_embeddings", "empty without engram layers",
               list(a.engram_num_embeddings))
        return
    _check_layer_list(a.engram_layer_ids, "engram_layer_ids", a.n_layers)
    _check(a.engram_max_ngram_size >= 2, "engram_max_ngram_size", "at least 2", a.engram_max_ngram_size)
    _check(a.engram_n_heads >= 1, "engram_n_heads", "a positive integer", a.engram_n_heads)
    _check(a.engram_vocab_size >= 2, "engram_vocab_size", "at least 2", a.engram_vocab_size)
    _check(1 <= a.engram_compressed_vocab_size <= a.vocab_size, "engram_compressed_vocab_size",
           f"in [1, vocab_size={a.vocab_size}]", a.engram_compressed_vocab_size)
    _check(0 <= a.engram_pad_id < a.vocab_size, "engram_pad_id", f"a token id < vocab_size={a.vocab_size}",
           a.engram_pad_id)
    rows = engram_table_rows(a)
    _check(a.engram_num_embeddings == rows, "engram_num_embeddings", f"{list(rows)} (the sum of each layer's primes)",
           list(a.engram_num_embeddings))


def _validate_dspark(a: ModelArgs) -> None:
    if a.n_mtp_layers == 0:
        return
    _check(a.dspark_block_size >= 1, "dspark_block_size", "a positive integer with DSpark stages",
           a.dspark_block_size)
    _check(len(a.dspark_target_layer_ids) >= 1, "dspark_target_layer_ids", "at least one backbone layer",
           list(a.dspark_target_layer_ids))
    _check_layer_list(a.dspark_target_layer_ids, "dspark_target_layer_ids", a.n_layers)
    _check(0 <= a.dspark_noise_token_id < a.vocab_size, "dspark_noise_token_id",
           f"a token id < vocab_size={a.vocab_size}", a.dspark_noise_token_id)
    _check(a.dspark_markov_rank >= 1, "dspark_markov_rank", "a positive integer", a.dspark_markov_rank)
    for name in ("dspark_n_routed_experts", "dspark_n_activated_experts"):
        _check(getattr(a, name) >= 0, name, "0 (as the backbone) or a positive integer", getattr(a, name))
    routed, activated = a.moe_experts(a.n_layers)
    _check(activated <= routed, "dspark_n_activated_experts", f"at most the DSpark routed experts ({routed})",
           activated)


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------
def _with_engram_rows(args: ModelArgs) -> ModelArgs:
    return replace(args, engram_num_embeddings=engram_table_rows(args))


# Tiny-A (spec §2.3): the golden cases' configuration, tt-metal's `small_model_args()`
TINY_A = _with_engram_rows(ModelArgs(
    max_batch_size=1, max_seq_len=128, temperature=0.0,
    vocab_size=512, dim=256, moe_inter_dim=128, n_layers=6, n_mtp_layers=1, n_heads=4,
    n_routed_experts=4, n_activated_experts=2, q_lora_rank=64, head_dim=64, rope_head_dim=16,
    o_groups=2, o_lora_rank=64, window_size=16, compress_ratios=(0, 2, 2, 1, 1, 1, 0),
    kv_source_layers=(1, 3), index_source_layers=(1, 3, 5), original_seq_len=32, rope_factor=4,
    index_n_heads=4, index_head_dim=64, index_topk=8,
    candidate_source_layer=3, candidate_topk_blocks=3, candidate_block_size=4,
    engram_layer_ids=(0, 1), engram_vocab_size=100, engram_n_heads=2, engram_head_dim=32,
    engram_compressed_vocab_size=256,
    dspark_block_size=2, dspark_noise_token_id=511, dspark_target_layer_ids=(4, 5), dspark_markov_rank=32,
    dspark_n_routed_experts=0, dspark_n_activated_experts=0,
))

# Tiny-B (spec §2.3): the released structure at tiny width; window 8 makes the ring wrap early
TINY_B = _with_engram_rows(replace(
    TINY_A,
    n_layers=12, n_mtp_layers=3, compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0),
    kv_source_layers=(2, 4, 6), index_source_layers=(2, 4, 6, 8, 10),
    candidate_source_layer=6, candidate_topk_blocks=4, candidate_block_size=2, index_topk=4,
    index_n_heads=4, index_head_dim=32, window_size=8, n_routed_experts=8, n_activated_experts=2,
    moe_inter_dim=64, engram_layer_ids=(1, 4), dspark_block_size=3, dspark_target_layer_ids=(9, 10, 11),
    dspark_n_routed_experts=4, dspark_n_activated_experts=1,
))

# the released model (spec §2.1), vision tower included
V41_FLASH = ModelArgs(vision_n_layers=32)

PRESETS: dict[str, ModelArgs] = {"tiny-a": TINY_A, "tiny-b": TINY_B, "v41-flash": V41_FLASH}

# Bench tables: about 24 primes of ~2^18 per layer (6.3M rows, 1.7 GB with scales) instead of 384M rows,
# so that the bench checkpoint fits one H200; the hashing and the row reads per token are unchanged.
BENCH_ENGRAM_VOCAB = 1 << 18
BENCH_EXPERTS = 48


def bench_preset(n_experts: int = BENCH_EXPERTS) -> ModelArgs:
    """The released widths and layer schedule with `n_experts` routed experts per layer (DSpark stages
    keep at most their released 128), small Engram tables and no vision tower. A step's FLOPs are set by
    the top-6 routing, but fewer experts than the released 384 understate two costs: a prefill chunk gives
    each expert more rows (larger, more efficient GEMMs; 48 experts: 8x, above the FP4 widening threshold)
    and a multi-row step touches fewer distinct experts (fewer weight bytes read)."""
    return _with_engram_rows(replace(
        V41_FLASH,
        n_routed_experts=n_experts,
        dspark_n_routed_experts=min(V41_FLASH.dspark_n_routed_experts, n_experts),
        engram_vocab_size=BENCH_ENGRAM_VOCAB,
        vision_n_layers=0,
    ))


def preset(name: str, n_experts: int | None = None) -> ModelArgs:
    """A validated preset by name: one of PRESETS, or "bench" (whose expert count `n_experts` sets)."""
    if name == "bench":
        args = bench_preset(BENCH_EXPERTS if n_experts is None else n_experts)
    elif name in PRESETS:
        _check(n_experts is None, "n_experts", "no value (only the bench preset takes an expert count)", n_experts)
        args = PRESETS[name]
    else:
        raise ConfigError(f"preset: expected one of {[*PRESETS, 'bench']}, got {name!r}")
    validate(args)
    return args
