"""Codecs: exhaustive code tables against torch's own float8 types, round trips, ties, saturation, and
the three weight layouts against the golden cases' reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import (
    E2M1_VALUES,
    ceil_pow2_e8m0,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    decode_fp4_packed,
    dequant_fp4_rows,
    dequant_fp8_blocks,
    dequant_fp8_rows,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
    pack_fp4,
    quantize_fp8_blocks,
    quantize_fp8_rows,
    unpack_fp4,
)

# the golden cases' own numpy reader (load_case.py), an independent implementation
from tests.conftest import TEXT_CASE, reference

ALL_CODES = torch.arange(256, dtype=torch.uint8)
E4M3_FINITE = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN in the same places, every other value equal bit for bit (so -0 differs from 0)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# exhaustive decode tables
# ---------------------------------------------------------------------------------------------
def test_e4m3_table_equals_torch():
    assert _same(decode_e4m3(ALL_CODES), ALL_CODES.view(torch.float8_e4m3fn).float())
    assert decode_e4m3(torch.tensor([0x7E, 0xFE, 0x01, 0x08], dtype=torch.uint8)).tolist() == [448, -448, 2**-9, 2**-6]
    assert torch.isnan(decode_e4m3(torch.tensor([0x7F, 0xFF], dtype=torch.uint8))).all()


def test_e8m0_table_equals_torch():
    assert _same(decode_e8m0(ALL_CODES), ALL_CODES.view(torch.float8_e8m0fnu).float())
    assert decode_e8m0(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [2.0**-127, 1.0, 2.0**127]


def test_e2m1_table():
    values = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert values.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(values[8])  # code 8 is -0
    packed = torch.arange(256, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)  # torch's own FP4 pairs
    assert torch.equal(unpack_fp4(packed.view(torch.uint8)).flatten()[0::2], torch.arange(256) & 0xF)
    with pytest.raises(ValueError, match="4-bit"):
        decode_e2m1(torch.tensor([16], dtype=torch.uint8))
    # packed bytes in one gather: the values (and -0s) of unpacking, then decoding, every byte, numpy too
    every = torch.arange(256, dtype=torch.uint8).view(16, 16)
    assert torch.equal(decode_fp4_packed(every).view(torch.int32), decode_e2m1(unpack_fp4(every)).view(torch.int32))
    assert np.array_equal(decode_fp4_packed(every.numpy()), decode_e2m1(unpack_fp4(every)).numpy())


def test_decoders_take_numpy_and_torch_storage_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    assert isinstance(decode_e4m3(codes), np.ndarray)
    np.testing.assert_array_equal(decode_e4m3(codes), reference.e4m3_to_f32(codes))
    with np.errstate(over="ignore"):  # the reader computes 2^128 for the NaN code before masking it
        np.testing.assert_array_equal(decode_e8m0(codes), reference.e8m0_to_f32(codes))
    assert _same(decode_e4m3(ALL_CODES.view(torch.float8_e4m3fn)), decode_e4m3(ALL_CODES))
    assert _same(decode_e8m0(ALL_CODES.view(torch.float8_e8m0fnu)), decode_e8m0(ALL_CODES))


# ---------------------------------------------------------------------------------------------
# encode: round trips, ties, saturation
# ---------------------------------------------------------------------------------------------
def test_e4m3_encode_round_trips_every_code():
    assert torch.equal(encode_e4m3(decode_e4m3(E4M3_FINITE)), E4M3_FINITE)
    nan_codes = encode_e4m3(torch.tensor([float("nan"), -float("nan")]))
    assert (nan_codes & 0x7F).tolist() == [0x7F, 0x7F]


def test_e4m3_ties_go_to_the_even_code():
    positive = decode_e4m3(torch.arange(0x7F, dtype=torch.uint8))  # 0 .. 448
    mids = (positive[:-1] + positive[1:]) / 2  # exact in float32
    lower = torch.arange(0x7E, dtype=torch.int32)
    expected = (lower + (lower & 1)).to(torch.uint8)  # of the two neighbours, the even code
    assert torch.equal(encode_e4m3(mids), expected)
    assert torch.equal(encode_e4m3(-mids), expected | 0x80)
    assert torch.equal(encode_e4m3(mids), _torch_e4m3(mids))


def test_e4m3_saturates_and_keeps_the_sign_of_zero():
    x = torch.tensor([448.0, 463.99, 464.0, 1e30, float("inf"), -float("inf"), -500.0, 0.0, -0.0, 1e-30, -1e-30])
    assert encode_e4m3(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x00, 0x80, 0x00, 0x80]


def test_e4m3_encode_matches_torch_on_random_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g) * torch.exp2(torch.randint(-14, 12, (1 << 20,), generator=g).float())
    assert torch.equal(encode_e4m3(x), _torch_e4m3(x))
    np.testing.assert_array_equal(encode_e4m3(x.numpy()), _torch_e4m3(x).numpy())


def test_e2m1_encode_round_trips_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(encode_e2m1(decode_e2m1(codes)), codes)


def test_e2m1_ties_and_saturation():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rounded = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # spec §3
    x = torch.tensor(ties)
    assert decode_e2m1(encode_e2m1(x)).tolist() == rounded
    assert decode_e2m1(encode_e2m1(-x)).tolist() == [-v for v in rounded]
    assert encode_e2m1(torch.tensor([6.0, 7.0, 1e9, float("inf"), -7.0])).tolist() == [7, 7, 7, 7, 15]
    assert encode_e2m1(torch.tensor([0.0, -0.0, -0.1])).tolist() == [0, 8, 8]  # sign of zero kept
    with pytest.raises(ValueError, match="NaN"):
        encode_e2m1(torch.tensor([float("nan")]))


def test_e2m1_encode_is_nearest_value():
    x = torch.linspace(-7, 7, 100_001)
    got = decode_e2m1(encode_e2m1(x))
    distance = (x.clamp(-6, 6).unsqueeze(-1) - torch.from_numpy(E2M1_VALUES)).abs()
    assert torch.equal((got - x.clamp(-6, 6)).abs(), distance.min(-1).values)


def test_e8m0_encode():
    powers = torch.exp2(torch.arange(-127, 128, dtype=torch.float32))
    assert torch.equal(encode_e8m0(powers), torch.arange(255, dtype=torch.uint8))
    assert torch.equal(ceil_pow2_e8m0(powers), torch.arange(255, dtype=torch.uint8))
    g = torch.Generator().manual_seed(1)
    x = torch.rand(1 << 18, generator=g) * torch.exp2(torch.randint(-150, 127, (1 << 18,), generator=g).float())
    x = x[x > 0]
    assert torch.equal(encode_e8m0(x), x.to(torch.float8_e8m0fnu).view(torch.uint8))
    assert encode_e8m0(torch.tensor([2.0**127 * 1.9, float("inf")])).tolist() == [254, 254]  # saturates
    with pytest.raises(ValueError, match="positive"):
        encode_e8m0(torch.tensor([0.0]))


def test_ceil_pow2_e8m0():
    x = torch.tensor([1.0, 1.0000001, 1.5, 2.0, 3.0, 0.75, 2.0**-127, 2.0**-127 * 1.1, 2.0**-140])
    assert ceil_pow2_e8m0(x).tolist() == [127, 128, 128, 128, 129, 127, 0, 1, 0]
    with pytest.raises(ValueError, match="2\\^127"):
        ceil_pow2_e8m0(torch.tensor([2.0**127 * 1.5]))


def test_fp4_packing():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]  # element 2k low nibble, 2k+1 high nibble
    assert torch.equal(unpack_fp4(packed.view(torch.int8)), codes)
    np.testing.assert_array_equal(unpack_fp4(pack_fp4(codes.numpy())), codes.numpy())
    all_codes = torch.arange(16, dtype=torch.uint8).repeat(16)
    assert torch.equal(unpack_fp4(pack_fp4(all_codes)), all_codes)


# ---------------------------------------------------------------------------------------------
# weight layouts against the golden reader (load_case.py's dequant_weight)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def golden_weights():
    weights, _ = reference.read_safetensors_raw(TEXT_CASE / "model.safetensors")
    return weights


def _torch_codes(weights, name):
    return torch.from_numpy(weights[name][2].copy()).view(torch.uint8)


def test_dequant_layouts_match_the_golden_reader(golden_weights):
    layouts = {"F8_E4M3": 0, "I8": 0}
    for name, (dtype, _, _) in golden_weights.items():
        if dtype not in layouts:
            continue
        w, s = _torch_codes(golden_weights, name), _torch_codes(golden_weights, name[: -len("weight")] + "scale")
        if dtype == "I8":
            got = dequant_fp4_rows(w, s)
        elif ".engram.embed." in name:
            got = dequant_fp8_rows(w, s)
        else:
            got = dequant_fp8_blocks(w, s)
        assert got.dtype == torch.float32
        assert np.array_equal(got.numpy(), reference.dequant_weight(golden_weights, name)), name
        layouts[dtype] += 1
    assert layouts["F8_E4M3"] > 0 and layouts["I8"] > 0


def test_dequant_takes_checkpoint_dtypes_and_partial_tiles():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 72, generator=g)  # neither dimension a multiple of 32
    codes, scale = quantize_fp8_blocks(w)
    assert codes.shape == (40, 72) and scale.shape == (2, 3)
    from_storage = dequant_fp8_blocks(codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu))
    assert torch.equal(from_storage, dequant_fp8_blocks(codes, scale))
    assert (from_storage - w).abs().max() <= w.abs().max() / 16  # 3 mantissa bits


def test_quantize_fp8_blocks_as_the_reference_recipe():
    """One power-of-two scale 2^ceil(log2(amax * float32(1/448))) per 32x32 tile, codes = RNE cast."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g) * 0.05
    codes, scale = quantize_fp8_blocks(w)
    tiles = w.unflatten(0, (2, BLOCK)).unflatten(-1, (3, BLOCK))
    ratio = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
    s = torch.exp2(torch.ceil(torch.log2(ratio.double()))).float()
    assert torch.equal(decode_e8m0(scale), s)
    assert torch.equal(codes, _torch_e4m3(tiles / s[:, None, :, None]).flatten(2).flatten(0, 1))


def test_requantizing_golden_weights_is_lossless(golden_weights):
    name = "layers.0.attn.wq_b.weight"
    w = torch.from_numpy(reference.dequant_weight(golden_weights, name))
    assert torch.equal(dequant_fp8_blocks(*quantize_fp8_blocks(w)), w)
    name = "layers.1.engram.embed.weight"
    rows = torch.from_numpy(reference.dequant_weight(golden_weights, name))
    assert torch.equal(dequant_fp8_rows(*quantize_fp8_rows(rows)), rows)
