"""Token id -> the text clients see for it (logprobs) and its raw bytes (chat logprobs), cached per tokenizer."""

from __future__ import annotations

from functools import lru_cache


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level alphabet: each of the 256 bytes is written as one printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()


class TokenStrings:
    """Token id -> its text (as in logprobs) and its raw bytes (as in chat logprobs), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in str(backend.decoder)
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_level and isinstance(piece, str) and piece and all(ch in _BYTE_DECODER for ch in piece):
            return [_BYTE_DECODER[ch] for ch in piece]
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return [int(piece[3:5], 16)]  # SentencePiece byte fallback
        return list(self._text(token_id).encode("utf-8"))
