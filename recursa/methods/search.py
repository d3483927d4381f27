"""BM25 over a context's passages or documents (the `bm25s` package, an optional extra): the
`search` of `codeact-bm25` and the sub-model tool `search_documents` of `rlm-subtools`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from recursa.errors import ConfigError
from recursa.extras import install_hint
from recursa.tools.spec import host_tool

PASSAGE_CHARS = 2_000
# `search_documents` returns whole documents up to this size (longer ones are cut into parts of
# about this size), so a hit carries the title and alias lines that say what the document is about.
DOCUMENT_CHARS = 12_000
# Hits per call at most: a sub-model reads every hit in its window.
MAX_DOCUMENT_HITS = 10


def passages_of(context: Any, size: int = PASSAGE_CHARS) -> list[str]:
    """Documents (list elements, dict entries with their keys) cut into passages of about `size`."""
    if isinstance(context, str):
        items = [context]
    elif isinstance(context, dict):
        items = [f"{k}\n{v}" for k, v in context.items()]
    else:
        items = [str(x) for x in context]
    out: list[str] = []
    for item in items:
        start = 0
        while start < len(item):
            end = min(len(item), start + size)
            if end < len(item):
                cut = max(
                    item.rfind("\n", start + size // 2, end), item.rfind(". ", start + size // 2, end) + 1
                )
                end = cut if cut > start else end
            out.append(item[start:end].strip())
            start = end
    return [p for p in out if p]


class BM25Index:
    def __init__(self, passages: list[str]) -> None:
        try:
            import bm25s
        except ImportError:
            raise ConfigError(
                "BM25 search (codeact-bm25, rlm-subtools) needs the bm25s package: " + install_hint("bench")
            ) from None
        self._bm25s = bm25s
        self.passages = passages or [""]
        tokens = bm25s.tokenize(self.passages, stopwords="en", show_progress=False)
        self._retriever = bm25s.BM25()
        self._retriever.index(tokens, show_progress=False)

    @classmethod
    def from_context(cls, context: Any) -> BM25Index:
        return cls(passages_of(context))

    def search(self, query: str, k: int = 5) -> list[str]:
        k = max(1, min(int(k), len(self.passages), 100))
        tokens = self._bm25s.tokenize([query or " "], stopwords="en", show_progress=False)
        if not tokens.vocab:
            return []
        found, scores = self._retriever.retrieve(tokens, k=k, show_progress=False)
        return [self.passages[int(i)] for i, score in zip(found[0], scores[0], strict=True) if score > 0]


def document_search(context: Any) -> Callable[..., list[str]]:
    """A host tool for `RLM(sub_tools=[...])`: BM25 over the documents of `context`."""
    index = BM25Index(passages_of(context, DOCUMENT_CHARS))

    def search_documents(query: str, k: int = 4) -> list[str]:
        """Search the document collection (BM25, keyword match). Returns the texts of the k
        documents that best match `query` (at most 10), best first. Put names, years and
        distinctive words from the question in the query."""
        return index.search(str(query), max(1, min(int(k), MAX_DOCUMENT_HITS)))

    return search_documents


def passage_search(context: Any) -> Callable[..., list[str]]:
    """A host REPL tool for `codeact-bm25`: BM25 over passages of the whole context."""
    index = BM25Index.from_context(context)

    @host_tool
    def search(query: str, k: int = 5) -> list[str]:
        """The k passages of the whole text that best match `query` (BM25)."""
        return index.search(str(query), int(k))

    return search
