"""Images over real HTTP with the official client: image_url data URLs, span tokens billed, the prefix cache
shared by equal images only, and a 400 for every bad image while the server keeps serving."""

from __future__ import annotations

import base64
import io
import math
import struct
import zlib

import numpy as np
import openai
import pytest
from PIL import Image

from serverproc import start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.xdist_group("test_image_api")]

NO_THINK = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-num-seqs", "4", "--kv-memory", "64MiB", "--limit-mm-per-prompt", '{"image": 2}')
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield srv, c
    c.close()
    stop_server(srv)


def png_bytes(w: int, h: int, seed: int) -> bytes:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def ask(client, url: str, text: str = "What is in the picture?", **kw):
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return client.chat.completions.create(model="tiny-v41", messages=[{"role": "user", "content": content}],
                                          max_tokens=4, temperature=0.0, extra_body=NO_THINK, **kw)


def span(w: int, h: int) -> int:
    """docs/architecture.md#image-preprocessing for images under min_pixels: upscaled by sqrt(544² / (w·h)), then
    rows·(cols + 1) + 2."""
    s = math.sqrt(295936 / (w * h))
    W, H = int(w * s), int(h * s)
    return math.ceil(math.ceil(H / 14) / 3) * (math.ceil(math.ceil(W / 14) / 3) + 1) + 2


def test_image_request_bills_its_span(server):
    _, client = server
    small = ask(client, data_url(png_bytes(200, 150, 0)))
    wide = ask(client, data_url(png_bytes(400, 120, 1)))
    assert small.choices[0].finish_reason == "length"
    assert span(200, 150) == 194 and span(400, 120) != 194
    assert small.usage.prompt_tokens - wide.usage.prompt_tokens == span(200, 150) - span(400, 120)


def test_equal_images_hit_the_prefix_cache_and_different_ones_do_not(server):
    srv, client = server

    def hit_rate() -> float:
        return next(v for k, v in srv.metrics().items() if k.startswith("flashserve_prefix_cache_hit_rate"))

    text = "Describe every detail you can see here, one by one, in order."
    first = ask(client, data_url(png_bytes(300, 300, 7)), text)
    base = hit_rate()
    ask(client, data_url(png_bytes(300, 300, 8)), text)  # same text and size, other pixels
    assert hit_rate() < base or hit_rate() == 0.0
    after_other = hit_rate()
    again = ask(client, data_url(png_bytes(300, 300, 7)), text)
    assert hit_rate() > after_other
    assert again.choices[0].message.content == first.choices[0].message.content


def header_only_png(w: int, h: int) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("url,message", [
    (data_url(b"\x89PNG garbage, not an image"), "not a readable image"),
    ("data:image/png;base64,@@@not base64@@@", "base64"),
    (data_url(header_only_png(20000, 20000)), "exceed the limit"),
    (data_url(header_only_png(0, 0)), "image"),
    (data_url(png_bytes(64, 64, 3)[:100]), "corrupt or truncated"),
    ("https://example.com/cat.png", "--allow-remote-images"),
    ("file:///etc/passwd", "data: URLs"),
])
def test_bad_images_get_a_400_and_the_server_keeps_serving(server, url, message):
    _, client = server
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, url)
    assert message in e.value.body["message"]
    assert e.value.body["param"] == "messages[0].content[1]" or "image_url" in e.value.body["param"]
    assert ask(client, data_url(png_bytes(64, 64, 4))).choices[0].finish_reason == "length"


def test_too_many_images_and_images_outside_user_messages_are_refused(server):
    _, client = server
    img = {"type": "image_url", "image_url": {"url": data_url(png_bytes(32, 32, 5))}}
    with pytest.raises(openai.BadRequestError, match="exceed the limit of 2"):
        client.chat.completions.create(model="tiny-v41", max_tokens=2, extra_body=NO_THINK,
                                       messages=[{"role": "user", "content": [img, img, img]}])
    with pytest.raises(openai.BadRequestError, match="user messages only"):
        client.chat.completions.create(model="tiny-v41", max_tokens=2, extra_body=NO_THINK,
                                       messages=[{"role": "system", "content": [img]},
                                                 {"role": "user", "content": "hi"}])


def test_anthropic_image_blocks(server):
    import anthropic

    srv, _ = server
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)

    def ask_claude(data: str, media: str = "image/png"):
        block = {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
        return client.messages.create(model="tiny-v41", max_tokens=3, thinking={"type": "disabled"},
                                      messages=[{"role": "user", "content": [
                                          {"type": "text", "text": "What is this?"}, block]}])

    small = ask_claude(base64.b64encode(png_bytes(200, 150, 0)).decode())
    counted = client.messages.count_tokens(model="tiny-v41", thinking={"type": "disabled"}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes(200, 150, 0)).decode()}}]}])
    assert counted.input_tokens == small.usage.input_tokens
    wide = ask_claude(base64.b64encode(png_bytes(400, 120, 1)).decode())
    assert small.stop_reason == "max_tokens"
    assert small.usage.input_tokens - wide.usage.input_tokens == span(200, 150) - span(400, 120)
    with pytest.raises(anthropic.BadRequestError) as e:
        ask_claude("%%% not base64 %%%")
    assert e.value.body["type"] == "error" and "base64" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="not a readable image"):
        ask_claude(base64.b64encode(b"GIF89a broken").decode(), "image/gif")
    client.close()
