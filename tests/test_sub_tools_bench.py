"""Sub-model tools offline: the scripted models' function calling, the `rlm-subtools` method (a BM25
search only sub-models call) on multihop-docs, and the worked example script."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import recursa.bench as bench
from recursa import RLM
from recursa.lm.base import CallMeta, LMRequest, LMResponse, Message
from recursa.methods.base import MethodSettings, get_method
from recursa.methods.search import document_search
from recursa.scripted import get_policy
from recursa.scripted.client import ScriptedClient
from recursa.scripted.tool_use import tool_turn
from recursa.tasks import generate
from recursa.testing.tool_replies import ToolCallReply, offered_tools
from recursa.tools.spec import make_sub_tools
from recursa.trace import load

ROOT = Path(__file__).resolve().parent.parent
SEARCH = {
    "name": "search",
    "description": "Search the document collection.",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "k": {"type": "integer", "default": 3}},
        "required": ["query"],
    },
}
HOP = "Who founded Orvane Systems? Reply with the name only, or NONE if you cannot find it."
DOC = (
    "Title: Orvane Systems\nAlso known as: Orvane OSX\n\nThe weather was mild. The founder of Orvane OSX "
    "is Kalo Brenn. Orvane Systems has its headquarters in Velmora."
)


def complete(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> LMResponse:
    client = ScriptedClient("scripted/oracle")
    return asyncio.run(client.complete(LMRequest(messages, 2_000, CallMeta("c1"), tools=tools)))


def after(messages: list[Message], response: LMResponse, *results: str) -> list[Message]:
    """The chat once the host has run the calls of `response` and returned `results`."""
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in response.tool_calls]
    return [
        *messages,
        {"role": "assistant", "content": response.text, "tool_calls": calls},
        *(
            {"role": "tool", "tool_call_id": c.id, "name": c.name, "content": r}
            for c, r in zip(response.tool_calls, results, strict=True)
        ),
    ]


# -- the scripted models' function calling ----------------------------------------------------------


def test_a_scripted_sub_model_searches_then_answers_from_what_it_read() -> None:
    chat: list[Message] = [{"role": "user", "content": HOP}]
    first = complete(chat, [SEARCH])
    assert first.finish_reason == "tool_calls" and len(first.tool_calls) == 1
    call = first.tool_calls[0]
    assert call.name == "search" and call.arguments == {"query": "founded Orvane Systems"}
    assert first.output_tokens > 0 and first.provider_cost_usd == 0.0
    chat = after(chat, first, json.dumps([DOC]))
    second = complete(chat, [SEARCH])
    # The fact names the company by its alias; the document's alias line resolves it.
    assert second.tool_calls == [] and second.text == "Kalo Brenn"
    assert second.input_tokens > first.input_tokens  # it read the result
    # The engine's last round offers no tools: the model still answers from the results it has.
    assert complete([*chat, {"role": "user", "content": "Answer now."}], None).text == "Kalo Brenn"


def test_nothing_found_means_one_more_search_by_names_then_an_answer() -> None:
    chat: list[Message] = [{"role": "user", "content": HOP}]
    first = complete(chat, [SEARCH])
    chat = after(chat, first, json.dumps(["The weather was mild in Velmora."]))
    second = complete(chat, [SEARCH])
    assert [(c.name, c.arguments) for c in second.tool_calls] == [
        ("search", {"query": "Orvane Systems", "k": 6})  # names only, twice the tool's default hits
    ]
    assert second.tool_calls[0].id != first.tool_calls[0].id
    chat = after(chat, second, "Error: search raised RuntimeError: index offline")
    third = complete(chat, [SEARCH])
    assert third.tool_calls == [] and third.text == "NONE"  # two searches at most, then it says so


def test_prompts_that_carry_their_own_text_are_answered_without_tools() -> None:
    task = generate("niah", 4_000, seed=1)
    prompt = f"{task.question}\n\nText:\n{task.context}"
    reply = complete([{"role": "user", "content": prompt}], [SEARCH])
    assert reply.tool_calls == [] and task.score(reply.text) == 1.0
    no_search = dict(SEARCH, name="lookup_weather", description="Today's weather in a city.")
    assert complete([{"role": "user", "content": HOP}], [no_search]).tool_calls == []


def test_the_document_search_tool_is_offered_as_a_function() -> None:
    task = generate("multihop-docs", 40_000, seed=3)
    tool = make_sub_tools([document_search(task.context)])[0]
    offered = tool.to_function()
    assert offered["name"] == "search_documents" and "BM25" in offered["description"]
    assert offered["parameters"]["required"] == ["query"]
    assert offered["parameters"]["properties"]["k"] == {"type": "integer", "default": 4}
    anchor = task.meta["path"][0]
    hits = tool.fn(anchor, k=3)
    assert 1 <= len(hits) <= 3 and all(hit in task.context for hit in hits)  # whole documents
    assert hits[0].startswith(f"Title: {anchor}\n")  # its own document ranks first
    assert len(tool.fn("founded born studied works located", k=50)) == 10  # capped at ten


# -- rlm-subtools ---------------------------------------------------------------------------------


def _run(method: str, task: Any, tmp_path: Path) -> Any:
    settings = MethodSettings(model="scripted/gpt5-like", sub_model="scripted/oracle", trace_dir=tmp_path)
    return asyncio.run(get_method(method).run(task, settings))


def test_rlm_subtools_lets_sub_models_search_and_keeps_documents_out_of_prompts(tmp_path: Path) -> None:
    task = generate("multihop-docs", 400_000, seed=4, hops=3)  # 50 documents
    with_tool = _run("rlm-subtools", task, tmp_path)
    without = _run("rlm", task, tmp_path)
    assert task.score(with_tool.answer) == 1.0 and task.score(without.answer) == 1.0
    events = load(with_tool.trace_path).events
    searches = [e for e in events if e.get("type") == "tool_call"]
    assert len(searches) >= 4  # the anchor and three hops, each looked up by a sub-model
    assert all(
        e["tool"] == "search_documents" and e["caller"] == "sub-model" and not e["error"] for e in searches
    )
    subs = [e for e in events if e.get("type") == "lm_call" and e.get("purpose") == "sub" and "usage" in e]
    asked = [e for e in subs if e.get("tool_calls")]
    assert len(asked) == len(searches) and len(subs) == with_tool.sub_calls
    # The root's code sent questions only; documents reached the sub-models through the tool alone.
    first_prompts = [e["prompt"] for e in subs if not e["prompt"].startswith("[")]
    assert first_prompts and all("Title:" not in p and len(p) < 400 for p in first_prompts)
    root = [e for e in events if e.get("type") == "lm_call" and e.get("purpose") == "root"]
    root_text = json.dumps([e.get("new_messages") for e in root])
    assert "search_documents" in root_text  # told the sub-models have it
    assert not any(doc[:200] in root_text for doc in task.context[1:])  # never shown the hits
    assert with_tool.usage.input_tokens < 0.6 * without.usage.input_tokens


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_the_scripted_search_habit_over_the_real_sdks(server: Any, tmp_path: Path, provider: str) -> None:
    """The same tool-using persona behind the fake server, through each SDK's function-calling path."""
    policies = {"root-model": get_policy("gpt5-like"), "sub-model": get_policy("oracle")}

    def respond(model: str, messages: list[Message]) -> str | ToolCallReply:
        turn = tool_turn(policies[model], messages, offered_tools())
        return ToolCallReply(turn.calls, text=turn.text) if turn.calls else turn.text

    server.holder["responder"] = respond
    server.reset()
    task = generate("multihop-docs", 200_000, seed=6, hops=2)
    base = server.base_url if provider == "openai" else server.base_url.removesuffix("/v1")
    rlm = RLM(
        f"{provider}/root-model",
        sub_model=f"{provider}/sub-model",
        base_url=base,
        api_key="test-key-0123456789",
        trace_dir=tmp_path,
        sub_tools=[document_search(task.context)],
    )
    result = rlm.run(task.question, task.context)
    assert task.score(result.answer) == 1.0, result.answer
    subs = [r for r in server.requests if r.model == "sub-model"]
    assert len(subs) >= 6  # the anchor and two hops: a search turn and an answer turn each
    read = [r for r in subs if r.messages[-1]["role"] == "tool"]
    assert read and all("Title: " in r.messages[-1]["content"] for r in read)


def test_bench_compares_rlm_and_rlm_subtools_on_multihop_docs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = bench.run(
        "multihop-docs", sizes="8k,131k", n=1, methods="rlm,rlm-subtools", out=out, progress=False
    )
    rows = {(r["method"], r["target_tokens"]): r for r in report.rows}
    assert len(rows) == 4 and all(r["status"] == "ok" and r["score"] == 1.0 for r in rows.values())
    # Without the tool the root hands over every document; with it the sub-model reads a few hits.
    assert rows[("rlm-subtools", 131_000)]["total_tokens"] < 0.6 * rows[("rlm", 131_000)]["total_tokens"]
    summary = (out / "summary.md").read_text()
    assert "| multihop-docs | rlm-subtools | 131K | 1 | 1.000 |" in summary


def test_the_worked_example_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sub_tools_bm25.py"), "--sizes", "8k,32k", "--n", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| 32K")]
    assert [line.split(" | ")[2] for line in lines] == ["none", "search (BM25)"]
    assert all(line.split(" | ")[3] == "1.00" for line in lines)
