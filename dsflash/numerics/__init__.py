"""Numerics shared by every backend. Each backend has its own numerics version (`numerics_version`), which keys
every cache, snapshot and link handshake of what that backend computed: bump the backend's version whenever
any of its arithmetic changes (a rounding point, a summation order, an index layout)."""

import math

import torch

# the CPU reference's version (6: the CPU backend pins MKL's code path (AVX2 kernels, STRICT), docs/numerics.md)
NUMERICS_VERSION = 6
# the CUDA backend's (6.cuda1: FP8/FP4 GEMMs as one fp32 tensor-core chain per shape-fixed K range over exactly
# dequantised bf16 operands, issue 22; docs/numerics.md)
CUDA_NUMERICS_VERSION = "6.cuda1"
# The model's quantisation block, along every linear input: one E8M0 scale per BLOCK values of a row (FP4
# weights, the Engram table, index keys and queries) or per BLOCK x BLOCK tile (dense FP8 weights), and one
# power-of-two scale per BLOCK values of an FP8 activation (and of the window KV's fake quantisation)
BLOCK = 32


def numerics_version(device: torch.device | str) -> str:
    """The numerics version of the backend computing on `device` ("cpu", "cuda:0", a torch.device): the CPU
    reference's or the CUDA backend's, as a string either way so that versions compare as one type. A state
    computed on one backend is refused by the other (their sums differ in order, so their bits do)."""
    try:
        kind = torch.device(device).type
    except RuntimeError as e:  # torch's error for a string that names no device
        raise ValueError(f"no numerics version for device {device!r}: {e}") from e
    if kind == "cpu":
        return str(NUMERICS_VERSION)
    if kind == "cuda":
        return CUDA_NUMERICS_VERSION
    raise ValueError(f"no numerics version for device type {kind!r}: dsflash computes on cpu or cuda")


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
