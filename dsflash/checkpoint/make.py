"""`dsflash make-checkpoint`: a seeded checkpoint (config.json + model.safetensors + model.manifest.json,
the tensors' hashes) in the official layout, for tests and benchmarks of shapes other than the golden ones.

Weights are drawn in their checkpoint dtypes with the statistics tt-metal's `testing.py` measured on
the released checkpoint (spec §2.3 [TT-TEST] init_weights): with unit norm weights and plain fan-in
scaling the MoE output swamps the small residual, and a synthetic stack becomes far more sensitive to
rounding than the real model. Every tensor has its own generator, seeded from (seed, name), and large
tensors are drawn and written in chunks of rows straight to their place in the file, so a model far
larger than memory can be written.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from dsflash.checkpoint.expect import BF16, E8M0, F8, I8, Expected, expected_tensors
from dsflash.checkpoint.manifest import write_manifest
from dsflash.checkpoint.reader import DTYPE_SIZES, INDEX
from dsflash.config import PRESETS, ConfigError, ModelArgs, preset, validate
from dsflash.numerics import BLOCK
from dsflash.numerics.codecs import E2M1_VALUES, E8M0_BIAS, quantize_fp8_blocks, quantize_fp8_rows

EMBED_RMS = 0.12  # RMS of the released embedding (the real layer-0 input)
# mean of each norm weight by owner (noise: 10% of the mean); every other norm has mean 1
NORM_MEAN = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
             "k_norm": 0.5}
NORM_NOISE = 0.1
# projection std = fan_in^-0.5 x gain, by the projection's own name; others have gain 1
PROJECTION_GAIN = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5,
                   "w2": 1.05}
VECTOR_STD = 0.5  # 1-d tensors other than norms: biases, sinks, mHC base/scale
# random E2M1 codes are uniform over 16 values; their RMS sets the FP4 scales
FP4_CODE_RMS = float(math.sqrt((E2M1_VALUES.astype("float64") ** 2).mean()))
# FP4 scale exponents are jittered uniformly by -1, 0, +1, which multiplies the mean square by this
FP4_JITTER = (-1, 0, 1)
FP4_JITTER_RMS = math.sqrt(sum(4.0**j for j in FP4_JITTER) / len(FP4_JITTER))
CHUNK_VALUES = 1 << 22  # values drawn at once (16 MB of float32)

Piece = tuple[str, int, bytes]  # tensor name, byte offset inside that tensor, bytes


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _owner(name: str) -> tuple[str, str]:
    """'layers.0.attn.wq_a.weight' -> ('layers.0.attn.wq_a', 'wq_a'): the owner's path and own name."""
    owner = name.rpartition(".")[0]
    return owner, owner.rpartition(".")[2]


def _gain(name: str) -> float:
    return PROJECTION_GAIN.get(_owner(name)[1], 1.0)


def _mean_std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """Distribution of a plain (BF16/F32) tensor: value = mean + std * N(0, 1)."""
    owner, own_name = _owner(name)
    if name == "embed.weight" or name.endswith("markov_head.embed.weight"):  # the two embedding tables
        return 0.0, EMBED_RMS
    if name.endswith(".weight") and "norm" in own_name:
        mean = next((m for key, m in NORM_MEAN.items() if owner == key or owner.endswith("." + key)), 1.0)
        return mean, NORM_NOISE * mean
    if len(shape) >= 2:
        return 0.0, shape[-1] ** -0.5 * _gain(name)
    return 0.0, VECTOR_STD


def _row_chunks(rows: int, values_per_row: int, multiple: int = 1) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_VALUES // (values_per_row * multiple)) * multiple
    for start in range(0, rows, step):
        yield start, min(step, rows - start)


def _plain(name: str, dtype: str, shape: tuple[int, ...], gen: torch.Generator) -> Iterator[Piece]:
    mean, std = _mean_std(name, shape)
    torch_dtype = torch.bfloat16 if dtype == BF16 else torch.float32
    row_bytes = math.prod(shape[1:]) * torch_dtype.itemsize
    for start, n in _row_chunks(shape[0], math.prod(shape[1:])):
        values = mean + std * torch.randn(n, *shape[1:], generator=gen)
        yield name, start * row_bytes, _bytes(values.to(torch_dtype))


def _fp8_blocks(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Iterator[Piece]:
    rows, cols = shape
    std = cols**-0.5 * _gain(name)
    scale_name, scale_cols = name[: -len("weight")] + "scale", -(-cols // BLOCK)
    for start, n in _row_chunks(rows, cols, BLOCK):  # whole 32-row tiles per chunk
        codes, scale = quantize_fp8_blocks(torch.randn(n, cols, generator=gen) * std)
        yield name, start * cols, _bytes(codes)
        yield scale_name, start // BLOCK * scale_cols, _bytes(scale)


def _fp8_rows(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Iterator[Piece]:
    rows, dim = shape
    scale_name = name[: -len("weight")] + "scale"
    for start, n in _row_chunks(rows, dim):
        codes, scale = quantize_fp8_rows(torch.randn(n, dim, generator=gen))
        yield name, start * dim, _bytes(codes)
        yield scale_name, start * (dim // BLOCK), _bytes(scale)


def _fp4(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Iterator[Piece]:
    """Random codes (both nibbles) with one power-of-two scale per 32 inputs, drawn directly in the
    checkpoint format (quantising gaussians would take minutes per layer at real widths). The scale
    exponents, jittered by ±1, aim at an RMS of fan_in^-0.5 x gain like the other projections (within
    the factor sqrt(2) a power of two allows); tt-metal's recipe leaves out the jitter's 1.32x."""
    rows, packed = shape
    fan_in = 2 * packed
    target = fan_in**-0.5 * _gain(name)
    exponent = round(math.log2(target / (FP4_CODE_RMS * FP4_JITTER_RMS))) + E8M0_BIAS
    scale_name, scale_cols = name[: -len("weight")] + "scale", fan_in // BLOCK
    for start, n in _row_chunks(rows, packed):
        codes = torch.randint(0, 256, (n, packed), generator=gen, dtype=torch.int32).to(torch.uint8)
        jitter = torch.randint(FP4_JITTER[0], FP4_JITTER[-1] + 1, (n, scale_cols), generator=gen, dtype=torch.int32)
        yield name, start * packed, _bytes(codes)
        yield scale_name, start * scale_cols, _bytes((exponent + jitter).to(torch.uint8))


def _pieces(name: str, dtype: str, shape: tuple[int, ...], seed: int) -> Iterator[Piece]:
    gen = _generator(seed, name)
    if dtype == F8:
        return (_fp8_rows if ".engram.embed." in name else _fp8_blocks)(name, shape, gen)
    if dtype == I8:
        return _fp4(name, shape, gen)
    return _plain(name, dtype, shape, gen)


def _header(expected: Expected) -> tuple[bytes, dict[str, int]]:
    """The safetensors header (tensors laid out in `expected` order) and each tensor's data offset."""
    entries: dict = {"__metadata__": {"format": "pt"}}
    offsets, position = {}, 0
    for name, (dtype, shape) in expected.items():
        size = math.prod(shape) * DTYPE_SIZES[dtype]
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + size]}
        offsets[name] = position
        position += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data area starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw, offsets


def shard_names(n: int) -> list[str]:
    """The file names of an n-shard checkpoint, as Hugging Face names them (one shard: model.safetensors)."""
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _split(expected: Expected, n: int) -> list[Expected]:
    """`expected` cut into n runs of consecutive tensors of about equal bytes; a scale stays in its weight's
    shard (the two are drawn together). Raises ConfigError when there are fewer tensors than shards."""
    units: list[Expected] = []  # a tensor, with the scale right after it when it has one
    for name, info in expected.items():
        if info[0] == E8M0 and units and name[: -len("scale")] + "weight" in units[-1]:
            units[-1][name] = info
        else:
            units.append({name: info})
    if not 1 <= n <= len(units):
        raise ConfigError(f"--shards: expected 1 to {len(units)} (the checkpoint's tensors), got {n}")
    sizes = list(map(_data_bytes, units))
    total, done, shards = sum(sizes), 0, [{}]
    for i, (unit, size) in enumerate(zip(units, sizes, strict=True)):
        # the next shard starts once this one holds its share, or when each unit left must start one
        full = done >= total * len(shards) / n or len(units) - i == n - len(shards)
        if shards[-1] and len(shards) < n and full:
            shards.append({})
        shards[-1].update(unit)
        done += size
    return shards


def _data_bytes(part: Expected) -> int:
    return sum(math.prod(shape) * DTYPE_SIZES[dtype] for dtype, shape in part.values())


def _file_size(part: Expected) -> int:
    return len(_header(part)[0]) + _data_bytes(part)


def split_at_most(expected: Expected, max_bytes: int) -> list[Expected]:
    """`expected` in the fewest `_split` shards whose files (header included) hold at most `max_bytes` each:
    a trained checkpoint's files then each fit a transfer's per-file limit. Raises ConfigError naming the
    tensor whose file alone would be larger."""
    n, parts = max(1, -(-_data_bytes(expected) // max_bytes)), []
    while True:
        try:
            parts = _split(expected, n)
        except ConfigError:  # more shards than weight-and-scale units: one unit a shard was still too large
            break
        if max(map(_file_size, parts)) <= max_bytes:
            return parts
        n += 1
    largest = max(parts, key=_file_size)
    raise ConfigError(f"shard size {max_bytes:,} bytes: tensor {next(iter(largest))!r} alone needs a file of "
                      f"{_file_size(largest):,} bytes")


def write_shards(out: Path, parts: list[Expected], write: Callable[[Path, Expected], None]) -> list[str]:
    """The official layout in `out`: `write(path, part)` for each part into its `shard_names` file, and with
    more than one part the index `model.safetensors.index.json` (total_size, weight_map). Earlier weights in
    `out` are removed first (they would be read as shards of this checkpoint). Returns the file names."""
    names = shard_names(len(parts))
    for old in [out / INDEX, out / "model.safetensors", *out.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    for name, part in zip(names, parts, strict=True):
        write(out / name, part)
    if len(parts) > 1:
        total = sum(map(_data_bytes, parts))
        weight_map = {t: name for name, part in zip(names, parts, strict=True) for t in part}
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                            indent=2) + "\n")
    return names


def _write_shard(path: Path, expected: Expected, seed: int) -> None:
    header, offsets = _header(expected)
    partial = path.with_name(path.name + ".partial")  # renamed when complete: no half-written checkpoint
    with open(partial, "wb") as f:
        f.write(header)
        for name, (dtype, shape) in expected.items():
            if dtype == E8M0:
                continue  # every scale is written together with its weight
            for target, offset, data in _pieces(name, dtype, shape, seed):
                f.seek(len(header) + offsets[target] + offset)
                f.write(data)
    os.replace(partial, path)


def write_tensors(path: Path, expected: Expected, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file of the `tensors` that `expected` names (each already in its stored dtype and
    shape), laid out in `expected` order as the seeded writer lays it out (a trained checkpoint's export,
    dsflash/train/export.py)."""
    header, offsets = _header(expected)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(header)
        for name, (dtype, shape) in expected.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(shape) or t.element_size() != DTYPE_SIZES[dtype]:
                raise ValueError(f"tensor {name!r}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
            f.seek(len(header) + offsets[name])
            f.write(_bytes(t))
    os.replace(partial, path)


def make_checkpoint(args: ModelArgs, seed: int, out_dir: str | Path, shards: int = 1) -> Path:
    """Write `out_dir/config.json` (official spelling) and the weights drawn from `seed`: one
    `model.safetensors`, or with shards > 1 the files `model-0000i-of-0000N.safetensors` and the index
    `model.safetensors.index.json` that the released checkpoint ships. A tensor's bytes depend only on
    (seed, name), so every shard count gives the same tensors. Returns `out_dir`."""
    validate(args)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_shards(out, _split(expected_tensors(args), shards), lambda path, part: _write_shard(path, part, seed))
    (out / "config.json").write_text(json.dumps(args.to_dict(), indent=2) + "\n")
    write_manifest(out, seed)  # for `--verify-weights`, and saying the weights are random
    return out


def make_with_tokenizer(args: ModelArgs, seed: int, out_dir: str | Path, shards: int = 1) -> Path | None:
    """`make_checkpoint` with a tokenizer that fits it, so text works end to end (`generate --prompt`,
    `serve`): the tiny byte-level BPE trained for `args.vocab_size` ids, saved as tokenizer.json, and the
    Engram class count of the config set to the count that tokenizer's compressed-token map gives. Returns
    None (writing nothing) for a vocabulary larger than the tiny corpus supports (the released model's,
    whose tokenizer.json is DeepSeek's)."""
    # deferred: the trainer writes checkpoints with this module on a machine without `tokenizers`
    from dsflash.tokenizer import build_tiny_tokenizer, compressed_token_map

    try:
        tokenizer = build_tiny_tokenizer(args.vocab_size)
    except ValueError:
        return None
    _, classes = compressed_token_map(tokenizer)
    out = make_checkpoint(dataclasses.replace(args, engram_compressed_vocab_size=classes), seed, out_dir, shards)
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def _command(ns: argparse.Namespace) -> int:
    try:
        args = preset(ns.preset, ns.experts)
        out = make_with_tokenizer(args, ns.seed, ns.out, ns.shards)
        note = "with tokenizer.json"
        if out is None:
            out = make_checkpoint(args, ns.seed, ns.out, ns.shards)
            note = (f"no tokenizer.json: a vocabulary of {args.vocab_size:,} ids needs the released tokenizer.json "
                    f"copied in (until then: --prompt-tokens)")
    except ConfigError as e:
        print(f"dsflash make-checkpoint: {e}", file=sys.stderr)
        return 2
    size = sum((out / name).stat().st_size for name in shard_names(ns.shards))
    print(f"wrote {out}: preset {ns.preset}, seed {ns.seed}, {len(expected_tensors(args))} tensors in "
          f"{ns.shards} file(s), {size:,} bytes, {note}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("make-checkpoint", help="write a seeded checkpoint for a preset configuration",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=[*PRESETS, "bench"],
                        help="the configuration: the tiny golden ones, the released model's, or bench (real widths, "
                             "fewer experts)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every tensor's generator")
    parser.add_argument("--out", required=True, type=Path,
                        help="directory for config.json, the weights, model.manifest.json and (tiny presets) "
                             "tokenizer.json")
    parser.add_argument("--shards", type=int, default=1, metavar="N",
                        help="write N shard files and model.safetensors.index.json, as the released checkpoint ships")
    parser.add_argument("--experts", type=int, help="routed experts per layer of the bench preset (default 48)")
    parser.set_defaults(func=_command)
