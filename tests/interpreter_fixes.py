"""Fixes to Triton's interpreter (TRITON_INTERPRET=1) so the GEMM kernels' logic can be checked on a CPU.

The interpreter (Triton 3.6-3.9) converts fp32 -> bf16/fp8 with its own bit arithmetic, which rounds
half-up without carrying into the exponent, and its `tl.dot` and bf16 multiplies run numpy on the raw
16-bit patterns of bf16 operands (integer garbage). Here conversions go through torch's casts (RNE, as the
GPU), dots widen their operands to fp32 first, and a 16-bit float product is the fp32 product (exact for
two 16-bit floats) rounded by torch's cast, as the GPU's correctly rounded multiply. These are exact
stand-ins for what the GPU computes on the values these kernels feed them (E4M3/E2M1 codes and bf16
values, whose products are exact in fp32); only the order of a block's 32-term sum may differ from the
tensor cores'. libdevice's `exp`
(no interpreter form: it returns None) becomes numpy's float32 exp, within an ulp of the GPU's `expf`, so
kernels that use it are checked with a tolerance. Imported by the interpreter scripts of
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
_fmul_shipped = interpreter.InterpreterBuilder.create_fmul


def _masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
    return _load(self, ptrs, _as_bool_mask(mask), other, cache_policy, is_volatile)


def _masked_store(self, ptrs, value, mask, cache_policy):
    return _store(self, ptrs, value, _as_bool_mask(mask), cache_policy)


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    def widen(h):
        if h.dtype.scalar.name in ("bf16", "fp16", "fp8e4nv", "fp8e5"):
            return _convert_float(h.data, h.dtype.scalar, tl.float32, None).view(np.float32)
        return h.data

    return interpreter.TensorHandle(np.matmul(widen(a), widen(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)


def _fmul(self, lhs, rhs):
    dtype = lhs.dtype.scalar
    if dtype.name not in ("bf16", "fp16"):
        return _fmul_shipped(self, lhs, rhs)
    a, b = (_convert_float(h.data, dtype, tl.float32, None).view(np.float32) for h in (lhs, rhs))
    return interpreter.TensorHandle(_convert_float(a * b, tl.float32, dtype, None), dtype)


def _exp(x, **_):
    return tl.core.tensor(interpreter.TensorHandle(np.exp(x.handle.data.astype(np.float32)), x.handle.dtype), x.type)


def _log1p(x, **_):
    return tl.core.tensor(interpreter.TensorHandle(np.log1p(x.handle.data.astype(np.float32)), x.handle.dtype),
                          x.type)


interpreter._convert_float = _convert_float
libdevice.exp = _exp
libdevice.log1p = _log1p
interpreter.InterpreterBuilder.create_masked_load = _masked_load
interpreter.InterpreterBuilder.create_masked_store = _masked_store
interpreter.InterpreterBuilder.create_dot = _dot
interpreter.InterpreterBuilder.create_fmul = _fmul
