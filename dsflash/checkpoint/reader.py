"""Lazy checkpoint access: safetensors files opened with mmap, tensors read on first use."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from dsflash.config import ModelArgs, load_config


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or does not match its config; the message says which tensor."""


class Checkpoint:
    """All `*.safetensors` files of a directory, indexed by tensor name. Tensors are returned in their
    stored dtype (FP8 E4M3, E8M0, I8 = packed FP4, BF16, F32)."""

    def __init__(self, path: str | Path, args: ModelArgs | None = None):
        self.path = Path(path)
        self.args = args or load_config(self.path)
        self._files = {}
        self._where: dict[str, str] = {}
        files = sorted(self.path.glob("*.safetensors"))
        files = [f for f in files if f.name != "golden.safetensors"]
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors weight files")
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types for truncated headers
                raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
            self._files[f.name] = h
            for k in h.keys():
                if k in self._where:
                    raise CheckpointError(f"tensor {k!r} appears in both {self._where[k]} and {f.name}")
                self._where[k] = f.name

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        try:
            fname = self._where[name]
        except KeyError as e:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}") from e
        try:
            return self._files[fname].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.path / fname}: tensor {name!r} unreadable ({e})") from e

    def dtype_shape(self, name: str) -> tuple[str, list[int]]:
        sl = self._files[self._where[name]].get_slice(name)
        return sl.get_dtype(), list(sl.get_shape())
