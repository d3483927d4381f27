"""The scripted root model every engine talks to, through the same fake server.

recursa and the official package share the REPL conventions this needs (```repl blocks,
`llm_query`, `llm_query_batched`, `rlm_query_batched`, and `answer["content"]` /
`answer["ready"] = True` to finish), so for every case the root writes the same code for both.
The other engines' questions carry `ENGINE[name]` (added by run.py), and the root writes the same
work in their dialects. minrlm: ```python blocks, `sub_llm(task)`, `sub_llm_batch([(task, ctx)])`
and `FINAL(value)`, which refuses an answer until the run's code has read the context (`input_0`),
so the last cell also reads `input_0[:0]` (nothing) first. recursive-llm: recursa's conventions
in ```python blocks (it would run a ```repl block's tag as code); its REPL runs RestrictedPython,
which refuses the timed cells (names starting with `_`, most imports), so it gets the per-turn
cases only. In every dialect the trivial turns are the same code.

The root recognises its task by a `BENCH[case:n]` marker in the question; a conversation without
one is a child RLM (depth 2), which takes three turns, or a plain sub-call (a lone user message, or
a prompt of the fan-out cases: minrlm's sub-calls carry a system prompt and go to the root model).
(recursa runs children on the sub-model and the official package on the root model; both are served
the same child policy.) Timed code measures itself inside the REPL and puts the elapsed seconds in
the answer, so every engine is timed the same way. In the per-turn case the question also names the
engine's process (`PID[n]`), and each root request appends the CPU time of that process tree to a
file for run.py (`_mark_cpu`).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"BENCH\[(\w+):(\d+)\]")
ENGINE_TAG = re.compile(r"ENGINE\[([\w-]+)\]")
FANOUT_PROMPT = re.compile(r"(item|again) \d+")
CLIENT_PID = re.compile(r"PID\[(\d+)\]")
# run.py sets this for the server process: where a root request of a run whose question names its
# process (PID[n]) appends the time and the CPU that process tree has used so far.
CPU_DIR = os.environ.get("BENCH_CPU_DIR")
SUB_MODEL = "bench-sub"
CHILD_TURNS = 3


@dataclass(frozen=True)
class Dialect:
    fence: str
    finish: str  # code that ends the run with the answer `{value}` (a Python expression)
    bodies: dict[str, str]  # the timed cells' work, by case; they set `answers`


REPL = Dialect(
    fence="repl",
    finish="answer['content'] = {value}\nanswer['ready'] = True",
    bodies={
        "batched": "answers = llm_query_batched([f'item {{i}}' for i in range({n})])",
        "twobatches": (
            "answers = llm_query_batched([f'item {{i}}' for i in range({half})])\n"
            "answers += llm_query_batched([f'again {{i}}' for i in range({half})])"
        ),
        "loop": "answers = [llm_query(f'item {{i}}') for i in range({n})]",
        "threads": (
            "from concurrent.futures import ThreadPoolExecutor\n"
            "with ThreadPoolExecutor(16) as pool:\n"
            "    answers = list(pool.map(llm_query, [f'item {{i}}' for i in range({n})]))"
        ),
        "children": "answers = rlm_query_batched([f'child task {{i}}' for i in range({n})])",
    },
)

PYTHON = Dialect(
    fence="python",
    finish="_ = input_0[:0]\nFINAL({value})",
    bodies={
        "batched": "answers = sub_llm_batch([(f'item {{i}}', '') for i in range({n})])",
        "twobatches": (
            "answers = sub_llm_batch([(f'item {{i}}', '') for i in range({half})])\n"
            "answers += sub_llm_batch([(f'again {{i}}', '') for i in range({half})])"
        ),
        "loop": "answers = [sub_llm(f'item {{i}}') for i in range({n})]",
        "threads": (
            "from concurrent.futures import ThreadPoolExecutor\n"
            "with ThreadPoolExecutor(16) as pool:\n"
            "    answers = list(pool.map(sub_llm, [f'item {{i}}' for i in range({n})]))"
        ),
    },
)

PYTHON_ANSWER = Dialect(fence="python", finish=REPL.finish, bodies={})
DIALECTS = {"minrlm": PYTHON, "recursive-llm": PYTHON_ANSWER}

_TIMED = "import time as _t\n_t0 = _t.perf_counter()\n{body}\n_el = _t.perf_counter() - _t0\n{finish}"
_COUNT = "f'{{sum(1 for a in answers if a.startswith(\"{expect}\"))}} {{_el:.4f}}'"


def _tree_cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` and of the processes below it, alive now (schedstat: ns)."""
    total, queue = 0, [pid]
    while queue:
        for task in Path(f"/proc/{queue.pop()}/task").glob("*"):
            try:
                total += int((task / "schedstat").read_text().split()[0])
                queue += [int(k) for k in (task / "children").read_text().split()]
            except (OSError, ValueError, IndexError):
                continue
    return total


def _mark_cpu(question: str) -> None:
    found = CLIENT_PID.search(question)
    if CPU_DIR and found:
        at, cpu = time.perf_counter(), _tree_cpu_ns(int(found.group(1)))
        with open(Path(CPU_DIR) / f"{found.group(1)}.txt", "a") as f:
            f.write(f"{at} {cpu}\n")


def _block(code: str, dialect: Dialect) -> str:
    return f"```{dialect.fence}\n{code}\n```"


def reply(model: str, messages: list[dict[str, str]]) -> str:
    if model == SUB_MODEL and len(messages) == 1:  # a plain llm_query (a child RLM has a system prompt)
        return "ok"
    last = messages[-1] if messages else {}
    if last.get("role") == "user" and FANOUT_PROMPT.fullmatch(str(last.get("content", "")).strip()):
        return "ok"
    done = sum(1 for m in messages if m["role"] == "assistant")
    found, dialect = None, REPL
    for m in messages:
        if m["role"] == "user":
            found = MARKER.search(m["content"])
            if found:
                tag = ENGINE_TAG.search(m["content"])
                dialect = DIALECTS[tag.group(1)] if tag else REPL
                break
    if found is None:  # a child RLM: two working turns, then its answer
        if done < CHILD_TURNS - 1:
            return _block(f"step = {done}\nprint(step)", REPL)
        return _block(REPL.finish.format(value="'child-done'"), REPL)
    case, n = found.group(1), int(found.group(2))
    if case == "turns":
        _mark_cpu(found.string)  # n turns of trivial code, then the answer
        if done < n - 1:
            return "Next step.\n" + _block(f"x = {done}\nprint(x)", dialect)
        return _block(dialect.finish.format(value="'done'"), dialect)
    expect = "child-done" if case == "children" else "ok"
    if case not in dialect.bodies:
        return _block(f"raise NotImplementedError('{case} is not in this dialect')", dialect)
    body = dialect.bodies[case].format(n=n, half=n // 2)
    finish = dialect.finish.format(value=_COUNT.format(expect=expect))
    return _block(_TIMED.format(body=body, finish=finish), dialect)
