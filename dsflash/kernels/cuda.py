"""CUDA backend (Triton): the CPU reference's kernels with the same signatures and numerics.

Exported: `linear(x, w)`, `expert_linear(x, bank, experts, slots_per_row)`, `sparse_attn(q, kv, sink, idx,
scale)`, `hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)`, the fused elementwise ops (`rms_norm`,
`rms_scale`, `collapse`, `expand`, `moe_sum`, `swiglu`, `fp8_fake_quant`, `fp4_fake_quant`: each one launch
with the rounding points of the torch composition it replaces, IEEE divisions, fp fusion off), the packed
FP4 state's `fp4_quant_packed` / `fp4_dequant_packed` (numerics/packing.py's bytes), plus `Weight`,
`CudaWeight`, `to_cuda_weight`, `expert_bank` and `quant_act`.

Numerics (spec §3, as dsflash/kernels/cpu.py):
- FP8/FP4 linear: the activation is quantised to E4M3 per 32 values with a power-of-two scale (the
  exponent-bit trick, bit-exact with numerics/quant.py), each 32-wide K block's product is one
  tensor-core dot with a fresh fp32 accumulator, scaled by a_s * b_s and added in K order to the fp32
  sum of its K range (ranges fixed by the weight's shape, quant.k_range_blocks), the range sums added in
  order, then rounded once to bf16, as the CPU does. With power-of-two scales the scaling is exact, so
  a difference from the CPU can only come from inside a block's 32-term dot (tensor-core vs CPU fp32
  summation; measured: FIDELITY.md); the MMA takes f16 operands: E4M3 codes convert exactly, FP4 weight
  codes are stored in a word layout (`fp4_words`) that shifts and masks turn into f16 pairs of value / 2^14
  (every E2M1 value is an f16 value; the 2^14 goes into the exact power-of-two weight scale).
- bf16/fp32 linear: one tiled dot with fp32 accumulation over K in fixed BK steps (fp32 weights use
  3xTF32 tensor-core products by default, IEEE fp32 FMA dots on request); output in the weight's dtype.
- sparse_attn: one program per (query, 64 heads, output channels); online softmax over blocks of 64
  indices with the probabilities rounded to bf16 before the PV product, fp32 running max/denominator,
  sink added last. Each program computes every score; up to 64 queries split the 512 output channels 4 ways.
- indexer: the scores in one kernel (per-head dots, the composition's bf16 rounding points, the heads added
  in order, the masks); top-k and candidate blocks by a radix select of 16-bit order keys, one program per
  row (lowest index first among equal scores), or torch's sort for a few long rows (the same picks).
- hc_split_sinkhorn: fp32, one row's 24 mixes through the whole split and 20 normalisations in one
  pass; a one-warp program takes a fixed tile of 4 rows that never interact.

Batch invariance: a row's bits never depend on how many rows share the call. Every kernel's tile
shape, K step and K split is a function of the weight's (N, K) or of the head/dim sizes only (never
of M), there is no autotuning and no atomics, and each output element is computed by the same
instruction sequence wherever its row sits in a tile. The M-dependent choices give identical bits by
construction and are tested to: fusing the activation quantisation into the GEMM (the quantisation is
exact bit arithmetic); for M <= 16, 16-row tiles, and running the K ranges as separate programs whose
sums a second kernel adds in range order (one program adds them in the same order); for M <= 64, the
attention's output channels over several programs (each computes the same scores); for M >= 128,
widening FP4 weights to E4M3 once per call instead of per tile; for plain GEMMs of M >= 512, N-wide tiles
(the same MMA per output element) with the shape-fixed K ranges added in one program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsflash.kernels import cpu
from dsflash.kernels.cpu import Weight
from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import E2M1_MAX, E4M3_MAX, decode_e2m1, encode_e2m1, pack_fp4
from dsflash.numerics.packing import check_width, packed_width
from dsflash.numerics.quant import K_RANGE_GROUP, k_range_blocks

__all__ = ["Weight", "CudaWeight", "to_cuda_weight", "quant_act", "act_scales", "fp4_to_fp8", "linear",
           "expert_bank", "expert_linear", "ExpertBank", "moe_route", "sparse_attn", "hc_split_sinkhorn",
           "LinearConfig",
           "linear_config", "collapse", "expand", "moe_sum", "swiglu", "rms_norm", "rms_scale", "fp8_fake_quant",
           "fp4_fake_quant", "fp4_quant_packed", "fp4_dequant_packed", "rope_rotate", "index_scores", "topk_indices",
           "candidate_blocks"]

_E4M3_MAX_INV = tl.constexpr(1.0 / E4M3_MAX)  # rounded to float32 in the product, as codecs.E4M3_MAX_INV
_E2M1_MAX_INV = tl.constexpr(1.0 / E2M1_MAX)
_BLOCK = tl.constexpr(BLOCK)  # numerics.BLOCK in the kernels (a kernel reads only constexpr globals)
_FP4_E4M3_SCALE_FLOOR = tl.constexpr(6 * 2.0 ** -9)  # quant.fp4_fake_quant's clamps of a group's amax
_FP4_POW2_SCALE_FLOOR = tl.constexpr(6 * 2.0 ** -126)
# M-dependent choices that never change bits (see the module docstring and the invariance tests):
FUSE_QUANT_MAX_M = 16  # up to this many rows the GEMM quantises its own activation tile (2-3 us faster)
NARROW_TILE_MAX_M = 16  # up to this many rows FP8/FP4 GEMMs use 16-row tiles (same bits as 64-row ones)
LARGE_TILE_MIN_M = 4096  # from this many rows FP8 GEMMs use 128x128 tiles (same bits as 64-row ones)
# Triton 3.6 contracts a * b + c into an FMA by default and 3.10 will not: every launch names its choice, so a
# Triton upgrade cannot change a kernel's bits (kernels that must round each product pass False)
FP_FUSION = True
SPREAD_MAX_M = 16  # up to this many rows a GEMM's K ranges run as separate programs (sums added in order)
FP4_PRECONVERT_M = 128  # from this many rows FP4 weights are widened to E4M3 once per call, not per tile
# MoE chunks of any size go through expert_linear (one launch per projection): one-row programs for a few
# rows, per-expert tiles from EXPERT_TILE_MIN_SLOTS slots (no host read of the routing, no loop over experts)
SLOT_MOE_ROWS = 1 << 62


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------
_ONE_WORD = tl.constexpr(0x7F7F7F7F)  # four E8M0 bytes of 2^0


@dataclass
class CudaWeight(Weight):
    """A Weight laid out for the CUDA kernels.

    fp8: `values` float8_e4m3fn [out, in]. fp4: `values` uint8 [out, in/2] in the word layout of
    `fp4_words` (each 8 elements one int32 word the kernel decodes with shifts and masks). bf16/fp32:
    `values` in that dtype [out, in]; an fp32 weight stored as bf16 in the checkpoint
    (the head, the router: widened by the model) keeps bf16 values, widened exactly tile by tile in the
    kernel -- half the bytes, the same values (another k order inside the MMA: FIDELITY.md).
    `scale` (fp8/fp4), when every scale is a normal power of two (always, for checkpoint weights):
    int32 words [ceil(in/128), ceil(out/scale_rows)], byte j of word c holding the E8M0 exponent
    (2^(byte-127)) of K block 4c+j, padded with 127; otherwise float32 [4*ceil(in/128),
    ceil(out/scale_rows)] padded with 1.0 (a slower path). `scale_rows` weight rows share one scale
    (32 for FP8's 32x32 tiles when the scales allow it, else 1).
    """

    scale_rows: int = 1

    @property
    def in_features(self) -> int:
        return self.values.size(1) * (2 if self.kind == "fp4" else 1)

    @property
    def scale_e8m0(self) -> bool:
        return self.scale is not None and self.scale.dtype == torch.int32


# An FP4 weight's 8 elements per int32 word: element 2i + h's magnitude (3 bits) at bits 16h + 9 - 3i and
# its sign at bit 16h + 15 - i. Shifting a word left by 3i and by i and masking gives elements 2i and 2i + 1
# as the two f16 halves of one register, each the f16 pattern (sign, magnitude << 9) of its value / 2^14
# (E2M1's subnormal 0.5 included: the E2M1 and f16 grids agree below and above 1 up to that factor).
_FP4_MAG_SHIFT = [16 * (e % 2) + 9 - 3 * (e // 2) for e in range(8)]
_FP4_SIGN_SHIFT = [16 * (e % 2) + 15 - e // 2 for e in range(8)]


def fp4_words(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint FP4 bytes [..., K/2] (element 2k in the low nibble) -> the kernels' word layout (uint8,
    same shape; K a multiple of 8)."""
    b = packed.to(torch.int64)
    codes = torch.stack([b & 15, b >> 4], -1).flatten(-2).unflatten(-1, (-1, 8))
    mag = torch.tensor(_FP4_MAG_SHIFT, device=packed.device)
    sign = torch.tensor(_FP4_SIGN_SHIFT, device=packed.device)
    words = (((codes & 7) << mag) | ((codes >> 3) << sign)).sum(-1)  # disjoint bits: the sum is the OR
    return words.to(torch.int32).contiguous().view(torch.uint8).view(packed.shape)


def _pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """float32 [rows, KB] -> K-block-major int32 words [ceil(KB/4), rows] of E8M0 bytes when every scale
    is exactly 2^(b-127) with b in 1..254, else float32 [4*ceil(KB/4), rows] padded with 1.0."""
    rows, kb = scale.shape
    pad = -kb % K_RANGE_GROUP
    bits = scale.contiguous().view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if bool(((mantissa == 0) & (exponent >= 1) & (exponent <= 254) & (bits >= 0)).all()):
        e = torch.nn.functional.pad(exponent.to(torch.uint8), (0, pad), value=127)
        return e.t().contiguous().view(-1, K_RANGE_GROUP, rows).permute(0, 2, 1).contiguous().view(torch.int32)[..., 0]
    return torch.nn.functional.pad(scale, (0, pad), value=1.0).t().contiguous()


def weight_from_codes(kind: str, codes: torch.Tensor, scale: torch.Tensor, device: torch.device) -> CudaWeight:
    """A checkpoint weight straight from its stored codes, with no float detour: fp8 E4M3 [out, in] with
    E8M0 tile scales [ceil(out/32), in/32], or fp4 bytes [out, in/2] with E8M0 scales [out, in/32]."""
    packed = _pack_scales(scale.to(device).float())
    if kind == "fp8":
        return CudaWeight("fp8", codes.to(device).contiguous(), packed, BLOCK)
    return CudaWeight("fp4", fp4_words(codes.to(device).view(torch.uint8)), packed, 1)


def to_cuda_weight(w: Weight, device: torch.device | str | None = None) -> CudaWeight:
    """Convert a CPU-reference Weight (float32 code values + per-(row, K-block) float32 scales) to the
    CUDA layout. Lossless: E4M3/E2M1 code values and power-of-two scales are stored exactly."""
    device = torch.device(device if device is not None else "cuda")
    if isinstance(w, CudaWeight):
        if w.values.device == device:
            return w
        return CudaWeight(w.kind, w.values.to(device), None if w.scale is None else w.scale.to(device), w.scale_rows)
    if w.kind in ("bf16", "fp32"):
        dtype = torch.bfloat16 if w.kind == "bf16" else torch.float32
        return CudaWeight(w.kind, w.values.to(device=device, dtype=dtype).contiguous())
    if w.kind not in ("fp8", "fp4"):
        raise ValueError(f"unknown weight kind {w.kind!r}")
    n, k = w.values.shape
    if k % BLOCK:
        raise ValueError(f"{w.kind} weight needs in_features divisible by {BLOCK}, got {k}")
    vals = w.values.float().cpu()
    scale = w.scale.float().cpu()
    assert scale.shape == (n, k // BLOCK), (scale.shape, (n, k // BLOCK))
    rows = 1
    if w.kind == "fp8":
        codes = vals.to(torch.float8_e4m3fn)
        if not torch.equal(codes.float(), vals):
            raise ValueError("fp8 weight values are not all E4M3 values")
        # one scale per BLOCK x BLOCK tile: keep one row of scales per BLOCK weight rows when the rows agree
        groups = torch.nn.functional.pad(scale, (0, 0, 0, -n % BLOCK), value=float("nan")).view(-1, BLOCK, k // BLOCK)
        if bool(((groups == groups[:, :1]) | torch.isnan(groups)).all()):
            scale, rows = scale[::BLOCK].contiguous(), BLOCK
        values = codes.to(device)
    else:
        codes = encode_e2m1(vals)
        if not torch.equal(decode_e2m1(codes), vals):
            raise ValueError("fp4 weight values are not all E2M1 values")
        values = fp4_words(pack_fp4(codes).to(device))
    return CudaWeight(w.kind, values, _pack_scales(scale).to(device), rows)



# ---------------------------------------------------------------------------------------------
# activation quantisation (shared by the standalone kernel and the fused GEMM prologue)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _quant_tile(xf):
    """float32 [R, 32] (from bf16) -> (E4M3 codes [R, 32], scale exponent bytes [R] int32, scales [R])
    exactly as quant.fp8_act_codes: s = 2^ceil(log2(max(amax, 1e-4) * f32(1/448))),
    q = e4m3_rne(clamp(x/s, ±448))."""
    amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-4)
    bits = (amax * _E4M3_MAX_INV).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1/s exactly (s is a normal power of two)
    q = tl.clamp(xf * inv[:, None], -448.0, 448.0).to(tl.float8e4nv)
    return q, e, s


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, e_ptr, M, KB, stride_xm, stride_qm,
                      BLOCK_M: tl.constexpr, BLOCK_KB: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    for j in tl.static_range(BLOCK_KB):
        kb = pid_k * BLOCK_KB + j
        if kb < KB:
            cols = kb * _BLOCK + tl.arange(0, _BLOCK)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=rmask[:, None], other=0.0)
            q, e, _s = _quant_tile(x.to(tl.float32))
            tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q, mask=rmask[:, None])
            # byte kb % 4 of word (kb // 4, row): words [ceil(KB/4), M]
            tl.store(e_ptr + ((kb // 4) * M + rows).to(tl.int64) * 4 + kb % 4, e.to(tl.uint8), mask=rmask)


def quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> (E4M3 codes float8_e4m3fn [M, K], scale words int32 [ceil(K/128), M]: byte j of
    word c is the E8M0 exponent of row's K block 4c+j, padded with 127). Bit-exact with
    quant.fp8_act_codes; `act_scales` decodes the words to its [M, K/32] float32 form."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.size(1) % BLOCK == 0
    x = x.contiguous()
    m, k = x.shape
    kb = k // BLOCK
    kc = triton.cdiv(kb, K_RANGE_GROUP)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    e = torch.empty((kc, m, K_RANGE_GROUP), dtype=torch.uint8, device=x.device)
    if kb % K_RANGE_GROUP:
        e[-1] = 127  # bytes past the last K block: 2^0
    if m:
        bkb = 8
        grid = (triton.cdiv(m, 32), triton.cdiv(kb, bkb))
        _act_quant_kernel[grid](x, q, e, m, kb, x.stride(0), q.stride(0), BLOCK_M=32, BLOCK_KB=bkb, num_warps=4,
                                enable_fp_fusion=FP_FUSION)
    return q, e.view(torch.int32)[..., 0]


def act_scales(words: torch.Tensor, k: int) -> torch.Tensor:
    """Scale words [ceil(K/128), M] -> float32 scales [M, K/32] (for tests)."""
    e = words.contiguous().unsqueeze(-1).view(torch.uint8)  # [KC, M, 4]
    e = e.permute(1, 0, 2).reshape(words.size(1), -1)[:, : k // BLOCK]
    return (e.to(torch.int32) << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------------
# block-scaled FP8/FP4 GEMM
# ---------------------------------------------------------------------------------------------
@triton.jit
def _e2m1_bits(c, MANTISSA: tl.constexpr, HALF: tl.constexpr, SIGN: tl.constexpr):
    """4-bit E2M1 codes (int32) -> the bit patterns (int32) of the same values in a float format whose
    mantissa starts at bit MANTISSA - 1, whose 0.5 is HALF and whose sign is bit SIGN: magnitude m >= 2 is
    2^(e-1)(1+f/2) -> (m << MANTISSA) + HALF; m = 1 (0.5) -> HALF; m = 0 -> 0. E4M3: (2, 0x30, 7)."""
    mag = c & 7
    b = tl.where(mag >= 2, (mag << MANTISSA) + HALF, tl.where(mag == 1, HALF, 0))
    return b | ((c & 8) << (SIGN - 3))


@triton.jit
def _fp4_word_values(w, BN: tl.constexpr):
    """A block's FP4 words [BN, 4] (fp4_words) -> the f16 operand [32, BN]: each value / 2^14."""
    i = tl.arange(0, 4)[None, None, :]
    # register i of a word: elements 2i and 2i + 1 as its two f16 halves
    r = ((w[:, :, None] << (3 * i)) & 0x0E000E00) | ((w[:, :, None] << i) & -2147450880)  # 0x80008000
    r = tl.reshape(r, [BN, _BLOCK // 2])
    pairs = tl.join((r & 0xFFFF).to(tl.int16), (r >> 16).to(tl.int16))
    return tl.trans(tl.reshape(pairs, [BN, _BLOCK]).to(tl.float16, bitcast=True))


@triton.jit
def _word_scale(word, j: tl.constexpr):
    """E8M0 byte j of an int32 word -> float32 2^(byte-127)."""
    return (((word >> (8 * j)) & 0xFF) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _load_block(x_rows, w_rows, kb, KB, mmask, nmask, FP4: tl.constexpr):
    """K block kb's activation and weight tiles as stored (zeros past the KB blocks of K)."""
    kin = kb < KB
    a = tl.load(x_rows + kb * _BLOCK, mask=mmask[:, None] & kin, other=0.0)
    if FP4:
        w = tl.load(w_rows + kb * 4, mask=nmask[:, None] & kin, other=0)
    else:
        w = tl.load(w_rows + kb * _BLOCK, mask=nmask[None, :] & kin, other=0.0)
    return a, w


@triton.jit
def _block_term(a, w, aw, bw, j: tl.constexpr, kb, ws_cols, stride_wsk, nmask, FP4: tl.constexpr,
                FUSE_QUANT: tl.constexpr, SCALE_E8M0: tl.constexpr, BN: tl.constexpr):
    """One K block's scaled product dot32(A, B) * a_s * b_s, fp32 [BM, BN]; j: the block's byte in the
    chunk's scale words."""
    if FUSE_QUANT:
        a, _e, a_s = _quant_tile(a.to(tl.float32))
    else:
        a_s = _word_scale(aw, j)
    if FP4:
        b = _fp4_word_values(w, BN)
    else:
        b = w
    if SCALE_E8M0:
        b_s = _word_scale(bw, j)
    else:
        b_s = tl.load(ws_cols + kb * stride_wsk, mask=nmask, other=1.0)
    if FP4:  # the f16 operand holds value / 2^14 (exact, and so is the MMA's sum: all scaled alike)
        b_s = b_s * 16384.0
    # f16 operands hold every E4M3 (2^-9 ... 448) and E2M1 code exactly (E4M3 -> f16 is one hardware
    # conversion per pair), and the f16 MMA accumulates in fp32, so the block's 32 exact products are
    # summed like the CPU reference's fp32 GEMM (the FP8 MMA keeps fewer accumulator bits and moved every
    # golden battery row off the reference)
    partial = tl.dot(a.to(tl.float16), b.to(tl.float16))
    # a_s * b_s is exact (a_s is a power of two), so partial * it is the reference's (partial * a_s) * b_s,
    # exact too; the caller's add is the only rounding
    return partial * (a_s[:, None] * b_s[None, :])


@triton.jit(do_not_specialize=["M", "stride_xs", "stride_pk", "expert_lo", "expert_hi"])
def _bs_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, slot_ptr, tile_ptr, M, N, KB, chunks_per_split,
                    stride_xm, stride_wn, stride_wsk, stride_ym, stride_xs, stride_pk, stride_we, stride_wse,
                    slots_per_row, expert_lo, expert_hi,
                    FP4: tl.constexpr, FUSE_QUANT: tl.constexpr, SCALE_ROWS: tl.constexpr,
                    SCALE_E8M0: tl.constexpr, SPREAD: tl.constexpr, SLOTS: tl.constexpr, GROUPED: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, RANGES: tl.constexpr):
    """y[M, N] = the block-scaled product (see linear), fp32 sums rounded once to bf16. K runs in chunks of
    4 blocks (one scale word); the chunks form ranges of `chunks_per_split` (quant.k_range_blocks, fixed by
    the weight's shape): each range's terms are added in K order to a fresh fp32 sum, and the range sums in range order.
    The loads are plain, so that Triton's pipeliner streams them through shared memory (cp.async,
    num_stages deep): a register double buffer measured 2-3x slower at large M (bench/results).
    SPREAD: program_id(1) takes one range and stores its sum to part[s, m, n], which _ordered_sum_kernel
    adds in range order -- the bits of one program looping over the ranges.
    SLOTS (routed experts): program_id(2) is slot s, one output row computed as a one-row call would
    compute it, with activation row s // slots_per_row and expert slot[s] of a stacked weight bank.
    GROUPED (routed experts, many slots): program_id(2) is tile t of up to BM slots of one expert
    (tile[t] = (expert, first, count): slots slot[first .. first + count), grouped by expert); each slot's
    row is computed as in SLOTS (a row's bits never depend on its tile) and stored at its slot's row; only the
    tiles of experts [expert_lo, expert_hi) work, the bank at w_ptr holding just those experts."""
    if SLOTS:
        s = tl.program_id(2)
        e = tl.load(slot_ptr + s).to(tl.int64)
        w_ptr += e * stride_we
        ws_ptr += e * stride_wse
        x_ptr += (s // slots_per_row).to(tl.int64) * stride_xm
        xs_ptr += s // slots_per_row
        y_ptr += s.to(tl.int64) * stride_ym
        part_ptr += s.to(tl.int64) * N
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    rk = tl.arange(0, _BLOCK)
    in_rows = rm  # activation rows
    out_rows = rm  # output rows
    KC = tl.cdiv(KB, 4)
    if GROUPED:
        t = tl.program_id(2)
        e = tl.load(tile_ptr + 3 * t).to(tl.int64)
        count = tl.load(tile_ptr + 3 * t + 2)
        count = tl.where((e >= expert_lo) & (e < expert_hi), count, 0)
        w_ptr += (e - expert_lo) * stride_we
        ws_ptr += (e - expert_lo) * stride_wse
        mmask = tl.arange(0, BM) < count
        out_rows = tl.load(slot_ptr + tl.load(tile_ptr + 3 * t + 1) + tl.arange(0, BM), mask=mmask, other=0)
        in_rows = out_rows // slots_per_row
        KC = tl.where(count > 0, KC, 0)  # the table's spare tiles and other experts' tiles do no work
    x_rows = x_ptr + in_rows[:, None].to(tl.int64) * stride_xm + rk[None, :]
    if FP4:  # the block's 4 words per weight row
        w_rows = ((w_ptr + rn[:, None].to(tl.int64) * stride_wn).to(tl.pointer_type(tl.int32))
                  + tl.arange(0, 4)[None, :])
    else:
        w_rows = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    ws_cols = ws_ptr + rn // SCALE_ROWS
    xs_rows = xs_ptr + in_rows
    c_lo = 0
    c_hi = KC
    if SPREAD:
        c_lo = tl.program_id(1) * chunks_per_split
        c_hi = tl.minimum(c_lo + chunks_per_split, KC)
    if not FUSE_QUANT:
        aw_next = tl.load(xs_rows + c_lo * stride_xs, mask=mmask, other=_ONE_WORD)
    if SCALE_E8M0:
        bw_next = tl.load(ws_cols + c_lo * stride_wsk, mask=nmask, other=_ONE_WORD)
    # one loop over the chunks (a loop per range would drain Triton's load pipeline at every range end).
    # RANGES (the program crosses range ends): `total` sums the current range, added to `acc` where the
    # range ends -- a second accumulator, ~70 more registers on 64x64 tiles, so only where needed
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if RANGES:
        total = tl.zeros([BM, BN], dtype=tl.float32)
    for c in range(c_lo, c_hi):
        more = c + 1 < c_hi
        aw = 0
        bw = 0
        if not FUSE_QUANT:
            aw = aw_next
            aw_next = tl.load(xs_rows + (c + 1) * stride_xs, mask=mmask & more, other=_ONE_WORD)
        if SCALE_E8M0:
            bw = bw_next
            bw_next = tl.load(ws_cols + (c + 1) * stride_wsk, mask=nmask & more, other=_ONE_WORD)
        for j in tl.static_range(4):
            kb = c * 4 + j
            a, w = _load_block(x_rows, w_rows, kb, KB, mmask, nmask, FP4)
            # a block past K adds +0 to a sum that is never -0
            term = _block_term(a, w, aw, bw, j, kb, ws_cols, stride_wsk, nmask, FP4, FUSE_QUANT, SCALE_E8M0, BN)
            if RANGES:
                total += term
            else:
                acc += term
        if RANGES:
            if ((c + 1) % chunks_per_split == 0) | (c + 1 == KC):  # the range ends
                acc += total
                total = tl.zeros([BM, BN], dtype=tl.float32)
    # SPREAD: acc is this program's range sum, stored for _ordered_sum_kernel
    mask = mmask[:, None] & nmask[None, :]
    if SPREAD:
        part = part_ptr + tl.program_id(1) * stride_pk + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part, acc, mask=mask)
    else:
        tl.store(y_ptr + out_rows[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _load_eight(p, mn, mask, kb, KB):
    """part[kb .. kb+7] at p (rows mn apart), 0 past KB."""
    v0 = tl.load(p, mask=mask & (kb < KB), other=0.0)
    v1 = tl.load(p + mn, mask=mask & (kb + 1 < KB), other=0.0)
    v2 = tl.load(p + 2 * mn, mask=mask & (kb + 2 < KB), other=0.0)
    v3 = tl.load(p + 3 * mn, mask=mask & (kb + 3 < KB), other=0.0)
    v4 = tl.load(p + 4 * mn, mask=mask & (kb + 4 < KB), other=0.0)
    v5 = tl.load(p + 5 * mn, mask=mask & (kb + 5 < KB), other=0.0)
    v6 = tl.load(p + 6 * mn, mask=mask & (kb + 6 < KB), other=0.0)
    v7 = tl.load(p + 7 * mn, mask=mask & (kb + 7 < KB), other=0.0)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _add_eight(acc, v0, v1, v2, v3, v4, v5, v6, v7):
    return ((((((((acc + v0) + v1) + v2) + v3) + v4) + v5) + v6) + v7)


@triton.jit(do_not_specialize=["M"])
def _ordered_sum_kernel(part_ptr, y_ptr, M, N, KB, stride_ym, BLOCK: tl.constexpr):
    """y[m, n] = ((0 + part[0, m, n]) + part[1, m, n]) + ..., fp32 adds in K order, stored in y's dtype;
    32 loads are issued before their adds so the chain waits on one latency per 32 blocks. A block past
    KB adds +0 to an accumulator that is never -0."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mn = M * N
    mask = offs < mn
    p = part_ptr + offs.to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for kb0 in range(0, KB, 32):
        a0, a1, a2, a3, a4, a5, a6, a7 = _load_eight(p, mn, mask, kb0, KB)
        b0, b1, b2, b3, b4, b5, b6, b7 = _load_eight(p + 8 * mn, mn, mask, kb0 + 8, KB)
        c0, c1, c2, c3, c4, c5, c6, c7 = _load_eight(p + 16 * mn, mn, mask, kb0 + 16, KB)
        d0, d1, d2, d3, d4, d5, d6, d7 = _load_eight(p + 24 * mn, mn, mask, kb0 + 24, KB)
        acc = _add_eight(acc, a0, a1, a2, a3, a4, a5, a6, a7)
        acc = _add_eight(acc, b0, b1, b2, b3, b4, b5, b6, b7)
        acc = _add_eight(acc, c0, c1, c2, c3, c4, c5, c6, c7)
        acc = _add_eight(acc, d0, d1, d2, d3, d4, d5, d6, d7)
        p += 32 * mn
    m = offs // N
    n = offs % N
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _ordered_sum(part: torch.Tensor, y: torch.Tensor, terms: int) -> None:
    """y[m, n] = the in-order fp32 sum of part[0..terms-1, m, n] (part contiguous [terms, M, N]). The sum is
    a chain of dependent loads, so small outputs get many small programs (the bits never depend on it)."""
    m, n = y.shape
    block, warps = (64, 2) if m * n <= 1 << 17 else (256, 4)
    _ordered_sum_kernel[(triton.cdiv(m * n, block),)](part, y, m, n, terms, y.stride(0), BLOCK=block,
                                                      num_warps=warps, enable_fp_fusion=FP_FUSION)


@triton.jit
def _fp4_to_fp8_kernel(w_ptr, o_ptr, total_words, BLOCK: tl.constexpr):
    """FP4 words (fp4_words) -> E4M3 bytes in K order, eight per word."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total_words
    w = tl.load(w_ptr + offs, mask=mask, other=0)
    e = tl.arange(0, 8)
    mag = (w[:, None] >> (16 * (e % 2) + 9 - 3 * (e // 2))[None, :]) & 7
    sign = (w[:, None] >> (16 * (e % 2) + 15 - e // 2)[None, :]) & 1
    o = _e2m1_bits(mag | (sign << 3), 2, 0x30, 7).to(tl.uint8)
    tl.store(o_ptr + offs[:, None] * 8 + e[None, :], o, mask=mask[:, None])


def fp4_to_fp8(values: torch.Tensor) -> torch.Tensor:
    """FP4 weight words uint8 [N, K/2] (fp4_words) -> float8_e4m3fn [N, K] (exact: every E2M1 value is an
    E4M3 value)."""
    n, kh = values.shape
    out = torch.empty((n, 2 * kh), dtype=torch.uint8, device=values.device)
    words = values.contiguous().view(torch.int32)
    block = 1024
    _fp4_to_fp8_kernel[(triton.cdiv(words.numel(), block),)](words, out, words.numel(), BLOCK=block, num_warps=4,
                                                             enable_fp_fusion=FP_FUSION)
    return out.view(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# routed experts: one launch for every (row, slot) pair of a step
# ---------------------------------------------------------------------------------------------
@dataclass
class ExpertBank:
    """One projection (w1, w2 or w3) of all routed experts, stacked: `values` [E, out, ...] and `scale`
    [E, ...] in CudaWeight's layout. `bank[e]` is expert e's CudaWeight, a view (no copy)."""

    kind: str
    values: torch.Tensor
    scale: torch.Tensor
    scale_rows: int

    def __getitem__(self, e: int) -> CudaWeight:
        return CudaWeight(self.kind, self.values[e], self.scale[e], self.scale_rows)

    @property
    def scale_e8m0(self) -> bool:
        return self.scale.dtype == torch.int32


def expert_bank(weights: list[Weight]) -> ExpertBank:
    """Stack the experts' weights of one projection (fp8/fp4 of one shape and scale layout)."""
    ws = [w if isinstance(w, CudaWeight) else to_cuda_weight(w) for w in weights]
    first = ws[0]
    for w in ws:
        if (w.kind, w.values.shape, w.scale.shape, w.scale.dtype, w.scale_rows) != (
                first.kind, first.values.shape, first.scale.shape, first.scale.dtype, first.scale_rows):
            raise ValueError("routed experts of one layer differ in kind, shape or scale layout")
    return ExpertBank(first.kind, torch.stack([w.values for w in ws]), torch.stack([w.scale for w in ws]),
                      first.scale_rows)


def expert_linear(x: torch.Tensor, bank: ExpertBank, experts: torch.Tensor, slots_per_row: int, *,
                  spread: bool | None = None, config: LinearConfig | None = None,
                  preconvert: bool | None = None) -> torch.Tensor:
    """Routed-expert GEMM over slots: row s of the result is x[s // slots_per_row] @ W_{experts[s]}^T,
    bf16 [len(experts), out], each row's bits those of `linear(x[row:row+1], bank[experts[s]])`. One launch
    whatever the routing (per group of experts for a prefill's widened FP4 bank), with no host read of it (a
    step stays capturable in a CUDA graph). `spread`, `config` and `preconvert` (tests, benchmarks) override
    three choices that never change bits: the K ranges as separate programs, the tile config, and a prefill's
    FP4 bank widened to E4M3 before its tiles."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{bank.kind} expert linear takes a bf16 activation, got {x.dtype}")
    slots = experts.reshape(-1).to(torch.int32).contiguous()
    n = bank.values.size(1)
    y = torch.empty((slots.numel(), n), dtype=torch.bfloat16, device=x.device)
    if slots.numel() == 0:
        return y
    x = x.contiguous()
    fuse = x.size(0) <= FUSE_QUANT_MAX_M
    a, a_s = (x, x) if fuse else quant_act(x)
    if config is None and slots.numel() >= EXPERT_TILE_MIN_SLOTS:
        # a prefill's slots: each expert's slots share 64-row tiles (the same bits as one-row tiles, tested)
        cfg = linear_config(bank.kind, n, x.size(1))
        experts_n = bank.values.size(0)
        order, tiles = _expert_tiles(slots, experts_n, cfg.BM)
        # FP4 tiles decode their nibbles per tile, in the MMA's issue slots; widened to E4M3 once per call they
        # run faster where an expert has enough rows to pay for its widening (EXPERT_WIDEN_MIN_SLOTS). A group
        # of experts at a time bounds the scratch; each launch's other tiles exit at once
        if preconvert is None:
            preconvert = slots.numel() >= EXPERT_WIDEN_MIN_SLOTS * experts_n
        widen = bank.kind == "fp4" and preconvert
        group = max(1, EXPERT_WIDEN_BYTES // (2 * bank.values[0].numel())) if widen else experts_n
        for lo in range(0, experts_n, group):
            hi = min(lo + group, experts_n)
            part = bank if not widen else ExpertBank(
                "fp8", fp4_to_fp8(bank.values[lo:hi].flatten(0, 1)).view(hi - lo, n, -1), bank.scale[lo:hi],
                bank.scale_rows)
            _block_scaled_gemm(a, a_s, part.values, part, y, fp4=part.kind == "fp4", fuse=fuse, cfg=cfg, spread=False,
                               slots=order, slots_per_row=slots_per_row, tiles=tiles, experts=(lo, hi))
        return y
    cfg = config or linear_config(bank.kind, n, x.size(1), m=1)  # each slot is a one-row product
    _block_scaled_gemm(a, a_s, bank.values, bank, y, fp4=bank.kind == "fp4", fuse=fuse, cfg=cfg, spread=spread,
                       slots=slots, slots_per_row=slots_per_row)
    return y


EXPERT_TILE_MIN_SLOTS = 512  # from this many slots expert_linear groups each expert's slots into tiles
EXPERT_WIDEN_BYTES = 1 << 30  # a prefill's FP4 bank is widened to E4M3 in groups of experts of at most this size
# ... when its experts have this many slots on average: w1 of an 8,192-row chunk, 48 experts (1,024 slots an
# expert) 11.28 -> 8.78 ms; 384 experts (128) 13.49 -> 13.92 (bench/results/kernels-experts-widened-2026-12-01.md)
EXPERT_WIDEN_MIN_SLOTS = 256


def _expert_tiles(slots: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the slots' indices grouped by expert, ascending within an expert; int32 [tiles, 3] rows (expert,
    first, count): tile t takes order[first:first + count], count <= bm). Device ops only, no host read of the
    routing: the table has a bound's length, cdiv(slots, bm) + experts, its spare tiles count 0."""
    order = torch.sort(slots, stable=True).indices.to(torch.int32)
    # scatter_add, not bincount: bincount reads its input's maximum back to the host, which a CUDA graph
    # capture refuses (and would bake one step's routing into the graph)
    counts = torch.zeros(experts, dtype=torch.int64, device=slots.device).scatter_add_(
        0, slots.long(), torch.ones_like(slots, dtype=torch.int64))
    per_expert = (counts + bm - 1) // bm
    ends = torch.cumsum(per_expert, 0)
    t = torch.arange(triton.cdiv(slots.numel(), bm) + experts, device=slots.device)
    expert = torch.searchsorted(ends, t, right=True).clamp(max=experts - 1)
    local = t - (ends[expert] - per_expert[expert])
    first = torch.cumsum(counts, 0)[expert] - counts[expert] + local * bm
    count = (counts[expert] - local * bm).clamp(0, bm) * (t < ends[-1])
    return order, torch.stack([expert, first, count], 1).to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------
# plain bf16 / fp32 GEMM
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _plain_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, k_per_split, part_cols, stride_xm, stride_wn,
                       stride_ym, group_x, group_w, group_y,
                       PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP_M: tl.constexpr, SPLIT: tl.constexpr, RANGES: tl.constexpr):
    # program_id(1) picks one of several independent GEMMs laid side by side (grouped `wo_a`); each is
    # computed exactly as a single call with the same config would. The K ranges [s * k_per_split, (s + 1) *
    # k_per_split) are fixed by the weight's shape, never by M; each range's dots chain from a zero
    # accumulator and the range sums add in s order. SPLIT: program_id(2) takes range s and stores its fp32
    # sum to part[s, m, g * N + n] (part_cols = groups * N columns) for _ordered_sum_kernel. RANGES (large M):
    # one program runs every range and adds their sums in order itself: the same bits, no partials in memory
    g = tl.program_id(1).to(tl.int64)
    x_ptr += g * group_x
    w_ptr += g * group_w
    y_ptr += g * group_y
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    xp = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    wp = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    k_lo = 0
    k_hi = K
    if SPLIT:
        k_lo = tl.program_id(2) * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if RANGES:
        total = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kmask = (k0 + rk) < k_hi  # k_per_split is a multiple of BK: only K's end cuts a step
        a = tl.load(xp + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
        # a bf16-stored fp32 weight widens exactly here (its low TF32 part is 0: the same products)
        b = tl.load(wp + k0, mask=nmask[None, :] & kmask[:, None], other=0.0).to(a.dtype)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        if RANGES:
            if ((k0 + BK) % k_per_split == 0) | (k0 + BK >= K):  # the range ends
                total += acc
                acc = tl.zeros([BM, BN], dtype=tl.float32)
    if RANGES:
        acc = total
    if SPLIT:
        part = (part_ptr + tl.program_id(2).to(tl.int64) * M * part_cols + rm[:, None].to(tl.int64) * part_cols
                + g * N + rn[None, :])
        tl.store(part, acc, mask=mmask[:, None] & nmask[None, :])
    else:
        y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _plain_gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, kind: str, groups: int, prec: str,
                config: LinearConfig | None) -> None:
    """y[:, g] = x[:, g] @ w[g]^T for each of `groups` bf16/fp32 GEMMs (x [M, groups * K] rows, w [groups, N,
    K], y [M, groups * N]). The K ranges come from the weight's shape (plain_k_per_split of its
    linear_config); from PLAIN_WIDE_MIN_M rows the tile is wider along N (fewer re-reads of x, same MMA per
    output element) and one program adds its ranges (no [splits, M, N] partials): the same bits."""
    m = y.size(0)
    n, k = w.shape[-2:]
    cfg = config or linear_config(kind, n, k)
    k_per_split = plain_k_per_split(cfg, n, k)
    splits = triton.cdiv(k, k_per_split)
    wide = config is None and m >= PLAIN_WIDE_MIN_M
    if wide:
        cfg = LinearConfig(BM=cfg.BM, BN=min(128, max(16, triton.next_power_of_2(n))), BK=cfg.BK, num_warps=4,
                           num_stages=3)
    split = splits > 1 and not wide
    part = torch.empty((splits, m, groups * n), dtype=torch.float32, device=x.device) if split else y
    grid = (triton.cdiv(m, cfg.BM) * triton.cdiv(n, cfg.BN), groups, splits if split else 1)
    _plain_gemm_kernel[grid](x, w, y, part, m, n, k, k_per_split, groups * n, x.stride(0), w.stride(-2), y.stride(0),
                             k, n * k, n, PREC=prec, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
                             SPLIT=split, RANGES=wide and splits > 1, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION)
    if split:
        _ordered_sum(part, y, splits)


# ---------------------------------------------------------------------------------------------
# configs: a function of (kind, N, K) only -- never of M
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearConfig:
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8


def linear_config(kind: str, n: int, k: int, m: int | None = None) -> LinearConfig:
    """The tile config for a weight of this kind and shape. M picks between two FP8/FP4 configs whose
    bits are equal (measured on every V4.1 layer shape: bench/results/mma-tiles-2026-11-30.txt; tested
    by tests/test_kernels_cuda.py), so a row's result never depends on M."""
    if kind in ("fp8", "fp4"):
        if m is not None and m <= NARROW_TILE_MAX_M:
            # 16-row tiles (mma.sync): 1.3-2x faster than the 64-row wgmma tiles at M <= 16
            return LinearConfig(BM=16, BN=64, BK=32, num_warps=2, num_stages=4)
        if kind == "fp8" and m is not None and m >= LARGE_TILE_MIN_M:
            # 128x128 tiles, two warpgroups: with f16 operands 8-27% faster than 64x64 on every fp8 layer at
            # M=8192 (slower at M=512, and on FP4 experts widened to E4M3, whose per-32 weight scales crowd
            # the registers: bench/results/prefill-gemm-f16-2026-11-30.txt)
            return LinearConfig(BM=128, BN=128, BK=32, num_warps=8, num_stages=2)
        # one warpgroup, m64n64k32 wgmmas: the best measured compromise at every other size
        return LinearConfig(BM=64, BN=64, BK=32, num_warps=4, num_stages=4)
    if kind == "bf16":
        if n >= 4096:
            return LinearConfig(BM=64, BN=128, BK=64, num_warps=4, num_stages=4)
        return LinearConfig(BM=64, BN=16 if n <= 1024 else 64, BK=128, num_warps=4, num_stages=4)
    # fp32: 3xTF32 tensor-core dots (see linear's fp32_precision)
    return LinearConfig(BM=16, BN=16 if n < 4096 else 64, BK=32, num_warps=4, num_stages=3)


PLAIN_SPLIT_PROGRAMS = 256  # a narrow bf16/fp32 weight's K is split until its tiles x splits reach this
PLAIN_SPLIT_MIN_STEPS = 4  # ... keeping at least this many BK steps per split
PLAIN_WIDE_MIN_M = 512  # from this many rows: N-wide tiles, the K ranges in one program (same bits, tested)


def plain_k_per_split(cfg: LinearConfig, n: int, k: int) -> int:
    """The K range of one program of a bf16/fp32 GEMM: all of K for wide weights; for narrow ones (the mHC
    projections' 24 outputs over 20480 inputs, the router) a split fixed by the shape, so every row of
    every call sums the same partials in the same order."""
    steps = triton.cdiv(k, cfg.BK)
    tiles = triton.cdiv(n, cfg.BN)
    splits = max(1, min(triton.cdiv(PLAIN_SPLIT_PROGRAMS, tiles), steps // PLAIN_SPLIT_MIN_STEPS))
    return triton.cdiv(steps, splits) * cfg.BK


def _block_scaled_gemm(a: torch.Tensor, a_s: torch.Tensor, wv: torch.Tensor, w: Weight, y: torch.Tensor, *,
                       fp4: bool, fuse: bool, cfg: LinearConfig, spread: bool | None,
                       slots: torch.Tensor | None = None, slots_per_row: int = 1,
                       tiles: torch.Tensor | None = None, experts: tuple[int, int] | None = None) -> None:
    """Launch the block-scaled GEMM into y (and the sum of the K ranges when they run as separate programs).
    With `slots`, y's row s is activation row s // slots_per_row times the bank's expert slots[s]; with
    `tiles` too (_expert_tiles), `slots` is the slot order grouped by expert and tile t takes up to BM of them,
    only those of `experts` (lo, hi) when given, the bank then holding experts lo .. hi - 1."""
    n, k = y.size(1), a.size(1)
    kb = k // BLOCK
    cps = k_range_blocks(n, kb) // K_RANGE_GROUP
    splits = triton.cdiv(triton.cdiv(kb, K_RANGE_GROUP), cps)
    rows = y.size(0)
    stacked = slots is not None and tiles is None
    m = 1 if slots is not None else rows  # rows per program column: a slot is a one-row call
    if spread is None:  # a decode tile's K chain is latency-bound: its ranges run side by side (measured:
        # bench/results/decode-gemm-2026-11-30.txt)
        spread = m <= SPREAD_MAX_M
    spread = spread and splits > 1 and tiles is None
    part = torch.empty((splits, rows, n), dtype=torch.float32, device=a.device) if spread else y
    programs = rows if stacked else tiles.size(0) if tiles is not None else 1
    grid = (triton.cdiv(m, cfg.BM) * triton.cdiv(n, cfg.BN), splits if spread else 1, programs)
    lo, hi = experts or (0, wv.size(0))  # without `experts`: all of a bank's experts (unused without tiles)
    _bs_gemm_kernel[grid](a, a_s, wv, w.scale, y, part, slots if slots is not None else y,
                          tiles if tiles is not None else y, m, n, kb, cps,
                          a.stride(0), wv.stride(-2), w.scale.stride(-2), y.stride(0),
                          a_s.stride(0) if not fuse else m, rows * n,
                          wv.stride(0) if slots is not None else 0, w.scale.stride(0) if slots is not None else 0,
                          slots_per_row, lo, hi, FP4=fp4, FUSE_QUANT=fuse, SCALE_ROWS=w.scale_rows,
                          SCALE_E8M0=w.scale_e8m0,
                          SPREAD=spread, SLOTS=stacked, GROUPED=tiles is not None, BM=cfg.BM, BN=cfg.BN,
                          GROUP_M=cfg.GROUP_M,
                          RANGES=splits > 1 and not spread, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                          enable_fp_fusion=FP_FUSION)
    if spread:
        _ordered_sum(part, y, splits)


def linear(x: torch.Tensor, w: Weight, *, out: torch.Tensor | None = None,
           config: LinearConfig | None = None, fuse_quant: bool | None = None,
           spread: bool | None = None, preconvert: bool | None = None,
           fp32_precision: str = "tf32x3") -> torch.Tensor:
    """y = x @ W^T by the weight's storage kind (see cpu.linear). x: [M, in] on CUDA. fp8/fp4 take a
    bf16 activation and give bf16; bf16/fp32 weights give their own dtype. A non-CUDA-layout Weight
    is converted on the fly (convert once with to_cuda_weight instead).
    Keyword overrides are for tests and benchmarks: `config` (tile config), and three choices that
    never change bits: `fuse_quant`, `spread` (the K ranges as separate programs) and `preconvert`
    (widen FP4 to E4M3 before the GEMM); `fp32_precision` for fp32 weights: "tf32x3" (default: three
    TF32 tensor-core products, measured closer to the CPU's fp32 than the alternative and 3-4.5x
    faster) or "ieee" (fp32 FMA dots, one long K chain per output)."""
    if not isinstance(w, CudaWeight) or w.values.device != x.device:
        w = to_cuda_weight(w, x.device)
    assert x.dim() == 2 and x.size(1) == w.in_features, (tuple(x.shape), w.in_features)
    m, k = x.shape
    n = w.out_features
    if w.kind in ("fp8", "fp4"):
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{w.kind} linear takes a bf16 activation, got {x.dtype}")
        cfg = config or linear_config(w.kind, n, k, m)
        y = out if out is not None else torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        if m == 0:
            return y
        x = x.contiguous()
        fuse = m <= FUSE_QUANT_MAX_M if fuse_quant is None else fuse_quant
        a, a_s = (x, x) if fuse else quant_act(x)  # fused: a_s unused
        wv, fp4 = w.values, w.kind == "fp4"
        if fp4 and (m >= FP4_PRECONVERT_M if preconvert is None else preconvert):
            wv, fp4 = fp4_to_fp8(wv), False
        _block_scaled_gemm(a, a_s, wv, w, y, fp4=fp4, fuse=fuse, cfg=cfg, spread=spread)
        return y
    dtype = torch.float32 if w.kind == "fp32" else torch.bfloat16
    # a bf16 activation of an fp32 weight is widened here: widened in the kernel, 3xTF32 gives other bits
    # (Triton then takes another MMA path; docs/rejected-ideas.md)
    x = x.to(dtype).contiguous()
    y = out if out is not None else torch.empty((m, n), dtype=dtype, device=x.device)
    if m == 0:
        return y
    _plain_gemm(x, w.values, y, w.kind, 1, fp32_precision if dtype == torch.float32 else "tf32", config)
    return y


# ---------------------------------------------------------------------------------------------
# sparse attention with sinks
# ---------------------------------------------------------------------------------------------
SPARSE_ATTN_BLOCK = 64


@triton.jit
def _sparse_attn_kernel(q_ptr, kv_ptr, sink_ptr, idx_ptr, o_ptr, H, D, KI, scale,
                        stride_qn, stride_qh, stride_kv, stride_in, stride_on, stride_oh,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,
                        BLOCK_O: tl.constexpr):
    """Program (query, head block, output slice): the softmax over the picked rows needs every channel
    (the scores), the output only its BLOCK_O channels. Programs of one query recompute the same scores
    (same tiles: the same bits) so a decode row spreads over D / BLOCK_O programs."""
    n = tl.program_id(0)
    hb = tl.program_id(1)
    rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    rd = tl.arange(0, BLOCK_D)
    ro = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    hmask = rh < H
    dmask = rd < D
    omask = ro < D
    q = tl.load(q_ptr + n.to(tl.int64) * stride_qn + rh[:, None] * stride_qh + rd[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_O], dtype=tl.float32)
    ri = tl.arange(0, BLOCK_I)
    for start in range(0, KI, BLOCK_I):
        ids = tl.load(idx_ptr + n.to(tl.int64) * stride_in + start + ri, mask=(start + ri) < KI, other=-1)
        valid = ids != -1
        rows = tl.where(valid, ids, 0).to(tl.int64)
        kv = tl.load(kv_ptr + rows[:, None] * stride_kv + rd[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv))
        s = tl.where(valid[None, :], s, float("-inf")) * scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BLOCK_O < BLOCK_D:
            kv = tl.load(kv_ptr + rows[:, None] * stride_kv + ro[None, :], mask=valid[:, None] & omask[None, :],
                         other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), kv)
        m_i = m_new
    sink = tl.load(sink_ptr + rh, mask=hmask, other=0.0)
    l_i = l_i + tl.exp(sink - m_i)
    o = tl.math.div_rn(acc, l_i[:, None])
    tl.store(o_ptr + n.to(tl.int64) * stride_on + rh[:, None] * stride_oh + ro[None, :], o.to(tl.bfloat16),
             mask=hmask[:, None] & omask[None, :])


SPARSE_ATTN_SPLIT_MAX_N = 64  # up to this many queries, each query's output channels spread over programs
SPARSE_ATTN_SLICE = 128  # ... of this many channels


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                *, out: torch.Tensor | None = None, block_h: int | None = None,
                block_o: int | None = None) -> torch.Tensor:
    """Single-KV-head attention over gathered rows with a per-head sink (see cpu.sparse_attn).
    q [N, H, D] bf16; kv [R, D] bf16; sink [H] fp32; idx [N, K] int (-1 = none). Returns bf16 [N, H, D].
    A few queries (a decode step) spread each query's output channels over programs: the same bits
    (tests/test_kernels_cuda.py). `block_h` / `block_o` (experiments, tests) override the heads and the
    output channels per program."""
    n, h, d = q.shape
    assert kv.dim() == 2 and kv.size(1) == d and idx.dim() == 2 and idx.size(0) == n
    q = q.to(torch.bfloat16)
    if q.stride(2) != 1:
        q = q.contiguous()
    kv = kv.to(torch.bfloat16)
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    idx = idx.contiguous()
    if idx.dtype not in (torch.int32, torch.int64):
        idx = idx.long()
    sink = sink.float().contiguous()
    o = out if out is not None else torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return o
    block_h = block_h or min(64, max(16, triton.next_power_of_2(h)))
    block_d = max(16, triton.next_power_of_2(d))
    warps = 8 if block_h * block_d >= 64 * 256 else 4
    block_o = block_o or (min(block_d, SPARSE_ATTN_SLICE) if n <= SPARSE_ATTN_SPLIT_MAX_N else block_d)
    grid = (n, triton.cdiv(h, block_h), triton.cdiv(block_d, block_o))
    _sparse_attn_kernel[grid](q, kv, sink, idx, o, h, d, idx.size(1), float(scale),
                              q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), o.stride(0), o.stride(1),
                              BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_I=SPARSE_ATTN_BLOCK, BLOCK_O=block_o,
                              num_warps=warps, num_stages=2, enable_fp_fusion=FP_FUSION)
    return o


# ---------------------------------------------------------------------------------------------
# indexer: scores, top-k, candidate blocks
# ---------------------------------------------------------------------------------------------
INDEX_SCORE_ROWS = 16  # query rows per scoring program (the dot's M)
INDEX_SCORE_ENTRIES = 64  # entries per scoring program
TOPK_BLOCK = 1024  # entries a top-k program reads per step


@triton.jit
def _index_head_term(q_ptr, w_ptr, keys, rows, rmask, h, H: tl.constexpr, D: tl.constexpr):
    """Head h's relu(q.k) times its weight, rounded as cpu.index_scores rounds it: the logit to bf16 (the
    einsum's output), the weighted term to bf16 (a bf16 product), then widened for the head sum."""
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * (H * D) + h * D + tl.arange(0, D)[None, :],
                mask=rmask[:, None], other=0.0)
    logit = tl.dot(q, keys).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + rows.to(tl.int64) * H + h, mask=rmask, other=0.0).to(tl.float32)
    return (tl.maximum(logit, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32)


@triton.jit(do_not_specialize=["N", "E"])
def _index_scores_kernel(q_ptr, k_ptr, w_ptr, vis_ptr, keep_ptr, o_ptr, N, E, stride_keep,
                         H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, KEEP: tl.constexpr,
                         R: tl.constexpr, BE: tl.constexpr):
    """scores[n, e] of cpu.index_scores for R query rows and BE entries: one dot per head against the
    entries' keys (loaded once), the heads added in order from head 0 as small_sum does, then the masks."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    rmask = rows < N
    emask = e < E
    keys = tl.load(k_ptr + e[None, :].to(tl.int64) * D + tl.arange(0, D)[:, None], mask=emask[None, :], other=0.0)
    total = _index_head_term(q_ptr, w_ptr, keys, rows, rmask, 0, H, D)
    for h in range(1, H):
        total += _index_head_term(q_ptr, w_ptr, keys, rows, rmask, h, H, D)
    vis = tl.load(vis_ptr + rows, mask=rmask, other=0)
    hide = e[None, :] >= vis[:, None]
    if KEEP:
        kept = tl.load(keep_ptr + rows[:, None].to(tl.int64) * stride_keep + e[None, :] // BLOCK,
                       mask=rmask[:, None] & emask[None, :], other=0)
        hide = hide | (kept == 0)
    out = tl.where(hide, float("-inf"), total).to(tl.bfloat16)
    tl.store(o_ptr + rows[:, None].to(tl.int64) * E + e[None, :], out, mask=rmask[:, None] & emask[None, :])


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor,
                 keep_blocks: torch.Tensor | None, block: int) -> torch.Tensor:
    """cpu.index_scores with this backend's small_sum (fp32 adds from head 0, then bf16) in one launch, no
    [N, H, T] logits in memory. The per-head dot (K = D in one chain of MMAs, fp32 accumulation) is the
    bf16 GEMM's (tests/test_kernels_cuda.py)."""
    n, h, d = q.shape
    e = keys.size(0)
    q = q.to(torch.bfloat16).contiguous()
    keys = keys.to(torch.bfloat16).contiguous()
    weights = weights.to(torch.bfloat16).contiguous()
    vis = visible.reshape(n).contiguous()
    out = torch.empty((n, e), dtype=torch.bfloat16, device=q.device)
    if n == 0 or e == 0:
        return out
    keep = keep_blocks.contiguous().view(torch.uint8) if keep_blocks is not None else out
    grid = (triton.cdiv(n, INDEX_SCORE_ROWS), triton.cdiv(e, INDEX_SCORE_ENTRIES))
    _index_scores_kernel[grid](q, keys, weights, vis, keep, out, n, e, keep.stride(0) if keep_blocks is not None else 0,
                               H=h, D=d, BLOCK=block, KEEP=keep_blocks is not None, R=INDEX_SCORE_ROWS,
                               BE=INDEX_SCORE_ENTRIES, num_warps=4, num_stages=2, enable_fp_fusion=False)
    return out


@triton.jit
def _order_keys(s_ptr, row, base, E, group, newest, GROUP: tl.constexpr, CAND: tl.constexpr, BLOCK: tl.constexpr):
    """Items base .. base + BLOCK of a row as 16-bit keys ordered like their bf16 values (-0 = +0, NaN
    above +inf as torch's sort has it): an item is one score (group 1) or the max of `group` consecutive
    scores (candidate blocks, GROUP >= group a power of two; the newest block +inf when CAND). Returns
    (keys, in range, item values)."""
    i = base + tl.arange(0, BLOCK)
    j = tl.arange(0, GROUP)
    e = i[:, None] * group + j[None, :]
    v = tl.load(s_ptr + row * E + e, mask=(e < E) & (j[None, :] < group), other=float("-inf"))
    v = tl.max(v.to(tl.float32), axis=1)
    if CAND:
        v = tl.where(i == newest, float("inf"), v)
    b = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b = tl.where(b == 0x8000, 0, b)
    key = tl.where((b & 0x8000) != 0, b ^ 0xFFFF, b | 0x8000)
    key = tl.where((b & 0x7FFF) > 0x7F80, 0xFFFF, key)
    return key, i < tl.cdiv(E, group), v


@triton.jit(do_not_specialize=["E", "k"])
def _topk_kernel(s_ptr, vis_ptr, o_ptr, E, k, width, group, GROUP: tl.constexpr, CAND: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One row's k best items (lowest index first among equal keys), found by a radix select of the 16-bit
    key (four 4-bit digits from the top: the k-th best key, and how many items equal to it to take), then
    one pass in index order that emits them. CAND: items are candidate blocks; writes the keep mask
    (picked and not -inf) for every block. Else: writes the picks ascending, those at or past `visible`
    as -1, then -1 up to `width`."""
    row = tl.program_id(0).to(tl.int64)
    items = tl.cdiv(E, group)
    vis = tl.load(vis_ptr + row)
    newest = tl.where(vis > 0, (vis - 1) // group, -1)  # (Triton's // truncates: no block when none is visible)
    prefix = 0
    known = 0
    need = k
    digits = tl.arange(0, 16)
    for p in tl.static_range(4):
        shift = 12 - 4 * p
        counts = tl.zeros([16], dtype=tl.int32)
        for base in range(0, items, BLOCK):
            key, valid, _ = _order_keys(s_ptr, row, base, E, group, newest, GROUP, CAND, BLOCK)
            match = valid & ((key & known) == prefix)
            hit = match[:, None] & (((key >> shift) & 15)[:, None] == digits[None, :])
            counts += tl.sum(hit.to(tl.int32), axis=0)
        at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # items with digit >= d
        chosen = tl.max(tl.where(at_least >= need, digits, 0), axis=0)
        need -= tl.sum(tl.where(digits > chosen, counts, 0), axis=0)
        prefix |= chosen << shift
        known |= 15 << shift
    ties = tl.full([], 0, tl.int32)
    written = tl.full([], 0, tl.int32)
    for base in range(0, items, BLOCK):
        key, valid, v = _order_keys(s_ptr, row, base, E, group, newest, GROUP, CAND, BLOCK)
        i = base + tl.arange(0, BLOCK)
        tie = valid & (key == prefix)
        rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        pick = (valid & (key > prefix)) | (tie & (rank < need))
        if CAND:
            tl.store(o_ptr + row * items + i, (pick & (v > float("-inf"))).to(tl.int8), mask=valid)
        else:
            pos = written + tl.cumsum(pick.to(tl.int32), axis=0) - 1
            tl.store(o_ptr + row * width + pos, i.to(tl.int64), mask=pick & (i < vis))
            written += tl.sum((pick & (i < vis)).to(tl.int32), axis=0)
        ties += tl.sum(tie.to(tl.int32), axis=0)
    if not CAND:
        for base in range(0, width, BLOCK):
            j = base + tl.arange(0, BLOCK)
            tl.store(o_ptr + row * width + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= written) & (j < width))


# One program per row reads a row five times, ~6 us per 1K scores: for a few long rows torch's sort, which
# spreads a row over the GPU, is faster (H200: 4K scores kernel 26 us vs sort 55; 64K scores, 8 rows 381 vs
# 104; 64K scores, 512 rows 974 vs 1,262: bench/results/kernels-indexer-2026-12-01.md). Both give the same
# picks (selection is exact), so the launch shape never changes a bit.
TOPK_KERNEL_MAX_SCORES = 8192
TOPK_KERNEL_MIN_ROWS = 512


def _topk_by_kernel(scores: torch.Tensor, kernel: bool | None) -> bool:
    n, e = scores.shape
    return kernel if kernel is not None else e <= TOPK_KERNEL_MAX_SCORES or n >= TOPK_KERNEL_MIN_ROWS


def _topk(scores: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, k: int, width: int, block: int,
          cand: bool) -> None:
    """One _topk_kernel program per row: the picks to out [N, width], or (`cand`) the keep mask of the
    candidate blocks of `block` scores to out [N, ceil(T / block)]."""
    n, e = scores.shape
    if n:
        group = triton.next_power_of_2(block)
        _topk_kernel[(n,)](scores.contiguous(), visible.reshape(n).contiguous(), out, e, k, width, block,
                           GROUP=group, CAND=cand, BLOCK=max(16, TOPK_BLOCK // group), num_warps=4,
                           enable_fp_fusion=FP_FUSION)


@triton.jit
def _moe_route_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, E, stride_l, temp, scale, K: tl.constexpr,
                      KP: tl.constexpr, FUNC: tl.constexpr, NORM: tl.constexpr, ASC: tl.constexpr,
                      BLOCK_E: tl.constexpr):
    """One row of the router (cpu.moe_route) with torch's CUDA functions: logits / temp (IEEE division),
    FUNC 1 sigmoid 1 / (1 + expf(-x)), 2 sqrtf(x > 20 ? x : log1pf(expf(x))); K rounds of the best of
    scores + bias (the lowest id among equal ones, -0 = +0), its unbiased score kept; the weights' sum from
    the first pick on (CUDA's small_sum), + 1e-20, IEEE divisions, times scale; ASC: stored by ascending id
    (each pick at its rank among the row's distinct picks)."""
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    s = tl.math.div_rn(tl.load(logit_ptr + n * stride_l + e, mask=valid, other=0.0), temp)
    if FUNC == 1:
        s = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-s))
    else:
        s = tl.sqrt_rn(tl.where(s > 20.0, s, libdevice.log1p(libdevice.exp(s))))
    key = tl.where(valid, s + tl.load(bias_ptr + e, mask=valid, other=0.0), float("-inf"))
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    weights = tl.zeros([KP], dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        pick = tl.min(tl.where(key == best, e, BLOCK_E), axis=0)
        w = tl.max(tl.where(e == pick, s, float("-inf")), axis=0)
        key = tl.where(e == pick, float("-inf"), key)
        ids = tl.where(kk == j, pick.to(tl.int64), ids)
        weights = tl.where(kk == j, w, weights)
        if j == 0:
            total = w
        else:
            total = total + w
    if NORM:
        weights = tl.math.div_rn(weights, total + 1e-20)
    weights = weights * scale
    slot = kk
    if ASC:
        live = kk < K
        below = (ids[None, :] < ids[:, None]) & live[None, :]
        slot = tl.sum(below.to(tl.int32), axis=1)
    tl.store(w_ptr + n * K + slot, weights, mask=kk < K)
    tl.store(id_ptr + n * K + slot, ids, mask=kk < K)


ROUTE_FUNCS = {"sigmoid": 1, "sqrtsoftplus": 2}  # the score functions the route kernel computes


def moe_route(logits: torch.Tensor, bias: torch.Tensor, k: int, score_func: str, temp: float, norm: bool,
              scale: float, ids: torch.Tensor | None = None, ascending: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu.moe_route with the bits of its torch composition on CUDA: one kernel for a shared bias and an
    elementwise score function (~15 launches a layer before, the sort to ascending ids included); the
    composition for softmax, a per-row bias (image rows) or given ids."""
    if ids is not None or bias.dim() != 1 or score_func not in ROUTE_FUNCS:
        return cpu.moe_route(logits, bias, k, score_func, temp, norm, scale, ids, ascending, small_sum=small_sum)
    n, e = logits.shape
    logits = logits.float().contiguous()
    weights = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    if n:
        block_e = max(16, triton.next_power_of_2(e))
        _moe_route_kernel[(n,)](logits, bias.float().contiguous(), weights, ids, e, logits.stride(0), float(temp),
                                float(scale), K=k, KP=max(2, triton.next_power_of_2(k)), FUNC=ROUTE_FUNCS[score_func],
                                NORM=norm and k > 1, ASC=ascending, BLOCK_E=block_e,
                                num_warps=4 if block_e <= 1024 else 8, enable_fp_fusion=FP_FUSION)
    return weights, ids


def topk_indices(scores: torch.Tensor, k: int, visible: torch.Tensor, width: int, *,
                 kernel: bool | None = None) -> torch.Tensor:
    """cpu.topk_indices: one program per row, or torch's sort for a few long rows (`kernel` forces either)."""
    if not _topk_by_kernel(scores, kernel):
        return cpu.topk_indices(scores, k, visible, width)
    out = torch.empty((scores.size(0), width), dtype=torch.int64, device=scores.device)
    _topk(scores, visible, out, k, width, 1, False)
    return out


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int, *,
                     kernel: bool | None = None) -> torch.Tensor:
    """cpu.candidate_blocks: one program per row taking the block maxima as it reads them, or torch's sort
    for a few long rows (as topk_indices)."""
    if not _topk_by_kernel(scores, kernel):
        return cpu.candidate_blocks(scores, visible, topk_blocks, block)
    n_blocks = triton.cdiv(scores.size(1), block)
    out = torch.empty((scores.size(0), n_blocks), dtype=torch.bool, device=scores.device)
    _topk(scores, visible, out.view(torch.int8), min(topk_blocks, n_blocks), 0, block, True)
    return out


# ---------------------------------------------------------------------------------------------
# mHC split + Sinkhorn
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sigmoid(x):
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))


@triton.jit(do_not_specialize=["N"])
def _hc_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, N, iters, eps,
               HC: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    NM: tl.constexpr = 2 * HC + HC * HC
    r = pid * ROWS + tl.arange(0, ROWS)
    rmask = r < N
    j = tl.arange(0, HC)
    row = mix_ptr + r.to(tl.int64) * NM
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    m_pre = tl.load(row[:, None] + j[None, :], mask=rmask[:, None], other=0.0)
    m_post = tl.load(row[:, None] + HC + j[None, :], mask=rmask[:, None], other=0.0)
    cidx = j[:, None] * HC + j[None, :]
    m_comb = tl.load(row[:, None, None] + 2 * HC + cidx[None, :, :], mask=rmask[:, None, None], other=0.0)
    pre = _sigmoid(m_pre * s0 + tl.load(base_ptr + j)[None, :]) + eps
    post = 2.0 * _sigmoid(m_post * s1 + tl.load(base_ptr + HC + j)[None, :])
    c = m_comb * s2 + tl.load(base_ptr + 2 * HC + cidx)[None, :, :]
    c = libdevice.exp(c - tl.max(c, axis=2)[:, :, None])
    c = tl.math.div_rn(c, tl.sum(c, axis=2)[:, :, None]) + eps
    c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(1, iters):
        c = tl.math.div_rn(c, tl.sum(c, axis=2)[:, :, None] + eps)
        c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps)
    out_r = r.to(tl.int64)
    tl.store(pre_ptr + out_r[:, None] * HC + j[None, :], pre, mask=rmask[:, None])
    tl.store(post_ptr + out_r[:, None] * HC + j[None, :], post, mask=rmask[:, None])
    tl.store(comb_ptr + out_r[:, None, None] * (HC * HC) + cidx[None, :, :], c, mask=rmask[:, None, None])


HC_ROWS = 4  # rows per program, one warp (fixed: the layout sets each row's reduction order)


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients from the (2+hc)*hc mixes (fp32): pre [.., hc], post [.., hc] and the
    Sinkhorn-normalised comb [.., hc, hc] (see cpu.hc_split_sinkhorn)."""
    assert hc & (hc - 1) == 0 and mixes.size(-1) == (2 + hc) * hc and iters >= 1
    lead = mixes.shape[:-1]
    m = mixes.reshape(-1, mixes.size(-1)).float().contiguous()
    n = m.size(0)
    dev = mixes.device
    pre = torch.empty((n, hc), dtype=torch.float32, device=dev)
    post = torch.empty((n, hc), dtype=torch.float32, device=dev)
    comb = torch.empty((n, hc, hc), dtype=torch.float32, device=dev)
    if n:
        _hc_kernel[(triton.cdiv(n, HC_ROWS),)](m, scale.float().contiguous(), base.float().contiguous(),
                                               pre, post, comb, n, iters, float(eps), HC=hc, ROWS=HC_ROWS,
                                               num_warps=1, enable_fp_fusion=FP_FUSION)
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


# ---------------------------------------------------------------------------------------------
# KV / index fake-quantisation (numerics/quant.py), one kernel per call instead of ~20 torch ops
# ---------------------------------------------------------------------------------------------
FAKE_QUANT_ROWS = 64  # quantisation groups per program


@triton.jit
def _fp4_codes(x, E4M3_SCALE: tl.constexpr):
    """Groups [BR, G] (fp32) -> quant.fp4_scaled's scales [BR] and each value's E2M1 magnitude code (0..7)
    and sign (1 where negative, -0 included), the rounding of quant.e2m1_round."""
    amax = tl.max(tl.abs(x), axis=1)
    if E4M3_SCALE:  # an all-zero group keeps a non-zero scale
        s = tl.clamp(tl.math.div_rn(tl.maximum(amax, _FP4_E4M3_SCALE_FLOOR), 6.0), -448.0, 448.0)
        s = s.to(tl.float8e4nv).to(tl.float32)
    else:  # 2^ceil(log2(amax / 6)) from the exponent bits, as quant.pow2_scale
        bits = (tl.maximum(amax, _FP4_POW2_SCALE_FLOOR) * _E2M1_MAX_INV).to(tl.int32, bitcast=True)
        s = ((((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23).to(tl.float32, bitcast=True)
    v = tl.clamp(tl.math.div_rn(x, s[:, None]), -6.0, 6.0)
    # the code counts the midpoints below |v|, and the ties that round up
    mag = tl.abs(v)
    code = ((mag > 0.25).to(tl.int32) + (mag > 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag > 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag > 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32) + (mag == 0.75).to(tl.int32) + (mag == 1.75).to(tl.int32)
            + (mag == 3.5).to(tl.int32))
    return s, code, (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)


@triton.jit
def _e2m1_value(code, negative):
    """Magnitude codes (0..7) and signs -> the E2M1 values (fp32). The sign is a factor: Triton's unary
    minus is 0 - x, which turns a -0 result into +0."""
    value = tl.where(code <= 4, code.to(tl.float32) * 0.5, tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0)))
    return tl.where(negative != 0, -1.0, 1.0) * value


@triton.jit
def _fake_quant_kernel(x_ptr, o_ptr, R, FP4: tl.constexpr, E4M3_SCALE: tl.constexpr, G: tl.constexpr,
                       BR: tl.constexpr):
    """Rows of G values are quantisation groups: quantise and dequantise each, as quant.fp8_fake_quant
    (FP4 false, G = 32) or quant.fp4_fake_quant (E2M1 values, an E4M3 or a power-of-two scale)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    offs = rows[:, None] * G + tl.arange(0, G)[None, :]
    mask = (rows < R)[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FP4:
        s, code, negative = _fp4_codes(x, E4M3_SCALE)
        out = _e2m1_value(code, negative) * s[:, None]
    else:
        q, _e, s = _quant_tile(x)
        out = q.to(tl.float32) * s[:, None]
    tl.store(o_ptr + offs, out.to(tl.bfloat16), mask=mask)


def _fake_quant(x: torch.Tensor, group: int, fp4: bool, e4m3_scale: bool) -> torch.Tensor:
    assert x.dtype == torch.bfloat16 and x.size(-1) % group == 0
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // group
    if rows:
        _fake_quant_kernel[(triton.cdiv(rows, FAKE_QUANT_ROWS),)](x, out, rows, FP4=fp4, E4M3_SCALE=e4m3_scale,
                                                                  G=group, BR=FAKE_QUANT_ROWS, num_warps=4,
                                                                  enable_fp_fusion=False)
    return out


# The packed FP4 rows of the state (numerics/packing.py): a row of GPE groups of G values is GPE * G / 2 code
# bytes (element 2k in the low nibble), then GPE scale bytes. The scale bytes are made and read with integer
# arithmetic (E4M3 / E8M0 bit layouts), the same on the GPU and in Triton's interpreter.
@triton.jit
def _fp4_quant_packed_kernel(x_ptr, o_ptr, R, GPE, W, E4M3_SCALE: tl.constexpr, G: tl.constexpr,
                             BR: tl.constexpr):
    """Quantisation groups (rows of G values, GPE per state row) -> their code bytes and scale byte."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < R
    x = tl.load(x_ptr + rows[:, None] * G + tl.arange(0, G)[None, :], mask=rmask[:, None], other=0.0)
    s, code, negative = _fp4_codes(x.to(tl.float32), E4M3_SCALE)
    lo, hi = tl.split(tl.reshape(code | (negative << 3), [BR, G // 2, 2]))
    base = (rows // GPE) * W
    group = rows % GPE
    tl.store(o_ptr + (base + group * (G // 2))[:, None] + tl.arange(0, G // 2)[None, :],
             (lo | (hi << 4)).to(tl.uint8), mask=rmask[:, None])
    bits = s.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    if E4M3_SCALE:  # s is an E4M3 value in [2^-9, 448]: subnormal below 2^-6
        scale = tl.where(exponent >= 121, ((exponent - 120) << 3) | ((bits >> 20) & 7), (s * 512.0).to(tl.int32))
    else:  # a normal power of two: its biased exponent is the E8M0 code
        scale = exponent
    tl.store(o_ptr + base + GPE * (G // 2) + group, scale.to(tl.uint8), mask=rmask)


@triton.jit
def _fp4_dequant_packed_kernel(p_ptr, o_ptr, R, GPE, W, E4M3_SCALE: tl.constexpr, G: tl.constexpr,
                               BR: tl.constexpr):
    """Packed groups -> bf16 values: code x scale (exact in fp32 and in bf16), as packing.dequant_packed."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < R
    base = (rows // GPE) * W
    group = rows % GPE
    b = tl.load(p_ptr + (base + group * (G // 2))[:, None] + tl.arange(0, G // 2)[None, :], mask=rmask[:, None],
                other=0).to(tl.int32)
    c = tl.load(p_ptr + base + GPE * (G // 2) + group, mask=rmask, other=0).to(tl.int32)
    if E4M3_SCALE:
        e, m = (c >> 3) & 15, c & 7
        s = tl.where(e == 0, m.to(tl.float32) * 0.001953125,  # subnormal: m * 2^-9
                     (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
        s = tl.where((e == 15) & (m == 7), float("nan"), s)
        s = tl.where((c & 0x80) != 0, -1.0, 1.0) * s
    else:  # 2^(c - 127); code 0 is the subnormal 2^-127, 255 NaN
        s = tl.where(c == 0, 5.877471754111438e-39, (c << 23).to(tl.float32, bitcast=True))
        s = tl.where(c == 255, float("nan"), s)
    lo = _e2m1_value(b & 7, b & 8) * s[:, None]
    hi = _e2m1_value((b >> 4) & 7, b & 128) * s[:, None]
    out = tl.reshape(tl.join(lo, hi), [BR, G])
    tl.store(o_ptr + rows[:, None] * G + tl.arange(0, G)[None, :], out.to(tl.bfloat16), mask=rmask[:, None])


def fp4_quant_packed(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    """packing.quant_packed in one kernel (bf16 [n, d] -> uint8 [n, d/2 + d/block]), byte for byte."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.size(1) % block == 0
    x = x.contiguous()
    n, d = x.shape
    gpe = d // block
    out = torch.empty((n, packed_width(d, block)), dtype=torch.uint8, device=x.device)
    if n:
        _fp4_quant_packed_kernel[(triton.cdiv(n * gpe, FAKE_QUANT_ROWS),)](
            x, out, n * gpe, gpe, out.size(1), E4M3_SCALE=e4m3_scale, G=block, BR=FAKE_QUANT_ROWS, num_warps=4,
            enable_fp_fusion=False)
    return out


def fp4_dequant_packed(packed: torch.Tensor, d: int, block: int, e4m3_scale: bool) -> torch.Tensor:
    """packing.dequant_packed in one kernel (uint8 [n, d/2 + d/block] -> bf16 [n, d]), bit for bit."""
    check_width(packed, d, block)
    packed = packed.contiguous()
    n, gpe = packed.size(0), d // block
    out = torch.empty((n, d), dtype=torch.bfloat16, device=packed.device)
    if n:
        _fp4_dequant_packed_kernel[(triton.cdiv(n * gpe, FAKE_QUANT_ROWS),)](
            packed, out, n * gpe, gpe, packed.size(1), E4M3_SCALE=e4m3_scale, G=block, BR=FAKE_QUANT_ROWS,
            num_warps=4, enable_fp_fusion=False)
    return out


def fp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """quant.fp8_fake_quant in one kernel (bf16 [..., K], K a multiple of 32), bit for bit."""
    return _fake_quant(x, BLOCK, False, False)


def fp4_fake_quant(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    """quant.fp4_fake_quant in one kernel, bit for bit."""
    return _fake_quant(x, block, True, e4m3_scale)


# ---------------------------------------------------------------------------------------------
# mHC stream collapse and expansion, each one kernel with the rounding of cpu.collapse / cpu.expand as
# composed from this backend's ops (fp32 products, streams added first to last, one rounding at the
# end); launched with fp fusion off, so no multiply-add is contracted into an FMA
# ---------------------------------------------------------------------------------------------
MHC_BLOCK = 512


@triton.jit
def _collapse_kernel(h_ptr, pre_ptr, o_ptr, D, stride_hn, stride_hs, stride_pn, stride_on,
                     HC: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.load(pre_ptr + n * stride_pn) * tl.load(h_ptr + n * stride_hn + offs, mask=mask).to(tl.float32)
    for i in tl.static_range(1, HC):
        h = tl.load(h_ptr + n * stride_hn + i * stride_hs + offs, mask=mask).to(tl.float32)
        acc = acc + tl.load(pre_ptr + n * stride_pn + i) * h
    tl.store(o_ptr + n * stride_on + offs, acc.to(o_ptr.dtype.element_ty), mask=mask)


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre[:, i] * h[:, i] in fp32, streams first to last, in h's dtype: [N, hc, D] x [N, hc] -> [N, D]."""
    n, hc, d = h.shape
    if h.stride(2) != 1:
        h = h.contiguous()
    pre = pre.float().contiguous()
    out = torch.empty((n, d), dtype=h.dtype, device=h.device)
    if n:
        _collapse_kernel[(n, triton.cdiv(d, MHC_BLOCK))](h, pre, out, d, h.stride(0), h.stride(1), pre.stride(0),
                                                         out.stride(0), HC=hc, BLOCK=MHC_BLOCK, num_warps=4,
                                                         enable_fp_fusion=False)
    return out


@triton.jit
def _expand_kernel(y_ptr, r_ptr, post_ptr, comb_ptr, o_ptr, D, stride_yn, stride_rn, stride_rs, stride_pn,
                   stride_cn, stride_on, stride_os, HC: tl.constexpr, BLOCK: tl.constexpr):
    # all HC output streams as one [HC, BLOCK] tile, so each residual stream is loaded once
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    ks = tl.arange(0, HC)
    y = tl.load(y_ptr + n * stride_yn + offs, mask=mask).to(tl.float32)
    r = tl.load(r_ptr + n * stride_rn + offs, mask=mask).to(tl.float32)
    mixed = tl.load(comb_ptr + n * stride_cn + ks)[:, None] * r[None, :]
    for j in tl.static_range(1, HC):
        r = tl.load(r_ptr + n * stride_rn + j * stride_rs + offs, mask=mask).to(tl.float32)
        mixed = mixed + tl.load(comb_ptr + n * stride_cn + j * HC + ks)[:, None] * r[None, :]
    out = tl.load(post_ptr + n * stride_pn + ks)[:, None] * y[None, :] + mixed
    tl.store(o_ptr + n * stride_on + ks[:, None] * stride_os + offs[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mask[None, :])


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[:, k] = post[:, k] * y + sum_j comb[:, j, k] * residual[:, j] in fp32 (j first to last), in y's
    dtype: y [N, D], residual [N, hc, D], post [N, hc], comb [N, hc, hc] -> [N, hc, D]."""
    n, hc, d = residual.shape
    if y.stride(1) != 1:
        y = y.contiguous()
    if residual.stride(2) != 1:
        residual = residual.contiguous()
    post = post.float().contiguous()
    comb = comb.float().contiguous()
    out = torch.empty((n, hc, d), dtype=y.dtype, device=y.device)
    if n:
        _expand_kernel[(n, triton.cdiv(d, MHC_BLOCK))](y, residual, post, comb, out, d, y.stride(0),
                                                       residual.stride(0), residual.stride(1), post.stride(0),
                                                       comb.stride(0), out.stride(0), out.stride(1), HC=hc,
                                                       BLOCK=MHC_BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


@triton.jit
def _moe_sum_kernel(r_ptr, s_ptr, o_ptr, D, stride_rn, stride_rk, stride_sn, stride_on, K: tl.constexpr,
                    BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        acc = acc + tl.load(r_ptr + n * stride_rn + k * stride_rk + offs, mask=mask).to(tl.float32)
    acc = acc + tl.load(s_ptr + n * stride_sn + offs, mask=mask).to(tl.float32)
    tl.store(o_ptr + n * stride_on + offs, acc.to(o_ptr.dtype.element_ty), mask=mask)


def moe_sum(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """cpu.moe_sum in one kernel (the same fp32 adds from zero, in slot order, then the shared expert)."""
    n, k, d = routed.shape
    if routed.stride(2) != 1:
        routed = routed.contiguous()
    if shared.stride(1) != 1:
        shared = shared.contiguous()
    out = torch.empty((n, d), dtype=shared.dtype, device=shared.device)
    if n:
        _moe_sum_kernel[(n, triton.cdiv(d, MHC_BLOCK))](routed, shared, out, d, routed.stride(0), routed.stride(1),
                                                        shared.stride(0), out.stride(0), K=k, BLOCK=MHC_BLOCK,
                                                        num_warps=4, enable_fp_fusion=False)
    return out


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, o_ptr, B, D, stride_ga, stride_gb, stride_ua, stride_ub, limit,
                   CLAMP: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Row r = a * B + b of out = [w_r *] silu(gate) * up with the clamps: torch's ops in fp32 (silu as its
    CUDA kernel, x / (1 + expf(-x)), IEEE division), rounded once to out's dtype."""
    r = tl.program_id(0)
    a = (r // B).to(tl.int64)
    b = (r % B).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(g_ptr + a * stride_ga + b * stride_gb + offs, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + a * stride_ua + b * stride_ub + offs, mask=mask).to(tl.float32)
    if CLAMP:
        u = tl.clamp(u, -limit, limit)
        g = tl.minimum(g, limit)
    h = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)) * u
    if HAS_WEIGHT:
        h = tl.load(w_ptr + r) * h
    tl.store(o_ptr + r.to(tl.int64) * D + offs, h.to(o_ptr.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """cpu.swiglu in one kernel (gate, up: [R, D] or [A, B, D] views with unit last stride; weights: one
    fp32 per row), out contiguous in gate's dtype."""
    assert gate.shape == up.shape and gate.stride(-1) == 1 and up.stride(-1) == 1
    g3, u3 = (gate.unsqueeze(1), up.unsqueeze(1)) if gate.dim() == 2 else (gate, up)
    a, b, d = g3.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    w = out if weights is None else weights.float().reshape(a * b).contiguous()
    if a * b:
        _swiglu_kernel[(a * b, triton.cdiv(d, MHC_BLOCK))](g3, u3, w, out, b, d, g3.stride(0), g3.stride(1),
                                                           u3.stride(0), u3.stride(1), float(limit),
                                                           CLAMP=limit > 0, HAS_WEIGHT=weights is not None,
                                                           BLOCK=MHC_BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


@triton.jit
def _softmax_pool_kernel(kv_ptr, s_ptr, o_ptr, D, stride_kg, stride_kj, stride_sg, stride_sj,
                         R: tl.constexpr, BLOCK: tl.constexpr):
    """torch's CUDA ops, rounding for rounding: the softmax over the group (max from -inf, the exponentials'
    sum from 0 in row order, each probability exp(s - max) / sum with expf and an IEEE division), then the
    products with kv summed from 0 in row order (the order torch's sum takes for ratio 2)."""
    g = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for j in tl.static_range(R):
        m = tl.maximum(m, tl.load(s_ptr + g * stride_sg + j * stride_sj + offs, mask=mask, other=0.0))
    den = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(R):
        den += libdevice.exp(tl.load(s_ptr + g * stride_sg + j * stride_sj + offs, mask=mask, other=0.0) - m)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(R):
        p = tl.math.div_rn(libdevice.exp(tl.load(s_ptr + g * stride_sg + j * stride_sj + offs, mask=mask,
                                                 other=0.0) - m), den)
        acc += tl.load(kv_ptr + g * stride_kg + j * stride_kj + offs, mask=mask, other=0.0) * p
    tl.store(o_ptr + g * D + offs, acc.to(tl.bfloat16), mask=mask)


def softmax_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """cpu.softmax_pool in one kernel (kv, score: fp32 [G, ratio, D] views with unit last stride)."""
    assert kv.shape == score.shape and kv.stride(-1) == 1 and score.stride(-1) == 1
    g, r, d = kv.shape
    out = torch.empty((g, d), dtype=torch.bfloat16, device=kv.device)
    if g:
        _softmax_pool_kernel[(g, triton.cdiv(d, MHC_BLOCK))](kv, score, out, d, kv.stride(0), kv.stride(1),
                                                            score.stride(0), score.stride(1), R=r, BLOCK=MHC_BLOCK,
                                                            num_warps=4, enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------------------------------------
# Engram: the hashed rows' gather + dequantisation, and the gated add to the streams
# ---------------------------------------------------------------------------------------------
ENGRAM_BLOCK = 256  # row_sum's block: the gate's row sums reduce in its order


@triton.jit
def _engram_rows_kernel(t_ptr, s_ptr, id_ptr, o_ptr, DE, BLOCK: tl.constexpr):
    """Row ids[r] of the FP8 table times its E8M0 scales (one per 32), rounded once to bf16."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < DE
    row = tl.load(id_ptr + r)
    v = tl.load(t_ptr + row * DE + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(s_ptr + row * (DE // _BLOCK) + offs // _BLOCK, mask=mask, other=127).to(tl.int32)
    # E8M0 byte -> 2^(b - 127) as torch converts it: 0 -> 2^-127 (subnormal), 255 -> NaN
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    tl.store(o_ptr + r * DE + offs, (v * bits.to(tl.float32, bitcast=True)).to(tl.bfloat16), mask=mask)


def engram_rows(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """cpu.engram_rows in one kernel (table float8_e4m3fn [rows, De], scale E8M0 [rows, De / 32])."""
    if table.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"Engram rows take an E4M3 table and E8M0 scales, got {table.dtype} and {scale.dtype}")
    de = table.size(-1)
    out = torch.empty((*ids.shape, de), dtype=torch.bfloat16, device=table.device)
    flat = ids.reshape(-1).contiguous()
    if flat.numel():
        _engram_rows_kernel[(flat.numel(), triton.cdiv(de, 1024))](table.contiguous(),
                                                                   scale.contiguous().view(torch.uint8), flat, out,
                                                                   de, BLOCK=1024, num_warps=4,
                                                                   enable_fp_fusion=False)
    return out


@triton.jit
def _engram_gate_kernel(h_ptr, k_ptr, v_ptr, qk_ptr, m_ptr, o_ptr, HC, D, stride_hn, stride_hs, stride_kn,
                        stride_ks, stride_vn, d, eps, scale, floor, MASK: tl.constexpr, BLOCK: tl.constexpr):
    """One (token, stream): cpu.engram_gate with the CUDA backend's row sums (BLOCK-wide lanes, the square
    sums as the FMAs its compiled row_sum uses, the product sum of the separately rounded products), IEEE
    divisions, torch's sigmoid 1 / (1 + expf(-x)); then the stream plus gate * value in bf16."""
    n = (tl.program_id(0) // HC).to(tl.int64)
    st = tl.program_id(0) % HC
    h_row = h_ptr + n * stride_hn + st * stride_hs
    k_row = k_ptr + n * stride_kn + st * stride_ks
    acc_h = tl.zeros([BLOCK], dtype=tl.float32)
    acc_k = tl.zeros([BLOCK], dtype=tl.float32)
    acc_d = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < D
        hv = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
        kv = tl.load(k_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(qk_ptr + st * D + offs, mask=mask, other=0.0)
        acc_h = tl.fma(hv, hv, acc_h)
        acc_k = tl.fma(kv, kv, acc_k)
        acc_d += (hv * q) * kv
    rstd = (tl.rsqrt(tl.math.div_rn(tl.sum(acc_h, axis=0), d) + eps)
            * tl.rsqrt(tl.math.div_rn(tl.sum(acc_k, axis=0), d) + eps))
    dot = (tl.sum(acc_d, axis=0) * rstd) * scale
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), floor))
    signed = tl.where((dot.to(tl.int32, bitcast=True) & -2147483648) != 0, -root, root)  # copysign
    gate = _sigmoid(signed)
    if MASK:
        gate = tl.where(tl.load(m_ptr + n) != 0, 0.0, gate)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < D
        hv = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + n * stride_vn + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + (n * HC + st) * D + offs, (hv + gate * vv).to(o_ptr.dtype.element_ty), mask=mask)


def engram_gate(h: torch.Tensor, key: torch.Tensor, value: torch.Tensor, qk_weight: torch.Tensor, eps: float,
                image_mask: torch.Tensor | None) -> torch.Tensor:
    """cpu.engram_gate with this backend's mean square and row sum, one program per (token, stream)
    (h [N, hc, D], key [N, hc, D], value [N, D]: views with unit last stride)."""
    n, hc, d = h.shape
    assert key.shape == h.shape and value.shape == (n, d) and h.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    out = torch.empty((n, hc, d), dtype=h.dtype, device=h.device)
    mask = image_mask.contiguous().view(torch.uint8) if image_mask is not None else out
    if n:
        _engram_gate_kernel[(n * hc,)](h, key, value, qk_weight.float().contiguous(), mask, out, hc, d,
                                       h.stride(0), h.stride(1), key.stride(0), key.stride(1), value.stride(0),
                                       float(d), float(eps), float(d ** -0.5), 1e-6, MASK=image_mask is not None,
                                       BLOCK=ENGRAM_BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------------------------------------
# RoPE: one kernel per rotation instead of ~5 torch ops (widen, gather the factors, conjugate, complex
# multiply, narrow back), with the CPU's rounding points: each product rounded, then the add (no FMA
# contraction, which nvcc may apply to torch's CUDA complex multiply: its fmad default is on)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(x_ptr, t_ptr, pos_ptr, R, H, stride_xn, stride_xh, OFF, INVERSE: tl.constexpr,
                 HALF: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    mask = (r < R)[:, None]
    n = r // H
    pos = tl.load(pos_ptr + n, mask=r < R, other=0)
    j = tl.arange(0, HALF)[None, :]
    xp = x_ptr + (n * stride_xn + (r % H) * stride_xh + OFF)[:, None] + 2 * j
    tp = t_ptr + (pos * (2 * HALF))[:, None] + 2 * j
    a = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(tp, mask=mask, other=0.0)
    d = tl.load(tp + 1, mask=mask, other=0.0)
    if INVERSE:  # the conjugate; a factor, so +0 becomes -0 as conj() makes it (Triton's minus is 0 - x)
        d = d * -1.0
    tl.store(xp, (a * c - b * d).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(xp + 1, (a * d + b * c).to(x_ptr.dtype.element_ty), mask=mask)


def rope_rotate(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, dim: int, inverse: bool
                ) -> torch.Tensor:
    """cpu.rope_rotate in one kernel, bit for bit (x [N, C] or [N, H, C] with unit last stride)."""
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    n, h, c = x3.shape
    assert x3.stride(2) == 1 and table.dtype == torch.complex64 and dim % 2 == 0
    if n * h:
        rows = 16
        _rope_kernel[(triton.cdiv(n * h, rows),)](x3, torch.view_as_real(table), positions.contiguous(), n * h, h,
                                                  x3.stride(0), x3.stride(1), c - dim, INVERSE=inverse,
                                                  HALF=dim // 2, BR=rows, num_warps=2, enable_fp_fusion=False)
    return x


# ---------------------------------------------------------------------------------------------
# row reductions with a fixed order (torch's CUDA reductions pick their split by tensor shape, so a
# row's sum could depend on how many rows share the call)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _row_sum_kernel(x_ptr, y_ptr, D, stride, SQUARE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride + offs, mask=offs < D, other=0.0).to(tl.float32)
        acc += v * v if SQUARE else v
    tl.store(y_ptr + row, tl.sum(acc, axis=0))


def row_sum(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """fp32 sum (of squares) over the last dim, one program per row, fixed order: [..., D] -> [...]."""
    shape = x.shape[:-1]
    x2 = x.reshape(-1, x.size(-1)).contiguous()
    y = torch.empty(x2.size(0), dtype=torch.float32, device=x.device)
    if x2.size(0):
        _row_sum_kernel[(x2.size(0),)](x2, y, x2.size(1), x2.stride(0), SQUARE=square, BLOCK=256,
                                       enable_fp_fusion=FP_FUSION)
    return y.view(shape)


@triton.jit
def _rms_scale_kernel(v_ptr, ss_ptr, w_ptr, o_ptr, D, C, eps, stride_vn, stride_on, HAS_WEIGHT: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out = [w *] (v * rsqrt(ss / D + eps)) in fp32, rounded once to o's dtype: torch's ops in one launch.
    ss: the row's sum of squares over D values; v, w, out: C columns."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    r = tl.rsqrt(tl.math.div_rn(tl.load(ss_ptr + n), D.to(tl.float32)) + eps)
    y = tl.load(v_ptr + n * stride_vn + offs, mask=mask).to(tl.float32) * r
    if HAS_WEIGHT:
        y = tl.load(w_ptr + offs, mask=mask).to(tl.float32) * y
    tl.store(o_ptr + n * stride_on + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


def _rms_scaled(values: torch.Tensor, x: torch.Tensor, eps: float, weight: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """[weight *] values * rsqrt(mean(x^2) + eps) row by row, with this backend's fixed-order row sum of x's
    squares (x, values: bf16 or fp32 rows, widened in the kernels)."""
    rows, c = values.shape
    ss = row_sum(x, square=True)
    out = torch.empty((rows, c), dtype=dtype, device=values.device)
    if rows:
        _rms_scale_kernel[(rows, triton.cdiv(c, 1024))](values, ss, values if weight is None else weight.contiguous(),
                                                       out, x.size(-1), c, float(eps), values.stride(0),
                                                       out.stride(0), HAS_WEIGHT=weight is not None, BLOCK=1024,
                                                       num_warps=4, enable_fp_fusion=False)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit stride along D, in its own dtype (the kernels widen bf16 exactly on load)."""
    x2 = x.reshape(-1, x.size(-1))
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """cpu.rms_norm with this backend's mean square: the fixed-order row sum of squares, then one kernel
    for the division (IEEE, as torch's), rsqrt and the two products. Triton's rsqrt is `rsqrt.approx.ftz`
    (PTX of Triton 3.6 and 3.9), torch's the same instruction without ftz: equal on the normal values a
    mean square plus eps gives."""
    xr = _rows(x)
    return _rms_scaled(xr, xr, eps, weight, x.dtype).view(x.shape)


def rms_scale(values: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """cpu.rms_scale (the mHC mixes times their input's inverse RMS) as rms_norm does it: fp32 [N, C]."""
    return _rms_scaled(values.float().contiguous(), _rows(x), eps, None, torch.float32)


def small_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over a short dim as explicit adds in fp32, first index first, in x's dtype."""
    parts = x.float().unbind(dim)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.to(x.dtype)


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The grouped output projection: x [M, G, D] bf16, w [G, R, D] bf16 -> [M, G, R] bf16, one launch;
    group g's bits equal `linear(x[:, g], Weight("bf16", w[g]))`."""
    m, groups, d = x.shape
    r = w.size(1)
    x = x.to(torch.bfloat16).contiguous()
    w = w.to(torch.bfloat16).contiguous()
    y = torch.empty((m, groups, r), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    _plain_gemm(x.view(m, groups * d), w, y.view(m, groups * r), "bf16", groups, "tf32", None)
    return y
