"""Experiment (GPU): FP8/FP4 GEMMs with the shape-fixed K ranges (NUMERICS_VERSION 3) against other kernel
versions passed as paths: a copy of the kernel package (a variant of this one, or an older one, e.g.
`mkdir old && git archive REV dsflash/kernels/cuda | tar -x -C old` then old/dsflash/kernels/cuda), or a
single-module kernel of the trees before the package (e.g. `git show 1027ac9:dsflash/kernels/cuda.py >
old.py`); each labelled by its file or folder name, DIFF where its bits differ from this tree's), at decode
and prefill sizes (there also other tile configs); at decode sizes also the bit-neutral choices (activation
quantisation fused into the GEMM; K ranges spread over programs or in one), checked to keep the bits.

    python bench/experiments/decode_gemm.py [--decode|--prefill] [old.py | dir ...] > $OUT/decode-gemm.txt
    (--decode: M = 1 and 8 only; --prefill: M = 512 and 8192 only)
"""

import importlib.util
import sys
from pathlib import Path

import torch

from dsflash.bench.kernels import LINEARS, _rotating, bench_graph, random_cuda_weight, weight_bytes
from dsflash.kernels import cuda as kc
from dsflash.kernels.cuda.configs import LinearConfig
from dsflash.numerics import BLOCK

SHAPES = [shape for shape in LINEARS if shape[1] in ("fp8", "fp4")]
# large-M tile configs (the range sum is a second accumulator: 64x64 tiles need ~250 registers)
WIDE_CANDIDATES = [LinearConfig(64, 32, 32, 4, 4), LinearConfig(128, 64, 32, 8, 3), LinearConfig(128, 128, 32, 8, 3),
                   LinearConfig(128, 128, 32, 8, 2)]


def act(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, device="cuda")
    mag = torch.exp2(torch.randint(-6, 7, (m, k // BLOCK), device="cuda").float()).repeat_interleave(BLOCK, 1)
    return (x * mag).bfloat16()


def load_module(path: str):
    """A kernel module file, or a kernel package folder (its modules import each other relatively: the copy's
    own modules load, under its name)."""
    p = Path(path)
    name = p.name if p.is_dir() else p.stem
    if p.is_dir():
        spec = importlib.util.spec_from_file_location(name, p / "__init__.py", submodule_search_locations=[str(p)])
    else:
        spec = importlib.util.spec_from_file_location(name, p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def module_values(mod, kind: str, values: torch.Tensor) -> torch.Tensor:
    """This tree's weight values in another kernel module's layout (FP4: the word layout of fp4_words, where
    one module has it and the other not)."""
    if kind == "fp4" and hasattr(mod, "fp4_words") and not hasattr(kc, "fp4_words"):
        return mod.fp4_words(values)
    if kind == "fp4" and hasattr(kc, "fp4_words") and not hasattr(mod, "fp4_words"):
        raise SystemExit("compare a word-layout module against an older one from the older tree")
    return values


def timed(fns) -> str:
    return f"{bench_graph(_rotating(fns)) * 1e3:7.1f}"


def main() -> None:
    others = {mod.__name__: mod for mod in (load_module(p) for p in sys.argv[1:] if not p.startswith("--"))}
    sizes = (1, 8) if "--decode" in sys.argv else (512, 8192) if "--prefill" in sys.argv else (1, 8, 512, 8192)
    torch.manual_seed(0)
    for label, kind, n, k in SHAPES:
        w = random_cuda_weight(kind, n, k)
        copies = [w] + [random_cuda_weight(kind, n, k) for _ in range(max(1, (256 << 20) // weight_bytes(w)))]
        for m in sizes:
            x = act(m, k)
            ref = kc.linear(x, w)
            out = [f"default {timed([lambda w=c, x=x: kc.linear(x, w) for c in copies])}"]
            if m <= 16:
                for name, kw in (("unfused", {"fuse_quant": False}), ("one program", {"spread": False})):
                    same = torch.equal(kc.linear(x, w, **kw), ref)
                    out.append(f"{name} {timed([lambda w=c, x=x, kw=kw: kc.linear(x, w, **kw) for c in copies])}"
                               f"{'' if same else ' DIFF'}")
            else:
                for cfg in WIDE_CANDIDATES:
                    same = torch.equal(kc.linear(x, w, config=cfg), ref)
                    out.append(f"BM{cfg.BM}/BN{cfg.BN}/w{cfg.num_warps}/s{cfg.num_stages} "
                               f"{timed([lambda w=c, x=x, cfg=cfg: kc.linear(x, w, config=cfg) for c in copies])}"
                               f"{'' if same else ' DIFF'}")
            for name, mod in others.items():
                ws = [mod.CudaWeight(c.kind, module_values(mod, c.kind, c.values), c.scale, c.scale_rows)
                      for c in copies]
                same = torch.equal(mod.linear(x, ws[0]), ref)
                out.append(f"{name} {timed([lambda w=c, x=x, mod=mod: mod.linear(x, w) for c in ws])}"
                           f"{'' if same else ' DIFF'}")
            print(f"{label:<24} M={m:<5} " + " | ".join(out), flush=True)
        del copies, w
        torch.cuda.empty_cache()
    for label, n, k, per_row in (("expert w1/w3 slots", 2304, 5120, 12), ("expert w2 slots", 5120, 2304, 1)):
        banks = [kc.expert_bank([random_cuda_weight("fp4", n, k) for _ in range(96 if per_row > 1 else 48)])
                 for _ in range(3)]
        for rows in (1, 5, 8):
            ids = torch.stack([torch.randperm(48)[:6] for _ in range(rows)]).cuda()
            if per_row > 1:
                ids = torch.cat([ids, ids + 48], 1)
            x = act(rows * ids.size(1) // per_row, k)
            ref = kc.expert_linear(x, banks[0], ids, per_row)
            out = []
            for name, spread in (("default", None), ("spread", True), ("one program", False)):
                same = torch.equal(kc.expert_linear(x, banks[0], ids, per_row, spread=spread), ref)
                fns = [lambda b=b, s=spread, x=x, ids=ids, r=per_row: kc.expert_linear(x, b, ids, r, spread=s)
                       for b in banks]
                out.append(f"{name} {timed(fns)}{'' if same else ' DIFF'}")
            for name, mod in others.items():
                bs = [mod.ExpertBank(b.kind, module_values(mod, b.kind, b.values), b.scale, b.scale_rows)
                      for b in banks]
                same = torch.equal(mod.expert_linear(x, bs[0], ids, per_row), ref)
                fns = [lambda b=b, x=x, ids=ids, r=per_row, mod=mod: mod.expert_linear(x, b, ids, r) for b in bs]
                out.append(f"{name} {timed(fns)}{'' if same else ' DIFF'}")
            print(f"{label:<24} rows={rows} " + " | ".join(out), flush=True)
        del banks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
