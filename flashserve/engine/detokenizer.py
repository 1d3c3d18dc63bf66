"""Incremental detokenization for streaming: never emits half a UTF-8 character, finds stop strings that
span tokens, and holds back text that may be the start of a stop string.

Every per-token operation is O(1) in the length of the text so far: decoding looks at a window of the last
tokens, the stop search at the new text plus ``max_stop - 1`` characters before it, and the text itself is
kept as finished pieces plus a short tail (``self.text += piece`` on an attribute copies the whole string in
CPython: 13 us per token at 115k characters)."""

from __future__ import annotations

_KEEP = 256  # characters the tail keeps at least: deltas and hold-backs read only the tail
# Tokens after the last text that the decode window keeps, so that a token's decode stays O(1): at most this
# many that add no text (skipped special tokens, ids the tokenizer lacks; the first few are kept because a
# decoder may strip what starts a text, "▁" in Metaspace), and at most twice as many in all before text that
# still ends in an unfinished character is emitted as it is (a character spans at most 4 tokens of bytes).
# Without the bound every token's decode grew: 88 us per token after 2,000 ids a 512-id tokenizer lacks.
_TEXTLESS_KEEP = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.keep = max(_KEEP, 2 * self.max_stop)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix: str | None = None  # decode of ids[prefix_offset:read_offset], kept until they move
        self._head: list[str] = []  # text before the tail, in pieces
        self._head_len = 0
        self._tail = ""
        self.emitted = 0
        self.search_from = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """The whole text so far (joins every piece: for final and cumulative outputs, not per token)."""
        return "".join(self._head) + self._tail

    @property
    def length(self) -> int:
        return self._head_len + len(self._tail)

    def _slice(self, a: int, b: int) -> str:
        """``text[a:b]``: O(b - a) when ``a`` lies in the tail (every delta), else a join."""
        if a >= self._head_len:
            return self._tail[a - self._head_len:b - self._head_len]
        return self.text[a:b]

    def _compact(self) -> None:
        """Move the tail's old part into the head once the tail doubles ``keep`` (amortized O(1) per char);
        the stop search's region stays in the tail."""
        if len(self._tail) < 2 * self.keep:
            return
        limit = self.length - self.keep
        if self.stop:
            limit = min(limit, self.search_from - self.max_stop + 1)
        cut = limit - self._head_len
        if cut > 0:
            self._head.append(self._tail[:cut])
            self._head_len += cut
            self._tail = self._tail[cut:]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def _advance(self, force: bool = False) -> None:
        if self._prefix is None:
            self._prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        prefix = self._prefix
        full = self._decode(self.ids[self.prefix_offset:])
        pending = len(self.ids) - self.read_offset
        force = force or pending > 2 * _TEXTLESS_KEEP
        if len(full) > len(prefix) and (force or not full.endswith("\ufffd")):
            self._tail += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._prefix = None
        elif full == prefix and pending > _TEXTLESS_KEEP:
            del self.ids[-1]  # added no text, and the window already holds enough such tokens

    def add(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed (text is cut before it), else None."""
        if self.stopped:
            return None
        self.ids.append(token_id)
        self._advance()
        matched = self._check_stop()
        self._compact()
        return matched

    def _check_stop(self) -> str | None:
        if not self.stop or self.length <= self.search_from:
            return None
        begin = max(0, self.search_from - self.max_stop + 1) - self._head_len  # >= 0: see _compact
        best = None
        for s in self.stop:
            i = self._tail.find(s, begin)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        self.search_from = self.length
        if best is None:
            return None
        self._tail = self._tail[:best[0]]
        self.emitted = min(self.emitted, self.length)
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
        for s in self.stop:  # the tail holds at least min(keep, length) >= max_stop characters
            for k in range(min(len(s) - 1, self.length), best, -1):
                if self._tail.endswith(s[:k]):
                    best = k
                    break
        return best

    def visible_end(self, final: bool) -> int:
        end = self.length if (final or self.stopped) else self.length - self._holdback()
        return max(end, self.emitted)

    def visible_text(self, final: bool) -> str:
        return self._slice(0, max(self.emitted, 0)) if not final else self.text

    def take_delta(self, final: bool) -> str:
        end = self.visible_end(final)
        d = self._slice(self.emitted, end)
        self.emitted = end
        return d
