"""No host file path crosses into the sandbox, the model's feedback, a trace or a server's error body
(recursa/trace/hostpaths.py, applied by the Redactor where host messages are made and by the worker
channel for every error reply).

A host tool that fails on a file says where the file is: `/home/alice/secrets/x.txt` names the user
and the layout of the machine. What the REPL's code, the root model, the trace and a `recursa serve`
client see keeps the file's name and the exception's type, not the folders.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from recursa import RLM, host_tool
from recursa.sandbox import make_sandbox
from recursa.testing.fake_state import Fault, FaultRule, FaultSchedule
from recursa.trace.hostpaths import HOST_PATH, scrub_paths
from recursa.trace.redact import Redactor
from tests.test_escapes import feedback_before
from tests.test_rlm_openai import SUB, code

SECRET_DIR = "/home/alice/secrets"  # a path that exists nowhere: the tool's error names it
LEAKS = ("/home/alice", "alice", "secrets/", "site-packages", "/usr/lib/python")


def _rlm(server: Any, tmp_path: Path, **options: Any) -> RLM:
    return RLM(
        "openai/root-model",
        base_url=server.base_url,
        api_key="k",
        sub_model=SUB,
        trace_dir=tmp_path,
        **options,
    )


@host_tool
def read_note(name: str) -> str:
    """Reads a note from the host."""
    with open(f"{SECRET_DIR}/{name}") as f:
        return f.read()


@host_tool
def crash(depth: int) -> str:
    """Fails with a host traceback in its message."""
    import traceback

    try:
        json.loads("{")
    except ValueError:
        raise RuntimeError("parser failed:\n" + traceback.format_exc()) from None
    return ""


def assert_clean(text: str, where: str) -> None:
    found = [leak for leak in LEAKS if leak in text]
    assert not found, f"{where} holds {found}: {text[:3000]}"


def test_a_host_tool_failing_on_a_file_names_the_file_only(server, script, tmp_path):
    script.root(
        "root-model",
        code(
            "try:\n    read_note('x.txt')\nexcept Exception as e:\n    print('caught', type(e).__name__, e)\n"
            "    said = str(e)\n"
            "try:\n    crash(1)\nexcept Exception as e:\n    print('caught', type(e).__name__, e)"
        ),
        code("FINAL(said)"),
    )
    result = _rlm(server, tmp_path, tools=[read_note, crash]).run("q", "ctx")
    told = feedback_before(server, 2)
    # Still useful: the tool, the exception's type and message, the file's name.
    assert "caught ToolError read_note raised FileNotFoundError" in told, told
    assert f"'{HOST_PATH}/x.txt'" in told and "No such file or directory" in told, told
    assert "JSONDecodeError" in told and f"{HOST_PATH}/decoder.py" in told, told
    assert_clean(told, "the REPL output shown to the root")
    assert result.stop_reason == "final" and "x.txt" in result.answer
    assert_clean(result.answer, "the answer (a REPL variable)")
    trace = result.trace_path.read_text()
    assert '"tool_call"' in trace and "x.txt" in trace
    assert_clean(trace, "the trace file")


@host_tool
def stat_file(path: str) -> int:
    """The size of a file the REPL names by its full path."""
    import os

    return os.stat(path).st_size


def test_a_path_in_the_sandboxs_own_folder_is_shown_as_the_code_names_it(server, script, tmp_path):
    # The sandbox's cwd is its scratch folder: the code knows that path, and `./sub/gone.txt` is
    # how it names the file; the folder's location is not repeated into the trace.
    script.root(
        "root-model",
        code(
            "import os\ntry:\n    stat_file(os.path.join(os.getcwd(), 'sub', 'gone.txt'))\n"
            "except Exception as e:\n    said = str(e)\n    print('caught', e)"
        ),
        code("FINAL(said)"),
    )
    result = _rlm(server, tmp_path, tools=[stat_file]).run("q", "ctx")
    assert result.stop_reason == "final", result.error
    assert "No such file or directory: './sub/gone.txt'" in result.answer, result.answer
    assert "recursa-repl-" not in result.trace_path.read_text()


def test_a_failing_sub_model_call_names_no_host_path(server, script, tmp_path):
    # A model server on the same machine (vLLM, llama.cpp) may quote where its weights live.
    script.root(
        "root-model",
        code("try:\n    llm_query('hi')\nexcept Exception as e:\n    print('caught', type(e).__name__, e)"),
        code("FINAL('done')"),
    )
    script.sub("sub-model", lambda prompt: "unused")
    message = f"cannot load model: [Errno 2] No such file or directory: '{SECRET_DIR}/weights/model.gguf'"
    server.faults = FaultSchedule(FaultRule(Fault(400, message=message), model="sub-model", times=None))
    try:
        result = _rlm(server, tmp_path, max_retries=0).run("q", "ctx")
    finally:
        server.faults = None
    told = feedback_before(server, 2)
    assert "caught SubcallError" in told and f"'{HOST_PATH}/model.gguf'" in told, told
    assert_clean(told, "the REPL output shown to the root")
    assert_clean(result.trace_path.read_text(), "the trace file")


def test_every_error_reply_into_the_sandbox_is_scrubbed_whatever_the_handler():
    # A handler of one's own (an integration's, a test's) need not scrub: the channel does.
    async def handler(fn, args):
        raise FileNotFoundError(2, "No such file or directory", f"{SECRET_DIR}/x.txt")

    async def main() -> str:
        sandbox = make_sandbox("subprocess")
        await sandbox.start(handler)
        try:
            res = await sandbox.execute(
                "try:\n    llm_query('x')\nexcept Exception as e:\n    print(type(e).__name__, e)", timeout=30
            )
        finally:
            await sandbox.close()
        return res.stdout

    out = asyncio.run(main())
    assert f"No such file or directory: '{HOST_PATH}/x.txt'" in out, out
    assert_clean(out, "the REPL output")


def test_a_served_run_that_cannot_read_its_context_file_names_the_file_only(tmp_path):
    pytest.importorskip("fastapi")
    import httpx

    from recursa.asgi.background import BackgroundServer
    from recursa.serve.openai_server import create_app
    from recursa.serve.settings import ServeSettings
    from tests.serve_helpers import install_test_root

    # The allowed folder is a link: the error names the file by its resolved path, which the client
    # never sent (here it holds "alice").
    real = tmp_path / "alice-home" / "data"
    real.mkdir(parents=True)
    (real / "bad.bin").write_bytes(b"\xff\xfe\x00 not text")
    (tmp_path / "shared").symlink_to(tmp_path / "alice-home")
    settings = ServeSettings(
        model=install_test_root(),
        sub_model="scripted/oracle",
        trace_dir=tmp_path / "traces",
        context_roots=(tmp_path / "shared",),
    )
    body = {"model": "recursa", "messages": [{"role": "user", "content": "q"}]}
    with BackgroundServer(create_app(settings)) as srv:
        for path in (tmp_path / "shared" / "data" / "bad.bin", tmp_path / "shared" / "data"):
            body["recursa"] = {"context_path": str(path)}
            reply = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
            assert reply.status_code == 400, reply.text
            message = reply.json()["error"]["message"]
            assert "bad.bin" in message or f"{HOST_PATH}/data" in message, message
            assert str(tmp_path) not in reply.text and "alice" not in reply.text, reply.text


@pytest.mark.parametrize(
    ("text", "kept", "gone"),
    [
        ("[Errno 2] No such file or directory: '/home/alice/secrets/x.txt'", "'<host path>/x.txt'", "alice"),
        (
            '  File "/usr/lib/python3.11/json/decoder.py", line 355',
            '"<host path>/decoder.py", line 355',
            "/usr",
        ),
        ("PermissionError: [Errno 13] Permission denied: '/home/alice'", "'<host path>'", "alice"),
        ("failed at /srv/app/data/x.db: locked", "<host path>/x.db: locked", "/srv"),
        ("HOME=/home/alice PATH=/opt/tools/bin:/home/alice/.local/bin", "PATH=<host path>/bin:", "alice"),
        ("see file:///var/www/private/a.html", "file://<host path>/a.html", "/var"),
        ("cannot open ~bob/notes.md or ~/keys/a.pem", "<host path>/notes.md", "bob"),
        ("open 'C:\\Users\\carol\\x.txt' failed", "'<host path>\\x.txt'", "carol"),
        ("PosixPath('/data/my files/report 1.pdf')", "PosixPath('<host path>/report 1.pdf')", "/data"),
        ("/mnt/nas/projects/q3/x.csv:12: bad row", "<host path>/x.csv:12: bad row", "/mnt"),
        ('{"file": "\\/home\\/alice\\/x.txt"}', "<host path>\\/x.txt", "alice"),
        ("GET /files?path=%2Fhome%2Falice%2Fx.txt failed", "<host path>%2Fx.txt", "alice"),
        ("cannot open ../../home/alice/notes/x.md", "<host path>/x.md", "alice"),
    ],
)
def test_the_path_scrubber_takes_every_form(text, kept, gone):
    out = Redactor()(text)
    assert kept in out and gone not in out, out
    assert Redactor()(out) == out  # scrubbing again changes nothing


@pytest.mark.parametrize(
    "text",
    [
        "POST http://127.0.0.1:8080/v1/chat/completions returned 404",
        "https://api.example.com/v1beta/models/gemini:generateContent failed",
        "1/2 of the items and/or 5 MB /s",
        "write to /dev/null failed",
        "relative/path/to/file.txt is missing",
    ],
)
def test_urls_ratios_and_relative_paths_are_left_alone(text):
    assert scrub_paths(text) == text


def test_an_oserrors_file_names_are_scrubbed_too():
    # str(OSError) is made from .filename and .filename2, not from args.
    exc = Redactor().exception(
        OSError(2, "No such file or directory", "/home/alice/a b.txt", None, "/srv/x/c")
    )
    assert str(exc) == "[Errno 2] No such file or directory: '<host path>/a b.txt' -> '<host path>/c'", str(
        exc
    )


def test_the_operators_own_views_keep_paths():
    message = "cannot read '/home/alice/data/x.txt'"
    assert Redactor(paths=False)(message) == message
    assert "alice" not in Redactor()(message)


async def test_an_mcp_client_over_http_is_told_the_trace_by_name_only(tmp_path):
    # Over stdio the client started the server on its own machine and opens the trace by its path;
    # over HTTP the folder is the server's, as for `recursa serve`.
    pytest.importorskip("mcp")
    from recursa.serve.settings import ServeSettings
    from tests.test_session_owners import ALICE, BOB, ROOT, _mcp_callers

    settings = ServeSettings(
        model=ROOT, sub_model="scripted/oracle", trace_dir=tmp_path, api_keys={"alice": ALICE, "bob": BOB}
    )
    async with _mcp_callers(settings) as (alice, _bob):
        opened = await alice.call_tool("recursa_session_open", {"context_text": "c"})
        asked = await alice.call_tool(
            "recursa_session_ask",
            {"session": opened.structured_content["session"], "question": "RUN: FINAL(1)"},
        )
        answered = await alice.call_tool("recursa_answer", {"question": "RUN: FINAL(2)", "context_text": "c"})
    for result in (opened, asked, answered):
        trace = result.structured_content["trace_path"]
        assert trace.endswith(".jsonl") and "/" not in trace and (tmp_path / trace).is_file(), trace
