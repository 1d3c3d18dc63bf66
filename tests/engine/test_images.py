"""Images through the engine: span expansion, embeddings merged exactly as the whole-sequence forward merges
them (chunks splitting a span included), prefix-cache keys that tell images apart, and refusals."""

import io
import struct
import zlib

import pytest
import torch
from PIL import Image

from engine_helpers import make_engine
from flashserve.engine import SamplingParams
from flashserve.engine.images import ImageError, load_images, ImageLimits

NAME = "tiny-v41"
PLACEHOLDER = "<｜deepseek_image｜>"


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def photo(seed: int, size=(200, 150)) -> bytes:
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    return png(Image.fromarray(arr))


def generate(engine, prompt, images, n=6, rid="r"):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), images=images)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no output")


@torch.inference_mode()
def reference(model, ids, embeds, n):
    """Greedy continuation by whole-sequence forwards with the span rows merged: no cache, no chunks."""
    ids = list(ids)
    for _ in range(n):
        e = torch.cat([embeds, embeds.new_zeros(len(ids) - embeds.shape[0], embeds.shape[1])])
        logits = model(torch.tensor([ids]), image_embeds=e[None], logits_rows=1).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[-n:]


def test_image_request_equals_the_whole_sequence_forward(models):
    """Exact prefill in chunks of 64 (the 194-position span crosses three chunk edges and the window)."""
    model = models(NAME)
    engine = make_engine(model, NAME, exact_prefill=True, prefill_chunk=64, max_num_batched_tokens=64)
    ids = engine.tokenizer.encode(f"look {PLACEHOLDER} and tell")
    out = generate(engine, ids, [photo(1)])
    group_ids = out.prompt_token_ids
    span = [i for i, t in enumerate(group_ids) if t == model.cfg.image_token_id]
    # 200x150 is upscaled to 628x471 (min_pixels): 45x34 patches, 12 rows of 15 cells, each row + newline
    assert len(span) == 12 * 16 + 2 and span == list(range(span[0], span[0] + len(span)))
    inp = load_images([photo(1)], model.cfg.vision, ImageLimits())[0]
    with torch.inference_mode():
        rows = model.embed_image(inp.patches.double(), inp.grid.patches)
    embeds = torch.zeros(len(group_ids), model.cfg.hidden_size, dtype=torch.float64)
    embeds[span[0]:span[0] + len(span)] = rows
    assert out.outputs[0].token_ids == reference(model, group_ids, embeds, 6)
    # the image matters: the same prompt with another image answers differently
    other = generate(engine, ids, [photo(2)], rid="other")
    assert other.outputs[0].token_ids != out.outputs[0].token_ids


def test_equal_images_share_cached_pages_and_different_ones_never_do(models):
    model = models(NAME)
    engine = make_engine(model, NAME)
    ids = engine.tokenizer.encode(f"{PLACEHOLDER} caption:")
    cold = generate(engine, ids, [photo(3)], rid="a").outputs[0].token_ids
    hits0 = engine.scheduler.prefix_hit_tokens
    generate(engine, ids, [photo(4)], rid="b")  # same ids, another image: the first page holds the span
    assert engine.scheduler.prefix_hit_tokens == hits0
    warm = generate(engine, ids, [photo(3)], rid="c").outputs[0].token_ids
    assert engine.scheduler.prefix_hit_tokens > hits0
    assert warm == cold
    assert engine.stats()["kv_pages_used"] == 0


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width``x``height`` (a decompression bomb's shape) with almost no data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data,message", [
    (b"not an image at all", "not a readable image"),
    (header_only_png(20000, 20000), "pixels exceed the limit"),
    (photo(5)[:200], "corrupt or truncated"),
    (b"", "no bytes"),
    (None, "format GIF is not accepted"),
])
def test_bad_images_are_refused_and_the_engine_keeps_serving(models, data, message):
    model = models(NAME)
    engine = make_engine(model, NAME)
    if data is None:
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, "GIF")
        data = buf.getvalue()
    ids = engine.tokenizer.encode(f"{PLACEHOLDER} hi")
    with pytest.raises(ImageError, match=message):
        engine.add_request("bad", ids, SamplingParams(max_tokens=2), images=[data])
    assert not engine.has_unfinished_requests()
    assert len(generate(engine, ids, [photo(6)]).outputs[0].token_ids) == 6


def test_placeholders_must_match_the_images(models):
    model = models(NAME)
    engine = make_engine(model, NAME)
    with pytest.raises(ImageError, match="2 image placeholders for 1 images"):
        engine.add_request("x", engine.tokenizer.encode(f"{PLACEHOLDER}{PLACEHOLDER}"), images=[photo(7)])
    limits = engine.image_limits
    with pytest.raises(ImageError, match="exceed the limit of"):
        engine.add_request("y", engine.tokenizer.encode(PLACEHOLDER * (limits.max_images + 1)),
                           images=[photo(7)] * (limits.max_images + 1))


def test_a_model_without_a_vision_tower_serves_text_and_refuses_images(models, tmp_path):
    from flashserve.model.checkpoint import save_checkpoint
    from flashserve.model.loader import load_model

    model = models(NAME)
    text_only = {n: t for n, t in model.checkpoint_tensors().items()
                 if not n.startswith(("vision.", "aligner.", "image_"))}
    save_checkpoint(text_only, tmp_path, model.cfg, quantize=False)
    loaded = load_model(tmp_path, dtype=torch.float64, with_mtp=False)
    assert loaded.vision is None
    engine = make_engine(loaded, str(tmp_path))
    ids = engine.tokenizer.encode(f"{PLACEHOLDER} hi")
    with pytest.raises(ImageError, match="reads text only"):
        engine.add_request("img", ids, images=[photo(8)])
    assert len(generate(engine, engine.tokenizer.encode("hi"), []).outputs[0].token_ids) == 6


def test_offline_llm_takes_vllm_style_multimodal_prompts():
    from flashserve import LLM

    llm = LLM(NAME, dtype="float64", kv_memory="16MiB", exact_prefill=True, enforce_eager=True)
    img = Image.open(io.BytesIO(photo(9)))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    text = f"see {PLACEHOLDER} now"
    as_pil, as_bytes = llm.generate([{"prompt": text, "multi_modal_data": {"image": img}},
                                     {"prompt": text, "multi_modal_data": {"image": [photo(9)]}}], sp)
    assert as_pil.outputs[0].token_ids == as_bytes.outputs[0].token_ids
    assert len(as_pil.prompt_token_ids) > 100  # the span, not one placeholder
    with pytest.raises(ImageError, match="1 image placeholders for 0 images"):
        llm.generate({"prompt": text}, sp)
