"""DSpark drafter (spec §10), stored as `mtp.S.*`: three ratio-0 blocks over a block of
[anchor, noise x (B-1)] rows that attend bidirectionally to each other and to each stage's ring of
target context KV, then the shared head plus a sequential Markov correction and a confidence head."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from dsflash.config import ModelArgs
from dsflash.kernels.cpu import pad_rows
from dsflash.model.attention import Attention
from dsflash.model.common import Chunk, Replayer
from dsflash.model.mhc import Block, FfnInput, hc_pre
from dsflash.model.rope import Rope
from dsflash.model.state import PositionRing
from dsflash.model.weights import WeightLoader


class DSparkAttention(Attention):
    """Block rows attend to the stage's ring (slot order, the slots filled so far) and to every block row."""

    def __init__(self, args: ModelArgs, layer: int, w: WeightLoader, prefix: str, ropes: tuple[Rope, Rope]):
        super().__init__(args, layer, w, prefix, ropes)
        self.stage = layer - args.n_layers

    def history(self, state) -> PositionRing:
        return state.ring(state.dspark, self.stage, self.args.window_size, (self.args.head_dim,), torch.bfloat16)

    def ring(self, state, last: torch.Tensor) -> torch.Tensor:
        """The reference's window ring after target position `last` (int64 [1], on the device): slot =
        position % window_size. Slots before position 0 repeat position 0, which no index reads (`core`
        attends to the filled slots only); device positions let a CUDA graph serve any `last`."""
        win = self.args.window_size
        history = self.history(state)
        ring = history.data.new_zeros(win, self.args.head_dim)
        positions = (last - win + 1 + torch.arange(win, device=ring.device)).clamp_min(0)
        ring[positions % win] = history.read(positions)
        return ring

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The stage's context KV of target rows (main_x: their projected taps) at `positions`: FP8-valued."""
        return self.window_kv(main_x, positions)

    def write_context(self, state, main_x: torch.Tensor, positions: torch.Tensor, n: int) -> None:
        self.history(state).write(positions[:n], self.context_kv(main_x, positions)[:n])

    def core(self, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor, chunk: Chunk
             ) -> tuple[torch.Tensor, torch.Tensor]:
        win = self.args.window_size
        filled = min(win, chunk.p0)  # target positions 0 .. p0-1 have context (a graph: always the window)
        dev = x.device
        idx = torch.cat([torch.arange(filled, device=dev), win + torch.arange(chunk.n, device=dev)])
        idx = idx.expand(chunk.rows, -1)
        source = torch.cat([self.ring(chunk.state, chunk.positions[:1] - 1), kv[: chunk.n]])
        return source, idx.contiguous()


class DSpark:
    def __init__(self, args: ModelArgs, w: WeightLoader, ropes: tuple[Rope, Rope], embed: torch.Tensor,
                 head: torch.Tensor):
        self.k = w.k
        self.args = args
        self.ropes = ropes
        self.embed, self.head = embed, head
        self.stages = []
        for s in range(args.n_mtp_layers):
            layer, prefix = args.n_layers + s, f"mtp.{s}."
            attn = DSparkAttention(args, layer, w, prefix + "attn.", ropes)
            self.stages.append(Block(args, layer, w, prefix, attn))
        last = f"mtp.{args.n_mtp_layers - 1}."
        self.main_proj = w.linear("mtp.0.main_proj")
        self.main_norm = w.tensor("mtp.0.main_norm.weight")
        self.norm = w.tensor(last + "norm.weight")
        self.markov_embed = w.tensor(last + "markov_head.embed.weight")
        self.markov_head = w.linear(last + "markov_head.head", widen=True)
        self.confidence = w.linear(last + "confidence_head.proj", widen=True)

    def write_context(self, state, main_hidden: torch.Tensor, first: int, graphs: Replayer | None = None) -> None:
        """Store the context KV of the target rows at positions first, first+1, ... (main_hidden = the taps'
        stream means, [N, n_taps*D]). With `graphs`, a decode's few rows replay one CUDA graph per row count
        (keyed by the rings' addresses): eagerly these few rows cost more than the draft's stages."""
        n = main_hidden.size(0)
        rows = pad_rows(main_hidden, self.k.row_tile)
        pos = torch.arange(first, first + rows.size(0), device=rows.device)
        self.stages[0].attn.rope.reserve(first + rows.size(0), rows.device)

        def write(positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            main_x = self.k.rms_norm(self.k.linear(x, self.main_proj), self.main_norm, self.args.norm_eps)
            for block in self.stages:
                block.attn.write_context(state, main_x, positions, n)
            return ()

        if graphs is not None and graphs.begin(rows.size(0), self._epoch()):
            graphs.run(("dspark-context", n, self._rings(state)), write, pos, rows)
        else:
            write(pos, rows)
        state.dspark_pos = first + n

    def _rings(self, state) -> tuple[tuple[int, int], ...]:
        """What a graph of the stages reads and writes of the state: the context rings, by address and size."""
        rings = [stage.attn.history(state).data for stage in self.stages]
        return tuple((t.data_ptr(), t.size(0)) for t in rings)

    def _epoch(self) -> tuple[int, ...]:
        """What the stages' graphs read by address besides weights and the state: the RoPE tables' versions."""
        return tuple(r.rebuilds for r in self.ropes)

    def draft(self, state, anchor: int, graphs: Replayer | None = None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """One draft round after the target row at position state.dspark_pos - 1 produced `anchor`.
        Returns ([anchor, d_1..d_B], logits [B, V] with the Markov bias added, raw confidence [B]).
        With `graphs` (the engine's store), once a whole window of context exists the stages and the head
        replay one CUDA graph per session (keyed by its context rings' addresses; one per stage when the stages'
        routed experts are off the device), and the Markov chain one more."""
        a = self.args
        b = a.dspark_block_size
        p0 = state.dspark_pos
        dev = self.embed.device
        ids = torch.tensor([anchor] + [a.dspark_noise_token_id] * (b - 1), device=dev)
        rows = b + (-b % self.k.row_tile)
        chunk = Chunk(state, torch.arange(p0, p0 + rows, device=dev), b, row_tile=self.k.row_tile, _p0=p0)
        self.stages[0].attn.rope.reserve(p0 + rows, dev)
        store = self.stages[0].ffn.store
        n_experts, topk = a.moe_experts(a.n_layers)
        fits = store is None or store.holds(min(rows * topk, n_experts))
        if (graphs is not None and graphs.begin(rows, self._epoch(), fits)
                and p0 >= a.window_size):
            key = ("dspark", b, self._rings(state))
            # routed experts from the expert store: a graph per stage, each stopping after its routing, the
            # stage's experts loaded into the store's slots before the next one runs them
            halts = 0 if store is None else len(self.stages)
            inputs: tuple[torch.Tensor, ...] = (ids,)
            for s in range(halts + 1):
                def fn(positions: torch.Tensor, *t: torch.Tensor, s: int = s) -> tuple[torch.Tensor, ...]:
                    local = replace(chunk, positions=positions, _shared={})
                    if s == 0:
                        return self._blocks(local, t[0], halt=halts > 0)
                    return self._blocks(local, resume=(s - 1, FfnInput(*t[:5]), t[5], t[6]), halt=s < halts)

                out = graphs.run((*key, s), fn, chunk.positions, *inputs)
                if s < halts:
                    inputs = (*out[:6], store.slots_for(a.n_layers + s, out[6]))
            tokens, logits, confidence = graphs.run(("dspark-chain", b), self._chain, ids, *out)
            logits, confidence = logits.clone(), confidence.clone()
        else:
            tokens, logits, confidence = self._chain(ids, *self._blocks(chunk, ids))
        return tokens.tolist(), logits, confidence

    def _chain(self, ids: torch.Tensor, x: torch.Tensor, logits: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequential Markov correction from the anchor ids[0], greedy (a draft only proposes: the target's
        verify decides every token), then the confidence head. On the device, token after token, so that a
        graph holds the chain and a draft reads its tokens back once. `logits` gets the biases in place."""
        tok, tokens, embeds = ids[:1], [ids[:1]], []
        for i in range(self.args.dspark_block_size):
            e = self.markov_embed[tok]
            logits[i] += self.k.linear(e.float(), self.markov_head)[0]
            tok = logits[i].argmax().view(1)
            tokens.append(tok)
            embeds.append(e)
        hidden = torch.cat([x[: len(embeds)], torch.cat(embeds)], dim=-1).float()
        return torch.cat(tokens), logits, self.k.linear(hidden, self.confidence)[: len(embeds), 0]

    def _blocks(self, chunk: Chunk, ids: torch.Tensor | None = None, *,
                resume: tuple[int, FfnInput, torch.Tensor, torch.Tensor] | None = None, halt: bool = False
                ) -> tuple[torch.Tensor, ...]:
        """The block rows through the stages, then the final norm (x [rows, D]) and the head (logits [B, V]).
        A draft replayed a stage at a time (routed experts in the expert store): `halt` stops after the next
        stage's routing and returns its FFN input, routing weights and expert ids; `resume` (the halted stage,
        its FFN input, weights and the ids remapped to the store's slots) first finishes that stage."""
        a = self.args
        start = 0
        if resume is None:
            rows = pad_rows(F.embedding(ids, self.embed), self.k.row_tile)
            h = rows.unsqueeze(1).repeat(1, a.hc_mult, 1)
            pre = torch.zeros(rows.size(0), a.hc_mult, device=rows.device)
            pre[:, 0] = 1.0
        else:
            start, ffn_in, weights, slots = resume
            block = self.stages[start]
            h, pre = block.finish(block.ffn.from_slots(ffn_in.x, weights, slots), ffn_in)
            start += 1
        for block in self.stages[start:]:
            if halt:
                ffn_in = block.attend(h, pre, chunk, joined=True)
                return (*ffn_in, *block.ffn.route(ffn_in.x, chunk))
            h, pre = block.forward(h, pre, chunk)
        x = self.k.rms_norm(hc_pre(self.k, h, pre), self.norm, a.norm_eps)
        return x, self.k.linear(x.float(), self.head)[: chunk.n]
