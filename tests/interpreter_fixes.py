"""Fixes to Triton's interpreter (TRITON_INTERPRET=1) so the GEMM kernels' logic can be checked on a CPU.

The interpreter (Triton 3.6-3.9) converts fp32 -> bf16/fp8 with its own bit arithmetic, which rounds
half-up without carrying into the exponent, and its `tl.dot` runs numpy's matmul on the raw 16-bit
patterns of bf16 operands (integer garbage). Here conversions go through torch's casts (RNE, as the
GPU) and dots widen their operands to fp32 first. Both are exact stand-ins for what the GPU computes
on the values these kernels feed them (E4M3/E2M1 codes and bf16 values, whose products are exact in
fp32); a dot of 16-bit operands runs as the tensor cores' chain of k16 steps, only the order of a step's 16
terms may differ from theirs. libdevice's `exp`
(no interpreter form: it returns None) becomes numpy's float32 exp, within an ulp of the GPU's `expf`, so
kernels that use it are checked with a tolerance. The kernels' few lines of inline PTX (which the interpreter
refuses) run as numpy forms of the same instructions. Imported by the interpreter scripts of
tests/test_kernels_interpret.py before any kernel runs.
"""

import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interpreter
from triton.language.extra import libdevice

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn,
          "fp8e5": torch.float8_e5m2}
_BITS = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def _convert_float(data, input_dtype, output_dtype, rounding_mode):
    width_in, width_out = input_dtype.primitive_bitwidth, output_dtype.primitive_bitwidth
    bits = torch.from_numpy(np.ascontiguousarray(data).view(f"uint{width_in}").astype(np.int64))
    values = bits.to(_BITS[width_in]).view(_TORCH[input_dtype.name])
    return values.to(_TORCH[output_dtype.name]).view(_BITS[width_out]).numpy().view(f"uint{width_out}")


def _as_bool_mask(mask):
    if mask.data.dtype != np.bool_:
        return interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)
    return mask


_load = interpreter.InterpreterBuilder.create_masked_load
_store = interpreter.InterpreterBuilder.create_masked_store


def _masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
    return _load(self, ptrs, _as_bool_mask(mask), other, cache_policy, is_volatile)


def _masked_store(self, ptrs, value, mask, cache_policy):
    return _store(self, ptrs, value, _as_bool_mask(mask), cache_policy)


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    def widen(h):
        if h.dtype.scalar.name in ("bf16", "fp16", "fp8e4nv", "fp8e5"):
            return _convert_float(h.data, h.dtype.scalar, tl.float32, None).view(np.float32)
        return h.data

    x, y, acc = widen(a), widen(b), d.data
    if a.dtype.scalar.name == "fp32":
        return interpreter.TensorHandle(np.matmul(x, y, dtype=acc.dtype) + acc, d.dtype.scalar)
    # 16-bit operands: the tensor cores' chain of k16 MMAs, each adding its 16 terms' sum to the accumulator, so
    # a dot's bits never depend on how many k16 steps one tl.dot takes (as on the GPU)
    for k in range(0, x.shape[-1], 16):
        acc = np.matmul(x[..., k:k + 16], y[..., k:k + 16, :], dtype=acc.dtype) + acc
    return interpreter.TensorHandle(acc, d.dtype.scalar)


def _exp(x, **_):
    return tl.core.tensor(interpreter.TensorHandle(np.exp(x.handle.data.astype(np.float32)), x.handle.dtype), x.type)


def _log1p(x, **_):
    return tl.core.tensor(interpreter.TensorHandle(np.log1p(x.handle.data.astype(np.float32)), x.handle.dtype),
                          x.type)


def _bf16x2_mul(a, b):
    """PTX fma.rn.bf16x2 adding -0 on int32 registers of two bf16 halves (low half first): their product,
    torch's bf16 multiply (RNE, subnormals kept, as the GPU's)."""
    def halves(v):
        return torch.from_numpy(np.ascontiguousarray(v).astype(np.int32)).view(torch.bfloat16)

    return (halves(a) * halves(b)).view(torch.int32).numpy()


# the kernels' inline PTX, by its text, as numpy on the registers' int32 values
_ASM = {"{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }": _bf16x2_mul}


class _AsmCall:
    def __init__(self, result):
        self.result = result

    def get_result(self, i):
        assert i == 0
        return self.result


def _inline_asm(self, asm, constraints, values, types, is_pure, pack):
    data = _ASM[asm](*(v.data for v in values))
    return _AsmCall(interpreter.TensorHandle(data, values[0].dtype.scalar))


interpreter._convert_float = _convert_float
interpreter.InterpreterBuilder.create_inline_asm = _inline_asm
libdevice.exp = _exp
libdevice.log1p = _log1p
interpreter.InterpreterBuilder.create_masked_load = _masked_load
interpreter.InterpreterBuilder.create_masked_store = _masked_store
interpreter.InterpreterBuilder.create_dot = _dot
