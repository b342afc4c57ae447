"""A live one-line progress bar on stderr, for the commands: weights loading layer by layer, a prefill token by
token. It appears only after `after_s` seconds (short runs print nothing) and only on a terminal or when asked."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from dsflash.config import load_config

WIDTH = 24  # characters of the bar


class ProgressBar:
    def __init__(self, label: str, unit: str, enabled: bool = True, after_s: float = 1.0, stream: TextIO | None = None):
        self.label, self.unit, self.after_s = label, unit, after_s
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.t0, self.shown = time.perf_counter(), False

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self.t0
        if not self.enabled or not (self.shown or elapsed > self.after_s):
            return
        self.shown = True
        filled = WIDTH * done // max(1, total)
        rate = f"  {done / elapsed:,.0f} {self.unit}/s" if elapsed > 0 else ""
        print(f"\r{self.label} [{'#' * filled}{' ' * (WIDTH - filled)}] {done:,}/{total:,} {self.unit}{rate}",
              end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.shown:
            print(file=self.stream, flush=True)
            self.shown = False


class LayerCount:
    """`Engine.load(progress=...)`'s callback (called once per layer loaded, by each model half) as a bar of
    `total` layers."""

    def __init__(self, total: int, enabled: bool = True, after_s: float = 1.0, stream: TextIO | None = None):
        self.bar = ProgressBar("loading weights", "layers", enabled, after_s, stream)
        self.total, self.done = total, 0

    def __call__(self, layer: int) -> None:
        self.done += 1
        self.bar(self.done, self.total)

    def close(self) -> None:
        self.bar.close()


def local_layers(model: str | Path, split: bool) -> int:
    """Layers a command loads here: the whole model, or the decoder half when a box runs the encoder half."""
    args = load_config(Path(model))
    return args.n_layers - args.first_decoder_layer if split else args.n_layers
