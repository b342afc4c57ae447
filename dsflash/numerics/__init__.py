"""Numerics shared by every backend. `numerics_version(backend)` (NUMERICS_VERSION, and CUDA_NUMERICS for the
CUDA backend) keys every cache, snapshot and link peer: bump one whenever any arithmetic changes (a rounding
point, a summation order, an index layout)."""

import math

import torch

NUMERICS_VERSION = 6  # 6: the CPU backend pins MKL's code path (AVX2 kernels, STRICT), docs/numerics.md
# The CUDA backend's own arithmetic on top of NUMERICS_VERSION (docs/numerics.md, "Versioning"): 1 = its FP8/FP4
# GEMMs are one fp32 accumulation per K range over exactly dequantised operands, not the reference's per-block
# sums. Bump it when only the CUDA arithmetic changes; a change both backends share bumps NUMERICS_VERSION
CUDA_NUMERICS = 1
# The model's quantisation block, along every linear input: one E8M0 scale per BLOCK values of a row (FP4
# weights, the Engram table, index keys and queries) or per BLOCK x BLOCK tile (dense FP8 weights), and one
# power-of-two scale per BLOCK values of an FP8 activation (and of the window KV's fake quantisation)
BLOCK = 32


def numerics_version(backend: str) -> str:
    """The version results of a backend (Kernels.name) are keyed by: NUMERICS_VERSION for the reference
    backend, with CUDA_NUMERICS for the CUDA one, whose FP8/FP4 GEMMs sum in another order."""
    if backend == "reference":
        return str(NUMERICS_VERSION)
    if backend == "cuda":
        return f"{NUMERICS_VERSION}.cuda{CUDA_NUMERICS}"
    raise ValueError(f"unknown kernel backend {backend!r}: 'reference' or 'cuda'")


def exact_div(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d rounded once, as IEEE division, on every device (x float32). torch's CUDA division by a Python
    number multiplies by the number's float32 reciprocal (ATen's BinaryDivTrueKernel.cu), a second rounding
    the CPU's division does not make; a tensor divisor keeps the division. A power of two has an exact
    reciprocal, so there the plain division is already exact (and needs no divisor tensor); d = 1 returns x
    itself (the same values, one kernel less in every router call at the released temperature)."""
    assert x.dtype == torch.float32, x.dtype
    if d == 1:
        return x
    if abs(math.frexp(d)[0]) == 0.5:
        return x / d
    return x / torch.full((), d, dtype=torch.float32, device=x.device)
