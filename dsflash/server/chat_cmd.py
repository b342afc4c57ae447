"""`dsflash chat`: a small terminal client for a running `dsflash serve` (streams replies, keeps the
conversation so the server's prefix cache resumes each turn). While the server prefills it shows the
prefill's progress; Ctrl-C stops a reply and keeps the conversation, Ctrl-C at the prompt ends the chat."""

from __future__ import annotations

import argparse
import json
import os
import sys

DIM, RESET, CLEAR = "\033[2m", "\033[0m", "\r\033[K"


class Waiting:
    """A dim status line until the first text of a reply: 'waiting', then the prefill's progress."""

    def __init__(self, out, enabled: bool):
        self.out, self.shown = out, enabled
        self.show("waiting for the server...")

    def show(self, text: str) -> None:
        if self.shown:
            self.out.write(f"{CLEAR}{DIM}{text}{RESET}")
            self.out.flush()

    def clear(self) -> None:
        if self.shown:
            self.out.write(CLEAR)
            self.shown = False


def stream_reply(url: str, messages: list[dict], args: argparse.Namespace, out, reply: list[str]) -> None:
    """Stream one reply to `out`, its text appended to `reply` as it comes (so an interrupted reply keeps
    what was shown)."""
    import httpx

    body = {"messages": messages, "stream": True, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "chat_template_kwargs": {"thinking": args.think},
            "return_progress": True}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    waiting = Waiting(out, out.isatty())
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                r.read()
                try:
                    message = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = r.text
                raise ChatError(f"the server answered {r.status_code}: {message}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ChatError(chunk["error"].get("message", "server error"))
                if "prompt_progress" in chunk:
                    p = chunk["prompt_progress"]
                    waiting.show(f"prefill {p['processed']}/{p['total']} tokens")
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("reasoning_content") or delta.get("content"):
                        waiting.clear()
                    if delta.get("reasoning_content"):
                        out.write(DIM + delta["reasoning_content"] + RESET)
                    if delta.get("content"):
                        out.write(delta["content"])
                        reply.append(delta["content"])
                    out.flush()
    finally:
        waiting.clear()
        out.write("\n")


class ChatError(Exception):
    """A turn the server refused or failed (the chat goes on)."""


def run(args: argparse.Namespace) -> int:
    import httpx

    args.api_key = args.api_key or os.environ.get("DSFLASH_API_KEY")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    failed = False
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # at the prompt: the end of the chat
            print(file=sys.stderr)
            return 130
        if not line or line.strip() in ("/exit", "/quit"):
            return 1 if failed else 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply: list[str] = []
        try:
            stream_reply(args.url, messages, args, sys.stdout, reply)
        except KeyboardInterrupt:  # the reply stops; the conversation keeps what was shown of it
            print("(stopped)", file=sys.stderr)
        except httpx.TransportError as e:  # nothing to talk to: the chat cannot go on
            print(f"dsflash chat: cannot reach the server at {args.url} ({e})", file=sys.stderr)
            return 1
        except ChatError as e:  # the conversation survives a refused turn (e.g. the box is down: 503)
            messages.pop()
            failed = True
            print(f"dsflash chat: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": "".join(reply)})


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal with a running dsflash serve")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--api-key", help="the server's --api-key (default: $DSFLASH_API_KEY)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--think", action="store_true", help="thinking mode (reasoning shown dimmed)")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens of a reply")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    p.set_defaults(func=run)
