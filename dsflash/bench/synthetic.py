"""A checkpoint made directly in device memory for benchmarks: every tensor the config's official
layout has (checkpoint/expect.py), drawn on first use in its stored dtype from a generator seeded by
(seed, name): every process draws the same tensor for a name in whatever order it asks (the ranks of a
parallel bench load their shards from their own copy). Timing depends on shapes, dtypes and routing
spread, not on trained values; nothing here is meant to produce sensible text."""

from __future__ import annotations

import dataclasses
import zlib

import torch

from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.reader import CheckpointError
from dsflash.config import ModelArgs, preset

_TORCH = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
          "BF16": torch.bfloat16, "F32": torch.float32}


class SyntheticCheckpoint:
    """The Checkpoint interface (get/has/names/dtype_shape) over random tensors on `device`."""

    def __init__(self, args: ModelArgs, device: str | torch.device, seed: int = 0):
        self.args, self.device = args, torch.device(device)
        self.expected = expected_tensors(args)
        self.seed = seed

    def names(self) -> list[str]:
        return sorted(self.expected)

    def has(self, name: str) -> bool:
        return name in self.expected

    def dtype_shape(self, name: str) -> tuple[str, list[int]]:
        dtype, shape = self.expected[name]
        return dtype, list(shape)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.expected:
            raise CheckpointError(f"synthetic checkpoint: no tensor {name!r}")
        dtype, shape = self.expected[name]
        dev = self.device
        g = torch.Generator(device=dev).manual_seed((self.seed << 32) | zlib.crc32(name.encode()))
        if dtype == "F8_E8M0":
            # scales near 2^-6 keep FP4/FP8 products in a realistic range
            return torch.randint(119, 123, shape, generator=g, device=dev, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        if dtype == "I8":
            return torch.randint(0, 256, shape, generator=g, device=dev, dtype=torch.uint8).view(torch.int8)
        x = torch.randn(shape, generator=g, device=dev)
        if dtype == "F8_E4M3":
            # code values times the ~2^-6 scales give fan-in-scaled weights
            return (x * 64 * shape[-1] ** -0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
        if len(shape) == 1:  # norms, biases, sinks
            x = 1 + 0.1 * x if name.endswith("norm.weight") else 0.5 * x
        else:
            x = x * shape[-1] ** -0.5
        return x.to(_TORCH[dtype])


def synthetic_spec(name: str, experts: int) -> str:
    """The `dsflash follow --synthetic` spelling of a bench's preset (the bench preset with its expert count)."""
    return f"{name}:{experts}" if name == "bench" else name


def synthetic_args(spec: str) -> ModelArgs:
    """The config of a synthetic_spec: the preset, with its routed experts for `bench:N`, and the bench's
    unbounded context."""
    name, _, experts = spec.partition(":")
    args = preset(name, int(experts)) if experts else preset(name)
    return dataclasses.replace(args, max_seq_len=1 << 21)
