"""DeepSeek-V4.1 vision path: image preprocessing, the ViT, the 3x3 aligner and the image span.

An image becomes an `n_vit_h x n_vit_w` grid of 14x14 patches. The ViT (patch linear, blocks of
full bidirectional attention with a 2-D RoPE and a SwiGLU MLP, final RMSNorm) gives one row per patch;
the aligner folds each 3x3 cell of that grid (zero-padded at the bottom / right) into one LM-width row,
`n_llm_h x n_llm_w` rows in reading order. The LM sees the image as the span

    IMAGE_START, (IMAGE x n_llm_w, IMAGE_NEW_LINE) x n_llm_h, IMAGE_END

(every position carrying `image_token_id`; token types tell them apart): the IMAGE slots take the
aligner rows, the delimiters the learned vectors `image_start` / `image_newline` / `image_end`.

Rounding points are those of DeepSeek's reference (`inference/vision.py`), checked bit for bit on CPU
against the golden image case: bf16 activations; every linear bf16 x bf16 with fp32 accumulation and the
bias added before the one rounding to bf16 (torch's `F.linear` with bias, as the reference calls it);
RMSNorm eps 1e-6 with fp32 statistics and an fp32 weight (stored bf16, widened); RoPE in fp32, rounded
to bf16 after the rotation; attention in fp32 (q and k each scaled by head_dim^-1/4, fp32 softmax, fp32
P.V, one rounding to bf16: torch's math path of `scaled_dot_product_attention`); silu(gate) * up in
bf16; exact (erf) GELU in the aligner; residual adds in bf16.

The tower runs one whole image per call, never a chunk of one, so it needs no row padding for batch
invariance (the LM's chunking does not reach it).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from dsflash.config import ModelArgs
from dsflash.model.weights import WeightLoader

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3  # token types
NORM_EPS = 1e-6  # the ViT's RMSNorm epsilon (not the LM's norm_eps)
PAD_GREY = (127, 127, 127)  # fill of the letterbox when an image is padded to its patch grid


def llm_grid(n_vit_h: int, n_vit_w: int, ratio: int) -> tuple[int, int]:
    """Aligner grid of a patch grid: each side divided by the downsample ratio, rounded up."""
    return -(-n_vit_h // ratio), -(-n_vit_w // ratio)


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Positions one image takes in the token stream: its rows, one newline each, start and end."""
    return n_llm_h * (n_llm_w + 1) + 2


def image_token_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """int64 token types of one image's span (START, rows of IMAGE x n_llm_w + NEW_LINE, END)."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return torch.tensor([IMAGE_START, *row * n_llm_h, IMAGE_END], dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# preprocessing (the reference's `image_processor.load_image`)
# ---------------------------------------------------------------------------------------------
@dataclass
class ImageInput:
    """One preprocessed image: the ViT input and its grids."""

    pixels: torch.Tensor  # bf16 [n_vit_h * n_vit_w, 3, p, p], patch index = row * n_vit_w + col
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def types(self) -> torch.Tensor:
        return image_token_types(self.n_llm_h, self.n_llm_w)


def _fit_token_budget(height: int, width: int, args: ModelArgs) -> tuple[int, int]:
    """Largest aspect-preserving pixel size (multiples of the patch) whose span fits vision_max_n_token.

    With aspect a = h / w and w_t tokens a row, the span costs about a w_t (w_t + 1) + 2 tokens; w_t is the
    positive root of a w_t^2 + a w_t = budget - 2, h_t = a w_t. Degenerate shapes collapse to one column
    (very tall) or one row (very wide)."""
    p, budget = args.vision_patch_size, args.vision_max_n_token
    cell = p * args.vision_downsample_ratio
    aspect = height / width
    tokens_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    tokens_h = tokens_w * aspect
    if tokens_w < 1.0:
        return (budget - 2) // 2 * cell, cell
    if tokens_h < 1.0:
        return cell, (budget - 3) * cell
    scale = min(math.floor(tokens_w) * cell / width, math.floor(tokens_h) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_image(width: int, height: int, args: ModelArgs) -> tuple[int, int]:
    """Pixel size (height, width) an image of this original size is brought to: wide images clipped to
    vision_max_wh_ratio, small ones scaled up to vision_min_pixels, each side rounded up to a multiple of
    the patch, then shrunk if the span would exceed vision_max_n_token."""
    p, r = args.vision_patch_size, args.vision_downsample_ratio
    if args.vision_max_wh_ratio is not None and width > height * args.vision_max_wh_ratio:
        width = height * args.vision_max_wh_ratio
    if 0 < width * height < args.vision_min_pixels:
        grow = (args.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * grow), int(height * grow)
    h_px, w_px = -(-height // p) * p, -(-width // p) * p
    if span_length(*llm_grid(h_px // p, w_px // p, r)) > args.vision_max_n_token:
        h_px, w_px = _fit_token_budget(height, width, args)
        assert span_length(*llm_grid(h_px // p, w_px // p, r)) <= args.vision_max_n_token
    return h_px, w_px


def preprocess_image(image, args: ModelArgs) -> ImageInput:
    """An image (bytes, a path, or a PIL image) -> the ViT input: RGB, brought to the planned size
    (letterboxed on grey 127 with an aspect-preserving bicubic resize, or plainly resized when wider than
    vision_max_wh_ratio), values ((v / 255) - 0.5) / 0.5 in fp32 rounded to bf16, cut into patches."""
    from PIL import Image, ImageOps  # only the preprocessing needs Pillow

    if isinstance(image, bytes | bytearray):
        image = Image.open(io.BytesIO(image))
    elif isinstance(image, str | os.PathLike):
        image = Image.open(image)
    rgb = image.convert("RGB")
    p, r = args.vision_patch_size, args.vision_downsample_ratio
    h_px, w_px = plan_image(rgb.width, rgb.height, args)
    if args.vision_max_wh_ratio is not None and rgb.width >= args.vision_max_wh_ratio * rgb.height:
        rgb = rgb.resize((w_px, h_px))
    else:
        rgb = ImageOps.pad(rgb, (w_px, h_px), color=PAD_GREY)
    x = torch.from_numpy(np.asarray(rgb, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    n_h, n_w = h_px // p, w_px // p
    pixels = x.reshape(3, n_h, p, n_w, p).permute(1, 3, 0, 2, 4).reshape(n_h * n_w, 3, p, p)
    return ImageInput(pixels, n_h, n_w, *llm_grid(n_h, n_w, r))


# ---------------------------------------------------------------------------------------------
# the tower
# ---------------------------------------------------------------------------------------------
@lru_cache(16)
def _rope_table(n_h: int, n_w: int, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos / sin [n_h * n_w, 1, rope_dim]: patch (r, c) turns by r * f_j in the first half of the
    angles and by c * f_j in the second, f_j = theta^(-2j / rope_dim)."""
    freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    row = torch.arange(n_h).repeat_interleave(n_w).float()
    col = torch.arange(n_w).repeat(n_h).float()
    angles = torch.cat([row[:, None] * freq, col[:, None] * freq], dim=-1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """2-D RoPE on [n, heads, head_dim]: element i pairs with i + head_dim/2 (not adjacent pairs), in fp32."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class _Linear:
    """A bf16 linear with an optional bias, applied as the reference applies it (one rounding)."""

    def __init__(self, w: WeightLoader, prefix: str, bias: bool = True):
        self.weight = w.tensor(prefix + ".weight", torch.bfloat16)
        self.bias = w.tensor(prefix + ".bias", torch.bfloat16) if bias else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + NORM_EPS))).to(x.dtype)


class _ViTBlock:
    def __init__(self, args: ModelArgs, w: WeightLoader, prefix: str):
        self.heads = args.vision_n_heads
        self.head_dim = args.vision_dim // args.vision_n_heads
        self.norm1 = w.tensor(prefix + "norm1.weight", torch.float32)
        self.norm2 = w.tensor(prefix + "norm2.weight", torch.float32)
        self.wqkv = _Linear(w, prefix + "attn.wqkv")
        self.wo = _Linear(w, prefix + "attn.wo")
        self.w1 = _Linear(w, prefix + "mlp.w1", bias=False)  # gate | up
        self.w2 = _Linear(w, prefix + "mlp.w2", bias=False)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        q, k, v = (t.view(n, self.heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = _rotate_halves(q, cos, sin), _rotate_halves(k, cos, sin)
        # torch's math path of SDPA: fp32, the softmax scale split as a square root onto q and k
        half_scale = (1.0 / math.sqrt(self.head_dim)) ** 0.5
        qf = q.transpose(0, 1).float() * half_scale
        kf = k.transpose(0, 1).float() * half_scale
        probs = torch.matmul(qf, kf.transpose(-2, -1)).softmax(dim=-1)
        o = torch.matmul(probs, v.transpose(0, 1).float()).to(x.dtype)  # [heads, n, head_dim]
        return self.wo(o.transpose(0, 1).reshape(n, -1))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(_rms_norm(x, self.norm1), cos, sin)
        gate, up = self.w1(_rms_norm(x, self.norm2)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Vision:
    """ViT + aligner + the span delimiters, built from the checkpoint (`vision.*`, `aligner.*`,
    `image_start` / `image_newline` / `image_end`)."""

    def __init__(self, args: ModelArgs, w: WeightLoader):
        self.args = args
        self.device = w.k.device
        self.patch = args.vision_patch_size
        self.ratio = args.vision_downsample_ratio
        self.rope_dim = args.vision_dim // args.vision_n_heads // 2
        self.patch_embed = _Linear(w, "vision.patch_embed.proj")
        self.blocks = [_ViTBlock(args, w, f"vision.blocks.{b}.") for b in range(args.vision_n_layers)]
        self.norm = w.tensor("vision.norm.weight", torch.float32)
        self.aligner_w1 = _Linear(w, "aligner.w1")
        self.aligner_w2 = _Linear(w, "aligner.w2")
        self.delimiters = {t: w.tensor(name, torch.bfloat16) for t, name in
                           ((IMAGE_START, "image_start"), (IMAGE_NEW_LINE, "image_newline"), (IMAGE_END, "image_end"))}

    def rope(self, n_vit_h: int, n_vit_w: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = _rope_table(n_vit_h, n_vit_w, self.rope_dim, float(self.args.vision_rope_theta))
        return cos.to(self.device), sin.to(self.device)

    def vit(self, pixels: torch.Tensor, n_vit_h: int, n_vit_w: int, trace: dict | None = None) -> torch.Tensor:
        """pixels [n_patch, 3, p, p] (rounded to bf16) -> bf16 [n_patch, vision_dim] after the final norm."""
        x = pixels.to(device=self.device, dtype=torch.bfloat16).flatten(1)  # (channel, y, x) order
        if x.size(0) != n_vit_h * n_vit_w or x.size(1) != 3 * self.patch**2:
            raise ValueError(f"pixels {tuple(pixels.shape)} do not hold a {n_vit_h}x{n_vit_w} grid of "
                             f"3x{self.patch}x{self.patch} patches")
        x = self.patch_embed(x)
        if trace is not None:
            trace["vit_patch_embed"] = x
        cos, sin = self.rope(n_vit_h, n_vit_w)
        for block in self.blocks:
            x = block(x, cos, sin)
            if trace is not None:
                trace.setdefault("vit_block_out", []).append(x)
        return _rms_norm(x, self.norm)

    def unfold(self, vit_out: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """ViT rows -> aligner input [n_llm_h * n_llm_w, vision_dim * r * r]: the grid zero-padded at the bottom /
        right to multiples of r, each r x r cell flattened channel-major (column c * r * r + dy * r + dx), cells in
        reading order."""
        r, c = self.ratio, vit_out.size(-1)
        n_llm_h, n_llm_w = llm_grid(n_vit_h, n_vit_w, r)
        grid = vit_out.new_zeros(n_llm_h * r, n_llm_w * r, c)
        grid[:n_vit_h, :n_vit_w] = vit_out.view(n_vit_h, n_vit_w, c)
        cells = grid.view(n_llm_h, r, n_llm_w, r, c).permute(0, 2, 4, 1, 3)  # [cell row, cell col, c, dy, dx]
        return cells.reshape(n_llm_h * n_llm_w, c * r * r)

    def align(self, vit_out: torch.Tensor, n_vit_h: int, n_vit_w: int, trace: dict | None = None) -> torch.Tensor:
        """ViT rows -> LM-width rows [n_llm_h * n_llm_w, dim] bf16, reading order: w1 (+bias), erf GELU, w2 (+bias)."""
        x = self.unfold(vit_out, n_vit_h, n_vit_w)
        hidden = F.gelu(self.aligner_w1(x))
        if trace is not None:
            trace["aligner_in"], trace["aligner_hidden"] = x, hidden
        return self.aligner_w2(hidden)

    def encode(self, pixels: torch.Tensor, n_vit_h: int, n_vit_w: int,
               trace: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One image: (vit_out bf16 [n_patch, vision_dim], aligner_out bf16 [n_llm_h * n_llm_w, dim])."""
        vit_out = self.vit(pixels, n_vit_h, n_vit_w, trace)
        return vit_out, self.align(vit_out, n_vit_h, n_vit_w, trace)

    def merge(self, rows: torch.Tensor, token_types: torch.Tensor, image_rows: torch.Tensor | None) -> torch.Tensor:
        """LM input rows [n, dim] with the span positions replaced: delimiters by the learned vectors, IMAGE
        positions by image_rows ([count of IMAGE positions, dim], reading order). Text rows are kept."""
        out = rows.clone()
        for t, vector in self.delimiters.items():
            out[token_types == t] = vector.to(out.dtype)
        slots = token_types == IMAGE
        count = int(slots.sum())
        given = 0 if image_rows is None else image_rows.size(0)
        if given != count:
            raise ValueError(f"{count} IMAGE positions in the chunk, {given} image rows given")
        if count:
            out[slots] = image_rows.to(device=out.device, dtype=out.dtype)
        return out
