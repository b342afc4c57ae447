"""`dsflash bench step|prefill`: the engine's own timings on a real-shape checkpoint.

- box step: the encoder half (embed, Engram, layers [0, d), layer d's cache write) appending L rows
  to a sequence of C tokens, then rolled back, for L = 1..8;
- back step: the decoder half (layers [d, n), head) on one row, plus one DSpark draft round;
- prefill: encoder-only prefill (`Session.prefill`) in tokens per second of prompt;
- reference speedup: the same encoder step with the CPU-reference code path run on the GPU, on a
  slice of the first layers (the reference keeps FP8/FP4 weights as float32 and cannot hold the
  whole model).

Results go to bench/results/<name>-<date>.json and .md with the GPU, commit and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsflash.bench.common import command, commit, machine, prompt, sync, timed_rounds
from dsflash.bench.drafts import add_parser as add_drafts
from dsflash.bench.synthetic import synthetic_args, synthetic_spec
from dsflash.bench.tiers import add_parser as add_tiers
from dsflash.config import V41_FLASH, ModelArgs
from dsflash.engine.halves import LocalEncoder, LocalHalf
from dsflash.engine.placement import add_layout_options, check_gpus, layer_devices
from dsflash.engine.ranks import start_ranks
from dsflash.engine.runner import Runner
from dsflash.engine.session import Engine, Session, engine_identity
from dsflash.model.load import ranges_within
from dsflash.model.parallel import Layout, Sharding
from dsflash.model.state import SequenceState
from dsflash.model.transformer import Transformer


def build_engine(args: ModelArgs, device: str, reference: bool = False, cuda_graphs: bool = True,
                 ranges: list[tuple[range, str]] | None = None, parallel: Sharding | None = None) -> Engine:
    """Both halves over a synthetic checkpoint; `ranges`: layer ranges over devices (--pp), `parallel`: rank 0
    of an --ep/--tp layout whose followers hold the same synthetic tensors -- as Engine.load takes them."""
    from dsflash.bench.synthetic import SyntheticCheckpoint

    ckpt = SyntheticCheckpoint(args, device)
    token_map = [i % args.engram_compressed_vocab_size for i in range(args.vocab_size)]
    d = args.first_decoder_layer

    def half(layers: range, tokens: list[int] | None) -> Runner:
        return Runner(Transformer(args, ckpt, tokens, layers, device=device, reference=reference,
                                  ranges=ranges_within(ranges, layers), parallel=parallel),
                      cuda_graphs and parallel is None)

    enc, dec = half(range(0, d), token_map), half(range(d, args.n_layers), None)
    if parallel is not None:
        parallel.ready()
    return Engine(dec, LocalHalf(enc), 1 << 21, engine_identity(dec.model))


def _box_step(enc: LocalEncoder, keep: int, new: list[int]) -> Callable[[], None]:
    def box_step() -> None:
        list(enc.append(new, keep, 8, len(new)))
        enc.rollback(keep)

    return box_step


def _step(s: Session, keep: int) -> Callable[[], None]:
    def step() -> None:
        s.step(keep, [5])
        s.rollback(keep)

    return step


def bench_steps(engine: Engine, contexts: list[int], rows: list[int], reps: int, warmup_s: float = 0.0) -> dict:
    a, dev = engine.args, engine.decoder.device
    out = {"box_step_ms": {}, "back_step_ms": {}, "draft_ms": {}}
    for ctx in contexts:
        s = engine.session()
        s.prefill(prompt(ctx, a.vocab_size))  # untimed: the first one compiles kernels (bench_prefill times it)
        keep = s.pos
        fns = {n: _box_step(s.encoder, keep, prompt(n, a.vocab_size, seed=n)) for n in rows}
        fns["step"] = _step(s, keep)
        if engine.decoder.model.dspark is not None:
            fns["draft"] = lambda s=s: s.draft(7)
        ms = timed_rounds(fns, dev, reps, warmup_s)
        out["box_step_ms"][ctx] = {n: ms[n] for n in rows}
        # a whole step minus its encoder part: layers [d, n) and the head
        out["back_step_ms"][ctx] = ms["step"] - ms.get(1, 0.0)
        if "draft" in ms:
            out["draft_ms"][ctx] = ms["draft"]
    return out


def bench_prefill(engine: Engine, lengths: list[int], compare_full: bool) -> dict:
    """Encoder-only prefill tok/s by prompt length; with `compare_full`, also a full prefill (every layer
    on every row, one model over all layers) and the state size per token."""
    a, dev = engine.args, engine.decoder.device
    full = None
    if compare_full:
        token_map = [i % a.engram_compressed_vocab_size for i in range(a.vocab_size)]
        full = Transformer(a, engine.decoder.model.ckpt, token_map, device=dev)
    res: dict = {"tok_s": {}, "full_tok_s": {}, "decoder_rows": {}, "cache_bytes_per_token": {},
                 "snapshot_bytes_per_token": {}}
    # warm-up: a first prefill compiles the kernels of every shape class, which must not count
    engine.session().prefill(prompt(min(lengths[0], 8192), a.vocab_size))
    sync(dev)
    for n in lengths:
        s = engine.session()
        ids = prompt(n, a.vocab_size)
        sync(dev)
        t0 = time.perf_counter()
        s.prefill(ids)
        sync(dev)
        res["tok_s"][n] = n / (time.perf_counter() - t0)
        res["decoder_rows"][n] = min(n, s.tail_rows())
        # the growing caches of both halves, as held in device memory (the model's 890 B/token at full shapes)
        res["cache_bytes_per_token"][n] = (s.state.cache_bytes() + s.encoder.state.cache_bytes()) / n
        if full is not None:
            state = SequenceState(device=dev)
            t0 = time.perf_counter()
            for i in range(0, n, 8192):
                full.forward(state, torch.tensor(ids[i:i + 8192], device=dev))
            sync(dev)
            res["full_tok_s"][n] = n / (time.perf_counter() - t0)
            res["snapshot_bytes_per_token"][n] = len(s.snapshot()) / n
        del s
    return res


def _slice_times(args: ModelArgs, device: str, layers: int, reference: bool, reps: int) -> dict:
    from dsflash.bench.synthetic import SyntheticCheckpoint

    dev = torch.device(device)
    token_map = [i % args.engram_compressed_vocab_size for i in range(args.vocab_size)]
    model = Runner(Transformer(args, SyntheticCheckpoint(args, device), token_map, range(0, layers), device=device,
                               reference=reference))
    ids = torch.tensor(prompt(1024, args.vocab_size), device=dev)
    state = SequenceState(device=dev)
    model.forward(state, ids[:512])
    ratios = {s: args.compress_ratios[s] for s in state.compressed}

    def step() -> None:
        model.forward(state, ids[512:513])
        state.truncate(512, ratios)

    def chunk() -> None:
        model.forward(SequenceState(device=dev), ids[:512])

    return {"step_ms": timed_rounds({0: step}, dev, reps)[0],
            "chunk512_ms": timed_rounds({0: chunk}, dev, max(2, reps // 4), warmup=1)[0]}


def reference_speedup(args: ModelArgs, device: str, layers: int, reps: int) -> dict:
    """Encoder slice [0, layers): one-row step and a 512-row chunk, Triton backend vs reference ops."""
    times = {}
    for name, ref in (("cuda", False), ("reference", True)):
        times[name] = _slice_times(args, device, layers, ref, reps)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"layers": layers, **times,
            "step_speedup": times["reference"]["step_ms"] / times["cuda"]["step_ms"],
            "chunk_speedup": times["reference"]["chunk512_ms"] / times["cuda"]["chunk512_ms"]}


def profile_step(engine: Engine, context: int, rows: int, prefill: bool = False, by_op: bool = False) -> str:
    """torch.profiler table of one step (box and back) after a `context`-token prompt, or with `prefill`
    of the prompt itself (encoder-only prefill): where the time goes, per op and kernel. `by_op` adds each
    torch op's CUDA time (with the kernels it launched) by input shapes, which name the op's place in the
    model (for an eager engine: graph replays hide the ops)."""
    from torch.profiler import ProfilerActivity, profile

    ids = prompt(context, engine.args.vocab_size)
    s = engine.session()
    if prefill:  # warm-up on a short prompt compiles the kernels of every shape class
        s.prefill(ids[: min(context, 4096)])
        s = engine.session()
    else:
        s.prefill(ids)
        keep = s.pos
        new = prompt(rows, engine.args.vocab_size, seed=1)
        for _ in range(2):  # warm-up: compilation and caches stay out of the profile
            s.step(keep, new)
            s.rollback(keep)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=by_op) as prof:
        if prefill:
            s.prefill(ids)
        else:
            s.step(keep, new)
        sync(engine.decoder.device)
    tables = prof.key_averages()
    host = tables.table(sort_by="self_cpu_time_total", row_limit=25)
    if not torch.cuda.is_available():
        return host
    ops = ("\n\nBy op and input shapes, with the kernels it launched:\n"
           + prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=50,
                                                                max_name_column_width=40,
                                                                max_shapes_column_width=70)) if by_op else ""
    return (tables.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\nBy host time:\n" + host
            + ops + "\n\n" + gpu_timeline(prof.events()))


def gpu_timeline(events, top: int = 12) -> str:
    """How busy the GPU was between its first and last kernel, and its longest idle gaps with the kernel
    that ended each and the host's top-level op at that moment: a gap the host caused (the GPU waiting for
    a launch) shows a host op; a step that is GPU-bound shows few and short gaps. Profiler-inflated host
    times make the gaps an upper bound: a CUDA graph launch takes milliseconds under the profiler (its
    kernels are traced one by one) against microseconds without it."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA)
    if not kernels:
        return "GPU timeline: no kernels"
    host = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == DeviceType.CPU and e.cpu_parent is None)
    busy, gaps, end = 0.0, [], kernels[0][0]
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, end, name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - kernels[0][0]
    lines = [f"GPU timeline: busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span ({100 * busy / span:.0f}%); "
             f"{len(gaps)} idle gaps, {sum(g for g, _, _ in gaps) / 1e3:.2f} ms in all, "
             f"{sum(g for g, _, _ in gaps if g >= 20) / 1e3:.2f} ms in gaps of 20 µs or more",
             "longest gaps (µs, kernel after the gap, host op at the gap's start):"]
    for gap, at, name in sorted(gaps, reverse=True)[:top]:
        on_host = next((h for s_, e_, h in host if s_ <= at <= e_), "-")
        lines.append(f"  {gap:8.1f}  {name[:60]:60s}  {on_host[:50]}")
    return "\n".join(lines)


def bench_link(model: str, device: str, prompt_len: int, steps: int) -> dict:
    """Bytes and step latency through a real `dsflash box` process on loopback, against one process."""
    import socket as socketlib

    from dsflash.split import link as link_mod

    counted = {"sent": 0, "received": 0}
    request, parse = link_mod.BoxLink.request, link_mod.RemoteEncoder._parse

    def counting_request(self, frame):
        counted["sent"] += len(frame.encode())
        return request(self, frame)

    def counting_parse(self, frame):
        counted["received"] += 16 + 4 + len(json.dumps(frame.meta, separators=(",", ":"))) + len(frame.body)
        return parse(self, frame)

    with socketlib.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    box = subprocess.Popen([sys.executable, "-m", "dsflash.cli", "box", "--model", model, "--listen",
                            f"127.0.0.1:{port}", "--device", device, "--max-context", str(prompt_len + steps + 16)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving" in box.stdout.readline()
        link_mod.BoxLink.request, link_mod.RemoteEncoder._parse = counting_request, counting_parse
        out = {}
        for name, addr in (("one_process", None), ("split", f"127.0.0.1:{port}")):
            engine = Engine.load(model, encoder=addr and link_mod.box_half(addr), device=device,
                                 max_context=prompt_len + steps + 16)
            s = engine.session()
            counted.update(sent=0, received=0)
            s.prefill(prompt(prompt_len, engine.args.vocab_size), chunk=256)
            prefill_bytes = dict(counted)
            counted.update(sent=0, received=0)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                s.step(s.pos, [7])
                times.append((time.perf_counter() - t0) * 1000)
            out[name] = {"step_ms": statistics.median(times), "prefill_bytes_received": prefill_bytes["received"],
                         "prefill_bytes_sent": prefill_bytes["sent"], "tail_rows": s.tail_rows(),
                         "step_bytes_received": counted["received"] / steps, "step_bytes_sent": counted["sent"] / steps}
            s.close()
        return out
    finally:
        link_mod.BoxLink.request, link_mod.RemoteEncoder._parse = request, parse
        box.kill()
        box.wait()


def _expert_caveat(r: dict) -> str:
    """What an expert count below the released one hides (config.bench_preset)."""
    experts = r["checkpoint"].get("experts")
    if experts is None or experts >= V41_FLASH.n_routed_experts:
        return ""
    return (f"; {experts} experts, not the released {V41_FLASH.n_routed_experts}: a prefill chunk gives each expert "
            f"{V41_FLASH.n_routed_experts / experts:g}x the rows and a multi-row step touches fewer distinct experts, "
            "so prefill and multi-row steps read faster than the released model's")


def _layout(r: dict) -> str:
    """The header's note on layer ranges (--pp), when the run had them."""
    layout = r.get("layout") or {}
    flags = " ".join(f"--{k} {layout[k]}" for k in ("pp", "ep", "tp") if layout.get(k, 1) > 1)
    return f"; {flags} over {', '.join(layout['devices'])}" if flags else ""


# What the system we follow publishes, printed under our numbers: the seed's box of two RTX PRO 6000s beside a Mac
# (../shared/seeds/000_23149bb6bf3b4165.txt), and the targets set from it for one H200 (docs/perf-record.md)
STEP_ANCHORS = ("Anchors: the seed's box (two RTX PRO 6000s) runs a step of 1-5 verify rows in 7.2-7.8 ms from 8K to "
                "1M context. Targets on one H200: box <= 5 ms at L=1 and <= 8 ms at L=5, back <= 5 ms "
                "(aim 2.5 / 4.5 / 4).")
PREFILL_ANCHORS = ("Anchors: the seed's split prefills 7,975 / 13,812 / 16,655 tok/s at 8K / 32K / 128K (prompt "
                   "tokens per second of time to first token, box and Mac together). Target on one H200: encoder-only "
                   "prefill >= 20,000 tok/s at 8K-128K with the released 384 experts (aim 30,000).")


def to_markdown(r: dict) -> str:
    lines = [f"# Engine benchmark {r['date']}", "", f"GPU/machine: {r['gpu']}; commit {r['commit']}; torch "
             f"{r['torch']}; CUDA graphs {'on' if r.get('cuda_graphs', True) else 'off'}" + _layout(r),
             f"Command: `{r['command']}`",
             f"Checkpoint: {r['checkpoint']} (top-{r['top_k']} routing{_expert_caveat(r)})", ""]
    if r.get("box_step_ms"):
        rows = sorted({n for v in r["box_step_ms"].values() for n in v}, key=int)
        lines += ["| context | " + " | ".join(f"box L={n} ms" for n in rows) + " | back step ms | draft ms |",
                  "|---" * (len(rows) + 3) + "|"]
        for ctx, box in r["box_step_ms"].items():
            lines.append(f"| {ctx} | " + " | ".join(f"{box[n]:.2f}" for n in rows) +
                         f" | {r['back_step_ms'][ctx]:.2f} | {r['draft_ms'].get(ctx, float('nan')):.2f} |")
        lines += ["", STEP_ANCHORS]
    if r.get("prefill_tok_s"):
        full = r.get("full_tok_s") or {}
        lines += ["", "| prompt tokens | encoder-only prefill tok/s | decoder rows | full prefill tok/s | speed-up |"
                  " cache B/token | snapshot B/token |", "|---|---|---|---|---|---|---|"]
        for n, v in r["prefill_tok_s"].items():
            f = full.get(n)
            lines.append(f"| {n} | {v:,.0f} | {r['decoder_rows'][n]} | {f'{f:,.0f}' if f else '-'} | "
                         f"{f'{v / f:.2f}x' if f else '-'} | {r['cache_bytes_per_token'][n]:,.0f} | "
                         f"{r['snapshot_bytes_per_token'].get(n, float('nan')):,.0f} |")
        lines += ["", PREFILL_ANCHORS]
    if r.get("reference_speedup"):
        s = r["reference_speedup"]
        lines += ["", f"Reference code path on the same device, encoder layers [0, {s['layers']}): one-row step "
                  f"{s['reference']['step_ms']:.1f} ms vs {s['cuda']['step_ms']:.1f} ms ({s['step_speedup']:.1f}x); "
                  f"512-row chunk {s['reference']['chunk512_ms']:.1f} ms vs {s['cuda']['chunk512_ms']:.1f} ms "
                  f"({s['chunk_speedup']:.1f}x)."]
    return "\n".join(lines) + "\n"


def run(ns: argparse.Namespace) -> int:
    args = synthetic_args(synthetic_spec(ns.preset, ns.experts))
    r = {"date": time.strftime("%Y-%m-%d"), "gpu": machine(ns.device), "commit": commit(), "torch": torch.__version__,
         "command": command(sys.argv[2:]) if len(sys.argv) > 2 else ns.what,
         "checkpoint": {"preset": ns.preset, "experts": args.n_routed_experts}, "top_k": args.n_activated_experts,
         "device": ns.device, "cuda_graphs": not ns.eager}
    if ns.what == "link":
        r["link"] = bench_link(ns.model, ns.device, ns.context[0], ns.reps)
        r["checkpoint"] = {"model": ns.model}
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"engine-link-{r['date']}.json").write_text(json.dumps(r, indent=1))
        print(json.dumps(r["link"], indent=1))
        return 0
    check_gpus(ns)
    ranges = layer_devices(ns, args, "all")
    r["layout"] = {"pp": ns.pp, "ep": ns.ep, "tp": ns.tp,
                   "devices": sorted({dev for _, dev in ranges or [(None, ns.device)]})}
    layout = Layout(ns.ep, ns.tp)
    parallel = None if layout.world == 1 else start_ranks(layout, None, ns.device, source=[
        "--synthetic", synthetic_spec(ns.preset, ns.experts)], ranges=ranges)
    try:
        return _measure(ns, r, args, build_engine(args, ns.device, cuda_graphs=not ns.eager, ranges=ranges,
                                                  parallel=parallel))
    finally:
        if parallel is not None:
            parallel.close()


def _measure(ns: argparse.Namespace, r: dict, args: ModelArgs, engine: Engine) -> int:
    """run()'s measurements on `engine`, written to --out."""
    if ns.what == "profile":
        table = profile_step(engine, ns.context[0], ns.rows[0], ns.prefill, by_op=ns.eager)
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        what = f"the prefill of {ns.context[0]} tokens" if ns.prefill else \
            f"one step (context {ns.context[0]}, {ns.rows[0]} rows)"
        (out / f"engine-profile{'-prefill' if ns.prefill else ''}-{ns.preset}-{r['date']}.md").write_text(
            f"# Profile of {what}\n\n{r['gpu']}, commit {r['commit']}\n\n```\n{table}\n```\n")
        print(table)
        return 0
    if ns.what in ("step", "all"):
        r.update(bench_steps(engine, ns.context, ns.rows, ns.reps, ns.warmup_s))
    if ns.what in ("prefill", "all"):
        pre = bench_prefill(engine, ns.lengths, ns.compare_full)
        r["prefill_tok_s"] = pre.pop("tok_s")
        r.update(pre)
    del engine
    if ns.reference_layers:
        r["reference_speedup"] = reference_speedup(args, ns.device, ns.reference_layers, ns.reps)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    layout = "".join(f"-{k}{r['layout'][k]}" for k in ("pp", "ep", "tp") if r["layout"][k] > 1)
    stem = out / f"engine-{ns.what}-{ns.preset}{layout}{'-eager' if ns.eager else ''}-{r['date']}"
    stem.with_suffix(".json").write_text(json.dumps(r, indent=1, default=str))
    stem.with_suffix(".md").write_text(to_markdown(r))
    print(to_markdown(r))
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def add_parser(sub: argparse._SubParsersAction, what: str) -> None:
    """`bench WHAT` with the options WHAT reads (run() reads each only where it is given)."""
    p = sub.add_parser(what, help=f"engine benchmark: {what}")
    p.add_argument("--preset", default="bench", help="bench (real widths, fewer experts), tiny-a, tiny-b, ...")
    p.add_argument("--experts", type=int, default=48, help="routed experts per layer of the bench preset")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--eager", action="store_true", help="run every forward eagerly (no CUDA graphs for short steps)")
    p.add_argument("--out", default="bench/results", help="directory for the results (JSON and Markdown)")
    if what in ("step", "all", "profile", "link"):
        p.add_argument("--context", type=_ints, default=[8192],
                       help="context lengths of the timed steps, comma-separated (profile and link: the first)")
    if what in ("step", "all", "profile"):
        p.add_argument("--rows", type=_ints, default=list(range(1, 9)),
                       help="rows per step, comma-separated (profile: the first)")
    if what in ("prefill", "all"):
        p.add_argument("--lengths", type=_ints, default=[8192, 32768], help="prompt lengths, comma-separated")
        p.add_argument("--compare-full", action="store_true",
                       help="also time a full prefill (decoder on every row) and report snapshot bytes per token")
    if what in ("step", "prefill", "all", "link"):
        p.add_argument("--reps", type=int, default=10, help="timed repetitions of each measurement")
    if what in ("step", "all"):
        p.add_argument("--warmup-s", type=float, default=3.0,
                       help="untimed rounds of every step shape for this long before timing")
    if what in ("step", "prefill", "all"):
        p.add_argument("--reference-layers", type=int, default=0,
                       help="also time the reference code path on an encoder slice of this many layers")
    if what != "link":
        add_layout_options(p)
    if what == "profile":
        p.add_argument("--prefill", action="store_true", help="the prefill of --context tokens, not a step")
    if what == "link":
        p.add_argument("--model", required=True, help="checkpoint directory both processes load")
    p.set_defaults(func=run, what=what)


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (results in bench/results/)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for what in ("step", "prefill", "all", "profile", "link"):
        add_parser(bsub, what)
    add_tiers(bsub)
    add_drafts(bsub)
    k = bsub.add_parser("kernels", help="each CUDA kernel at real shapes against the measured ceilings")
    k.add_argument("rest", nargs=argparse.REMAINDER, help="the options of python -m dsflash.bench.kernels")
    k.set_defaults(func=lambda ns: __import__("dsflash.bench.kernels", fromlist=["main"]).main(ns.rest))
