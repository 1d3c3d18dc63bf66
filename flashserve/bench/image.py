"""Image prefill against text prefill of the same length (docs/images.md).

    python -m flashserve.bench.image [--repeats 5] [--threads 2] [--size 4000x3000]

On ``tiny-v41`` (random weights, float32): one image whose span is shrunk to the 1024-token budget, against a
text prompt of exactly as many tokens, each prefilled by a fresh request (prefix caching off) to its first
token, alternating, medians of ``--repeats``. Reports both rates, their ratio, and the shares of the image
request spent decoding/resizing the image (Pillow) and in the vision tower + aligner.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import torch


def _image_bytes(w: int, h: int) -> bytes:
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, "JPEG", quality=90)  # a photo-sized file, not 36 MB of noise
    return buf.getvalue()


def _first_token_s(engine, prompt: list[int], images: list) -> float:
    from ..engine import SamplingParams

    t = time.perf_counter()
    engine.add_request(f"r{t}", prompt, SamplingParams(max_tokens=1, ignore_eos=True), images=images)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", default="4000x3000", help="source image WxH (shrunk to the span budget)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ..engine import EngineConfig, LLMEngine
    from ..engine.images import decode_image, load_images, preprocess

    w, h = (int(x) for x in args.size.split("x"))
    engine = LLMEngine(EngineConfig(model="tiny-v41", kv_memory="256MiB", enable_prefix_caching=False,
                                    max_num_batched_tokens=2048, threads=args.threads,
                                    enforce_eager=True))  # images are prefill's work, which is eager
    cfg, model = engine.model_config, engine.model
    data = _image_bytes(w, h)
    inp = load_images([data], cfg.vision, engine.image_limits)[0]
    n = inp.span_tokens
    g = torch.Generator().manual_seed(0)
    text = [t for t in torch.randint(16, cfg.vocab_size - 1, (n + 8,), generator=g).tolist()
            if t != cfg.image_token_id][:n]
    image_prompt = [cfg.image_token_id]
    print(f"image {w}x{h} -> {inp.grid.size[0]}x{inp.grid.size[1]}, {inp.grid.patches[0]}x{inp.grid.patches[1]} "
          f"patches, span {n} tokens; text prompt {len(text)} tokens; {args.threads} threads", flush=True)
    _first_token_s(engine, text[:64], [])  # warm-up
    img_s, txt_s, pre_s, tower_s = [], [], [], []
    for _ in range(args.repeats):
        img_s.append(_first_token_s(engine, image_prompt, [data]))
        txt_s.append(_first_token_s(engine, text, []))
        t = time.perf_counter()
        pre = preprocess(decode_image(data, engine.image_limits), cfg.vision)
        pre_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.inference_mode():
            model.embed_image(pre.patches, pre.grid.patches)
        tower_s.append(time.perf_counter() - t)
    img, txt = statistics.median(img_s), statistics.median(txt_s)
    pre, tower = statistics.median(pre_s), statistics.median(tower_s)
    print(f"image request: {n / img:8.1f} tokens/s ({1000 * img:.1f} ms to first token)")
    print(f"text request:  {len(text) / txt:8.1f} tokens/s ({1000 * txt:.1f} ms)")
    print(f"image / text:  {(n / img) / (len(text) / txt):.2f}x")
    print(f"shares of the image request: decode + resize + patches {pre / img:.0%} ({1000 * pre:.1f} ms), "
          f"vision tower + aligner {tower / img:.0%} ({1000 * tower:.1f} ms), language model the rest")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
