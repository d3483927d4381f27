"""Worked example: a local BM25 search as a tool only sub-models can call (`RLM(sub_tools=[search])`).

The multihop-docs family asks 2-4 hop questions over generated documents. Without a tool the
root finds the starting entity by handing every document, group by group, to sub-models. With
`sub_tools=[search]` it asks a sub-model the question alone; the sub-model searches the
collection (BM25 in this process), reads the hits and answers. The root never sees the hits: only
the sub-model's short answer comes back into the REPL.

    pip install -e ".[bench]"                      # bm25s
    python examples/sub_tools_bm25.py               # scripted models, offline, no key
    python examples/sub_tools_bm25.py --sizes 32k,131k,1m --n 3
    python examples/sub_tools_bm25.py --model openai/gpt-5-mini --sub-model openai/gpt-5-nano --n 1

With the scripted models the table is a harness check (the calls, the tool round trips and the
token counts are real; the models' skill is not). Point --model/--sub-model at real models for
an evaluation.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recursa import RLM
from recursa.bench.sizes import CHARS_PER_TOKEN, label, parse_sizes
from recursa.tasks import Task, generate


def make_search(documents: list[str]) -> Callable[..., list[str]]:
    """A BM25 index over whole documents, and the tool function sub-models call.

    The tool runs in the host (sub-model tools always do), so it may close over the index.
    Its name, docstring and type hints are what the sub-model is offered.
    """
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(documents, stopwords="en", show_progress=False), show_progress=False)

    def search(query: str, k: int = 4) -> list[str]:
        """Search the document collection (BM25 keyword match). Returns the texts of the k documents
        that best match `query` (at most 10), best first. Put names, years and distinctive words
        from the question in the query."""
        tokens = bm25s.tokenize([query or " "], stopwords="en", show_progress=False)
        if not tokens.vocab:
            return []
        k = max(1, min(int(k), 10, len(documents)))
        found, scores = retriever.retrieve(tokens, k=k, show_progress=False)
        return [documents[int(i)] for i, s in zip(found[0], scores[0], strict=True) if s > 0]

    return search


@dataclass
class Row:
    score: float
    sub_calls: int  # sub-model calls (a tool round trip is one more call)
    searches: int  # search calls the sub-models made
    tokens: int  # input + output tokens of the whole call tree
    latency_s: float


async def solve(task: Task, *, with_search: bool, args: argparse.Namespace) -> Row:
    counts = {"sub": 0, "search": 0}

    def listen(event: dict[str, Any]) -> None:
        if event.get("type") == "lm_call" and event.get("purpose") == "sub" and "usage" in event:
            counts["sub"] += 1
        if event.get("type") == "tool_call" and event.get("caller") == "sub-model":
            counts["search"] += 1

    started = time.perf_counter()  # the index is part of the cost of the tool
    assert isinstance(task.context, list)
    rlm = RLM(
        args.model,
        sub_model=args.sub_model,
        base_url=args.base_url,
        sub_tools=[make_search(task.context)] if with_search else [],
        on_event=listen,
        trace=False,
    )
    result = await rlm.arun(task.question, task.context)
    return Row(
        score=task.score(result.answer),
        sub_calls=counts["sub"],
        searches=counts["search"],
        tokens=result.usage.input_tokens + result.usage.output_tokens,
        latency_s=time.perf_counter() - started,
    )


async def main(args: argparse.Namespace) -> None:
    print(f"multihop-docs, root {args.model}, sub-model {args.sub_model}, {args.n} instance(s) per size\n")
    print(
        "| context (tokens) | documents | sub-model tools | score | sub-model calls | searches | tokens | latency (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size in parse_sizes(args.sizes):
        tasks = [generate("multihop-docs", size * CHARS_PER_TOKEN, seed=seed) for seed in range(args.n)]
        for with_search in (False, True):
            rows = [await solve(t, with_search=with_search, args=args) for t in tasks]
            print(
                f"| {label(size)} | {len(tasks[0].context):,} | {'search (BM25)' if with_search else 'none'} "
                f"| {statistics.mean(r.score for r in rows):.2f} "
                f"| {statistics.median(r.sub_calls for r in rows):g} "
                f"| {statistics.median(r.searches for r in rows):g} "
                f"| {statistics.median(r.tokens for r in rows):,.0f} "
                f"| {statistics.median(r.latency_s for r in rows):.2f} |"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="32k,131k,1m", help="context sizes in tokens")
    parser.add_argument("--n", type=int, default=3, help="instances per size")
    parser.add_argument("--model", default="scripted/gpt5-like")
    parser.add_argument("--sub-model", default="scripted/oracle")
    parser.add_argument("--base-url", default=None)
    asyncio.run(main(parser.parse_args()))
