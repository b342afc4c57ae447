"""Time the CUDA kernels (dsflash/kernels/cuda/) at real V4.1-Flash shapes.

    DSFLASH_COMMIT=$(git rev-parse HEAD) python -m dsflash.bench.kernels --out bench/results [--sweep]

For each kernel and M in (1, 5, 8, 512, 8192) rows: the median of triton.testing.do_bench, the bytes
it must move (weights/inputs read once, outputs written once) and its FLOPs, the achieved TB/s and
TFLOP/s, and the fraction of the ceiling that binds (copy bandwidth for memory-bound sizes, the
measured dense matrix rate for compute-bound ones), measured in the same run. Weights are rotated
among copies totalling > 2x the L2 so small-M timings read HBM, not the cache. `--sweep` also times
candidate tile configs of the FP8/FP4 GEMM (the chosen one must not depend on M). Writes
kernels-<date>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.testing

from dsflash.bench.common import command
from dsflash.kernels import cpu
from dsflash.kernels import cuda as kc
from dsflash.kernels.cuda import configs
from dsflash.model.attention import INDEXER_ROWS
from dsflash.numerics import BLOCK, packing
from dsflash.numerics.quant import K_RANGE_GROUP

M_VALUES = (1, 5, 8, 512, 8192)
L2_ROTATE_BYTES = 256 << 20

# (layer, kind, out N, in K)
LINEARS = [
    ("wq_a", "fp8", 1280, 5120),
    ("wq_b", "fp8", 32768, 1280),
    ("wkv", "fp8", 512, 5120),
    ("wo_b", "fp8", 5120, 8192),
    ("shared w1/w3", "fp8", 2304, 5120),
    ("shared w2", "fp8", 5120, 2304),
    ("expert w1/w3", "fp4", 2304, 5120),
    ("expert w2", "fp4", 5120, 2304),
    ("indexer.wk", "bf16", 128, 5120),
    ("gate", "fp32", 384, 5120),
    ("mHC fn", "fp32", 24, 20480),
    ("head", "fp32", 129280, 5120),
]
HEAD_MAX_M = 8  # the fp32 head only ever sees the last positions


def bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of eager calls (launch overhead included when it exceeds the GPU time)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, rep=20) -> float:
    """Median milliseconds per call from CUDA-graph replays (GPU time without host launch overhead)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


LAST_EAGER: dict = {}


def bench_both(fn) -> float:
    """Graph time (returned) and eager time (kept in LAST_EAGER["ms"] for the row)."""
    LAST_EAGER["ms"] = bench(fn, warmup=10, rep=40)
    return bench_graph(fn)


def measure_ceilings() -> dict:
    dev = "cuda"
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a))
    copy_tbs = 2 * n / (t * 1e-3) / 1e12
    a = b = None
    s = 8192
    x = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    y = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    t = bench(lambda: x @ y)
    bf16_tflops = 2 * s**3 / (t * 1e-3) / 1e12
    fp8_tflops = None
    try:
        xf = x.to(torch.float8_e4m3fn)
        yf = y.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=dev)
        t = bench(lambda: torch._scaled_mm(xf, yf, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        fp8_tflops = 2 * s**3 / (t * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001
        print("fp8 ceiling not measured:", e, file=sys.stderr)
    return {"copy_TBps": copy_tbs, "bf16_TFLOPs": bf16_tflops, "fp8_TFLOPs": fp8_tflops}


def random_cuda_weight(kind: str, n: int, k: int) -> kc.CudaWeight:
    """A CUDA-layout weight filled with random valid codes and E8M0 scales (built on the GPU)."""
    dev = "cuda"
    kb = k // BLOCK
    kc_ = triton.cdiv(kb, K_RANGE_GROUP)
    if kind == "fp8":
        vals = (torch.randn(n, k, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        words = torch.randint(118, 126, (kc_, triton.cdiv(n, BLOCK), K_RANGE_GROUP), dtype=torch.uint8, device=dev)
        return kc.CudaWeight("fp8", vals, words.view(torch.int32)[..., 0].contiguous(), BLOCK)
    if kind == "fp4":
        vals = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        words = torch.randint(118, 126, (kc_, n, K_RANGE_GROUP), dtype=torch.uint8, device=dev)
        return kc.CudaWeight("fp4", vals, words.view(torch.int32)[..., 0].contiguous(), 1)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    return kc.CudaWeight(kind, (torch.randn(n, k, device=dev) / k**0.5).to(dtype))


def weight_bytes(w: kc.CudaWeight) -> int:
    scale = 0 if w.scale is None else w.scale.numel() * w.scale.element_size()
    return w.values.numel() * w.values.element_size() + scale


def _rotating(fns):
    state = {"i": 0}

    def call():
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        fn()
    return call


def row(kernel, shape, m, ms, nbytes, flops, ceil, extra=None):
    tbs = nbytes / (ms * 1e-3) / 1e12
    tflops = flops / (ms * 1e-3) / 1e12
    t_mem = nbytes / (ceil["copy_TBps"] * 1e12)
    rate = ceil["fp8_TFLOPs"] if extra and extra.get("fp8") and ceil.get("fp8_TFLOPs") else ceil["bf16_TFLOPs"]
    t_cmp = flops / (rate * 1e12)
    bound = "memory" if t_mem >= t_cmp else "compute"
    floor_ms = max(t_mem, t_cmp) * 1e3
    eager = LAST_EAGER.pop("ms", None)
    r = {"kernel": kernel, "shape": shape, "M": m, "us": ms * 1e3, "eager_us": None if eager is None else eager * 1e3,
         "bytes": nbytes, "flops": flops,
         "TBps": tbs, "TFLOPs": tflops, "bound": bound, "floor_us": floor_ms * 1e3,
         "pct_of_ceiling": 100 * floor_ms / ms}
    if extra:
        r.update({k: v for k, v in extra.items() if k != "fp8"})
    print(f"{kernel:<18} {shape:<22} M={m:<5} {ms * 1e3:9.1f} us (eager {r['eager_us'] or 0:7.1f}) {tbs:5.2f} TB/s "
          f"{tflops:6.1f} TFLOP/s "
          f"{bound:<7} {r['pct_of_ceiling']:5.1f}% of floor {r.get('note', '')}", flush=True)
    return r


def bench_linears(ceil, ms_values, sweep: bool) -> list[dict]:
    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name, kind, n, k in LINEARS:
        w0 = random_cuda_weight(kind, n, k)
        wb = weight_bytes(w0)
        n_copies = min(128, -(-max(L2_ROTATE_BYTES, 2 * l2) // wb))
        copies = [w0] + [random_cuda_weight(kind, n, k) for _ in range(n_copies - 1)]
        for m in ms_values:
            if name == "head" and m > HEAD_MAX_M:
                continue
            x = (torch.randn(m, k, device="cuda")).to(torch.float32 if kind == "fp32" else torch.bfloat16)
            out_b = 4 if kind == "fp32" else 2
            nbytes = wb + x.numel() * x.element_size() + m * n * out_b
            flops = 2 * m * n * k
            cfg = configs.linear_config(kind, n, k, m)
            fn = _rotating([lambda w=w, x=x: kc.linear(x, w) for w in copies])
            ms = bench_both(fn)
            extra = {"fp8": kind in ("fp8", "fp4"), "layer": name, "kind": kind,
                     "config": f"BM{cfg.BM} BN{cfg.BN} w{cfg.num_warps} s{cfg.num_stages}"}
            if kind in ("fp8", "fp4"):
                extra["fused_quant"] = m <= configs.FUSE_QUANT_MAX_M
            rows.append(row(f"linear {kind}", f"{name} {k}->{n}", m, ms, nbytes, flops, ceil, extra))
            alts = []  # the same bits by another route: record what each M-dependent choice buys
            if kind in ("fp8", "fp4") and m <= configs.SPREAD_MAX_M:
                alts += [{"fuse_quant": m > configs.FUSE_QUANT_MAX_M}, {"spread": False}]
            if kind == "fp4" and m >= configs.FP4_PRECONVERT_M:
                alts += [{"preconvert": False}]
            if kind == "fp32":
                alts += [{"fp32_precision": "ieee"}]
            for alt in alts:
                ms2 = bench_both(_rotating([lambda w=w, x=x, a=alt: kc.linear(x, w, **a) for w in copies]))
                note = " ".join(f"{key}={val}" for key, val in alt.items())
                rows.append(row(f"linear {kind} alt", f"{name} {k}->{n}", m, ms2, nbytes, flops, ceil,
                                dict(extra, note=note)))
            if kind in ("bf16", "fp8", "fp4") and m in (1, 8192):  # cuBLAS bf16 for context (not row-invariant)
                wref = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                xb = x.bfloat16()
                ms3 = bench_both(lambda xb=xb, wref=wref: torch.nn.functional.linear(xb, wref))
                ref_bytes = n * k * 2 + xb.numel() * 2 + m * n * 2
                rows.append(row("cuBLAS bf16 (ref)", f"{name} {k}->{n}", m, ms3, ref_bytes, flops, ceil,
                                {"layer": name, "kind": "bf16-cublas"}))
            if sweep and kind in ("fp8", "fp4") and m in (1, 512, 8192):
                for cand in SWEEP_CONFIGS:
                    if cand == cfg:
                        continue
                    try:
                        fns = [lambda w=w, x=x, c=cand: kc.linear(x, w, config=c) for w in copies]
                        ms4 = bench_graph(_rotating(fns))
                    except Exception as e:  # noqa: BLE001
                        print("sweep config failed", cand, e, file=sys.stderr)
                        continue
                    rows.append(row(f"sweep {kind}", f"{name} {k}->{n}", m, ms4, nbytes, flops, ceil,
                                    dict(extra, config=f"BM{cand.BM} BN{cand.BN} w{cand.num_warps} s{cand.num_stages}",
                                         note=f"cfg BM{cand.BM} BN{cand.BN} w{cand.num_warps} s{cand.num_stages}")))
        del copies, w0
        torch.cuda.empty_cache()
    return rows


def bench_experts(ceil, rows_values=(1, 5, 8), experts=48, top_k=6) -> list[dict]:
    """expert_linear over a step's (row, slot) pairs: top-6 of 48 experts per row, banks rotated so the
    weights come from HBM; the K ranges as separate programs (default) or in one (same bits)."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, n, k in (("expert w1/w3", 2304, 5120), ("expert w2", 5120, 2304)):
        banks = [kc.expert_bank([random_cuda_weight("fp4", n, k) for _ in range(experts)]) for _ in range(3)]
        per_expert = weight_bytes(banks[0][0])
        for m in rows_values:
            ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)]).cuda()
            per_row = top_k if name == "expert w1/w3" else 1
            x = torch.randn(m * top_k // per_row, k, device="cuda").bfloat16()
            used = len(set(ids.flatten().tolist()))
            nbytes = used * per_expert + x.numel() * 2 + m * top_k * n * 2
            flops = 2 * m * top_k * n * k
            for spread in (None, False):
                fn = _rotating([lambda b=b, s=spread, x=x, ids=ids, r=per_row: kc.expert_linear(x, b, ids, r, spread=s)
                                for b in banks])
                ms = bench_both(fn)
                note = "K ranges spread" if spread is None else "K ranges in one program"
                rows.append(row("expert_linear", f"{name} {k}->{n} x{m * top_k}", m, ms, nbytes, flops, ceil,
                                {"fp8": True, "note": note}))
        del banks
        torch.cuda.empty_cache()
    return rows


def bench_prefill_experts(ceil, m=8192, top_k=6) -> list[dict]:
    """A prefill chunk's routed w1 GEMM: expert_linear over its m * top_k slots (per-expert tiles, one launch)
    against one `linear` per used expert over its gathered rows (the loop it replaces; the gathers and the
    host read of the counts are outside the timing), with 48 experts (the bench checkpoint) and 384 (the
    released model: ~128 rows an expert)."""
    rows = []
    g = torch.Generator().manual_seed(0)
    n, k = 2304, 5120
    for experts in (48, 384):
        bank = kc.expert_bank([random_cuda_weight("fp4", n, k) for _ in range(experts)])
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)]).cuda()
        x = torch.randn(m, k, device="cuda").bfloat16()
        nbytes = experts * weight_bytes(bank[0]) + x.numel() * 2 + m * top_k * n * 2
        flops = 2 * m * top_k * n * k
        for widen in (True, False):
            ms = bench_both(lambda b=bank, x=x, ids=ids, w=widen: kc.expert_linear(x, b, ids, top_k, preconvert=w))
            note = "FP4 widened to E4M3 first" if widen else "FP4 in tiles"
            rows.append(row("expert_linear tiles", f"w1 {k}->{n} x{m * top_k}, {experts} experts", m, ms, nbytes,
                            flops, ceil, {"fp8": True, "note": note}))
        flat = ids.flatten()
        groups = [(e, x[(flat == e).nonzero()[:, 0] // top_k].contiguous()) for e in range(experts)]

        def loop(b=bank, groups=groups):
            for e, xe in groups:
                if xe.size(0):
                    kc.linear(xe, b[e])
        LAST_EAGER["ms"] = bench(loop, warmup=3, rep=10)
        rows.append(row("expert loop (linear)", f"w1 {k}->{n} x{m * top_k}, {experts} experts", m, LAST_EAGER["ms"],
                        nbytes, flops, ceil, {"fp8": True, "note": "eager"}))
        del bank, groups
        torch.cuda.empty_cache()
    return rows


SWEEP_CONFIGS = [
    configs.LinearConfig(64, 64, 32, 4, 4),
    configs.LinearConfig(128, 64, 32, 8, 3),
    configs.LinearConfig(128, 128, 32, 8, 3),
]


def bench_quant(ceil, ms_values) -> list[dict]:
    rows = []
    for k in (5120,):
        for m in ms_values:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ms = bench_both(lambda x=x: kc.quant_act(x))
            rows.append(row("quant_act", f"K={k}", m, ms, m * k * 3 + m * k // BLOCK, 0, ceil))
    # the packed FP4 state: quantise-and-pack new entries / keys, and read entries back (a step's picks,
    # a prefill's whole source)
    for name, d, (block, e4m3) in (("entry", 512, packing.ENTRY), ("index key", 128, packing.INDEX_KEY)):
        width = packing.packed_width(d, block)
        for m in (*ms_values, 65536):
            x = torch.randn(m, d, device="cuda").bfloat16()
            packed = kc.fp4_quant_packed(x, block, e4m3)
            ms = bench_both(lambda x=x, b=block, e=e4m3: kc.fp4_quant_packed(x, b, e))
            rows.append(row("fp4_quant_packed", f"{name} {d}", m, ms, m * (2 * d + width), 0, ceil))
            ms = bench_both(lambda p=packed, d=d, b=block, e=e4m3: kc.fp4_dequant_packed(p, d, b, e))
            rows.append(row("fp4_dequant_packed", f"{name} {d}", m, ms, m * (2 * d + width), 0, ceil))
    return rows


def bench_sparse_attn(ceil, ms_values, h=64, d=512, k=640) -> list[dict]:
    rows = []
    for n in ms_values:
        r = max(8192, n) + 128
        q = torch.randn(n, h, d, device="cuda").bfloat16()
        kv = torch.randn(r, d, device="cuda").bfloat16()
        sink = torch.randn(h, device="cuda")
        idx = torch.randint(0, r, (n, k), device="cuda", dtype=torch.int32)
        ms = bench_both(lambda q=q, kv=kv, sink=sink, idx=idx: kc.sparse_attn(q, kv, sink, idx, d ** -0.5))
        rows_read = min(r, n * k)
        nbytes = 2 * q.numel() * 2 + rows_read * d * 2 + idx.numel() * 4
        flops = 4 * n * h * k * d
        rows.append(row("sparse_attn", f"H{h} D{d} K{k}", n, ms, nbytes, flops, ceil))
    return rows


def composed_index_scores(q, keys, weights, visible, keep, block):
    """The CUDA backend's indexer scores before the fused kernel: the bf16 GEMM of every (row, head) query
    with the keys, then cpu.index_scores' composition with this backend's head sum (35 launches)."""
    n, h, d = q.shape
    logits = kc.linear(q.reshape(n * h, d), keys).view(n, h, -1)
    scores = kc.small_sum(logits.relu_() * weights.unsqueeze(-1), 1)
    scores.masked_fill_(torch.arange(logits.size(-1), device=q.device) >= visible, -torch.inf)
    if keep is not None:
        scores.masked_fill_(~keep.repeat_interleave(block, dim=-1)[..., : logits.size(-1)], -torch.inf)
    return scores


def bench_indexer(ceil, ms_values, h=32, d=128, topk=512, block=8, blocks=2048) -> list[dict]:
    """An index layer's scoring and top-k over 4K (8K context, ratio 2) and 64K (128K context) entries,
    with the composition the fused scores replaced (the bf16 GEMM then 35 elementwise launches) beside."""
    rows = []
    for e in (4096, 65536, 131072):
        keys = torch.randn(e, d, device="cuda").bfloat16()
        kw = kc.to_cuda_weight(cpu.Weight("bf16", keys))
        for n in ms_values:
            if n > INDEXER_ROWS:  # the model scores at most this many rows at a time
                continue
            q = torch.randn(n, h, d, device="cuda").bfloat16()
            w = (torch.randn(n, h, device="cuda") * 0.1).bfloat16()
            vis = torch.full((n, 1), e, device="cuda")
            ms = bench_both(lambda q=q, k=keys, w=w, v=vis: kc.index_scores(q, k, w, v, None, block))
            flops, nbytes = 2 * n * h * d * e, e * d * 2 + n * e * 2
            rows.append(row("index_scores", f"H{h} D{d} E{e}", n, ms, nbytes, flops, ceil))
            ms = bench_both(lambda q=q, kw=kw, w=w, v=vis: composed_index_scores(q, kw, w, v, None, block))
            rows.append(row("index_scores composed", f"H{h} D{d} E{e}", n, ms, nbytes, flops, ceil))
            scores = kc.index_scores(q, keys, w, vis, None, block)
            ms = bench_both(lambda s=scores, v=vis: kc.topk_indices(s, topk, v, topk, kernel=True))
            rows.append(row("topk_indices kernel", f"E{e} k{topk}", n, ms, 5 * n * e * 2, 0, ceil))
            ms = bench_both(lambda s=scores, v=vis: cpu.topk_indices(s, topk, v, topk))
            rows.append(row("topk_indices torch sort", f"E{e} k{topk}", n, ms, n * e * 2, 0, ceil))
            ms = bench_both(lambda s=scores, v=vis: kc.candidate_blocks(s, v, blocks, block, kernel=True))
            rows.append(row("candidate_blocks kernel", f"E{e} {blocks}x{block}", n, ms, 5 * n * e * 2, 0, ceil))
            ms = bench_both(lambda s=scores, v=vis: cpu.candidate_blocks(s, v, blocks, block))
            rows.append(row("candidate_blocks torch sort", f"E{e} {blocks}x{block}", n, ms, n * e * 2, 0, ceil))
    return rows


def bench_hc(ceil, ms_values) -> list[dict]:
    rows = []
    for n in ms_values:
        mixes = torch.randn(n, 24, device="cuda")
        scale = torch.rand(3, device="cuda")
        base = torch.randn(24, device="cuda")
        ms = bench_both(lambda m=mixes, s=scale, b=base: kc.hc_split_sinkhorn(m, s, b, 4, 20, 1e-6))
        flops = n * (20 * 2 * 16 * 3)  # ~3 ops per element per half-round
        rows.append(row("hc_split_sinkhorn", "hc=4 iters=20", n, ms, n * 48 * 4, flops, ceil))
    return rows


def to_markdown(meta: dict, rows: list[dict]) -> str:
    c = meta["ceilings"]
    fp8 = f"{c['fp8_TFLOPs']:.0f}" if c.get("fp8_TFLOPs") else "n/a"
    lines = [
        f"# Kernel timings {meta['date']}",
        "",
        f"GPU: {meta['gpu']}; torch {meta['torch']}; triton {meta['triton']}; commit {meta['commit']}",
        f"Command: `{meta['command']}`",
        f"Ceilings measured in this run: copy {c['copy_TBps']:.2f} TB/s (read+write), "
        f"bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s, fp8 _scaled_mm {fp8} TFLOP/s.",
        "Floor = max(bytes / copy rate, FLOPs / matrix rate (fp8 rate for fp8/fp4 GEMMs)); "
        "% = floor / measured time.",
        "",
        "µs = median per call from CUDA-graph replays; eager µs = median of plain calls (host launch "
        "overhead included).",
        "",
        "| kernel | shape | M | config | µs | eager µs | TB/s | TFLOP/s | bound | % of floor | note |",
        "|---|---|---:|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        eager = "" if r.get("eager_us") is None else f"{r['eager_us']:.1f}"
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['M']} | {r.get('config', '')} | {r['us']:.1f} | {eager} | "
                     f"{r['TBps']:.2f} | {r['TFLOPs']:.1f} | {r['bound']} | {r['pct_of_ceiling']:.1f} | "
                     f"{r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sweep", action="store_true", help="also time candidate FP8/FP4 tile configs")
    ap.add_argument("--only", default="linear,experts,quant,attn,indexer,hc")
    ap.add_argument("--m", default=",".join(map(str, M_VALUES)))
    args = ap.parse_args(argv)
    ms_values = [int(v) for v in args.m.split(",")]
    only = set(args.only.split(","))
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print("ceilings", json.dumps(ceil), flush=True)
    rows: list[dict] = []
    if "linear" in only:
        rows += bench_linears(ceil, ms_values, args.sweep)
    if "experts" in only:
        rows += bench_experts(ceil)
        rows += bench_prefill_experts(ceil)
    if "quant" in only:
        rows += bench_quant(ceil, ms_values)
    if "attn" in only:
        rows += bench_sparse_attn(ceil, ms_values)
    if "indexer" in only:
        rows += bench_indexer(ceil, ms_values)
    if "hc" in only:
        rows += bench_hc(ceil, ms_values)
    date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    meta = {"date": date, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "commit": os.environ.get("DSFLASH_COMMIT", "unknown"),
            "command": command(argv if argv is not None else sys.argv[1:], "python -m dsflash.bench.kernels"),
            "ceilings": ceil}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"kernels-{date}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(to_markdown(meta, rows))
    print("wrote", stem.with_suffix(".json"), stem.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
