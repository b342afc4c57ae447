"""Where the two largest weight families live (issue 17): the Engram tables and the routed experts.

"gpu" keeps them on the compute device (for the CPU backend: in host memory), "host" in pinned host
memory read by the device, "disk" in the checkpoint's files, read on demand. Every tier gives the same
bits as "gpu"; only bytes moved and time differ.
"""

from __future__ import annotations

from dataclasses import dataclass

TIERS = ("gpu", "host", "disk")
ENGRAM_CACHE = 1 << 30  # bytes of hot Engram rows the disk tier keeps in RAM, by default


@dataclass(frozen=True)
class Tiers:
    engram: str = "gpu"
    experts: str = "gpu"
    expert_cache: int | None = None  # bytes of device expert slots for host/disk experts (None: one layer's bank)
    # bytes of hot Engram rows the disk tier keeps in RAM, shared evenly by the model's Engram tables (0: none).
    # 1 GiB holds ~4M of the released model's 264-byte rows (~87K tokens' worth at 48 rows a token)
    engram_cache: int = ENGRAM_CACHE

    def __post_init__(self) -> None:
        for name in ("engram", "experts"):
            if getattr(self, name) not in TIERS:
                raise ValueError(f"{name} tier {getattr(self, name)!r}: expected one of {', '.join(TIERS)}")
        if self.expert_cache is not None and self.expert_cache <= 0:
            raise ValueError(f"expert cache of {self.expert_cache} bytes: expected a positive size")
        if self.engram_cache < 0:
            raise ValueError(f"Engram cache of {self.engram_cache} bytes: expected a size of 0 or more")


RESIDENT = Tiers()  # the default: everything on the compute device


def sum_stats(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """Several models' `Transformer.tier_stats()` (e.g. the two halves in one process) as one: each family's
    counters added, its hit rate recomputed from the sums."""
    total: dict[str, dict] = {}
    for part in parts:
        for family, stats in part.items():
            into = total.setdefault(family, {})
            for key, value in stats.items():
                into[key] = into.get(key, 0) + value
    for stats in total.values():
        if "hits" in stats and "misses" in stats:
            stats["hit_rate"] = stats["hits"] / max(1, stats["hits"] + stats["misses"])
    return total
