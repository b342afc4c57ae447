"""JSON mode (OpenAI `response_format: {"type": "json_object"}`): the answer is a JSON object.

A byte-level pushdown automaton (`step`) accepts exactly the prefixes of a JSON object text (RFC 8259:
objects, arrays, strings with escapes, numbers, true/false/null, whitespace); `JsonObject` turns it into
the allowed tokens of each position for the sampler. A token is allowed when all of its bytes keep the
text a valid prefix; EOS only once the object is closed; other special tokens never. Masks are cached by
automaton state, so a state's vocabulary scan is paid once per server, and tokens made only of plain
string bytes are allowed inside strings without a scan. Its state follows emitted tokens only
(`advance`), like `sampling.Forcing`, so speculative decoding stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
# number states after which the number may end
NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})

# a state: (mode, stack) with stack a tuple of "o"/"a" (open objects and arrays), mode a string or, for a
# literal in progress, ("lit", remaining bytes)
State = tuple
START: State = ("start", ())


def _value_start(byte: int, stack: tuple) -> State | None:
    if byte == ord("{"):
        return ("obj_first", stack + ("o",))
    if byte == ord("["):
        return ("arr_first", stack + ("a",))
    if byte == ord('"'):
        return ("str", stack)
    if byte == ord("-"):
        return ("minus", stack)
    if byte == ord("0"):
        return ("zero", stack)
    if byte in DIGITS:
        return ("int", stack)
    if byte in LITERALS:
        return (("lit", LITERALS[byte]), stack)
    return None


def _closed(stack: tuple) -> State:
    """The state after a value ends in `stack`'s innermost container (or at the top)."""
    return ("after", stack) if stack else ("done", stack)


def _close(byte: int, stack: tuple) -> State | None:
    if stack and byte == (ord("}") if stack[-1] == "o" else ord("]")):
        return _closed(stack[:-1])
    return None


# UTF-8 inside strings: a lead byte's sub-mode, then each continuation's byte range and the sub-mode after
# it ("" = back to plain string bytes); e0/ed/f0/f4 exclude overlong forms, surrogates and > U+10FFFF
UTF8_LEADS = [(0xC2, 0xDF, "c1"), (0xE0, 0xE0, "e0"), (0xE1, 0xEC, "c2"), (0xED, 0xED, "ed"), (0xEE, 0xEF, "c2"),
              (0xF0, 0xF0, "f0"), (0xF1, 0xF3, "c3"), (0xF4, 0xF4, "f4")]
UTF8_NEXT = {"c1": (0x80, 0xBF, ""), "c2": (0x80, 0xBF, "c1"), "c3": (0x80, 0xBF, "c2"), "e0": (0xA0, 0xBF, "c1"),
             "ed": (0x80, 0x9F, "c1"), "f0": (0x90, 0xBF, "c2"), "f4": (0x80, 0x8F, "c2")}


def _string(byte: int, mode: str, stack: tuple, end: str) -> State | None:
    """One byte inside a string whose closing quote leads to mode `end`. Sub-modes after the kind ("str" or
    "key"): "" plain, "\\" after a backslash, "uN" N hex digits to go, UTF8_NEXT's continuations."""
    kind, body = mode[:3], mode[3:]
    if body == "":
        if byte == ord('"'):
            return (end, stack) if end != "after" else _closed(stack)
        if byte == ord("\\"):
            return (kind + "\\", stack)
        if byte < 0x20:
            return None
        if byte < 0x80:
            return (mode, stack)
        return next(((kind + sub, stack) for lo, hi, sub in UTF8_LEADS if lo <= byte <= hi), None)
    if body == "\\":
        if byte == ord("u"):
            return (kind + "u4", stack)
        return (kind, stack) if byte in ESCAPES else None
    if body[0] == "u":
        if byte not in HEX:
            return None
        left = int(body[1])
        return (kind, stack) if left == 1 else (f"{kind}u{left - 1}", stack)
    lo, hi, after = UTF8_NEXT[body]
    return (kind + after, stack) if lo <= byte <= hi else None


def step(state: State, byte: int) -> State | None:
    """The automaton's state after `byte`, or None if the text stops being a JSON object prefix."""
    mode, stack = state
    if isinstance(mode, tuple):  # a literal: true / false / null
        rest = mode[1]
        if byte != rest[0]:
            return None
        return ((("lit", rest[1:])), stack) if len(rest) > 1 else _closed(stack)
    if mode.startswith("key"):
        return _string(byte, mode, stack, "colon")
    if mode.startswith("str"):
        return _string(byte, mode, stack, "after")
    if mode in ("minus", "zero", "int", "dot", "frac", "e", "esign", "exp"):
        nxt = _number(mode, byte)
        if nxt is not None:
            return (nxt, stack)
        if mode not in NUMBER_ENDS:
            return None
        return step(_closed(stack), byte)  # the number ended: the byte belongs to what follows
    if byte in WHITESPACE:  # every structural mode allows it
        return state
    if mode == "start":
        return ("obj_first", ("o",)) if byte == ord("{") else None
    if mode == "obj_first":  # after "{": a key or "}"
        return ("key", stack) if byte == ord('"') else _close(byte, stack)
    if mode == "obj_key":  # after "," in an object
        return ("key", stack) if byte == ord('"') else None
    if mode == "colon":
        return ("value", stack) if byte == ord(":") else None
    if mode == "value":
        return _value_start(byte, stack)
    if mode == "arr_first":  # after "[": a value or "]"
        return _value_start(byte, stack) or _close(byte, stack)
    if mode == "after":  # a value ended inside a container
        if byte == ord(","):
            return ("obj_key", stack) if stack[-1] == "o" else ("value", stack)
        return _close(byte, stack)
    return None  # "done": only whitespace (handled above)


def _number(mode: str, byte: int) -> str | None:
    digit = byte in DIGITS
    if mode == "minus":
        return "zero" if byte == ord("0") else "int" if digit else None
    if mode in ("zero", "int"):
        if mode == "int" and digit:
            return "int"
        return "dot" if byte == ord(".") else "e" if byte in b"eE" else None
    if mode == "dot":
        return "frac" if digit else None
    if mode == "frac":
        return "frac" if digit else "e" if byte in b"eE" else None
    if mode == "e":
        return "esign" if byte in b"+-" else "exp" if digit else None
    if mode in ("esign", "exp"):
        return "exp" if digit else None
    return None


def _plain(data: bytes | None) -> bool:
    """Whole UTF-8 characters, none a quote, a backslash or a control character."""
    if not data:
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c >= " " and c not in '"\\' for c in text)


def feed(state: State | None, data: bytes) -> State | None:
    for byte in data:
        if state is None:
            return None
        state = step(state, byte)
    return state


def is_complete(state: State | None) -> bool:
    return state is not None and state[0] == "done"


class JsonObject:
    """Allowed tokens for JSON mode. `token_bytes[i]` is token i's bytes, None for special tokens; `eos`
    ends the answer once the object is closed; with `trigger` (the end of the reasoning) the constraint
    starts after that token. Masks are cached across requests by automaton state (share one `cache`)."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos: int, trigger: int | None = None,
                 cache: dict | None = None):
        self.tokens = token_bytes
        self.eos, self.trigger = eos, trigger
        self.cache = cache if cache is not None else {}
        self.waiting = trigger is not None  # for the trigger: no constraint yet
        self.state: State | None = START
        if "plain" not in self.cache:  # tokens that leave a string's plain state as it was
            self.cache["plain"] = torch.tensor([_plain(b) for b in token_bytes])

    def determined(self, limit: int) -> list[int]:
        return []

    def allowed(self) -> torch.Tensor | None:
        """A bool mask over the vocabulary, or None before the trigger."""
        if self.waiting:
            return None
        if self.state is None:
            raise ValueError("a token outside the JSON grammar was emitted")
        key = ("mask", self.state)
        mask = self.cache.get(key)
        if mask is None:
            mask = self.cache[key] = self._mask(self.state)
        return mask

    def _mask(self, state: State) -> torch.Tensor:
        mode = state[0]
        in_string = isinstance(mode, str) and mode in ("str", "key")
        if in_string:  # plain tokens keep the state; only the others need a scan
            mask = self.cache["plain"].clone()
            todo = (~mask).nonzero().flatten().tolist()
        else:
            mask = torch.zeros(len(self.tokens), dtype=torch.bool)
            todo = range(len(self.tokens))
        for i in todo:
            data = self.tokens[i]
            if data:
                mask[i] = feed(state, data) is not None
        mask[self.eos] = is_complete(state)
        return mask

    def advance(self, token: int) -> None:
        if self.waiting:
            self.waiting = token != self.trigger
            return
        data = self.tokens[token] if token != self.eos else b""
        self.state = feed(self.state, data) if data is not None else None
