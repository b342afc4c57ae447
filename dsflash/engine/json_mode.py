"""JSON mode and structured outputs (OpenAI `response_format` json_object / json_schema): the answer is a
JSON object, optionally one that a JSON schema describes.

A byte-level pushdown automaton (`step`) accepts exactly the prefixes of a JSON object text (RFC 8259:
objects, arrays, strings with escapes, numbers, true/false/null, whitespace); `JsonObject` turns it into
the allowed tokens of each position for the sampler. A token is allowed when all of its bytes keep the
text a valid prefix; EOS only once the object is closed; other special tokens never. Masks are cached by
automaton state, so a state's vocabulary scan is paid once per server, and tokens made only of plain
string bytes are allowed inside strings without a scan. Its state follows emitted tokens only
(`advance`), never drafts, so speculative decoding stays exact.

With a schema (`compile_schema`, a subset: type, properties, required, additionalProperties, items, enum,
const; anything else is refused, never ignored) the automaton's frames carry the schema: an object emits
its declared properties in schema order (optional ones may be skipped, required ones not), values take
their property's type, enum and const values are matched literally, integers have no fraction or exponent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
NUMBER_MODES = frozenset({"minus", "zero", "int", "dot", "frac", "e", "esign", "exp"})
# number states after which the number may end
NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})

# a state: (mode, stack). The stack holds the open containers: "o" / "a" for any JSON, ("o", Node, next
# property index) / ("a", items Node) under a schema. The mode is a string, or a tuple for a literal in
# progress ("lit", remaining bytes), a schema value ("value", Node) or its colon ("colon", Node), enum
# candidates ("enum", candidates, bytes matched) and property-name candidates ("okey", (name, index)..., n)
State = tuple
START: State = ("start", ())
KINDS = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
SCHEMA_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "enum", "const",
                             "title", "description", "default", "examples", "$schema", "$comment"})


class SchemaError(ValueError):
    """A schema outside the supported subset, or malformed."""


@dataclass(frozen=True, eq=False)  # compared by identity: states holding nodes stay cheap to hash
class Node:
    kinds: frozenset
    literals: tuple[bytes, ...] | None = None  # enum / const values, compact JSON
    keys: tuple[bytes, ...] = ()  # declared property names as JSON strings, schema order
    values: tuple[Node, ...] = ()
    required: tuple[bool, ...] = ()
    items: Node | None = None
    open_object: bool = True  # an object with no declared properties: any members


def _compact(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def compile_schema(schema, where: str = "schema") -> Node:
    """The supported subset of JSON Schema as automaton nodes (SchemaError names what is not supported)."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{where}: must be an object")
    unknown = sorted(set(schema) - SCHEMA_KEYWORDS)
    if unknown:
        raise SchemaError(f"{where}: {', '.join(unknown)} not supported")
    literals = None
    if "const" in schema:
        literals = (_compact(schema["const"]),)
    elif "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise SchemaError(f"{where}.enum: must be a non-empty list")
        literals = tuple(dict.fromkeys(_compact(v) for v in schema["enum"]))
    kinds = schema.get("type", sorted(KINDS))
    kinds = [kinds] if isinstance(kinds, str) else kinds
    # checked before the set is made: a number or a nested list is no set of names
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds) \
            or not set(kinds) <= KINDS:
        raise SchemaError(f"{where}.type: {schema.get('type')!r} is not a JSON type or list of them")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise SchemaError(f"{where}.properties: must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required) \
            or not set(required) <= set(props):
        raise SchemaError(f"{where}.required: must list declared properties")
    if not isinstance(schema.get("additionalProperties", False), bool):
        raise SchemaError(f"{where}.additionalProperties: only true or false is supported")
    items = schema.get("items")
    return Node(frozenset(kinds), literals, tuple(_compact(k) for k in props),
                tuple(compile_schema(v, f"{where}.properties.{k}") for k, v in props.items()),
                tuple(k in required for k in props), None if items is None else compile_schema(items, f"{where}.items"),
                not props)


def schema_start(root: Node) -> State:
    if root.kinds != {"object"} or root.literals is not None:
        raise SchemaError("schema: the root must be an object (type: object)")
    return (("value", root), ())


def _frame_kind(frame) -> str:
    return frame if isinstance(frame, str) else frame[0]


def _keys_left(frame) -> tuple:
    """A schema object's property names that may come next, as (JSON name, index): the next ones in schema
    order up to and including the first required one."""
    _, node, pos = frame
    out = []
    for i in range(pos, len(node.keys)):
        out.append((node.keys[i], i))
        if node.required[i]:
            break
    return tuple(out)


def _may_close(frame) -> bool:
    return isinstance(frame, str) or frame[0] == "a" or not any(frame[1].required[frame[2]:])


def _schema_value_start(byte: int, stack: tuple, node: Node) -> State | None:
    if node.literals is not None:
        return _enum(byte, node.literals, 0, stack)
    k = node.kinds
    if byte == ord("{") and "object" in k:
        return ("obj_first", stack + ("o" if node.open_object else ("o", node, 0),))
    if byte == ord("[") and "array" in k:
        return ("arr_first", stack + ("a" if node.items is None else ("a", node.items),))
    if byte == ord('"') and "string" in k:
        return ("str", stack)
    if (byte == ord("-") or byte in DIGITS) and k & {"integer", "number"}:
        state = _value_start(byte, stack)
        return state if "number" in k else ("i:" + state[0], stack)
    if (byte in b"tf" and "boolean" in k) or (byte == ord("n") and "null" in k):
        return _value_start(byte, stack)
    return None


def _enum(byte: int, candidates: tuple[bytes, ...], i: int, stack: tuple) -> State | None:
    """One byte against the enum values still possible after i bytes; a value ends where it is complete
    and the byte cannot continue another one (the byte then belongs to what follows)."""
    nxt = tuple(c for c in candidates if len(c) > i and c[i] == byte)
    if nxt:
        if all(len(c) == i + 1 for c in nxt):
            return _closed(stack)
        return (("enum", nxt, i + 1), stack)
    if any(len(c) == i for c in candidates):
        return step(_closed(stack), byte)
    return None


def _key(byte: int, candidates: tuple, i: int, stack: tuple) -> State | None:
    """One byte of a declared property name (JSON strings: a complete one is never a prefix of another)."""
    nxt = tuple((c, j) for c, j in candidates if len(c) > i and c[i] == byte)
    if not nxt:
        return None
    if len(nxt) == 1 and len(nxt[0][0]) == i + 1:
        _, node, _pos = stack[-1]
        j = nxt[0][1]
        return (("colon", node.values[j]), stack[:-1] + (("o", node, j + 1),))
    return (("okey", nxt, i + 1), stack)


def _key_start(byte: int, stack: tuple) -> State | None:
    frame = stack[-1]
    if isinstance(frame, str):
        return ("key", stack) if byte == ord('"') else None
    return _key(byte, _keys_left(frame), 0, stack)


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
    if stack and byte == (ord("}") if _frame_kind(stack[-1]) == "o" else ord("]")) and _may_close(stack[-1]):
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
    if isinstance(mode, tuple):
        tag = mode[0]
        if tag == "lit":  # true / false / null
            rest = mode[1]
            if byte != rest[0]:
                return None
            return (("lit", rest[1:]), stack) if len(rest) > 1 else _closed(stack)
        if tag == "enum":
            return _enum(byte, mode[1], mode[2], stack)
        if tag == "okey":
            return _key(byte, mode[1], mode[2], stack)
        if byte in WHITESPACE:
            return state
        if tag == "value":
            return _schema_value_start(byte, stack, mode[1])
        return (("value", mode[1]), stack) if byte == ord(":") else None  # "colon"
    if mode.startswith("key"):
        return _string(byte, mode, stack, "colon")
    if mode.startswith("str"):
        return _string(byte, mode, stack, "after")
    integer = mode.startswith("i:")  # an integer: no fraction, no exponent
    number = mode[2:] if integer else mode
    if number in NUMBER_MODES:
        nxt = _number(number, byte)
        if nxt is not None:
            if integer and nxt not in ("zero", "int"):
                return None
            return (("i:" if integer else "") + nxt, stack)
        if number not in NUMBER_ENDS:
            return None
        return step(_closed(stack), byte)  # the number ended: the byte belongs to what follows
    if byte in WHITESPACE:  # every structural mode allows it
        return state
    if mode == "start":
        return ("obj_first", ("o",)) if byte == ord("{") else None
    if mode == "obj_first":  # after "{": a key or "}"
        return _key_start(byte, stack) or _close(byte, stack)
    if mode == "obj_key":  # after "," in an object
        return _key_start(byte, stack)
    if mode == "colon":
        return ("value", stack) if byte == ord(":") else None
    if mode == "value":
        return _value_start(byte, stack)
    top = stack[-1] if stack else None
    items = top[1] if isinstance(top, tuple) and top[0] == "a" else None
    if mode == "arr_first":  # after "[": a value or "]"
        start = _value_start(byte, stack) if items is None else _schema_value_start(byte, stack, items)
        return start or _close(byte, stack)
    if mode == "after":  # a value ended inside a container
        if byte == ord(","):
            if _frame_kind(top) == "a":
                return ("value", stack) if items is None else (("value", items), stack)
            return ("obj_key", stack) if isinstance(top, str) or _keys_left(top) else None
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


def feed(state: State | None, data: bytes, step_fn: Callable[[State, int], State | None] = step) -> State | None:
    for byte in data:
        if state is None:
            return None
        state = step_fn(state, byte)
    return state


def is_complete(state: State | None) -> bool:
    return state is not None and state[0] == "done"


def value_may_end(state: State) -> bool:
    """Whether a top-level value is whole in `state` (a number ends only where the next byte cannot continue
    it: a space after it shows whether it could end here)."""
    after = step(state, ord(" "))
    return after is not None and after[0] == "done"


class Vocab:
    """A vocabulary's token bytes (None: a token no grammar ever allows) and the tables the masks of byte
    automata are built from: the tokens by first byte, and the plain-string tokens."""

    def __init__(self, token_bytes: Sequence[bytes | None]):
        self.tokens = token_bytes
        self.has_bytes = torch.tensor([b is not None for b in token_bytes])
        # tokens that leave a string's plain state as it was
        self.plain = torch.tensor([_plain(b) for b in token_bytes])
        self.by_first: dict[int, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b:
                self.by_first.setdefault(b[0], []).append(i)
        self._without: dict[int, torch.Tensor] = {}

    def without(self, byte: int) -> torch.Tensor:
        """The tokens with bytes none of which is `byte`."""
        if byte not in self._without:
            self._without[byte] = torch.tensor([b is not None and byte not in b for b in self.tokens])
        return self._without[byte]

    def mask(self, state: State, step_fn: Callable[[State, int], State | None],
             keep: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens whose bytes `step_fn` takes from `state`. `keep`: tokens known to be taken (they leave
        the state as it was), so only the others are scanned; without it only the tokens whose first byte
        is taken are."""
        if keep is not None:
            mask = keep.clone()
            todo = (~mask).nonzero().flatten().tolist()
        else:
            mask = torch.zeros(len(self.tokens), dtype=torch.bool)
            todo = [i for byte, ids in self.by_first.items() if step_fn(state, byte) is not None for i in ids]
        for i in todo:
            data = self.tokens[i]
            if data:
                mask[i] = feed(state, data, step_fn) is not None
        return mask


class JsonObject:
    """Allowed tokens for JSON mode. `vocab`: the token bytes (None for special tokens); `eos` ends the answer
    once the object is closed; with `schema` the object follows it. Masks of schema-free states are cached
    across requests (share one `cache`)."""

    def __init__(self, vocab: Vocab, eos: int, cache: dict | None = None, schema: Node | None = None):
        self.vocab, self.eos = vocab, eos
        # a schema's states are its own (nodes are per request): its masks live with this constraint
        self.cache = (cache if cache is not None else {}) if schema is None else {}
        self.state: State | None = START if schema is None else schema_start(schema)

    def determined(self, limit: int) -> list[int]:
        return []

    def allowed(self) -> torch.Tensor:
        """A bool mask over the vocabulary."""
        if self.state is None:
            raise ValueError("a token outside the JSON grammar was emitted")
        mask = self.cache.get(self.state)
        if mask is None:
            mode = self.state[0]
            in_string = isinstance(mode, str) and mode in ("str", "key")  # plain tokens keep the state
            mask = self.vocab.mask(self.state, step, self.vocab.plain if in_string else None)
            mask[self.eos] = is_complete(self.state)
            self.cache[self.state] = mask
        return mask

    def advance(self, token: int) -> None:
        data = self.vocab.tokens[token] if token != self.eos else b""
        self.state = feed(self.state, data) if data is not None else None
