"""Structured outputs: a :class:`Constraint` compiled by llguidance into one matcher per sequence, whose
allowed-token bitmask the sampler applies to the whole batch at once (rows without a constraint untouched).

llguidance (the engine behind llama.cpp's and vLLM's guidance backend) compiles JSON schemas and Lark grammars
lazily against the tokenizer, so a mask costs microseconds per row and needs no precompiled automaton.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .sampling_params import Constraint, RequestError

log = logging.getLogger("flashserve.engine")

_BITS = torch.arange(32, dtype=torch.int32)


class Guide:
    """One sequence's matcher. Inactive until its constraint's ``after`` token has been generated; meanwhile the
    tokens that would end the sequence (``hold``: EOS, stop token ids) are forbidden, so a constrained answer
    cannot be skipped by ending inside the reasoning (only the length limit can cut it)."""

    def __init__(self, matcher: Any, after: int | None, hold: tuple[int, ...] = ()):
        self.matcher, self.after, self.hold = matcher, after, hold
        self.active = after is None

    def advance(self, token_id: int) -> None:
        """Record the sampled token (the mask allowed it, so the matcher accepts it)."""
        if not self.active:
            self.active = token_id == self.after
            return
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token_id):
            log.warning("structured output: token %d refused by the grammar: %s", token_id, self.matcher.get_error())


class Guides:
    """Compiles constraints against one tokenizer (the llguidance tokenizer is built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll: Any = None

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll is None:
            import llguidance

            self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self.tokenizer.eos_token_id)
        return self._ll

    @staticmethod
    def grammar(c: Constraint) -> str:
        from llguidance import LLMatcher

        if c.kind == "json":
            return LLMatcher.grammar_from_json_schema(c.text, defaults={"whitespace_flexible": False})
        return LLMatcher.grammar_from_lark(c.text)

    def check(self, c: Constraint) -> None:
        """RequestError naming ``c.param`` when the backend cannot compile the constraint."""
        from llguidance import LLMatcher

        try:
            error = LLMatcher.validate_grammar(self.grammar(c), self.ll_tokenizer)
        except (ValueError, TypeError) as e:
            error = str(e)
        if error:
            raise RequestError(f"{c.param}: the constraint cannot be compiled: {error}")

    def guide(self, c: Constraint, stop_token_ids: list[int] | None = None) -> Guide:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, self.grammar(c))
        if matcher.is_error():
            raise RequestError(f"{c.param}: the constraint cannot be compiled: {matcher.get_error()}")
        hold = tuple({self.tokenizer.eos_token_id, *(stop_token_ids or ())} - {c.after})
        return Guide(matcher, c.after, hold)


def allowed_tokens(guides: list[Guide | None], vocab_size: int) -> tuple[list[int], torch.Tensor | None]:
    """(rows constrained now, their allowed-token masks [len(rows), vocab_size] bool): active guides by their
    grammar, guides still waiting for their ``after`` token everything but their ``hold`` tokens."""
    rows = [i for i, g in enumerate(guides) if g is not None and (g.active or g.hold)]
    if not rows:  # no constrained row: llguidance is not even imported
        return rows, None
    from llguidance.torch import fill_next_token_bitmask

    bitmask = torch.full((len(rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        if guides[i].active:
            fill_next_token_bitmask(guides[i].matcher, bitmask, j)
    mask = ((bitmask[:, :, None] >> _BITS) & 1).reshape(len(rows), -1)[:, :vocab_size].bool()
    for j, i in enumerate(rows):
        if not guides[i].active:
            mask[j, [t for t in guides[i].hold if t < vocab_size]] = False
    return rows, mask
