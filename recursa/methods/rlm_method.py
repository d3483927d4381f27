"""`rlm`, `rlm-nosub`, `rlm-tips`, `rlm-subtools`: the recursive language model itself.

- `rlm`: sub-calls to the sub-model (`max_depth=1`), as in the paper;
- `rlm-nosub`: the same REPL without sub-calls (`max_depth=0`);
- `rlm-tips`: `rlm` with the task family's strategy text (`Family.tips`) in the root's prompt;
- `rlm-subtools`: `rlm` whose sub-models may call `search_documents`, a BM25 search over the
  task's documents that runs in the host (`RLM(sub_tools=...)`); the root never sees its output.

Tasks that ship REPL tools (evidence-spans: `list_papers`, `search`, ...) pass them as
`RLM(tools=...)`: the engine defines them in the REPL and describes them in the root's prompt.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from recursa.methods.base import MethodResult, MethodSettings
from recursa.rlm import RLM
from recursa.tasks.base import Task, get_family


@dataclass
class RLMMethod:
    name: str = "rlm"
    subcalls: bool = True
    tips: bool = False  # add the family's tips to the root's system prompt
    sub_tools: bool = False  # give sub-models a BM25 search over the task's documents

    async def run(self, task: Task, settings: MethodSettings) -> MethodResult:
        sub_calls = 0
        user_listener = settings.run.get("on_event")

        def listen(event: dict[str, Any]) -> None:
            nonlocal sub_calls
            if event.get("type") == "lm_call" and event.get("purpose") == "sub" and "usage" in event:
                sub_calls += 1
            if user_listener is not None:
                user_listener(event)

        started = time.perf_counter()  # building the search index counts: the method pays for it
        sub_tools: list[Any] = []
        if self.sub_tools:
            from recursa.methods.search import document_search

            # Indexing a large collection takes a while: off the event loop, so other rows run on.
            sub_tools.append(await asyncio.to_thread(document_search, task.context))
        rlm = RLM(
            settings.model,
            sub_model=settings.sub_model,
            **{**settings.run, "on_event": listen},
            max_depth=1 if self.subcalls else 0,
            tools=task.tools,
            sub_tools=sub_tools,
        )
        tips = get_family(task.family).tips if self.tips else None
        result = await rlm.arun(task.question, task.context, tips=tips or None)
        return MethodResult(
            answer=result.answer,
            usage=result.usage,
            iterations=result.iterations,
            sub_calls=sub_calls,
            stop_reason=result.stop_reason,
            latency_s=time.perf_counter() - started,
            trace_path=str(result.trace_path) if result.trace_path else None,
            error=result.error,
            failure="budget" if result.stop_reason == "budget" else None,
        )
