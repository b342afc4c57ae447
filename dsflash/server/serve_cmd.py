"""`dsflash serve`: the OpenAI/Anthropic-compatible HTTP server (see `dsflash.server.app`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from dsflash.engine.placement import add_placement_options, size_arg
from dsflash.server import MAX_BODY, MAX_QUEUE, REQUEST_TIMEOUT_S, SHUTDOWN_TIMEOUT_S

if TYPE_CHECKING:
    from dsflash.model.parallel import Sharding


def run(args: argparse.Namespace) -> int:
    from dsflash.engine.ranks import run_ranked
    from dsflash.engine.session import default_device

    model = args.model
    if model is None:
        from dsflash.checkpoint.builtin import builtin_checkpoint

        model = builtin_checkpoint()
        print(f"dsflash serve: no --model given, using the built-in tiny checkpoint at {model}", file=sys.stderr)
    args.device = args.device or default_device()
    return run_ranked(args, model, "back" if args.box else "all", lambda parallel: _serve(args, model, parallel))


def _serve(args: argparse.Namespace, model: str, parallel: Sharding | None) -> int:
    """The server on rank 0 (or alone), the model sharded over `parallel` when given."""
    from dsflash.checkpoint.manifest import thinks, verify_weights
    from dsflash.engine.placement import checked_plan, layer_devices, tiers_from
    from dsflash.engine.progress import LayerCount, local_layers
    from dsflash.engine.session import DEFAULT_CHUNK, Engine
    from dsflash.server.app import create_app
    from dsflash.server.limits import serve
    from dsflash.split.link import box_half
    from dsflash.tokenizer import load_tokenizer

    half = "back" if args.box else "all"
    placed = checked_plan("serve", args, model, half)  # before any tensor is read
    if args.verify_weights:
        verify_weights(model)  # damaged or mismatched weights: cli.main says which tensor, serves nothing
    encoder = box_half(args.box, args.box_token, args.box_deadline) if args.box else None
    loading = LayerCount(local_layers(model, args.box is not None))
    engine = Engine.load(model, max_context=args.max_context, encoder=encoder, device=args.device,
                         cuda_graphs=not args.eager, tiers=tiers_from(args, placed), loaded=loading,
                         ranges=layer_devices(args, model, half), parallel=parallel)
    loading.close()
    tokenizer = load_tokenizer(model)
    cache = engine.prefix_cache(disk_dir=args.cache_dir) if args.cache_dir else None
    name = args.served_model_name or "deepseek-v4.1-flash"
    api_key = args.api_key or os.environ.get("DSFLASH_API_KEY")
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"dsflash serve: listening on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    thinking = {"on": True, "off": False}.get(args.thinking, thinks(model))
    app = create_app(engine, tokenizer, cache=cache, model_name=name, dspark=args.dspark, api_key=api_key,
                     thinking=thinking, chunk=args.chunk or DEFAULT_CHUNK, max_body=args.max_body,
                     request_timeout=args.request_timeout, max_queue=args.max_queue)
    serve(app, args.host, args.port, args.log_level, args.request_timeout, args.shutdown_timeout)
    return 0


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a count (0, 1, 2, ...): {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over HTTP (OpenAI and Anthropic APIs)")
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--api-key",
                   help="require this key on all but /health and /metrics (default: $DSFLASH_API_KEY, else none)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--cache-dir", help="prefix-cache directory (default: RAM only)")
    p.add_argument("--dspark", type=int, default=0, metavar="K", help="DSpark draft depth limit (0 = off)")
    p.add_argument("--max-context", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--served-model-name", default=None,
                   help="model ids the API answers to, comma-separated; the first is reported "
                        "(default: deepseek-v4.1-flash)")
    p.add_argument("--thinking", choices=("auto", "on", "off"), default="auto",
                   help="whether requests that do not say reason; auto: on, except for a checkpoint that never "
                        "learnt to (seeded random weights, a model trained by `dsflash train`: its manifest says)")
    p.add_argument("--chunk", type=int, default=None, metavar="N",
                   help="prefill chunk in tokens: the prefix cache's snapshot grid and the progress events' step "
                        "(default: 8192)")
    p.add_argument("--log-level", default="info", help="uvicorn log level: critical, error, warning, info, debug")
    p.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    p.add_argument("--eager", action="store_true", help="run every forward eagerly (no CUDA graphs for short steps)")
    p.add_argument("--box", metavar="HOST:PORT", help="run the encoder half on this dsflash box")
    p.add_argument("--box-token", help="the box's shared secret")
    p.add_argument("--box-deadline", type=float, default=60.0,
                   help="seconds to wait for a box that went away before answering 503")
    p.add_argument("--verify-weights", action="store_true",
                   help="check every tensor against the checkpoint's model.manifest.json before loading")
    p.add_argument("--max-body", type=size_arg, default=MAX_BODY, metavar="SIZE",
                   help=f"largest request body, e.g. 16MiB, 512KiB (413 past it; default {MAX_BODY // 1024 ** 2}MiB)")
    p.add_argument("--max-queue", type=_count, default=MAX_QUEUE, metavar="N",
                   help="generation requests that may wait beyond the running ones (503 + Retry-After past it; "
                        f"default {MAX_QUEUE})")
    p.add_argument("--request-timeout", type=_seconds, default=REQUEST_TIMEOUT_S, metavar="S",
                   help="seconds for a request's headers, and then its body, to arrive (closed / 408 past it; "
                        f"default {REQUEST_TIMEOUT_S:g})")
    p.add_argument("--shutdown-timeout", type=_seconds, default=SHUTDOWN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM, seconds running generations may finish before they are ended "
                        f"(streams get their finish reason and [DONE]; default {SHUTDOWN_TIMEOUT_S:g})")
    add_placement_options(p, context=False)
    p.set_defaults(func=run)
