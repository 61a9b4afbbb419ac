"""Generated tokens -> text as it grows: the deltas a stream sends and where stop strings end it.

``TextStream`` decodes a request's tokens incrementally: each token's text is the growth of the
decoded window over the tokens since the last stable point, held back while it ends in an
incomplete character (a byte-level token that splits one), so a delta is never half a
character. With stop strings it also holds back the last ``len(longest stop) - 1`` characters
(they may begin a stop string), and when the text first contains one it is cut before it and the
stream says it stopped; the engine then ends the request at that token.

The deltas join to a prefix of ``final_text``; the sender sends the rest of the final text last.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.rl.tokenizer import Tokenizer


class TextStream:
    """The text of one request's tokens as they arrive (``push``), and its final text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.stopped = False
        """A stop string was found: the text ends before it."""
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._tokens: list[int] = []
        self._prefix = 0  # first token of the decoding window
        self._read = 0  # tokens whose text is in ``_text``
        self._text = ""
        self._sent = 0  # characters of ``_text`` handed out by ``push``

    def push(self, token: int) -> str:
        """Add one generated token; the text that may be sent now (possibly empty)."""
        self._tokens.append(token)
        if self.stopped:
            return ""
        before = len(self._text)
        decode = self.tokenizer.decode
        known = decode(self._tokens[self._prefix : self._read])
        window = decode(self._tokens[self._prefix :])
        if len(window) > len(known) and not window.endswith("\ufffd"):
            self._text += window[len(known) :]
            self._prefix, self._read = self._read, len(self._tokens)
        if self.stop and len(self._text) > before:
            hit = self._first_stop(max(0, before - self._hold))
            if hit is not None:
                self._text = self._text[:hit]
                self.stopped = True
                return self._take(len(self._text))
        return self._take(len(self._text) - self._hold)

    def final_text(self) -> str:
        """The whole text: cut before the stop string once stopped, else the tokenizer's decoding
        of every token when the deltas sent are a prefix of it (the same text a request that was
        not streamed gets), else the incremental text."""
        if self.stopped:
            return self._text
        full = self.tokenizer.decode(self._tokens)
        return full if full.startswith(self._text[: self._sent]) else self._text

    def _take(self, upto: int) -> str:
        upto = max(upto, self._sent)
        delta = self._text[self._sent : upto]
        self._sent = upto
        return delta

    def _first_stop(self, start: int) -> int | None:
        hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None
