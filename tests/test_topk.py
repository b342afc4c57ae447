"""The indexer's top-k without a sort of the row gives the sorted rule's set: the k largest, ties to the
lowest index (invisible entries are -inf and tie too)."""

import pytest
import torch

from dsflash.model.attention import topk_lowest_index, topk_lowest_index_set

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_topk_set_is_the_sorted_rule(device):
    g = torch.Generator().manual_seed(0)
    for n, k in ((7, 3), (40, 8), (600, 512), (5000, 512), (64, 64), (64, 1)):
        scores = torch.randint(-4, 5, (9, n), generator=g).float()  # few distinct values: ties everywhere
        scores[0] = 1.0
        scores[1, n // 2:] = -torch.inf
        scores[2] = -torch.inf
        scores[3] = torch.randn(n, generator=g)
        scores = scores.to(device)
        want = topk_lowest_index(scores, k).sort(dim=-1).values
        assert torch.equal(topk_lowest_index_set(scores, k), want), (n, k)
