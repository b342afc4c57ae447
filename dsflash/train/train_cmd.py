"""`dsflash train-data` and `dsflash train`: build the training text and tokenizer (here, with network access
and `tokenizers`), then train the model and save it as a checkpoint directory `dsflash generate --model`
loads (on the H200: `python3 -m dsflash.train.train_cmd --data DIR --out DIR`, no `tokenizers` needed)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

from dsflash.checkpoint.reader import Checkpoint
from dsflash.engine.placement import size_arg
from dsflash.train import data
from dsflash.train.backend import Masters
from dsflash.train.export import SHARD_BYTES, export_weights
from dsflash.train.loop import (
    DSPARK_LABELS,
    REPEAT_VOCAB_GROWTH,
    REPEAT_VOCAB_LEARNT,
    REPEAT_VOCAB_STEPS,
    Plan,
    Trainer,
    smoke_args,
    summary,
    trained_args,
    write_json,
)
from dsflash.train.plot import write_csv, write_png

SAVE_RESERVE_S = 45.0  # of the budget, kept for the test NLL, the export and the curves


def export_dir(masters: Masters, args, data_dir: Path, out: Path, shard_bytes: int) -> Path:
    """The checkpoint (export.py's layout, shards of at most `shard_bytes`) with the data's tokenizer.json copied
    in, not parsed."""
    ckpt = export_weights(masters, args, out, shard_bytes)
    shutil.copyfile(data_dir / "tokenizer.json", ckpt / "tokenizer.json")
    return ckpt


def run(ns: argparse.Namespace) -> int:
    """One training run; with `--ranks N` (N > 1), N data-parallel processes of it (`Ranks`), rank 0 saving."""
    if ns.ranks > 1 and not dist.is_initialized():
        with socket.socket() as s:  # a free port for the ranks' rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # this process's CPU threads shared out (on the CPU a GEMM's bits depend on its thread count)
        threads = max(1, torch.get_num_threads() // ns.ranks)
        torch.multiprocessing.spawn(_rank, args=(ns, port, threads), nprocs=ns.ranks)
        return 0
    return _train(ns)


def _rank(rank: int, ns: argparse.Namespace, port: int, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ns.ranks)
    try:
        _train(ns)
    finally:
        dist.destroy_process_group()


def _train(ns: argparse.Namespace) -> int:
    t0 = time.monotonic()
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and dist.is_initialized():  # a rank's own GPU, where there are several
        device = f"cuda:{dist.get_rank() % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    if torch.device(device).type == "cuda":
        # reproducible from the seed: cuBLAS's fixed workspace, and deterministic kernels where torch has them
        # (it warns for the ones it lacks rather than stopping a budgeted run)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    token_map, classes = data.load_engram_map(ns.data)
    make_args = smoke_args if ns.smoke else trained_args
    args = Checkpoint(ns.init).args if ns.init else make_args(len(token_map), classes)
    plan = Plan(seq_len=ns.seq_len, budget_s=ns.budget - SAVE_RESERVE_S, steps=ns.steps, dspark_steps=ns.dspark_steps,
                seed=ns.seed, eval_every=ns.eval_every, eval_windows=ns.eval_windows, lr=ns.lr,
                dspark_lr=ns.lr if ns.dspark_lr is None else ns.dspark_lr, anchors=ns.anchors,
                dspark_labels=ns.dspark_labels, dspark_share=ns.dspark_share, fact_span=ns.fact_span,
                index_rows=ns.index_rows, index_weight=ns.index_weight, attention_picks=ns.attention_picks,
                answer_weight=ns.answer_weight, repeat_share=ns.repeat_share, repeat_reach=ns.repeat_reach,
                repeat_ids=ns.repeat_ids, repeat_vocab=ns.repeat_vocab, copy_warmup=ns.copy_warmup,
                batch=ns.batch, graphs=not ns.eager)
    trainer = Trainer(args, token_map, data.load_tokens(ns.data, "train"), data.load_tokens(ns.data, "validation"),
                      plan, device, data.load_facts(ns.data), ns.init)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    end = t0 + plan.budget_s
    backbone_end = end - plan.dspark_share * (end - time.monotonic())
    steps = trainer.backbone(backbone_end)
    dspark_steps = trainer.dspark(end)
    if trainer.ranks.rank != 0:  # rank 0 holds the same masters and saves them
        return 0
    test = torch.from_numpy(data.load_tokens(ns.data, "test").astype("int64"))
    result = summary(trainer, steps, dspark_steps, time.monotonic() - t0)
    if ns.init:  # the run this one went on from, as its train.json says (shipped checkpoints keep it inside)
        earlier = next((p for p in (ns.init / "train.json", ns.init.parent / "train.json") if p.is_file()), None)
        result["continued_from"] = json.loads(earlier.read_text()) if earlier else str(ns.init)
    result["validation_nll"] = trainer.nll(trainer.validation, plan.eval_windows)
    result["test_nll"] = trainer.nll(test, plan.eval_windows)
    ckpt = export_dir(trainer.masters, args, Path(ns.data), out / "checkpoint", ns.shard_size)
    write_csv(trainer.log.rows, out / "loss.csv")
    write_png(trainer.log.rows, out / "loss.png")
    result["total_seconds"] = round(time.monotonic() - t0, 1)
    write_json(out / "train.json", result)
    print(f"wrote {ckpt}: {result['parameters']:,} parameters, {steps} backbone + {dspark_steps} DSpark steps, "
          f"validation NLL {result['validation_nll']:.3f}, test NLL {result['test_nll']:.3f} nats/token, "
          f"{result['total_seconds']} s")
    return 0


def prepare(ns: argparse.Namespace) -> int:
    from dsflash.train import vocab

    manifest = data.build(Path(ns.out))
    info = vocab.build(Path(ns.out), ns.vocab_size, ns.seed)
    print(f"wrote {ns.out}: {sum(s['documents'] for s in manifest['splits'].values())} documents, "
          f"{info['splits']['train']['tokens']:,} train tokens, {info['engram_classes']} Engram classes")
    return 0


def quality(ns: argparse.Namespace) -> int:
    from dsflash.train.quality import report

    result = report(ns.model, ns.data, ns.device or "cpu", ns.seq_len, ns.windows, ns.needle_distance)
    print(json.dumps(result, indent=2))
    return 0


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, type=Path, help="the directory `dsflash train-data` wrote")
    parser.add_argument("--out", required=True, type=Path,
                        help="where checkpoint/, loss.csv, loss.png and train.json go")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="wall-clock seconds for the whole run; training stops in time to save")
    # the model's max_seq_len: the most tokens a step (eager, 3.3x the tokens/s of 4096), 19 GiB peak on the H200
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per training step")
    parser.add_argument("--steps", type=int, help="backbone steps (default: as many as the budget allows)")
    parser.add_argument("--dspark-steps", type=int, help="DSpark steps (default: as many as the budget allows)")
    parser.add_argument("--eval-every", type=int, default=50, help="validation NLL every N backbone steps")
    parser.add_argument("--eval-windows", type=int, default=4, help="windows of --seq-len tokens per NLL")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    parser.add_argument("--init", type=Path, help="go on training this checkpoint (an earlier run's) instead")
    parser.add_argument("--lr", type=float, default=Plan.lr, help="peak learning rate of the backbone phase")
    parser.add_argument("--dspark-lr", type=float,
                        help="peak learning rate of the DSpark phase (default: --lr): a drafter retrained after a "
                             "backbone continuation at a low rate needs its own")
    parser.add_argument("--anchors", type=int, default=Plan.anchors,
                        help="draft blocks a DSpark window trains (the window's frozen forward costs the same "
                             "for any number)")
    parser.add_argument("--dspark-labels", choices=DSPARK_LABELS, default=Plan.dspark_labels,
                        help="the DSpark rows' labels: the target's greedy token after each text position, or its "
                             "greedy chain after each anchor, as decoding verifies drafts -- on the rows where the "
                             "text is that chain (agreeing: the rest left out), or on every row, the text "
                             "rewritten to the chain (b - 1 more target forwards a window; anchors b apart)")
    parser.add_argument("--dspark-share", type=float, default=Plan.dspark_share,
                        help="of the budget, for the DSpark stages")
    parser.add_argument("--fact-span", type=int, default=Plan.fact_span,
                        help="tokens of a training window per recall fact (0: none)")
    parser.add_argument("--index-rows", type=int, default=Plan.index_rows,
                        help="query rows a step fits the indexer on (0: the indexer is not trained)")
    parser.add_argument("--index-weight", type=float, default=Plan.index_weight,
                        help="weight of the indexer's KL beside the next-token loss")
    parser.add_argument("--attention-picks", type=float, default=Plan.attention_picks,
                        help="of the backbone phase, from its start: the index layers pick the entries the main "
                             "attention weighs most (the warm-up) instead of the indexer's")
    parser.add_argument("--answer-weight", type=float, default=Plan.answer_weight,
                        help="weight of the recall facts' answers' mean loss beside the mean over every token")
    parser.add_argument("--repeat-share", type=float, default=Plan.repeat_share,
                        help="of a training window's tokens, copies of a passage earlier in it (copying practice; "
                             "0: none)")
    parser.add_argument("--repeat-reach", type=int, default=Plan.repeat_reach,
                        help="the longest gap from a passage to its copy, grown to from inside the attention "
                             "window over the first half of the backbone phase")
    parser.add_argument("--repeat-ids", choices=("text", "window", "vocabulary"), default=Plan.repeat_ids,
                        help="what a repeated passage holds: the text there, or ids drawn at random (which only "
                             "copying predicts) from the window or uniformly from the train text's distinct tokens")
    parser.add_argument("--repeat-vocab", type=int, default=Plan.repeat_vocab,
                        help="with --repeat-ids vocabulary: draw from this many of the distinct tokens at first, "
                             f"{REPEAT_VOCAB_GROWTH}x more each time the last {REPEAT_VOCAB_STEPS} steps copy "
                             f"{REPEAT_VOCAB_LEARNT * 100:.0f}%% of their targets (0: all from the start)")
    parser.add_argument("--copy-warmup", type=float, default=Plan.copy_warmup,
                        help="of the backbone phase, from its start: windows of random ids only, each passage "
                             "written twice (the induction task; needs --repeat-ids vocabulary): among the "
                             "--repeat-vocab ids, the curriculum grows the gap between a passage and its copy from "
                             "0 to half the window, then the ids, then the gap to --repeat-reach; the warm-up ends "
                             "once that is learnt)")
    parser.add_argument("--batch", type=int, default=Plan.batch,
                        help="training windows a step on each rank, their gradients averaged")
    parser.add_argument("--ranks", type=int, default=1,
                        help="data-parallel processes (torch.distributed, gloo), each with its own --batch windows "
                             "a step; with --device cuda rank r runs on GPU r mod the GPUs there")
    parser.add_argument("--device", help="torch device (default: cuda when available)")
    parser.add_argument("--eager", action="store_true",
                        help="on a GPU, launch every training window's kernels from Python (default: CUDA graphs)")
    parser.add_argument("--smoke", action="store_true", help="the tests' narrow configuration (CPU seconds)")
    parser.add_argument("--shard-size", type=size_arg, default=SHARD_BYTES, metavar="SIZE",
                        help="the largest weight file of the checkpoint (15MiB: each file comes back from the GPU "
                             "machine within its per-file limit)")
    parser.set_defaults(func=run)


def register(subparsers) -> None:
    p = subparsers.add_parser("train-data", help="download and split the training text, train its tokenizer",
                              description=prepare.__doc__ or "build the training data")
    p.add_argument("--out", required=True, type=Path, help="directory for the splits, tokens and tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (4-16K)")
    p.add_argument("--seed", type=int, default=0, help="seed of the chat turns cut from the train split")
    p.set_defaults(func=prepare)
    q = subparsers.add_parser("quality", help="measure a trained checkpoint's quality gates (NLL, needle, DSpark)",
                              description="test NLL, needle recall and DSpark acceptance of a trained checkpoint")
    q.add_argument("--model", required=True, type=Path, help="the checkpoint directory")
    q.add_argument("--data", required=True, type=Path,
                   help="the directory `dsflash train-data` wrote, or a held-out sample (heldout.npz, beside the "
                        "built-in checkpoint)")
    q.add_argument("--device", help="torch device (default: cpu, the reference backend)")
    q.add_argument("--seq-len", type=int, default=2048, help="tokens per NLL window")
    q.add_argument("--windows", type=int, default=4, help="NLL windows")
    q.add_argument("--needle-distance", type=int, default=1500, help="tokens between the needle and its cue")
    q.set_defaults(func=quality)
    _train_arguments(subparsers.add_parser("train", help="train the small V4.1 model and its DSpark stages",
                                           description=__doc__.split("\n\n")[0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m dsflash.train.train_cmd", description=__doc__)
    _train_arguments(parser)
    ns = parser.parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
