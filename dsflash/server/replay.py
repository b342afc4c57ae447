"""Exact replay of sampled tool calls (ds4's trick): the token ids of each finished reply with tool calls are
kept by call id, and when a client sends that assistant turn back (OpenAI `tool_calls`, Responses
`function_call` items, Anthropic `tool_use` blocks: all reach here as OpenAI-form messages) unchanged, the
prompt carries those ids instead of a re-rendering, so the next turn's tokens extend the last turn's and
the prefix cache serves all of it. A re-rendering differs wherever the model's bytes or token split differ
from the canonical ones (spacing, key order, a word split in two).

The most recent `limit` replies, in memory and, with a prefix-cache directory, in a journal beside its
snapshots (`replays-<model identity>.jsonl`, one reply a line), so a restarted server still replays the calls
its snapshots were made from. The journal is best effort like the snapshots: a failed write is logged once and
the reply kept in memory; a damaged line is skipped; it is rewritten with the kept replies when it holds
twice as many lines. Calls the server no longer knows are re-rendered (a cache miss from there on, never a
wrong prompt).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# private-use characters around a per-process nonce: no client text holds this
_NONCE = secrets.token_hex(8)
REPLAY_MARK = re.compile(f"\ue001{_NONCE}:(\\d+)\ue001")


@dataclass(frozen=True)
class Reply:
    """One sampled assistant turn: its ids (the end token included), whether it was sampled after `<think>`,
    and what the client was told (content, reasoning, the calls by id)."""

    ids: tuple[int, ...]
    thinking: bool
    content: str
    reasoning: str
    calls: tuple[tuple[str, str, Any], ...]  # (call id, name, arguments as parsed JSON)


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n\n".join(str(p.get("text", "")) for p in content)
    return None


def _parsed(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return None


class Replays:
    def __init__(self, limit: int = 4096, journal: Path | None = None):
        """`journal`: the file that keeps the replies across restarts (None: memory only)."""
        self.limit, self.journal = limit, journal
        self._by_call: OrderedDict[str, Reply] = OrderedDict()
        self._lock = threading.Lock()
        self._lines = 0  # lines in the journal
        self._warned = False
        if journal is not None and journal.exists():
            self._load(journal)

    def remember(self, reply: Reply) -> None:
        with self._lock:
            self._keep(reply)
            if self.journal is not None:
                self._write(reply)

    def _keep(self, reply: Reply) -> None:
        for call_id, _, _ in reply.calls:
            self._by_call[call_id] = reply
            self._by_call.move_to_end(call_id)
        while len(self._by_call) > self.limit:
            self._by_call.popitem(last=False)

    def _load(self, journal: Path) -> None:
        try:
            lines = journal.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            log.warning("replay journal %s unreadable (%s): starting without it", journal, e)
            return
        damaged = 0
        for line in lines:
            try:
                d = json.loads(line)
                reply = Reply(tuple(int(t) for t in d["ids"]), bool(d["thinking"]), str(d["content"]),
                              str(d["reasoning"]), tuple((str(c), str(n), a) for c, n, a in d["calls"]))
            except (ValueError, KeyError, TypeError):
                damaged += 1
                continue
            self._keep(reply)
        if damaged:
            log.warning("replay journal %s: %d damaged line(s) skipped", journal, damaged)
        self._lines = len(lines)

    def _write(self, reply: Reply) -> None:
        """Append `reply` to the journal, or rewrite it with the kept replies once it holds twice as many."""
        try:
            if self._lines + 1 > 2 * self.limit:
                kept = list({id(r): r for r in self._by_call.values()}.values())  # each once, oldest first
                tmp = self.journal.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in kept), encoding="utf-8")
                tmp.replace(self.journal)
                self._lines = len(kept)
            else:
                with open(self.journal, "a", encoding="utf-8") as f:
                    f.write(json.dumps(asdict(reply)) + "\n")
                self._lines += 1
        except OSError as e:  # a full or read-only disk: the reply stays in memory
            if not self._warned:
                log.warning("replay journal %s not written (%s): replies kept in memory only", self.journal, e)
                self._warned = True

    def match(self, message: dict) -> Reply | None:
        """The reply an OpenAI-form assistant message is, when it came back unchanged: the same calls (ids,
        names, arguments as JSON values), the same content, and the same reasoning if it carries one."""
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list) or not calls:
            return None
        first = calls[0].get("id") if isinstance(calls[0], dict) else None
        with self._lock:
            reply = self._by_call.get(first) if isinstance(first, str) else None
        if reply is None or len(calls) != len(reply.calls):
            return None
        for call, (call_id, name, args) in zip(calls, reply.calls, strict=True):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or call.get("id") != call_id or fn.get("name") != name \
                    or _parsed(fn.get("arguments")) != args:
                return None
        if (_text(message.get("content")) or "").strip() != reply.content.strip():
            return None
        reasoning = message.get("reasoning_content")
        if reasoning and reasoning.strip() != reply.reasoning.strip():
            return None
        return reply

    def marked(self, messages: Sequence[dict]) -> tuple[dict[int, tuple[bool, str]], list[tuple[int, ...]]]:
        """For `encode_messages(verbatim=...)`: the messages that are replies kept here, each as a mark,
        and the ids the marks stand for (`tokenize` puts them in)."""
        verbatim, ids = {}, []
        for i, message in enumerate(messages):
            reply = self.match(message) if isinstance(message, dict) else None
            if reply is not None:
                verbatim[i] = (reply.thinking, f"\ue001{_NONCE}:{len(ids)}\ue001")
                ids.append(reply.ids)
        return verbatim, ids


def tokenize_with(tokenize: Callable[[str], list[int]], replayed: list[tuple[int, ...]]) -> Callable[[str], list[int]]:
    """`tokenize`, with each replay mark in the text becoming the ids it stands for."""
    def run(text: str) -> list[int]:
        pieces = REPLAY_MARK.split(text)  # text, mark index, text, ...
        out: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                out += replayed[int(piece)]
            elif piece:
                out += tokenize(piece)
        return out

    return run
