"""MCP servers as tools: real servers on the `mcp` package (tests/mcp_tool_server.py) over stdio
and streamable HTTP, their tools called from REPL code and by sub-models through the real loop and
the real openai client, then closed with the run or session."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from recursa import RLM
from recursa.asgi.background import BackgroundServer
from recursa.errors import ConfigError
from recursa.testing.tool_replies import ToolCallReply, offered_tools
from recursa.tools.mcp_config import parse_mcp_servers
from recursa.trace import load

from .mcp_tool_server import build
from .test_rlm_openai import code, make_rlm

LOCAL_TOOLS = ["add", "pid", "whoami", "weather", "fail", "big", "search_docs", "print"]
SERVER_SCRIPT = str(Path(__file__).with_name("mcp_tool_server.py"))


@pytest.fixture(scope="module")
def web():
    """The test server's tools over streamable HTTP on 127.0.0.1 (stopped when the module ends)."""
    app = build("web").streamable_http_app(streamable_http_path="/mcp")
    with BackgroundServer(app) as srv:
        yield srv.url + "/mcp"


def stdio(name: str = "local", **extra):
    return {"command": sys.executable, "args": [SERVER_SCRIPT, name], **extra}


def use(server, *replies, sub=None):
    server.reset()

    def respond(model, messages):
        if model == "root-model":
            turn = sum(1 for m in messages if m["role"] == "assistant")
            return replies[min(turn, len(replies) - 1)]
        return sub(messages)

    server.holder["responder"] = respond


def test_repl_code_calls_tools_of_a_stdio_and_an_http_server(server, web, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-host-secret-0123456789")
    probe = (
        "w = weather('Paris')\n"
        "docs = search_docs('rlm', limit=2)\n"
        "who = local_whoami()\n"
        "total = web_add(1)\n"
        "pid_seen = pid()\n"
        "errors = []\n"
        "for f, args in [(fail, ('no disk',)), (slow, (5,)), (local_add, ()), (local_print, ('hi',))]:\n"
        "    try:\n"
        "        errors.append(repr(f(*args)))\n"
        "    except ToolError as e:\n"
        "        errors.append(str(e))\n"
        "cut = big(5000)\n"
        "print(w, docs, who, total, len(cut))\n"
        "for line in errors: print(line)"
    )
    use(server, code(probe), "FINAL_VAR(pid_seen)")
    servers = {
        "local": stdio(env={"TOOL_TOKEN": "t-1"}, max_result_chars=1000, tools=LOCAL_TOOLS),
        # the slow call is abandoned on the in-process server: the stdio one closes at once
        "web": {"url": web, "tools": ["add", "whoami", "slow"], "timeout": 1.0},
    }
    rlm = make_rlm(server, tmp_path, mcp_servers=servers)
    result = rlm.run("q", "ctx")
    assert result.stop_reason == "final", result

    system = next(r for r in server.requests if r.model == "root-model").messages[0]["content"]
    # own names where no other server has the tool; the server's name where two do (add, whoami)
    # or where the name would hide a Python builtin (print); each with its schema
    assert "`weather(city: str) -> dict` (runs outside the sandbox): [MCP server local]" in system
    assert "`search_docs(query: str, limit: int = 3) -> list[str]`" in system
    assert "`local_add(a: int, b: int = 10) -> int`" in system and "`web_add(" in system
    assert "`local_print(text: str)`" in system and "`print(" not in system

    shown = [r for r in server.requests if r.model == "root-model"][1].messages[-1]["content"]
    marker = "\n[... 4,000 more characters cut; ask the tool for less]"
    assert shown.splitlines()[1] == (
        "{'city': 'Paris', 'celsius': 21.5} ['rlm result 0', 'rlm result 1'] "
        f"local key=absent token=t-1 11 {1000 + len(marker)}"
    )
    assert "fail returned an error: Error executing tool fail: cannot do it: no disk" in shown
    assert "slow did not return within 1 s" in shown
    assert "missing a required argument: 'a'" in shown
    assert "'HI'" in shown
    assert "sk-host-secret" not in shown

    # the stdio server's process ended with the run
    pid = int(result.answer)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    calls = [e for e in load(result.trace_path).events if e["type"] == "tool_call"]
    assert {"weather", "search_docs", "local_whoami", "web_add", "pid"} <= {e["tool"] for e in calls}


def tool_using_sub(messages):
    if not any(m["role"] == "tool" for m in messages):
        names = {t["name"] for t in offered_tools()}
        assert {"search_docs", "add"} <= names
        return ToolCallReply([("search_docs", {"query": "paris", "limit": 1})])
    return "sub read: " + next(m["content"] for m in messages if m["role"] == "tool")


def test_sub_models_only_call_the_tools_of_a_sub_models_server_in_a_session(server, web, tmp_path):
    use(
        server,
        code("print('search_docs' in dir(), llm_query('capital?'))"),
        "FINAL(done)",
        sub=tool_using_sub,
    )
    rlm = make_rlm(server, tmp_path, mcp_servers={"web": {"url": web, "use": "sub_models"}})
    with rlm.session("ctx") as session:
        first = session.ask("q1")
        second = session.ask("q2")
    assert first.stop_reason == second.stop_reason == "final"
    shown = [r for r in server.requests if r.model == "root-model"][1].messages[-1]["content"]
    assert "False sub read: " in shown and "paris result 0" in shown
    system = next(r for r in server.requests if r.model == "root-model").messages[0]["content"]
    assert "Sub-models you call with llm_query" in system and "`search_docs(" in system
    events = load(first.trace_path).events  # the session's trace: both questions, one connection
    assert [e["caller"] for e in events if e["type"] == "tool_call"] == ["sub-model", "sub-model"]


@pytest.mark.parametrize(
    ("servers", "fragment"),
    [
        ("nope", "cannot read 'nope'"),
        ([{"command": "x", "url": "http://h/mcp"}], "exactly one of 'command'"),
        ([{"url": "ftp://h"}], "http:// or https://"),
        ({"a": {"url": "http://h/mcp", "type": "sse"}}, "'sse' is not supported"),
        ({"a": {"command": "x", "use": "root"}}, "'use' is one of repl, sub_models, both"),
        ({"a": {"command": "x", "timeout": 0}}, "'timeout' is a number of seconds > 0"),
        ({"a": {"command": "x", "commands": []}}, "unknown key(s) commands"),
        ([{"command": "x", "name": "a"}, {"url": "http://h/mcp", "name": "a"}], "two servers are named 'a'"),
        (42, "takes a list of server entries"),
    ],
)
def test_bad_entries_are_refused_at_construction(server, tmp_path, servers, fragment):
    with pytest.raises(ConfigError, match="mcp_servers") as info:
        make_rlm(server, tmp_path, mcp_servers=servers)
    assert fragment in str(info.value)


def test_config_files_and_acp_entries_parse_to_the_same_servers(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"docs": {"url": "https://x.io/mcp", "headers": {"A": "b"}}}}))
    from_file = parse_mcp_servers(str(path))
    acp = parse_mcp_servers(
        [
            {
                "type": "http",
                "name": "docs",
                "url": "https://x.io/mcp",
                "headers": [{"name": "A", "value": "b"}],
            }
        ]
    )
    assert from_file == acp and from_file[0].headers == {"A": "b"}
    assert "b" not in repr(from_file) and "b" not in from_file[0].where().split("(")[0]


def test_a_server_that_cannot_start_fails_the_run_with_its_name(server, tmp_path):
    use(server, "FINAL(never)")
    rlm = make_rlm(server, tmp_path, mcp_servers={"broken": {"command": str(tmp_path / "no-such-server")}})
    with pytest.raises(ConfigError, match="could not connect to MCP server 'broken'"):
        rlm.run("q", "ctx")


def test_serve_takes_mcp_servers_from_the_operators_flag(tmp_path):
    from recursa.cli import _parser
    from recursa.serve.commands import _settings

    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"ops": {"url": "http://127.0.0.1:9/mcp"}}}))
    args = _parser().parse_args(["serve", "--model", "scripted/gpt5-like", "--mcp-servers", str(path)])
    settings = _settings(args, "serve")
    assert [s.name for s in settings.run["mcp_servers"]] == ["ops"]
    rlm = RLM(**settings.run)  # what every request's run is built with
    assert rlm.config.mcp_servers[0].url == "http://127.0.0.1:9/mcp"
