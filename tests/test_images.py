"""Images through the engine (session, encoder-only prefill, prefix cache) on the golden image case's
checkpoint: the same bits whatever the chunking, those of DeepSeek's one-shot prefill with the lowest-index
tie rule where this CPU stack computes the reference's bits (tests/golden_stack.py), and cache keys that tell
images apart."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from dsflash.engine.images import ImageSpan
from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.session import Engine
from dsflash.model.vision import ImageInput, preprocess_image
from tests.conftest import TEXT_CASE
from tests.conftest import VISION_CASE as CASE
from tests.golden_stack import router_probe


@pytest.fixture(scope="module")
def case():
    assert (CASE / "golden.safetensors").exists(), f"no image case at {CASE}"
    return Engine.load(CASE, max_context=4096), load_file(str(CASE / "golden.safetensors"))


def span_of(g) -> ImageSpan:
    n_vit_h, n_vit_w, n_llm_h, n_llm_w = (int(v) for v in g["image0.grid"])
    pixels = torch.from_numpy(g["image0.pixels"]).to(torch.bfloat16)
    return ImageSpan(int(g["image0.span"][0]), ImageInput(pixels, n_vit_h, n_vit_w, n_llm_h, n_llm_w))


@pytest.fixture(scope="module")
def one_shot(case):
    """The whole image prompt in one chunk; where this CPU stack sums the router as the golden machine did,
    exactly the reference's last logits row, elsewhere within the golden PASS envelope (max |Δ| <= 0.5) with
    the same top token."""
    engine, g = case
    ids = g["full.input_ids"].tolist()
    logits = engine.session().prefill(ids, chunk=len(ids), images=[span_of(g)])
    ref = torch.from_numpy(g["full_lowtie.logits"][-1])
    if router_probe(TEXT_CASE).reproduced:
        assert torch.equal(logits, ref)
    else:
        assert float((logits.double() - ref.double()).abs().max()) <= 0.5 and logits.argmax() == ref.argmax()
    return logits


@pytest.mark.parametrize("chunk", [60, 7, 25])
def test_prefill_with_an_image_equals_the_one_shot_whatever_the_chunks(case, one_shot, chunk):
    engine, g = case
    ids = g["full.input_ids"].tolist()
    logits = engine.session().prefill(ids, chunk=chunk, images=[span_of(g)])
    assert torch.equal(logits, one_shot)


def test_image_changes_the_answer_and_the_cache_key(case, tmp_path):
    engine, g = case
    ids = g["full.input_ids"].tolist()
    span = span_of(g)
    other = ImageSpan(span.start, ImageInput(-span.image.pixels, *(span.image.n_vit_h, span.image.n_vit_w,
                                                                   span.image.n_llm_h, span.image.n_llm_w)))
    cache = PrefixCache(engine.identity, engine.numerics, disk_dir=tmp_path)
    a = engine.session().sync(ids, images=[span], cache=cache, chunk=16).logits
    again = engine.session().sync(ids, images=[span], cache=cache, chunk=16)
    b = again.logits
    assert again.reused == len(ids) and torch.equal(a, b)
    changed = engine.session().sync(ids, images=[other], cache=cache, chunk=16)
    c = changed.logits
    assert changed.reused <= span.start  # nothing past the image is reused for another image
    assert not torch.equal(a, c)


def test_png_preprocessing_gives_the_stored_pixels(case):
    engine, g = case
    from PIL import Image

    image = Image.fromarray(np.asarray(g["image0.rgb_u8"]))
    got = preprocess_image(image, engine.args)
    assert torch.equal(got.pixels.float(), torch.from_numpy(g["image0.pixels"]))


def test_wrong_spans_are_refused(case):
    engine, g = case
    ids = g["full.input_ids"].tolist()
    span = span_of(g)
    with pytest.raises(ValueError, match="image token id"):
        engine.session().prefill([5] * len(ids), images=[span])
    with pytest.raises(ValueError, match="not inside"):
        engine.session().prefill(ids[:22], images=[span])
    assert Path(CASE).exists()


@pytest.mark.slow  # ~9 s; test_split covers split == one process
def test_split_with_an_image_equals_one_process(case, tmp_path):
    """The box runs the vision tower: an image prompt through a box process gives the same bits, and a
    box restarted mid-answer is rebuilt with the image (the back side keeps its pixels)."""
    from dsflash.engine.sampling import SamplingParams
    from dsflash.engine.spec import decode
    from dsflash.split.link import box_half
    from tests.test_split import BoxProcess, decode_across_box_restart, free_port

    engine, g = case
    ids = g["full.input_ids"].tolist()
    local = engine.session()
    expected_logits = local.prefill(ids, chunk=16, images=[span_of(g)])
    expected = list(decode(local, expected_logits, 6, SamplingParams(), stop=set()))
    box = BoxProcess(free_port(), cache_dir=tmp_path / "cache", case=CASE).start()
    try:
        split = Engine.load(CASE, max_context=4096, encoder=box_half(f"127.0.0.1:{box.port}"))
        s = split.session()
        logits = s.prefill(ids, chunk=16, images=[span_of(g)])
        assert torch.equal(logits, expected_logits)
        assert decode_across_box_restart(box, s, logits, 6, restart_after=2) == expected
        assert split.encoder.link.reconnects >= 1
    finally:
        box.kill()
