"""`dsflash chat`: a small terminal client for a running `dsflash serve` (streams replies, keeps the
conversation so the server's prefix cache resumes each turn)."""

from __future__ import annotations

import argparse
import json
import sys

DIM, RESET = "\033[2m", "\033[0m"


def stream_reply(url: str, messages: list[dict], args: argparse.Namespace, out) -> str:
    import httpx

    body = {"messages": messages, "stream": True, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "chat_template_kwargs": {"thinking": args.think}}
    reply = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"server answered {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "server error"))
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("reasoning_content"):
                    out.write(DIM + delta["reasoning_content"] + RESET)
                if delta.get("content"):
                    out.write(delta["content"])
                    reply.append(delta["content"])
                out.flush()
    out.write("\n")
    return "".join(reply)


def run(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            messages.append({"role": "assistant", "content": stream_reply(args.url, messages, args, sys.stdout)})
        except Exception as e:  # the conversation survives a failed turn (e.g. the box is down: 503)
            messages.pop()
            print(f"error: {e}", file=sys.stderr)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal with a running dsflash serve")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--think", action="store_true", help="thinking mode (reasoning shown dimmed)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.set_defaults(func=run)
