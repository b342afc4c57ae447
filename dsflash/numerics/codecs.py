"""Bit-exact codecs between the checkpoint's raw codes and float32.

Formats (spec §3, §13.1, §14):
- E2M1 (FP4): 4-bit code, bit 3 = sign, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; two codes per byte,
  element 2k in the low nibble and 2k+1 in the high nibble (stored as I8 [out, in/2]).
- E4M3 (OCP float8_e4m3fn): bias 7, subnormals, no infinities, S.1111.111 = NaN, largest 448.
- E8M0 (scales): value 2^(byte-127), byte 255 = NaN, no sign and no zero.

Every function takes a numpy array or a torch tensor and returns the same kind; codes travel as
uint8 (torch float8 and int8 tensors are accepted and reinterpreted bytewise). Encoders round to
nearest, ties to even, and saturate instead of overflowing.
"""

from __future__ import annotations

import numpy as np
import torch

from dsflash.numerics import BLOCK

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_NAN = 0x7F
E8M0_NAN = 0xFF
E8M0_BIAS = 127

Array = np.ndarray | torch.Tensor


def _e2m1_table() -> np.ndarray:
    magnitudes = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    return np.concatenate([magnitudes, -magnitudes])


def _e4m3_table() -> np.ndarray:
    table = np.empty(256, np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[code] = np.nan
        elif exponent == 0:
            table[code] = sign * mantissa * 2.0**-9  # subnormal: mantissa/8 * 2^(1-7)
        else:
            table[code] = sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return table


def _e8m0_table() -> np.ndarray:
    powers = np.ldexp(np.float64(1.0), np.arange(E8M0_NAN) - E8M0_BIAS)  # 2^-127 is a float32 subnormal
    return np.append(powers, np.nan).astype(np.float32)


E2M1_VALUES = _e2m1_table()
E4M3_VALUES = _e4m3_table()
E8M0_VALUES = _e8m0_table()
_E2M1_T, _E4M3_T, _E8M0_T = (torch.from_numpy(t) for t in (E2M1_VALUES, E4M3_VALUES, E8M0_VALUES))


# ---------------------------------------------------------------------------------------------
# numpy <-> torch: one implementation (torch), both kinds of input
# ---------------------------------------------------------------------------------------------
def _codes(x: Array) -> torch.Tensor:
    """Codes as a uint8 tensor, sharing memory; 1-byte float8/int8 tensors are reinterpreted."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if t.dtype != torch.uint8:
        if t.element_size() != 1:
            raise TypeError(f"codes must be a 1-byte dtype, got {t.dtype}")
        t = t.view(torch.uint8)
    return t


def _floats(x: Array) -> torch.Tensor:
    t = torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x
    return t.to(torch.float32)


def _like(t: torch.Tensor, x: Array) -> Array:
    return t.numpy() if isinstance(x, np.ndarray) else t


def _lookup(table: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """table[c] for uint8 codes c: one embedding row a code, int32 indices (twice torch's float8 -> float32
    conversion on a CPU; the weights' decode runs at every GEMM of the reference backend)."""
    return torch.nn.functional.embedding(c.int(), table.to(c.device).view(table.size(0), -1)).view(
        *c.shape, *table.shape[1:])


def _decode(table: torch.Tensor, codes: Array) -> Array:
    c = _codes(codes)
    return _like(_lookup(table, c), codes)


def _nibbles(codes: Array) -> torch.Tensor:
    c = _codes(codes)
    if bool((c > 0xF).any()):
        raise ValueError("E2M1 codes are 4-bit: values above 15 found")
    return c


# ---------------------------------------------------------------------------------------------
# decode: code -> float32
# ---------------------------------------------------------------------------------------------
def decode_e2m1(codes: Array) -> Array:
    """4-bit E2M1 codes (0..15, one per element) -> float32."""
    c = _nibbles(codes)
    return _like(_lookup(_E2M1_T, c), codes)


# each byte's two E2M1 values, its low nibble's first: packed FP4 decodes in one gather
_E2M1_PAIRS = torch.stack([_E2M1_T[torch.arange(256) & 0xF], _E2M1_T[torch.arange(256) >> 4]], dim=-1)


def decode_fp4_packed(packed: Array) -> Array:
    """Packed E2M1 bytes [..., n] (pack_fp4's layout) -> float32 [..., 2n]: decode_e2m1(unpack_fp4(packed)),
    one table row a byte (the CPU backend decodes its stored FP4 weights at every GEMM: 3x faster)."""
    p = _codes(packed)
    return _like(_lookup(_E2M1_PAIRS, p).flatten(-2), packed)


def decode_e4m3(codes: Array) -> Array:
    return _decode(_E4M3_T, codes)


def decode_e8m0(codes: Array) -> Array:
    return _decode(_E8M0_T, codes)


def pack_fp4(codes: Array) -> Array:
    """4-bit codes [..., 2n] -> bytes [..., n]: element 2k in the low nibble, 2k+1 in the high nibble."""
    c = _nibbles(codes)
    if c.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {c.shape[-1]}")
    return _like(c[..., 0::2] | (c[..., 1::2] << 4), codes)


def unpack_fp4(packed: Array) -> Array:
    """Bytes [..., n] (uint8 or int8) -> 4-bit codes uint8 [..., 2n]."""
    p = _codes(packed)
    return _like(torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2), packed)


# ---------------------------------------------------------------------------------------------
# encode: float32 -> code (inputs are first rounded to float32)
# ---------------------------------------------------------------------------------------------
def _sign_bit(x: torch.Tensor) -> torch.Tensor:
    return torch.signbit(x).to(torch.int32)


def encode_e4m3(x: Array) -> Array:
    """float32 -> E4M3 code, round to nearest even, saturating at ±448 (±inf too); NaN -> 0x7F|sign."""
    v = _floats(x)
    a = v.abs().clamp(max=E4M3_MAX)
    # binade exponent, held at the subnormal floor 2^-6 (frexp gives a = m * 2^e with m in [0.5, 1))
    exponent = torch.where(a < 2.0**-6, -6, torch.frexp(a).exponent - 1)
    # number of quanta of 2^(exponent-3) (3 mantissa bits); torch.round is half-to-even
    quanta = torch.round(torch.ldexp(a, (3 - exponent).to(torch.float32))).to(torch.int32)
    # code = (biased exponent << 3 | mantissa) = (exponent + 6) * 8 + quanta; a carry into the next binade
    # (quanta == 16) lands on the right code by the same formula, and subnormals have exponent + 6 == 0
    code = (exponent + 6) * 8 + quanta
    code = torch.where(torch.isnan(a), E4M3_NAN, code) | (_sign_bit(v) << 7)
    return _like(code.to(torch.uint8), x)


def e2m1_magnitude(v: torch.Tensor) -> torch.Tensor:
    """float32 -> the E2M1 magnitude nearest |v| (round to nearest even, saturating at 6), float32."""
    a = v.abs().clamp(max=E2M1_MAX)
    # grid spacing .5 below 2, 1 below 4, 2 up to 6; ties to even multiples = ties to even codes
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.round(a / step) * step


def encode_e2m1(x: Array) -> Array:
    """float32 -> 4-bit E2M1 code (bit 3 = sign), round to nearest even, saturating at ±6; the sign
    of zero is kept. NaN has no code and raises."""
    v = _floats(x)
    if bool(torch.isnan(v).any()):
        raise ValueError("E2M1 has no NaN: input contains NaN")
    r = e2m1_magnitude(v)
    code = torch.where(r < 2, r * 2, torch.where(r < 4, r + 2, torch.where(r == 4, 6.0, 7.0)))
    return _like((code.to(torch.int32) | (_sign_bit(v) << 3)).to(torch.uint8), x)


def _positive_bits(x: Array, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    v = _floats(x)
    if not bool((v > 0).all()):
        raise ValueError(f"{what}: E8M0 holds positive values only (no zero, sign or NaN)")
    bits = v.contiguous().view(torch.int32)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def encode_e8m0(x: Array) -> Array:
    """Positive float32 -> E8M0 code, bit-identical to torch's float8_e8m0fnu cast except that it
    saturates at 2^127 instead of giving NaN: a normal value goes to the nearest power of two (a
    mantissa of exactly 1.5 rounds up); a float32 subnormal to 2^-127 when at most 2^-127, else 2^-126."""
    exponent, mantissa = _positive_bits(x, "encode_e8m0")
    code = torch.where(exponent == 0, (mantissa > 0x400000).to(torch.int32),
                       exponent + (mantissa >= 0x400000).to(torch.int32))
    return _like(code.clamp(max=E8M0_NAN - 1).to(torch.uint8), x)


def ceil_pow2_e8m0(x: Array) -> Array:
    """Positive float32 x <= 2^127 -> E8M0 code of 2^ceil(log2 x), from the exponent bits plus one
    when the mantissa is non-zero (DeepSeek's power-of-two scale rounding)."""
    exponent, mantissa = _positive_bits(x, "ceil_pow2_e8m0")
    # subnormal x lies in (0, 2^-126): 2^-127 covers up to 2^-127 itself (mantissa 0x400000)
    code = torch.where(exponent == 0, (mantissa > 0x400000).to(torch.int32),
                       exponent + (mantissa != 0).to(torch.int32))
    if bool((code >= E8M0_NAN).any()):
        raise ValueError("ceil_pow2_e8m0: values above 2^127 have no E8M0 power of two")
    return _like(code.to(torch.uint8), x)


# ---------------------------------------------------------------------------------------------
# weight layouts: quantise (for writing checkpoints) and dequantise (float32 torch tensors)
# ---------------------------------------------------------------------------------------------
E4M3_MAX_INV = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)  # a float32 reciprocal, as the kernels use


def _fp8_scale_codes(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale 2^ceil(log2(amax/448)) per block; all-zero blocks get the floor 1e-4."""
    return ceil_pow2_e8m0(amax.clamp_min(1e-4) * E4M3_MAX_INV)


def quantize_fp8_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [out, in] -> (E4M3 codes [out, in], E8M0 codes [ceil(out/block), ceil(in/block)]): one
    power-of-two scale per block x block tile (partial edge tiles included)."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -cols % block, 0, -rows % block))
    tiles = padded.unflatten(0, (-1, block)).unflatten(-1, (-1, block))  # [R, block, C, block]
    scale = _fp8_scale_codes(tiles.abs().amax(dim=(1, 3)))
    codes = encode_e4m3(tiles / decode_e8m0(scale)[:, None, :, None])
    return codes.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale


def quantize_fp8_rows(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [rows, dim] -> (E4M3 codes [rows, dim], E8M0 codes [rows, dim/block]): the Engram table
    format, one power-of-two scale per `block` values of a row."""
    groups = w.float().unflatten(-1, (-1, block))
    scale = _fp8_scale_codes(groups.abs().amax(dim=-1))
    return encode_e4m3(groups / decode_e8m0(scale).unsqueeze(-1)).flatten(-2), scale


def quantize_fp4_rows(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [out, in] -> (packed E2M1 codes uint8 [out, in/2], E8M0 codes [out, in/block]): the routed
    experts' format, one power-of-two scale 2^ceil(log2(amax/6)) per `block` inputs of a row (an all-zero
    block gets the smallest normal scale)."""
    groups = w.float().unflatten(-1, (-1, block))
    scale = ceil_pow2_e8m0(groups.abs().amax(dim=-1).clamp_min(E2M1_MAX * 2.0**-126) / E2M1_MAX)
    return pack_fp4(encode_e2m1(groups / decode_e8m0(scale).unsqueeze(-1)).flatten(-2)), scale


def _scales(scale_e8m0: Array) -> torch.Tensor:
    return torch.as_tensor(decode_e8m0(scale_e8m0))


def dequant_fp8_blocks(w_e4m3: Array, scale_e8m0: Array, block: int = BLOCK) -> torch.Tensor:
    """E4M3 [out, in] with E8M0 [ceil(out/block), ceil(in/block)] tile scales -> float32 [out, in]."""
    w = torch.as_tensor(decode_e4m3(w_e4m3))
    s = _scales(scale_e8m0).repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return w * s[: w.shape[0], : w.shape[1]]


def dequant_fp4_rows(packed_i8: Array, scale_e8m0: Array, block: int = BLOCK) -> torch.Tensor:
    """Packed E2M1 [out, in/2] with E8M0 [out, in/block] scales -> float32 [out, in]."""
    w = torch.as_tensor(decode_fp4_packed(packed_i8))
    return w * _scales(scale_e8m0).repeat_interleave(block, dim=1)


def dequant_fp8_rows(w_e4m3: Array, scale_e8m0: Array, block: int = BLOCK) -> torch.Tensor:
    """Engram table rows: E4M3 [rows, dim] with E8M0 [rows, dim/block] scales -> float32 [rows, dim]."""
    return torch.as_tensor(decode_e4m3(w_e4m3)) * _scales(scale_e8m0).repeat_interleave(block, dim=1)
