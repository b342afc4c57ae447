"""Every tensor an official-layout checkpoint of a config holds: name -> (safetensors dtype, shape).

Layout (spec §13.1, golden README "Files in each case"): FP8 E4M3 weights carry a sibling `.scale`
with one E8M0 per 32x32 tile; routed experts are packed E2M1 (I8 [out, in/2]) with one E8M0 per 32
inputs; Engram tables are E4M3 rows with one E8M0 per 32 values of a row; BF16 and F32 elsewhere.
The DSpark stages (`mtp.S.`) share `embed.weight` and `head.weight`, which are stored once.
"""

from __future__ import annotations

from collections.abc import Callable

from dsflash.config import ModelArgs
from dsflash.numerics import BLOCK

F8 = "F8_E4M3"
E8M0 = "F8_E8M0"
I8 = "I8"  # packed FP4: safetensors' own F4 type is not used by the checkpoint
BF16 = "BF16"
F32 = "F32"

Shape = tuple[int, ...]
Expected = dict[str, tuple[str, Shape]]


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _fp8(out: Expected, name: str, rows: int, cols: int) -> None:
    out[f"{name}.weight"] = (F8, (rows, cols))
    out[f"{name}.scale"] = (E8M0, (_blocks(rows), _blocks(cols)))


def _fp4(out: Expected, name: str, rows: int, cols: int) -> None:
    out[f"{name}.weight"] = (I8, (rows, cols // 2))
    out[f"{name}.scale"] = (E8M0, (rows, cols // BLOCK))


def _bf16(out: Expected, name: str, *shape: int) -> None:
    out[name] = (BF16, shape)


def _swiglu(out: Expected, prefix: str, dim: int, inter: int, add: Callable[[Expected, str, int, int], None]) -> None:
    add(out, f"{prefix}.w1", inter, dim)
    add(out, f"{prefix}.w2", dim, inter)
    add(out, f"{prefix}.w3", inter, dim)


def _block(out: Expected, a: ModelArgs, layer: int, prefix: str) -> None:
    """One Block (mHC, attention, MoE, Engram) of a backbone layer or a DSpark stage."""
    d, hc = a.dim, a.hc_mult
    backbone = layer < a.n_layers
    mix = (2 + hc) * hc
    _bf16(out, f"{prefix}.attn_norm.weight", d)
    _bf16(out, f"{prefix}.ffn_norm.weight", d)
    for site in ("attn", "ffn"):
        out[f"{prefix}.hc_{site}_fn"] = (F32, (mix, hc * d))
        out[f"{prefix}.hc_{site}_base"] = (F32, (mix,))
        out[f"{prefix}.hc_{site}_scale"] = (F32, (3,))

    attn = f"{prefix}.attn"
    out[f"{attn}.attn_sink"] = (F32, (a.n_heads,))
    _fp8(out, f"{attn}.wq_a", a.q_lora_rank, d)
    _bf16(out, f"{attn}.q_norm.weight", a.q_lora_rank)
    _fp8(out, f"{attn}.wq_b", a.n_heads * a.head_dim, a.q_lora_rank)
    _fp8(out, f"{attn}.wkv", a.head_dim, d)
    _bf16(out, f"{attn}.kv_norm.weight", a.head_dim)
    # stored bf16: used block-diagonally per group in an einsum, never as an FP8 GEMM
    _bf16(out, f"{attn}.wo_a.weight", a.o_groups * a.o_lora_rank, a.n_heads * a.head_dim // a.o_groups)
    _fp8(out, f"{attn}.wo_b", d, a.o_groups * a.o_lora_rank)
    if backbone and layer in a.kv_source_layers:
        _bf16(out, f"{attn}.compressor.wkv.weight", a.head_dim, d)
        _bf16(out, f"{attn}.compressor.norm.weight", a.head_dim)
        if a.compress_ratios[layer] > 1:  # ratio 1 has one token per group: nothing to gate
            _bf16(out, f"{attn}.compressor.wgate.weight", a.head_dim, d)
        _bf16(out, f"{attn}.indexer.wk.weight", a.index_head_dim, a.head_dim)
        _bf16(out, f"{attn}.indexer.k_norm.weight", a.index_head_dim)
    if backbone and layer in a.index_source_layers:
        _fp8(out, f"{attn}.indexer.wq_b", a.index_n_heads * a.index_head_dim, a.q_lora_rank)
        _bf16(out, f"{attn}.indexer.weights_proj.weight", a.index_n_heads, d)

    routed, _ = a.moe_experts(layer)
    _bf16(out, f"{prefix}.ffn.gate.weight", routed, d)
    out[f"{prefix}.ffn.gate.bias"] = (F32, (routed,))
    if a.vision_enabled:
        out[f"{prefix}.ffn.gate.bias_vl"] = (F32, (routed,))
    for e in range(routed):
        _swiglu(out, f"{prefix}.ffn.experts.{e}", d, a.moe_inter_dim, _fp4)
    _swiglu(out, f"{prefix}.ffn.shared_experts", d, a.moe_inter_dim, _fp8)

    if backbone and layer in a.engram_layer_ids:
        rows = a.engram_num_embeddings[a.engram_layer_ids.index(layer)]
        out[f"{prefix}.engram.embed.weight"] = (F8, (rows, a.engram_head_dim))
        out[f"{prefix}.engram.embed.scale"] = (E8M0, (rows, a.engram_head_dim // BLOCK))
        n_hash_cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads
        _fp8(out, f"{prefix}.engram.wkv", d * (hc + 1), n_hash_cols * a.engram_head_dim)
        _bf16(out, f"{prefix}.engram.q_weight", hc, d)
        _bf16(out, f"{prefix}.engram.k_weight", hc, d)


def _vision(out: Expected, a: ModelArgs) -> None:
    vd, inter, d = a.vision_dim, a.vision_inter_dim, a.dim
    _bf16(out, "vision.patch_embed.proj.weight", vd, 3 * a.vision_patch_size**2)
    _bf16(out, "vision.patch_embed.proj.bias", vd)
    for b in range(a.vision_n_layers):
        p = f"vision.blocks.{b}"
        _bf16(out, f"{p}.attn.wqkv.weight", 3 * vd, vd)
        _bf16(out, f"{p}.attn.wqkv.bias", 3 * vd)
        _bf16(out, f"{p}.attn.wo.weight", vd, vd)
        _bf16(out, f"{p}.attn.wo.bias", vd)
        _bf16(out, f"{p}.mlp.w1.weight", 2 * inter, vd)  # gate and up, fused
        _bf16(out, f"{p}.mlp.w2.weight", vd, inter)
        _bf16(out, f"{p}.norm1.weight", vd)
        _bf16(out, f"{p}.norm2.weight", vd)
    _bf16(out, "vision.norm.weight", vd)
    _bf16(out, "aligner.w1.weight", d, vd * a.vision_downsample_ratio**2)
    _bf16(out, "aligner.w1.bias", d)
    _bf16(out, "aligner.w2.weight", d, d)
    _bf16(out, "aligner.w2.bias", d)
    for delimiter in ("image_start", "image_end", "image_newline"):
        _bf16(out, delimiter, d)


def expected_tensors(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype string, shape) of every tensor the checkpoint must hold, in a fixed
    order: top level, vision, backbone layers, DSpark stages."""
    a = args
    out: Expected = {}
    _bf16(out, "embed.weight", a.vocab_size, a.dim)
    _bf16(out, "head.weight", a.vocab_size, a.dim)
    _bf16(out, "norm.weight", a.dim)
    if a.vision_enabled:
        _vision(out, a)
    for layer in range(a.n_layers):
        _block(out, a, layer, f"layers.{layer}")
    for stage in range(a.n_mtp_layers):
        prefix = f"mtp.{stage}"
        _block(out, a, a.n_layers + stage, prefix)
        if stage == 0:
            _fp8(out, f"{prefix}.main_proj", a.dim, a.dim * len(a.dspark_target_layer_ids))
            _bf16(out, f"{prefix}.main_norm.weight", a.dim)
        if stage == a.n_mtp_layers - 1:
            _bf16(out, f"{prefix}.norm.weight", a.dim)
            _bf16(out, f"{prefix}.markov_head.embed.weight", a.vocab_size, a.dspark_markov_rank)
            _bf16(out, f"{prefix}.markov_head.head.weight", a.vocab_size, a.dspark_markov_rank)
            _bf16(out, f"{prefix}.confidence_head.proj.weight", 1, a.dim + a.dspark_markov_rank)
    return out
