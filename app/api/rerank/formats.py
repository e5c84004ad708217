"""Generative reranking: the prompt formats (qwen3-reranker, chat, a custom file), each as the text before the document,
the document's own piece and the text after it, plus the two label words whose probabilities give the score."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
# Qwen3-Reranker's model card, verbatim: the system line, the user turn, and an empty think block before the answer.
_QWEN3_PREFIX = f"<|im_start|>system\n{_JUDGE}<|im_end|>\n<|im_start|>user\n"
_QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# The user turn; the document is its own piece so that the text before it is one shared prefix. It starts with the
# space that follows "<Document>:", which byte-level tokenizers attach to the next word: tokenizing the pieces
# apart gives the same ids as tokenizing the whole turn.
_QUERY_TEMPLATE = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>:"
_DOCUMENT_TEMPLATE = " {document}"
FORMAT_NAMES = ("chat", "qwen3-reranker")


class RerankFormatError(ValueError):
    """A --rerank-format that cannot be used with this model (unreadable file, a label word of several tokens)."""


@dataclass(frozen=True)
class RerankFormat:
    """Text templates of one prompt format: prefix + query + document + suffix, then the model answers yes or no."""

    name: str
    prefix: str  # text before the query part (may hold special tokens)
    query: str  # with {instruction} and {query}
    document: str  # with {document}
    suffix: str  # text after the document, up to where the answer starts
    yes: str
    no: str
    default_instruction: str = DEFAULT_INSTRUCTION


def _chat_format(tokenizer: PreTrainedTokenizerBase) -> RerankFormat:
    """The served model's own chat template around the judge's system line and the user turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise RerankFormatError("--rerank-format chat needs a tokenizer with a chat template; use qwen3-reranker or "
                                "a format file")
    marker = "\x00GENSCORE_USER_TURN\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": _JUDGE}, {"role": "user", "content": marker}],
        tokenize=False, add_generation_prompt=True)
    if text.count(marker) != 1:
        raise RerankFormatError("the chat template does not render the user turn verbatim")
    prefix, suffix = text.split(marker)
    return RerankFormat("chat", prefix, _QUERY_TEMPLATE, _DOCUMENT_TEMPLATE, suffix, "yes", "no")


def _file_format(path: Path) -> RerankFormat:
    """A JSON file with prefix, query, document, suffix, yes and no (and optionally default_instruction)."""
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RerankFormatError(f"cannot read the rerank format file {path}: {exc}") from None
    fields = ("prefix", "query", "document", "suffix", "yes", "no")
    missing = [f for f in fields if not isinstance(spec.get(f), str)]
    if missing:
        raise RerankFormatError(f"rerank format file {path} needs string fields {missing}")
    if "{document}" not in spec["document"] or "{query}" not in spec["query"]:
        raise RerankFormatError(f"rerank format file {path}: 'query' needs {{query}} and 'document' needs {{document}}")
    return RerankFormat(path.stem, *(spec[f] for f in fields),
                        default_instruction=spec.get("default_instruction", DEFAULT_INSTRUCTION))


def resolve_format(spec: str, tokenizer: PreTrainedTokenizerBase) -> RerankFormat:
    """--rerank-format value -> a format: `chat`, `qwen3-reranker`, or the path of a JSON format file."""
    if spec == "chat":
        return _chat_format(tokenizer)
    if spec == "qwen3-reranker":
        return RerankFormat(spec, _QWEN3_PREFIX, _QUERY_TEMPLATE, _DOCUMENT_TEMPLATE, _QWEN3_SUFFIX, "yes", "no")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise RerankFormatError(f"--rerank-format must be one of {FORMAT_NAMES} or a JSON file, got {spec!r}")
    return _file_format(path)


@dataclass(frozen=True)
class RerankPrompts:
    """One format bound to the served tokenizer: its label token ids and the token pieces of a prompt."""

    format: RerankFormat
    tokenizer: PreTrainedTokenizerBase
    yes_id: int
    no_id: int

    @classmethod
    def bind(cls, fmt: RerankFormat, tokenizer: PreTrainedTokenizerBase) -> RerankPrompts:
        ids = []
        for word in (fmt.yes, fmt.no):
            tokens = tokenizer(word, add_special_tokens=False)["input_ids"]
            if len(tokens) != 1:
                raise RerankFormatError(f"rerank label word {word!r} is {len(tokens)} tokens in this model's "
                                        "vocabulary; it must be exactly one")
            ids.append(tokens[0])
        if ids[0] == ids[1]:
            raise RerankFormatError(f"rerank label words {fmt.yes!r} and {fmt.no!r} are the same token")
        return cls(fmt, tokenizer, ids[0], ids[1])

    def _ids(self, text: str) -> list[int]:
        # special tokens are written in the templates themselves, so the tokenizer adds none of its own
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def head(self, query: str, instruction: str | None) -> list[int]:
        """Everything before the document: the part every document of a request shares."""
        fmt = self.format
        text = fmt.query.format(instruction=instruction or fmt.default_instruction, query=query)
        return self._ids(fmt.prefix + text)

    def document(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """The document's piece as token ids, with each token's character span in the document text (None with a
        tokenizer that gives no offsets); the template's own text around the document is clipped away."""
        piece = self.format.document.format(document=text)
        if not self.tokenizer.is_fast:
            return self._ids(piece), None
        encoded = self.tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
        before = self.format.document.format(document="\x00").index("\x00")  # characters ahead of the document
        spans = [(min(max(a - before, 0), len(text)), min(max(b - before, 0), len(text)))
                 for a, b in encoded["offset_mapping"]]
        return encoded["input_ids"], spans

    def tail(self) -> list[int]:
        return self._ids(self.format.suffix)
