"""Prometheus metrics of the server: request and error counters, token counters, latency histograms and
the queue gauges."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.finished: dict[str, int] = {}  # generations by how they ended: stop, length, cancelled
        self.prompt_tokens = self.prefill_tokens = self.generated_tokens = self.cached_tokens = 0
        self.drafted = self.accepted = 0
        self.box_reconnects: Callable[[], int] | None = None  # read from the box link, when split
        self.tier_stats: Callable[[], dict[str, dict]] | None = None  # Engine.tier_stats: off-device weights
        self.ttft = Histogram((0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram((0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.queued = 0
        self.running = 0

    def inc(self, table: dict[str, int], key: str) -> None:
        with self.lock:
            table[key] = table.get(key, 0) + 1

    def render(self) -> str:
        with self.lock:
            lines = []

            def counter(name: str, help_: str, values: dict[str, int] | int, label: str = "") -> None:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} counter")
                if isinstance(values, dict):
                    for k, v in sorted(values.items()):
                        lines.append(f'{name}{{{label}="{k}"}} {v}')
                else:
                    lines.append(f"{name} {values}")

            def hist(name: str, help_: str, h: Histogram) -> None:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} histogram")
                for b, c in zip(h.buckets, h.counts, strict=True):
                    lines.append(f'{name}_bucket{{le="{b}"}} {c}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
                lines.append(f"{name}_sum {h.sum}")
                lines.append(f"{name}_count {h.count}")

            counter("dsflash_requests_total", "HTTP requests by endpoint.", self.requests, "endpoint")
            counter("dsflash_errors_total", "Failed requests by kind.", self.errors, "kind")
            counter("dsflash_finished_total", "Generations by how they ended (cancelled: the client left or the "
                    "server shut down).", self.finished, "reason")
            counter("dsflash_prompt_tokens_total", "Prompt tokens of generation requests.", self.prompt_tokens)
            counter("dsflash_prefill_tokens_total", "Prompt tokens actually prefilled (not from the cache).",
                    self.prefill_tokens)
            counter("dsflash_cached_tokens_total", "Prompt tokens resumed from the prefix cache.", self.cached_tokens)
            counter("dsflash_generated_tokens_total", "Generated tokens.", self.generated_tokens)
            counter("dsflash_draft_tokens_total", "DSpark draft tokens verified.", self.drafted)
            counter("dsflash_draft_accepted_total", "DSpark draft tokens accepted.", self.accepted)
            if self.box_reconnects is not None:
                counter("dsflash_box_reconnects_total", "Reconnections to the box.", self.box_reconnects())
            for family, stats in (self.tier_stats() if self.tier_stats is not None else {}).items():
                for key, value in stats.items():  # e.g. dsflash_experts_misses_total, dsflash_experts_hit_rate
                    kind = "gauge" if key.endswith("rate") else "counter"
                    name = f"dsflash_{family}_{key}" + ("_total" if kind == "counter" else "")
                    lines += [f"# HELP {name} {family} tier: {key.replace('_', ' ')}.", f"# TYPE {name} {kind}",
                              f"{name} {value}"]
            hist("dsflash_time_to_first_token_seconds", "Request arrival to first generated token.", self.ttft)
            hist("dsflash_inter_token_latency_seconds", "Time between generated tokens.", self.itl)
            lines.append("# HELP dsflash_queue_depth Generation requests waiting for the engine.")
            lines.append("# TYPE dsflash_queue_depth gauge")
            lines.append(f"dsflash_queue_depth {self.queued}")
            lines.append("# HELP dsflash_running Generation requests running on the engine.")
            lines.append("# TYPE dsflash_running gauge")
            lines.append(f"dsflash_running {self.running}")
            return "\n".join(lines) + "\n"
