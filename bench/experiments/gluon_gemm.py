"""Experiment (GPU; compiles offline too): does an MMA issued one K block ahead of its promotion speed up the
block-scaled GEMM, with the same bits?

The engine's GEMM (dsflash/kernels/cuda/gemm.py `_bs_gemm_kernel`) multiplies each 32-wide K block from a fresh
accumulator and promotes it at once (acc += partial * (a_s * b_s)): Triton's `tl.dot` then waits for every
block's wgmma (`wgmma.wait_group 0`), so the tensor cores idle during each promotion. Here the same arithmetic
in two kernels over one simple layout (f16 operands holding E4M3 codes exactly, fp32 per-(row, block) and
per-(column, block) scales):
- `tl_dot`: Triton, a fresh `tl.dot` per block and its promotion (the engine's pattern);
- `gluon`: Gluon, block k+1's wgmma issued asynchronously before block k is retired
  (`warpgroup_mma_wait(num_outstanding=1)`) and promoted, operands staged through shared buffers by the threads;
- `tl_dot prescaled`: `tl_dot` with the activation's power-of-two scale folded into a bf16 operand (exact), the
  promotion multiplying by the weight's scale alone;
- `gluon_v2`: the same overlap, A widened in the MMA's register operand layout (no shared round trip), the weight
  widened to f16 once per call and streamed by cp.async through a STAGES-deep ring.
All promote in K order from zero, so their bits must be equal (the experiment prints DIFF otherwise).

    python bench/experiments/gluon_gemm.py            # on the GPU: bits and CUDA-graph µs at M = 8, 512, 8192
    python bench/experiments/gluon_gemm.py --compile  # anywhere: sm_90 PTX of the Gluon kernel, wait pattern
"""

import re
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from dsflash.kernels.cuda.common import FP_FUSION
from dsflash.numerics import BLOCK

BK = tl.constexpr(BLOCK)  # the model's activation-quantisation block: one promotion per BLOCK K
# Gluon moved between Triton 3.6 (the GPU machine) and 3.9: the CTA barrier's name, and whether an async MMA's
# wait returns the finished accumulator (with `warpgroup_mma_init`) or leaves it in the MMA's own result
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
WAIT_RETURNS = tl.constexpr(hasattr(hopper, "warpgroup_mma_init"))
cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared


@triton.jit
def tl_dot_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                  PRESCALED: tl.constexpr):
    """A fresh `tl.dot` per block, promoted at once. PRESCALED: the activation's power-of-two block scale folded
    into a bf16 operand (exact: an E4M3 code times 2^e is a bf16 value), so the promotion multiplies by the
    weight's scale alone: one op an output element per block less."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    kb_n = K // BK
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(kb_n):
        a = tl.load(a_ptr + rm[:, None] * K + kb * BK + rk[None, :], mask=(rm < M)[:, None], other=0.0)
        b = tl.load(b_ptr + rn[None, :] * K + kb * BK + rk[:, None], mask=(rn < N)[None, :], other=0.0)
        sa = tl.load(as_ptr + rm * kb_n + kb, mask=rm < M, other=1.0)
        sb = tl.load(bs_ptr + rn * kb_n + kb, mask=rn < N, other=1.0)
        if PRESCALED:
            a = (a.to(tl.float32) * sa[:, None]).to(tl.bfloat16)
            acc += tl.dot(a, b.to(tl.bfloat16)) * sb[None, :]
        else:
            acc += tl.dot(a.to(tl.float16), b.to(tl.float16)) * (sa[:, None] * sb[None, :])
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


@gluon.jit
def _retire(token, outstanding: gl.constexpr):
    """The accumulator of the async MMA `token` once at most `outstanding` newer ones are in flight."""
    if WAIT_RETURNS:
        done = warpgroup_mma_wait(num_outstanding=outstanding, deps=[token])
    else:
        warpgroup_mma_wait(num_outstanding=outstanding, deps=[token])
        done = token
    return done


@gluon.jit
def _block(a_ptr, b_ptr, as_ptr, bs_ptr, am, ak, bk, bn, sm, sn, M, N, K, kb, live):
    """Block kb's operands (E4M3 codes) and scales, in registers; zeros and ones where not `live`."""
    kb_n = K // BK
    a = gl.load(a_ptr + am[:, None] * K + kb * BK + ak[None, :], mask=(am < M)[:, None] & live, other=0.0)
    b = gl.load(b_ptr + bn[None, :] * K + kb * BK + bk[:, None], mask=(bn < N)[None, :] & live, other=0.0)
    sa = gl.load(as_ptr + sm * kb_n + kb, mask=(sm < M) & live, other=1.0)
    sb = gl.load(bs_ptr + sn * kb_n + kb, mask=(sn < N) & live, other=1.0)
    return a, b, sa, sb


@gluon.jit
def gluon_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, y_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr,
                 WARPS: gl.constexpr):
    # one warpgroup per 64 rows; the next block's operands and scales are loaded into registers while this
    # block's MMA runs, and three shared buffers let a warpgroup run a block ahead of the other
    load_a: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
    load_b: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, WARPS], [0, 1])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BN, 16])
    smem_a: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    smem_b: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2,
                                                transposed=True)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    am = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, load_a))
    ak = gl.arange(0, BK, layout=gl.SliceLayout(0, load_a))
    bk = gl.arange(0, BK, layout=gl.SliceLayout(1, load_b))
    bn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, load_b))
    sm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    sn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    a_bufs = gl.allocate_shared_memory(gl.float16, [3, BM, BK], smem_a)
    b_bufs = gl.allocate_shared_memory(gl.float16, [3, BK, BN], smem_b)
    kb_n = K // BK
    zero = gl.zeros([BM, BN], gl.float32, mma)
    acc = gl.zeros([BM, BN], gl.float32, mma)
    a, b, psa, psb = _block(a_ptr, b_ptr, as_ptr, bs_ptr, am, ak, bk, bn, sm, sn, M, N, K, 0, kb_n > 0)
    a_bufs.index(0).store(a.to(gl.float16))
    b_bufs.index(0).store(b.to(gl.float16))
    fence_async_shared()
    cta_barrier()
    prev = warpgroup_mma(a_bufs.index(0), b_bufs.index(0), zero, use_acc=False, is_async=True)
    a, b, nsa, nsb = _block(a_ptr, b_ptr, as_ptr, bs_ptr, am, ak, bk, bn, sm, sn, M, N, K, 1, kb_n > 1)
    for kb in range(1, kb_n):
        s = kb % 3
        a_bufs.index(s).store(a.to(gl.float16))
        b_bufs.index(s).store(b.to(gl.float16))
        fence_async_shared()
        cta_barrier()
        cur = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), zero, use_acc=False, is_async=True)
        csa = nsa
        csb = nsb
        a, b, nsa, nsb = _block(a_ptr, b_ptr, as_ptr, bs_ptr, am, ak, bk, bn, sm, sn, M, N, K, kb + 1,
                                kb + 1 < kb_n)
        part = _retire(prev, 1)  # block kb - 1 done, kb in flight
        acc += part * (psa[:, None] * psb[None, :])
        prev = cur
        psa = csa
        psb = csb
    part = _retire(prev, 0)
    acc += part * (psa[:, None] * psb[None, :])
    gl.store(y_ptr + sm[:, None] * N + sn[None, :], acc, mask=(sm < M)[:, None] & (sn < N)[None, :])


@gluon.jit
def _v2_issue(a_ptr, b_rows, b_bufs, as_ptr, bs_ptr, am, ak, bn, sm, sn, M, N, K, kb, a, sa, sb, zero,
              STAGES: gl.constexpr):
    """v2's step kb: wait for block kb's weight slot, refill the slot of block kb - 2, issue block kb's MMA,
    load block kb + 1's activations and scales. Returns (MMA, next a, kb's scales, next scales)."""
    kb_n = K // BK
    async_copy.wait_group(STAGES - 3)  # block kb's copy landed (this thread's part)
    cta_barrier()  # every thread's part, and every thread's MMA kb - 2 retired: its slot may be refilled
    fence_async_shared()
    nxt = kb + STAGES - 2
    cp_async(b_bufs.index(nxt % STAGES), b_rows + nxt * BK, mask=(bn < N)[None, :] & (nxt < kb_n))
    async_copy.commit_group()
    mma = warpgroup_mma(a.to(gl.float16), b_bufs.index(kb % STAGES), zero, use_acc=False, is_async=True)
    live = kb + 1 < kb_n
    a = gl.load(a_ptr + am[:, None] * K + (kb + 1) * BK + ak[None, :], mask=(am < M)[:, None] & live, other=0.0)
    sa_next = gl.load(as_ptr + sm * kb_n + kb + 1, mask=(sm < M) & live, other=1.0)
    sb_next = gl.load(bs_ptr + sn * kb_n + kb + 1, mask=(sn < N) & live, other=1.0)
    return mma, a, sa, sb, sa_next, sb_next


@gluon.jit
def gluon_v2_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, y_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr,
                    WARPS: gl.constexpr, STAGES: gl.constexpr):
    """v2: one warpgroup; A (E4M3 codes) loaded a block ahead straight into the MMA's register operand layout
    and widened there (no shared round trip); B (the weight, widened to f16 once per call) streamed by
    cp.async through a STAGES-deep shared ring, the slot of block kb - 2 refilled after every thread retired
    its MMA; each block's MMA runs while the previous block is promoted."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BN, 16])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    load_b: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, WARPS], [0, 1])
    smem_b: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2,
                                                transposed=True)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    am = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, dot_a))
    ak = gl.arange(0, BK, layout=gl.SliceLayout(0, dot_a))
    bk = gl.arange(0, BK, layout=gl.SliceLayout(1, load_b))
    bn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, load_b))
    sm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    sn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    b_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, BK, BN], smem_b)
    kb_n = K // BK
    b_rows = b_ptr + bn[None, :] * K + bk[:, None]
    for j in gl.static_range(STAGES - 2):  # blocks 0 .. STAGES - 3 in flight
        cp_async(b_bufs.index(j), b_rows + j * BK, mask=(bn < N)[None, :] & (j < kb_n))
        async_copy.commit_group()
    zero = gl.zeros([BM, BN], gl.float32, mma)
    acc = gl.zeros([BM, BN], gl.float32, mma)
    a = gl.load(a_ptr + am[:, None] * K + ak[None, :], mask=(am < M)[:, None], other=0.0)
    sa = gl.load(as_ptr + sm * kb_n, mask=sm < M, other=1.0)
    sb = gl.load(bs_ptr + sn * kb_n, mask=sn < N, other=1.0)
    prev, a, psa, psb, sa, sb = _v2_issue(a_ptr, b_rows, b_bufs, as_ptr, bs_ptr, am, ak, bn, sm, sn, M, N, K, 0, a,
                                          sa, sb, zero, STAGES)
    for kb in range(1, kb_n):
        cur, a, csa, csb, sa, sb = _v2_issue(a_ptr, b_rows, b_bufs, as_ptr, bs_ptr, am, ak, bn, sm, sn, M, N, K, kb,
                                             a, sa, sb, zero, STAGES)
        part = _retire(prev, 1)  # block kb - 1 done, kb in flight
        acc += part * (psa[:, None] * psb[None, :])
        prev = cur
        psa = csa
        psb = csb
    part = _retire(prev, 0)
    acc += part * (psa[:, None] * psb[None, :])
    gl.store(y_ptr + sm[:, None] * N + sn[None, :], acc, mask=(sm < M)[:, None] & (sn < N)[None, :])


# (kernel, BM, BN, warps, stages): the first config is the bits reference; 128x128 with 8 warps and 2 stages is
# the engine's large-M FP8 config; gluon_v2 takes the weight widened to f16 (once per call: timed apart)
CONFIGS = [("tl_dot", 64, 64, 4, 4), ("tl_dot", 128, 128, 8, 2), ("tl_dot prescaled", 64, 64, 4, 4),
           ("tl_dot prescaled", 128, 128, 8, 2), ("gluon", 128, 64, 8, 1), ("gluon_v2", 64, 64, 4, 4)]
BM, BN, WARPS = 64, 64, 4  # --compile


def run(cfg, a, b, sa, sb) -> torch.Tensor:
    name, bm, bn, warps, stages = cfg
    m, k = a.shape
    n = b.size(0)
    y = torch.empty(m, n, device=a.device)
    if name.startswith("tl_dot"):
        kernel, extra = tl_dot_kernel, {"num_stages": stages, "PRESCALED": name != "tl_dot"}
    elif name == "gluon":
        kernel, extra = gluon_kernel, {"WARPS": warps}
    else:
        kernel, extra = gluon_v2_kernel, {"WARPS": warps, "STAGES": stages}
    kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](a, b, sa, sb, y, m, n, k, BM=bm, BN=bn, num_warps=warps,
                                                    enable_fp_fusion=FP_FUSION, **extra)
    return y


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "as_ptr": "*fp32", "bs_ptr": "*fp32", "y_ptr": "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "BM": "constexpr", "BN": "constexpr", "WARPS": "constexpr"}
    names = gluon_kernel.arg_names
    src = GluonASTSource(fn=gluon_kernel, signature=sig,
                         constexprs={(names.index("BM"),): BM, (names.index("BN"),): BN,
                                     (names.index("WARPS"),): WARPS})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})
    ops = [ln.strip() for ln in k.asm["ptx"].splitlines() if "wgmma" in ln]
    print("wgmma ops:", "".join("M" if "mma_async" in op else "W" + re.sub(r"\D", "", op) if "wait" in op else ""
                                for op in ops))


def main() -> None:
    if "--compile" in sys.argv:
        compile_only()
        return
    from triton.testing import do_bench_cudagraph

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in (("wo_b", 5120, 8192), ("wq_a", 1280, 5120)):
        for m in (8, 512, 8192):
            a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
            sa = torch.exp2(torch.randint(-8, 8, (m, k // BK), device="cuda", generator=g).float())
            sb = torch.rand(n, k // BK, device="cuda", generator=g) / 64
            b16 = b.to(torch.float16)
            ref = run(CONFIGS[0], a, b, sa, sb)
            cells = []
            for cfg in CONFIGS:
                args = (a, b16 if cfg[0] == "gluon_v2" else b, sa, sb)
                same = torch.equal(ref, run(cfg, *args))
                us = do_bench_cudagraph(lambda cfg=cfg, args=args: run(cfg, *args)) * 1000
                label = f"{cfg[0]} {cfg[1]}x{cfg[2]}/w{cfg[3]}/s{cfg[4]}"
                cells.append(f"{label} {us:8.1f} µs {2 * m * n * k / us / 1e6:4.0f} TF/s{'' if same else ' DIFF'}")
            widen = do_bench_cudagraph(lambda b=b: b.to(torch.float16)) * 1000
            print(f"{name} M={m:<5} " + " | ".join(cells) + f" | widening the weight to f16 {widen:.1f} µs",
                  flush=True)


if __name__ == "__main__":
    main()
