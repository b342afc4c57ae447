"""Training a V4.1-architecture model from a seed: the backbone on next-token loss, then the DSpark stages on
the frozen backbone (its taps, its greedy outputs), inside a wall-clock budget that always leaves time to save.

Every step builds the model from the masters (backend.Masters) and runs the inference forward of one
sequence through the training kernels (backend.training_kernels); on a GPU a window's build, forward and
backward after the first are one CUDA graph's replay (graph.py). The routers' correction biases are not
trained by the gradient: as in DeepSeek-V3's auxiliary-loss-free balancing, each step moves an expert's bias
up when it took fewer than its share of the routed slots and down when more (`BIAS_RATE`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsflash.checkpoint.make import make_checkpoint
from dsflash.checkpoint.reader import Checkpoint
from dsflash.config import ModelArgs, engram_table_rows, validate
from dsflash.model.common import Selections
from dsflash.model.mhc import hc_pre
from dsflash.model.transformer import Debug, ForwardOutput, HostTables, Tokens, Transformer
from dsflash.model.weights import WeightLoader
from dsflash.train.backend import Masters, TrainState, id_counts, training_kernels
from dsflash.train.blocks import BlockAttention, BlockChunk, block_rows
from dsflash.train.graph import CapturedStep
from dsflash.train.indexer import attention_picks, indexer_kl, query_rows

PAD_ID = 2  # tokenizer.PAD_ID (not imported: that module needs `tokenizers`, which the GPU machine lacks)
BIAS_RATE = 0.005
FACT_MIN_GAP = 64  # tokens from a recall fact's statement to its cue, at least
REPEAT_TOKENS = (16, 64)  # a repeated passage's length, from-to (Plan.repeat_share)
REPEAT_GAP_MIN = 8  # tokens from a passage's end to its copy, at least
# The copying curriculum (`Trainer.grow_copy_curriculum`): once the mean copy accuracy of the last
# REPEAT_VOCAB_STEPS steps reaches REPEAT_VOCAB_LEARNT, the copy warm-up's longest gap between a passage and its
# copy grows REPEAT_VOCAB_GROWTH-fold, and once it reaches half the window, Plan.repeat_vocab's id count does;
# then, among FAR_VOCAB ids again, the gap beyond the window to Plan.repeat_reach, and the ids once more
REPEAT_VOCAB_GROWTH, REPEAT_VOCAB_STEPS, REPEAT_VOCAB_LEARNT = 4, 25, 0.5
FAR_VOCAB = 64
TWICE_TOKENS = 32  # a passage of Plan.copy_warmup's windows, written twice
DSPARK_LABELS = ("text", "agreeing", "chain")  # Plan.dspark_labels


def trained_args(vocab_size: int, classes: int) -> ModelArgs:
    """The shipped model: 8 layers keeping every V4.1 path -- Engram at layers 1 and 3, a ratio-2 KV source
    (layer 2) read by a reuse layer (3) and a re-index layer (4), the split at layer 5 (the first ratio-1
    layer, a KV source and the candidate source), a reuse layer (6) and a re-index layer (7) after it, MoE with
    8 routed experts (2 active) and a shared one, a 128-token window, and two DSpark stages tapping layers
    5-7. A 16K context (YaRN on the compressed RoPE from 8K)."""
    args = ModelArgs(
        max_batch_size=1, max_seq_len=16384, temperature=0.0, vocab_size=vocab_size, dim=256, moe_inter_dim=256,
        n_layers=8, n_mtp_layers=2, n_heads=4, n_routed_experts=8, n_activated_experts=2, q_lora_rank=128,
        head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=64, window_size=128,
        compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 0, 0), kv_source_layers=(2, 5), index_source_layers=(2, 4, 5, 7),
        original_seq_len=8192, rope_factor=4, index_n_heads=4, index_head_dim=64, index_topk=64,
        candidate_source_layer=5, candidate_topk_blocks=16, candidate_block_size=8,
        engram_layer_ids=(1, 3), engram_vocab_size=4096, engram_n_heads=4, engram_head_dim=32,
        engram_compressed_vocab_size=classes, engram_pad_id=PAD_ID,
        dspark_block_size=4, dspark_noise_token_id=PAD_ID, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=64,
        dspark_n_routed_experts=8, dspark_n_activated_experts=2)
    args = dataclasses.replace(args, engram_num_embeddings=engram_table_rows(args))
    validate(args)
    return args


def smoke_args(vocab_size: int, classes: int) -> ModelArgs:
    """trained_args' layer schedule at a width the CPU trains in seconds (the tests' configuration)."""
    args = dataclasses.replace(
        trained_args(vocab_size, classes), max_seq_len=2048, dim=64, moe_inter_dim=32, q_lora_rank=32, head_dim=32,
        o_lora_rank=32, index_head_dim=32, window_size=16, index_topk=8, candidate_topk_blocks=4,
        candidate_block_size=4, engram_vocab_size=64, engram_n_heads=2, dspark_markov_rank=32)
    args = dataclasses.replace(args, engram_num_embeddings=engram_table_rows(args))
    validate(args)
    return args


@dataclass
class Plan:
    seq_len: int = 4096  # tokens per step (one sequence)
    budget_s: float = 480.0  # wall clock for both phases, from the first step
    dspark_share: float = 0.2  # of the budget, for the DSpark stages
    steps: int | None = None  # backbone steps (then the budget only stops early); None: as many as fit
    dspark_steps: int | None = None
    lr: float = 2e-3
    dspark_lr: float = 2e-3
    warmup: int = 30
    anchors: int = 256  # DSpark blocks per step
    # the DSpark rows' labels (DSPARK_LABELS): the target's greedy token after each text position ("text"; past a
    # block's first row it follows text the chain decoding verifies would not have written), or its greedy chain
    # after each anchor (`greedy_chain`): only the rows where the text is that chain ("agreeing"), or every row,
    # the text rewritten to the chain ("chain")
    dspark_labels: str = "text"
    eval_every: int = 50
    eval_windows: int = 4  # validation windows of seq_len tokens
    fact_span: int = 2048  # tokens a window holds per recall fact (its statement, then its cue and answer)
    index_rows: int = 256  # query rows a step fits the indexer on (indexer.py); 0: the indexer stays as it is
    index_weight: float = 1.0  # of the indexer's KL beside the next-token loss
    # of the backbone phase, from its start: the index layers pick by the main attention (indexer.py's warm-up)
    attention_picks: float = 0.0
    answer_weight: float = 0.0  # of the facts' answers' mean loss beside the mean over every token
    repeat_share: float = 0.0  # of a window's tokens, copies of a passage earlier in it (`write_repeats`); 0: none
    repeat_reach: int = 4096  # the longest gap from a passage to its copy, reached halfway through the phase
    # what a repeated passage holds (`write_repeats`): "text" (the text there), "window" (ids drawn from the window
    # at random) or "vocabulary" (ids drawn uniformly from the train text's distinct tokens)
    repeat_ids: str = "text"
    # with repeat_ids "vocabulary": the ids a passage is drawn from at the start, the first of the distinct ids in
    # a seeded order, grown as they are learnt (REPEAT_VOCAB_*); 0: all of them from the start. Copying among a
    # few ids is learnt first and then carries over to more (bench/results/copy-probe-cpu-2026-12-07.txt)
    repeat_vocab: int = 0
    # of the backbone phase, from its start: windows of ids alone (with repeat_ids "vocabulary", from the
    # curriculum's ids), each passage of TWICE_TOKENS written twice, the gap between the two growing with the
    # curriculum -- the induction task, learnt where copies among text are not (`twice_window`); it ends sooner
    # once the curriculum's last level is learnt (`grow_copy_curriculum`); 0: none
    copy_warmup: float = 0.0
    batch: int = 1  # training windows a step on each rank, their gradients averaged (`Ranks`)
    graphs: bool = True  # on a GPU, each window of a phase after its first as one CUDA graph (graph.py)
    seed: int = 0


@dataclass
class Log:
    rows: list[dict] = field(default_factory=list)

    def add(self, **row) -> None:
        self.rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def init_masters(args: ModelArgs, seed: int, device: torch.device | str) -> Masters:
    """The seeded checkpoint's tensors (checkpoint/make.py), with every norm weight 1 and every router bias 0:
    the released model's statistics are a trained model's, a training run starts from the plain ones."""
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(args, seed, tmp)
        masters = Masters(Checkpoint(tmp), device)
    with torch.no_grad():
        for name, p in masters.params.items():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".gate.bias"):
                p.zero_()
    return masters


def learning_rate(peak: float, step: int, progress: float, warmup: int) -> float:
    """Linear warmup, flat, then a linear decay to a tenth over the last 30% of the phase."""
    ramp = min(1.0, (step + 1) / warmup)
    decay = 1.0 if progress < 0.7 else 1.0 - 0.9 * min(1.0, (progress - 0.7) / 0.3)
    return peak * ramp * decay


def moe_prefix(args: ModelArgs, layer: int) -> str:
    """The checkpoint prefix of a backbone layer's or a DSpark stage's MoE."""
    return f"layers.{layer}.ffn." if layer < args.n_layers else f"mtp.{layer - args.n_layers}.ffn."


def expert_loads(args: ModelArgs, trace: dict) -> dict[int, torch.Tensor]:
    """layer -> the number of routed slots each of its experts took in the step's routing trace."""
    return {layer: id_counts(ids, args.moe_experts(layer)[0]) for layer, ids in trace.get("moe_ids", {}).items()}


def balance_biases(masters: Masters, loads: dict[int, torch.Tensor]) -> None:
    """Aux-loss-free balancing: each router's bias +- BIAS_RATE by whether its expert was under or over loaded."""
    with torch.no_grad():
        for layer, load in loads.items():
            load = load.float()
            masters.params[moe_prefix(masters.args, layer) + "gate.bias"] += BIAS_RATE * torch.sign(load.mean() - load)


def drop_unrouted_grads(masters: Masters, loads: dict[int, torch.Tensor]) -> None:
    """An expert no slot was routed to gets no gradient (None: AdamW leaves it as it is), as when the forward
    did not use it; the grouped expert GEMM (backend.expert_linear) gives it zeros. One host read a step."""
    if not loads:
        return
    for layer, used in zip(loads, torch.stack(list(loads.values())).bool().tolist(), strict=True):
        prefix = moe_prefix(masters.args, layer)
        for e in (e for e, u in enumerate(used) if not u):
            for w in ("w1", "w2", "w3"):
                masters.params[f"{prefix}experts.{e}.{w}.weight"].grad = None


class Ranks:
    """The data-parallel ranks of a run (torch.distributed over gloo: processes of one host, rank r on GPU r
    mod the GPUs there, or on the CPU). Each rank trains its own windows; per step the
    ranks go by rank 0's clock and take the mean of their gradients, so every rank holds the same masters. A
    step of N ranks with W windows each is a step of one process with N x W windows, bit for bit (on the CPU
    at the same threads a process): a gradient is a sum over windows scaled by a power of two either way."""

    def __init__(self):
        self.on = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self.on else (0, 1)

    def clock(self, go: bool, progress: float) -> tuple[bool, float]:
        """Rank 0's (go on, progress of the phase): a learning rate and a stop every rank agrees on."""
        if not self.on:
            return go, progress
        t = torch.tensor([float(go), progress], dtype=torch.float64)
        dist.broadcast(t, 0)
        return bool(t[0]), float(t[1])

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        host = t.cpu()  # through the host: gloo's CPU path, whatever the device
        dist.all_reduce(host)
        return host.to(t.device)

    def mean_grads(self, params: list[torch.Tensor]) -> None:
        """Every rank's gradients -> their mean; a parameter no rank's windows reached keeps None (AdamW leaves
        it as it is), one that some reached counts zeros for the others."""
        if not self.on:
            return
        reached = self._sum(torch.tensor([p.grad is not None for p in params], dtype=torch.int64)).bool().tolist()
        live = [p for p, r in zip(params, reached, strict=True) if r]
        if not live:
            return
        flat = self._sum(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in live]))
        for p, g in zip(live, (flat / self.world).split([p.numel() for p in live]), strict=True):
            p.grad = g.view_as(p)

    def sum_loads(self, loads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each MoE layer's expert loads summed over the ranks (every rank routes the same layers)."""
        if not self.on or not loads:
            return loads
        flat = self._sum(torch.cat(list(loads.values())))
        return dict(zip(loads, flat.split([v.numel() for v in loads.values()]), strict=True))


def add_loads(total: dict[int, torch.Tensor], loads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The expert loads of a step's windows, layer by layer."""
    out = dict(total)
    for layer, v in loads.items():
        out[layer] = out[layer] + v if layer in out else v
    return out


@dataclass
class Stream:
    """One window slot's randomness (its windows' starts, facts, repeats, the indexer's query rows, the DSpark
    anchors): slot s of N ranks x W windows is rank s // W's window s % W; slot 0 is seeded as a one-window run
    always was."""

    rng: np.random.Generator
    index_generator: torch.Generator

    @classmethod
    def seeded(cls, seed: int, slot: int) -> Stream:
        if slot == 0:
            return cls(np.random.default_rng(seed), torch.Generator().manual_seed(seed))
        sequence = np.random.SeedSequence([seed, slot])
        return cls(np.random.default_rng(sequence), torch.Generator().manual_seed(int(sequence.generate_state(1)[0])))


class Trainer:
    def __init__(self, args: ModelArgs, token_map: list[int], train: np.ndarray, validation: np.ndarray,
                 plan: Plan, device: torch.device | str, facts: list[dict[str, list[int]]] = (),
                 init: Path | None = None):
        """`init`: a checkpoint to go on training (an earlier run's export, its trained norms and router
        biases kept), instead of the seeded start."""
        self.args, self.token_map, self.plan, self.facts = args, token_map, plan, list(facts)
        self.device = torch.device(device)
        torch.manual_seed(plan.seed)
        self.ranks = Ranks()
        first = self.ranks.rank * plan.batch
        self.streams = [Stream.seeded(plan.seed, first + j) for j in range(plan.batch)]
        self.train_tokens = torch.from_numpy(train.astype(np.int64))
        if plan.repeat_ids not in ("text", "window", "vocabulary"):
            raise ValueError(f"repeat_ids is text, window or vocabulary, not {plan.repeat_ids!r}")
        if plan.dspark_labels not in DSPARK_LABELS:
            raise ValueError(f"dspark_labels is one of {', '.join(DSPARK_LABELS)}, not {plan.dspark_labels!r}")
        if plan.copy_warmup and plan.repeat_ids != "vocabulary":
            raise ValueError("copy_warmup draws its ids as repeat_ids 'vocabulary' does: set that too")
        # the distinct ids of the train text in a seeded order: a "vocabulary" repeat draws from the first
        # `repeat_vocab` of them (Plan.repeat_vocab)
        self.vocabulary = self.repeat_vocab = None
        if plan.repeat_ids == "vocabulary":
            ids = torch.unique(self.train_tokens)
            self.vocabulary = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(plan.seed))]
            self.repeat_vocab = min(plan.repeat_vocab or ids.numel(), ids.numel())
        # the copy warm-up's longest gap between a passage and its copy (`twice_window`); the curriculum grows it
        self.twice_gap = 0
        self.beyond = False  # the curriculum's gap grows beyond the window (`grow_copy_curriculum`)
        self.warming = plan.copy_warmup > 0  # until the warm-up's share of the phase or its last level is done
        self._copy_accs: deque[float] = deque(maxlen=REPEAT_VOCAB_STEPS)  # the last steps' (`grow_copy_curriculum`)
        self.validation = torch.from_numpy(validation.astype(np.int64))
        self.masters = Masters(Checkpoint(init), self.device) if init else init_masters(args, plan.seed, self.device)
        self.k = training_kernels(self.masters)
        self.log = Log()
        self._tables: HostTables | None = None  # the first model's (not the model: see `model`)
        self._captured: dict[tuple, CapturedStep] = {}  # the phase's windows (`_run`)
        self.replays = 0  # windows that ran as a graph's replay

    def _run(self, key: tuple, fn: Callable[..., tuple], prefix: str, **inputs: torch.Tensor) -> tuple:
        """fn(**inputs); with Plan.graphs, through the phase's CapturedStep of `key` (on a GPU a replay after the
        first call), its gradients on the masters named from `prefix`."""
        if not self.plan.graphs:
            return fn(**inputs)
        step = self._captured.get(key)
        if step is None:
            step = self._captured[key] = CapturedStep(fn, self.masters.trainable(prefix), self.masters.forget_values)
        out = step(**inputs)
        self.replays += step.graph is not None
        return out

    def model(self) -> Transformer:
        """The model as the masters are now, with the first model's host tables. (Not a model kept from step to
        step: its weights' autograd nodes would tie a CUDA graph's backward to the stream they were made on.)"""
        model = Transformer(self.args, self.masters, self.token_map, kernels=self.k, tables=self._tables)
        self._tables = self._tables or model.host_tables()
        return model

    def window(self, progress: float = 1.0, stream: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """seq_len + 1 train tokens from a random start with recall facts (`write_facts`) and then repeated
        passages (`write_repeats`, their gaps as at `progress` of the phase) written over them; the positions
        of x[1:] whose targets are the facts' answers' first tokens (the ones recall decides), those whose
        targets a repeat copies, and of those the ones whose passage lies beyond the attention window. Drawn
        from `self.streams[stream]`."""
        rng = self.streams[stream].rng
        self.warming = self.warming and progress < self.plan.copy_warmup
        if self.warming:
            return self.twice_window(rng)
        start = int(rng.integers(0, self.train_tokens.numel() - self.plan.seq_len - 1))
        x = self.train_tokens[start:start + self.plan.seq_len + 1].clone()
        used = torch.zeros(x.numel(), dtype=torch.bool)
        answers = self.write_facts(rng, x, used) if self.facts and self.plan.fact_span else []
        copies, far = self.write_repeats(rng, x, used, progress) if self.plan.repeat_share else ([], [])
        answers, copies, far = (torch.tensor(rows, dtype=torch.int64, device=self.device)
                                for rows in (answers, copies, far))
        return x.to(self.device), answers, copies, far

    def twice_window(self, rng: np.random.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plan.copy_warmup's window: seq_len + 1 ids of the curriculum's `repeat_vocab`, passages of TWICE_TOKENS
        each written twice, 0 to `twice_gap` ids between the two; as `window` returns (no facts; the copies, and
        of those the ones more than a window after their source). The gap's growth is what makes this induction:
        written twice in a row, a copy is always the same distance back, and the model learns to read that offset
        -- which copies nothing in the text (on the H100 the ids were all copied after 1,000 steps and none of the
        text's repeats after the switch; bench/results/train-h100-copy-warmup-2026-12-07.json). With the gap
        varied, only finding the current id earlier in the window says where to copy from."""
        n, half = self.plan.seq_len + 1, TWICE_TOKENS
        pieces, copies, far, at = [], [], [], 0
        while at < n:
            gap = int(rng.integers(0, self.twice_gap + 1))
            ids = self.vocabulary[torch.from_numpy(rng.integers(0, self.repeat_vocab, half + gap))]
            pieces += [ids, ids[:half]]  # the passage, the gap's ids, the passage again
            second = at + half + gap
            targets = range(second, second + half - 1)  # position i predicts x[i + 1]
            copies.extend(targets)
            if half + gap > self.args.window_size:
                far.extend(targets)
            at = second + half
        x = torch.cat(pieces)[:n]
        copies, far = (torch.tensor(rows, dtype=torch.int64) for rows in (copies, far))
        none = torch.zeros(0, dtype=torch.int64, device=self.device)
        return x.to(self.device), none, copies[copies < n - 1].to(self.device), far[far < n - 1].to(self.device)

    def repeat_gap_max(self, progress: float) -> int:
        """The copying curriculum: the longest gap grows geometrically from inside the attention window to
        `repeat_reach` over the first half of the phase (a copy from the window is learnt first: the sparse
        entries beyond it need the indexer to find them)."""
        first, reach = min(self.args.window_size // 2, self.plan.repeat_reach), self.plan.repeat_reach
        return int(first * (reach / first) ** min(1.0, progress / 0.5))

    def write_repeats(self, rng: np.random.Generator, x: torch.Tensor, used: torch.Tensor, progress: float
                      ) -> tuple[list[int], list[int]]:
        """Passages of REPEAT_TOKENS of x written again after themselves, a gap log-uniform in REPEAT_GAP_MIN to
        `repeat_gap_max(progress)` later, until `repeat_share` of x are copies; a passage and its copy avoid
        each other and every token `used` marks (the facts), then are marked. Recalling a fact is copying
        from the context, which plain text asks for too rarely to be learnt in a short run; a repeat asks for
        it at every token after its first. With `repeat_ids` "window" or "vocabulary" the passage is first
        replaced by ids drawn at random: its copy is then predictable by copying alone (real text's copies are
        mostly predictable from the n-grams before them, which is what a model that has not learnt to copy
        already uses). Drawn from the window, a passage's ids occur elsewhere in it too, so the token before a
        target does not tell where to copy from; drawn from the vocabulary (mostly rare ids, once in a window)
        it does, as in the classic induction task (32 of 64 random ids written twice: learnt by the smoke model
        in ~1,000 steps of 256 tokens, where its copies of ids from the window stay at chance;
        bench/results/copy-probe-cpu-2026-12-06.txt). Returns the positions
        of x[1:] whose targets a repeat copies (position i predicts x[i + 1]), and of those the ones more than a
        window after their source."""
        target, top = self.plan.repeat_share * x.numel(), self.repeat_gap_max(progress)
        copies, far, placed, written, attempts = [], [], [], 0, 0
        while written < target and attempts < 64 + x.numel() // 8:
            attempts += 1
            n = int(rng.integers(REPEAT_TOKENS[0], REPEAT_TOKENS[1] + 1))
            gap = round(float(np.exp(rng.uniform(np.log(REPEAT_GAP_MIN), np.log(max(top, REPEAT_GAP_MIN))))))
            if 2 * n + gap > x.numel():
                continue
            a = int(rng.integers(0, x.numel() - 2 * n - gap + 1))
            b = a + n + gap
            if used[a:a + n].any() or used[b:b + n].any():
                continue
            x[b:b + n] = x[a:a + n].clone()
            placed.append((a, b, n))
            used[a:a + n] = used[b:b + n] = True
            copies.extend(range(b, b + n - 1))
            if b - a > self.args.window_size:
                far.extend(range(b, b + n - 1))
            written += n
        for a, b, n in placed if self.plan.repeat_ids != "text" else ():  # drawn after: the same places either way
            if self.plan.repeat_ids == "window":
                x[a:a + n] = x[torch.from_numpy(rng.integers(0, x.numel(), n))]
            else:
                x[a:a + n] = self.vocabulary[torch.from_numpy(rng.integers(0, self.repeat_vocab, n))]
            x[b:b + n] = x[a:a + n]
        return copies, far

    def write_facts(self, rng: np.random.Generator, x: torch.Tensor, used: torch.Tensor) -> list[int]:
        """One fact in each `fact_span` tokens of x: its statement in the span's first quarter, its cue and
        answer at a random later place at least FACT_MIN_GAP tokens on (so 64 to ~2000 tokens apart), written
        over the text; the validation and test windows get none. Returns where each answer's first token is
        predicted (its position - 1)."""
        span, answers = self.plan.fact_span, []
        for s0 in range(0, x.numel() - span + 1, span):
            fact = self.facts[int(rng.integers(len(self.facts)))]
            statement, ask = fact["statement"], fact["cue"] + fact["answer"]
            last = s0 + span - len(ask)  # the cue's last start
            a = s0 + int(rng.integers(0, span // 4))
            if a + len(statement) + FACT_MIN_GAP > last:
                continue
            b = int(rng.integers(a + len(statement) + FACT_MIN_GAP, last + 1))
            x[a:a + len(statement)] = torch.tensor(statement)
            x[b:b + len(ask)] = torch.tensor(ask)
            used[a:a + len(statement)] = used[b:b + len(ask)] = True
            answers.append(b + len(fact["cue"]) - 1)
        return answers

    def nll(self, tokens: torch.Tensor, windows: int) -> float:
        """Mean next-token NLL (nats) over `windows` evenly spaced windows of seq_len + 1 tokens."""
        t = self.plan.seq_len
        starts = np.linspace(0, tokens.numel() - t - 1, windows).astype(int)
        total = 0.0
        with torch.no_grad():
            for s in starts:
                x = tokens[s:s + t + 1].to(self.device)
                out = self.model().forward(TrainState(device=self.device), Tokens(x[:-1]))
                total += float(F.cross_entropy(out.logits, x[1:]))
        return total / windows

    def _update(self, opt: torch.optim.Optimizer, params: list, loads: dict[int, torch.Tensor]) -> None:
        """One optimiser step on the gradients the step's windows left (the ranks' mean, clipped to norm 1),
        then the routers' bias balance of the MoE layers the step routed through (`loads`: its windows' expert
        loads)."""
        self.ranks.mean_grads(params)
        loads = self.ranks.sum_loads(loads)
        drop_unrouted_grads(self.masters, loads)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance_biases(self.masters, loads)

    def clock(self, step: int, steps: int | None, started: float, deadline: float) -> tuple[bool, float]:
        """(go on, progress of the phase) by rank 0's clock: by steps when they are given, else by time."""
        go = (steps is None or step < steps) and time.monotonic() < deadline
        progress = step / steps if steps else (time.monotonic() - started) / max(deadline - started, 1e-9)
        return self.ranks.clock(go, progress)

    def indexer_loss(self, model: Transformer, state: TrainState, trace: dict, rows: torch.Tensor) -> torch.Tensor:
        """The indexer's KL to the main attention (indexer.py) on the query `rows` (`query_rows`: past the window,
        whose queries read compressed entries only there); zero without index layers or rows."""
        if not rows.numel() or "indexer_inputs" not in trace:
            return torch.zeros((), device=self.device)
        return indexer_kl(model, state, trace, rows)

    def backbone(self, deadline: float) -> int:
        p, started = self.plan, time.monotonic()
        params = self.masters.trainable()
        opt = torch.optim.AdamW(params, lr=p.lr, betas=(0.9, 0.95), weight_decay=0.1)
        step = 0
        while True:
            go, progress = self.clock(step, p.steps, started, deadline)
            if not go:
                break
            lr = learning_rate(p.lr, step, progress, p.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            warm = progress < p.attention_picks
            loads, logged = {}, []
            for j in range(p.batch):
                loss, kl, window_loads, hits = self.backbone_window(progress, j, warm)
                loads = add_loads(loads, window_loads)
                logged.append({"train_loss": float(loss.detach()), "index_kl": float(kl.detach()), **hits})
            self._update(opt, params, loads)
            step += 1
            row = {"phase": "backbone", "step": step, "elapsed_s": round(time.monotonic() - started, 2),
                   "lr": lr, "picks": "attention" if warm else "indexer", **mean_rows(logged)}
            if self.repeat_vocab is not None:
                row["repeat_vocab"] = self.repeat_vocab
                if p.copy_warmup:
                    row["twice_gap"], row["warm_up"] = self.twice_gap, int(self.warming)
                self.grow_copy_curriculum(row.get("copy_acc", 0.0))
            if self.ranks.rank == 0:  # the log holds rank 0's windows
                if step % p.eval_every == 0:
                    row["val_loss"] = self.nll(self.validation, p.eval_windows)
                self.log.add(**row)
        self._captured.clear()  # the phase's graphs, and their memory
        return step

    def grow_copy_curriculum(self, copy_acc: float) -> None:
        """The copying curriculum, after each step (each rank by its own windows' accuracy): once the copies of the
        present level are learnt, the copy warm-up's longest gap grows (`twice_gap`: 0, 1, then
        REPEAT_VOCAB_GROWTH-fold up to half the window, the text's repeats' first reach), among the first ids;
        then REPEAT_VOCAB_GROWTH times the ids (Plan.repeat_vocab); then, among FAR_VOCAB ids again, the gap beyond
        the window to Plan.repeat_reach (at most half a window of seq_len: copies read from the compressed entries
        the indexer picks), and the ids again; once that is learnt the warm-up ends: the text's time is not spent
        on windows that have nothing more to teach. The gap comes first, among few ids, both times: among 64 ids
        the smoke model learnt every gap to 64 (0.87-0.91 of the copies), where with every id a plain model stayed
        at the gap of 1 for 30,000 steps (bench/results/copy-probe-gaps-cpu-2026-12-07.txt); beyond its window it
        learnt copies among 64 ids (far-copy-smoke-cpu-2026-12-07.txt), where the trained model with every id
        copied 0-17 % for 1,270 steps (train-h100-far-copies-2026-12-07.md)."""
        self._copy_accs.append(copy_acc)
        if len(self._copy_accs) < REPEAT_VOCAB_STEPS or sum(self._copy_accs) / REPEAT_VOCAB_STEPS < REPEAT_VOCAB_LEARNT:
            return
        every = self.repeat_vocab >= self.vocabulary.numel()
        near = self.args.window_size // 2
        far = max(near, min(self.plan.repeat_reach, self.plan.seq_len // 2))
        reach = far if self.beyond else near
        if self.warming and self.twice_gap < reach:
            self.twice_gap = min(reach, max(1, self.twice_gap * REPEAT_VOCAB_GROWTH))
        elif not every:
            self.repeat_vocab = min(self.vocabulary.numel(), self.repeat_vocab * REPEAT_VOCAB_GROWTH)
        elif self.warming and not self.beyond and near < far:
            self.beyond, self.repeat_vocab = True, min(FAR_VOCAB, self.vocabulary.numel())
        elif self.warming:
            self.warming = False
            return
        self._copy_accs.clear()

    def backbone_window(self, progress: float, stream: int, warm: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor], dict[str, float]]:
        """One window's forward and backward (`window_loss`; on a GPU its CUDA graph after the first): (its
        next-token loss, its indexer KL, its expert loads, its greedy hit rates -- the facts' first answer
        tokens, the repeats' copied tokens, those beyond the window)."""
        p = self.plan
        x, answers, copies, far = self.window(progress, stream)
        weights = torch.zeros(x.numel() - 1, device=self.device)
        if answers.numel():  # each answer 1/answers of the answers' mean loss
            weights[answers] = 1.0 / answers.numel()
        n, first = p.seq_len, self.args.window_size
        rows = (query_rows(n, p.index_rows, first, self.streams[stream].index_generator, self.device)
                if p.index_rows and n > first else torch.zeros(0, dtype=torch.int64, device=self.device))
        loss, kl, logits, loads = self._run(("backbone", warm), functools.partial(self.window_loss, warm=warm), "",
                                            tokens=x, answer_weights=weights, index_rows=rows)
        y = x[1:]
        hits = {name: float((logits[at].argmax(-1) == y[at]).float().mean())
                for name, at in (("fact_recall", answers), ("copy_acc", copies), ("copy_far", far)) if at.numel()}
        # a graph's outputs: the step's next window overwrites them
        return loss.clone(), kl.clone(), {layer: v.clone() for layer, v in loads.items()}, hits

    def window_loss(self, tokens: torch.Tensor, answer_weights: torch.Tensor, index_rows: torch.Tensor, warm: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The forward of tokens[:-1] and its backward (its loss over `batch`: the gradients of a step's windows
        add up): the mean next-token loss, plus the indexer's KL on the query `index_rows` (`indexer_loss`),
        plus `answer_weight` times the answers' mean loss (`answer_weights`: 1/answers at each answer's
        position). Returns (the next-token loss, the KL, the logits, the expert loads), all on the device:
        nothing is read back to the host (CapturedStep)."""
        p, trace = self.plan, {}
        state, model = TrainState(device=self.device), self.model()
        select = Selections(picker=attention_picks) if warm else None
        out = model.forward(state, Tokens(tokens[:-1]), debug=Debug(select=select, trace=trace))
        token_losses = F.cross_entropy(out.logits, tokens[1:], reduction="none")
        loss = token_losses.mean()
        kl = self.indexer_loss(model, state, trace, index_rows)
        total = loss + p.index_weight * kl
        if p.answer_weight:
            # a window holds a few answers among thousands of tokens: without a weight of their own their
            # gradient is too small a part of the step for the attention to learn the look-up
            total = total + p.answer_weight * (token_losses * answer_weights).sum()
        (total / p.batch).backward()
        return loss.detach(), kl.detach(), out.logits.detach(), expert_loads(self.args, trace)

    def dspark(self, deadline: float) -> int:
        """The DSpark stages on the frozen backbone: per step `batch` windows on each rank (`dspark_window`)."""
        p, started = self.plan, time.monotonic()
        for name, t in self.masters.params.items():
            t.requires_grad_(name.startswith("mtp.") and not name.endswith(".gate.bias"))
        params = self.masters.trainable("mtp.")
        opt = torch.optim.AdamW(params, lr=p.dspark_lr, betas=(0.9, 0.95), weight_decay=0.1)
        step = 0
        while True:
            go, progress = self.clock(step, p.dspark_steps, started, deadline)
            if not go:
                break
            lr = learning_rate(p.dspark_lr, step, progress, p.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            loads, logged = {}, []
            for j in range(p.batch):
                loss, accepted, window_loads = self.dspark_window(j)
                loads = add_loads(loads, window_loads)
                logged.append({"train_loss": float(loss), "accepted_per_block": accepted})
            self._update(opt, params, loads)
            step += 1
            if self.ranks.rank == 0:
                self.log.add(phase="dspark", step=step, elapsed_s=round(time.monotonic() - started, 2), lr=lr,
                             **mean_rows(logged))
        for t in self.masters.params.values():
            t.requires_grad_(False)
        self._captured.clear()
        return step

    def dspark_window(self, stream: int) -> tuple[torch.Tensor, float, dict[int, torch.Tensor]]:
        """One window's DSpark training (`draft_loss`; on a GPU its CUDA graph after the first) at `anchors`
        random target positions: (its loss, its drafts accepted per block, its expert loads)."""
        p, b = self.plan, self.args.dspark_block_size
        x = self.window(stream=stream)[0][:-1]
        # a chain's blocks must not overlap (each writes its own rows of the window): anchors b apart at least
        starts = np.arange(1, x.numel() - b, b if p.dspark_labels == "chain" else 1)
        anchors = torch.from_numpy(np.sort(self.streams[stream].rng.choice(
            starts, size=min(p.anchors, starts.size), replace=False))).to(self.device)
        loss, accepted, loads = self._run(("dspark",), self.draft_loss, "mtp.", tokens=x, anchors=anchors)
        # a graph's outputs: the step's next window overwrites them
        return loss.clone(), float(accepted), {layer: v.clone() for layer, v in loads.items()}

    def draft_loss(self, tokens: torch.Tensor, anchors: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The backbone's taps and greedy outputs of `tokens` (no gradient), then blocks of [anchor, noise...]
        rows at the `anchors` trained to give the greedy tokens after each anchor, backward included (its loss
        over `batch`). Returns (the loss, the drafts accepted per block, the expert loads), all on the device.

        With Plan.dspark_labels "agreeing" or "chain", the labels are the target's greedy chain after each anchor
        (`greedy_chain`)."""
        model, labels = self.model(), self.plan.dspark_labels
        with torch.no_grad():
            if labels != "text":
                tokens, out, weights = greedy_chain(model, tokens, anchors, rewrite=labels == "chain")
            else:
                out, weights = model.forward(TrainState(device=self.device), Tokens(tokens)), None
        trace: dict = {}
        loss, accepted = dspark_loss(model, self.masters, out.main_hidden, tokens, out.logits.argmax(-1), anchors,
                                     trace, weights)
        (loss / self.plan.batch).backward()
        return loss.detach(), accepted, expert_loads(self.args, trace)


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the rows that have it (a step's windows' logged values)."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}


def draft_logits(model: Transformer, masters: Masters, main_hidden: torch.Tensor, x: torch.Tensor,
                 greedy: torch.Tensor, anchors: torch.Tensor, trace: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafts of every anchor's block side by side (blocks.py): (logits [M * B, V] with the Markov bias of
    the previous greedy token, as decoding adds the previous draft's; the final hidden rows; the Markov
    embeddings; the labels, the backbone's greedy tokens)."""
    a, k, dspark = model.args, model.k, model.dspark
    b, n = a.dspark_block_size, x.numel()
    w = WeightLoader(masters, k)
    for s, block in enumerate(dspark.stages):  # the stages' attention over many blocks at once
        block.attn = BlockAttention(a, a.n_layers + s, w, f"mtp.{s}.attn.", model.ropes)
    positions = torch.arange(n, device=x.device)
    model.ropes[0].reserve(n + b, x.device)
    main_x = k.rms_norm(k.linear(main_hidden, dspark.main_proj), dspark.main_norm, a.norm_eps)
    contexts = [block.attn.context_kv(main_x, positions) for block in dspark.stages]
    ids, rows_pos, labels, previous = block_rows(x, greedy, anchors, b, a.dspark_noise_token_id)
    chunk = BlockChunk(TrainState(device=x.device), rows_pos, ids.numel(), trace=trace, contexts=contexts,
                       anchors=anchors, block=b, row_tile=1, _p0=0)
    h = F.embedding(ids, dspark.embed).unsqueeze(1).repeat(1, a.hc_mult, 1)
    pre = torch.zeros(ids.numel(), a.hc_mult, device=x.device)
    pre[:, 0] = 1.0
    for block in dspark.stages:
        h, pre = block.forward(h, pre, chunk)
    y = k.rms_norm(hc_pre(k, h, pre), dspark.norm, a.norm_eps)
    embeds = dspark.markov_embed[previous]
    logits = k.linear(y.float(), dspark.head) + k.linear(embeds.float(), dspark.markov_head)
    return logits, y, embeds, labels


def greedy_chain(model: Transformer, tokens: torch.Tensor, anchors: torch.Tensor, rewrite: bool = True
                 ) -> tuple[torch.Tensor, ForwardOutput, torch.Tensor]:
    """Labels from the target's greedy chain after each anchor: the window `tokens` (with `rewrite`, the b - 1 rows
    after each anchor, blocks b apart, rewritten to the chain, a row a forward: Jacobi iteration, b forwards in
    all), its last forward, and each block row's weight in the DSpark loss. Decoding verifies draft i against the
    target's token after the anchor and drafts 1..i-1, never after the text's next tokens, which the greedy token
    equals only ~40 % of the time on held-out Python. A row whose text before it (after the rewrite: its chain,
    which a block's rewrites change for the blocks after it) disagrees with the greedy tokens gets weight 0, with
    every row after it in its block. Without `rewrite`, one forward: the text's labels on the rows where the text
    already is the chain. Call without autograd."""
    b = model.args.dspark_block_size
    at = anchors.unsqueeze(1) + torch.arange(b, device=anchors.device)
    out = model.forward(TrainState(device=tokens.device), Tokens(tokens))
    tokens = tokens.clone()
    for _ in range(b - 1 if rewrite else 0):
        tokens[at[:, 1:]] = out.logits.argmax(-1)[at[:, :-1]]
        out = model.forward(TrainState(device=tokens.device), Tokens(tokens))
    agree = tokens[at[:, 1:]] == out.logits.argmax(-1)[at[:, :-1]]
    weights = torch.cat([torch.ones_like(agree[:, :1]), agree], dim=1).float().cumprod(dim=1).flatten()
    return tokens, out, weights


def dspark_loss(model: Transformer, masters: Masters, main_hidden: torch.Tensor, x: torch.Tensor,
                greedy: torch.Tensor, anchors: torch.Tensor, trace: dict, weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the drafts against the backbone's greedy tokens plus the confidence head's BCE on
    whether each draft is right, over the block rows (or their `weights`' weighted mean); and the mean number
    of drafts a block would get accepted."""
    b = model.args.dspark_block_size
    logits, y, embeds, labels = draft_logits(model, masters, main_hidden, x, greedy, anchors, trace)
    right = (logits.argmax(-1) == labels).float()
    confidence = model.k.linear(torch.cat([y, embeds], dim=-1).float(), model.dspark.confidence)[:, 0]
    if weights is None:  # the plain mean, summed as before: runs without the chain keep their bits
        loss = F.cross_entropy(logits, labels) + 0.1 * F.binary_cross_entropy_with_logits(confidence, right)
    else:
        rows = (F.cross_entropy(logits, labels, reduction="none")
                + 0.1 * F.binary_cross_entropy_with_logits(confidence, right, reduction="none"))
        loss = (rows * weights).sum() / weights.sum()
    accepted = right.view(-1, b).cumprod(dim=1).sum(dim=1).mean()
    return loss, accepted


def summary(trainer: Trainer, steps: int, dspark_steps: int, seconds: float) -> dict:
    params, plan = trainer.masters.params, trainer.plan
    return {"parameters": sum(p.numel() for p in params.values()),
            "parameters_without_engram_tables": sum(p.numel() for n, p in params.items() if ".engram.embed." not in n),
            "backbone_steps": steps, "dspark_steps": dspark_steps, "ranks": trainer.ranks.world,
            "graph_replays": trainer.replays,
            "tokens_seen": steps * plan.seq_len * plan.batch * trainer.ranks.world,
            "train_seconds": round(seconds, 1), "plan": dataclasses.asdict(plan),
            "device": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "cpu",
            "torch": torch.__version__}


def write_json(path: Path, d: dict) -> None:
    path.write_text(json.dumps(d, indent=2) + "\n")


