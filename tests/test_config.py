"""Config: both spellings, the validator's errors, Engram primes, presets."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import load_file

from dsflash.config import (
    PRESETS,
    TINY_A,
    TINY_B,
    V41_FLASH,
    ConfigError,
    ModelArgs,
    bench_preset,
    engram_primes,
    engram_table_rows,
    load_config,
    preset,
    validate,
)
from tests.conftest import GOLDEN_CASES, TEXT_CASE, VISION_CASE

# the released HF config.json (spec §2.1 values, HF key names), written out independently of the code
RELEASED_HF = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "engram_pad_token_id": 2,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "vision_config": {"num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
                      "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
                      "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None},
    "text_config": {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120,
        "num_hidden_layers": 40, "num_nextn_predict_layers": 3, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
        "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "max_position_embeddings": 1048576,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "moe_intermediate_size": 2304, "scoring_func": "sqrtsoftplus", "gate_temp": 1.0,
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "topk_method": "noaux_tc", "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20, "hidden_act": "silu", "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_vocab_size": 16000000, "engram_compressed_vocab_size": 99092,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
        "initializer_range": 0.02,
    },
}


def _official(**changes) -> dict:
    d = TINY_A.to_dict()
    d.update(changes)
    return d


# ---------------------------------------------------------------------------------------------
# spellings
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: p.name)
def test_golden_config_reads_in_official_spelling(case):
    args = load_config(case)
    raw = json.loads((case / "config.json").read_text())
    assert args.to_dict() == raw  # every key known, every value kept
    assert args.extra == {}


def test_tiny_a_preset_is_the_golden_config():
    raw = json.loads((TEXT_CASE / "config.json").read_text())
    assert PRESETS["tiny-a"].to_dict() == raw
    assert load_config(TEXT_CASE) == PRESETS["tiny-a"]


def test_vision_case_config():
    args = load_config(VISION_CASE)
    assert args.vision_enabled and (args.vision_n_layers, args.vision_dim, args.image_token_id) == (2, 128, 496)


def test_released_hf_config_reads_as_the_v41_flash_preset():
    args = ModelArgs.from_dict(RELEASED_HF)
    assert args == V41_FLASH
    assert args.extra["initializer_range"] == 0.02 and args.extra["bos_token_id"] == 0


def test_hf_bare_text_config_with_quantization():
    text = dict(RELEASED_HF["text_config"], quantization_config=RELEASED_HF["quantization_config"],
                engram_pad_id=2)
    args = ModelArgs.from_dict(text)
    assert args == replace(V41_FLASH, vision_n_layers=0)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["text_config"].update(dim=5120), "mixes spellings"),
    (lambda d: d["text_config"].update(engram_pad_token_id=3), "engram_pad_token_id"),
    (lambda d: d["text_config"].update(num_key_value_heads=8), "num_key_value_heads"),
    (lambda d: d["text_config"]["rope_scaling"].update(rope_type="linear"), "rope_scaling.rope_type"),
    (lambda d: d["quantization_config"].update(weight_block_size=[128, 128]), "quantization_config.weight_block_size"),
    (lambda d: d.pop("quantization_config"), "dtype"),
    (lambda d: d["quantization_config"].pop("expert_dtype"), "expert_dtype"),
    (lambda d: d["text_config"].update(kv_source_layer_ids=[2, 8, 14, 24]), "compress_ratios[20]"),
    (lambda d: d["text_config"].update(compress_ratios=[0] * 43), "kv_source_layers"),
    (lambda d: d["text_config"].update(rms_norm_eps="tiny"), "norm_eps"),
])
def test_hf_config_errors_name_the_field(mutate, field):
    d = copy.deepcopy(RELEASED_HF)
    mutate(d)
    with pytest.raises(ConfigError, match=re.escape(field)):
        ModelArgs.from_dict(d)


def test_load_config_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_official(o_groups=3)))
    with pytest.raises(ConfigError, match=r"config\.json: n_heads: expected a multiple of o_groups=3, got 4"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path / "elsewhere")


# ---------------------------------------------------------------------------------------------
# validator: every constraint, with the field, the expected and the actual value in the message
# ---------------------------------------------------------------------------------------------
INVALID = [
    ({"dim": 240}, "dim: expected a multiple of 32, got 240"),
    ({"q_lora_rank": 48}, "q_lora_rank: expected a multiple of 32"),
    ({"head_dim": 48}, "head_dim: expected a multiple of 32"),
    ({"o_lora_rank": 40}, "o_groups\\*o_lora_rank: expected a multiple of 32, got 80"),
    ({"moe_inter_dim": 100}, "moe_inter_dim: expected a multiple of 32"),
    ({"index_head_dim": 48}, "index_head_dim: expected a multiple of 32"),
    ({"engram_head_dim": 48}, "engram_head_dim: expected a multiple of 32"),
    ({"o_groups": 3}, "n_heads: expected a multiple of o_groups=3, got 4"),
    ({"rope_head_dim": 15}, "rope_head_dim: expected an even number"),
    ({"rope_head_dim": 96, "head_dim": 128}, "rope_head_dim: expected <= index_head_dim=64, got 96"),
    ({"score_func": "relu"}, "score_func: expected one of"),
    ({"n_shared_experts": 2}, "n_shared_experts: expected 1, got 2"),
    ({"n_activated_experts": 5}, "n_activated_experts: expected at most n_routed_experts=4, got 5"),
    ({"dtype": "bf16"}, "dtype: expected 'fp8'"),
    ({"expert_dtype": "fp8"}, "expert_dtype: expected 'fp4'"),
    ({"n_layers": 0}, "n_layers: expected a positive integer, got 0"),
    ({"n_layers": 6.0}, "n_layers: expected int, got 6.0"),
    ({"norm_topk_prob": 1}, "norm_topk_prob: expected bool, got 1"),
    ({"norm_eps": 0.0}, "norm_eps: expected a positive number"),
    ({"compress_ratios": [0, 2, 2, 1, 1, 1]}, "compress_ratios: expected 7 entries"),
    ({"compress_ratios": [0, 2, 2, 1, 1, 1, 2]}, "compress_ratios: expected 0 for every DSpark stage"),
    ({"compress_ratios": [0, 2, 2, 1, 1, -1, 0]}, "compress_ratios: expected non-negative ratios"),
    ({"compress_ratios": [0, 2, 2, 2, 1, 1, 0]}, "compress_ratios\\[4\\]: expected 2, the ratio of its KV source"),
    ({"compress_ratios": [2, 2, 2, 1, 1, 1, 0]}, "kv_source_layers: expected a KV source at or before layer 0"),
    ({"kv_source_layers": [0, 3], "index_source_layers": [0, 3, 5]}, "kv_source_layers: expected layers with "
                                                                     "compress ratio > 0, got \\[0\\]"),
    ({"kv_source_layers": [1, 6]}, "kv_source_layers: expected backbone layer ids in \\[0, 6\\)"),
    ({"kv_source_layers": [3, 1]}, "kv_source_layers: expected strictly increasing"),
    ({"index_source_layers": [1, 5]}, "index_source_layers: expected every KV source \\[1, 3\\] included, got \\[3\\]"),
    ({"index_source_layers": [0, 1, 3, 5]}, "index_source_layers: expected layers with compress ratio > 0"),
    ({"candidate_source_layer": 4}, "candidate_source_layer: expected one of index_source_layers"),
    ({"candidate_topk_blocks": 1}, "candidate_topk_blocks: expected candidate_topk_blocks\\*candidate_block_size "
                                   ">= index_topk=8, got 4"),
    ({"candidate_block_size": 0}, "candidate_block_size: expected a positive integer"),
    ({"candidate_source_layer": 1}, "index_source_layers: expected index sources after candidate_source_layer=1 "
                                    "reading the KV source 1, got \\[3, 5\\]"),
    ({"engram_layer_ids": [0, 6]}, "engram_layer_ids: expected backbone layer ids in \\[0, 6\\)"),
    ({"engram_num_embeddings": [660, 865]}, "engram_num_embeddings: expected \\[660, 864\\]"),
    ({"engram_num_embeddings": [660]}, "engram_num_embeddings: expected \\[660, 864\\]"),
    ({"engram_layer_ids": [], "engram_num_embeddings": [660]}, "engram_num_embeddings: expected empty"),
    ({"engram_max_ngram_size": 1}, "engram_max_ngram_size: expected at least 2"),
    ({"engram_compressed_vocab_size": 513}, "engram_compressed_vocab_size: expected in \\[1, vocab_size=512\\]"),
    ({"engram_pad_id": 512}, "engram_pad_id: expected a token id < vocab_size=512"),
    ({"dspark_target_layer_ids": [4, 6]}, "dspark_target_layer_ids: expected backbone layer ids in \\[0, 6\\)"),
    ({"dspark_target_layer_ids": []}, "dspark_target_layer_ids: expected at least one backbone layer"),
    ({"dspark_block_size": 0}, "dspark_block_size: expected a positive integer with DSpark stages"),
    ({"dspark_noise_token_id": 512}, "dspark_noise_token_id: expected a token id < vocab_size=512"),
    ({"dspark_n_routed_experts": 2, "dspark_n_activated_experts": 3}, "dspark_n_activated_experts: expected at most"),
    ({"vision_n_layers": 2, "vision_n_heads": 3}, "vision_dim: expected a multiple of vision_n_heads=3, got 1024"),
    ({"vision_n_layers": 2}, "image_token_id: expected a token id < vocab_size=512, got 129264"),
]


@pytest.mark.parametrize("changes, message", INVALID, ids=[m.split(":")[0] for _, m in INVALID])
def test_validator_names_field_expected_and_actual(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelArgs.from_dict(_official(**changes))


def test_candidate_prefilter_can_be_off():
    args = ModelArgs.from_dict(_official(candidate_source_layer=-1, candidate_topk_blocks=0))
    assert args.candidate_source_layer == -1


def test_no_dspark_stages_needs_no_targets():
    ModelArgs.from_dict(_official(n_mtp_layers=0, compress_ratios=[0, 2, 2, 1, 1, 1], dspark_target_layer_ids=[]))


# ---------------------------------------------------------------------------------------------
# Engram primes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: p.name)
def test_engram_primes_match_the_reference(case):
    golden = load_file(case / "golden.safetensors")
    assert np.array_equal(np.array(engram_primes(load_config(case))), golden["engram_primes"])


def test_released_engram_primes():
    primes = engram_primes(V41_FLASH)
    flat = [p for layer in primes for per_n in layer for p in per_n]
    assert np.array(primes).shape == (2, 3, 8)
    assert len(set(flat)) == 48 and min(flat) > 15_999_999
    assert engram_table_rows(V41_FLASH) == (384006168, 384016682)
    # 48 consecutive primes: nothing prime is skipped between the smallest and the largest
    assert all(not _naive_prime(n) for n in range(16_000_000, max(flat)) if n not in set(flat))


def _naive_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*PRESETS, "bench"])
def test_presets_validate(name):
    validate(preset(name))


def test_tiny_b_follows_the_spec():
    b = TINY_B
    assert b.compress_ratios == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0)
    assert (b.kv_source_layers, b.index_source_layers, b.candidate_source_layer) == ((2, 4, 6), (2, 4, 6, 8, 10), 6)
    assert (b.window_size, b.n_routed_experts, b.moe_inter_dim, b.index_topk) == (8, 8, 64, 4)
    assert b.moe_experts(b.n_layers) == (4, 1) and b.dspark_target_layer_ids == (9, 10, 11)
    assert b.engram_num_embeddings == engram_table_rows(b)


def test_bench_preset_real_widths_fewer_experts():
    b = bench_preset(64)
    widths = ("dim", "n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
              "compress_ratios", "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
              "candidate_block_size", "engram_head_dim", "engram_n_heads", "moe_inter_dim", "n_activated_experts")
    assert all(getattr(b, w) == getattr(V41_FLASH, w) for w in widths)
    assert b.moe_experts(0) == (64, 6) and b.moe_experts(b.n_layers) == (64, 3)
    assert preset("bench").n_routed_experts == 48 and bench_preset(200).dspark_n_routed_experts == 128
    assert all(rows < 10_000_000 for rows in b.engram_num_embeddings)


def test_preset_errors():
    with pytest.raises(ConfigError, match="preset: expected one of"):
        preset("tiny-c")
    with pytest.raises(ConfigError, match="n_experts: expected no value"):
        preset("tiny-a", 8)
    with pytest.raises(ConfigError, match="n_activated_experts: expected at most n_routed_experts=4"):
        preset("bench", 4)
