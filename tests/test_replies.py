"""The corpus of root-model replies under tests/replies/: how real models of each family write, and
what recursa must make of it. Every case goes through `read_reply`; cases with a `run` section also
go through a whole run, with the REPL, against the fake server.

A case (JSON; any text may be a list of lines, joined with newlines):
  id, family, covers   what it is and which defect or bug class it guards
  rules                the reply rules (recursa/loop/rules.py) it exercises: every rule whose switching
                       off changes how the reply is read, and any whose limit it tests
  reply                the root's reply
  blocks               the code blocks that run, in order
  final                null, or {"protocol", "text", "loose"}: the answer written in prose
  not_run              tags of the fences that do not run ("" for a bare fence); default none
  notes                how many notes the reader leaves for the model; default 0
  unfenced_code        optional: false reads (and runs) the reply with RLM(unfenced_code=False)
  run                  optional: context, then (the root's later replies), sub (the sub-model's reply),
                       max_iterations, executed (every block run, in order), answer, protocol,
                       stop_reason, value (when it differs from answer), feedback (texts the
                       message after the first reply must contain)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from recursa import RLM
from recursa.loop.parse import Reply, read_reply
from recursa.loop.rules import DEFAULT_RULES, RULES
from recursa.outcomes import ANSWER_PROTOCOLS, STOP_REASONS
from recursa.trace import load

CORPUS = Path(__file__).parent / "replies"
ROOT, SUB = "openai/root-model", "openai/sub-model"


def _text(value: Any) -> Any:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return value


def _rules(case: dict[str, Any]) -> Any:
    if case.get("unfenced_code", True):
        return DEFAULT_RULES
    return DEFAULT_RULES.without("unfenced_code", "bare_fence_code")


def _cases() -> list[Any]:
    cases = []
    for path in sorted(CORPUS.glob("*.json")):
        for case in json.loads(path.read_text(encoding="utf-8")):
            cases.append(pytest.param(case, id=f"{path.stem}:{case['id']}"))
    return cases


CASES = _cases()


def test_the_corpus_is_large_and_ids_are_unique():
    ids = [c.values[0]["id"] for c in CASES]
    assert len(ids) >= 60
    assert len(set(ids)) == len(ids)
    families = {c.values[0]["family"] for c in CASES}
    assert {"gpt", "claude", "qwen", "gemini", "small"} <= families


def _reading(parsed: Reply) -> tuple[Any, ...]:
    answer = parsed.answer
    written = None if answer is None else (answer.written.protocol, answer.written.text, answer.place)
    return parsed.code, written, parsed.skipped_tags, len(parsed.notes), parsed.code_outside_fences


def test_every_rule_has_a_case_and_every_case_names_its_rules():
    named = {name for c in CASES for name in c.values[0]["rules"]}
    assert named <= {r.name for r in RULES}
    assert {r.name for r in RULES} - named == set(), "a reply rule with no case in tests/replies/"
    assert all(c.values[0]["rules"] for c in CASES), "a case that names no rule"


@pytest.mark.parametrize("rule", [r for r in RULES if r.stage != "turn"], ids=lambda r: r.name)
def test_a_rule_s_own_examples_read_otherwise_without_it(rule):
    for example in rule.examples:
        assert _reading(read_reply(example)) != _reading(read_reply(example, DEFAULT_RULES.without(rule.name)))


@pytest.mark.parametrize("case", CASES)
def test_reply(case, request):
    parsed = read_reply(_text(case["reply"]), _rules(case))
    assert parsed.code == [_text(b) for b in case["blocks"]]
    final = case["final"]
    if final is None:
        assert parsed.turn_answer is None
    else:
        assert parsed.turn_answer is not None
        assert parsed.turn_answer.protocol == final["protocol"]
        assert parsed.turn_answer.text == _text(final["text"])
        assert parsed.turn_answer.loose == final.get("loose", False)
    assert sorted(parsed.skipped_tags) == sorted(case.get("not_run", []))
    assert len(parsed.notes) == case.get("notes", 0), parsed.notes
    # The rules it names are those it exercises: with any other switched off it reads the same.
    rules = _rules(case)
    for rule in RULES:
        if rule.stage != "turn" and rules.on(rule.name) and rule.name not in case["rules"]:
            assert _reading(read_reply(_text(case["reply"]), rules.without(rule.name))) == _reading(parsed), rule.name
    if "answer_beside_code" in case["rules"]:
        assert parsed.code and parsed.turn_answer is not None and case.get("run")
    if case.get("run"):
        _run(case, request.getfixturevalue("server"), request.getfixturevalue("script"), request)


def _run(case: dict[str, Any], server: Any, script: Any, request: Any) -> None:
    spec = case["run"]
    tmp_path = request.getfixturevalue("tmp_path")
    replies = [_text(case["reply"]), *(_text(r) for r in spec.get("then", []))]
    script.root("root-model", *replies)
    script.sub("sub-model", lambda prompt: spec.get("sub", "sub answer"))
    rlm = RLM(
        ROOT,
        sub_model=SUB,
        base_url=server.base_url,
        api_key="test-key-0123456789",
        trace_dir=tmp_path,
        max_iterations=spec.get("max_iterations", 4),
        unfenced_code=case.get("unfenced_code", True),
    )
    result = rlm.run(spec.get("question", "What is the answer?"), _text(spec.get("context", "ctx")))
    assert result.stop_reason == spec.get("stop_reason", "final"), result.error
    end = next(e for e in load(result.trace_path).events if e["type"] == "run_end")
    assert end["stop_reason"] in STOP_REASONS and end["answer_protocol"] in ANSWER_PROTOCOLS
    assert result.answer == _text(spec["answer"])
    if "value" in spec:
        assert result.value == spec["value"]
    assert result.answer_protocol == spec["protocol"]
    executed = [e["code"] for e in load(result.trace_path).events if e["type"] == "exec"]
    assert executed == [_text(b) for b in spec["executed"]]
    for text in spec.get("feedback", []):
        assert text in server.requests[1].messages[-1]["content"]
