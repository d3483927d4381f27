"""Root turns to answer over the reply corpus (tests/replies/), with answers beside code taken when
they cannot be a guess (the `answer_beside_code` rule, now) and with them always waiting (before).

    python benchmarks/answer_turns.py [--beside-only] [--limit N]

Every corpus case with a `run` section is run whole (a scripted root gives the case's replies in
order, the REPL is real), once per setting; the table counts root turns (`result.iterations`) and
whether the run still ends with the case's answer. `--beside-only`: only the cases whose first reply
writes an answer beside code (the ones the rule can change).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from recursa import RLM
from recursa.loop.engine import RunEngine
from recursa.loop.parse import read_reply
from recursa.loop.rules import DEFAULT_RULES
from recursa.scripted import register

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "replies"
_names = itertools.count()


def _text(value: Any) -> Any:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return value


def _cases(beside_only: bool) -> list[dict[str, Any]]:
    cases = []
    for path in sorted(CORPUS.glob("*.json")):
        for case in json.loads(path.read_text(encoding="utf-8")):
            if not case.get("run") or case.get("unfenced_code") is False:
                continue
            read = read_reply(_text(case["reply"]))
            case["beside"] = bool(read.code and read.turn_answer is not None)
            if case["beside"] or not beside_only:
                cases.append(case)
    return cases


def _model(replies: list[str], then: str) -> str:
    """A scripted model that gives `replies` in order, then `then` (a model confirming its answer)."""
    name = f"corpus-{next(_names)}"

    @register(name)
    def _factory() -> Any:
        def policy(messages: list[dict[str, Any]]) -> str:
            done = sum(1 for m in messages if m["role"] == "assistant")
            return replies[done] if done < len(replies) else then

        return policy

    return f"scripted/{name}"


def _run(case: dict[str, Any], trace_dir: str) -> tuple[int, bool]:
    spec = case["run"]
    replies = [_text(case["reply"]), *(_text(r) for r in spec.get("then", []))]
    rlm = RLM(
        _model(replies, f"FINAL({json.dumps(_text(spec['answer']), ensure_ascii=False)})"),
        sub_model=_model([], spec.get("sub", "sub answer")),
        trace_dir=trace_dir,
        max_iterations=spec.get("max_iterations", 4),
    )
    result = rlm.run(spec.get("question", "What is the answer?"), _text(spec.get("context", "ctx")))
    return result.iterations, result.answer == _text(spec["answer"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beside-only", action="store_true")
    parser.add_argument("--limit", type=int, default=0, help="run at most N cases (0: all)")
    args = parser.parse_args()
    cases = _cases(args.beside_only)
    if args.limit:
        cases = cases[: args.limit]
    before_rules = DEFAULT_RULES.without("answer_beside_code")
    rows: dict[str, dict[str, list[Any]]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for setting in ("before", "after"):
            turns: dict[str, list[Any]] = {"all": [], "beside": [], "same_answer": []}
            # Before: the engine reads replies with the rule switched off (what it did until now).
            patch = (
                mock.patch.object(RunEngine, "reply_rules", property(lambda self: before_rules))
                if setting == "before"
                else contextlib.nullcontext()
            )
            with patch:
                for case in cases:
                    n, same = _run(case, tmp)
                    turns["all"].append(n)
                    turns["same_answer"].append(same)
                    if case["beside"]:
                        turns["beside"].append(n)
            rows[setting] = turns
    seconds = time.perf_counter() - started
    print(f"answer_turns: {len(cases)} corpus runs per setting, {seconds:.1f} s in all")
    print(f"{'setting':<8} {'cases':>6} {'root turns':>11} {'mean':>6} {'beside-code cases':>18} "
          f"{'their turns':>12} {'their mean':>11} {'same answer':>12}")
    for setting, t in rows.items():
        beside = t["beside"]
        print(
            f"{setting:<8} {len(t['all']):>6} {sum(t['all']):>11} {statistics.fmean(t['all']):>6.2f} "
            f"{len(beside):>18} {sum(beside):>12} {statistics.fmean(beside) if beside else 0:>11.2f} "
            f"{sum(t['same_answer']):>12}"
        )
    fewer = sum(1 for b, a in zip(rows["before"]["all"], rows["after"]["all"], strict=True) if a < b)
    more = sum(1 for b, a in zip(rows["before"]["all"], rows["after"]["all"], strict=True) if a > b)
    print(f"answered in fewer turns after: {fewer} cases; in more: {more}")


if __name__ == "__main__":
    main()
