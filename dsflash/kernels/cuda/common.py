"""What the kernels of several op families share: the launch's FMA contraction choice and programmatic
dependent launch, the quantisation block as a Triton constant, the activation tile's FP8 quantisation and the
sigmoid."""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import E4M3_MAX

# Triton 3.6 contracts a * b + c into an FMA by default and 3.10 will not: every launch names its choice, so a
# Triton upgrade cannot change a kernel's bits (kernels that must round each product pass False)
FP_FUSION = True
TL_BLOCK = tl.constexpr(BLOCK)  # numerics.BLOCK inside the kernels (a kernel reads only constexpr globals)
_E4M3_MAX_INV = tl.constexpr(1.0 / E4M3_MAX)  # rounded to float32 in the product, as codecs.E4M3_MAX_INV


def _pdl_wanted() -> bool:
    """Programmatic dependent launch on sm_90 and later, unless `DSFLASH_PDL=0`; never under Triton's interpreter,
    which has no grid dependency control. On by default: measured on an H100, steps 3-6 % faster with the same
    bits, prefill unchanged (docs/perf-record.md)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("DSFLASH_PDL", "1") != "1":
        return False
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 9  # no GPU: compiling only


# Programmatic dependent launch: a kernel launched with `launch_pdl=PDL_LAUNCH` may start while the kernel before
# it on the stream finishes (a decode step is thousands of small kernels, each paying a launch gap in a CUDA graph
# too). Every kernel therefore begins with `grid_entry()`, which waits for the previous grid's completion and the
# visibility of its writes before touching memory, so no bit changes; every launch names the choice (tested).
PDL_LAUNCH = _pdl_wanted()
_PDL = tl.constexpr(PDL_LAUNCH)


@triton.jit
def grid_entry():
    """A kernel's first statement: with programmatic dependent launch, wait until the previous kernel on the
    stream has finished and its writes are visible, then let the next one be scheduled (its programs wait
    the same way, so they only take idle SM slots early). Nothing without it."""
    if _PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def quant_tile(xf):
    """float32 [R, BLOCK] (from bf16) -> (E4M3 codes [R, BLOCK], scale exponent bytes [R] int32, scales [R])
    exactly as quant.fp8_act_codes: s = 2^ceil(log2(max(amax, 1e-4) * f32(1/448))),
    q = e4m3_rne(clamp(x/s, ±448))."""
    amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-4)
    bits = (amax * _E4M3_MAX_INV).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1/s exactly (s is a normal power of two)
    q = tl.clamp(xf * inv[:, None], -448.0, 448.0).to(tl.float8e4nv)
    return q, e, s


@triton.jit
def sigmoid(x):
    """torch's CUDA sigmoid: 1 / (1 + expf(-x)), an IEEE division."""
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))


@triton.jit
def scale_bytes(word, first, NB: tl.constexpr):
    """E8M0 bytes first .. first + NB - 1 of int32 scale words [R] -> int32 [R, NB]."""
    j = first + tl.arange(0, NB)
    return (word[:, None] >> (8 * j[None, :])) & 0xFF


@triton.jit
def block_scales(word, first, NB: tl.constexpr):
    """E8M0 bytes first .. first + NB - 1 of int32 scale words [R] -> float32 [R, NB]: 2^(byte - 127)."""
    return (scale_bytes(word, first, NB) << 23).to(tl.float32, bitcast=True)


@triton.jit
def times_blocks(v, s, R: tl.constexpr, NB: tl.constexpr):
    """float32 v [R, NB * 32] times per-(row, 32-wide block) scales s [R, NB]."""
    return tl.reshape(tl.reshape(v, [R, NB, TL_BLOCK]) * s[:, :, None], [R, NB * TL_BLOCK])
