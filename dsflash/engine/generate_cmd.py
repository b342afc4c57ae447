"""`dsflash generate`: one prompt, streamed, with timing; the command-line face of the engine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dsflash.checkpoint.builtin import builtin_checkpoint
from dsflash.checkpoint.manifest import verify_weights
from dsflash.engine.images import ImageSpan
from dsflash.engine.placement import add_placement_options, checked_plan, layer_devices, tiers_from
from dsflash.engine.progress import LayerCount, ProgressBar, local_layers
from dsflash.engine.ranks import run_ranked
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import DEFAULT_CHUNK, ContextLengthError, Engine, default_device
from dsflash.engine.spec import DecodeStats, decode
from dsflash.model.parallel import Sharding
from dsflash.model.vision import preprocess_image
from dsflash.split.link import box_half
from dsflash.tokenizer import EOS_ID, load_tokenizer


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        args.model = builtin_checkpoint()
        print(f"dsflash generate: no --model given, using the built-in tiny checkpoint at {args.model}",
              file=sys.stderr)
    return run_ranked(args, args.model, "back" if args.box else "all", lambda parallel: generate(args, parallel))


def generate(args: argparse.Namespace, parallel: Sharding | None) -> int:
    """The command on rank 0 (or alone), the model sharded over `parallel` when given."""
    half = "back" if args.box else "all"
    placed = checked_plan("generate", args, args.model, half)
    if args.verify_weights:
        verify_weights(args.model)
    encoder = box_half(args.box, args.box_token, args.box_deadline) if args.box else None
    loading = LayerCount(local_layers(args.model, args.box is not None), enabled=not args.json)
    engine = Engine.load(args.model, max_context=args.context, encoder=encoder, device=args.device,
                         cuda_graphs=not args.eager, tiers=tiers_from(args, placed), loaded=loading,
                         ranges=layer_devices(args, args.model, half), parallel=parallel)
    loading.close()
    tokenizer, images = None, []
    if args.image and args.prompt is None:
        raise SystemExit("dsflash generate: --image goes with --prompt")
    if args.prompt is not None:
        tokenizer = load_tokenizer(args.model)
        prompt = [0]
        for path in args.image or []:  # each image's span follows BOS, before the text, in the given order
            images.append(ImageSpan(len(prompt), preprocess_image(path, engine.args)))
            prompt += [engine.args.image_token_id] * images[-1].length
        prompt += tokenizer.encode(args.prompt, add_special_tokens=False).ids
    else:
        prompt = json.loads(Path(args.prompt_tokens).read_text())
        if (Path(args.model) / "tokenizer.json").exists():
            tokenizer = load_tokenizer(args.model)
    if len(prompt) + args.n > engine.max_context:  # refused before any of it is computed
        raise ContextLengthError(len(prompt) + args.n, engine.max_context)
    try:
        params = SamplingParams(args.temperature, args.top_p, args.top_k, args.min_p, args.seed,
                                args.presence_penalty, args.frequency_penalty, args.repetition_penalty)
    except ValueError as e:
        raise SystemExit(f"dsflash generate: {e}") from e
    cache = engine.prefix_cache(disk_dir=args.cache_dir) if args.cache_dir else None
    stats = DecodeStats()
    t0 = time.perf_counter()
    progress = ProgressBar("prefill", "tokens", enabled=not args.json)
    session = engine.session()
    synced = session.sync(prompt, images=images, cache=cache, chunk=args.chunk, progress=progress)
    stats.prompt_tokens, stats.cached_tokens, stats.prefill_s = len(prompt), synced.reused, synced.prefill_s
    logits = synced.logits
    progress.close()
    out, text = [], ""
    for tok in decode(session, logits, args.n, params, stop={EOS_ID} if not args.ignore_eos else set(),
                      dspark=args.dspark, stats=stats):
        if not out:
            stats.ttft_s = time.perf_counter() - t0
        out.append(tok)
        if tokenizer is not None:
            new = tokenizer.decode(out, skip_special_tokens=False)
            if not args.json:
                print(new[len(text):], end="", flush=True)
            text = new
        elif not args.json:
            print(tok, end=" ", flush=True)
    session.close()
    report = {"tokens": out, "text": text if tokenizer else None, **stats.as_dict()}
    tiers = engine.tier_stats()
    if tiers:  # e.g. "experts": the expert cache's hits, misses, evictions, bytes read and stall seconds
        report["tiers"] = tiers
    if args.json:
        print(json.dumps(report))
    else:
        drafts = (f" · draft acceptance {stats.accept_rate:.0%} · {stats.tokens_per_cycle:.2f} tokens/cycle"
                  if args.dspark else "")  # plain decoding has no drafts to report
        print(f"\n--\nTTFT {stats.ttft_s * 1000:.0f} ms · prefill {report['prefill_tok_s']:,.0f} tok/s "
              f"({stats.cached_tokens} cached) · decode {report['decode_tok_s']:.1f} tok/s{drafts}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from one prompt, streaming, with timing")
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny checkpoint)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--prompt-tokens", help="JSON array of token ids")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="an image before the --prompt text (repeatable; needs a checkpoint with the vision tower)")
    p.add_argument("-n", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of this mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the likeliest")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from tokens already generated")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence in the generated tokens")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the logits of tokens seen in the prompt or output (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--dspark", type=int, default=0, metavar="K", help="DSpark draft depth limit (0 = off)")
    p.add_argument("--cache-dir", help="prefix-cache directory")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prefill chunk size")
    p.add_argument("--ignore-eos", action="store_true", help="generate all -n tokens, past the end of sentence")
    p.add_argument("--device", default=default_device(), help="cpu or cuda (default: cuda when present)")
    p.add_argument("--eager", action="store_true", help="run every forward eagerly (no CUDA graphs for short steps)")
    p.add_argument("--box", metavar="HOST:PORT", help="run the encoder half on this dsflash box")
    p.add_argument("--box-token", help="the box's shared secret")
    p.add_argument("--box-deadline", type=float, default=60.0, help="seconds to wait for a box that went away")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--verify-weights", action="store_true",
                   help="check every tensor against the checkpoint's model.manifest.json before loading")
    add_placement_options(p)
    p.set_defaults(func=run)
