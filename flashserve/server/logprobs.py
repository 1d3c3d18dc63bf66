"""Logprobs in the OpenAI shapes: chat's ``logprobs.content`` entries and completions' four parallel lists."""

from __future__ import annotations

import math
from typing import Any


class TokenStrings:
    """Token id -> its text (special tokens included), cached: logprobs ask for the same ids again and again."""

    def __init__(self, tokenizer: Any, limit: int = 300_000):
        self.tokenizer, self.limit = tokenizer, limit
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            try:
                s = self.tokenizer.decode([tid], skip_special_tokens=False)
            except Exception:  # an id the tokenizer cannot render: shown as empty
                s = ""
            if len(self.cache) < self.limit:
                self.cache[tid] = s
        return s


def _top(d: dict[int, float] | None, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely entries of a logprob dict (which holds the sampled token plus the top-k)."""
    if not d or k <= 0:
        return []
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


def _lp(v: float | None) -> float:
    """JSON has no -inf: an impossible token reports -9999 as OpenAI does."""
    if v is None or not math.isfinite(v):
        return -9999.0
    return float(v)


def chat_logprobs(ts: TokenStrings, token_ids: list[int], lps: list[dict[int, float]], k: int) -> list[dict]:
    out = []
    for tid, d in zip(token_ids, lps):
        s = ts(tid)
        tops = [{"token": ts(t), "logprob": _lp(v), "bytes": list(ts(t).encode("utf-8", "replace"))}
                for t, v in _top(d, k)]
        out.append({"token": s, "logprob": _lp((d or {}).get(tid)), "bytes": list(s.encode("utf-8", "replace")),
                    "top_logprobs": tops})
    return out


def completion_logprobs(ts: TokenStrings, token_ids: list[int], lps: list[dict[int, float] | None], k: int,
                        offset: int, first_is_prompt_start: bool = False) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for j, (tid, d) in enumerate(zip(token_ids, lps)):
        s = ts(tid)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
        if d is None or (first_is_prompt_start and j == 0):
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(d.get(tid)))
        top: dict[str, float] = {}
        for t, v in _top(d, k):
            top.setdefault(ts(t), _lp(v))
        if k == 0 or (tid in d and s not in top):
            top.setdefault(s, _lp(d.get(tid)))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge(a: dict | None, b: dict | None) -> dict | None:
    """Two completions logprob pieces as one."""
    if a is None:
        return b
    if b is None:
        return a
    return {key: a[key] + b[key] for key in a}


EMPTY = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
