"""The FP4 caches pack losslessly into the model's storage format (288 B per compressed entry, 68 B per
index key at the released widths)."""

import torch

from dsflash.numerics.packing import pack, unpack
from dsflash.numerics.quant import fp4_fake_quant


def test_fake_quantised_rows_pack_losslessly_at_released_widths():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 512, generator=g) * torch.logspace(-3, 2, 50).unsqueeze(1)).to(torch.bfloat16)
    x[3] = 0  # an all-zero entry
    entries = fp4_fake_quant(x, 16, e4m3_scale=True)
    keys = fp4_fake_quant(x[:, :128].contiguous(), 32, e4m3_scale=False)
    for values, fmt, size in ((entries, "fp4_e4m3_16", 288), (keys, "fp4_e8m0_32", 68)):
        p = pack(values, fmt)
        assert p.shape == (50, size) and p.dtype == torch.uint8
        assert torch.equal(unpack(p, fmt, values.size(1)).view(torch.int16), values.view(torch.int16))


def test_values_that_are_not_fp4_do_not_pack():
    assert pack(torch.full((2, 32), 0.3).to(torch.bfloat16) + torch.arange(32) * 1e-2, "fp4_e8m0_32") is None
