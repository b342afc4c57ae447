"""The FP4 caches in the model's storage format (spec §6.7), which is also how the state holds them.

A compressed KV entry is E2M1 codes with one E4M3 scale per 16 values (a 512-wide entry: 256 code bytes
then 32 scale bytes = 288 B); an index key is E2M1 codes with one E8M0 scale per 32 (128 wide: 64 + 4 =
68 B). Codes pack two to a byte, element 2k in the low nibble. `quant_packed` is quant.fp4_fake_quant
stopped before the dequantisation; `dequant_packed` finishes it: the two give fp4_fake_quant's bf16 bits
(every E2M1 value times an E4M3 or power-of-two scale is exact in float32 and in bf16; the sign of a zero
is kept in its code).
"""

from __future__ import annotations

import torch

from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import (
    decode_e4m3,
    decode_e8m0,
    decode_fp4_packed,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
    pack_fp4,
)
from dsflash.numerics.quant import fp4_scaled

ENTRY = (16, True)  # compressed KV: (block, E4M3 scale)
INDEX_KEY = (BLOCK, False)  # index keys: (block, E8M0 scale)


def packed_width(d: int, block: int) -> int:
    """Bytes of one packed d-wide row: the codes, then one scale byte per block."""
    return d // 2 + d // block


def values_per_row(width: int, block: int) -> int:
    """The d of a packed row of `width` bytes (packed_width's inverse)."""
    return width * 2 * block // (block + 2)


def check_width(packed: torch.Tensor, d: int, block: int) -> None:
    if packed.size(-1) != packed_width(d, block):
        raise ValueError(f"packed FP4 rows of width {d} have {packed_width(d, block)} bytes, got {packed.size(-1)}")


def quant_packed(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    """bf16 [n, d] -> uint8 [n, packed_width(d, block)]: Q4 codes and scale bytes."""
    s, v = fp4_scaled(x, block, e4m3_scale)
    scale_codes = encode_e4m3(s) if e4m3_scale else encode_e8m0(s)
    return torch.cat([pack_fp4(encode_e2m1(v.flatten(-2))), scale_codes.to(torch.uint8)], dim=-1)


def dequant_packed(packed: torch.Tensor, d: int, block: int, e4m3_scale: bool) -> torch.Tensor:
    """uint8 [n, packed_width(d, block)] -> the bf16 [n, d] values (fp4_fake_quant's bits)."""
    check_width(packed, d, block)
    codes, scale_codes = packed[..., : d // 2], packed[..., d // 2:]
    scale = decode_e4m3(scale_codes) if e4m3_scale else decode_e8m0(scale_codes)
    v = decode_fp4_packed(codes).unflatten(-1, (-1, block)) * scale.unsqueeze(-1)
    return v.flatten(-2).to(torch.bfloat16)
