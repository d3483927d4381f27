"""sandbox="ray" behaves as a local REPL: the same scripted runs and episodes, once with local REPLs
and once with each REPL on a node of a two-node cluster simulated by Ray's own test utilities, give
the same answers, stop reasons, errors, model-visible feedback and trace events, once what must
differ is normalised away (ids, times, node names, each node's isolation report)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="sandbox='ray' needs the ray extra (installed by the dev extra)")
from ray.cluster_utils import Cluster  # noqa: E402

from recursa import RLM, Budget  # noqa: E402
from recursa.sandbox.cluster import shutdown_hosts  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROOT, SUB = "openai/root-model", "openai/sub-model"
KEY = "sk-parity-0123456789abcdef"
REPL = {"cpu_repl": 0.001}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head and one more node, both taking REPLs; provider keys in the environment of the driver
    and of the nodes' processes (none may reach a REPL, on either side)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPENAI_API_KEY", KEY)
        env.setenv("ANTHROPIC_API_KEY", KEY)
        yield from _cluster()


def _cluster() -> Iterator[Cluster]:
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                          "resources": {"cpu_repl": 1}})  # fmt: skip
    made.add_node(num_cpus=1, resources={"cpu_repl": 1})
    made.wait_for_nodes()
    ray.init(address=made.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield made
    finally:
        shutdown_hosts()
        ray.shutdown()
        made.shutdown()


def code(src: str) -> str:
    return f"Running it.\n```repl\n{src}\n```"


@dataclass
class Case:
    replies: list[str]  # the root's, in order (the last one repeats)
    options: dict[str, Any] = field(default_factory=dict)  # RLM(...) settings
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    sub: Callable[[str], str] = lambda prompt: f"sub:{prompt[:20]}"
    children: list[str] = field(default_factory=list)  # a child RLM's root replies (max_depth >= 2)
    context: str = "the context: alpha beta gamma"
    expect: list[str] = field(default_factory=list)  # in what the root saw, on both sides


def _refuse(prompt: str) -> str:
    raise AssertionError("not reached")


def failing_tool(x: int) -> int:
    """Divides 10 by x."""
    return 10 // x


THREADS = (  # 8 threads ask at once; the budget lets some through and refuses the others
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
BIG_AFTER_SMALL = (  # one call the budget takes, then one it refuses (in sequence: no race between them)
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

CASES: dict[str, Case] = {
    "exception_traceback": Case(
        [code("def f(n):\n    return g(n)\ndef g(n):\n    raise ValueError(f'bad {n}')\nf(3)"),
         code("import sys\nprint('to stderr', file=sys.stderr)\nprint('to stdout')\nundefined_name"),
         "FINAL(done)"],
        expect=["line 4, in g\n    raise ValueError(f'bad {n}')\nValueError: bad 3", "to stdout\nto stderr\n"],
    ),
    "answers": Case(
        [code("FINAL_VAR('nope')"), "FINAL_VAR(nothing_here)",
         code("answer['content'] = 'from the dict'\nanswer['ready'] = True")],
        expect=["no variable named 'nope' is defined", "FINAL_VAR(nothing_here) names no variable"],
    ),
    "final_var_value": Case([code("counts = {'a': 1, 'b': [1, 2]}\nFINAL_VAR('counts')")]),
    "huge_output": Case(
        [code("print('x' * 50_000)\nprint('y' * 10)"), "FINAL(seen)"],
        options={"max_output_chars": 2_000}, expect=["characters omitted ...]", "yyyyyyyyyy"],
    ),
    "timeout_keeps_state": Case(
        [code("kept = 'still here'"), code("while True:\n    pass"),
         code("import time\ntry:\n    while True:\n        time.sleep(0.02)\nexcept KeyboardInterrupt:\n"
              "    time.sleep(60)"),
         code("print(kept)"), "FINAL(ok)"],
        options={"exec_timeout": 0.5}, sandbox_options={"grace_s": 0.3},
        expect=["KeyboardInterrupt", "variables kept", "killed after", "REPL output:\nstill here"],
    ),
    "worker_dies": Case(
        [code("kept = 1"), code("import os\nos.kill(os.getpid(), 9)"),
         code("print('after kill', kept)\nimport os\nos._exit(3)"), code("print('after exit', kept)"),
         code("import resource\nprint(resource.getrlimit(resource.RLIMIT_DATA)[0] > 0)\nx = bytearray(6 << 30)"),
         "FINAL(ok)"],
        expect=["killed by SIGKILL", "exit code 3", "after exit 1", "True\n", "MemoryError"],
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
        options={"budget": Budget(max_usd=0.012), "max_output_tokens": 200,
                 "prices": {m: {"input_per_mtok": 1.0, "output_per_mtok": 1.0} for m in (ROOT, SUB)}},
        expect=["small: sub:small", "refused: LM call refused"],
    ),
    "no_sub_calls_at_depth_0": Case(
        [code("try:\n    llm_query('x')\nexcept Exception as e:\n    print(type(e).__name__, e)"), "FINAL(ok)"],
        options={"max_depth": 0}, expect=["max_depth=0"],
    ),
    "sub_raises": Case(
        [code("try:\n    llm_query('explode')\nexcept Exception as e:\n    print(type(e).__name__, e)"),
         code("llm_query('explode')"), "FINAL(ok)"],
        sub=lambda p: (_ for _ in ()).throw(RuntimeError("no")) if "explode" in p else "fine",
        expect=["SubcallError the call to openai/sub-model failed", "    llm_query('explode')\nSubcallError"],
    ),
    "tools": Case(
        [code("print(failing_tool(5))\nprint(failing_tool(0))"),
         code("try:\n    failing_tool(0)\nexcept Exception as e:\n    print(type(e).__name__, e)"), "FINAL(ok)"],
        options={"tools": [failing_tool]}, expect=["2\nTraceback", "ZeroDivisionError integer division"],
    ),
    "child_rlm": Case(
        [code("print(rlm_query('child question', context='child ctx'))\nprint(rlm_query('again'))"), "FINAL(ok)"],
        options={"max_depth": 2}, children=[code("print(len(context))"), "FINAL(child done)"],
        expect=["REPL output:\nchild done\nchild done"],
    ),
    "isolation_probes": Case(
        [code(PROBES), "FINAL(ok)"],
        expect=["REPL output:\n[]\nnet: PermissionError\ndenied\ndenied\ndenied\nwrote True\nmine"],
    ),
}


def run_case(server: Any, script: Any, tmp: Path, case: Case, side: str) -> dict[str, Any]:
    server.reset()
    script.root("root-model", *case.replies)
    script.sub("sub-model", case.sub)
    if case.children:
        script.root("sub-model", *case.children)
    options = dict(case.sandbox_options)
    if side == "ray":
        options["resources"] = REPL
    rlm = RLM(ROOT, sub_model=SUB, base_url=server.base_url, api_key=KEY, trace_dir=tmp / side,
              sandbox="ray" if side == "ray" else "auto", sandbox_options=options, **case.options)  # fmt: skip
    result = rlm.run("What is it?", case.context)
    roots = [r for r in server.requests if r.model == "root-model"]
    events = [json.loads(line) for line in Path(result.trace_path).read_text().splitlines()]
    return {
        "answer": result.answer,
        "value": result.value,
        "stop_reason": result.stop_reason,
        "error": result.error,
        "iterations": result.iterations,
        "llm_calls": result.usage.llm_calls,
        "seen": [m["content"] for m in roots[-1].messages] if roots else [],
        "subs": sorted(r.messages[-1]["content"] for r in server.requests if r.model == "sub-model"),
        "events": trace_events(events),
        "isolation": isolation(result.isolation),
    }


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


def trace_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace without its clocks; the sub-calls of one cell in a fixed order (concurrent ones end
    in any order, locally too)."""
    out: list[dict[str, Any]] = []
    group: list[dict[str, Any]] = []
    for event in events:
        kept = {k: v for k, v in event.items() if k not in _CLOCKED}
        if isinstance(kept.get("config"), dict):
            kept["config"] = {k: v for k, v in kept["config"].items() if k not in _SIDE}
        if kept["type"] == "lm_call" and kept.get("purpose") != "root":
            kept.pop("call_id")  # numbered as they start
            group.append(kept)
            continue
        out += sorted(group, key=lambda e: json.dumps(normalised(e), sort_keys=True, default=str))
        group = []
        out.append(kept)
    return out + group


_IDS = re.compile(r"\b(run|call|ep)[-_][0-9a-f]{6,}\b|\b[0-9a-f]{12,}\b")
_TIMES = re.compile(r"\b\d+(\.\d+)?\s?(ms|s)\b")


def normalised(value: Any) -> Any:
    if isinstance(value, str):
        return _TIMES.sub("<t>", _IDS.sub("<id>", value))
    if isinstance(value, list):
        return [normalised(v) for v in value]
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_run_on_the_cluster_is_a_local_run(cluster: Cluster, server: Any, script: Any, tmp_path: Path,
                                             name: str) -> None:  # fmt: skip
    case = CASES[name]
    local = normalised(run_case(server, script, tmp_path, case, "local"))
    seen = "\n".join(local["seen"] + [e["stdout"] for e in local["events"] if e["type"] == "exec"])
    assert all(text in seen for text in case.expect), (case.expect, seen)  # (both sides as wrong would agree)
    remote = normalised(run_case(server, script, tmp_path, case, "ray"))
    for key in local:
        assert remote[key] == local[key], (key, local[key], remote[key])
