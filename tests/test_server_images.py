"""Images through the HTTP APIs (OpenAI image_url parts, Anthropic image blocks, Responses input_image),
on a tiny vision-enabled checkpoint served by a real server process."""

from __future__ import annotations

import base64
import dataclasses
import io
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import serve_app

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
PIL = pytest.importorskip("PIL")

ROOT = Path(__file__).resolve().parents[1]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}

def png(seed: int, w: int = 84, h: int = 56) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dsflash.checkpoint.make import make_checkpoint
    from dsflash.config import PRESETS
    from dsflash.tokenizer import build_tiny_tokenizer, compressed_token_map

    tmp = tmp_path_factory.mktemp("vl")
    tokenizer = build_tiny_tokenizer(512)
    args = dataclasses.replace(PRESETS["tiny-a"], vision_n_layers=2, vision_dim=128, vision_n_heads=2,
                               vision_inter_dim=352, vision_min_pixels=3136, vision_max_n_token=64,
                               image_token_id=496, max_seq_len=2048,
                               engram_compressed_vocab_size=compressed_token_map(tokenizer)[1])
    ckpt = make_checkpoint(args, 3, tmp / "ckpt")
    tokenizer.save(str(ckpt / "tokenizer.json"))
    proc, base = serve_app(ckpt, tmp, 2048, "tiny-vl", 16)
    yield base
    proc.kill()
    proc.wait()


def chat_body(image_b64: str) -> dict:
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image_b64}"}}]
    return {"model": "tiny-vl", "max_tokens": 3, "temperature": 0, **NO_THINK,
            "messages": [{"role": "user", "content": content}]}


def test_openai_image_chat_counts_the_span_and_caches_by_image(server):
    first = httpx.post(server + "/v1/chat/completions", json=chat_body(png(1)), timeout=60).json()
    span = 2 * (2 + 1) + 2  # an 84x56 image: a 2x2 aligner grid, rows + newlines, start and end
    text_only = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        **chat_body(png(1)), "messages": [{"role": "user", "content": "What is in this picture?"}]}).json()
    assert first["usage"]["prompt_tokens"] >= text_only["usage"]["prompt_tokens"] + span
    again = httpx.post(server + "/v1/chat/completions", json=chat_body(png(1)), timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    other = httpx.post(server + "/v1/chat/completions", json=chat_body(png(2)), timeout=60).json()
    # the other image's prompt has the same token ids; only text before the image may be reused
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"] - span


def test_anthropic_and_responses_images(server):
    claude = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0)
    m = claude.messages.create(model="tiny-vl", max_tokens=3, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png(3)}},
        {"type": "text", "text": "Describe it."}]}])
    assert m.usage.input_tokens > 10
    oai = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    r = oai.responses.create(model="tiny-vl", max_output_tokens=3, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "image_url": f"data:image/png;base64,{png(3)}"}]}])
    assert r.usage.input_tokens > 10


def test_bad_images_are_400_naming_the_field(server):
    for url, needle in (("https://example.com/cat.png", "data: URLs"), ("data:image/png;base64,@@@", "base64"),
                        (f"data:image/png;base64,{base64.b64encode(b'not an image').decode()}", "readable")):
        body = chat_body(png(1))
        body["messages"][0]["content"][1]["image_url"]["url"] = url
        r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and needle in r.text and "messages[0].content[1]" in r.text, r.text


@pytest.mark.slow  # ~10 s; the server's image tests stay
def test_generate_cli_with_an_image(tmp_path_factory, server):
    """`dsflash generate --image` on the same tiny vision checkpoint the server uses (made by the fixture)."""
    import json
    import subprocess
    import sys

    ckpt = next(Path(p) for p in tmp_path_factory.getbasetemp().glob("vl*/ckpt"))
    image = tmp_path_factory.mktemp("img") / "x.png"
    image.write_bytes(base64.b64decode(png(5)))
    cmd = [sys.executable, "-m", "dsflash.cli", "generate", "--model", str(ckpt), "--prompt", "Describe it.",
           "-n", "3", "--json", "--device", "cpu"]
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with_image = json.loads(subprocess.run(cmd + ["--image", str(image)], env=env, capture_output=True, text=True,
                                           check=True).stdout)
    without = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
    assert with_image["prompt_tokens"] == without["prompt_tokens"] + 8  # a 2x2 aligner grid's span
