"""The FP4 caches as the state holds them: the model's storage format (288 B per compressed entry, 68 B
per index key at the released widths), made by quantising and read back as fake quantisation's bits."""

import pytest
import torch

from dsflash.numerics.packing import ENTRY, INDEX_KEY, dequant_packed, packed_width, quant_packed
from dsflash.numerics.quant import fp4_fake_quant


def rows_with_edges(n: int, d: int, seed: int) -> torch.Tensor:
    """Random rows over five decades, an all-zero row, negative zeros and E2M1 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 2, n).unsqueeze(1)
    x[3] = 0
    x[4, ::3] = -0.0
    x[5, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5,
                              -3.5, -5.0, 1e-30])  # amax 6: each value / scale sits on a rounding tie
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("fmt,d,size", [(ENTRY, 512, 288), (INDEX_KEY, 128, 68)])
def test_packed_rows_read_back_as_fake_quantisation(fmt, d, size):
    x = rows_with_edges(50, d, d)
    p = quant_packed(x, *fmt)
    assert p.shape == (50, size) and p.dtype == torch.uint8 and packed_width(d, fmt[0]) == size
    got, want = dequant_packed(p, d, *fmt), fp4_fake_quant(x, *fmt)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # -0 included
    assert torch.equal(dequant_packed(p[7:9], d, *fmt), got[7:9])


def test_a_packed_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="288 bytes, got 287"):
        dequant_packed(torch.zeros(2, 287, dtype=torch.uint8), 512, *ENTRY)
