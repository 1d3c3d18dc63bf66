"""Real-size slices: a checkpoint of DeepSeek-V4.1-Flash or V4-Flash with the real layer dimensions for a few layers.

    python -m flashserve.bench.slice --model deepseek-v41-flash --layers 2 --out DIR [--engram-rows N] [--dry-run]
    python -m flashserve.bench.slice --model deepseek-v4-flash --layers 2 --out DIR --gguf DIR.gguf

A slice is benchmark material for the real model's regime (experts of 2304 x 5120, 384 of them a layer), on a
machine that cannot hold the whole model. It is written in the released layout (block FP8 with UE8M0 scales for
dense layers, MXFP4 experts, FP8 engram rows, bf16 embeddings and head over the real vocabulary) with random
values on those storage grids, scaled so each product keeps its input's magnitude; the model's output means
nothing, its speed is the real layers'. The layers kept are chosen so each role the model has is present
(:data:`ROLE_LAYERS`): for V4.1 a KV source, a re-index layer, a reader of its top-k and an engram layer; for V4 a
CSA (hash-routed) and an HCA layer. The MTP / DSpark stages and the vision tower are left out. Sizes are printed,
and the free disk checked, before anything is written. ``--gguf PATH`` (V4-Flash) also writes the GGUF llama.cpp's
own converter makes of the slice, which ``scripts/bench_slice_llamacpp.py`` decodes beside flashserve. Not a test.

The slice's ``tokenizer.json`` is synthetic, as its weights are (:func:`slice_tokenizer`): a word-level vocabulary
over the slice's ``vocab_size`` whose texts mean nothing, with the chat and special tokens at the released ids
(docs/architecture.md#tokenizer-and-chat-format). It exists so the engine can serve the slice: an engram layer
hashes each token by its tokenizer class (flashserve.model.engram.compressed_token_map), and the engine refuses a
tokenizer whose class count is not the config's ``engram_compressed_vocab_size`` (99,092 for V4.1-Flash); the
synthetic vocabulary has exactly that many classes, its other texts being case variants that the engram normaliser
folds onto one of them.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

from ..config.checkpoint_layout import BF16, FP4, FP8, FP8_TABLE, FP32, INT, TensorSpec, checkpoint_layout
from ..config.engram_primes import engram_table_rows
from ..config.model_config import ModelConfig, config_from_dict
from ..config.presets import preset_json

# the original layers a slice keeps first, in this order (then every other layer, ascending, whose KV and index
# sources are kept): V4.1-Flash's 20 is the decoder's KV source (ratio 1) and the candidate pool's source, 24
# re-indexes 20's entries, 25 reads 24's top-k, 14 is a ratio-2 KV source with an engram table; V4-Flash's 2 is
# a hash-routed CSA layer, 3 an HCA layer
ROLE_LAYERS = {"deepseek-v41-flash": (20, 24, 25, 14), "deepseek-v4-flash": (2, 3)}
SHARD_BYTES = 2 << 30
# the released tokenizer's chat and special tokens by id, (text, special), as
# docs/architecture.md#tokenizer-and-chat-format lists them; a narrowed vocabulary (tests) that cannot hold them
# takes the tiny presets' numbering instead
RELEASED_SPECIALS: dict[int, tuple[str, bool]] = {
    0: ("<｜begin▁of▁sentence｜>", True), 1: ("<｜end▁of▁sentence｜>", True), 2: ("<｜▁pad▁｜>", True),
    128799: ("<｜System｜>", False), 128803: ("<｜User｜>", True), 128804: ("<｜Assistant｜>", True),
    128821: ("<think>", False), 128822: ("</think>", False), 128825: ("｜DSML｜", True),
    128828: ("<｜latest_reminder｜>", True), 129264: ("<｜deepseek_image｜>", True),
}
IMAGE_TOKEN = "<｜deepseek_image｜>"
UNK_TOKEN = "<unk>"  # what a word outside the synthetic vocabulary encodes to


def slice_layers(cfg: ModelConfig, model: str, n: int) -> list[int]:
    """The ``n`` original layers a slice of ``model`` keeps, ascending: the role layers first, then others whose
    compressed KV and index sources are kept (a layer without them could not attend)."""
    if not 1 <= n <= cfg.num_hidden_layers:
        raise ValueError(f"--layers must be 1..{cfg.num_hidden_layers}, got {n}")
    chosen: list[int] = []
    for layer in (*ROLE_LAYERS[model], *range(cfg.num_hidden_layers)):
        if len(chosen) == n:
            break
        if layer in chosen:
            continue
        needs = [s for s in (cfg.kv_source(layer), cfg.index_source(layer)) if s is not None and s != layer]
        if all(s in chosen for s in needs):
            chosen.append(layer)
    return sorted(chosen)


def slice_config(model: str, layers: list[int], engram_rows: int, dims: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of a slice keeping ``layers`` (original indices) of preset ``model``, each engram
    table about ``engram_rows`` rows; ``dims``: text-config fields to replace (tests shrink the widths)."""
    raw = preset_json(model)
    text = raw.get("text_config", raw)
    for key, value in (dims or {}).items():  # a field where the preset holds it (V4.1: some are top-level)
        (raw if key in raw and key not in text else text)[key] = value
    full = config_from_dict(preset_json(model))
    # as the released config.json names it (llama.cpp's converter picks its model class by this name)
    raw.setdefault("architectures", ["DeepseekV41ForCausalLM" if full.is_v41 else "DeepseekV4ForCausalLM"])
    new = {old: i for i, old in enumerate(layers)}
    text["num_hidden_layers"] = len(layers)
    text["compress_ratios"] = [full.compress_ratios[i] for i in layers]
    text["num_nextn_predict_layers"] = 0
    raw.pop("vision_config", None)
    if raw.get("image_token_id") is not None and raw["image_token_id"] >= text["vocab_size"]:
        raw.pop("image_token_id")  # a narrowed vocabulary (tests) has no room for it
    if full.is_v41:
        for key in ("kv_source_layer_ids", "index_source_layer_ids"):
            text[key] = [new[i] for i in getattr(full, key) if i in new]
        text["candidate_source_layer_id"] = new.get(full.candidate_source_layer_id, -1)
        text["dspark_target_layer_ids"] = []
        engram = [new[i] for i in full.engram_layer_ids if i in new]
        ngram, heads = text["engram_max_ngram_size"], text["engram_n_heads"]
        vocab = max(engram_rows // ((ngram - 1) * heads), 64)
        text["engram_layer_ids"] = engram
        text["engram_vocab_size"] = vocab
        text["engram_num_embeddings"] = engram_table_rows(len(engram), ngram, heads, vocab)
    else:
        hashed = [i for i in layers if i in full.hash_layer_ids]
        if hashed != layers[:len(hashed)]:
            raise ValueError(f"hash-routed layers {hashed} of the slice must come first (V4 hashes its first layers)")
        text["num_hash_layers"] = len(hashed)
    config_from_dict(raw)  # the slice's config is one a checkpoint could hold
    return raw


def _generator(seed: int, name: str):
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _scale_byte(std: float, rms: float) -> int:
    """The UE8M0 byte of the power of two closest to ``std / rms``: stored values of root-mean-square ``rms``
    times it have about standard deviation ``std``."""
    return 127 + round(math.log2(std / rms))


def stored_tensors(spec: TensorSpec, cfg: ModelConfig, seed: int) -> list[tuple[str, Any]]:
    """Random stored tensors of one layout tensor on its storage grid (by stored name): products keep their
    input's magnitude (weights of standard deviation fan_in^-1/2), norms and scales are one, biases zero."""
    import torch

    from ..model.checkpoint import scale_name

    g = _generator(seed, spec.name)
    name, shape = spec.name, spec.shape
    if spec.kind == INT:  # hash routing: each token's k distinct experts
        return [(name, torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(-1)[:, :shape[1]])]
    if spec.kind in (BF16, FP32):
        dtype = torch.bfloat16 if spec.kind == BF16 else torch.float32
        if name.endswith(("norm.weight", "_scale")):
            return [(name, torch.ones(shape, dtype=dtype))]
        if name.endswith(("bias", "bias_vl", "_base", "attn_sink")):
            return [(name, torch.zeros(shape, dtype=dtype))]
        std = shape[-1] ** -0.5 if len(shape) == 2 and not name.startswith(("embed.",)) else 1.0
        return [(name, (torch.randn(shape, generator=g) * std).to(dtype))]
    rows, cols = shape
    std = cols ** -0.5
    if spec.kind == FP4:  # two E2M1 codes a byte, every code equally likely (root mean square 2.93)
        q = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g).view(torch.int8)
        s = torch.full((rows, -(-cols // 32)), _scale_byte(std, 2.93), dtype=torch.uint8)
        return [(name, q), (scale_name(name), s.view(torch.float8_e8m0fnu))]
    # FP8: normal values times 16 in E4M3 (well inside its range), one power-of-two scale a block or row segment
    q = (torch.randn(shape, generator=g) * 16).to(torch.float8_e4m3fn)
    if spec.kind == FP8:
        b = cfg.quantization.weight_block_size
        grid = (-(-rows // b), -(-cols // b))
    elif spec.kind == FP8_TABLE:
        grid, std = (rows, -(-cols // 32)), 1.0
    else:
        raise ValueError(f"unknown storage kind {spec.kind!r} for {name}")
    s = torch.full(grid, _scale_byte(std, 16.0), dtype=torch.uint8)
    return [(name, q), (scale_name(name), s.view(torch.float8_e8m0fnu))]


def slice_specials(cfg: ModelConfig) -> dict[int, tuple[str, bool]]:
    """The chat and special tokens of a slice's tokenizer by id, (text, special): the released ids where the
    vocabulary holds them all, else the tiny presets' (those inside it); the image token at the config's
    ``image_token_id``, left out where the config has none."""
    from ..engine.tokenizer import TINY_SPECIALS

    table = RELEASED_SPECIALS if max(RELEASED_SPECIALS) < cfg.vocab_size else TINY_SPECIALS
    out = {i: v for i, v in table.items() if i < cfg.vocab_size and v[0] != IMAGE_TOKEN}
    image = getattr(cfg, "image_token_id", None)
    if image is not None and 0 <= image < cfg.vocab_size and image not in out:
        out[image] = (IMAGE_TOKEN, True)
    return out


def _word(n: int, width: int) -> str:
    """``n`` in base 26 over ``a``-``z``, ``width`` letters."""
    letters = []
    for _ in range(width):
        n, r = divmod(n, 26)
        letters.append(chr(ord("a") + r))
    return "".join(reversed(letters))


def slice_tokenizer(cfg: ModelConfig):
    """A synthetic ``tokenizers.Tokenizer`` over ``cfg.vocab_size`` ids with exactly ``engram_compressed_vocab_size``
    engram classes (every id distinct where the config has none, V4).

    Word-level, split at whitespace and punctuation, unknown words to ``<unk>``: :func:`slice_specials` at their
    ids, ``<unk>``, then as many lowercase words as classes remain (``aaaa``, ``aaab``, ...), then the ids left over
    as case variants of those words (``Aaaa``, ``aAaa``, ...), which the engram normaliser lowercases onto their
    word. Raises ValueError where the vocabulary cannot hold that many classes (or no word besides the specials).
    The result is checked with the engine's own class map (RuntimeError should it disagree with the config)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from ..model.engram import compressed_token_map, engram_normalizer

    vocab_size = cfg.vocab_size
    specials = slice_specials(cfg)
    norm = engram_normalizer()
    special_classes = len({norm.normalize_str(text) or text for text, _ in specials.values()})
    free = [i for i in range(vocab_size) if i not in specials]
    classes = cfg.engram_compressed_vocab_size or special_classes + len(free)
    n_words = classes - special_classes - 1  # the words' classes besides the specials' and <unk>'s
    n_variants = len(free) - 1 - n_words
    if n_words < 1 or n_variants < 0:
        raise ValueError(f"a synthetic tokenizer of {vocab_size} ids ({len(specials)} of them special, in "
                         f"{special_classes} classes) cannot have {classes} engram classes")
    per_word = -(-n_variants // n_words)  # case patterns a word needs
    width = 1
    while 26 ** width < n_words or 2 ** width - 1 < per_word:
        width += 1
    words = [_word(n, width) for n in range(n_words)]
    texts = [UNK_TOKEN, *words]
    for j in range(n_variants):  # the j-th variant: word j mod n_words, its letters set in mask j // n_words + 1
        word, mask = words[j % n_words], j // n_words + 1
        texts.append("".join(c.upper() if mask >> k & 1 else c for k, c in enumerate(word)))
    vocab = {text: i for i, (text, _) in specials.items()}
    vocab.update(zip(texts, free))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # the specials as added tokens (their ids are already theirs): matched whole in text, special ones skipped in
    # decoding unless asked for
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for _, (t, s) in sorted(specials.items()) if not s])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for _, (t, s) in sorted(specials.items()) if s])
    ids, (_, got) = tok.get_vocab_size(with_added_tokens=True), compressed_token_map(tok)
    if (ids, got) != (vocab_size, classes):
        raise RuntimeError(f"the synthetic tokenizer has {ids} ids in {got} engram classes; the config asks "
                           f"{vocab_size} in {classes}")
    return tok


def write_tokenizer(out: Path, cfg: ModelConfig, tok=None) -> Path:
    """Write ``tok`` (default :func:`slice_tokenizer` of ``cfg``) as ``out/tokenizer.json``; returns the file."""
    tok = slice_tokenizer(cfg) if tok is None else tok
    path = Path(out) / "tokenizer.json"
    tok.save(str(path))
    return path


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_slice(model: str, layers: int, engram_rows: int, dims: dict[str, Any] | None = None
               ) -> tuple[ModelConfig, dict, list[int], list[TensorSpec], list[int]]:
    """(config, config.json dict, original layers kept, tensor specs, stored bytes of each) of a slice."""
    from ..model.checkpoint import stored_bytes

    if model not in ROLE_LAYERS:
        raise ValueError(f"--model must be one of {', '.join(ROLE_LAYERS)}, got {model!r}")
    full = config_from_dict(preset_json(model))
    kept = slice_layers(full, model, layers)
    raw = slice_config(model, kept, engram_rows, dims)
    cfg = config_from_dict(raw)
    specs = checkpoint_layout(cfg, mtp=False, vision=False)
    return cfg, raw, kept, specs, [stored_bytes(s, cfg) for s in specs]


def write_slice(out: Path, model: str, layers: int, *, engram_rows: int = 1 << 20, seed: int = 0,
                dry_run: bool = False, shard_bytes: int = SHARD_BYTES, dims: dict[str, Any] | None = None,
                echo=print) -> int:
    """Print a slice's sizes, check the free disk, and write it to ``out`` (unless ``dry_run``): the checkpoint and
    its synthetic ``tokenizer.json`` (:func:`slice_tokenizer`). Returns the checkpoint's bytes. ``dims``: text-config
    fields to replace (tests shrink the widths)."""
    from ..model.checkpoint import write_checkpoint

    cfg, raw, kept, specs, sizes = plan_slice(model, layers, engram_rows, dims)
    total = sum(sizes)
    by_part: dict[str, int] = {}
    for spec, size in zip(specs, sizes):
        by_part[spec.part] = by_part.get(spec.part, 0) + size
    roles = ", ".join(f"{old} ({cfg.layer_role(i)}{', engram' if i in cfg.engram_layer_ids else ''})"
                      for i, old in enumerate(kept))
    echo(f"{model} slice: layers {roles}; {len(specs)} tensors, {_gib(total)}")
    for part, size in sorted(by_part.items(), key=lambda kv: -kv[1]):
        echo(f"  {part:<16} {_gib(size)}")
    classes = f", {cfg.engram_compressed_vocab_size} engram classes" if cfg.engram_compressed_vocab_size else ""
    echo(f"  tokenizer.json   synthetic, {cfg.vocab_size} ids{classes}")
    if dry_run:
        return total
    out = Path(out)
    probe = out if out.exists() else next(p for p in out.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < total * 1.05:
        raise OSError(f"{probe} has {_gib(free)} free; the slice needs {_gib(total)} (and 5% to spare)")
    tok = slice_tokenizer(cfg)  # before the weights: a vocabulary that cannot hold its classes fails early
    write_checkpoint(out, raw, specs, lambda spec: stored_tensors(spec, cfg, seed), sizes,
                     max_shard_bytes=shard_bytes)
    write_tokenizer(out, cfg, tok)
    echo(f"wrote {out}")
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashserve.bench.slice", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, choices=sorted(ROLE_LAYERS))
    ap.add_argument("--layers", type=int, required=True, help="layers to keep (the role layers first)")
    ap.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    ap.add_argument("--engram-rows", type=int, default=1 << 20,
                    help="about this many rows in each engram table (V4.1; the real tables hold 384M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="print the sizes only")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="V4-Flash: also write the GGUF llama.cpp's own converter makes of the slice (MXFP4 experts, "
                         "the FP8 dense weights as Q8_0, bf16 head), for scripts/bench_slice_llamacpp.py")
    args = ap.parse_args(argv)
    if args.engram_rows < 1:
        ap.error("--engram-rows must be at least 1")
    if args.gguf is not None:
        from . import llamacpp

        if args.model != "deepseek-v4-flash":
            ap.error("--gguf: llama.cpp's converter reads V4-Flash checkpoints; it has no V4.1 model")
        if args.gguf.exists():
            ap.error(f"--gguf: {args.gguf} exists")
        if (why := llamacpp.unavailable()) is not None:
            ap.error(f"--gguf: {why}")
    try:
        total = write_slice(args.out, args.model, args.layers, engram_rows=args.engram_rows, seed=args.seed,
                            dry_run=args.dry_run)
        if args.gguf is not None and not args.dry_run:
            free = shutil.disk_usage(args.gguf.parent if args.gguf.parent.exists() else Path.cwd()).free
            if free < total * 1.1:  # the GGUF is about the slice's size (Q8_0 dense weights are a little larger)
                raise OSError(f"{args.gguf.parent} has {_gib(free)} free; the GGUF needs about {_gib(total)}")
            args.gguf.parent.mkdir(parents=True, exist_ok=True)
            llamacpp.make_gguf_file(args.out, args.gguf)
            print(f"wrote {args.gguf}")
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
