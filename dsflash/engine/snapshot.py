"""Session snapshots: a self-describing binary file (format in docs/snapshot-format.md).

    magic "DSFLSNAP" | u32 format version | u32 header length | header JSON | payload

The header names the numerics version (the backend's that computed the state), the model identity, the
token count, the payload size and its SHA-256; the payload is a safetensors blob of the token ids and every
state tensor. Anything that does not match is refused with the reason, before a single tensor is read.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dsflash.model.state import GrowingRows, PositionRing, SequenceState, StatePool
from dsflash.numerics import packing

MAGIC = b"DSFLSNAP"
# 2: a prefill's state holds every row a rollback it allows reaches (model/transformer.tail_rows); a version-1
# snapshot of a prefill lacks the last layers' rows below its last window, so it is refused (the prefix cache
# deletes it and prefills again) rather than re-stepped wrong after a rollback
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sII")


class SnapshotError(ValueError):
    """A snapshot is truncated, corrupted, or made by another model or numerics version."""


# the growing caches, held packed in the model's own FP4 format (numerics/packing.py), are stored as held
_PACKED = {"compressed": ("fp4_e4m3_16", packing.ENTRY), "index_keys": ("fp4_e8m0_32", packing.INDEX_KEY)}


def _cache_format(key: str) -> tuple[str, tuple[int, bool]] | None:
    """(format name, (block, E4M3 scale)) of a packed cache tensor's key ("part/compressed.20"), else None."""
    return _PACKED.get(key.split("/")[-1].split(".")[0]) if "/" in key else None


def _state_tensors(part: str, state: SequenceState) -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {f"{part}/engram_ids": state.engram_ids.rows.clone()}
    for name, table in (("window", state.window), ("raw", state.raw), ("dspark", state.dspark)):
        for k, ring in table.items():
            t[f"{part}/{name}.{k}"] = ring.data
    for name, table in (("compressed", state.compressed), ("index_keys", state.index_keys)):
        for k, rows in table.items():
            t[f"{part}/{name}.{k}"] = rows.rows.clone()
    return t


def encode(states: dict[str, SequenceState], tokens: list[int], model_id: str, numerics: str,
           extras: dict[str, torch.Tensor]) -> bytes:
    """`states`: the session's model states by part name (encoder and decoder halves), computed with the
    numerics version `numerics` (numerics.numerics_version of their device); `extras`: its own tensors (plain
    names), returned as they were by decode."""
    tensors = {}
    for part, state in states.items():
        tensors.update(_state_tensors(part, state))
    tensors.update(extras)
    tensors = {k: v.cpu() for k, v in tensors.items()}
    packed = {}
    for key, t in tensors.items():
        fmt = _cache_format(key)
        if fmt:  # [format, values per row]
            packed[key] = [fmt[0], packing.values_per_row(t.size(1), fmt[1][0])]
    tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)
    payload = st_save({k: v.contiguous() for k, v in tensors.items()})
    header = json.dumps({
        "numerics": numerics,
        "model": model_id,
        "tokens": len(tokens),
        "parts": {part: {"pos": st.pos, "dspark_pos": st.dspark_pos} for part, st in states.items()},
        "payload_bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "sections": {k: v.numel() * v.element_size() for k, v in sorted(tensors.items())},  # bytes each
        "packed": packed,
    }).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload


def read_header(blob: bytes) -> dict:
    if len(blob) < _PREFIX.size:
        raise SnapshotError(f"truncated snapshot: {len(blob)} bytes, shorter than its {_PREFIX.size}-byte prefix")
    magic, version, hlen = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise SnapshotError("not a dsflash snapshot (bad magic)")
    if version != FORMAT_VERSION:
        raise SnapshotError(f"snapshot format version {version}, this build reads {FORMAT_VERSION}")
    try:
        header = json.loads(blob[_PREFIX.size:_PREFIX.size + hlen])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SnapshotError(f"corrupted snapshot header ({e})") from e
    return header


def check(blob: bytes, model_id: str, numerics: str) -> tuple[dict, bytes]:
    """The header and payload of a whole snapshot of `model_id` made with the numerics version `numerics` (the
    reader's backend's): every refusal short of reading tensors (the prefix cache deletes a file that fails
    here)."""
    header = read_header(blob)
    # str: builds before the per-backend versions wrote the CPU's as the number 6, the same arithmetic as "6"
    if str(header.get("numerics")) != numerics:
        raise SnapshotError(f"snapshot made with numerics version {header.get('numerics')}, "
                            f"the loaded model computes version {numerics}")
    if header.get("model") != model_id:
        raise SnapshotError(f"snapshot belongs to model {header.get('model')}, not to the loaded {model_id}")
    start = _PREFIX.size + len(json.dumps(header).encode())
    payload = blob[start:]
    if len(payload) != header.get("payload_bytes"):
        raise SnapshotError(f"truncated snapshot: payload {len(payload)} bytes, header says {header['payload_bytes']}")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise SnapshotError("corrupted snapshot: payload checksum mismatch")
    return header, payload


def decode(blob: bytes, model_id: str, numerics: str, device: torch.device | str = "cpu",
           pools: dict[str, StatePool | None] | None = None
           ) -> tuple[dict[str, SequenceState], list[int], dict[str, torch.Tensor]]:
    """The states by part ("decoder", "encoder"), the tokens and the extras of a snapshot, checked against
    `model_id` and `numerics` (the version of the backend on `device`); a part's state takes its buffers from
    pools[part] when given (a resumed session replays the CUDA graphs of the sessions before it,
    model/state.StatePool)."""
    header, payload = check(blob, model_id, numerics)
    tensors = st_load(payload)
    packed = header.get("packed", {})
    for key, t in tensors.items():
        fmt = _cache_format(key)
        if fmt and (key not in packed or packed[key][0] != fmt[0] or t.dtype != torch.uint8
                    or t.size(1) != packing.packed_width(packed[key][1], fmt[1][0])):
            raise SnapshotError(f"snapshot tensor {key} is not in the {fmt[0]} format this build holds "
                                f"(dtype {t.dtype}, shape {tuple(t.shape)}, header {packed.get(key)})")
    ids = tensors.pop("tokens")
    states = {part: SequenceState(pos=p["pos"], dspark_pos=p["dspark_pos"], device=device,
                                  pool=(pools or {}).get(part))
              for part, p in header["parts"].items()}
    extras = {}
    for key, t in tensors.items():
        if "/" not in key:
            extras[key] = t.to(device)
            continue
        part, field_key = key.split("/")
        state = states[part]
        if field_key == "engram_ids":
            state.engram_ids.append(t.to(device))
            continue
        name, k = field_key.split(".")
        role = (name, int(k))
        if name in ("window", "raw", "dspark"):
            ring = PositionRing(t.size(0), tuple(t.shape[1:]), t.dtype, device, state.pool, role)
            ring.data.copy_(t.to(device))
            getattr(state, name)[int(k)] = ring
        else:
            rows = GrowingRows(tuple(t.shape[1:]), t.dtype, device, state.pool, role)
            rows.append(t.to(device))
            getattr(state, name)[int(k)] = rows
    return states, ids.tolist(), extras
