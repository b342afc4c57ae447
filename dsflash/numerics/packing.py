"""Lossless packing of the FP4 caches into the model's storage format (spec §6.7).

The compressed KV holds E2M1 values with one E4M3 scale per 16 (a 512-wide entry packs to 256 + 32 =
288 bytes) and the index keys E2M1 values with one E8M0 scale per 32 (128 wide: 64 + 4 = 68 bytes).
The engine keeps them as bf16 values (each is exactly code x scale); packing recovers a valid
(codes, scale) per block from the values: the scale is the block maximum over one of the seven
non-zero E2M1 magnitudes, the one that is a representable scale and makes every value a code. The
packed bytes decode to the same bf16 bits; a block with no such scale makes `pack` return None.
"""

from __future__ import annotations

import torch

from dsflash.numerics.codecs import (
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
    pack_fp4,
    unpack_fp4,
)

_MAGNITUDES = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)
FORMATS = {"fp4_e4m3_16": (16, "e4m3"), "fp4_e8m0_32": (32, "e8m0")}


def _scale_codes(s: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, exactly representable?) of candidate scales."""
    if kind == "e4m3":
        codes = encode_e4m3(s)
        return codes, (decode_e4m3(codes) == s) & (s > 0)
    ok = (s > 0) & (torch.frexp(s).mantissa == 0.5)  # a power of two
    codes = encode_e8m0(torch.where(ok, s, torch.ones_like(s)))
    return codes, ok & (decode_e8m0(codes) == s)


def pack(values: torch.Tensor, fmt: str) -> torch.Tensor | None:
    """bf16 [n, d] FP4-valued rows -> uint8 [n, d/2 + d/block]: packed codes, then one scale byte per
    block. None if some block is not code x representable scale."""
    block, kind = FORMATS[fmt]
    n, d = values.shape
    v = values.float().reshape(n, d // block, block)
    amax = v.abs().amax(-1)
    scale = torch.ones_like(amax)
    scale_code = _scale_codes(scale, kind)[0]
    found = amax == 0  # an all-zero block takes any scale
    for g in _MAGNITUDES:
        s = amax / g
        codes, exact = _scale_codes(s, kind)
        q = v / torch.where(s > 0, s, 1.0).unsqueeze(-1)  # an all-zero block never divides by zero
        fits = exact & (decode_e2m1(encode_e2m1(q.clamp(-6, 6))) == q).all(-1) & ~found
        scale = torch.where(fits, s, scale)
        scale_code = torch.where(fits, codes, scale_code)
        found |= fits
    if not bool(found.all()):
        return None
    codes = encode_e2m1((v / scale.unsqueeze(-1)).reshape(n, d))
    return torch.cat([pack_fp4(codes), scale_code.to(torch.uint8)], dim=1)


def unpack(packed: torch.Tensor, fmt: str, d: int) -> torch.Tensor:
    block, kind = FORMATS[fmt]
    n = packed.size(0)
    codes, scale_codes = packed[:, : d // 2], packed[:, d // 2:]
    scale = decode_e4m3(scale_codes) if kind == "e4m3" else decode_e8m0(scale_codes)
    v = decode_e2m1(unpack_fp4(codes)).reshape(n, d // block, block) * scale.unsqueeze(-1)
    return v.reshape(n, d).to(torch.bfloat16)
