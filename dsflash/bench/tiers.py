"""`dsflash bench tiers`: routed experts resident ("gpu") vs in pinned host memory ("host") vs read from the
checkpoint's files ("disk"), through the device expert cache (model/expert_cache.py); and the Engram tables
in pinned host memory ("engram-host") or read from the files ("engram-disk"), experts resident.

The checkpoint is written to disk first (real safetensors files, one per layer, so the disk tier reads a
real file): the tensors of an encoder slice of the first `--layers` layers of the preset (with all
`--experts` routed experts per layer: 384, the released count, exceeds the cache it is given) plus the
next KV source layer's cache writer. Then, per tier, the slice's prefill at each length (in 8,192-row
chunks, as a session prefills) and its steps of L rows after a `--context`-token prefill (each rolled
back): tok/s, ms, the cache's hit rate, bytes read per token and stall seconds. The prefill's final
streams are compared with the resident tier's, bit for bit. Results go to bench/results/tiers-*.json and
.md with the machine, commit and command.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.reader import DTYPE_SIZES, Checkpoint
from dsflash.config import ModelArgs, preset
from dsflash.engine.runner import Runner
from dsflash.model.state import SequenceState
from dsflash.model.tiers import TIERS, Tiers
from dsflash.model.transformer import Transformer

from .common import command, commit, machine, prompt, sync, timed_rounds
from .synthetic import SyntheticCheckpoint

CHUNK = 8192  # prefill chunk rows (engine/session.py DEFAULT_CHUNK)
WARMUP_TOKENS = 512  # an untimed, uncounted first prefill per tier (see run)


def slice_names(args: ModelArgs, layers: int) -> list[str]:
    """The tensors an encoder slice [0, layers) reads: the embedding, its layers, and the cache writer of
    the next layer when that layer is a KV source (Transformer.next_source)."""
    own = tuple(f"layers.{i}." for i in range(layers))
    writer = (f"layers.{layers}.attn.", f"layers.{layers}.attn_norm.") if layers in args.kv_source_layers else ()
    return [n for n in expected_tensors(args) if n == "embed.weight" or n.startswith(own) or n.startswith(writer)]


def write_checkpoint(args: ModelArgs, layers: int, out: Path, device: str) -> int:
    """The slice's tensors, drawn on `device` (SyntheticCheckpoint), as one safetensors file per layer (plus
    one for the rest) in `out`, flushed and dropped from the page cache; kept when a previous run wrote the
    same (a stamp names the preset). Returns the routed experts' bytes."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = out / "bench-tiers.json"
    want = {"config": args.to_dict(), "layers": layers}
    names = slice_names(args, layers)
    synthetic = SyntheticCheckpoint(args, device)
    expected = expected_tensors(args)
    experts = sum(math.prod(expected[n][1]) * DTYPE_SIZES[expected[n][0]] for n in names if ".ffn.experts." in n)
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return experts
    stamp.unlink(missing_ok=True)
    for old in out.glob("bench-*.safetensors"):  # another slice's files would hold some tensors twice
        old.unlink()
    groups: dict[str, list[str]] = {}
    for n in names:
        layer = n.split(".")[1] if n.startswith("layers.") and int(n.split(".")[1]) < layers else "rest"
        groups.setdefault(layer, []).append(n)
    for group, members in groups.items():
        path = out / f"bench-{group}.safetensors"
        save_file({n: synthetic.get(n).cpu() for n in members}, str(path))
        fd = os.open(path, os.O_RDONLY)
        try:  # on disk, out of the page cache: the disk tier's first reads go to the drive
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    (out / "config.json").write_text(json.dumps(args.to_dict(), indent=2) + "\n")
    stamp.write_text(json.dumps(want))
    return experts


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


ENGRAM_PREFIX = "engram-"


def tiers_of(label: str, cache: int | None, engram_cache: int | None) -> Tiers:
    """A --tiers entry: an expert tier (gpu, host, disk), or engram-host / engram-disk (experts resident)."""
    if label.startswith(ENGRAM_PREFIX):
        extra = {} if engram_cache is None else {"engram_cache": engram_cache}
        return Tiers(engram=label[len(ENGRAM_PREFIX):], **extra)
    return Tiers(experts=label, expert_cache=cache)


class _Counters:
    """The off-device tier's counters between two moments (none for resident weights): the expert cache's, or
    the Engram tables' (their row cache's hits, rows and bytes read, read seconds as the stall)."""

    def __init__(self, model: Transformer):
        self.model = model
        self.start = self._now()

    def _now(self) -> dict:
        stats = self.model.tier_stats()
        if "engram" in stats:
            e = stats["engram"]
            return {"hits": e["cache_hits"], "misses": e["rows_read"], "evictions": 0, "bytes_read": e["bytes_read"],
                    "stall_s": e["read_s"]}
        return stats.get("experts", {})

    def delta(self, tokens: int) -> dict:
        now = self._now()
        if not now:
            return {}
        d = {k: now[k] - self.start[k] for k in ("hits", "misses", "evictions", "bytes_read", "stall_s")}
        self.start = now
        return {"hit_rate": d["hits"] / max(1, d["hits"] + d["misses"]), "bytes_per_token": d["bytes_read"] / tokens,
                "stall_s": d["stall_s"], "misses": d["misses"], "evictions": d["evictions"]}


def _steps(runner: Runner, state: SequenceState, ids: torch.Tensor, context: int, rows: list[int], reps: int,
           counters: _Counters, res: dict, saved: Callable[[dict], None]) -> None:
    """Steps of each row count after `context` tokens, each rolled back: ms and the cache's counters, into
    res["steps"]."""
    a, dev = runner.args, runner.device
    ratios = {s: a.compress_ratios[s] for s in state.compressed}
    for n in rows:
        new = ids[context:context + n]

        def step(new: torch.Tensor = new) -> None:
            runner.forward(state, new)
            state.truncate(context, ratios)

        for _ in range(2):  # untimed and not counted: the first call compiles, the second captures a graph
            step()
        counters.delta(1)
        ms = timed_rounds({0: step}, dev, reps, warmup=0)[0]
        res["steps"][n] = {"ms": ms, "tok_s": n * 1000 / ms, **counters.delta(n * reps)}
        saved(res)


def bench_tier(args: ModelArgs, ckpt_dir: Path, layers: int, tier: str, cache: int | None,
               engram_cache: int | None, device: str,
               lengths: list[int], context: int, rows: list[int], reps: int, eager: bool, warmup: int,
               saved: Callable[[dict], None]) -> dict:
    """One tier's load, prefills and steps (see the module docstring), after an untimed prefill of `warmup`
    tokens; `saved(results so far)` after each measurement (a run cut short keeps what it measured)."""
    dev = torch.device(device)
    token_map = [i % args.engram_compressed_vocab_size for i in range(args.vocab_size)]
    t0 = time.perf_counter()
    model = Transformer(args, Checkpoint(ckpt_dir, args), token_map, range(0, layers), device=device,
                        tiers=tiers_of(tier, cache, engram_cache))
    runner = Runner(model, cuda_graphs=not eager)
    sync(dev)
    res: dict = {"load_s": time.perf_counter() - t0, "prefill": {}, "steps": {}}
    if model.expert_stores:
        (store,) = model.expert_stores  # one layer range: one store
        res["cache"] = {"slots": store.slots, "bytes": store.slots * store.slot_bytes}
    ids = torch.tensor(prompt(max(lengths + [context]) + max(rows), args.vocab_size), device=dev)
    runner.forward(SequenceState(device=dev), ids[:warmup])
    counters = _Counters(model)
    for n in sorted(set(lengths + [context])):
        state = SequenceState(device=dev)
        sync(dev)
        t0 = time.perf_counter()
        for i in range(0, n, CHUNK):
            out = runner.forward(state, ids[i:min(n, i + CHUNK)])
        sync(dev)
        ms = (time.perf_counter() - t0) * 1000
        entry = {"ms": ms, "tok_s": n * 1000 / ms, "streams": _digest(out.streams), **counters.delta(n)}
        if n in lengths:
            res["prefill"][n] = entry
            saved(res)
        if n == context:  # the steps right after their context (before longer prefills: cheaper ones first)
            _steps(runner, state, ids, context, rows, reps, counters, res, saved)
    for store in model.expert_stores:
        store.close()
    return res


def to_markdown(r: dict) -> str:
    c = r["checkpoint"]
    lines = [f"# Expert tiers {r['date']}", "", f"Machine: {r['machine']}; commit {r['commit']}; torch {r['torch']}",
             f"Command: `{r['command']}`",
             f"Checkpoint on disk: preset {c['preset']}, {c['experts']} routed experts x {c['layers']} layers "
             f"(encoder slice), {c['expert_bytes'] / 2**30:.2f} GiB of routed experts, written in {c['write_s']:.0f} s",
             "", "| tier | cache slots (GiB) | load s | what | tok/s | ms | hit rate | bytes/token | stall s | "
             "same bits |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = r["tiers"].get("gpu", {}).get("prefill", {})
    for tier, t in r["tiers"].items():
        cache = t.get("cache")
        where = f"{cache['slots']} ({cache['bytes'] / 2**30:.2f})" if cache else "resident"
        for kind, label in (("prefill", "prefill {}"), ("steps", "step L={}")):
            for n, e in t[kind].items():
                same = "-" if kind == "steps" or n not in base else ("yes" if e["streams"] == base[n]["streams"]
                                                                     else "NO")
                lines.append(f"| {tier} | {where} | {t['load_s']:.1f} | {label.format(n)} | {e['tok_s']:,.1f} | "
                             f"{e['ms']:,.1f} | {e.get('hit_rate', 1.0):.2f} | {e.get('bytes_per_token', 0):,.0f} | "
                             f"{e.get('stall_s', 0):.2f} | {same} |")
    return "\n".join(lines) + "\n"


def run(ns: argparse.Namespace) -> int:
    args = preset(ns.preset, ns.experts) if ns.preset == "bench" else preset(ns.preset)
    args = dataclasses.replace(args, max_seq_len=1 << 21)
    if not 0 < ns.layers <= args.first_decoder_layer:
        raise SystemExit(f"dsflash bench tiers: --layers {ns.layers}: expected 1..{args.first_decoder_layer} "
                         "(an encoder slice)")
    known = [*TIERS, *(ENGRAM_PREFIX + t for t in TIERS[1:])]
    bad = [t for t in ns.tiers if t not in known]
    if bad:
        raise SystemExit(f"dsflash bench tiers: --tiers {','.join(bad)}: expected some of {','.join(known)}")
    cache = None if ns.expert_cache_gib is None else int(ns.expert_cache_gib * 2**30)
    engram_cache = None if ns.engram_cache_gib is None else int(ns.engram_cache_gib * 2**30)
    t0 = time.perf_counter()
    expert_bytes = write_checkpoint(args, ns.layers, Path(ns.dir), ns.device)
    r = {"date": time.strftime("%Y-%m-%d"), "machine": machine(ns.device), "commit": commit(),
         "torch": torch.__version__, "command": command(sys.argv[2:]),
         "checkpoint": {"preset": ns.preset, "experts": args.n_routed_experts, "layers": ns.layers, "dir": ns.dir,
                        "expert_bytes": expert_bytes, "write_s": time.perf_counter() - t0},
         "tiers": {}}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"tiers-{ns.preset}-e{args.n_routed_experts}-l{ns.layers}-{r['date']}"
    for i, tier in enumerate(ns.tiers):
        def saved(res: dict, tier: str = tier) -> None:
            r["tiers"][tier] = res
            stem.with_suffix(".json").write_text(json.dumps(r, indent=1))
            stem.with_suffix(".md").write_text(to_markdown(r))

        # the first tier's warm-up is a whole chunk: it compiles the kernels of every prefill shape class for
        # the process; the later tiers' a short one, for the cache's own shapes
        warmup = min(ns.lengths[0], CHUNK if i == 0 else WARMUP_TOKENS)
        saved(bench_tier(args, Path(ns.dir), ns.layers, tier, cache, engram_cache, ns.device, ns.lengths, ns.context,
                         ns.rows, ns.reps, ns.eager, warmup, saved))
        print(f"{tier}: {json.dumps(r['tiers'][tier])}", flush=True)
        gc.collect()  # the tier's model and its memory gone before the next one loads
        if ns.device.startswith("cuda"):
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):  # and the pinned host blocks the tier left cached
                torch._C._host_emptyCache()
    print(to_markdown(r))
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    p = bsub.add_parser("tiers", help="routed experts resident vs pinned host vs disk, through the expert cache")
    p.add_argument("--preset", default="bench", help="configuration to slice (bench: real widths and schedule)")
    p.add_argument("--experts", type=int, default=384, help="routed experts per layer of the bench preset")
    p.add_argument("--layers", type=int, default=2, help="the encoder slice [0, N) written and run")
    p.add_argument("--dir", default="/tmp/dsflash-bench-tiers", help="where the checkpoint is written (kept)")
    p.add_argument("--tiers", type=lambda s: s.split(","), default=list(TIERS),
                   help="expert tiers (gpu, host, disk) and Engram tiers (engram-host, engram-disk)")
    p.add_argument("--expert-cache-gib", type=float, default=None,
                   help="device expert cache in GiB (default: one layer's bank)")
    p.add_argument("--engram-cache-gib", type=float, default=None,
                   help="the Engram disk tier's hot-row RAM cache in GiB (default: model/tiers.py's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--lengths", type=ints, default=[8192, 32768], help="prefill lengths")
    p.add_argument("--context", type=int, default=8192, help="steps follow a prefill of this many tokens")
    p.add_argument("--rows", type=ints, default=[1, 5], help="rows per step (L)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each step")
    p.add_argument("--eager", action="store_true", help="steps without CUDA graphs (every tier)")
    p.add_argument("--out", default="bench/results", help="directory for the results (.json, .md)")
    p.set_defaults(func=run)
