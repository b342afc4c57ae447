"""Activation and KV fake-quantisation (spec §3), bit-exact with DeepSeek's kernels.

All functions take bf16 input (the kernels are compiled for bf16) and work on blocks along the last
dimension. Scales are powers of two computed with the kernels' exponent-bit trick, or E4M3 for the
compressed KV.
"""

from __future__ import annotations

import functools

import torch

from dsflash.numerics import BLOCK, exact_div
from dsflash.numerics.codecs import E2M1_MAX, E2M1_VALUES, E4M3_MAX, E4M3_MAX_INV

# An FP8/FP4 GEMM sums its K blocks' scaled products in ranges fixed by the weight's shape (NUMERICS_VERSION
# 3): each range in K order from a fresh fp32 sum, then the range sums in order. Narrow weights get up to 16
# ranges so that a decode step's GEMM spreads over ~512 GPU programs of 64 outputs; a range keeps at least
# 16 blocks and is a whole number of 4-block groups (the CUDA kernel's chunk: the K blocks whose E8M0 scale
# bytes share one int32 word).
K_RANGE_GROUP = 4
_K_RANGE_TILE_N, _K_RANGE_PROGRAMS, _K_RANGE_MAX, _K_RANGE_MIN_GROUPS = 64, 512, 16, 4


def k_range_blocks(n: int, kb: int) -> int:
    """K blocks per summation range of an FP8/FP4 GEMM with n outputs over kb 32-wide K blocks."""
    groups = -(-kb // K_RANGE_GROUP)
    tiles = -(-n // _K_RANGE_TILE_N)
    ranges = max(1, min(_K_RANGE_MAX, -(-_K_RANGE_PROGRAMS // tiles), groups // _K_RANGE_MIN_GROUPS))
    return K_RANGE_GROUP * -(-groups // ranges)
# the kernels multiply by reciprocals held as float32 constants, not divide by the maximum (codecs' E4M3_MAX_INV)
_E2M1_MAX_INV = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)

_E2M1_MAGNITUDES = torch.from_numpy(E2M1_VALUES[:8])  # codes 0..7: the non-negative E2M1 values
# round-to-nearest-even boundaries between consecutive E2M1 magnitudes; at an exact tie the value
# goes up only where the upper code is even (0.75 -> 1, 1.75 -> 2, 3.5 -> 4)
_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_E2M1_TIE_UP = torch.tensor([False, True, False, True, False, True, False])


def pow2_scale(amax: torch.Tensor, max_inv: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax * max_inv)), the product rounded to float32 first."""
    return pow2_ceil(amax.float() * max_inv)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 x) of a normal positive float32 x (at most 2^127), from the exponent bits plus one when the
    mantissa is non-zero: codecs.ceil_pow2_e8m0's power of two, without its host-side range checks."""
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & ((1 << 23) - 1)
    return ((exponent + (mantissa != 0).to(torch.int32)) << 23).view(torch.float32)


def e4m3_saturate(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round to nearest even, saturating at ±448 (a plain cast gives NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


@functools.cache
def _e2m1_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _E2M1_MAGNITUDES.to(device), _E2M1_MIDS.to(device), _E2M1_TIE_UP.to(device)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """float32 in [-6, 6] -> nearest E2M1 value (ties to the even code), sign of zero kept."""
    values, mids, tie_up = _e2m1_tables(x.device)
    mag = x.abs().unsqueeze(-1)
    code = (mag > mids).sum(-1) + ((mag == mids) & tie_up).sum(-1)
    return torch.where(torch.signbit(x), -values[code], values[code])


def fp8_act_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [..., K] -> (E4M3 codes as float32 values [..., K], power-of-two scales [..., K/32])."""
    assert x.dtype == torch.bfloat16
    xg = x.float().unflatten(-1, (-1, BLOCK))
    s = pow2_scale(xg.abs().amax(dim=-1).clamp_min(1e-4), E4M3_MAX_INV)
    q = e4m3_saturate(xg / s.unsqueeze(-1))
    return q.float().flatten(-2), s


def fp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Q8: quantise to FP8 per 32 with a power-of-two scale and dequantise, back in bf16."""
    assert x.dtype == torch.bfloat16
    xg = x.float().unflatten(-1, (-1, BLOCK))
    s = pow2_scale(xg.abs().amax(dim=-1).clamp_min(1e-4), E4M3_MAX_INV).unsqueeze(-1)
    return (e4m3_saturate(xg / s).float() * s).flatten(-2).to(torch.bfloat16)


def fp4_scaled(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4's scales [..., K/block] (float32: E4M3 values, or powers of two) and the values over their
    scale [..., K/block, block], clamped to the E2M1 range but not yet rounded."""
    assert x.dtype == torch.bfloat16
    xg = x.float().unflatten(-1, (-1, block))
    amax = xg.abs().amax(dim=-1)
    if e4m3_scale:
        # an all-zero group keeps a non-zero scale
        s = e4m3_saturate(exact_div(amax.clamp_min(6 * 2**-9), E2M1_MAX)).float()
    else:
        s = pow2_scale(amax.clamp_min(6 * 2**-126), _E2M1_MAX_INV)
    return s, (xg / s.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)


def fp4_fake_quant(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    """Q4: E2M1 values per `block`, with an E8M0 power-of-two scale (index keys and queries, block 32)
    or an E4M3 scale (compressed KV, block 16). Returns bf16."""
    s, v = fp4_scaled(x, block, e4m3_scale)
    return (e2m1_round(v) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)
