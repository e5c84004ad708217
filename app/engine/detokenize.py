"""Incremental detokenization: a generated sequence's text grown a few tokens at a time, the way vLLM and TGI do it,
so each step decodes a short window of tokens instead of the whole output again."""

from __future__ import annotations

_INCOMPLETE = "\ufffd"  # what a byte-level tokenizer decodes an unfinished UTF-8 character to


class IncrementalDetokenizer:
    """One sequence's text: `text` is `tokenizer.decode(ids, skip_special_tokens=...)` of every token added so far,
    less the U+FFFD of a character still unfinished at its end (all of it after `flush`).

    Each step decodes two windows that start at `prefix_offset`: the tokens already read (up to `read_offset`) and
    the same plus the new ones; the new text is the difference. The window starts a token or more before the new
    ones because a token's text can depend on the one before it (a leading space dropped at the start of a decode,
    a character whose bytes span two tokens). New text that ends in U+FFFD waits for the tokens that complete it, so
    the window stays a few tokens long. Where the two windows disagree on the already-read text (a tokenizer that
    cleans up spaces across tokens), the whole sequence is decoded instead; a tokenizer that cleans up spaces
    (which can join text across any window's start) always decodes the whole sequence, as before.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # " ." -> "." and the like rewrite text across a window's start: only the whole sequence decodes right
        self._whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window's first token
        self.read_offset = 0  # tokens whose text is in `read_text`
        self.read_text = ""  # the text of ids[:read_offset]
        self.pending = ""  # the text of the tokens after read_offset, up to an unfinished character at its end

    @property
    def text(self) -> str:
        return self.read_text + self.pending if self.pending else self.read_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def add(self, token: int) -> str:
        """Take one token; return the text it completes and reads past ("" while the window ends in an unfinished
        character or decodes to nothing; `text` shows the finished characters before it meanwhile)."""
        self.ids.append(token)
        return self._read(final=False)

    def flush(self) -> str:
        """At the end of the sequence: the text of every token not yet read, an unfinished character included."""
        return self._read(final=True)

    def _read(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        if self._whole:
            prefix, window = "", None
        else:
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            window = self._decode(self.ids[self.prefix_offset:])
        if window is None or not window.startswith(prefix):  # the new tokens changed text already read: decode everything once
            whole = self._decode(self.ids)
            new, read = whole[len(self.read_text):], whole
        else:
            new = window[len(prefix):]
            read = self.read_text + new
        if not final and (not new or new.endswith(_INCOMPLETE)):
            self.pending = new.rstrip(_INCOMPLETE) if read.startswith(self.read_text) else ""
            return ""
        self.read_text, self.pending = read, ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new
