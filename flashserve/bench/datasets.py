"""Benchmark prompts: random token strings, prefix-sharing prompts, or ShareGPT conversations from a file.

Every request records its prompt length in tokens as the benchmark's tokenizer counts the text sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import UserError


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def is_special(self, i: int) -> bool: ...


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send and the output length asked for."""

    prompt: str
    prompt_len: int
    output_len: int


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """``n`` lengths uniform in [mean·(1−ratio), mean·(1+ratio)] (vLLM's range ratio), at least 1."""
    if not 0.0 <= ratio < 1.0:
        raise UserError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def _ordinary_ids(tok: TextTokenizer) -> np.ndarray:
    ids = np.array([i for i in range(tok.vocab_size) if not tok.is_special(i)])
    if not len(ids):
        raise UserError("the tokenizer has no ordinary tokens to draw random prompts from")
    return ids


def _random_text(rng: np.random.Generator, pool: np.ndarray, tok: TextTokenizer, length: int) -> str:
    """Text of random ordinary tokens that re-encodes to ``length`` tokens where the tokenizer allows:
    decoding and re-encoding merges or splits tokens, so the ids are cut or topped up a few times."""
    ids = rng.choice(pool, size=int(length)).tolist()
    text = tok.decode(ids)
    for _ in range(8):
        ids = tok.encode(text)
        if len(ids) == length:
            break
        ids = ids[:length] if len(ids) > length else ids + rng.choice(pool, size=length - len(ids)).tolist()
        text = tok.decode(ids)
    return text


def random_requests(tok: TextTokenizer, n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """``n`` prompts of random ordinary tokens; with ``prefix_len`` all share one random prefix of that many
    tokens and differ in a random suffix of ``input_len`` tokens (the prefix-cache case)."""
    _check_positive(num_prompts=n, input_len=input_len, output_len=output_len)
    if prefix_len < 0:
        raise UserError(f"--prefix-len must be >= 0, got {prefix_len}")
    rng = np.random.default_rng(seed)
    pool = _ordinary_ids(tok)
    prefix = _random_text(rng, pool, tok, prefix_len) if prefix_len else ""
    ins = _lengths(rng, input_len, range_ratio, n)
    outs = _lengths(rng, output_len, range_ratio, n)
    out = []
    for i, o in zip(ins, outs):
        text = prefix + _random_text(rng, pool, tok, i)
        out.append(SampleRequest(text, len(tok.encode(text)), int(o)))
    return out


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def _read_conversations(path: Path) -> list[Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"--dataset-path: cannot read {path}: {exc}") from None
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--dataset-path: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise UserError(f"--dataset-path: {path} must hold a list of conversations")
    return data


def _first_turns(entry: Any) -> tuple[str, str] | None:
    """(first human message, the reply to it) of one ShareGPT entry, or None when it has none."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in (first, second)):
        return None
    return first["value"], second["value"]


def sharegpt_requests(tok: TextTokenizer, path: str | Path, n: int, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """``n`` prompts from a ShareGPT-layout JSON or JSONL file: each entry's first human turn is the prompt;
    the output length is ``output_len`` or the token length of the reply in the file (entries with an empty
    prompt or reply are skipped, as vLLM does for prompts under 4 tokens)."""
    _check_positive(num_prompts=n)
    entries = _read_conversations(Path(path))
    order = np.random.default_rng(seed).permutation(len(entries))
    out: list[SampleRequest] = []
    for i in order:
        pair = _first_turns(entries[i])
        if pair is None:
            continue
        prompt_len, reply_len = len(tok.encode(pair[0])), len(tok.encode(pair[1]))
        want = output_len or reply_len
        if prompt_len < 4 or want < 1:
            continue
        out.append(SampleRequest(pair[0], prompt_len, want))
        if len(out) == n:
            return out
    raise UserError(f"--dataset-path: {path} has {len(out)} usable conversations, fewer than --num-prompts {n} "
                    "(each needs a 'conversations' list whose first two turns have a 'value' string)")
