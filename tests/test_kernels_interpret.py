"""CUDA-backend kernel logic without a GPU: Triton's interpreter (TRITON_INTERPRET=1) runs the kernels
on the CPU. The fp32 row reductions run on the interpreter as it is; the GEMMs, the activation
quantisation and sparse attention need the fixes of tests/interpreter_fixes.py (its fp32 -> bf16/fp8
conversions and bf16 dots are wrong as shipped, and it has no libdevice `exp`: the fixes give it numpy's,
so the mHC split and SwiGLU kernels are checked to a tolerance). The GPU's own rounding is checked on the
GPU machine by tests/test_kernels_cuda.py (results in kernels/FIDELITY.md); here the indexing, masking,
split/sum and slot logic are."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the dev extras install triton for these tests")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import torch
from dsflash.kernels import cuda
g = torch.Generator().manual_seed(0)
for rows, width in ((1, 5), (7, 300), (64, 1024), (3, 20480)):
    x = torch.randn(rows, width, generator=g)
    for square in (False, True):
        got = cuda.row_sum(x, square=square)
        ref = (x.double() ** (2 if square else 1)).sum(-1)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5), (rows, width, square)
        # a row's sum does not depend on the other rows of the call
        assert torch.equal(cuda.row_sum(x[rows // 2:rows // 2 + 1], square=square), got[rows // 2:rows // 2 + 1])
h = torch.randn(5, 4, 33, generator=g)
assert torch.equal(cuda.small_sum(h, 1), ((h[:, 0] + h[:, 1]) + h[:, 2]) + h[:, 3])
print("ok")
"""


def test_row_reductions_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


KERNEL_SCRIPT = """
import dataclasses
import interpreter_fixes  # noqa: F401  (before any kernel runs)
import torch
from dsflash.kernels import cpu, cuda, load_kernels
from dsflash.model.attention import softmax_pool
from dsflash.model.engram import engram_gate
from dsflash.model.mhc import hc_post, hc_pre
from dsflash.kernels.cuda import configs, experts
from dsflash.numerics import BLOCK
from dsflash.numerics.quant import fp8_act_codes, k_range_blocks
from test_kernels_cuda import act_for, attn_inputs, rand_act, rand_weight

g = torch.Generator().manual_seed(0)
def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())
for kind, n, k in (("fp8", 96, 160), ("fp4", 80, 256), ("fp8", 96, 1280), ("fp4", 128, 256)):  # the last: EVEN
    w = rand_weight(kind, n, k, g)
    wc = cuda.to_cuda_weight(w, "cpu")
    x = rand_act(5, k, g)
    full = cuda.linear(x, wc)
    assert (k_range_blocks(n, k // BLOCK) < k // BLOCK) == (k == 1280), k  # 1280: two K ranges
    assert rel(full, cpu.linear(x, w)) < 1e-5, (kind, rel(full, cpu.linear(x, w)))
    # every route that must not change bits, and a row's bits whatever the other rows
    for m in (1, 5):
        assert torch.equal(cuda.linear(x[:m], wc, spread=False), full[:m]), (kind, m)
        assert torch.equal(cuda.linear(x[:m], wc, spread=True), full[:m]), (kind, m)
        assert torch.equal(cuda.linear(x[:m], wc, fuse_quant=True), full[:m]), (kind, m)
        assert torch.equal(cuda.linear(x[:m], wc, dequantise=True), full[:m]), (kind, m)
        if kind == "fp4":
            assert torch.equal(cuda.linear(x[:m], wc, preconvert=True), full[:m]), (kind, m)
    assert torch.equal(cuda.linear(x[3:4], wc), full[3:4])
    wide = configs.linear_config(kind, n, k)  # the 64-row tiles of large M, on a decode-sized call
    narrow = configs.linear_config(kind, n, k, 5)
    assert wide != narrow and torch.equal(cuda.linear(x, wc, config=wide), full)
    for bk in (32, 64):  # the decode tiles' MMA steps narrower than their 128 (a scale word's columns)
        assert torch.equal(cuda.linear(x, wc, config=dataclasses.replace(narrow, BK=bk)), full), (kind, bk)
    # routed experts: one launch over (row, slot) pairs equals one-row calls of each slot's expert
    weights = [rand_weight(kind, n, k, g) for _ in range(5)]
    bank = cuda.expert_bank([cuda.to_cuda_weight(e, "cpu") for e in weights])
    ids = torch.tensor([[0, 2], [4, 1], [3, 0], [2, 4]])
    for per_row, xs in ((2, x[:4]), (1, rand_act(8, k, g))):
        got = cuda.expert_linear(xs, bank, ids, per_row)
        for slot, e in enumerate(ids.flatten().tolist()):
            row = xs[slot // per_row: slot // per_row + 1]
            assert torch.equal(got[slot:slot + 1], cuda.linear(row, bank[e])), (kind, per_row, slot)
            assert rel(got[slot:slot + 1], cpu.linear(row, weights[e])) < 1e-5
        assert rel(got, cpu.expert_linear(xs, cpu.expert_bank(weights), ids, per_row)) < 1e-5
        assert torch.equal(cuda.expert_linear(xs, bank, ids.to(torch.int32), per_row), got)  # ids of either width
    # a prefill's many slots share per-expert tiles (the threshold lowered: the interpreter is slow): the
    # one-row programs' bits, with an expert that has no slot, the fused and the separate quantisation; an FP4
    # bank widened to E4M3 two experts at a time (three launches) or decoded in the tiles
    one_row, experts.EXPERT_TILE_MIN_SLOTS = configs.linear_config(kind, n, k, m=1), 40
    experts.EXPERT_WIDEN_BYTES = 2 * 2 * bank.values[0].numel()
    for rows, per_row in ((20, 3), (8, 6)):
        xs = rand_act(rows, k, g)
        ids = torch.randint(1, 5, (rows, per_row), generator=g)
        got = cuda.expert_linear(xs, bank, ids, per_row, preconvert=True)
        assert torch.equal(got, cuda.expert_linear(xs, bank, ids, per_row, config=one_row)), (kind, rows)
        assert torch.equal(got, cuda.expert_linear(xs, bank, ids, per_row, preconvert=False)), (kind, rows)
        assert torch.equal(got, cuda.expert_linear(xs, bank, ids.to(torch.int32), per_row, preconvert=True))
# FP4 scales up to 2 (E8M0 words: the tiles multiply each decoded bf16 pair by one bf16 2^(b-1)) and past 2
# (float32 scales, the f16 route), in every route
for top in (1, 2):
    w = rand_weight("fp4", 128, 256, g)
    w.scale.copy_(torch.exp2(torch.randint(-125, top + 1, w.scale.shape, generator=g).float()))
    w.scale[0, 0], w.scale[1, 0] = 2.0 ** top, 2.0 ** -125
    wc = cuda.to_cuda_weight(w, "cpu")
    assert wc.scale_e8m0 == (top == 1), top
    x = rand_act(5, 256, g)
    full = cuda.linear(x, wc)
    assert rel(full, cpu.linear(x, w)) < 1e-5, (top, rel(full, cpu.linear(x, w)))
    for m in (1, 5):
        for kw in ({"dequantise": True}, {"preconvert": True}, {"spread": True}, {"spread": False}):
            assert torch.equal(cuda.linear(x[:m], wc, **kw), full[:m]), (top, m, kw)
for kind, n, k in (("fp32", 24, 1024), ("bf16", 40, 1024)):  # narrow plain GEMMs: K split by the shape
    w = rand_weight(kind, n, k, g)
    wc = cuda.to_cuda_weight(w, "cpu")
    assert configs.plain_k_per_split(configs.linear_config(kind, n, k), n, k) < k
    x = act_for(kind, 5, k, g)
    full = cuda.linear(x, wc)
    assert rel(full, cpu.linear(x, w)) < (1e-5 if kind == "fp32" else 5e-3), (kind, rel(full, cpu.linear(x, w)))
    for m in (1, 3):
        assert torch.equal(cuda.linear(x[:m], wc), full[:m]), (kind, m)
    assert torch.equal(cuda.linear(x[2:3], wc), full[2:3])
# the K ranges: a sum that one K-order pass gets wrong by 15 (tests/test_kernels_cpu.py), in one program and spread
from test_kernels_cpu import block_weight
xr = torch.zeros(1, 1024)
xr[0, ::BLOCK] = 1.0
xr[0, 0], xr[0, 31 * BLOCK] = 2.0 ** 24, -(2.0 ** 24)
wr = cuda.to_cuda_weight(block_weight(1024), "cpu")
for spread in (False, True):
    assert float(cuda.linear(xr.bfloat16(), wr, spread=spread)[0, 0]) == 15.0, spread
# an fp32 weight stored in bf16 (the head) is widened exactly in the kernel: here the same sums as the fp32-stored
# weight (on the GPU the bf16 operand layout reorders each MMA's k terms: tests/test_kernels_cuda.py)
stored = (torch.randn(40, 1024, generator=g) / 32).bfloat16()
xh = torch.randn(3, 1024, generator=g)
assert torch.equal(cuda.linear(xh, cuda.CudaWeight("fp32", stored)),
                   cuda.linear(xh, cuda.to_cuda_weight(cpu.Weight("fp32", stored.float()), "cpu")))
# grouped `wo_a`: each group's bits are a single linear's, also when that linear splits K
xg = torch.randn(3, 4, 1024, generator=g).bfloat16()
wg = (torch.randn(4, 40, 1024, generator=g) / 32).bfloat16()
assert configs.plain_k_per_split(configs.linear_config("bf16", 40, 1024), 40, 1024) < 1024
got = cuda.grouped_linear(xg, wg)
for gi in range(4):
    one = cuda.linear(xg[:, gi].contiguous(), cuda.to_cuda_weight(cpu.Weight("bf16", wg[gi]), "cpu"))
    assert torch.equal(got[:, gi], one), gi
# from PLAIN_WIDE_MIN_M rows: N-wide tiles and every K range in one program, the narrow split route's bits (bf16:
# numpy's fp32 matmul orders fp32 products by tile width, the GPU's MMA does not)
xw = torch.randn(configs.PLAIN_WIDE_MIN_M + 3, 1024, generator=g).bfloat16()
ww = cuda.to_cuda_weight(cpu.Weight("bf16", (torch.randn(40, 1024, generator=g) / 32).bfloat16()), "cpu")
wide = cuda.linear(xw, ww)
assert torch.equal(cuda.linear(xw[:5], ww), wide[:5]) and torch.equal(cuda.linear(xw[300:303], ww), wide[300:303])
xgw = torch.randn(configs.PLAIN_WIDE_MIN_M, 4, 1024, generator=g).bfloat16()
assert torch.equal(cuda.grouped_linear(xgw[:3], wg), cuda.grouped_linear(xgw, wg)[:3])
# a bf16 activation of an fp32 weight (the router, the mHC projections) and bf16 RMS inputs widen inside the
# kernels: the bits of widening them first
wf = cuda.to_cuda_weight(cpu.Weight("fp32", torch.randn(40, 1024, generator=g) / 32), "cpu")
for rows in (3, configs.PLAIN_WIDE_MIN_M + 3):
    xb = torch.randn(rows, 1024, generator=g).bfloat16()
    assert torch.equal(cuda.linear(xb, wf), cuda.linear(xb.float(), wf)), rows
mixes_in = torch.randn(4, 24, generator=g)
assert torch.equal(cuda.rms_scale(mixes_in, xb[:4], 1e-6), cuda.rms_scale(mixes_in, xb[:4].float(), 1e-6))
# mHC collapse / expand: one kernel each, the bits of the composition of this backend's ops
streams = torch.randn(6, 4, 700, generator=g).bfloat16()
pre, post = torch.rand(6, 4, generator=g), torch.rand(6, 4, generator=g) * 2
comb = torch.rand(6, 4, 4, generator=g)
y = torch.randn(6, 700, generator=g).bfloat16()
# the model's formulas over the CUDA backend's sums (what each fused kernel must reproduce)
ms = lambda x: (cuda.row_sum(x, square=True) / x.size(-1)).unsqueeze(-1)  # noqa: E731
formulas = dataclasses.replace(load_kernels("cpu"), small_sum=cuda.small_sum, row_sum=cuda.row_sum, mean_square=ms)
assert torch.equal(cuda.collapse(streams, pre), hc_pre(formulas, streams, pre))
assert torch.equal(cuda.expand(y, streams, post, comb), hc_post(formulas, y, streams, post, comb))
assert torch.equal(cuda.collapse(streams[2:3], pre[2:3]), cuda.collapse(streams, pre)[2:3])
# the MoE output: six routed rows in slot order from an fp32 zero, then the shared expert's (order matters
# from three terms on)
routed = (torch.randn(5, 6, 700, generator=g) * torch.exp2(torch.randint(-20, 20, (5, 6, 1), generator=g).float()))
routed[0, :, :8] = torch.tensor([2.0 ** 24, 1, 1, 1, 1, -2.0 ** 24]).unsqueeze(-1)  # 0 in slot order, 4 reversed
routed, shared = routed.bfloat16(), torch.randn(5, 700, generator=g).bfloat16()
assert torch.equal(cuda.moe_sum(routed, shared), cpu.moe_sum(routed, shared))
# RMSNorm: the row sum of squares, then one kernel (the interpreter's rsqrt is numpy's, so not bit-checked here)
xn = (torch.randn(5, 3, 700, generator=g) * 3).bfloat16()
wn = (1 + 0.1 * torch.randn(700, generator=g)).bfloat16()
normed = cuda.rms_norm(xn, wn, 1e-6)
composed = cpu.rms_norm(xn, wn, 1e-6, mean_square=lambda v: (cuda.row_sum(v, square=True) / v.size(-1)).unsqueeze(-1))
assert normed.shape == xn.shape and (normed.float() - composed.float()).abs().max() <= 2 ** -7 * composed.abs().max()
assert torch.equal(cuda.rms_norm(xn[1:2], wn, 1e-6), normed[1:2])
# KV / index fake-quantisation: bit-exact with numerics/quant.py, ties, zeros and extremes included
from dsflash.numerics import quant
xf = torch.randn(7, 3, 512, generator=g) * torch.exp2(torch.randint(-12, 12, (7, 3, 1), generator=g).float())
xf[0, 0, :64] = 0
xf[1, 1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -1.75, -3.5, 6.0, -6.0, 0.0, -0.0, 1e-30,
                              3e38])
xf[2, 0, :16] = -0.0
xf = xf.bfloat16()
assert torch.equal(cuda.fp8_fake_quant(xf).view(torch.int16), quant.fp8_fake_quant(xf).view(torch.int16))
for block, e4m3 in ((16, True), (32, False)):
    got = cuda.fp4_fake_quant(xf, block, e4m3_scale=e4m3).view(torch.int16)
    assert torch.equal(got, quant.fp4_fake_quant(xf, block, e4m3_scale=e4m3).view(torch.int16)), (block, e4m3)
# RoPE: the CPU's rounding points (products rounded, then added), [N, C] and [N, H, C], both directions, zeros
table = torch.polar(torch.ones(40, 32), torch.rand(40, 32, generator=g) * 6.3)
table[0] = 1  # position 0: the factor 1 + 0i, whose conjugate's -0 imaginary part must not flip a zero's sign
for shape in ((9, 96), (5, 3, 80)):
    xr = torch.randn(*shape, generator=g).bfloat16()
    xr.view(-1, shape[-1])[0, -64:] = -0.0
    pos = torch.tensor([0, 39, 7, 7, 12, 3, 0, 25, 1])[: shape[0]]
    for inverse in (False, True):
        want = cpu.rope_rotate(xr.clone(), table, pos, 64, inverse)
        got = cuda.rope_rotate(xr.clone(), table, pos, 64, inverse)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (shape, inverse)
# the packed FP4 state: numerics/packing.py's bytes, read back as the fake quantisation's bits
from dsflash.numerics import packing
for d, fmt in ((512, packing.ENTRY), (128, packing.INDEX_KEY)):
    rows = xf.view(-1, 512)[:, :d].contiguous()
    packed = cuda.fp4_quant_packed(rows, *fmt)
    assert torch.equal(packed, packing.quant_packed(rows, *fmt)), fmt
    got = cuda.fp4_dequant_packed(packed, d, *fmt).view(torch.int16)
    assert torch.equal(got, quant.fp4_fake_quant(rows, *fmt).view(torch.int16)), fmt
# SwiGLU with the clamps and the routing weight (strided slot views), and the mHC split + Sinkhorn: libdevice's
# exp is numpy's here, so within a bf16 / fp32 ulp
gu = (torch.randn(3, 2, 6, 300, generator=g) * 4).bfloat16()
wr = torch.rand(3, 6, 1, generator=g)
for got, ref in ((cuda.swiglu(gu[:, 0], gu[:, 1], 7.0, wr), cpu.swiglu(gu[:, 0], gu[:, 1], 7.0, wr)),
                 (cuda.swiglu(gu[:, 0, 0], gu[:, 1, 0], 0.0), cpu.swiglu(gu[:, 0, 0], gu[:, 1, 0], 0.0))):
    assert got.shape == ref.shape and ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()
assert torch.equal(cuda.swiglu(gu[1:2, 0], gu[1:2, 1], 7.0, wr[1:2]), cuda.swiglu(gu[:, 0], gu[:, 1], 7.0, wr)[1:2])
mixes = torch.randn(5, 24, generator=g)
hc_scale, hc_base = torch.rand(3, generator=g), torch.randn(24, generator=g) * 0.1
for got, ref in zip(cuda.hc_split_sinkhorn(mixes, hc_scale, hc_base, 4, 20, 1e-6),
                    cpu.hc_split_sinkhorn(mixes, hc_scale, hc_base, 4, 20, 1e-6)):
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), float((got - ref).abs().max())
# activation quantisation: bit-exact with numerics/quant.py
xq = rand_act(5, 192, g)
xq[0, :BLOCK] = 0
codes, words = cuda.quant_act(xq)
ref_codes, ref_scales = fp8_act_codes(xq)
assert torch.equal(codes.float(), ref_codes) and torch.equal(cuda.act_scales(words, 192), ref_scales)
# the compressor's pooling: numpy's exp stands in for expf, so within rounding of the CPU's softmax
rows = torch.randn(9, 2, 2, 64, generator=g) * 3
got = cuda.softmax_pool(rows[:, :, 0], rows[:, :, 1])
assert rel(got, softmax_pool(formulas, rows[:, :, 0], rows[:, :, 1])) < 1e-2
assert torch.equal(cuda.softmax_pool(rows[3:4, :, 0], rows[3:4, :, 1]), got[3:4])
# Engram: the row gather exact; the gate within rounding (numpy's exp, sqrt and rsqrt stand in)
from test_kernels_cuda import engram_inputs
table, scale, ids, h, key, value, qk, mask = engram_inputs(3, 4, 300, 40, 64, 3, g)
assert torch.equal(cuda.engram_rows(table, scale, ids).view(torch.int16),
                   cpu.engram_rows(table, scale, ids).view(torch.int16))
out = cuda.engram_gate(h, key, value, qk, 1e-6, mask)
assert rel(out, engram_gate(formulas, h, key, value, qk, 1e-6, mask)) < 1e-2
assert torch.equal(cuda.engram_gate(h[1:2], key[1:2], value[1:2], qk, 1e-6, mask[1:2]), out[1:2])
# sparse attention: the online softmax over 64-index blocks as the CPU's, and a query's bits alone
q, kv, sink, idx = attn_inputs(6, 16, 64, 300, 160, g)
got = cuda.sparse_attn(q, kv, sink, idx, 64 ** -0.5)
ref = cpu.sparse_attn(q, kv, sink, idx, 64 ** -0.5)
assert (got == ref).float().mean() > 0.99 and rel(got, ref) < 1e-3, rel(got, ref)
assert torch.equal(cuda.sparse_attn(q[2:3], kv, sink, idx[2:3], 64 ** -0.5), got[2:3])
# ... a few queries' score tiles computed side by side first: the bits of each program computing its own
for apart in (False, True):
    assert torch.equal(cuda.sparse_attn(q, kv, sink, idx, 64 ** -0.5, scores_apart=apart, block_o=32), got), apart
print("ok")
"""


# ~90 s on 2 cores: the Triton interpreter runs every kernel family (CI runs the slow set)
@pytest.mark.slow
def test_kernels_under_the_fixed_interpreter():
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}
    r = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


MODEL_SCRIPT = """
import dataclasses
import interpreter_fixes  # noqa: F401
import torch
import dsflash.model.transformer as transformer
from dsflash.model.state import SequenceState
from dsflash.kernels import cpu, cuda, load_kernels
from dsflash.model.load import load_model

def mean_square(x):  # the CUDA backend's
    return (cuda.row_sum(x, square=True) / x.size(-1)).unsqueeze(-1)

composed = dataclasses.replace(
    load_kernels("cpu"), small_sum=cuda.small_sum, mean_square=mean_square, row_sum=cuda.row_sum,
    rms_norm=lambda x, w, eps: cpu.rms_norm(x, w, eps, mean_square=mean_square),
    rms_scale=lambda v, x, eps: cpu.rms_scale(v, x, eps, mean_square=mean_square))
fused = dataclasses.replace(composed, rms_norm=cuda.rms_norm, rms_scale=cuda.rms_scale, collapse=cuda.collapse,
                            expand=cuda.expand, moe_sum=cuda.moe_sum, fp8_fake_quant=cuda.fp8_fake_quant,
                            fp4_fake_quant=cuda.fp4_fake_quant, fp4_quant_packed=cuda.fp4_quant_packed,
                            fp4_dequant_packed=cuda.fp4_dequant_packed, rope_rotate=cuda.rope_rotate,
                            fp4_dequant_picked=cuda.fp4_dequant_picked, attention_indices=cuda.attention_indices,
                            window_source=cuda.window_source, window_rows=cuda.window_rows)
ids = torch.randint(0, 500, (20,), generator=torch.Generator().manual_seed(0))
logits = []
for kernels in (composed, fused):
    transformer.load_kernels = lambda device, reference=False, k=kernels: k
    logits.append(load_model(CASE).forward(SequenceState(), ids).logits)
assert torch.equal(logits[0], logits[1]), float((logits[0] - logits[1]).abs().max())
print("ok")
"""


# ~20 s on 2 cores (slow set)
@pytest.mark.slow
def test_fused_elementwise_kernels_in_the_model_under_the_interpreter(golden_cases):
    """The CUDA backend's RMSNorm, mHC (mix scale, collapse, expand), MoE sum, KV fake-quant, packing and RoPE
    kernels, run by the interpreter inside a whole tiny-model forward (the model's own views, strides and row
    padding), give the logits of the torch ops they replace, on every other op of the reference backend."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}
    script = f"CASE = {str(golden_cases[0])!r}\n" + MODEL_SCRIPT
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]



def test_fp4_word_layout_decodes_to_the_checkpoint_codes():
    """fp4_words puts element 2i + h's magnitude at bit 16h + 9 - 3i and its sign at 16h + 15 - i; a
    (sign, magnitude << 9) f16 pattern times 2^14 is the E2M1 value, -0 included."""
    import numpy as np
    import torch

    from dsflash.kernels import cuda

    packed = torch.randint(0, 256, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    words = cuda.fp4_words(packed).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([packed.long() & 15, packed.long() >> 4], -1).flatten(-2).unflatten(-1, (-1, 8))
    for e in range(8):
        h, i = e % 2, e // 2
        got = ((words >> (16 * h + 9 - 3 * i)) & 7) | (((words >> (16 * h + 15 - i)) & 1) << 3)
        assert torch.equal(got, codes[..., e]), e
    patterns = np.array([((c >> 3) << 15) | ((c & 7) << 9) for c in range(16)], dtype=np.uint16)
    values = patterns.view(np.float16).astype(np.float32) * 2.0**14
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    assert (values == np.concatenate([e2m1, -e2m1])).all() and np.signbit(values[8:]).all()


INDEXER_SCRIPT = """
import interpreter_fixes  # noqa: F401  (before any kernel runs)
import torch
from dsflash.kernels import cpu, cuda
from test_kernels_cuda import indexer_inputs

g = torch.Generator().manual_seed(0)
for n, e, block, topk, blocks in ((5, 300, 8, 64, 6), (3, 77, 3, 16, 4), (1, 20, 8, 32, 9)):
    q, keys, weights, visible, keep = indexer_inputs(n, 4, 16, e, block, g, exact=True)
    for kept in (None, keep):
        got = cuda.index_scores(q, keys, weights, visible, kept, block)
        ref = cpu.index_scores(q, keys, weights, visible, kept, block, small_sum=cuda.small_sum)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (n, e, kept is None)
    # row 0: zeros of both signs (torch's sort finds -0 and +0 equal) around a few larger scores
    got[0] = torch.where(torch.arange(e) % 2 == 1, -0.0, 0.0)
    got[0, e // 3:e // 3 + 5] = 1.0
    assert len(set(got[0].tolist())) < e // 2  # many ties: the lowest index must win
    k = min(topk, e)
    assert torch.equal(cuda.topk_indices(got, k, visible, topk, kernel=True), cpu.topk_indices(got, k, visible, topk))
    assert torch.equal(cuda.candidate_blocks(got, visible, blocks, block, kernel=True),
                       cpu.candidate_blocks(got, visible, blocks, block)), (n, e)
    alone = cuda.topk_indices(got[-1:], k, visible[-1:], topk, kernel=True)
    assert torch.equal(alone, cuda.topk_indices(got, k, visible, topk, kernel=True)[-1:])
print("ok")
"""


ATTENTION_INDEX_SCRIPT = """
import dataclasses
import torch
from dsflash.kernels import cuda, load_kernels
from dsflash.model import attention
from dsflash.model.state import PositionRing
from dsflash.numerics import packing

g = torch.Generator().manual_seed(0)
ref = load_kernels("cpu")
for rows, window, p0, topk, entries in ((1, 128, 900, 64, 300), (5, 16, 3, 24, 40), (3, 8, 0, 5, 7), (2, 4, 1, 1, 3),
                                        (11, 4, 6, 2, 5)):
    positions = torch.arange(p0, p0 + rows)
    _, window_idx, _ = attention.window_source(ref, positions, rows, window, window)
    # the indexer's picks: ascending, -1 padded, some rows with none, some full
    picks = torch.full((rows, topk), -1, dtype=torch.int64)
    for r in range(rows):
        n = int(torch.randint(0, min(topk, entries) + 1, (1,), generator=g)) if r % 3 else min(topk, entries)
        picks[r, :n] = torch.randperm(entries, generator=g)[:n].sort().values
    for local in (False, True):
        want = attention.attention_indices(ref, window_idx, picks, window + rows, local)
        assert torch.equal(cuda.attention_indices(window_idx, picks, window + rows, local), want), (rows, local)
    # -1 entries anywhere (not only at the ends) keep their order too
    scrambled = torch.where(torch.rand(picks.shape, generator=g) < 0.3, -1, picks)
    want = attention.attention_indices(ref, window_idx, scrambled, window + rows, False)
    assert torch.equal(cuda.attention_indices(window_idx, scrambled, window + rows, False), want)
    # the window's side from the positions: rows past the real ones (padding), chunks longer than the ring
    for n, capacity in ((rows, window), (max(1, rows - 1), window), (rows, max(1, rows // 2)), (rows, 3 * window)):
        for got, want in zip(cuda.window_source(positions, n, window, capacity),
                             attention.window_source(ref, positions, n, window, capacity), strict=True):
            assert torch.equal(got, want), (rows, p0, n, capacity)
    # the source rows and the ring's update: fused where the ring holds the window and the chunk (no slot written
    # is read), the formula otherwise (a chunk that wraps the ring)
    fused = dataclasses.replace(ref, window_rows=cuda.window_rows)
    for n, comp in ((rows, None), (max(1, rows - 1), torch.randn(7, 16, generator=g).bfloat16())):
        for capacity in (window + n, window + n + 5, window):
            ring = PositionRing(capacity, (16,), torch.bfloat16)
            ring.data.copy_(torch.randn(capacity, 16, generator=g))
            kv = torch.randn(rows, 16, generator=g).bfloat16()
            slots, _, written = attention.window_source(ref, positions, n, window, capacity)
            before = ring.data.clone()
            want = attention.window_rows(ref, ring, slots, written, kv, n, comp)
            ring_want, ring.data = ring.data, before
            got = attention.window_rows(fused, ring, slots, written, kv, n, comp)
            assert torch.equal(got, want) and torch.equal(ring.data, ring_want), (rows, n, capacity)
    # the picked entries, decoded inside the gather
    values = (torch.randn(entries, 64, generator=g) * 3).bfloat16()
    packed = packing.quant_packed(values, *packing.ENTRY)
    got = cuda.fp4_dequant_picked(packed, picks, 64, *packing.ENTRY)
    assert torch.equal(got.view(torch.int16), attention.picked_entries(ref, packed, picks, 64).view(torch.int16))
print("ok")
"""


def test_attention_index_kernels_under_the_interpreter():
    """The window ring's slots and indices from the positions, the source rows with the ring's update, the
    attention's indices (the window's, then the picks past the window source, valid entries first in order)
    and the picked entries decoded inside their gather, each one CUDA launch, equal the model's torch formulas
    (model/attention.py) on decode- and chunk-shaped rows (padding rows, chunks longer than the ring), locally
    numbered picks or not."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", ATTENTION_INDEX_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


ROUTER_SCRIPT = """
import interpreter_fixes  # noqa: F401  (before any kernel runs)
import torch
import dataclasses
from dsflash.kernels import cuda, load_kernels
from dsflash.model.moe import route
from test_kernels_cuda import router_inputs

g = torch.Generator().manual_seed(0)
composed = dataclasses.replace(load_kernels("cpu"), small_sum=cuda.small_sum)
for e in (48, 384):
    for ties in (False, True):
        logits, bias = router_inputs(9, e, g, ties)
        for func in ("sqrtsoftplus", "sigmoid"):
            for temp, norm, asc in ((1.0, True, False), (0.7, True, True), (1.0, False, False), (1.0, True, True)):
                w, ids = cuda.moe_route(logits, bias, 6, func, temp, norm, 1.5, ascending=asc)
                rw, rids = route(composed, logits, bias, 6, func, temp, norm, 1.5, ascending=asc)
                # numpy's exp / log1p stand in for the GPU's: the picks exact, the weights to an ulp or so
                assert torch.equal(ids, rids), (e, ties, func, temp, norm, asc)
                assert torch.allclose(w, rw, rtol=1e-6, atol=0), (e, ties, func, float((w - rw).abs().max()))
                alone = cuda.moe_route(logits[4:5], bias, 6, func, temp, norm, 1.5, ascending=asc)
                assert torch.equal(alone[1], ids[4:5]) and torch.equal(alone[0], w[4:5])
# softmax, a per-row bias and given ids are the model's to compose: the kernel declines them
assert cuda.moe_route(logits, bias.expand(9, -1), 6, "sigmoid", 1.0, True, 1.5) is None
assert cuda.moe_route(logits, bias, 6, "softmax", 1.0, True, 1.5) is None
assert cuda.moe_route(logits, bias, 6, "sigmoid", 1.0, True, 1.5, ids=ids) is None
w, ids = route(dataclasses.replace(composed, moe_route=cuda.moe_route), logits, bias.expand(9, -1), 6, "sigmoid",
               1.0, True, 1.5)
assert torch.equal(ids, route(composed, logits, bias, 6, "sigmoid", 1.0, True, 1.5)[1])
print("ok")
"""


@pytest.mark.slow  # ~6 s on 2 cores
def test_moe_route_kernel_under_the_fixed_interpreter():
    """The route kernel picks the composition's experts (descending, lowest id among equal scores, -0 = +0;
    or by id) and gives its weights (within the interpreter's numpy exp / log1p), a row's alone as in the
    batch."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}
    r = subprocess.run([sys.executable, "-c", ROUTER_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_indexer_kernels_under_the_fixed_interpreter():
    """The fused indexer scores (integer inputs: exact under any dot order) equal the composition with the
    CUDA head sum; the radix-select top-k and candidate blocks equal the CPU's sort-based picks, ties
    (many, and -0 against +0) going to the lowest index."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}
    r = subprocess.run([sys.executable, "-c", INDEXER_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


SINKHORN_GRAD_SCRIPT = """
import interpreter_fixes  # noqa: F401
import torch
from dsflash.kernels import cpu
from dsflash.train.backend import _Sinkhorn
g = torch.Generator().manual_seed(0)
for lead, used in (((1,), (0, 1, 2)), ((37,), (0, 1, 2)), ((3, 5), (2,)), ((6,), (0, 1))):
    mixes = torch.randn(*lead, 24, generator=g)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g) * 0.5
    weights = [torch.randn(*lead, *shape, generator=g) for shape in ((4,), (4,), (4, 4))]

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (mixes, scale, base)]
        outs = fn(*leaves, 4, 20, 1e-6)
        sum((outs[i] * weights[i]).sum() for i in used).backward()
        return outs, [t.grad for t in leaves]

    (got, got_grads), (ref, ref_grads) = grads(_Sinkhorn.apply), grads(cpu.hc_split_sinkhorn)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())
    for a, b in zip(got_grads, ref_grads):
        assert a.shape == b.shape and float((a - b).norm() / b.norm()) < 1e-5, (lead, used)
print("ok")
"""


FIXED_POINT_SCRIPT = """
import torch
from dsflash.kernels import cuda
from dsflash.train.backend import kv_sums_fixed_point, sparse_attn_grads
from dsflash.kernels import cpu
g = torch.Generator().manual_seed(0)
for m, d, rows in ((1, 64, 3), (300, 32, 17), (129, 48, 5)):
    src = torch.randn(m, d, generator=g) * torch.logspace(-5, 2, m).unsqueeze(-1)
    idx = torch.randint(-1, rows, (m,), generator=g)
    factor = torch.ldexp(torch.ones(()), torch.tensor(40))
    got = torch.zeros(rows, d, dtype=torch.int64)
    cuda.add_rows_fixed_point(got, idx, src, factor)
    ref = torch.zeros(rows, d, dtype=torch.int64).index_add_(
        0, idx.clamp_min(0), (src * factor).to(torch.int64) * (idx >= 0).unsqueeze(-1))
    assert torch.equal(got, ref), (m, d)
# the backward's GPU path (its kv sums through the kernel) against its CPU path
n, h, d, r = 40, 4, 32, 60
q, kv = torch.randn(n, h, d, generator=g).bfloat16(), torch.randn(r, d, generator=g).bfloat16()
sink, idx = torch.randn(h, generator=g), torch.randint(-1, r, (n, 100), generator=g)
out, lse = cpu.sparse_attn_lse(q, kv, sink, idx, d ** -0.5)
d_out = torch.randn(n, h, d, generator=g).bfloat16()
a = sparse_attn_grads(q, kv, sink, idx, d ** -0.5, out, lse, d_out, kv_sums_fixed_point)
b = sparse_attn_grads(q, kv, sink, idx, d ** -0.5, out, lse, d_out)
assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
assert float((a[1].float() - b[1].float()).abs().max()) <= 2 ** -7 * float(b[1].float().abs().max())
print("ok")
"""


def test_fixed_point_row_sums_kernel_is_the_torch_op():
    """The trainer's kv-gradient sums on a GPU (kernels/cuda add_rows_fixed_point, integer atomics) give torch's
    integer sums exactly, D a power of two or not, -1 rows skipped; the sparse attention backward with them gives
    its CPU path's gradients (kv's within bf16 rounding)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", FIXED_POINT_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.slow  # ~6 s under the interpreter
def test_training_sinkhorn_backward_kernel_gives_autograds_gradients():
    """The trainer's mHC split on a GPU (train/backend.py _Sinkhorn: the forward kernel keeping its states and
    the backward kernel) against autograd through the reference, under the interpreter: the mixes', scales' and
    bases' gradients, with some outputs unused (their gradients None)."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}
    r = subprocess.run([sys.executable, "-c", SINKHORN_GRAD_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_new_kernels_compile_for_sm90():
    """The interpreter runs kernels as Python, so it misses what only the compiler rejects: compile the
    kernels not yet run on a GPU machine when written (the indexer's, the compressor's pooling, Engram's, the
    router, the trainer's mHC split and kv-gradient sums, the attention's window and indices and picked
    entries, the GEMMs' dequantisation, sparse attention's score tiles apart) for sm_90 here (Triton ships
    ptxas; no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from dsflash.kernels.cuda import attention, configs, elementwise, gemm, indexer, mhc, quant, router, weights

    def check(fn, pointers, constexprs):
        sig = {name: pointers.get(name, "constexpr" if name in constexprs else "i32") for name in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig,
                        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
        assert compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]

    pointers = {"x_ptr": "*fp8e4nv", "xs_ptr": "*i32", "w_ptr": "*u8", "ws_ptr": "*i32", "y_ptr": "*bf16",
                "part_ptr": "*fp32", "slot_ptr": "*i32", "tile_ptr": "*i32", "stride_we": "i64", "stride_wse": "i64"}
    base = {"SCALE_ROWS": 1, "SCALE_E8M0": True, "GROUP_M": 8, "RANGES": False}
    # 64-row tiles over E4M3 codes (FP8) and a prefill's expert tiles over Q8(x) in bf16 (FP4)
    check(gemm._bs_gemm_kernel, pointers, {**base, "FP4": False, "ACT": "codes", "SPREAD": False, "SLOTS": False,
                                           "GROUPED": False, "BM": 64, "BN": 64, "BK": 32, "RANGES": True,
                                           "SWAP": False, "SCALE_ROWS": 32})
    check(gemm._bs_gemm_kernel, {**pointers, "x_ptr": "*bf16"},
          {**base, "FP4": True, "ACT": "bf16", "SPREAD": False, "SLOTS": False, "GROUPED": True, "BM": 64, "BN": 64,
           "BK": 32, "RANGES": True, "SWAP": False})
    # a decode's swapped tiles (the weight as the wgmma's A operand): a dense call quantising its rows, expert slots
    for fp4, act, slots in ((False, "quantise", False), (True, "bf16", True)):
        check(gemm._bs_gemm_kernel, {**pointers, "x_ptr": "*bf16"},
              {**base, "FP4": fp4, "ACT": act, "SPREAD": True, "SLOTS": slots, "GROUPED": False, "BM": 16, "BN": 64,
               "BK": 128, "SWAP": True, "SCALE_ROWS": 1 if fp4 else 32})
    # the dequantised-operand route of a large call: Q8(x) and the weight as bf16
    check(gemm._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*bf16", "e_ptr": "*bf16"},
          {"BLOCK_M": configs.ACT_QUANT_ROWS, "BLOCK_KB": configs.ACT_QUANT_BLOCKS, "DEQUANTISE": True})
    # ... and a prefill's expert tiles over dequantised banks
    check(gemm._plain_gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*bf16",
                                    "slot_ptr": "*i32", "tile_ptr": "*i32", "group_w": "i64"},
          {"PREC": "tf32", "BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8, "SPLIT": False, "RANGES": True,
           "GATHER": True})
    for e8m0 in (False, True):
        check(weights._dequant_kernel, {"w_ptr": "*fp8e4nv", "ws_ptr": "*i32" if e8m0 else "*fp32", "o_ptr": "*bf16"},
              {"SCALE_ROWS": 32, "SCALE_E8M0": e8m0, "ROWS": configs.DEQUANT_ROWS})
    for cand, group in ((False, 1), (True, 8)):
        check(indexer._topk_kernel, {"s_ptr": "*bf16", "vis_ptr": "*i64", "o_ptr": "*i8" if cand else "*i64"},
              {"GROUP": group, "CAND": cand, "BLOCK": configs.TOPK_BLOCK // group})
    check(elementwise._softmax_pool_kernel, {"kv_ptr": "*fp32", "s_ptr": "*fp32", "o_ptr": "*bf16"},
          {"R": 2, "BLOCK": configs.MHC_BLOCK})
    check(elementwise._engram_rows_kernel, {"t_ptr": "*fp8e4nv", "s_ptr": "*u8", "id_ptr": "*i64", "o_ptr": "*bf16"},
          {"BLOCK": configs.ENGRAM_ROWS_BLOCK})
    for masked in (False, True):
        check(elementwise._engram_gate_kernel, {"h_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
                                                "qk_ptr": "*fp32", "m_ptr": "*u8", "o_ptr": "*bf16", "d": "fp32",
                                                "eps": "fp32", "scale": "fp32", "floor": "fp32"},
              {"MASK": masked, "BLOCK": configs.ROW_SUM_BLOCK})
    for keep in (False, True):
        check(indexer._index_scores_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*bf16", "vis_ptr": "*i64",
                                             "keep_ptr": "*u8", "o_ptr": "*bf16"},
              {"H": 32, "D": 128, "BLOCK": 8, "KEEP": keep, "R": configs.INDEX_SCORE_ROWS,
               "BE": configs.INDEX_SCORE_ENTRIES})
    check(attention._add_rows_fixed_point_kernel, {"src_ptr": "*fp32", "idx_ptr": "*i64", "dst_ptr": "*i64",
                                                   "factor_ptr": "*fp32"}, {"BLOCK_M": 64, "BLOCK_D": 64})
    check(attention._window_rows_kernel, {"ring_ptr": "*bf16", "slot_ptr": "*i64", "written_ptr": "*i64",
                                          "kv_ptr": "*bf16", "comp_ptr": "*bf16", "o_ptr": "*bf16"},
          {"D": 512, "WINDOW": 128, "BD": 512})
    check(attention._window_source_kernel, {"pos_ptr": "*i64", "slot_ptr": "*i64", "idx_ptr": "*i64",
                                            "written_ptr": "*i64"}, {"WINDOW": 128, "CAPACITY": 128, "BW": 128})
    for local in (False, True):
        check(attention._attention_indices_kernel, {"w_ptr": "*i64", "p_ptr": "*i64", "o_ptr": "*i64"},
              {"LOCAL": local, "BW": 128, "BP": 512})
    attn_pointers = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "sink_ptr": "*fp32", "idx_ptr": "*i32", "o_ptr": "*bf16",
                     "s_ptr": "*fp32", "scale": "fp32"}
    check(attention._attn_scores_kernel, attn_pointers, {"BLOCK_H": 64, "BLOCK_D": 512, "BLOCK_I": 64})
    for scores, block_o in ((False, 512), (True, 128)):  # a prefill's programs; a decode's, scores apart
        check(attention._sparse_attn_kernel, attn_pointers, {"BLOCK_H": 64, "BLOCK_D": 512, "BLOCK_I": 64,
                                                             "BLOCK_O": block_o, "SCORES": scores})
    for picked in (False, True):
        check(quant._fp4_dequant_packed_kernel, {"p_ptr": "*u8", "pick_ptr": "*i64", "o_ptr": "*bf16"},
              {"E4M3_SCALE": False, "G": 64, "BR": configs.FAKE_QUANT_ROWS, "PICKED": picked})
    hc_pointers = {"mix_ptr": "*fp32", "scale_ptr": "*fp32", "base_ptr": "*fp32", "eps": "fp32"}
    for save in (False, True):
        check(mhc._hc_kernel, {**hc_pointers, "pre_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32",
                               "states_ptr": "*fp32"}, {"HC": 4, "ROWS": configs.HC_ROWS, "SAVE": save})
    check(mhc._hc_backward_kernel, {**hc_pointers, "states_ptr": "*fp32", "gpre_ptr": "*fp32", "gpost_ptr": "*fp32",
                                    "gcomb_ptr": "*fp32", "dz_ptr": "*fp32"}, {"HC": 4, "ROWS": configs.HC_ROWS})
    for func in (1, 2):
        check(router._moe_route_kernel, {"logit_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32",
                                         "id_ptr": "*i64", "temp": "fp32", "scale": "fp32"},
              {"K": 6, "KP": 8, "FUNC": func, "NORM": True, "ASC": func == 2, "BLOCK_E": 512})
