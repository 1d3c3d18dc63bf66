"""A ``tokenizers`` byte-level BPE from a GGUF's vocabulary fields (what llama.cpp's converter writes for the
DeepSeek family: ``tokenizer.ggml.model = "gpt2"``).

* ``tokenizer.ggml.tokens``: every id's token, in the byte-level alphabet (the BPE vocabulary; ``UNUSED`` ids, the
  converter's ``[PADn]`` fillers, are left out);
* ``tokenizer.ggml.merges``: the BPE merges, ``"a b"`` each;
* ``tokenizer.ggml.token_type``: ``CONTROL`` (3) tokens become special added tokens, ``USER_DEFINED`` (4) ones
  added tokens kept in decoded text, as the checkpoint's ``tokenizer.json`` marked them (the converter writes
  CONTROL for a special token or one that looks like ``<｜...｜>``; ``keep_in_text`` names the family's tokens of
  that look that stay in text);
* ``tokenizer.ggml.pre``: the pre-tokenizer, by llama.cpp's name: ``gpt-2`` (GPT-2's regex) or ``deepseek-v3``
  (the DeepSeek-V3/V4 splits: digits in threes, CJK runs, then words and punctuation, as llama.cpp's
  ``LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM``).
Torch-free.
"""

from __future__ import annotations

from typing import Iterable

from .file import GGUFError, GGUFModel

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType

# llama.cpp's regexes for LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM (src/llama-vocab.cpp), applied in turn
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
PRE_TOKENIZERS = ("gpt-2", "deepseek-v3")


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in _DEEPSEEK_V3_SPLITS]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(model: GGUFModel, keep_in_text: Iterable[str] = ()):
    """The ``tokenizers.Tokenizer`` of ``model``'s vocabulary; a GGUFError names what is missing or unsupported."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    meta = model.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{model.path}: tokenizer.ggml.model is {kind!r}; flashserve reads byte-level BPE "
                        "vocabularies ('gpt2'), as the DeepSeek family's")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{model.path}: tokenizer.ggml.pre {pre!r} is not supported (known: "
                        f"{', '.join(PRE_TOKENIZERS)})")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFError(f"{model.path}: the GGUF has no vocabulary (tokenizer.ggml.tokens and tokenizer.ggml.merges)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{model.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind != UNUSED:
            vocab.setdefault(tok, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise GGUFError(f"{model.path}: tokenizer.ggml.merges has an entry {m!r} that is not two tokens")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    keep = set(keep_in_text)
    added = [(tokens[i], kind == CONTROL and tokens[i] not in keep) for i, kind in enumerate(types)
             if kind in (CONTROL, USER_DEFINED) and vocab.get(tokens[i]) == i]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, special in added if not special])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, special in added if special])
    return tok


def special_ids(model: GGUFModel) -> dict[str, int]:
    """``bos``/``eos``/``pad`` ids the GGUF names (``tokenizer.ggml.*_token_id``)."""
    out = {}
    for ours, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        value = model.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            out[ours] = int(value)
    return out
