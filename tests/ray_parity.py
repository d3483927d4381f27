"""The differential between local REPLs and `sandbox="ray"` (tests/test_ray_sandbox.py runs it on
its cluster): the same scripted runs and RLMEnv episodes, each once with local REPLs and once
with its REPLs on the cluster, through the real `openai` SDK against the fake server. What is
compared: answers, values, stop reasons, errors, what the root saw turn by turn, the sub-calls'
prompts, the trace's events in order, the rollout rows, and the isolation report. Normalised away
only what must differ: ids, clocks, which node, whether a REPL was forked from the node's zygote,
and limits set from a worker's measured size (only whether they are set)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa import RLM, Budget
from recursa.env import RLMEnv
from recursa.sandbox import cgroups

ROOT, SUB = "openai/root-model", "openai/sub-model"
KEY = "sk-parity-0123456789abcdef"  # the run's key, and the nodes' and driver's environment's


def code(src: str) -> str:
    return f"Running it.\n```repl\n{src}\n```"


def _sub(prompt: str) -> str:
    if "explode" in prompt:
        raise RuntimeError("no")
    if "slow" in prompt:
        time.sleep(0.8)  # (the fake server's thread: a cell's deadline passes while it waits)
    return f"sub:{prompt[:20]}"


@dataclass
class Case:
    replies: list[str]  # the root's, in order (the last one repeats)
    options: dict[str, Any] = field(default_factory=dict)  # RLM(...) or RLMEnv(...) settings
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    children: list[str] = field(default_factory=list)  # a child RLM's root replies (max_depth >= 2)
    expect: list[str] = field(default_factory=list)  # in what the root saw or the cells printed
    episode: bool = False  # an RLMEnv episode stepped with `replies`, not an RLM run
    questions: int = 1  # more: a session's questions, each answered with `replies`
    copies: int = 1  # more: episodes of one environment stepped at once, each its own context
    context: Any = "the context: alpha beta gamma"


def failing_tool(x: int) -> int:
    """Divides 10 by x."""
    return 10 // x


def unsendable_tool() -> Any:
    """Returns what JSON cannot carry."""
    return {1, 2}


def reading_tool(name: str) -> str:
    """Reads a host file."""
    with open(f"/srv/recursa-parity/secret/{name}") as fh:
        return fh.read()


THREADS = (  # 8 threads ask at once; a cap on calls lets some through and refuses the others
    "from concurrent.futures import ThreadPoolExecutor\n"
    "def ask(i):\n"
    "    try:\n"
    "        return llm_query('same question')\n"
    "    except Exception as e:\n"
    "        return f'{type(e).__name__}: {e}'\n"
    "with ThreadPoolExecutor(8) as pool:\n"
    "    out = sorted(pool.map(ask, range(8)))\n"
    "print('\\n'.join(out))"
)
BIG_AFTER_SMALL = (  # one call the budget takes, then one it refuses (in sequence: no race)
    "print('small:', llm_query('small'))\n"
    "try:\n    llm_query('x' * 60_000)\nexcept BudgetExceeded as e:\n    print('refused:', e)"
)
PROBES = (
    "import os, socket\n"
    f"print(sorted(k for k, v in os.environ.items() if 'KEY' in k or {KEY!r} in v))\n"
    "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\nexcept Exception as e:\n"
    "    print('net:', type(e).__name__)\n"
    "for path in ('/etc/passwd', '/root/probe', '/tmp/probe', os.path.expanduser('~/probe')):\n"
    "    try:\n        open(path, 'a').close()\n        print('wrote', path == os.path.expanduser('~/probe'))\n"
    "    except OSError:  # EACCES (Landlock) or EROFS (bwrap's read-only binds; a forked REPL)\n"
    "        print('denied')\n"
    "open('scratch.txt', 'w').write('mine')\nprint(open('scratch.txt').read())"
)
PRICES = {m: {"input_per_mtok": 1.0, "output_per_mtok": 1.0} for m in (ROOT, SUB)}

CASES: dict[str, Case] = {
    "cells": Case(
        [code("def f(n):\n    return g(n)\ndef g(n):\n    raise ValueError(f'bad {n}')\nf(3)"),
         code("import sys\nprint('to stderr', file=sys.stderr)\nprint('to stdout')\nundefined_name"),
         code("print('x' * 50_000)\nprint('y' * 10)"),
         code("llm_query = 5\ncontext = 'mine'\nkept = {'a': [1, 2], 'b': None}\nSHOW_VARS()"),
         code("print(len(context), llm_query('again'))\nprint('\\udcff surrogate', 'é日本')\n"
              "try:\n    print(llm_query('odd \\udcff'))\nexcept Exception as e:\n    print(type(e).__name__, e)"),
         code("FINAL_VAR('nope')"), "FINAL_VAR(nothing_here)", code("FINAL_VAR('kept')")],
        options={"max_output_chars": 2_000},
        expect=["line 4, in g\n    raise ValueError(f'bad {n}')\nValueError: bad 3", "to stdout\nto stderr\n",
                "characters omitted ...]", "yyyyyyyyyy", "29 sub:again", "no variable named 'nope' is defined",
                "FINAL_VAR(nothing_here) names no variable"],
    ),
    "deadlines_and_deaths": Case(
        [code("kept = 'still here'"), code("while True:\n    pass"),
         code("import time\ntry:\n    while True:\n        time.sleep(0.02)\nexcept KeyboardInterrupt:\n"
              "    time.sleep(60)"),
         code("print(llm_query('slow one'))"),
         code("import os\nos.kill(os.getpid(), 9)"),
         code("import os\nos.write(2, b'native stderr before exit\\n')\nos._exit(3)"),
         code("import resource\nprint(resource.getrlimit(resource.RLIMIT_DATA)[0] > 0)\nx = bytearray(6 << 30)"),
         code("print(kept)"), "FINAL(ok)"],
        options={"exec_timeout": 0.5}, sandbox_options={"grace_s": 0.3},
        expect=["KeyboardInterrupt", "variables kept", "killed after",
                "killed by SIGKILL", "exit code 3", "native stderr before exit", "True\n", "MemoryError",
                "REPL output:\nstill here"],
    ),
    "calls_budget_in_threads": Case(
        [code(THREADS), "FINAL(done)"], options={"budget": Budget(max_llm_calls=6)},
        expect=["BudgetExceeded: LM call refused: the budget of 6 LM calls is used up", "sub:same question"],
    ),
    "tokens_budget": Case(
        [code(BIG_AFTER_SMALL), "FINAL(partial)"],
        options={"budget": Budget(max_tokens=12_000), "max_output_tokens": 200},
        expect=["small: sub:small", "refused: LM call refused: this call could use up to"],
    ),
    "usd_budget": Case(
        [code(BIG_AFTER_SMALL), "FINAL(partial)"],
        options={"budget": Budget(max_usd=0.012), "max_output_tokens": 200, "prices": PRICES},
        expect=["small: sub:small", "refused: LM call refused"],
    ),
    "depth_0": Case(
        [code("try:\n    llm_query('x')\nexcept Exception as e:\n    print(type(e).__name__, e)"), "FINAL(ok)"],
        options={"max_depth": 0}, expect=["max_depth=0"],
    ),
    "sub_calls_and_tools_failing": Case(
        [code("try:\n    llm_query('explode')\nexcept Exception as e:\n    print(type(e).__name__, e)"),
         code("llm_query('explode')"),
         code("print(failing_tool(5))\nprint(failing_tool(0))"),
         code("try:\n    unsendable_tool()\nexcept Exception as e:\n    print(type(e).__name__, e)"),
         code("reading_tool('key.txt')"), "FINAL(ok)"],
        options={"tools": [failing_tool, unsendable_tool, reading_tool], "max_retries": 0},
        expect=["SubcallError the call to openai/sub-model failed", "    llm_query('explode')\nSubcallError",
                "2\nTraceback", "ZeroDivisionError", "FileNotFoundError"],
    ),
    "children": Case(
        [code("print(rlm_query('child question', context='child ctx'))\n"
              "print(rlm_query_batched(['a?', 'b?'], ['one', 'three']))"), "FINAL(ok)"],
        options={"max_depth": 2}, children=[code("print(len(context))"), "FINAL_VAR(context)"],
        expect=["REPL output:\nchild ctx\n['one', 'three']"],
    ),
    "partial_answer_at_the_turn_limit": Case(
        [code("answer['content'] = 'half of it'"), code("x = 1"), "still thinking"],
        options={"max_iterations": 2},
    ),
    "context_kinds": Case(
        [code("print(type(context).__name__, len(context), context)"), "FINAL(ok)"],
        context={"notes": "日本語の文 é", "more": "alpha\nünïcödé beta"}, expect=["dict 2 {'notes': '日本語の文 é'"],
    ),
    "session": Case(
        [code("asked = globals().get('asked', 0) + 1\nprint(asked, history if asked > 1 else None, context[1])"),
         code("answer['content'] = asked\nanswer['ready'] = True")],
        context=["one", "ünïcödé two"], questions=2, expect=["REPL output:\n2 [{'question': 'Question 1?', 'answer': '1', 'stop_reason': 'final'}] ünïcödé two"],
    ),
    "run_deadline": Case(
        [code("print('begun')"), code("import time\ntime.sleep(30)"), "FINAL(late)"],
        options={"budget": Budget(max_seconds=2)},
    ),
    "isolation_probes": Case(
        [code(PROBES), "FINAL(ok)"],
        expect=["REPL output:\n[]\nnet: PermissionError\ndenied\ndenied\ndenied\nwrote True\nmine"],
    ),
    "episode": Case(
        [code("print(len(context), llm_query('in an episode'))\nprint(rlm_query('child?', context='kid'))"),
         code("import os\nos.kill(os.getpid(), 9)"), code("x = 2"), "FINAL(16)"],
        options={"max_turns": 4, "max_depth": 2}, sandbox_options={"snapshots": True}, episode=True,
        children=[code("print(len(context))"), "FINAL_VAR(context)"],
        expect=["29 sub:in an episode\nkid", "killed by SIGKILL"],
    ),
    "episodes_at_once": Case(
        [code("print(llm_query(context))\nlast = context[-2:]"), code("print(len(context), last)"), "FINAL(16)"],
        options={"max_turns": 4}, episode=True, copies=4, expect=["sub:the context: alpha", "#3"],
    ),
    "episode_past_its_turns": Case([code("x = 1")] * 3, options={"max_turns": 2}, episode=True),
}

if cgroups.memory_available() is not None:  # (else the environment's bound only refuses starts)
    CASES["episode_in_a_memory_bound"] = Case(
        [code("held = bytearray(300 << 20)\nfor i in range(0, len(held), 4096):\n    held[i] = 1\nprint('held')"),
         code("print('after')"), "FINAL(16)"],
        options={"max_turns": 4, "max_memory_bytes": 256 << 20}, sandbox_options={"snapshots": True}, episode=True,
        expect=["reached their memory bound (256 MiB)", "after"],
    )  # fmt: skip


async def run_case(server: Any, trace_dir: Path, case: Case, sandbox: str, options: dict[str, Any]) -> dict[str, Any]:
    """One case with REPLs of `sandbox` (`options` added to its sandbox_options): what is compared
    (an exception out of the run or episode is part of it)."""
    try:
        return await _run_case(server, trace_dir, case, sandbox, options)
    except Exception as exc:
        return normalised({"raised": f"{type(exc).__name__}: {exc}", "seen": []})


async def _run_case(server: Any, trace_dir: Path, case: Case, sandbox: str, options: dict[str, Any]) -> dict[str, Any]:
    server.reset()
    script = server.holder["responder"]
    script.roots.clear()
    script.root("root-model", *case.replies)
    script.sub("sub-model", _sub)
    if case.children:
        script.root("sub-model", *case.children)
    settings = {"sandbox": sandbox, "sandbox_options": {**case.sandbox_options, **options}, "trace_dir": trace_dir,
                "base_url": server.base_url, "api_key": KEY, **case.options}  # fmt: skip
    if case.episode:
        got = await _episode(case, settings)
    else:
        rlm = RLM(ROOT, sub_model=SUB, **settings)
        if case.questions > 1:
            async with rlm.session(case.context) as session:
                results = [await session.aask(f"Question {i + 1}?") for i in range(case.questions)]
        else:
            results = [await rlm.arun("What is it?", case.context)]
        result = results[-1]
        trace = await asyncio.to_thread(Path(str(result.trace_path)).read_text)
        got = {"answer": [r.answer for r in results], "value": [r.value for r in results],
               "stop_reason": [r.stop_reason for r in results], "error": [r.error for r in results],
               "iterations": result.iterations, "llm_calls": result.usage.llm_calls,
               "isolation": isolation(result.isolation), "events": trace_events(trace.splitlines())}  # fmt: skip
    roots = [r for r in server.requests if r.model == "root-model"]
    got["seen"] = [m["content"] for m in roots[-1].messages] if roots else []
    got["subs"] = sorted(str(r.messages[-1]["content"]) for r in server.requests if r.model == "sub-model")
    return normalised(got)


async def _episode(case: Case, settings: dict[str, Any]) -> dict[str, Any]:
    """RLMEnv episodes stepped with the case's replies (the root's turns come from the caller), as
    many at once as the case has copies, each with a context of its own."""
    env = RLMEnv(SUB, **settings)
    try:
        contexts = [case.context] if case.copies == 1 else [f"{case.context} #{i}" for i in range(case.copies)]
        outcomes = await asyncio.gather(*(_stepped(env, case, context) for context in contexts))
        return outcomes[0] if case.copies == 1 else {"episodes": outcomes}
    finally:
        await env.aclose()


async def _stepped(env: RLMEnv, case: Case, context: Any) -> dict[str, Any]:
    episode = await env.start("What is it?", context, scorer=lambda a: float(a == "16"))
    observations = []
    for reply in case.replies:
        if episode.done:
            break
        observations.append(await episode.step(reply))
    rows = episode.rollouts(include_subcalls=True) if episode.done else []
    return {"observations": observations, "done": episode.done, "answer": episode.answer,
            "stop_reason": episode.stop_reason, "error": episode.error, "reward": episode.reward,
            "messages": episode.messages, "isolation": isolation(episode.result.isolation),
            "rows": [{k: v for k, v in r.items() if k not in ("run_id", "trajectory_id", "parent_run_id")}
                     for r in rows],
            "events": trace_events([json.dumps(e) for e in episode.events])}  # fmt: skip


def isolation(report: dict[str, Any]) -> dict[str, Any]:
    """An isolation report without what differs by node or by measure: which node, whether the REPL
    was forked from the node's zygote, and the limits set from the worker's measured size (only
    whether they are set)."""
    kept = {k: v for k, v in report.items() if k not in ("ray_node", "ray_node_address", "forked")}
    kept["rlimits"] = {k: v if k != "data" else v is not None for k, v in report.get("rlimits", {}).items()}
    memory = dict(report.get("memory", {}))
    memory["cgroup_limit_bytes"] = memory.get("cgroup_limit_bytes") is not None
    kept["memory"] = memory
    return kept


_CLOCKED = frozenset({"seq", "ts", "queued_s", "latency_s", "duration_s", "isolation"})
_SIDE = frozenset({"sandbox", "sandbox_options"})  # run_start's config: which sandbox ran is the difference


def trace_events(lines: list[str]) -> list[dict[str, Any]]:
    """A trace without its clocks, each run's events in their order, the runs in the order of
    what they were asked (children of one batch run at once and interleave in any order, locally
    too), and the sub-calls between two other events of a run in a fixed order (likewise)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        kept = {k: v for k, v in json.loads(line).items() if k not in _CLOCKED}
        if isinstance(kept.get("config"), dict):
            kept["config"] = {k: v for k, v in kept["config"].items() if k not in _SIDE}
        runs.setdefault(str(kept.get("run_id")), []).append(kept)
    ordered = sorted(runs.values(), key=lambda run: (run[0].get("depth") or 0, _key(run[0])))
    return [event for run in ordered for event in _sub_calls_sorted(run)]


def _key(event: dict[str, Any]) -> str:
    return json.dumps(normalised(event), sort_keys=True, default=str)


def _sub_calls_sorted(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    group: list[dict[str, Any]] = []
    for event in events:
        if event["type"] == "lm_call" and event.get("purpose") != "root":
            event.pop("call_id", None)  # numbered as they start
            group.append(event)
            continue
        out += sorted(group, key=_key)
        group = []
        out.append(event)
    return out + sorted(group, key=_key)


_IDS = re.compile(r"\b(run|call|ep|env)[-_][0-9a-f]{6,}\b|\b[0-9a-f]{12,}\b")
_TIMES = re.compile(r"\b\d+(\.\d+)?\s?(ms|s)\b")


def normalised(value: Any) -> Any:
    if isinstance(value, str):
        return _TIMES.sub("<t>", _IDS.sub("<id>", value))
    if isinstance(value, list | tuple):
        return [normalised(v) for v in value]
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items()}
    return value


def differences(local: dict[str, Any], remote: dict[str, Any]) -> list[str]:
    """Where two outcomes differ, first difference of each part, for the failure message."""
    found = []
    for key in local:
        if remote.get(key) != local[key]:
            a, b = local[key], remote.get(key)
            if isinstance(a, list) and isinstance(b, list):
                i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                a, b = a[i : i + 1], b[i : i + 1]
                key = f"{key}[{i}]"
            found.append(f"{key}:\n  local: {json.dumps(a, default=str)[:2000]}\n  ray:   {json.dumps(b, default=str)[:2000]}")
    return found


def expected_in(outcome: dict[str, Any], case: Case) -> list[str]:
    """The case's expected texts found nowhere in the outcome (what the root saw, what the cells
    printed, the observations): both sides wrong in the same way would agree."""
    text = "\n".join(_strings(outcome))
    return [wanted for wanted in case.expect if normalised(wanted) not in text]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [s for v in value for s in _strings(v)] if isinstance(value, list) else []
