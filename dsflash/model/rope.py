"""Rotary position embedding (spec §3): interleaved pairs on the last `rope_head_dim` channels.

Two variants per model: "main" (rope_theta, no YaRN) for ratio-0 layers and DSpark stages, and
"compress" (compress_rope_theta with YaRN) for every rotation in a ratio>0 layer. The complex
factors are computed in blocks of 64 positions, so a position's factor never depends on how many
positions were asked for (no scalar tails in the vectorised cos/sin).
"""

from __future__ import annotations

import math

import torch

from dsflash.config import ModelArgs
from dsflash.kernels import Kernels

_POSITION_BLOCK = 64


class Rope:
    def __init__(self, args: ModelArgs, compressed: bool, kernels: Kernels):
        dim = args.rope_head_dim
        base = args.compress_rope_theta if compressed else args.rope_theta
        original = args.original_seq_len if compressed else 0
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if original > 0:
            def corrected_dim(rotations: float) -> float:
                return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(corrected_dim(args.beta_fast)), 0)
            high = min(math.ceil(corrected_dim(args.beta_slow)), dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
            smooth = 1 - ramp
            freqs = freqs / args.rope_factor * (1 - smooth) + freqs * smooth
        self.freqs = freqs
        self.dim, self.compressed = dim, compressed
        self._tables: dict[torch.device, torch.Tensor] = {}
        self.rebuilds = 0  # CUDA graphs read the table by address: a rebuild retires them
        self.k = kernels

    def _block(self, b: int) -> torch.Tensor:
        pos = torch.arange(b * _POSITION_BLOCK, (b + 1) * _POSITION_BLOCK)
        angles = torch.outer(pos, self.freqs)
        return torch.polar(torch.ones_like(angles), angles)

    def reserve(self, end: int, device: torch.device) -> None:
        """Make the table on `device` cover positions < end. The table is computed on the CPU for every
        backend (so all rotate by the same factors) and grows by doubling. Entry points reserve once per
        forward, so rotations never read a position back from the device to check it."""
        table = self._tables.get(device)
        if table is None or table.size(0) < end:
            have = 0 if table is None else table.size(0) // _POSITION_BLOCK
            blocks = max(-(-end // _POSITION_BLOCK), 2 * have)
            self._tables[device] = torch.cat([self._block(b) for b in range(blocks)]).to(device)
            self.rebuilds += 1

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last `dim` channels of x ([N, dim_total] or [N, H, dim_total]) in place."""
        return self.k.rope_rotate(x, self._tables[positions.device], positions, self.dim, inverse)
