"""Forced tool calls (OpenAI `tool_choice` required or a named function, Anthropic `any` or a named tool): the
answer is one DSML invoke of a forced tool whose parameters follow the tool's JSON schema, so the arguments
the server's DSML parser builds from it are always a valid JSON object of that schema.

An automaton over the text the chat encoding renders for one call (its `Syntax` handed in by the server,
which owns the DSML strings):

    HEAD NAME NAME_END  (PARAM (BETWEEN PARAM)*)?  INVOKE_END  EOS
    PARAM = PARAM_OPEN KEY FLAG ("true" ATTR_END RAW | "false" ATTR_END JSON) PARAM_CLOSE

The fixed text (tags, names, an enum's strings) is matched in its own tokens (the tokenizer's encoding of
each literal, as the model saw it in training, and as a trie over the candidates, so drafts of its forced
tokens verify for sure); the values are matched by their bytes. A string value (string="true") is any text
that does not end in a part of PARAM_CLOSE, which then follows in its own tokens; any value may also be JSON
(string="false"), which json_mode's automaton takes from the property's schema node. Declared properties
come in schema order, optional ones skippable and required ones not, as json_mode's objects do; a tool whose
parameters declare no properties takes any names. As `JsonObject`, `ToolCall` follows emitted tokens only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsflash.engine.json_mode import (
    KINDS,
    NUMBER_MODES,
    WHITESPACE,
    Node,
    SchemaError,
    State,
    Vocab,
    _keys_left,
    _may_close,
    feed,
    schema_start,
    value_may_end,
)
from dsflash.engine.json_mode import step as json_step

END: State = ("end",)
ANY = Node(KINDS)  # the value of a property no schema describes


@dataclass(frozen=True)
class Syntax:
    """The DSML text around a call's name and parameters (see the module docstring)."""

    head: str  # the separator, the calls block's opening and the invoke's up to its name="
    name_end: str  # closes the invoke tag's name attribute, and its line
    param_open: str  # a parameter tag up to its name="
    flag: str  # between a parameter's name and its string= value
    attr_end: str  # closes a parameter tag's attributes
    param_close: str
    between: str  # between two parameters
    invoke_end: str  # after the last parameter: closes the invoke and the calls block

    def __post_init__(self) -> None:
        close = self.param_close.encode()
        if close[0] in close[1:]:  # a raw value's partial match of the closing tag restarts only at its start
            raise ValueError("the parameter closing tag must not repeat its first byte")
        if not close.startswith(b"<"):  # JSON takes no "<" outside strings: the tag ends a JSON value
            raise ValueError("the parameter closing tag must start with '<'")


def _after(t: int, pos: int) -> State:
    """Stands for `ToolCall._next(t, pos, False)` among a literal's candidates, made when the literal ends."""
    return ("next", t, pos)


def _json_byte(js: State, byte: int) -> State | None:
    """json_mode's step, without whitespace around the value (the encoding writes none there: the tag's
    closing follows the value at once)."""
    mode, stack = js
    if not stack and byte in WHITESPACE:
        outside = mode[0] == "value" if isinstance(mode, tuple) else mode.removeprefix("i:") in NUMBER_MODES | {"done"}
        if outside:
            return None
    return json_step(js, byte)


def parameter_names(name: str, node: Node) -> list[bytes]:
    """A forced tool's declared parameter names as DSML writes them; SchemaError when the tool's name or one
    of them could not be told apart from the tags around it, or its root is not an object."""
    schema_start(node)
    names = [name] + [json.loads(k) for k in node.keys]
    bad = next((n for n in names if not isinstance(n, str) or not n or any(c in n for c in '"<>\n')), None)
    if bad is not None:
        raise SchemaError(f"the name {bad!r} cannot be a DSML name (no quotes, angle brackets or newlines)")
    return [n.encode() for n in names[1:]]


class ToolCall:
    """Allowed tokens for a forced call of one of `tools` ((name, parameters node) pairs; a node from
    json_mode.compile_schema whose root is an object). `vocab`'s bytes must include the DSML marker's;
    `encode` is the tokenizer's (text -> ids, no special tokens added)."""

    def __init__(self, vocab: Vocab, eos: int, syntax: Syntax, tools: list[tuple[str, Node]],
                 encode: Callable[[str], list[int]]):
        if not tools:
            raise ValueError("a forced call needs a tool")
        self.vocab, self.eos, self.encode = vocab, eos, encode
        self.syntax = syntax
        self.close = syntax.param_close.encode()
        self.nodes = [(node, [n.decode() for n in parameter_names(name, node)]) for name, node in tools]
        self.cache: dict = {}  # masks by state (states hold this request's nodes)
        self.state: State | None = self._lits([(syntax.head + name + syntax.name_end, self._next(t, 0, True))
                                               for t, (name, _) in enumerate(tools)])

    # -- the automaton -------------------------------------------------------------------------------------
    def _lits(self, cands: list[tuple[str, State]]) -> State:
        """Matching one of several texts (none a prefix of another) in their tokens, each followed by its state."""
        return ("lit", tuple((tuple(self.encode(text)), after) for text, after in cands), 0)

    def _next(self, t: int, pos: int, first: bool) -> State:
        """After the invoke's name line (`first`) or a parameter of tool `t`, declared properties from `pos` on."""
        x = self.syntax
        lead = x.param_open if first else x.between + x.param_open
        node, names = self.nodes[t]
        cands: list[tuple[str, State]] = []
        if node.open_object:
            cands.append((lead, ("okey", t, False)))
        else:
            for _, j in _keys_left(("o", node, pos)):
                cands += self._values(lead + names[j] + x.flag, node.values[j], t, j + 1)
        if node.open_object or _may_close(("o", node, pos)):
            cands.append((x.invoke_end, END))
        return self._lits(cands)

    def _values(self, head: str, node: Node, t: int, pos: int) -> list[tuple[str, State]]:
        """The ways a parameter's tag may end and its value begin: a JSON value always, raw text when a
        string may fill it (only the enum's strings, whole, when it has literals)."""
        x = self.syntax
        out: list[tuple[str, State]] = [(head + "false" + x.attr_end, ("json", t, pos, (("value", node), ()), 0))]
        if node.literals is None:
            if "string" in node.kinds:
                out.append((head + "true" + x.attr_end, ("raw", t, pos, 0)))
        else:
            strings = [v for v in (json.loads(lit) for lit in node.literals) if isinstance(v, str)]
            out += [(head + "true" + x.attr_end + v + x.param_close, _after(t, pos)) for v in strings
                    if x.param_close not in v]
        return out

    def _closing(self, t: int, pos: int) -> State:
        return self._lits([(self.syntax.param_close, _after(t, pos))])

    def _tail(self, data: bytes, k: int) -> int | None:
        """How much of the closing tag a value's text ends in after `data`, from `k`; None once it holds the
        whole tag (the parser would end the value there: only the tag's own tokens may)."""
        for byte in data:
            k = k + 1 if byte == self.close[k] else int(byte == self.close[0])
            if k == len(self.close):
                return None
        return k

    def _value_mask(self, mask: torch.Tensor, k: int) -> torch.Tensor:
        """`mask` less the tokens that would complete the closing tag inside a value (after `k` bytes of it)."""
        tokens = self.vocab.tokens
        todo = mask & ~self.vocab.without(self.close[0]) if k == 0 else mask
        for i in todo.nonzero().flatten().tolist():
            mask[i] = self._tail(tokens[i], k) is not None
        return mask

    def _key_keeps(self, data: bytes) -> bool:
        return all(byte >= 0x20 and byte not in b'"<>' for byte in data)

    def _advance(self, state: State, token: int) -> State | None:
        tag = state[0]
        if tag == "lit":
            _, cands, i = state
            nxt = tuple((seq, after) for seq, after in cands if seq[i] == token)
            if not nxt:
                return None
            whole = [after for seq, after in nxt if len(seq) == i + 1]
            if not whole:
                return ("lit", nxt, i + 1)
            after = whole[0]
            return self._next(after[1], after[2], False) if after[0] == "next" else after
        data = self.vocab.tokens[token] if token != self.eos else None
        if tag in ("raw", "json", "okey"):
            opener = self._opener(state)
            if opener is not None and any(seq[0] == token for seq, _ in opener[1]):
                return self._advance(opener, token)
        if data is None:
            return None
        if tag in ("raw", "json"):
            k = self._tail(data, state[-1])
            if k is None:
                return None
            if tag == "raw":
                return state[:3] + (k,)
            js = feed(state[3], data, _json_byte)
            return None if js is None else ("json", state[1], state[2], js, k)
        if tag == "okey":
            return ("okey", state[1], True) if self._key_keeps(data) else None
        return None  # END: only EOS

    def _opener(self, state: State) -> State | None:
        """The literal that may start from a value's state: the closing tag (a raw value, a JSON value that
        may end here), or the rest of a parameter tag after an undeclared name."""
        tag = state[0]
        if tag == "raw" or (tag == "json" and value_may_end(state[3])):
            return self._closing(state[1], state[2])
        if tag == "okey" and state[2]:
            return self._lits(self._values(self.syntax.flag, ANY, state[1], 0))
        return None

    # -- the constraint ------------------------------------------------------------------------------------
    def determined(self, limit: int) -> list[int]:
        """The literal's next tokens while only one is possible (forced text: drafts sure to verify)."""
        out, state = [], self.state
        while state is not None and state[0] == "lit" and len(out) < limit:
            nexts = {seq[state[2]] for seq, _ in state[1]}
            if len(nexts) != 1:
                break
            (token,) = nexts
            out.append(token)
            state = self._advance(state, token)
        return out

    def allowed(self) -> list[int] | torch.Tensor:
        state = self.state
        if state is None:
            raise ValueError("a token outside the forced call's grammar was emitted")
        if state[0] == "lit":
            return sorted({seq[state[2]] for seq, _ in state[1]})
        if state == END:
            return [self.eos]
        mask = self.cache.get(state)
        if mask is None:
            tag, tokens = state[0], self.vocab.tokens
            if tag == "json":
                mode = state[3][0]
                in_string = isinstance(mode, str) and mode in ("str", "key")  # plain tokens keep the state
                mask = self._value_mask(self.vocab.mask(state[3], _json_byte, self.vocab.plain if in_string else None),
                                        state[4])
            elif tag == "raw":
                mask = self._value_mask(self.vocab.has_bytes.clone(), state[3])
            else:
                mask = torch.tensor([b is not None and self._key_keeps(b) for b in tokens])
            opener = self._opener(state)
            if opener is not None:
                mask[[seq[0] for seq, _ in opener[1]]] = True
            self.cache[state] = mask
        return mask

    def advance(self, token: int) -> None:
        self.state = None if self.state is None else self._advance(self.state, token)
