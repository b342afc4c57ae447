"""CUDA (Triton) kernels against the CPU reference backend, on fresh random inputs.

Each comparison reports ‖Δ‖/‖ref‖ and the largest distance in units in the last place of the output
dtype (bf16 or fp32), and asserts the written tolerances below. Batch invariance is checked bit for
bit: a row computed in a call of M rows equals the same row computed with M = 1, 7, 64 and 300, at
any position. Set DSFLASH_TOL_REPORT=path to append every measurement as a JSON line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import pytest
import torch

from dsflash.kernels import Kernels, cpu, load_kernels
from dsflash.model.attention import softmax_pool
from dsflash.model.engram import engram_gate
from dsflash.model.mhc import hc_post, hc_pre
from dsflash.model.moe import route
from dsflash.numerics import BLOCK, exact_div
from dsflash.numerics.quant import fp8_act_codes
from tests.test_kernels_cpu import block_weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run on the GPU machine")

if torch.cuda.is_available():
    from dsflash.bench.kernels import composed_index_scores
    from dsflash.kernels import cuda as kc
    from dsflash.kernels.cuda import configs, experts

DEV = "cuda"


@functools.cache
def composed() -> Kernels:
    """The CUDA backend without its fused ops: the model's formulas over this backend's primitive ops, whose
    bits each fused kernel must give."""
    return dataclasses.replace(load_kernels(DEV), collapse=None, expand=None, softmax_pool=None, engram_gate=None,
                               moe_route=None)

# written tolerances: (‖Δ‖/‖ref‖, max ulp of the output dtype over elements whose |ref| >= 1/8 of the
# output's rms; a result that cancels to near zero has an ulp far below its inputs' rounding, so its
# ulp distance measures the inputs' magnitude, not this kernel -- it is reported, not asserted).
# fp8/fp4 (CUDA numerics 6.cuda1): the same exact products as the CPU's (dequantised operands), summed as
# one tensor-core MMA chain per K range where the CPU sums each 32-wide block apart and adds the scaled block
# sums: another fp32 order, so an output differs only where its fp32 sums round to neighbouring bf16 values
# (1 ulp: on the H200 rel 1.01e-4 on wq_b 1280->32768, the first run); fp32: 3xTF32 tensor-core products (the
# default) in another summation order over K=5120.
TOL = {
    "fp8": (3e-4, 1),
    "fp4": (3e-4, 1),
    "bf16": (1e-3, 2),
    "fp32": (1e-5, 4096),
    "sparse_attn": (2e-3, 8),
    "hc": (1e-6, 64),
}


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bits mapped to integers whose order and distance count representable values (ulps)."""
    if t.dtype == torch.bfloat16:
        i = t.contiguous().view(torch.int16).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    i = t.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def measure(name: str, out: torch.Tensor, ref: torch.Tensor) -> tuple[float, int, int]:
    out = out.cpu()
    ref = ref.to(out.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), f"{name}: NaN in output (unwritten element?)"
    d = (out.float() - ref.float()).norm().item()
    rel = d / max(ref.float().norm().item(), 1e-30)
    ulp = (_ordered(out) - _ordered(ref)).abs()
    rms = ref.float().square().mean().sqrt()
    typical = ref.float().abs() >= rms / 8
    small = ref.float().abs() >= rms / 64
    max_ulp_big = int(ulp[typical].max()) if typical.any() else 0
    max_ulp = int(ulp.max())
    line = {"name": name, "rel": rel, "max_ulp_typical": max_ulp_big,
            "max_ulp_rms64": int(ulp[small].max()) if small.any() else 0, "max_ulp_all": max_ulp,
            "frac_bit_equal": float((ulp == 0).float().mean())}
    print("TOL", json.dumps(line))
    path = os.environ.get("DSFLASH_TOL_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    return rel, max_ulp_big, max_ulp


def check(name: str, kind: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    rel, ulp_big, _ = measure(name, out, ref)
    rel_tol, ulp_tol = TOL[kind]
    assert rel <= rel_tol, f"{name}: rel {rel:.3g} > {rel_tol}"
    assert ulp_big <= ulp_tol, f"{name}: max ulp {ulp_big} > {ulp_tol}"


# ---------------------------------------------------------------------------------------------
# random inputs
# ---------------------------------------------------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand_act(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """bf16 activations whose 32-blocks span many binades (exercises the per-block scales)."""
    x = torch.randn(m, k, generator=g)
    block_mag = torch.exp2(torch.randint(-6, 7, (m, -(-k // BLOCK)), generator=g).float()).repeat_interleave(BLOCK, 1)
    x = x * block_mag[:, :k]
    x[:, :: 97] *= 40.0  # outliers
    return x.bfloat16()


def rand_weight(kind: str, n: int, k: int, g: torch.Generator) -> cpu.Weight:
    """A CPU-reference Weight as model/weights.py builds it from a checkpoint."""
    if kind == "fp8":
        codes = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        tiles = torch.exp2(torch.randint(-14, -6, (-(-n // BLOCK), k // BLOCK), generator=g).float())
        return cpu.Weight("fp8", codes, tiles.repeat_interleave(BLOCK, 0)[:n].contiguous())
    if kind == "fp4":
        table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
        codes = table[torch.randint(0, 16, (n, k), generator=g)]
        return cpu.Weight("fp4", codes, torch.exp2(torch.randint(-10, -3, (n, k // BLOCK), generator=g).float()))
    w = torch.randn(n, k, generator=g) / k**0.5
    return cpu.Weight(kind, w.bfloat16() if kind == "bf16" else w)


def act_for(kind: str, m: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = rand_act(m, k, g)
    return x.float() if kind == "fp32" else x


# ---------------------------------------------------------------------------------------------
# activation quantisation: bit-exact
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,k", [(1, 5120), (37, 1280), (300, 160)])
def test_quant_act_bit_exact(m, k):
    g = gen(1)
    x = rand_act(m, k, g)
    x[0, :BLOCK] = 0  # an all-zero block takes the 1e-4 floor
    x[-1, BLOCK:2 * BLOCK] = torch.tensor(3.0e38).bfloat16()  # near the top of bf16
    x[-1, 2 * BLOCK:3 * BLOCK] = torch.tensor(1e-30).bfloat16()  # tiny block
    q, words = kc.quant_act(x.to(DEV))
    q_ref, s_ref = fp8_act_codes(x)
    assert torch.equal(q.float().cpu(), q_ref)
    assert torch.equal(kc.act_scales(words, k).cpu(), s_ref)


# ---------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------
LINEAR_SHAPES = [  # (kind, out N, in K): real V4.1-Flash layers, then odd sizes
    ("fp8", 1280, 5120),    # wq_a: dim -> q_lora
    ("fp8", 32768, 1280),   # wq_b: q_lora -> 64 heads x 512
    ("fp8", 512, 5120),     # wkv
    ("fp8", 5120, 8192),    # wo_b
    ("fp8", 2304, 5120),    # shared expert w1/w3
    ("fp8", 5120, 2304),    # shared expert w2
    ("fp4", 2304, 5120),    # routed expert w1/w3
    ("fp4", 5120, 2304),    # routed expert w2
    ("bf16", 128, 5120),    # indexer.wk
    ("bf16", 1024, 4096),
    ("fp32", 384, 5120),    # router gate
    ("fp8", 96, 160),       # K not a multiple of 128, N not of the tile
    ("fp4", 40, 96),
    ("bf16", 50, 72),
    ("fp32", 33, 40),
]


@pytest.mark.parametrize("kind,n,k", LINEAR_SHAPES)
def test_linear_matches_cpu(kind, n, k):
    g = gen(n * 7919 + k)
    w = rand_weight(kind, n, k, g)
    wc = kc.to_cuda_weight(w)
    m = 37
    x = act_for(kind, m, k, g)
    ref = cpu.linear(x, w)
    out_dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEV)
    y = kc.linear(x.to(DEV), wc, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == ref.dtype
    check(f"linear {kind} {k}->{n} M={m}", kind, y, ref)
    if kind in ("fp8", "fp4"):  # the spec's form: the dequantised matmul of Q8(x) and W, exact, rounded once
        q, s = fp8_act_codes(x)
        exact = (q.double() * s.double().repeat_interleave(BLOCK, -1)) @ (
            w.values.double() * w.scale.double().repeat_interleave(BLOCK, -1)).T
        check(f"linear {kind} {k}->{n} M={m} vs the exact dequantised matmul", kind, y, exact.bfloat16())
    # the same rows through the small-M route (fused quantisation, K split over programs) and alone
    assert torch.equal(kc.linear(x[:5].to(DEV), wc), y[:5])
    assert torch.equal(kc.linear(x[3:4].to(DEV), wc), y[3:4])
    if kind in ("fp8", "fp4"):  # the other quantisation path gives the same bits
        y2 = kc.linear(x.to(DEV), wc, fuse_quant=not (m <= configs.FUSE_QUANT_MAX_M))
        assert torch.equal(y, y2)


def test_linear_fp32_ieee_measured():
    """The IEEE-FMA alternative for fp32 weights: measured and bounded, not the default."""
    g = gen(9)
    w = rand_weight("fp32", 384, 5120, g)
    x = act_for("fp32", 37, 5120, g)
    y = kc.linear(x.to(DEV), kc.to_cuda_weight(w), fp32_precision="ieee")
    rel, _, _ = measure("linear fp32 ieee 5120->384 M=37", y, cpu.linear(x, w))
    assert rel <= 1e-5


def test_bf16_stored_fp32_weight_widened_in_the_kernel():
    """The head and the router are bf16 in the checkpoint and fp32 in the model: the CUDA backend keeps them
    in bf16 (half the bytes) and widens tiles in the kernel. The values are the widened weight's, but the
    bf16 operand layout orders each MMA's k terms differently, so the bits are not the fp32-stored
    kernel's (measured on the H200); the accuracy against the CPU is, and rows stay independent."""
    g = gen(12)
    stored = (torch.randn(4100, 5120, generator=g) / 64).bfloat16()
    widened = load_kernels(DEV).weight("fp32", stored, None)
    assert widened.values.dtype == torch.bfloat16
    x = act_for("fp32", 9, 5120, g)
    y = kc.linear(x.to(DEV), widened)
    assert y.dtype == torch.float32
    ref = cpu.linear(x, cpu.Weight("fp32", stored.float()))
    rel, _, _ = measure("linear fp32 (bf16-stored) 5120->4100 M=9", y, ref)
    assert rel <= TOL["fp32"][0]
    for rows in (slice(0, 5), slice(4, 5)):
        assert torch.equal(kc.linear(x[rows].to(DEV), widened), y[rows])


def test_mhc_and_moe_sum_kernels_give_the_composed_ops_bits():
    """One kernel each for the mHC stream mixing, with the bits of the torch ops they replace (this backend's
    ordered stream sum, fp32 products, one rounding), whatever the rows of the call."""
    g = gen(13)
    for n in (1, 7, 300):
        streams = torch.randn(n, 4, 5120, generator=g).bfloat16().to(DEV)
        pre, post = torch.rand(n, 4, generator=g).to(DEV), (2 * torch.rand(n, 4, generator=g)).to(DEV)
        comb = torch.rand(n, 4, 4, generator=g).to(DEV)
        y = torch.randn(n, 5120, generator=g).bfloat16().to(DEV)
        got = kc.collapse(streams, pre)
        assert torch.equal(got, hc_pre(composed(), streams, pre)), n
        assert torch.equal(kc.collapse(streams[-1:], pre[-1:]), got[-1:])
        mixed = kc.expand(y, streams, post, comb)
        assert torch.equal(mixed, hc_post(composed(), y, streams, post, comb)), n
        assert torch.equal(kc.expand(y[:1], streams[:1], post[:1], comb[:1]), mixed[:1])
        scales = torch.exp2(torch.randint(-20, 20, (n, 6, 1), generator=g).float())
        routed = torch.randn(n, 6, 5120, generator=g) * scales
        routed[0, :, :8] = torch.tensor([2.0 ** 24, 1, 1, 1, 1, -2.0 ** 24]).unsqueeze(-1)  # slot order matters
        routed = routed.bfloat16().to(DEV)
        assert torch.equal(kc.moe_sum(routed, y), cpu.moe_sum(routed, y)), n


def test_rms_norm_and_scale_kernels_give_the_composed_ops_bits():
    """RMSNorm as the fixed-order row sum of squares plus one kernel: the bits of torch's ops on the same
    mean square (Triton's rsqrt is the ftz variant of torch's instruction: equal on normal values)."""
    g = gen(14)
    k = load_kernels(DEV)
    w = (1 + 0.1 * torch.randn(5120, generator=g)).bfloat16().to(DEV)
    for shape in ((1, 5120), (7, 5120), (300, 5120), (3, 4, 5120)):
        x = (torch.randn(*shape, generator=g) * 3).bfloat16().to(DEV)
        got = kc.rms_norm(x, w, 1e-6)
        assert torch.equal(got, cpu.rms_norm(x, w, 1e-6, mean_square=k.mean_square)), shape
        assert torch.equal(kc.rms_norm(x[:1], w, 1e-6), got[:1])
    # the mHC mixes times their input's inverse RMS (20480 = 4 streams x 5120)
    x = torch.randn(37, 20480, generator=g).to(DEV)
    mixes = torch.randn(37, 24, generator=g).to(DEV)
    got = kc.rms_scale(mixes, x, 1e-6)
    assert torch.equal(got, cpu.rms_scale(mixes, x, 1e-6, mean_square=k.mean_square))
    assert torch.equal(kc.rms_scale(mixes[5:6], x[5:6], 1e-6), got[5:6])


def test_swiglu_kernel_gives_the_composed_ops_bits():
    """silu(gate) * up with the clamps and the routing weight in one kernel: the bits of torch's CUDA ops,
    for the routed slots' strided [rows, k, D] views and the shared expert's [rows, D]."""
    g = gen(17)
    gate_up = (torch.randn(5, 2, 6, 2304, generator=g) * 4).bfloat16().to(DEV)  # beyond the clamp of 7
    weights = torch.rand(5, 6, 1, generator=g).to(DEV)
    got = kc.swiglu(gate_up[:, 0], gate_up[:, 1], 7.0, weights)
    assert torch.equal(got, cpu.swiglu(gate_up[:, 0], gate_up[:, 1], 7.0, weights))
    assert torch.equal(kc.swiglu(gate_up[2:3, 0], gate_up[2:3, 1], 7.0, weights[2:3]), got[2:3])
    gate, up = gate_up[:, 0, 0], gate_up[:, 1, 0]
    for limit in (7.0, 0.0):
        assert torch.equal(kc.swiglu(gate, up, limit), cpu.swiglu(gate, up, limit)), limit


def test_softmax_pool_kernel_gives_the_composed_ops_bits():
    """The compressor's pooling (softmax over a group's 2 rows, products, sum) in one kernel: the bits of
    torch's CUDA ops on the compressor's strided [G, 2, D] views, each group alone as in a batch."""
    g = gen(19)
    rows = (torch.randn(37, 2, 2, 512, generator=g) * 3).to(DEV)  # [groups, ratio, (kv, score), D]
    kv, score = rows[:, :, 0], rows[:, :, 1]
    got = kc.softmax_pool(kv, score)
    assert torch.equal(got, softmax_pool(composed(), kv, score))
    assert torch.equal(kc.softmax_pool(kv[5:6], score[5:6]), got[5:6])
    assert measure("softmax_pool", got, softmax_pool(load_kernels("cpu"), kv.cpu(), score.cpu()))[0] < 1e-2  # expf


def engram_inputs(n, hc, d, rows, de, cols, g):
    table = (torch.randn(rows, de, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 135, (rows, de // BLOCK), dtype=torch.uint8, generator=g)  # E8M0: 2^-17 .. 2^7
    ids = torch.randint(0, rows, (n, cols), generator=g)
    h = (torch.randn(n, hc, d, generator=g) * 2).bfloat16()
    kv = torch.randn(n, (hc + 1) * d, generator=g).bfloat16()
    qk = torch.randn(hc, d, generator=g).bfloat16().float() * torch.randn(hc, d, generator=g).bfloat16().float()
    mask = torch.rand(n, generator=g) < 0.3
    key, value = kv[:, : hc * d].unflatten(-1, (hc, d)), kv[:, hc * d:]
    return table, scale.view(torch.float8_e8m0fnu), ids, h, key, value, qk, mask


def test_engram_kernels_give_the_composed_ops_bits():
    """Engram's row gather + dequantisation and its gate in one kernel each: the bits of torch's CUDA ops
    (the gate's with this backend's row sums), each token alone as in a batch."""
    g = gen(23)
    table, scale, ids, h, key, value, qk, mask = (t.to(DEV) for t in engram_inputs(7, 4, 5120, 300, 256, 6, g))
    got = kc.engram_rows(table, scale, ids)
    ref = cpu.engram_rows(table, scale, ids)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    for image in (None, mask):
        out = kc.engram_gate(h, key, value, qk, 1e-6, image)
        assert torch.equal(out, engram_gate(composed(), h, key, value, qk, 1e-6, image))
        assert torch.equal(kc.engram_gate(h[3:4], key[3:4], value[3:4], qk, 1e-6, None if image is None else
                                          image[3:4]), out[3:4])


def test_bf16_activations_widen_in_the_kernels():
    """The router's and the mHC projections' bf16 input: the fp32 GEMM (which widens it before its kernel:
    3xTF32 on a register-widened operand gives other bits) and the RMS kernels (which widen it on load) give
    the bits of an fp32 copy (narrow and wide GEMM routes)."""
    g = gen(18)
    wf = kc.to_cuda_weight(rand_weight("fp32", 384, 5120, g))
    for rows in (1, 7, configs.PLAIN_WIDE_MIN_M + 8):
        x = torch.randn(rows, 5120, generator=g).bfloat16().to(DEV)
        assert torch.equal(kc.linear(x, wf), kc.linear(x.float(), wf)), rows
    mixes = torch.randn(7, 24, generator=g).to(DEV)
    assert torch.equal(kc.rms_scale(mixes, x[:7], 1e-6), kc.rms_scale(mixes, x[:7].float(), 1e-6))


def test_k_ranges_on_the_gpu():
    """The sum that one K-order pass gets wrong by 15 (tests/test_kernels_cpu.py), at decode and prefill sizes."""
    x = torch.zeros(200, 1024)
    x[:, ::BLOCK] = 1.0
    x[:, 0], x[:, 31 * BLOCK] = 2.0 ** 24, -(2.0 ** 24)
    w = kc.to_cuda_weight(block_weight(1024))
    for m in (1, 16, 200):
        for spread in (False, True):
            y = kc.linear(x[:m].bfloat16().to(DEV), w, spread=spread)
            assert torch.equal(y.float().cpu(), torch.full((m, 1), 15.0)), (m, spread)


def test_fake_quant_kernels_are_bit_exact():
    """The window KV (FP8) and compressed KV / index (FP4) fake-quantisation kernels against numerics/quant.py
    run by torch on the same GPU tensors."""
    from dsflash.numerics import quant
    g = gen(15)
    x = torch.randn(300, 4, 512, generator=g) * torch.exp2(torch.randint(-12, 12, (300, 4, 1), generator=g).float())
    x[0, 0, :64] = 0
    x[1, 1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -1.75, -3.5, 6.0, -6.0, 0.0, -0.0, 1e-30,
                                 3e38])
    x = x.bfloat16()
    assert torch.equal(kc.fp8_fake_quant(x.to(DEV)).view(torch.int16).cpu(), quant.fp8_fake_quant(x).view(torch.int16))
    for block, e4m3 in ((16, True), (32, False)):
        got = kc.fp4_fake_quant(x.to(DEV), block, e4m3_scale=e4m3).view(torch.int16)
        want = quant.fp4_fake_quant(x, block, e4m3_scale=e4m3).view(torch.int16)  # the CPU reference
        assert torch.equal(got.cpu(), want), (block, e4m3)
        assert torch.equal(quant.fp4_fake_quant(x.to(DEV), block, e4m3_scale=e4m3).view(torch.int16).cpu(), want)


def test_packed_fp4_state_kernels_are_byte_exact():
    """The compressed KV / index keys as the state holds them: the packing kernels give numerics/packing.py's
    bytes, and read them back as the fake quantisation's bits (-0 included), whole and gathered."""
    from dsflash.numerics import packing, quant
    g = gen(16)
    x = torch.randn(300, 512, generator=g) * torch.exp2(torch.randint(-12, 12, (300, 1), generator=g).float())
    x[0, :64] = 0
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -1.75, -3.5, 6.0, -6.0, 0.0, -0.0, 1e-30,
                              3e38])
    x[2, ::3] = -0.0
    for d, fmt in ((512, packing.ENTRY), (128, packing.INDEX_KEY)):
        xd = x[:, :d].contiguous().bfloat16()
        packed = kc.fp4_quant_packed(xd.to(DEV), *fmt)
        assert torch.equal(packed.cpu(), packing.quant_packed(xd, *fmt)), fmt
        got = kc.fp4_dequant_packed(packed, d, *fmt).view(torch.int16).cpu()
        assert torch.equal(got, quant.fp4_fake_quant(xd, *fmt).view(torch.int16)), fmt
        rows = torch.tensor([5, 0, 299, 5], device=DEV)
        assert torch.equal(kc.fp4_dequant_packed(packed[rows], d, *fmt).view(torch.int16).cpu(), got[rows.cpu()])
        picks = torch.tensor([[5, 0, -1], [299, 5, -1]], device=DEV)  # the attention's picks: -1 reads row 0
        assert torch.equal(kc.fp4_dequant_picked(packed, picks, d, *fmt).view(torch.int16).cpu(),
                           got[picks.flatten().clamp_min(0).cpu()])


def test_attention_indices_kernel_gives_the_models_indices():
    """The window ring's slots and indices from the positions, the source rows with the ring's update, and the
    attention's indices (the window's, then the picks past the window source, valid entries first in order),
    a launch each, as model/attention.py composes them (decode and chunk rows, padding rows, chunks longer than
    the ring)."""
    from dsflash.model.attention import attention_indices, window_rows, window_source
    from dsflash.model.state import PositionRing
    g, ref = gen(17), load_kernels("cpu")
    for rows, window, p0, topk, entries in ((1, 128, 5000, 512, 1300), (8, 128, 60, 512, 30), (64, 128, 0, 64, 16),
                                            (300, 128, 7, 64, 40)):
        positions = torch.arange(p0, p0 + rows)
        for n, capacity in ((rows, window), (max(1, rows - 1), window), (rows, max(1, rows // 2))):
            got = kc.window_source(positions.to(DEV), n, window, capacity)
            for a, b in zip(got, window_source(ref, positions, n, window, capacity), strict=True):
                assert torch.equal(a.cpu(), b), (rows, n, capacity)
        # the source rows and the ring's update in one launch, where the ring holds the window and the chunk
        for n in (rows, max(1, rows - 1)):
            ring = PositionRing(window + 64 + n, (512,), torch.bfloat16)
            ring.data.copy_(torch.randn(ring.capacity, 512, generator=g))
            kv, comp = torch.randn(rows, 512, generator=g).bfloat16(), torch.randn(9, 512, generator=g).bfloat16()
            slots, _, written = window_source(ref, positions, n, window, ring.capacity)
            ring_gpu = ring.data.to(DEV)
            want = window_rows(ref, ring, slots, written, kv, n, comp)
            got = kc.window_rows(ring_gpu, slots.to(DEV), written.to(DEV), kv.to(DEV), n, comp.to(DEV))
            assert torch.equal(got.cpu(), want) and torch.equal(ring_gpu.cpu(), ring.data), (rows, n)
        _, window_idx, _ = window_source(ref, positions, rows, window, window)
        picks = torch.where(torch.rand(rows, topk, generator=g) < 0.4, -1,
                            torch.randint(0, entries, (rows, topk), generator=g))
        for local in (False, True):
            want = attention_indices(ref, window_idx, picks, window + rows, local)
            got = kc.attention_indices(window_idx.to(DEV), picks.to(DEV), window + rows, local)
            assert torch.equal(got.cpu(), want), (rows, local)


@pytest.mark.parametrize("d", [512, 5120, 20480])
def test_row_sum_against_the_cpu_sum(d):
    """The fixed-order row sums (RMS statistics, Engram's gate) against torch's CPU sum of the same fp32 values
    (another order): measured for FIDELITY.md and bounded; a row's bits whatever the other rows."""
    g = gen(d)
    x = torch.randn(37, d, generator=g) * torch.exp2(torch.randint(-4, 5, (37, 1), generator=g).float())
    for square, bound in ((False, 1e-6), (True, 5e-7)):  # measured on the H200: 1.8e-7, 7.5e-8
        got = kc.row_sum(x.to(DEV), square=square)
        rel, _, _ = measure(f"row_sum{' of squares' if square else ''} {d}", got, (x * x if square else x).sum(-1))
        assert rel < bound, (square, rel)
        assert torch.equal(kc.row_sum(x[5:6].to(DEV), square=square), got[5:6])


def test_rope_kernel_rounds_as_the_cpu():
    """RoPE in one kernel: the bits of the CPU composition on CPU tensors (products rounded, then added), for
    [N, C] and [N, H, C] rows, both directions, a conjugated zero included."""
    g = gen(19)
    table = torch.polar(torch.ones(300, 32), torch.rand(300, 32, generator=g) * 6.3)
    table[0] = 1
    pos = torch.randint(0, 300, (37,), generator=g)
    pos[0] = 0
    for shape in ((37, 576), (37, 64, 512)):
        x = torch.randn(*shape, generator=g).bfloat16()
        x[0, ..., -64:] = -0.0
        for inverse in (False, True):
            want = cpu.rope_rotate(x.clone(), table, pos, 64, inverse)
            got = kc.rope_rotate(x.to(DEV), table.to(DEV), pos.to(DEV), 64, inverse)
            assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), (shape, inverse)


def test_exact_div_is_the_cpu_division():
    """torch's CUDA `x / 6.0` is x * fp32(1/6) (one rounding more); numerics.exact_div divides as the CPU."""
    x = torch.rand(1 << 16, generator=gen(16)) * 100
    for d in (6.0, 5120, 3.0, 4, 0.5, 1.0):
        assert torch.equal(exact_div(x.to(DEV), d).cpu(), x / d), d
    assert not torch.equal((x.to(DEV) / 6.0).cpu(), x / 6.0)  # what exact_div is for (stays true on torch 2.11-2.13)


def test_to_cuda_weight_roundtrip():
    g = gen(7)
    w8 = rand_weight("fp8", 100, 256, g)
    c8 = kc.to_cuda_weight(w8)
    assert c8.values.dtype == torch.float8_e4m3fn and c8.scale_rows == BLOCK and c8.scale_e8m0
    assert torch.equal(c8.values.float().cpu(), w8.values)
    w4 = rand_weight("fp4", 64, 192, g)
    c4 = kc.to_cuda_weight(w4)
    assert c4.values.dtype == torch.uint8 and c4.values.shape == (64, 96) and c4.in_features == 192
    # a weight whose scales are not powers of two keeps float32 scales and still matches
    wq = cpu.Weight("fp4", w4.values, w4.scale * 1.375)
    cq = kc.to_cuda_weight(wq)
    assert cq.scale.dtype == torch.float32
    x = rand_act(5, 192, g)
    check("linear fp4 float32-scales", "fp4", kc.linear(x.to(DEV), cq), cpu.linear(x, wq))


@pytest.mark.parametrize("top", [1, 2])
def test_fp4_scales_at_the_ends_of_the_decode_range(top):
    """FP4 tiles multiply each decoded bf16 pair by one bf16 2^(b-1), so E8M0 words hold FP4 scales up to 2
    (b = 128); 2^-125 .. 2 there, and past 2 (float32 scales, the f16 route) give the CPU's values, with the
    same bits in every route (2^-126, an fp32 subnormal once times 0.5, is left out: FTZ is no concern here)."""
    g = gen(5 + top)
    w = rand_weight("fp4", 256, 512, g)
    w.scale.copy_(torch.exp2(torch.randint(-125, top + 1, w.scale.shape, generator=g).float()))
    w.scale[0, 0], w.scale[1, 0] = 2.0 ** top, 2.0 ** -125
    wc = kc.to_cuda_weight(w)
    assert wc.scale_e8m0 == (top == 1)
    x = rand_act(16, 512, g)
    full = kc.linear(x.to(DEV), wc)
    check(f"linear fp4 scales to 2^{top}", "fp4", full, cpu.linear(x, w))
    for m in (1, 5, 16):
        for kw in ({"dequantise": True}, {"preconvert": True}, {"spread": True}, {"spread": False}):
            assert torch.equal(kc.linear(x[:m].to(DEV), wc, **kw), full[:m]), (m, kw)


INVARIANCE_SHAPES = [("fp8", 1280, 5120), ("fp4", 2304, 5120), ("fp8", 96, 160), ("bf16", 1024, 4096),
                     ("fp32", 384, 5120), ("fp32", 24, 20480)]


@pytest.mark.parametrize("kind,n,k", INVARIANCE_SHAPES)
def test_linear_batch_invariant(kind, n, k):
    g = gen(11)
    wc = kc.to_cuda_weight(rand_weight(kind, n, k, g))
    rows_all = configs.PLAIN_WIDE_MIN_M + 88  # plain GEMMs: the wide-tile, one-program-ranges route
    x = act_for(kind, rows_all, k, g).to(DEV)
    full = kc.linear(x, wc)
    perm = torch.randperm(rows_all, generator=g).to(DEV)
    for m in (1, 7, 64, 300, rows_all):
        assert torch.equal(kc.linear(x[:m], wc), full[:m]), f"prefix M={m}"
        rows = perm[:m]
        assert torch.equal(kc.linear(x[rows], wc), full[rows]), f"permuted M={m}"
        if kind in ("fp8", "fp4"):  # every route that must not change bits
            for fuse in (False, True):
                assert torch.equal(kc.linear(x[rows], wc, fuse_quant=fuse), full[rows]), f"fuse={fuse} M={m}"
            for spread in (False, True):
                assert torch.equal(kc.linear(x[rows], wc, spread=spread), full[rows]), f"spread={spread} M={m}"
            for deq in (False, True):  # the operands dequantised in memory (large calls) or in the tiles
                assert torch.equal(kc.linear(x[rows], wc, dequantise=deq), full[rows]), f"dequantise={deq} M={m}"
            if kind == "fp4":
                for pre in (False, True):
                    assert torch.equal(kc.linear(x[rows], wc, preconvert=pre), full[rows]), f"pre={pre} M={m}"
    for r in (0, 123, 299):
        assert torch.equal(kc.linear(x[r:r + 1], wc), full[r:r + 1]), f"single row {r}"


# ---------------------------------------------------------------------------------------------
# sparse attention
# ---------------------------------------------------------------------------------------------
def attn_inputs(n, h, d, r, k, g, scattered=False):
    q = (torch.randn(n, h, d, generator=g) * 2).bfloat16()
    kv = torch.randn(r, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, r, (n, k), generator=g)
    n_valid = torch.randint(0, k + 1, (n,), generator=g)
    n_valid[0] = k
    if n > 2:
        n_valid[1] = 0  # a query with no valid row gives zeros
    if scattered:  # -1 anywhere (the reference allows it)
        idx = torch.where(torch.rand(n, k, generator=g) < 0.3, -1, idx)
    else:  # valid entries first, as the model lays them out
        idx = torch.where(torch.arange(k)[None, :] < n_valid[:, None], idx, -1)
    return q, kv, sink, idx.to(torch.int32)


def indexer_inputs(n, h, d, e, block, g, exact=False):
    """Index queries, keys, head weights, visible counts and kept candidate blocks. `exact`: small integer
    q and keys (every logit exact in bf16, so any dot order gives the same bits) and three weight values:
    many equal scores, for the tie rule. Row visible counts include 0, a partial block and all of e."""
    if exact:
        q = torch.randint(-2, 3, (n, h, d), generator=g).bfloat16()
        keys = torch.randint(-2, 3, (e, d), generator=g).bfloat16()
        weights = torch.tensor([0.25, -0.5, 1.0])[torch.randint(0, 3, (n, h), generator=g)].bfloat16()
    else:
        q = (torch.randn(n, h, d, generator=g) * 2).bfloat16()
        keys = torch.randn(e, d, generator=g).bfloat16()
        weights = (torch.randn(n, h, generator=g) * 0.1).bfloat16()
    visible = torch.randint(0, e + 1, (n, 1), generator=g)
    visible[0] = e
    if n > 2:
        visible[1], visible[2] = 0, block + 3
    keep = torch.rand(n, -(-e // block), generator=g) < 0.5
    return q, keys, weights, visible, keep


def router_inputs(n: int, e: int, g: torch.Generator, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits [n, e] (some past softplus's threshold of 20) and a bias [e]; `ties`: few distinct values,
    +0 and -0 among them, so equal biased scores are common."""
    if ties:
        logits = torch.randint(-2, 3, (n, e), generator=g).float()
        logits[logits == 0] = torch.where(torch.rand(int((logits == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
        return logits, torch.zeros(e)
    logits = torch.randn(n, e, generator=g) * 3
    logits[:, :3] += 25.0
    return logits, torch.randn(e, generator=g) * 0.1


@pytest.mark.parametrize("e", [48, 384])
def test_moe_route_gives_the_composed_ops_bits(e):
    """The route kernel equals the torch composition on CUDA (exact division by the temperature, torch's
    sigmoid or softplus and sqrt, the stable sort's picks, the ordered weight sum, the sort by id): ids and
    weights bit for bit, in the router's order and by id, with ties, each row alone."""
    g = gen(e)
    for ties in (False, True):
        logits, bias = (t.to(DEV) for t in router_inputs(9, e, g, ties))
        for func in ("sqrtsoftplus", "sigmoid"):
            for temp, norm, asc in ((1.0, True, False), (0.7, True, True), (1.0, False, False), (1.0, True, True)):
                got = kc.moe_route(logits, bias, 6, func, temp, norm, 1.5, ascending=asc)
                ref = route(composed(), logits, bias, 6, func, temp, norm, 1.5, ascending=asc)
                assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0]), (ties, func, temp, norm, asc)
                alone = kc.moe_route(logits[4:5], bias, 6, func, temp, norm, 1.5, ascending=asc)
                assert torch.equal(alone[0], got[0][4:5]) and torch.equal(alone[1], got[1][4:5])


@pytest.mark.parametrize("n,e", [(5, 4000), (19, 5000), (1, 300)])  # the GEMM took BK 128 below 4096 entries
def test_indexer_kernels_give_the_composed_ops_bits(n, e):
    """The fused scores equal the bf16 GEMM + composition (per-head dots, heads in order), the top-k and
    candidate blocks equal cpu.topk_indices / cpu.candidate_blocks on the same scores, each row alone."""
    g = gen(n * 7 + e)
    block, topk = 8, 512
    q, keys, weights, visible, keep = (t.to(DEV) for t in indexer_inputs(n, 32, 128, e, block, g))
    for kept in (None, keep):
        got = kc.index_scores(q, keys, weights, visible, kept, block)
        ref = composed_index_scores(q, kc.to_cuda_weight(cpu.Weight("bf16", keys)), weights, visible, kept, block)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (e, kept is None)
        assert torch.equal(kc.index_scores(q[-1:], keys, weights[-1:], visible[-1:], None if kept is None else
                                           kept[-1:], block), got[-1:])
    scores = got
    k = min(topk, e)
    picks = kc.topk_indices(scores, k, visible, topk, kernel=True)
    assert torch.equal(picks, cpu.topk_indices(scores, k, visible, topk))
    blocks = kc.candidate_blocks(scores, visible, 64, block, kernel=True)
    assert torch.equal(blocks, cpu.candidate_blocks(scores, visible, 64, block))
    assert torch.equal(kc.topk_indices(scores[-1:], k, visible[-1:], topk, kernel=True),
                       kc.topk_indices(scores, k, visible, topk, kernel=True)[-1:])


@pytest.mark.parametrize("n,h,d,r,k,scattered", [
    (19, 64, 512, 4096, 640, False),   # V4.1: 64 heads x 512, 512 top-k + 128 window
    (9, 64, 512, 1000, 160, True),
    (13, 8, 64, 300, 100, True),       # small model sizes, K not a multiple of 64
])


def test_sparse_attn_matches_cpu(n, h, d, r, k, scattered):
    g = gen(n * 1000 + k)
    q, kv, sink, idx = attn_inputs(n, h, d, r, k, g, scattered)
    scale = d ** -0.5
    ref = cpu.sparse_attn(q, kv, sink, idx, scale)
    out = torch.full((n, h, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    o = kc.sparse_attn(q.to(DEV), kv.to(DEV), sink.to(DEV), idx.to(DEV), scale, out=out)
    if not scattered:
        assert torch.equal(o[1].cpu(), torch.zeros(h, d, dtype=torch.bfloat16))
    check(f"sparse_attn N={n} H={h} D={d} K={k}", "sparse_attn", o, ref)
    o64 = kc.sparse_attn(q.to(DEV), kv.to(DEV), sink.to(DEV), idx.long().to(DEV), scale)
    assert torch.equal(o, o64)


def test_sparse_attn_batch_invariant():
    g = gen(5)
    q, kv, sink, idx = attn_inputs(300, 64, 512, 2048, 640, g)
    q, kv, sink, idx = (t.to(DEV) for t in (q, kv, sink, idx))
    scale = 512 ** -0.5
    full = kc.sparse_attn(q, kv, sink, idx, scale)
    perm = torch.randperm(300, generator=g).to(DEV)
    for m in (1, 7, 64, 300):
        rows = perm[:m]
        assert torch.equal(kc.sparse_attn(q[rows], kv, sink, idx[rows], scale), full[rows]), f"M={m}"
        assert torch.equal(kc.sparse_attn(q[:m], kv, sink, idx[:m], scale), full[:m]), f"prefix M={m}"
    # a query's output channels split over programs and its score tiles computed apart first (decode) give the
    # unsplit kernel's bits
    for block_o in (configs.SPARSE_ATTN_SLICE, 512):  # the split a few queries take, and none
        for apart in (False, True):
            got = kc.sparse_attn(q, kv, sink, idx, scale, block_o=block_o, scores_apart=apart)
            assert torch.equal(got, full), f"block_o={block_o} scores_apart={apart}"


# ---------------------------------------------------------------------------------------------
# mHC split + Sinkhorn
# ---------------------------------------------------------------------------------------------
def hc_inputs(n, g):
    mixes = torch.randn(n, 24, generator=g) * 3
    scale = torch.rand(3, generator=g) * 2 + 0.1
    base = torch.randn(24, generator=g)
    return mixes, scale, base


def test_hc_split_sinkhorn_matches_cpu():
    g = gen(3)
    mixes, scale, base = hc_inputs(1000, g)
    ref = cpu.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    out = kc.hc_split_sinkhorn(mixes.to(DEV), scale.to(DEV), base.to(DEV), 4, 20, 1e-6)
    for name, o, r in zip(("pre", "post", "comb"), out, ref, strict=True):
        assert o.shape == r.shape
        check(f"hc_split_sinkhorn {name}", "hc", o, r)
    # leading dims are kept
    m3 = mixes[:12].view(3, 4, 24)
    pre, post, comb = kc.hc_split_sinkhorn(m3.to(DEV), scale.to(DEV), base.to(DEV), 4, 20, 1e-6)
    assert pre.shape == (3, 4, 4) and comb.shape == (3, 4, 4, 4)
    assert torch.equal(comb.reshape(12, 4, 4), out[2][:12])


def test_hc_split_sinkhorn_batch_invariant():
    g = gen(4)
    mixes, scale, base = (t.to(DEV) for t in hc_inputs(300, g))
    full = kc.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    perm = torch.randperm(300, generator=g).to(DEV)
    for m in (1, 7, 64, 300):
        rows = perm[:m]
        part = kc.hc_split_sinkhorn(mixes[rows], scale, base, 4, 20, 1e-6)
        for a, b in zip(part, full, strict=True):
            assert torch.equal(a, b[rows]), f"M={m}"


@pytest.mark.parametrize("m", [1, 5, 37, 600])
def test_grouped_linear_equals_per_group_calls_and_cpu(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 8, 4096, generator=g).to(torch.bfloat16)
    w = (torch.randn(8, 1024, 4096, generator=g) * 4096 ** -0.5).to(torch.bfloat16)
    got = kc.grouped_linear(x.to(DEV), w.to(DEV))
    for gi in (0, 3, 7):
        one = kc.linear(x[:, gi].contiguous().to(DEV), kc.to_cuda_weight(cpu.Weight("bf16", w[gi]), DEV))
        assert torch.equal(got[:, gi], one)
    rel = ((got.float().cpu() - cpu.grouped_linear(x, w).float()).norm() / cpu.grouped_linear(x, w).float().norm())
    assert rel < 1e-3
    # a row's bits do not depend on the other rows
    assert torch.equal(kc.grouped_linear(x[:1].to(DEV), w.to(DEV)), got[:1])


@pytest.mark.parametrize("kind,n,k", [("fp4", 2304, 5120), ("fp4", 5120, 2304), ("fp8", 96, 160)])
def test_expert_linear_equals_one_row_calls(kind, n, k):
    """One launch over every (row, slot) pair of a step gives each slot the bits of a one-row call."""
    g = gen(n + k)
    weights = [rand_weight(kind, n, k, g) for _ in range(6)]
    bank = kc.expert_bank([kc.to_cuda_weight(w, DEV) for w in weights])
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(5)]).to(DEV)
    for per_row, x in ((3, rand_act(5, k, g)), (1, rand_act(15, k, g))):
        x = x.to(DEV)
        got = kc.expert_linear(x, bank, ids, per_row)
        for slot, e in enumerate(ids.flatten().tolist()):
            row = x[slot // per_row: slot // per_row + 1]
            assert torch.equal(got[slot:slot + 1], kc.linear(row, bank[e])), (per_row, slot)
        check(f"expert_linear {kind} {n}x{k}", kind, got.cpu(),
              cpu.expert_linear(x.cpu(), cpu.expert_bank(weights), ids.cpu(), per_row))


@pytest.mark.parametrize("n,k", [(2304, 5120), (5120, 2304)])
def test_prefill_expert_tiles_widened_in_groups_give_one_row_bits(n, k, monkeypatch):
    """A prefill's slots in per-expert tiles, its FP4 bank dequantised to bf16 a group of experts at a time (here
    three experts: four launches over 10 experts, one without slots): every slot's bits are a one-row call's."""
    g = gen(n * 7 + k)
    bank = kc.expert_bank([kc.to_cuda_weight(rand_weight("fp4", n, k, g), DEV) for _ in range(10)])
    x = rand_act(120, k, g).to(DEV)
    ids = torch.stack([torch.randperm(9, generator=g)[:6] + 1 for _ in range(120)]).to(DEV)
    assert ids.numel() >= configs.EXPERT_TILE_MIN_SLOTS
    monkeypatch.setattr(experts, "EXPERT_WIDEN_BYTES", 3 * 2 * n * k)  # three experts' bf16 weights
    got = kc.expert_linear(x, bank, ids, 6, preconvert=True)
    assert torch.equal(got, kc.expert_linear(x, bank, ids, 6))  # 72 slots an expert: not widened
    assert torch.equal(got, kc.expert_linear(x, bank, ids, 6, preconvert=False))
    assert torch.equal(got, kc.expert_linear(x, bank, ids, 6, config=configs.linear_config("fp4", n, k, m=1)))
    for slot in (0, 5, 377, 719):
        assert torch.equal(got[slot:slot + 1], kc.linear(x[slot // 6: slot // 6 + 1], bank[int(ids.flatten()[slot])]))


@pytest.mark.parametrize("rows", [3, 200])
def test_expert_slots_filled_from_pinned_memory_give_the_banks_bits(rows):
    """The expert cache's slots (model/expert_cache.py): a pinned host bank filled by expert_put, five slots
    filled from it on a side stream, then expert_linear over the slots with the ids remapped expert -> slot
    gives the resident bank's bits: a step's one-row programs (3 rows) and a prefill's tiles (600 slots)."""
    n, k = 2304, 5120
    g = gen(rows)
    ws = [kc.to_cuda_weight(rand_weight("fp4", n, k, g), DEV) for _ in range(8)]
    bank = kc.expert_bank(ws)
    host = kc.expert_slots(ws[0], 8, True)
    for e, w in enumerate(ws):
        kc.expert_put(host, e, w)
    torch.cuda.synchronize()
    assert host.values.is_pinned() and host.scale.is_pinned()
    used = [6, 1, 3, 4, 0]  # the expert in each slot
    slots = kc.expert_slots(ws[0], len(used), False)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for s, e in enumerate(used):
            kc.expert_put(slots, s, host[e])
    torch.cuda.current_stream().wait_stream(side)
    remap = torch.full((8,), -1, dtype=torch.int64)
    remap[used] = torch.arange(len(used))
    ids = torch.stack([torch.tensor(used)[torch.randperm(5, generator=g)[:3]] for _ in range(rows)]).to(DEV)
    assert (ids.numel() >= configs.EXPERT_TILE_MIN_SLOTS) == (rows == 200)
    x = rand_act(rows, k, g).to(DEV)
    assert torch.equal(kc.expert_linear(x, slots, remap.to(DEV)[ids], 3), kc.expert_linear(x, bank, ids, 3))
    with pytest.raises(ValueError, match="differs"):
        kc.expert_put(slots, 0, kc.to_cuda_weight(rand_weight("fp4", 64, k, g), DEV))


@pytest.mark.parametrize("kind,n,k", [s for s in LINEAR_SHAPES if s[0] in ("fp8", "fp4")])
def test_narrow_and_large_tiles_give_the_wide_tiles_bits(kind, n, k):
    """Calls of <= 16 rows use 16-row swapped tiles (64 weight rows on the wgmma's M) with 128-wide MMA steps,
    FP8 calls of >= LARGE_TILE_MIN_M rows 128x128 tiles; their bits must equal the 64-row tiles' (32-wide
    steps), and so must other steps of either tile."""
    g = gen(n * 31 + k)
    wc = kc.to_cuda_weight(rand_weight(kind, n, k, g))
    x = rand_act(16, k, g).to(DEV)
    wide = configs.linear_config(kind, n, k)
    narrow = configs.linear_config(kind, n, k, 16)
    assert narrow != wide and narrow.BK != wide.BK
    expected = kc.linear(x, wc, config=wide, spread=False)
    for spread in (False, None):
        assert torch.equal(kc.linear(x, wc, spread=spread), expected)
    for cfg in (dataclasses.replace(narrow, BK=32), dataclasses.replace(narrow, BK=64),
                dataclasses.replace(wide, BK=128)):
        assert torch.equal(kc.linear(x, wc, config=cfg, spread=False), expected), cfg
    x = rand_act(configs.LARGE_TILE_MIN_M + 40, k, g).to(DEV)
    large = configs.linear_config(kind, n, k, x.size(0))
    assert (large != wide) == (kind == "fp8")
    assert torch.equal(kc.linear(x, wc), kc.linear(x, wc, config=wide))
