"""Incremental detokenization for streaming: never emits half a UTF-8 character, finds stop strings that
span tokens, and holds back text that may be the start of a stop string."""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.search_from = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def _advance(self, force: bool = False) -> None:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (force or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed (text is cut before it), else None."""
        if self.stopped:
            return None
        self.ids.append(token_id)
        self._advance()
        return self._check_stop()

    def _check_stop(self) -> str | None:
        if not self.stop or len(self.text) <= self.search_from:
            return None
        begin = max(0, self.search_from - self.max_stop + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, begin)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        self.search_from = len(self.text)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        self.emitted = min(self.emitted, len(self.text))
        self.stopped = True
        return best[1]

    def finish(self) -> str | None:
        """Flush bytes held back because they did not yet form a whole character; return the stop string
        the flushed text completed (the text is cut before it), else None."""
        if self.stopped or self.read_offset >= len(self.ids):
            return None
        self._advance(force=True)
        return self._check_stop()

    def _holdback(self) -> int:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def visible_end(self, final: bool) -> int:
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._holdback()
        return max(end, self.emitted)

    def visible_text(self, final: bool) -> str:
        return self.text[:max(self.emitted, 0)] if not final else self.text

    def take_delta(self, final: bool) -> str:
        end = self.visible_end(final)
        d = self.text[self.emitted:end]
        self.emitted = end
        return d
