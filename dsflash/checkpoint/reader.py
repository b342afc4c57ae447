"""Lazy checkpoint access: safetensors files opened with mmap, tensors read on first use.

Each file's header is parsed and checked here before safetensors opens it, so a truncated or damaged
file is refused with the reason (which byte range, which tensor) rather than a library error code.
`open_checkpoint` also checks every tensor name, dtype and shape against the config (expect.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import safe_open

from dsflash.checkpoint.expect import expected_tensors
from dsflash.config import RUNTIME_FIELDS, ModelArgs, load_config


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or does not match its config; the message says which tensor."""


# bytes per element of every safetensors dtype a checkpoint may hold
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
# a header larger than this is damage, not data (the released checkpoint's headers are a few MB)
MAX_HEADER_BYTES = 1 << 30

TensorInfo = tuple[str, list[int]]  # safetensors dtype string, shape


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header: every tensor's byte range must match its dtype and
    shape, and the ranges must tile the data area exactly (no gap, no overlap, nothing missing)."""
    return read_layout(path)[0]


def read_layout(path: Path) -> tuple[dict[str, TensorInfo], dict[str, tuple[int, int]]]:
    """`read_header`'s tensors, and where each one's bytes lie in the file ([begin, end) file offsets)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: header length field says {n} bytes, but the file has {size - 8} "
                                  "bytes after it (truncated file or damaged header)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)

    tensors: dict[str, TensorInfo] = {}
    ranges = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (isinstance(dtype, str) and all(isinstance(x, int) and x >= 0 for x in [*shape, begin, end])
                  and begin <= end)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {info!r}")
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
        need = math.prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != need:
            raise CheckpointError(f"{path}: tensor {name!r}: {dtype} {shape} needs {need} bytes, "
                                  f"its data_offsets span {end - begin}")
        tensors[name] = (dtype, list(shape))
        ranges.append((begin, end, name))
    data_start = 8 + n

    data_size = size - 8 - n
    position = 0
    for begin, end, name in sorted(ranges):
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else f"leaves a gap of {begin - position} bytes"
            raise CheckpointError(f"{path}: tensor {name!r} at data byte {begin} {what}")
        position = end
    if position > data_size:
        last = max(ranges)[2]
        raise CheckpointError(f"{path}: truncated: tensor data ends at byte {position} (tensor {last!r}), "
                              f"the file holds {data_size} bytes of data")
    if position < data_size:
        raise CheckpointError(f"{path}: {data_size - position} unexpected bytes after the last tensor")
    return tensors, {name: (data_start + begin, data_start + end) for begin, end, name in ranges}


def has_nan(t: torch.Tensor) -> bool:
    """Whether a tensor stored in an 8-bit float format holds a NaN. E4M3 ("fn": no infinities) is NaN at
    S.1111.111, the bytes 0x7F and 0xFF, which are the int8 and the uint8 maximum; an E8M0 scale (a bare
    exponent) at 0xFF. So one or two max-reductions over the stored bytes tell, with no temporary tensor
    (several GB/s on one core): cheap enough for every load. Other dtypes: False."""
    if not t.numel():
        return False
    if t.dtype == torch.float8_e4m3fn:
        return bool(t.view(torch.int8).max() == 127 or t.view(torch.uint8).max() == 255)
    if t.dtype == torch.float8_e8m0fnu:
        return bool(t.view(torch.uint8).max() == 255)
    return False


INDEX = "model.safetensors.index.json"


def _read_index(path: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file name), checked for shape: a damaged index is
    refused naming the field, not trusted to point anywhere."""
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable index ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: no \"weight_map\" object naming each tensor's shard")
    for name, file in weight_map.items():
        if not isinstance(file, str) or "/" in file or file in ("", ".", ".."):
            raise CheckpointError(f"{path}: weight_map[{name!r}] = {file!r}: expected a shard file name")
    return weight_map


class Checkpoint:
    """A checkpoint directory's tensors by name, returned in their stored dtype (FP8 E4M3, E8M0, I8 =
    packed FP4, BF16, F32).

    With `model.safetensors.index.json` (as the released checkpoint ships) its `weight_map` says which
    shard holds each tensor, and every shard's header must list exactly the tensors the index gives it;
    without one, every `*.safetensors` file of the directory is a shard. Headers are read and checked at
    open; a shard is mmapped only at the first `get` of one of its tensors, so a host can open a
    checkpoint whose files together exceed its address space or its memory (a 94 GiB Engram shard)."""

    def __init__(self, path: str | Path, args: ModelArgs | None = None):
        self.path = Path(path)
        self.args = args or load_config(self.path)
        self._files: dict[str, object] = {}  # shard file name -> safe_open handle, opened on first use
        self._lock = threading.Lock()
        self._where: dict[str, str] = {}
        self._info: dict[str, TensorInfo] = {}
        self._range: dict[str, tuple[int, int]] = {}
        index = self.path / INDEX
        if index.exists():
            self._open_indexed(index)
            return
        files = sorted(self.path.glob("*.safetensors"))
        files = [f for f in files if f.name != "golden.safetensors"]
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors weight files")
        for f in files:
            tensors, ranges = read_layout(f)
            for k in tensors:
                if k in self._where:
                    raise CheckpointError(f"tensor {k!r} appears in both {self._where[k]} and {f.name}")
            self._add(f.name, tensors, ranges)

    def _open_indexed(self, index: Path) -> None:
        weight_map = _read_index(index)
        shards: dict[str, set[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(file, set()).add(name)
        for file, listed in sorted(shards.items()):
            f = self.path / file
            if not f.is_file():
                raise CheckpointError(f"{f}: missing shard (the index {INDEX} puts tensor {min(listed)!r} "
                                      f"and {len(listed) - 1} others in it)")
            tensors, ranges = read_layout(f)
            absent = sorted(listed - tensors.keys())
            if absent:
                raise CheckpointError(f"{f}: tensor {absent[0]!r} is not in this shard's header, but {INDEX} "
                                      f"puts it there ({len(absent)} such tensors)")
            unlisted = sorted(tensors.keys() - listed)
            if unlisted:
                elsewhere = weight_map.get(unlisted[0])
                why = f"it names {elsewhere} for it" if elsewhere else "it does not list it"
                raise CheckpointError(f"{f}: tensor {unlisted[0]!r} is in this shard, but {INDEX} {why} "
                                      f"({len(unlisted)} such tensors)")
            self._add(file, tensors, ranges)

    def _add(self, file: str, tensors: dict[str, TensorInfo], ranges: dict[str, tuple[int, int]]) -> None:
        for k, info in tensors.items():
            self._where[k] = file
            self._info[k] = info
            self._range[k] = ranges[k]

    def _shard(self, file: str):
        """The shard's safe_open handle, mmapping it on first use."""
        with self._lock:
            h = self._files.get(file)
            if h is None:
                try:
                    h = self._files[file] = safe_open(str(self.path / file), framework="pt")
                except Exception as e:  # safetensors raises its own error types for what read_header let through
                    raise CheckpointError(f"{self.path / file}: unreadable safetensors file ({e})") from e
            return h

    def opened(self) -> list[str]:
        """The shards mmapped so far (by file name)."""
        return sorted(self._files)

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        try:
            fname = self._where[name]
        except KeyError as e:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}") from e
        shard = self._shard(fname)
        try:
            t = shard.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.path / fname}: tensor {name!r} unreadable ({e})") from e
        if has_nan(t):  # damage that would load, then poison every request
            nan = torch.isnan(t.float()).flatten()
            raise CheckpointError(f"{self.path / fname}: tensor {name!r} holds NaN ({int(nan.sum())} values, the "
                                  f"first at element {int(nan.nonzero()[0])}): the file is damaged")
        return t

    def file_of(self, name: str) -> str:
        return self._where[name]

    def digest(self, name: str) -> str:
        """Hex SHA-256 of the tensor's bytes as the file stores them."""
        begin, end = self._range[name]
        h = hashlib.sha256()
        with open(self.path / self._where[name], "rb") as f:
            f.seek(begin)
            while begin < end:
                chunk = f.read(min(end - begin, 1 << 24))
                if not chunk:
                    raise CheckpointError(f"{self.path / self._where[name]}: truncated inside tensor {name!r}")
                h.update(chunk)
                begin += len(chunk)
        return h.hexdigest()

    def byte_range(self, name: str) -> tuple[Path, int, int]:
        """The file holding a tensor and its bytes' [begin, end) offsets in it (for reads that bypass the
        mmap: Engram rows and routed experts on the disk tier)."""
        try:
            begin, end = self._range[name]
        except KeyError as e:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}") from e
        return self.path / self._where[name], begin, end

    def dtype_shape(self, name: str) -> tuple[str, list[int]]:
        try:
            dtype, shape = self._info[name]
        except KeyError as e:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}") from e
        return dtype, list(shape)


def _describe(info: tuple[str, tuple[int, ...] | list[int]]) -> str:
    return f"{info[0]} {list(info[1])}"


# a mismatch report lists this many problems, then counts the rest
MAX_REPORTED = 20


def validate_checkpoint(ckpt: Checkpoint) -> None:
    """Refuse a checkpoint whose tensors differ from what its config requires: missing, extra,
    mis-typed or mis-shaped tensors are all listed, each with the expected and the actual value."""
    expected = expected_tensors(ckpt.args)
    problems = []
    for name, want in expected.items():
        if not ckpt.has(name):
            problems.append(f"missing tensor {name!r}: expected {_describe(want)}")
            continue
        got = ckpt.dtype_shape(name)
        if (got[0], tuple(got[1])) != want:
            problems.append(f"tensor {name!r}: expected {_describe(want)}, got {_describe(got)}")
    for name in ckpt.names():
        if name not in expected:
            problems.append(f"unexpected tensor {name!r} ({_describe(ckpt.dtype_shape(name))}): "
                            "not part of a checkpoint of this config")
    if problems:
        shown = problems[:MAX_REPORTED]
        if len(problems) > MAX_REPORTED:
            shown.append(f"... and {len(problems) - MAX_REPORTED} more")
        raise CheckpointError(f"{ckpt.path}: checkpoint does not match its config ({len(problems)} problems):\n  "
                              + "\n  ".join(shown))


def open_checkpoint(path: str | Path, args: ModelArgs | None = None) -> Checkpoint:
    """Open a checkpoint directory (config.json unless `args` is given) and validate every tensor."""
    ckpt = Checkpoint(path, args)
    validate_checkpoint(ckpt)
    return ckpt


def model_identity(args: ModelArgs, ckpt: Checkpoint) -> str:
    """Hex SHA-256 of the model config (runtime limits and unknown keys left out) and the tensor index
    (names, dtypes, shapes): two processes agree on it only when they hold the same model layout."""
    # float fields as floats, so that `"rope_theta": 10000` and `10000.0` name the same model
    config = {f.name: float(getattr(args, f.name)) if f.type == "float" else getattr(args, f.name)
              for f in fields(args) if f.name not in (*RUNTIME_FIELDS, "extra")}
    index = [[name, *ckpt.dtype_shape(name)] for name in ckpt.names()]
    blob = json.dumps({"config": config, "tensors": index}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
