"""Request and response models of the rerank routes: the Cohere/Jina/vLLM shape, Text Embeddings Inference's shape,
and the scoring fields both take (windows of long documents over the shared query prefix, a label set)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from app.api.protocol import SHAPE_TAG_SUFFIX, Flag, StrictModel, TokenId

# The /rerank path answers two shapes; the tags name the branch a body takes.
JINA_SHAPE, TEI_SHAPE = f"jina{SHAPE_TAG_SUFFIX}", f"tei{SHAPE_TAG_SUFFIX}"


class RerankScoringFields(StrictModel):
    """How documents are scored, in every shape: the windows of a document longer than `max_tokens_per_doc` (or than
    what fits the model beside the query), how its windows' scores aggregate, and the label set."""

    window_size: TokenId | None = Field(
        default=None, ge=1, description="Tokens per window of a long document (default: max_tokens_per_doc, else what "
        "fits the model's context beside the query).")
    window_stride: TokenId | None = Field(
        default=None, ge=1, description="Tokens between window starts (default: three quarters of window_size, so "
        "windows overlap by a quarter).")
    aggregate: Literal["max", "mean"] = Field(
        default="max", description="A windowed document's score: its best window's (max) or the windows' mean.")
    labels: str | dict[str, list[str | list[TokenId]]] | None = Field(
        default=None, description="A label set of two labels (relevant first, then not relevant) instead of the "
        "format's yes/no words: a name from --label-sets or {label: [surface form, ...]}.")


class TextDocument(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere v1 documents may carry other fields; only text is read

    text: str


class RerankRequest(RerankScoringFields):
    """The fields Cohere v2, Jina and vLLM rerank clients send, plus the long-document fields."""

    model: str | None = Field(default=None, description="Must match the served model name when given.")
    query: str = Field(description="The search query.")
    documents: list[str | TextDocument] = Field(description="Texts to rank, or {\"text\": ...} objects.")
    top_n: int | None = Field(default=None, description="Return only the best top_n documents (at least 1).")
    return_documents: Flag = Field(default=True, description="Include each document's text in its result.")
    instruction: str | None = Field(default=None, description="Task instruction in the prompt (default: the "
                                    "format's, a web-search retrieval task).")
    max_tokens_per_doc: int | None = Field(
        default=None, description="A document longer than this many tokens is scored in windows (or cut to its "
        "first max_tokens_per_doc tokens with `truncate`).")
    truncate: Flag = Field(default=False, description="Cut a long document to its first tokens instead of scoring "
                           "it in windows.")


class TeiRerankRequest(RerankScoringFields):
    """Text Embeddings Inference's rerank request (Haystack's TEI ranker and other RAG stacks send it)."""

    query: str = Field(description="The search query.")
    texts: list[str] = Field(description="Texts to rank.")
    raw_scores: Flag = Field(default=False, description="Report log p(yes) - log p(no) instead of the probability.")
    return_text: Flag = Field(default=False, description="Include each text in its result.")
    truncate: Flag | None = Field(default=False, description="Cut a text that does not fit the model beside the "
                                  "query (false or null: score it in windows).")
    truncation_direction: Literal["Left", "Right", "left", "right"] = Field(
        default="Right", description="Which end of a cut text is dropped: Right keeps its start, Left its end.")
    max_tokens_per_doc: int | None = Field(default=None, description="A text longer than this many tokens is scored "
                                           "in windows (or cut with `truncate`).")


def _shape(body: object) -> str:
    return TEI_SHAPE if isinstance(body, dict) and "texts" in body else JINA_SHAPE


AnyRerankRequest = Annotated[Annotated[RerankRequest, Tag(JINA_SHAPE)] | Annotated[TeiRerankRequest, Tag(TEI_SHAPE)],
                             Discriminator(_shape)]


class RerankDocument(BaseModel):
    text: str


class Span(BaseModel):
    start: int = Field(description="Offset of the window's first character in the document.")
    end: int = Field(description="Offset just past its last character.")


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None
    windows: int | None = Field(default=None, description="For a document scored in windows: how many.")
    span: Span | None = Field(default=None, description="For a document scored in windows: the characters of its "
                              "best window.")


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class JinaRerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class CohereRerankResponse(BaseModel):
    id: str
    results: list[RerankResult]
    meta: dict


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = None
    windows: int | None = None
    span: Span | None = None
