"""The memory plan (issue 17): where each part of the model lives -- each GPU, pinned host memory, the
checkpoint's files on disk -- and whether that fits, computed from tensor headers alone (a checkpoint's,
or a config's `expected_tensors`), so it answers for the 510 GB release without reading a weight.

Parts: dense weights, routed experts, Engram tables, vision tower, DSpark stages, a second copy of what
both halves load when one process holds both (the embedding: each half's Transformer loads its own),
the sequence state at a context and session count (model/state.py's layout), the GPU expert cache, and
a stated workspace allowance. Weights count their stored bytes: what the CUDA backend keeps (FP8/FP4
codes with E8M0 scales; bf16 widened inside its kernels).

The halves of the split (d = args.first_decoder_layer): "box" = embed, Engram, layers [0, d), the vision
tower and layer d's cache write; "back" = layers [d, n), norm, head, DSpark; "all" = both in one process.
With several GPUs and no layout flags the layers go to them greedily in order. A parallel layout names
its ranks: `--pp N` cuts the half's layers into N equal ranges (stages), and each stage runs on
max(tp, ep) ranks (GPUs; `--tp` and `--ep` together share the same ranks), rank = stage * max(tp, ep) + r.
Per rank the plan counts what model/parallel.py loads: the stage's first rank drives (it holds the state,
the workspace of the indexer and every tensor not split), tensor parallelism (`--tp`) splits attention by
heads (wq_b, the sinks, wo_a's groups, wo_b's rows), the q and kv LoRA, the shared experts and the head by
output rows over every rank (`split_by_rows`), and expert parallelism (`--ep`) gives rank e the routed experts
with ids in its e-th slice (`expert_range`; without it they are the driver's). Host memory and the disk are
the machine's: a tier there is counted once, whatever the ranks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from dsflash.checkpoint.expect import expected_tensors
from dsflash.checkpoint.reader import DTYPE_SIZES, Checkpoint
from dsflash.config import ModelArgs
from dsflash.model.attention import INDEXER_ROWS
from dsflash.model.parallel import Layout, expert_share, split_by_rows
from dsflash.model.state import ROLLBACK_ROWS
from dsflash.model.tiers import ENGRAM_CACHE, TIERS
from dsflash.numerics.packing import ENTRY, INDEX_KEY, packed_width

GiB = 1 << 30
HALVES = ("box", "back", "all")
# what the rows of a plan hold, in table order
PARTS = {"dense": "dense weights", "experts": "routed experts", "engram": "Engram tables", "vision": "vision tower",
         "dspark": "DSpark stages", "copies": "second copies", "state": "KV/state", "cache": "expert cache",
         "rows": "Engram row cache",
         "workspace": "graphs/workspace", "reserve": "process reserve"}
WEIGHT_PARTS = ("dense", "experts", "engram", "vision", "dspark")

# Stated allowances (not measured from the model's tensors):
# per GPU: CUDA graphs of the step sizes, one 8,192-token prefill chunk's activations, allocator slack
GPU_WORKSPACE = 4 * GiB
CPU_WORKSPACE = 1 * GiB  # the same for the CPU backend (no graphs)
HOST_RESERVE = 2 * GiB  # the process itself: torch, the tokenizer, Python, pinned staging
# GrowingRows grows to the power of two above its rows: the compressed entries, index keys and Engram ids hold up
# to 2x their rows
GROWTH = 2

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


class PlacementError(ValueError):
    """A placement that cannot be planned or does not fit; the message (one line) says what to change."""


def parse_size(text: str) -> int:
    """Bytes from "140GiB", "512GiB", "256KiB", "1.5TiB" (binary units, any case) or a plain byte count."""
    m = _SIZE.fullmatch(str(text))
    unit = m and UNITS.get(m.group(2).lower())
    if not m or unit is None or (unit == 1 and "." in m.group(1)):
        raise PlacementError(f"size {text!r}: expected a byte count or a number with KiB, MiB, GiB or TiB "
                             "(e.g. 140GiB, 1.5TiB)")
    return int(float(m.group(1)) * unit) if "." in m.group(1) else int(m.group(1)) * unit


def gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def human(n: int) -> str:
    """Bytes in the largest binary unit that keeps them at least 1 (one decimal)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Request:
    """What the plan is asked for. engram/experts None: the defaults (module doc of `plan`)."""

    half: str = "all"
    backend: str = "cuda"  # "cpu": the one device is host memory
    gpu_memory: tuple[int, ...] = ()  # bytes per GPU (CUDA)
    host_memory: int = 0
    engram: str | None = None
    experts: str | None = None
    expert_cache: int | None = None  # bytes per GPU holding MoE layers; None: the largest layer's bank
    engram_cache: int = ENGRAM_CACHE  # host RAM for the disk tier's hot Engram rows
    context: int = 1 << 20
    sessions: int = 1
    gpu_ids: tuple[int, ...] = ()  # the GPUs' ids, for the table (default 0 .. len(gpu_memory)-1)
    pp: int = 1  # layer ranges (stages)
    tp: int = 1  # tensor-parallel ranks per stage
    ep: int = 1  # expert-parallel ranks per stage (the same ranks as --tp's when both are given)

    @property
    def world(self) -> int:
        """Ranks per stage."""
        return max(self.tp, self.ep)

    @property
    def ranks(self) -> int:
        return self.pp * self.world

    @property
    def parallel(self) -> bool:
        """Whether the request names a layout (else several GPUs are filled greedily in layer order)."""
        return self.ranks > 1

    def __post_init__(self) -> None:
        if self.half not in HALVES:
            raise PlacementError(f"--half {self.half!r}: expected one of {', '.join(HALVES)}")
        for flag, value in (("--engram", self.engram), ("--experts", self.experts)):
            if value is not None and value not in TIERS:
                raise PlacementError(f"{flag} {value!r}: expected one of {', '.join(TIERS)}")
        for flag, value in (("--context", self.context), ("--sessions", self.sessions), ("--pp", self.pp),
                            ("--tp", self.tp), ("--ep", self.ep)):
            if value < 1:
                raise PlacementError(f"{flag} {value}: expected at least 1")
        if self.backend == "cuda" and not self.gpu_memory:
            raise PlacementError("no GPU to plan for: give --gpus and --gpu-memory")
        if self.gpu_ids and len(self.gpu_ids) != len(self.gpu_memory):
            raise ValueError(f"{len(self.gpu_ids)} GPU ids for {len(self.gpu_memory)} GPU capacities")
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise PlacementError(f"--ep {self.ep} with --tp {self.tp}: both run over the same ranks, give equal counts")
        if self.backend == "cuda" and self.parallel and len(self.gpu_memory) != self.ranks:
            raise PlacementError(f"--gpus: {len(self.gpu_memory)} GPU(s) for --pp {self.pp} x --tp {self.tp} x "
                                 f"--ep {self.ep} = {self.ranks} ranks (one GPU a rank)")


@dataclass
class Device:
    """One place memory is counted: a GPU, host memory (pinned), or the disk (bytes read, no capacity)."""

    name: str
    capacity: int | None
    parts: dict[str, int] = field(default_factory=dict)
    layers: list[int] = field(default_factory=list)

    def add(self, part: str, n: int) -> None:
        if n:
            self.parts[part] = self.parts.get(part, 0) + n

    @property
    def used(self) -> int:
        return sum(self.parts.values())

    @property
    def short(self) -> int:
        return 0 if self.capacity is None else max(0, self.used - self.capacity)


@dataclass
class Unit:
    """What must sit on one GPU together: a layer (or the embedding side, or the head side) and its state."""

    key: str
    layer: int | None
    parts: dict[str, int] = field(default_factory=dict)  # GPU-resident bytes by part

    @property
    def size(self) -> int:
        return sum(self.parts.values())


@dataclass
class Plan:
    request: Request
    engram: str
    experts: str
    gpus: list[Device]
    host: Device
    disk: Device
    spill: Device = field(default_factory=lambda: Device("unplaced", 0))  # GPU parts no GPU could take
    expert_bytes: int = 0  # the largest routed expert's stored bytes (the expert cache's slot)

    @property
    def unplaced(self) -> int:
        return self.spill.used

    @property
    def fits(self) -> bool:
        return not self.unplaced and not self.host.short and not any(g.short for g in self.gpus)

    @property
    def columns(self) -> list[Device]:
        return [*self.gpus, self.host, self.disk, *([self.spill] if self.spill.parts else [])]

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.columns:
            for part, n in d.parts.items():
                out[part] = out.get(part, 0) + n
        return out

    def problem(self) -> str | None:
        """Why it does not fit, with the shortfall in GiB and the flag that would fix it (None: it fits)."""
        r, cpu, held = self.request, self.request.backend == "cpu", self.totals()
        if self.experts != "gpu" and r.expert_cache is not None and r.expert_cache < self.expert_bytes:
            return (f"an expert cache of {human(r.expert_cache)} holds no expert ({human(self.expert_bytes)} "
                    "each): give --expert-cache at least one expert's size")
        short = self.unplaced + sum(g.short for g in self.gpus)
        if short:
            if cpu:
                where, offload = f"in host memory ({human(r.host_memory)}, the CPU backend's device)", "disk"
            else:
                where = f"on {len(self.gpus)} GPU(s) of {human(max(r.gpu_memory))}"
                room = r.host_memory - self.host.used
                offload = "host" if room >= held.get("experts", 0) else "disk"
            # the fewest flags that move enough off the device: one of them (the experts first), else both
            moves = []
            if self.experts == "gpu":
                moves.append((f"--experts {offload}", held.get("experts", 0)))
            if self.engram == "gpu":
                moves.append(("--engram disk" if cpu else "--engram host", held.get("engram", 0)))
            one = [flag for flag, n in moves if n >= short]
            if one:
                fix = one[0]
            elif moves and sum(n for _, n in moves) >= short:
                fix = " ".join(flag for flag, _ in moves)
            else:
                fix = "--host-memory" if cpu else "--gpu-memory or --gpus"
            return f"{gib(short)} GiB of the plan does not fit {where} ({fix} would fix it)"
        if self.host.short:
            fix = ("--experts disk" if self.experts == "host" and held.get("experts", 0) >= self.host.short
                   else "--engram disk" if self.engram == "host" else "--host-memory")
            return (f"{gib(self.host.short)} GiB of the plan does not fit in host memory "
                    f"({human(self.host.capacity)} left for it; {fix} would fix it)")
        return None

    def as_dict(self) -> dict:
        def dev(d: Device) -> dict:
            out = {"name": d.name, "capacity": d.capacity, "used": d.used, "parts": dict(d.parts)}
            if d.layers:
                out["layers"] = [d.layers[0], d.layers[-1]]
            return out

        r = self.request
        return {"half": r.half, "backend": r.backend, "context": r.context, "sessions": r.sessions,
                "pp": r.pp, "tp": r.tp, "ep": r.ep,
                "engram": self.engram, "experts": self.experts, "fits": self.fits, "problem": self.problem(),
                "gpus": [dev(g) for g in self.gpus], "host": dev(self.host), "disk": dev(self.disk),
                "totals": self.totals()}

    def table(self) -> str:
        """The plan as a compact table (GiB)."""
        r = self.request
        cols = self.columns
        held = self.totals()
        tiers = "; ".join(f"{label} {tier if part in held else '(none in this half)'}" for part, label, tier in
                          (("engram", "engram", self.engram), ("experts", "experts", self.experts)))
        layout = f"pp {r.pp} x tp {r.tp} x ep {r.ep} (per-rank bytes), " if r.parallel else ""
        head = f"plan: half {r.half}, {r.backend}, {layout}context {r.context:,} x {r.sessions} session(s); {tiers}"
        width = 11
        lines = [head, f"{'':<18}" + "".join(f"{d.name:>{width}}" for d in cols)]
        for part, label in PARTS.items():
            if any(part in d.parts for d in cols):
                lines.append(f"{label:<18}" + "".join(
                    f"{human(d.parts[part]) if part in d.parts else '-':>{width}}" for d in cols))
        lines.append(f"{'total':<18}" + "".join(f"{human(d.used):>{width}}" for d in cols))
        lines.append(f"{'capacity':<18}" + "".join(
            f"{human(d.capacity) if d.capacity is not None and d is not self.spill else '-':>{width}}"
            for d in cols))
        if any(g.layers for g in self.gpus):
            lines.append(f"{'layers':<18}" + "".join(
                f"{f'{d.layers[0]}-{d.layers[-1]}' if d.layers else '-':>{width}}" for d in cols))
        if r.backend == "cpu":
            lines.append("(weights at their stored bytes, as the CPU reference keeps FP8/FP4; the bf16 tensors it "
                         "holds in fp32 -- head, routers, ratio-2 compressors -- take twice theirs)")
        problem = self.problem()
        lines.append("fits" if problem is None else f"does not fit: {problem}")
        return "\n".join(lines)


def tensor_infos(source: Checkpoint | ModelArgs) -> tuple[ModelArgs, dict[str, tuple[str, tuple[int, ...]]]]:
    """(config, (dtype, shape) of every tensor), from a checkpoint's headers or a config's expected tensors."""
    if isinstance(source, Checkpoint):
        return source.args, {name: source.dtype_shape(name) for name in source.names()}
    return source, expected_tensors(source)


def tensor_sizes(source: Checkpoint | ModelArgs) -> tuple[ModelArgs, dict[str, int]]:
    """(config, stored bytes of every tensor), from a checkpoint's headers or a config's expected tensors."""
    args, infos = tensor_infos(source)
    return args, {name: math.prod(shape) * DTYPE_SIZES[dtype] for name, (dtype, shape) in infos.items()}


def _part_of(name: str) -> tuple[str, int | None]:
    """(part, backbone layer or None) of a tensor name."""
    if name.startswith("mtp."):
        return "dspark", None
    if name.startswith(("vision.", "aligner.", "image_")):
        return "vision", None
    if not name.startswith("layers."):
        return "dense", None  # embed, head, norm
    layer = int(name.split(".")[1])
    if ".ffn.experts." in name:
        return "experts", layer
    if ".engram.embed." in name:
        return "engram", layer
    return "dense", layer


def _next_source_writes(args: ModelArgs, names: list[str]) -> set[str]:
    """The tensors of layer d's cache write (its SourceWriter and its attention norm), which the box half loads
    to compute layer d's entries from its own output."""
    d = args.first_decoder_layer
    if d not in args.kv_source_layers:
        return set()
    p = f"layers.{d}."
    return {name for name in names if name == p + "attn_norm.weight" or name.startswith(
        (p + "attn.compressor.", p + "attn.indexer.wk.", p + "attn.indexer.k_norm."))}


def half_tensors(args: ModelArgs, names: list[str], half: str) -> list[tuple[str, str, str]]:
    """(tensor, unit key, part) of each tensor the half loads; "all" lists both halves (the embedding twice).
    Unit keys: "embed" (the token side), "layer.{i}", "head" (norm, head, DSpark and the back's embedding);
    parts as `_part_of`."""
    d = args.first_decoder_layer
    writes = _next_source_writes(args, names)
    parts = [(name, *_part_of(name)) for name in names]
    out = []
    for side in (("box", "back") if half == "all" else (half,)):
        for name, part, layer in parts:
            if side == "box":
                if name == "embed.weight" or part == "vision":
                    out.append((name, "embed", part))
                elif layer is not None and layer < d:
                    out.append((name, f"layer.{layer}", part))
                elif name in writes:
                    out.append((name, f"layer.{d - 1}", part))
            elif name == "embed.weight" or part == "dspark" or (layer is None and part == "dense"):
                out.append((name, "head", part))
            elif layer is not None and layer >= d:
                # the back's layer d reads the entries the box wrote: it loads no cache write of its own
                if not (layer == d and name in writes and name != f"layers.{d}.attn_norm.weight"):
                    out.append((name, f"layer.{layer}", part))
    return out


def state_bytes(args: ModelArgs, half: str, context: int, growth: int = GROWTH) -> dict[str, int]:
    """Bytes of one session's state by unit key, at `context` tokens (model/state.py): each layer's window
    ring (bf16 rows of head_dim, window + ROLLBACK_ROWS of them); per KV source held here, its packed
    compressed entries and index keys (one per `ratio` tokens, GrowingRows' doubling included); a ratio>1
    source's fp32 (kv, score) ring on the side that writes it; the Engram ids (int64 per token) on the token
    side; the DSpark stages' rings and the session's DSpark input ring on the head side. `growth`: the
    growing buffers' capacity over their rows (1: the rows themselves)."""
    d, ring = args.first_decoder_layer, args.window_size + ROLLBACK_ROWS
    layers = half_layers(args, half)
    out: dict[str, int] = {}

    def add(key: str, n: int) -> None:
        out[key] = out.get(key, 0) + n

    entry = packed_width(args.head_dim, ENTRY[0]) + packed_width(args.index_head_dim, INDEX_KEY[0])
    for i in layers:
        add(f"layer.{i}", ring * args.head_dim * 2)
    for s in args.kv_source_layers:
        ratio = args.compress_ratios[s]
        if s in layers:
            add(f"layer.{s}", growth * (context // ratio) * entry)
        raw = (ratio + ROLLBACK_ROWS) * 2 * args.head_dim * 4
        if ratio > 1 and s == d and half != "back":  # the box writes layer d's entries after layer d-1
            add(f"layer.{d - 1}", raw)
        elif ratio > 1 and s in layers and s != d:
            add(f"layer.{s}", raw)
    if half != "back" and args.engram_layer_ids:
        add("embed", growth * context * 8)
    if half != "box":
        add("head", args.n_mtp_layers * ring * args.head_dim * 2
            + ring * args.dim * len(args.dspark_target_layer_ids) * 2)
    return out


def index_scratch(args: ModelArgs, layers: list[int], context: int, backend: str) -> int:
    """The indexer's temporaries on a device holding `layers`: the decoded index keys of the largest source
    it reads (fp32) and one block of INDEXER_ROWS query rows' scores against them (bf16; the CPU reference
    also holds the per-head logits, index_n_heads times more)."""
    ratios = [args.compress_ratios[i] for i in layers if i in args.index_source_layers]
    if not ratios:
        return 0
    entries = context // min(ratios)
    heads = args.index_n_heads if backend == "cpu" else 1
    return entries * args.index_head_dim * 4 + INDEXER_ROWS * entries * 2 * heads


def _units(args: ModelArgs, sizes: dict[str, int], req: Request, engram: str, experts: str
           ) -> tuple[list[Unit], Device, Device]:
    """The GPU units in placement order, and what goes to host memory and to disk."""
    host, disk = Device("host", req.host_memory), Device("disk", None)
    units: dict[str, Unit] = {}
    seen: set[str] = set()

    def unit(key: str) -> Unit:
        if key not in units:
            units[key] = Unit(key, int(key.split(".")[1]) if key.startswith("layer.") else None)
        return units[key]

    tier = {"engram": engram, "experts": experts}
    for name, key, part in half_tensors(args, list(sizes), req.half):
        if name in seen:
            part = "copies"
        seen.add(name)
        where = tier.get(part, "gpu")
        target = unit(key).parts if where == "gpu" else (host if where == "host" else disk).parts
        target[part] = target.get(part, 0) + sizes[name]
    for key, n in state_bytes(args, req.half, req.context).items():
        u = unit(key).parts
        u["state"] = u.get("state", 0) + n * req.sessions
    order = sorted(units.values(), key=lambda u: (u.key != "embed", u.key == "head", u.layer or 0))
    host.add("reserve", HOST_RESERVE)
    if "engram" in disk.parts:
        host.add("rows", req.engram_cache)
    return order, host, disk


def _largest_expert(sizes: dict[str, int]) -> int:
    """The largest routed expert's bytes (its three projections, weights and scales)."""
    per: dict[str, int] = {}
    for name, n in sizes.items():
        if ".experts." in name:
            key = name.rsplit(".", 2)[0]  # layers.L.ffn.experts.E
            per[key] = per.get(key, 0) + n
    return max(per.values(), default=0)


def _bank(args: ModelArgs, sizes: dict[str, int]) -> int:
    """The largest layer's routed-expert bytes (one layer's bank)."""
    per: dict[int | None, int] = {}
    for name, n in sizes.items():
        part, layer = _part_of(name)
        if part == "experts":
            per[layer] = per.get(layer, 0) + n
    return max(per.values(), default=0)


def _caches(args: ModelArgs, layers: list[int]) -> int:
    """The expert caches a device holding backbone `layers` keeps: one per model half among them, since each
    half's model has its own store a layer range (model/transformer.py; DSpark's stages share the last one)."""
    return len({i >= args.first_decoder_layer for i in layers})


def _place(args: ModelArgs, sizes: dict[str, int], req: Request, engram: str, experts: str) -> Plan:
    units, host, disk = _units(args, sizes, req, engram, experts)
    cpu = req.backend == "cpu"
    caps = (req.host_memory,) if cpu else req.gpu_memory
    ids = req.gpu_ids or range(len(caps))
    gpus = [Device("cpu" if cpu else f"GPU {ids[i]}", c) for i, c in enumerate(caps)]
    cache = 0 if experts == "gpu" else (req.expert_cache or _bank(args, sizes))
    plan = Plan(req, engram, experts, gpus, host, disk, expert_bytes=_largest_expert(sizes))

    def overhead(units: list[Unit]) -> dict[str, int]:
        """What a device holding `units` needs besides them: the workspace, and the expert caches for its
        MoE layers when their experts live elsewhere."""
        layers = [u.layer for u in units if u.layer is not None]
        workspace = (CPU_WORKSPACE if cpu else GPU_WORKSPACE) + index_scratch(args, layers, req.context, req.backend)
        return {"workspace": workspace, "cache": cache * _caches(args, layers)}

    queue = list(units)
    for g in gpus:
        taken: list[Unit] = []
        while queue:
            nxt = taken + [queue[0]]
            if taken and sum(u.size for u in nxt) + sum(overhead(nxt).values()) > g.capacity:
                break
            taken.append(queue.pop(0))
        for u in taken:
            for part, n in u.parts.items():
                g.add(part, n)
        for part, n in (overhead(taken) if taken else {}).items():
            g.add(part, n)
        g.layers = [u.layer for u in taken if u.layer is not None]
    for u in queue:
        for part, n in u.parts.items():
            plan.spill.add(part, n)
    if cpu:  # host memory is the CPU backend's device: what it holds leaves that much less for the host tier
        host.capacity = max(0, req.host_memory - gpus[0].used)
    return plan


def plan(source: Checkpoint | ModelArgs, req: Request) -> Plan:
    """The placement of `req.half` of the model, with its tiers resolved (a parallel layout per rank: the
    module doc; one that does not divide is refused naming the flag). Defaults: on CUDA, Engram in host
    memory when it fits, else on disk; the routed experts on the GPUs when they fit, else in host memory
    when it fits, else on disk. On the CPU backend both stay resident (in host memory, its device). The
    first choice that fits is returned, the experts' tier chosen before Engram's (a token reads megabytes of
    experts, and a few kilobytes of Engram rows); when none fits, the first one tried (its `problem` says
    which flag to change)."""
    args, infos = tensor_infos(source)
    sizes = {name: math.prod(shape) * DTYPE_SIZES[dtype] for name, (dtype, shape) in infos.items()}
    if req.parallel:
        check_layout(args, infos, req)
    elif len(set(req.gpu_ids)) < len(req.gpu_ids):
        raise PlacementError(f"--gpus {','.join(map(str, req.gpu_ids))}: a GPU named twice needs a layout "
                             "(--pp, --tp or --ep) to give each rank its part")
    cpu = req.backend == "cpu"
    engrams = [req.engram] if req.engram else (["gpu"] if cpu else ["host", "disk"])
    experts = [req.experts] if req.experts else (["gpu"] if cpu else ["gpu", "host", "disk"])
    first = None
    for x in experts:
        for e in engrams:
            tried = (_place_ranks(args, infos, sizes, req, e, x) if req.parallel
                     else _place(args, sizes, req, e, x))
            if tried.fits:
                return tried
            first = first or tried
    return first


_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.")


def half_layers(args: ModelArgs, half: str) -> range:
    """The backbone layers a half runs."""
    d = args.first_decoder_layer
    return {"box": range(0, d), "back": range(d, args.n_layers), "all": range(args.n_layers)}[half]


def layer_ranges(layers: range, pp: int) -> list[range]:
    """`layers` cut into `pp` equal consecutive ranges (`--pp`); PlacementError when they do not divide."""
    if pp < 1 or len(layers) % pp:
        raise PlacementError(f"--pp {pp}: the {len(layers)} layers {layers.start}-{layers.stop - 1} do not divide "
                             f"into {pp} equal ranges")
    step = len(layers) // pp
    return [range(start, start + step) for start in range(layers.start, layers.stop, step)]


def _expert_counts(names: list[str]) -> dict[str, int]:
    """Routed experts per family (a layer's or a DSpark stage's `...ffn.experts`)."""
    out: dict[str, int] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            out[m.group(1)] = max(out.get(m.group(1), 0), int(m.group(2)) + 1)
    return out


def check_layout(args: ModelArgs, infos: dict[str, tuple[str, tuple[int, ...]]], req: Request) -> None:
    """PlacementError naming the flag when the layout does not divide the model: the half's layers by --pp,
    the attention heads, o_groups, indexer heads, vocabulary and expert columns by --tp, every family of
    routed experts by --ep."""
    layer_ranges(half_layers(args, req.half), req.pp)
    if req.tp > 1:
        for what, n in (("attention heads", args.n_heads), ("output groups (o_groups)", args.o_groups),
                        ("indexer heads", args.index_n_heads), ("vocabulary entries", args.vocab_size),
                        ("expert intermediate columns", args.moe_inter_dim)):
            if n % req.tp:
                raise PlacementError(f"--tp {req.tp}: the model's {n} {what} do not divide by {req.tp}")
    if req.ep > 1:
        for family, n in _expert_counts(list(infos)).items():
            if n % req.ep:
                raise PlacementError(f"--ep {req.ep}: the {n} routed experts of {family} do not divide by {req.ep}")


def _place_ranks(args: ModelArgs, infos: dict[str, tuple[str, tuple[int, ...]]], sizes: dict[str, int],
                 req: Request, engram: str, experts: str) -> Plan:
    """A parallel layout (module doc): each rank's GPU gets its part of its stage's tensors (an equal part of
    a split one; a routed expert on its rank; anything else on the stage's driver), the driver the stage's
    state, every rank the workspace and the driver (experts off the GPU) the expert cache. A GPU named for
    several ranks (`--gpus 0,0`) holds all of theirs; on the CPU backend every rank is a process of the one
    host."""
    cpu = req.backend == "cpu"
    stages = layer_ranges(half_layers(args, req.half), req.pp)
    layout = Layout(ep=req.ep, tp=req.tp)
    ids = req.gpu_ids or tuple(range(len(req.gpu_memory)))
    devices: dict[int, Device] = {}
    if cpu:
        rank_device = [Device("cpu", req.host_memory)] * req.ranks
    else:
        rank_device = [devices.setdefault(ids[r], Device(f"GPU {ids[r]}", req.gpu_memory[r])) for r in range(req.ranks)]
    gpus = list({id(d): d for d in rank_device}.values())  # each device once, in rank order
    host, disk = Device("host", req.host_memory), Device("disk", None)
    tier = {"engram": engram, "experts": experts}

    def stage_of(key: str) -> int:
        if key == "embed":
            return 0
        if key == "head":
            return req.pp - 1
        layer = int(key.split(".")[1])
        return next(s for s, r in enumerate(stages) if layer in r)

    def rank(stage: int, r: int = 0) -> Device:
        return rank_device[stage * req.world + r]

    def weight_rows(name: str) -> int:
        weight = infos.get(name.rsplit(".", 1)[0] + ".weight")
        return weight[1][0] if weight else 0

    counts = _expert_counts(list(sizes))
    seen: set[str] = set()
    for name, key, part in half_tensors(args, list(sizes), req.half):
        label = "copies" if name in seen else part
        seen.add(name)
        where = tier.get(part, "gpu")
        if where != "gpu":  # the machine's host memory or disk: the whole tensor, once
            (host if where == "host" else disk).add(label, sizes[name])
            continue
        stage, expert = stage_of(key), _EXPERT.match(name)
        if split_by_rows(name, weight_rows(name), args, layout):
            for r in range(req.world):
                rank(stage, r).add(label, sizes[name] // req.world)
        elif expert and req.ep > 1:
            rank(stage, int(expert.group(2)) * req.ep // counts[expert.group(1)]).add(label, sizes[name])
        else:
            rank(stage).add(label, sizes[name])
    for key, n in state_bytes(args, req.half, req.context).items():
        rank(stage_of(key)).add("state", n * req.sessions)
    slot = _largest_expert(sizes)
    # off the GPUs the experts run from a device cache: the driver's, or with --ep each rank's of its range
    # (by default its share of one layer's bank: model/parallel.expert_share)
    cache = 0 if experts == "gpu" else (req.expert_cache or
                                        _bank(args, sizes) * expert_share(args, req.ep) // args.n_routed_experts)
    for s, layers in enumerate(stages):
        for r in range(req.world):
            rank(s, r).add("workspace", CPU_WORKSPACE if cpu else GPU_WORKSPACE)
            rank(s, r).layers = sorted({*rank(s, r).layers, *layers})
            # rank 0 keeps a store a model range (each half's among the stage's layers: `_caches`), an
            # expert-parallel follower one for all of its stage's (model/parallel.follow)
            if r == 0:
                rank(s, r).add("cache", cache * _caches(args, list(layers)))
            elif req.ep > 1:
                rank(s, r).add("cache", cache)
        rank(s).add("workspace", index_scratch(args, list(layers), req.context, req.backend))
    host.add("reserve", HOST_RESERVE)
    if "engram" in disk.parts:
        host.add("rows", req.engram_cache)
    if cpu:
        host.capacity = max(0, req.host_memory - gpus[0].used)
    return Plan(req, engram, experts, gpus, host, disk, expert_bytes=slot)
