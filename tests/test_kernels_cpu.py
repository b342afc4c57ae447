"""The CPU reference's block-scaled GEMM: the K-range rule of the numerics (quant.k_range_blocks) and its
summation order, on inputs whose fp32 sum tells the orders apart."""

from __future__ import annotations

import torch

from dsflash.kernels import cpu
from dsflash.numerics import BLOCK
from dsflash.numerics.quant import K_RANGE_GROUP, k_range_blocks


def test_k_ranges_are_fixed_by_the_weight_shape():
    for n in (1, 24, 96, 512, 1280, 2304, 5120, 32768, 129280):
        for kb in range(1, 300):
            per = k_range_blocks(n, kb)
            ranges = -(-kb // per)
            assert per % K_RANGE_GROUP == 0 and 1 <= ranges <= 16, (n, kb)
            assert ranges == 1 or per >= 16, (n, kb)
            if kb * BLOCK < 928:
                assert ranges == 1, (n, kb)  # the tiny golden models never have a second range
    # the V4.1 decode shapes: (outputs, K blocks) -> blocks per range
    assert [k_range_blocks(n, kb) for n, kb in ((1280, 160), (32768, 40), (512, 160), (5120, 256), (2304, 160),
                                                (5120, 72))] == [16, 40, 16, 40, 16, 20]


def block_weight(k: int) -> cpu.Weight:
    """An FP8 weight row whose K block kb holds a single 1 (scale 1): block kb's product is x[BLOCK kb]."""
    values = torch.zeros(1, k)
    values[0, ::BLOCK] = 1.0
    return cpu.Weight("fp8", values, torch.ones(1, k // BLOCK))


def test_block_scaled_gemm_sums_each_k_range_then_the_ranges():
    # 32 blocks = two ranges of 16 (one output): terms 2^24, then 1 fourteen times, then 1 sixteen times,
    # the last replaced by -2^24. In one K-order sum every 1 is lost against 2^24 and the result is 0; summed
    # per range, range 1 is 2^24 and range 2 is exactly 15 - 2^24, so the result is 15.
    assert k_range_blocks(1, 32) == 16
    x = torch.zeros(1, 1024)
    x[0, ::BLOCK] = 1.0
    x[0, 0] = 2.0 ** 24
    x[0, 31 * BLOCK] = -(2.0 ** 24)
    y = cpu.linear(x.bfloat16(), block_weight(1024))
    assert y.dtype == torch.bfloat16 and float(y[0, 0]) == 15.0


def test_keyed_topk_picks_what_a_stable_descending_sort_picks():
    """topk_lowest_index's keyed top-k (rows under 2^20 values) against the stable sort it replaces, on rows
    full of ties, both zeros, infinities and NaNs, in each dtype it takes: the same indices in the same order."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for _ in range(20):
            s = (torch.randint(-4, 5, (6, 300), generator=g).float() / 4).to(dtype)
            s[0, ::7], s[1, ::5], s[2, 3], s[2, 4] = -torch.inf, torch.inf, -0.0, 0.0
            s[3, 10], s[3, 11] = torch.nan, -torch.nan
            for k in (1, 5, 64, 300):
                want = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
                assert torch.equal(cpu.topk_lowest_index(s, k), want), (dtype, k)
    # 16-bit rows take int32 keys up to 2^16 values and int64 keys beyond: both sides of the bound
    for width in (1 << 16, (1 << 16) + 1):
        s = (torch.randint(-40, 41, (2, width), generator=g).float() / 8).bfloat16()
        s[0, -5:] = torch.inf
        want = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :70]
        assert torch.equal(cpu.topk_lowest_index(s, 70), want), width
