"""The trainer on a GPU: backbone and DSpark windows replayed as CUDA graphs (dsflash/train/graph.py) train
exactly as the same windows launched eagerly -- the same losses and the same masters, bit for bit, after
several steps of each phase, one window a step and two (a step's gradients summed over its windows' replays)."""

import numpy as np
import pytest
import torch

from dsflash.train.loop import PAD_ID, Plan, Trainer, smoke_args

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB, CLASSES = 512, 100


def _trained(graphs: bool, batch: int) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    # token ids and facts of a seeded generator (the GPU machine has no `tokenizers` for the tiny tokenizer)
    rng = np.random.default_rng(0)
    token_map = [PAD_ID % CLASSES if i == PAD_ID else i % CLASSES for i in range(VOCAB)]
    tokens = rng.integers(3, VOCAB, 20_000).astype(np.uint16)
    facts = [{"statement": rng.integers(3, VOCAB, 12).tolist(), "cue": rng.integers(3, VOCAB, 4).tolist(),
              "answer": rng.integers(3, VOCAB, 2).tolist()} for _ in range(8)]
    plan = Plan(seq_len=256, steps=4, dspark_steps=3, anchors=16, batch=batch, graphs=graphs, index_rows=64,
                answer_weight=1.0, fact_span=128, repeat_share=0.3, eval_every=1000)
    t = Trainer(smoke_args(VOCAB, CLASSES), token_map, tokens, tokens, plan, "cuda", facts)
    t.backbone(deadline=float("inf"))
    t.dspark(deadline=float("inf"))
    return [row["train_loss"] for row in t.log.rows], {n: p.detach().clone() for n, p in t.masters.params.items()}, t


@pytest.mark.parametrize("batch", [1, 2])
def test_a_graphed_window_trains_as_the_eager_one(batch):
    torch.use_deterministic_algorithms(True, warn_only=True)
    losses, masters, t = _trained(graphs=True, batch=batch)
    assert t.replays == (4 + 3) * batch - 2  # every window after each phase's first was a replay
    eager_losses, eager_masters, _ = _trained(graphs=False, batch=batch)
    assert losses == eager_losses
    assert all(torch.equal(masters[n], eager_masters[n]) for n in masters)


def test_the_sinkhorn_kernels_give_autograds_gradients_on_the_gpu():
    """train/backend.py _Sinkhorn (the split's forward kernel keeping its states, its backward kernel) against
    autograd through the reference's torch ops on the same GPU, and the same bits twice."""
    from dsflash.kernels import cpu
    from dsflash.train.backend import _Sinkhorn

    g = torch.Generator(device="cuda").manual_seed(0)
    mixes = torch.randn(4099, 24, generator=g, device="cuda")
    scale, base = torch.rand(3, generator=g, device="cuda") + 0.5, torch.randn(24, generator=g, device="cuda") * 0.5
    weights = [torch.randn(4099, *shape, generator=g, device="cuda") for shape in ((4,), (4,), (4, 4))]

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (mixes, scale, base)]
        sum((o * w).sum() for o, w in zip(fn(*leaves, 4, 20, 1e-6), weights, strict=True)).backward()
        return [t.grad for t in leaves]

    got, again, ref = grads(_Sinkhorn.apply), grads(_Sinkhorn.apply), grads(cpu.hc_split_sinkhorn)
    for a, b, r in zip(got, again, ref, strict=True):
        assert torch.equal(a, b) and float((a - r).norm() / r.norm()) < 1e-5


def test_the_sparse_attention_backward_is_deterministic_on_the_gpu():
    """train/backend.py _SparseAttention on a GPU (the kv rows' gradient by integer atomics): the same bits twice,
    within bf16 rounding of the CPU's gradients, at a trained_args-like shape (a 128-token window, 64 picks)."""
    from dsflash.train.backend import _SparseAttention

    g = torch.Generator().manual_seed(0)
    n, h, d = 2048, 4, 64
    q, kv = torch.randn(n, h, d, generator=g).bfloat16(), torch.randn(n + 512, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    window = torch.arange(n).unsqueeze(1) + torch.arange(128) - 127
    idx = torch.cat([torch.where(window >= 0, window, -1), n + torch.randint(0, 512, (n, 64), generator=g)], 1)
    probe = torch.randn(n, h, d, generator=g)

    def grads(device):
        leaves = [t.to(device).requires_grad_() for t in (q, kv, sink)]
        (_SparseAttention.apply(*leaves, idx.to(device), d ** -0.5).float() * probe.to(device)).sum().backward()
        return [t.grad.cpu().double() for t in leaves]

    got, again, ref = grads("cuda"), grads("cuda"), grads("cpu")
    for a, b, r in zip(got, again, ref, strict=True):
        assert torch.equal(a, b) and float((a - r).norm() / r.norm()) < 1e-2
