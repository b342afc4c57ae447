"""The model's training mode: the inference forward (dsflash/model, unchanged) over a kernel record whose
ops autograd can differentiate, with straight-through estimators where the forward quantises.

What the reference ops (kernels/cpu.py) give autograd, and what this backend changes:
- FP8/FP4 GEMMs: the reference sums 32-wide K blocks of integer codes in a fixed order, which autograd could
  follow but at the memory of one [K/32, rows, out] partial per call. Here a GEMM is one bf16 matmul of the
  fake-quantised activation and weight (both exact in bf16: E4M3/E2M1 values times powers of two), the
  reference's products summed in the matmul's order; the quantisers' rounding passes the gradient straight
  through (`ste`).
- The weights: fp32 master tensors (`Masters`) behind the checkpoint's names. A linear's FP8 tiles or FP4
  rows and an Engram table's FP8 rows are re-quantised from the master at every use, as the export writes
  them (numerics/codecs.py), so the forward sees the bits the saved checkpoint will hold.
- The packed FP4 caches (compressed KV, index keys): the state holds their fake-quantised values instead of
  packed bytes (`TrainState`), so the gradient reaches the compressors through the entries.
- Sparse attention is the reference's: autograd follows its online softmax, and a softmax of our own (the
  same function, other roundings) moved the logits far more than its rounding (a small model amplifies it).
- The indexer's scores, top-k and candidate blocks choose indices only: computed without autograd.
Everything else (norms, mHC, RoPE in place, the router, SwiGLU, the compressor's pooling, the state's ring
writes) is the reference's own torch code, which autograd follows.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from dsflash.checkpoint.reader import Checkpoint
from dsflash.kernels import Kernels, cpu, load_kernels
from dsflash.kernels.cpu import Weight
from dsflash.model.state import GrowingRows, SequenceState
from dsflash.numerics.codecs import (
    dequant_fp4_rows,
    dequant_fp8_blocks,
    dequant_fp8_rows,
    quantize_fp4_rows,
    quantize_fp8_blocks,
    quantize_fp8_rows,
)
from dsflash.numerics.quant import fp4_fake_quant, fp8_fake_quant

# how each stored dtype is held as a master, and quantised back (export.py writes these formats)
FP8, FP4, ENGRAM, PLAIN = "fp8", "fp4", "engram", "plain"


def ste(x: torch.Tensor, quantised: torch.Tensor) -> torch.Tensor:
    """`quantised`'s values exactly with x's gradient (the straight-through estimator). Not x + (q - x): in
    bf16 that sum rounds twice and misses q."""
    return quantised.detach() + (x - x.detach())


def quantised(kind: str, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, E8M0 scale codes) of a master in its stored format."""
    with torch.no_grad():
        if kind == FP8:
            return quantize_fp8_blocks(master)
        if kind == FP4:
            return quantize_fp4_rows(master)
        return quantize_fp8_rows(master)


def dequantised(kind: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if kind == FP8:
        return dequant_fp8_blocks(codes, scale)
    if kind == FP4:
        return dequant_fp4_rows(codes, scale)
    return dequant_fp8_rows(codes, scale)


def fake_quant(kind: str, master: torch.Tensor) -> torch.Tensor:
    """The master's values as its stored format holds them, with the master's gradient."""
    with torch.no_grad():
        values = dequantised(kind, *quantised(kind, master))
    return ste(master, values)


class Masters:
    """The trainable tensors by checkpoint name, in fp32, and a checkpoint-like face (`get`, `has`, `names`,
    `args`) the model's WeightLoader reads.

    `get` of a plain (BF16/F32) tensor is the master cast to the stored dtype: a fresh autograd node, so a
    model built for a step differentiates into the masters (a model is built per step; building is cheap next
    to a forward). `get` of a quantised weight or Engram table is a fixed handle tensor with the stored codes'
    dtype; the training backend's `weight` and `engram_rows` look the master up by the handle."""

    def __init__(self, ckpt: Checkpoint, device: torch.device | str):
        self.args, self.device = ckpt.args, torch.device(device)
        self.params: dict[str, torch.Tensor] = {}
        self.kinds: dict[str, str] = {}
        self.stored_dtype: dict[str, torch.dtype] = {}
        self._handles: dict[str, torch.Tensor] = {}
        self._by_handle: dict[int, str] = {}
        for name in ckpt.names():
            t = ckpt.get(name)
            if t.dtype == torch.float8_e8m0fnu:  # a scale: re-derived from its weight's master
                continue
            if t.dtype == torch.float8_e4m3fn or t.dtype in (torch.int8, torch.uint8):
                scale = ckpt.get(name[: -len("weight")] + "scale")
                kind = ENGRAM if ".engram.embed." in name else FP8 if t.dtype == torch.float8_e4m3fn else FP4
                value = dequantised(kind, t, scale)
                self._handles[name] = t.to(self.device)
                self._handles[name[: -len("weight")] + "scale"] = scale.to(self.device)
                self._by_handle[id(self._handles[name])] = name
            else:
                kind, value = PLAIN, t.float()
            self.kinds[name], self.stored_dtype[name] = kind, t.dtype
            self.params[name] = value.to(self.device).requires_grad_(not name.endswith(".gate.bias"))

    def names(self) -> list[str]:
        return sorted([*self.params, *(n for n in self._handles if n not in self.params)])

    def has(self, name: str) -> bool:
        return name in self.params or name in self._handles

    def get(self, name: str) -> torch.Tensor:
        if name in self._handles:
            return self._handles[name]
        return self.params[name].to(self.stored_dtype[name])

    def master_of(self, handle: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(name, master) of a quantised tensor's handle (what `get` gave the model)."""
        name = self._by_handle.get(id(handle))
        if name is None:
            raise KeyError("not a handle of these masters: the model was built from another checkpoint")
        return self.kinds[name], self.params[name]

    def trainable(self, prefix: str = "") -> list[torch.Tensor]:
        return [p for n, p in self.params.items() if p.requires_grad and n.startswith(prefix)]


class TrainWeight(Weight):
    """A quantised linear's master; `values` re-quantises it (FP8 tiles or FP4 rows), straight through."""

    def __init__(self, kind: str, master: torch.Tensor):
        self.kind, self.master = kind, master

    @property
    def values(self) -> torch.Tensor:
        return fake_quant(self.kind, self.master)

    @property
    def scale(self) -> None:
        return None

    @property
    def out_features(self) -> int:
        return self.master.size(0)

    @property
    def in_features(self) -> int:
        return self.master.size(1)


class _LazyRows(GrowingRows):
    """GrowingRows whose row shape and dtype are the first rows written (the cache values of TrainState)."""

    def __init__(self, device: torch.device):
        self._buf, self.n, self._device = None, 0, device

    def reserve(self, n: int) -> None:
        if self._buf is not None:
            super().reserve(n)

    def put(self, first: torch.Tensor, rows: torch.Tensor, end: int) -> None:
        if self._buf is None:
            self._buf = rows.new_zeros(0, *rows.shape[1:])
        super().put(first, rows, end)


class TrainState(SequenceState):
    """A sequence's state in training: the compressed KV and index keys as their fake-quantised bf16 values
    (what the reference's packing reads back), so autograd follows the entries."""

    def rows(self, table: dict, key: int, shape: tuple[int, ...], dtype: torch.dtype) -> GrowingRows:
        r = table.get(key)
        if r is None:
            r = table[key] = _LazyRows(self.device)
        return r


def training_kernels(masters: Masters) -> Kernels:
    """The reference record with the training ops above, on the masters' device."""
    base = load_kernels(masters.device, reference=True)

    def weight(kind: str, stored: torch.Tensor, scale: torch.Tensor | None) -> Weight:
        if kind in (FP8, FP4):
            return TrainWeight(*masters.master_of(stored))
        return Weight(kind, stored.to(torch.float32 if kind == "fp32" else torch.bfloat16))

    def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
        if w.kind in (FP8, FP4):
            xq = ste(x, fp8_fake_quant(x.detach()))
            return F.linear(xq, w.values.to(torch.bfloat16))
        return F.linear(x.to(w.values.dtype), w.values)

    def engram_rows(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        kind, master = masters.master_of(table)
        return fake_quant(kind, master[ids.flatten()]).view(*ids.shape, -1).to(torch.bfloat16)

    def fp4_values(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
        return ste(x, fp4_fake_quant(x.detach(), block, e4m3_scale))

    return dataclasses.replace(
        base, name="training", row_tile=1, slot_moe_rows=0, weight=weight, linear=linear,
        engram_rows=engram_rows,
        fp8_fake_quant=lambda x: ste(x, fp8_fake_quant(x.detach())), fp4_fake_quant=fp4_values,
        fp4_quant_packed=fp4_values, fp4_dequant_packed=lambda values, d, block, e4m3: values,
        index_scores=torch.no_grad()(cpu.index_scores))
