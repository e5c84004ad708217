"""Long documents in rerank: a document longer than its token limit is cut (truncation) or split into overlapping
windows, each its own prompt over the shared query prefix, each window knowing its character span."""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import InvalidRequestError


def window_starts(length: int, size: int, stride: int) -> list[int]:
    """First token of each window of `size` tokens every `stride` tokens; the last window ends with the document."""
    starts = list(range(0, max(length - size, 0) + 1, stride))
    if starts[-1] + size < length:
        starts.append(length - size)
    return starts


@dataclass(frozen=True)
class LongDocumentPolicy:
    """What to do with a document over `limit` tokens: cut it (keeping its start, or its end) or window it."""

    limit: int  # the longest document scored whole
    truncate: bool
    keep_end: bool  # truncation drops the start instead of the end
    size: int  # window size
    stride: int

    @classmethod
    def of(cls, fits: int, max_tokens_per_doc: int | None, window_size: int | None, window_stride: int | None,
           truncate: bool, keep_end: bool = False) -> LongDocumentPolicy:
        """`fits`: document tokens the model takes beside the query and the format's text (its context minus those)."""
        if fits < 1:
            raise InvalidRequestError("the query with the format's text leaves no room for a document in the "
                                      "model's context; shorten it", "query")
        if max_tokens_per_doc is not None and max_tokens_per_doc < 1:
            raise InvalidRequestError(f"max_tokens_per_doc must be at least 1, got {max_tokens_per_doc}",
                                      "max_tokens_per_doc")
        if window_size is not None and window_size > fits:
            raise InvalidRequestError(f"window_size = {window_size} tokens does not fit the model's context beside "
                                      f"the query and the format's text (at most {fits})", "window_size")
        threshold = max_tokens_per_doc or window_size or fits
        limit = min(threshold, fits)
        size = window_size or limit
        stride = window_stride or max(1, size - size // 4)
        if stride > size:
            raise InvalidRequestError(f"window_stride = {stride} exceeds window_size = {size}: windows would skip "
                                      "tokens", "window_stride")
        return cls(limit, truncate, keep_end, size, stride)


@dataclass(frozen=True)
class DocumentPieces:
    """One document's pieces to score: the whole (or cut) document, or its windows with their character spans."""

    pieces: list[list[int]]
    spans: list[tuple[int, int] | None] | None  # per window, in document characters (None without offsets); None
    # when the document is not windowed

    @property
    def windowed(self) -> bool:
        return self.spans is not None


def document_pieces(ids: list[int], offsets: list[tuple[int, int]] | None, policy: LongDocumentPolicy
                    ) -> DocumentPieces:
    if len(ids) <= policy.limit:
        return DocumentPieces([ids], None)
    if policy.truncate:
        return DocumentPieces([ids[-policy.limit:] if policy.keep_end else ids[: policy.limit]], None)
    pieces, spans = [], []
    for start in window_starts(len(ids), policy.size, policy.stride):
        end = min(start + policy.size, len(ids))
        pieces.append(ids[start:end])
        spans.append((offsets[start][0], offsets[end - 1][1]) if offsets is not None else None)
    return DocumentPieces(pieces, spans)
