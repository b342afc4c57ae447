"""Images in a session's timeline: where each image's span sits and how it enters cache keys.

A span's positions all carry the image token id, so the token ids alone cannot tell two images apart.
Prefix-cache keys therefore replace each span position by an id derived from the image's content
(pixels and grid) and the offset inside the span: the same image at the same place hits, any other
image misses, and no key ends inside a span that a text-only key could match.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from dsflash.model.vision import TEXT, ImageInput


@dataclass(frozen=True)
class ImageSpan:
    start: int  # absolute position of the span's first row (IMAGE_START)
    image: ImageInput

    @property
    def length(self) -> int:
        return self.image.types.numel()

    @property
    def digest(self) -> int:
        """A 62-bit content id: the image's pixels and grid."""
        h = hashlib.sha256(self.image.pixels.contiguous().view(torch.int16).numpy().tobytes())
        h.update(repr((self.image.n_vit_h, self.image.n_vit_w)).encode())
        return int.from_bytes(h.digest()[:8], "little") >> 2


def token_types(n: int, spans: list[ImageSpan], first: int) -> torch.Tensor | None:
    """int64 types of positions first .. first+n-1 (None when all text); spans must not overlap."""
    types = torch.full((n,), TEXT, dtype=torch.int64)
    for s in spans:
        lo, hi = s.start - first, s.start - first + s.length
        if lo < 0 or hi > n:
            raise ValueError(f"image span [{s.start}, {s.start + s.length}) is not inside positions "
                             f"[{first}, {first + n})")
        if bool((types[lo:hi] != TEXT).any()):
            raise ValueError(f"image spans overlap at position {s.start}")
        types[lo:hi] = s.image.types
    return types if spans else None


SpanKey = tuple[int, int, int]  # (start, length, content digest): what a cache key needs of a span


def span_keys(spans: list[ImageSpan]) -> list[SpanKey]:
    return [(s.start, s.length, s.digest) for s in spans]


def cache_key(tokens: list[int], spans: list[SpanKey]) -> list[int]:
    """The token ids with every span position replaced by a negative content-derived id."""
    key = list(tokens)
    for start, length, digest in spans:
        for k in range(length):
            if start + k < len(key):
                key[start + k] = -1 - ((digest * 1_000_003 + k) % (1 << 62))
    return key
