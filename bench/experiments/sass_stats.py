"""Experiment (no GPU needed): compile the block-scaled GEMM kernel for sm_90 with the installed Triton and
report, per variant, the registers per thread (`cuobjdump -res-usage`), the SASS instruction count and
the instruction mix that decides decode speed (conversions, MMAs, async copies). Runs on any machine with
the Triton wheel (it ships ptxas and cuobjdump); used between GPU runs to see what a kernel change does to
the compiled code before timing it.

    python bench/experiments/sass_stats.py [variant] [--ops]
    (variant: a copy of the kernel package folder, or a single-module kernel of the trees before the package,
    to compile instead; --ops: also each variant's 12 most frequent opcodes)
"""

import collections
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsflash.kernels.cuda import configs, gemm
from dsflash.numerics import BLOCK

NOT_DIVISIBLE = {"M", "N", "KB", "chunks_per_split", "slots_per_row", "stride_xs", "stride_pk"}
# (label, FP4, SPREAD, SLOTS, RANGES, ACT (what the activation operand holds: gemm.block_scaled_gemm), config)
VARIANTS = [
    ("fp8 decode, K ranges spread", False, True, False, False, "quantise", configs.linear_config("fp8", 1280, 5120, 1)),
    ("fp4 decode slots, spread", True, True, True, False, "bf16", configs.linear_config("fp4", 2304, 5120, 1)),
    ("fp8 prefill, one range", False, False, False, False, "codes", configs.linear_config("fp8", 32768, 1280)),
    ("fp8 prefill, several ranges", False, False, False, True, "codes", configs.linear_config("fp8", 5120, 8192)),
    ("fp4 prefill, several ranges", True, False, False, True, "codes", configs.linear_config("fp4", 2304, 5120)),
]


@functools.cache
def gemm_module():
    """This tree's gemm module, or a variant's: a package folder (its modules import each other relatively:
    the copy's own load, under its name) or an older single-module kernel file."""
    paths = [Path(a) for a in sys.argv[1:] if not a.startswith("--")]
    if not paths:
        return gemm
    p = paths[0]
    if p.is_dir():
        spec = importlib.util.spec_from_file_location("variant_cuda", p / "__init__.py",
                                                      submodule_search_locations=[str(p)])
    else:
        spec = importlib.util.spec_from_file_location("variant_cuda", p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["variant_cuda"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return getattr(mod, "gemm", mod)


def compile_variant(fp4: bool, spread: bool, slots: bool, ranges: bool, act: str, cfg: configs.LinearConfig):
    fn = gemm_module()._bs_gemm_kernel
    names = fn.arg_names
    sig = {name: "i32" for name in names}
    codes = act == "codes"
    sig.update({"x_ptr": "*fp8e4nv" if codes else "*bf16", "xs_ptr": "*i32" if codes else "*bf16", "tile_ptr": "*i32",
                "w_ptr": "*u8" if fp4 else "*fp8e4nv", "ws_ptr": "*i32", "y_ptr": "*bf16", "part_ptr": "*fp32",
                "slot_ptr": "*i32", "stride_we": "i64", "stride_wse": "i64"})
    sig.update({name: "*i32" for name in ("cnt_ptr",) if name in names})  # a variant's tile counters
    constexprs = {"FP4": fp4, "ACT": act, "SCALE_ROWS": 1 if fp4 else BLOCK, "SCALE_E8M0": True,
                  "SPREAD": spread, "SLOTS": slots, "GROUPED": False, "BM": cfg.BM, "BN": cfg.BN,
                  "BK": cfg.BK, "GROUP_M": cfg.GROUP_M,
                  "RANGES": ranges, "EVEN": True, "SWAP": cfg.swap}
    constexprs = {k: v for k, v in constexprs.items() if k in names}  # an older variant may lack a flag
    sig.update({name: "constexpr" for name in constexprs})
    # what the JIT assumes at run time for 16-aligned pointers and strides
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name, t in sig.items()
             if t != "constexpr" and name not in NOT_DIVISIBLE}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def sass_stats(kernel) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    opcodes = collections.Counter(m.group(1) for line in lines
                                  if (m := re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)))
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)), "instructions": len(lines),
            **{op: sum(op in line for line in lines) for op in ("HMMA", "HGMMA", "F2F", "LDGSTS", "BAR")},
            "opcodes": opcodes}


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90")
    for label, fp4, spread, slots, ranges, act, cfg in VARIANTS:
        stats = sass_stats(compile_variant(fp4, spread, slots, ranges, act, cfg))
        opcodes = stats.pop("opcodes")
        print(f"{label:<30} BM{cfg.BM}/BN{cfg.BN}/w{cfg.num_warps}/s{cfg.num_stages}  "
              + "  ".join(f"{k} {v}" for k, v in stats.items()), flush=True)
        if "--ops" in sys.argv:
            print("    " + "  ".join(f"{op} {n}" for op, n in opcodes.most_common(12)))


if __name__ == "__main__":
    main()
