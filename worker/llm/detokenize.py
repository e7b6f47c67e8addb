"""Incremental detokenization: text pieces as tokens arrive, never a broken UTF-8 character.

Byte-level BPE spreads one character over several tokens, so decoding a single token can end
in half a character (U+FFFD). As vLLM and TGI do, each step decodes a short window of recent
tokens twice — up to the last emitted token and up to the newest — and emits the difference
only when it does not end in U+FFFD. Stop strings are found in the text, across pieces; the
text is cut before the stop string and anything after it is never sent.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
WINDOW = 6  # tokens of context before the unsent ones; enough for any merge boundary


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], skip_special: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.text = ""  # everything decided so far (sent or held back for stop matching)
        self.sent = 0  # characters of self.text already returned
        self._prefix = 0  # ids[_prefix:_read] decodes to text already in self.text
        self._read = 0
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token: int) -> str:
        """Feed one token; returns the new text safe to send now (may be empty)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self._prefix = max(0, len(self.ids) - WINDOW)
            self._read = len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest, at the end of the sequence (a trailing partial character included)."""
        rest = self._decode(self.ids[self._prefix :])
        done = self._decode(self.ids[self._prefix : self._read])
        if not self.stopped and len(rest) > len(done):
            self.text += rest[len(done) :]
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
                final = True
        # hold back a tail that could be the start of a stop string
        end = len(self.text) if final else max(self.sent, len(self.text) - self._hold)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
