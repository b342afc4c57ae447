"""The link protocol between the back side and the box (docs/link-protocol.md).

Every frame: a 16-byte little-endian header, then the payload.

    magic b"DSFL" | u16 version | u8 type | u8 flags | u32 request id | u32 payload length

A payload is `u32 meta length | meta (UTF-8 JSON object) | body (raw little-endian tensor bytes)`.
The meta says what the body holds; a body whose length differs from what the meta implies is a
malformed frame. Frames over the negotiated maximum are refused before their payload is read.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum

import torch

MAGIC = b"DSFL"
# 3: the back side PINGs while connected (the box closes silent connections), WELCOME carries the box's
# idle_timeout and max_context; 2: the layer-20 cache rows are always packed (no `packed` flag)
VERSION = 3
HEADER = struct.Struct("<4sHBBII")
MAX_FRAME = 256 << 20  # a 1M-token prompt is 4 MiB of int32; a prefill part of 8K rows ~0.3 GiB at most


class FrameType(IntEnum):
    HELLO = 1  # back -> box: {protocol, token, identity, numerics}
    WELCOME = 2  # box -> back: {identity, numerics, version}
    ERROR = 3  # either way: {code, retryable, message}
    APPEND = 4  # back -> box: {session, keep, chunk, tail} + int32 tokens
    PART = 5  # box -> back: one chunk's hand-off {session, start, n_rows, hand_start, n_hand, done, total, last}
    CLOSE = 6  # back -> box: {session}
    SYNC = 7  # back -> box: {session} + int32 tokens: make the box's state equal to these tokens
    SYNCED = 8  # box -> back: {session, pos, cached}
    PING = 9
    PONG = 10


class ProtocolError(ValueError):
    """A malformed frame: the connection that sent it is closed."""


@dataclass
class Frame:
    type: FrameType
    request: int
    meta: dict = field(default_factory=dict)
    body: bytes = b""

    def encode(self) -> bytes:
        meta = json.dumps(self.meta, separators=(",", ":")).encode()
        payload = struct.pack("<I", len(meta)) + meta + self.body
        return HEADER.pack(MAGIC, VERSION, int(self.type), 0, self.request, len(payload)) + payload


def _recv(sock: socket.socket, n: int, timeout: float | None, until: float | None, what: str) -> bytes:
    """Up to `n` bytes; each read waits at most `timeout` s and never past the monotonic time `until`
    (both None: as the socket is set)."""
    if until is not None:
        left = until - time.monotonic()
        timeout = left if timeout is None else min(timeout, left)
        if timeout <= 0:
            raise TimeoutError(f"{what} (over the deadline)")
    if timeout is not None or until is not None:
        sock.settimeout(timeout)
    try:
        chunk = sock.recv(min(n, 1 << 20))
    except TimeoutError:
        raise TimeoutError(f"{what} (no byte for {sock.gettimeout():.1f} s)") from None
    if not chunk:
        raise ConnectionError("connection closed")
    return chunk


def _recv_exact(sock: socket.socket, n: int, timeout: float | None, until: float | None, what: str,
                buf: bytes = b"") -> bytes:
    buf = bytearray(buf)
    while len(buf) < n:
        buf += _recv(sock, n - len(buf), timeout, until, what)
    return bytes(buf)


def read_frame(sock: socket.socket, max_frame: int = MAX_FRAME, *, wait: float | None = None,
               stall: float | None = None, until: float | None = None) -> Frame:
    """The next frame. `wait`: seconds to wait for it to begin; `stall`: seconds any later read of it may
    wait for bytes, so a peer that announces a frame and sends less cannot hold the reader; `until`: a
    monotonic time by which the whole frame must be in. Running out raises TimeoutError; None leaves
    the socket's own timeout in force."""
    first = _recv(sock, HEADER.size, wait, until, "no frame began")
    head = _recv_exact(sock, HEADER.size, stall, until, "frame header stalled", first)
    magic, version, ftype, _flags, request, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError("bad magic: not a dsflash link frame")
    if version != VERSION:
        raise ProtocolError(f"link protocol version {version}, this side speaks {VERSION}")
    try:
        ftype = FrameType(ftype)
    except ValueError as e:
        raise ProtocolError(f"unknown frame type {ftype}") from e
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the {max_frame}-byte limit")
    payload = _recv_exact(sock, length, stall, until, f"frame payload of {length} bytes stalled")
    if length < 4:
        raise ProtocolError("payload shorter than its meta length field")
    (mlen,) = struct.unpack_from("<I", payload)
    if mlen > length - 4:
        raise ProtocolError("meta length exceeds the payload")
    try:
        meta = json.loads(payload[4:4 + mlen])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"meta is not JSON ({e})") from e
    except RecursionError:  # the payload limit allows tens of thousands of nested brackets
        raise ProtocolError("meta nests too deeply") from None
    if not isinstance(meta, dict):
        raise ProtocolError("meta is not a JSON object")
    return Frame(ftype, request, meta, payload[4 + mlen:])


def field_of(meta: dict, name: str, kind: type, minimum: int | None = None):
    """A required meta field of the given type, else ProtocolError naming it."""
    v = meta.get(name)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise ProtocolError(f"meta field {name!r} must be {kind.__name__}, got {v!r}")
    if minimum is not None and v < minimum:
        raise ProtocolError(f"meta field {name!r} must be >= {minimum}, got {v}")
    return v


def tokens_body(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def body_tokens(body: bytes) -> list[int]:
    if len(body) % 4:
        raise ProtocolError("token body is not a whole number of int32")
    return list(struct.unpack(f"<{len(body) // 4}i", body))


def tensors_body(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def body_tensors(body: bytes, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Split a body into tensors of the given shapes and dtypes; its length must match exactly."""
    sizes = [torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size() for shape, dt in specs]
    if sum(sizes) != len(body):
        raise ProtocolError(f"body of {len(body)} bytes, its meta implies {sum(sizes)}")
    out, at = [], 0
    for (shape, dt), size in zip(specs, sizes, strict=True):
        raw = torch.empty(0, dtype=torch.uint8)
        if size:
            raw = torch.frombuffer(bytearray(body[at:at + size]), dtype=torch.uint8)
        out.append(raw.view(dt).reshape(shape))
        at += size
    return out


def error_frame(request: int, code: str, message: str, retryable: bool) -> Frame:
    return Frame(FrameType.ERROR, request, {"code": code, "retryable": retryable, "message": message})


def images_body(spans) -> tuple[list[dict], bytes]:
    """APPEND/SYNC image payload: per span its start and grids in the meta, its bf16 pixels in the body
    (after the int32 tokens)."""
    meta = [{"start": s.start, "grid": [s.image.n_vit_h, s.image.n_vit_w, s.image.n_llm_h, s.image.n_llm_w]}
            for s in spans]
    return meta, tensors_body([s.image.pixels.to(torch.bfloat16) for s in spans])


def token_count(meta: dict, body: bytes) -> int:
    """How many token ids an APPEND/SYNC carries, from its meta and body length alone (before parsing)."""
    return field_of(meta, "n_tokens", int, 0) if meta.get("images") else len(body) // 4


def tokens_and_images(meta: dict, body: bytes, patch: int, ratio: int) -> tuple[list[int], list]:
    """Split an APPEND/SYNC body into token ids and image spans (ProtocolError if they disagree)."""
    from dsflash.engine.images import ImageSpan
    from dsflash.model.vision import ImageInput, llm_grid

    images = meta.get("images") or []
    if not images:
        return body_tokens(body), []
    if not isinstance(images, list):
        raise ProtocolError("meta field 'images' must be a list")
    n = token_count(meta, body)
    ids = body_tokens(body[:4 * n])
    specs, starts = [], []
    for i, im in enumerate(images):
        grid = im.get("grid") if isinstance(im, dict) else None
        if not (isinstance(grid, list) and len(grid) == 4 and all(isinstance(g, int) and g > 0 for g in grid)):
            raise ProtocolError(f"images[{i}].grid must be four positive integers")
        if tuple(grid[2:]) != llm_grid(grid[0], grid[1], ratio):
            raise ProtocolError(f"images[{i}].grid: aligner grid {grid[2:]} does not follow from {grid[:2]}")
        starts.append(field_of(im, "start", int, 0))
        specs.append(((grid[0] * grid[1], 3, patch, patch), torch.bfloat16))
    pixels = body_tensors(body[4 * n:], specs)
    return ids, [ImageSpan(start, ImageInput(px, *im["grid"]))
                 for start, px, im in zip(starts, pixels, images, strict=True)]
