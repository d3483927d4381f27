"""Folder contexts never read outside their folder: not through a symbolic link, a hard link
(on a server), or a path swapped for a link after the server checked it. Through every entry point:
the Python API, `recursa run`, `recursa serve` (HTTP) and `recursa mcp` (the MCP client)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path, PurePosixPath

import pytest

from recursa import RLM
from recursa.confined import ConfinedPath
from recursa.context import build_payload
from recursa.errors import ContextError
from recursa.trace import load
from tests.cli_launcher import CliLauncher
from tests.serve_helpers import install_test_root

SECRET = "TOP-SECRET-OUTSIDE-THE-FOLDER"
HARD = "HARD-LINKED-FROM-OUTSIDE"
ROOT_MODEL = install_test_root()  # "RUN: code" questions run their code
DUMP = "RUN: import json; FINAL(json.dumps(context))"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """allowed/docs holds two real files and every way out: links to a file, to /etc, to a folder,
    a link up to a file of the allowed root (fine), a hard link to an outside file, and a pipe."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    (outside / "linked.txt").write_text(HARD)
    allowed = tmp_path / "allowed"
    docs = allowed / "docs"
    (docs / "sub").mkdir(parents=True)
    (allowed / "notes.txt").write_text("notes in the root")
    (docs / "a.txt").write_text("alpha")
    (docs / "sub" / "b.txt").write_text("beta")
    (docs / "leak.txt").symlink_to(outside / "secret.txt")
    (docs / "relative-leak.txt").symlink_to(Path("..", "..", "outside", "secret.txt"))
    (docs / "passwd").symlink_to("/etc/passwd")
    (docs / "outdir").symlink_to(outside)
    (docs / "up.txt").symlink_to(Path("..", "notes.txt"))
    (docs / "same.txt").symlink_to("a.txt")
    os.link(outside / "linked.txt", docs / "hard.txt")
    os.mkfifo(docs / "pipe")
    return allowed


def _no_secret(text: str, *, hard_links_refused: bool = True) -> None:
    assert SECRET not in text
    assert HARD not in text or not hard_links_refused


def _skipped_names(skipped: list[str]) -> set[str]:
    return {s.split(" (", 1)[0] for s in skipped}


OUTWARD = {"leak.txt", "relative-leak.txt", "passwd", "outdir", "pipe"}


def test_python_api_reads_the_folder_and_reports_every_way_out(tree: Path, tmp_path: Path) -> None:
    result = RLM(ROOT_MODEL, sub_model="scripted/oracle", trace_dir=tmp_path / "t").run(DUMP, tree / "docs")
    assert result.stop_reason == "final"
    got = json.loads(result.answer)
    _no_secret(result.answer, hard_links_refused=False)
    # A hard link is read through the Python API (the user's own folder), not through a server.
    assert sorted(got) == ["a.txt", "hard.txt", "same.txt", "sub/b.txt"]
    assert got["same.txt"] == "alpha"
    assert _skipped_names(result.skipped_files) == OUTWARD | {"up.txt"}  # up.txt leaves docs/
    start = load(result.trace_path).root.start
    assert _skipped_names(start["context"]["skipped_files"]) == OUTWARD | {"up.txt"}


def test_confined_path_refuses_hard_links_and_allows_links_inside_its_root(tree: Path) -> None:
    payload = build_payload(ConfinedPath(tree, PurePosixPath("docs")))
    assert payload.keys == ["a.txt", "same.txt", "sub/b.txt", "up.txt"]
    _no_secret(payload.read_bytes().decode())
    assert _skipped_names(payload.info.skipped_files) == OUTWARD | {"hard.txt"}
    with pytest.raises(ContextError, match="other hard links"):
        build_payload(ConfinedPath(tree, PurePosixPath("docs/hard.txt")))


def test_a_folder_swapped_for_a_link_after_the_check_is_not_followed(tree: Path, tmp_path: Path) -> None:
    from recursa.serve.sources import check_path

    checked = check_path(str(tree / "docs"), (tree,))
    # The race a client could win: the folder becomes a link out between the check and the read.
    shutil.rmtree(tree / "docs")
    (tree / "docs").symlink_to(tmp_path / "outside")
    with pytest.raises(ContextError, match="symbolic link"):
        build_payload(checked)
    checked_file = check_path(str(tree / "notes.txt"), (tree,))
    (tree / "notes.txt").unlink()
    (tree / "notes.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    with pytest.raises(ContextError, match="symbolic link"):
        build_payload(checked_file)


def test_cli_run_leaves_links_out_and_says_so(tree: Path, tmp_path: Path, cli_launcher: CliLauncher) -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    out = cli_launcher.run(
        [
            *["run", "What is the code?", "--context", str(tree / "docs"), "--model", "scripted/gpt5-like"],
            *["--sub-model", "scripted/oracle", "--trace-dir", str(tmp_path / "t"), "--max-iterations", "3"],
        ],
        cwd=Path.cwd(),
        env=env,
    )
    assert out.returncode in (0, 3) and "Traceback" not in out.stderr, out.stderr
    assert "left out of the context folder" in out.stderr and "leak.txt" in out.stderr
    (trace,) = (tmp_path / "t").glob("*.jsonl")
    context = load(trace).root.start["context"]
    assert context["total_chars"] == len("alpha") * 2 + len("beta") + len(HARD)
    _no_secret(trace.read_text(), hard_links_refused=False)
    chat = cli_launcher.run(
        [
            *["chat", "--context", str(tree / "docs"), "--model", "scripted/gpt5-like"],
            *["--sub-model", "scripted/oracle", "--trace-dir", str(tmp_path / "c")],
        ],
        cwd=Path.cwd(),
        env=env,
        stdin="What is the code?\n",
    )
    assert chat.returncode == 0 and "Traceback" not in chat.stderr, chat.stderr
    assert "left out of the context folder" in chat.stderr and "leak.txt (a symbolic link" in chat.stderr
    _no_secret(chat.stdout + chat.stderr, hard_links_refused=False)


def test_serve_context_path_folder_keeps_to_the_allowed_root(tree: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from recursa.serve.openai_server import create_app
    from recursa.serve.settings import ServeSettings

    settings = ServeSettings(
        model=ROOT_MODEL, sub_model="scripted/oracle", trace_dir=tmp_path / "t", context_roots=(tree,)
    )
    with TestClient(create_app(settings)) as http:

        def ask(path: str) -> dict:
            body = {
                "model": "recursa",
                "messages": [{"role": "user", "content": DUMP}],
                "recursa": {"context_path": path},
            }
            return http.post("/v1/chat/completions", json=body).json()

        reply = ask(str(tree / "docs"))
        answer = reply["choices"][0]["message"]["content"]
        _no_secret(answer)
        assert sorted(json.loads(answer)) == ["a.txt", "same.txt", "sub/b.txt", "up.txt"]
        assert _skipped_names(reply["recursa"]["skipped_files"]) == OUTWARD | {"hard.txt"}
        # Naming a link out directly is refused before any run; the server goes on serving.
        refused = ask(str(tree / "docs" / "leak.txt"))
        assert refused["error"]["code"] == "context_path_not_allowed"
        refused = ask(str(tree / "docs" / "hard.txt"))
        assert "hard links" in refused["error"]["message"]
        _no_secret(json.dumps(refused))
        assert json.loads(ask(str(tree / "docs" / "sub"))["choices"][0]["message"]["content"]) == {
            "b.txt": "beta"
        }


async def test_mcp_context_path_folder_keeps_to_the_allowed_root(tree: Path, tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from mcp import Client

    from recursa.serve.mcp_server import TOOL_NAME, build_mcp_server
    from recursa.serve.settings import ServeSettings

    settings = ServeSettings(
        model=ROOT_MODEL, sub_model="scripted/oracle", trace_dir=tmp_path / "t", context_roots=(tree,)
    )
    async with Client(build_mcp_server(settings)) as client:
        result = await client.call_tool(TOOL_NAME, {"question": DUMP, "context_path": str(tree / "docs")})
        assert not result.is_error, result.content
        out = result.structured_content
        _no_secret(json.dumps(out))
        assert sorted(json.loads(out["answer"])) == ["a.txt", "same.txt", "sub/b.txt", "up.txt"]
        assert _skipped_names(out["skipped_files"]) == OUTWARD | {"hard.txt"}
        opened = await client.call_tool("recursa_session_open", {"context_path": str(tree / "docs")})
        sid = opened.structured_content["session"]
        asked = await client.call_tool("recursa_session_ask", {"session": sid, "question": DUMP})
        _no_secret(json.dumps(asked.structured_content))
        assert "leak.txt" not in json.loads(asked.structured_content["answer"])
        await client.call_tool("recursa_session_close", {"session": sid})


def test_a_deep_or_crowded_folder_is_walked_within_bounds(tmp_path: Path, monkeypatch) -> None:
    """A chain of 1,100 nested folders (deeper than Python's recursion limit, one descriptor each)
    and a folder of more names than a walk looks at: both are read up to the bounds, and what was
    left out is listed once, never a crash."""
    from recursa import confined

    deep = tmp_path / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(1100):  # os.makedirs recurses per component
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)
    (deep / "top.txt").write_text("top")
    Path(str(deep) + "/d" * 1100, "bottom.txt").write_text("bottom")
    try:
        files, skipped = confined.read_context_path(ConfinedPath(tmp_path, PurePosixPath("deep")))
        assert files["top.txt"] == "top" and "bottom" not in files.values()
        assert len(files) == 1 and len(skipped) == 1
        assert skipped[0].startswith("d/" * confined.MAX_DEPTH) and "folders deep" in skipped[0]
    finally:
        for depth in range(1100, 0, -1):  # shutil.rmtree recurses too: undo the chain by hand
            target = str(deep) + "/d" * depth
            for name in os.listdir(target):
                os.unlink(os.path.join(target, name))
            os.rmdir(target)

    crowded = tmp_path / "crowded"
    (crowded / "sub").mkdir(parents=True)
    for k in range(120):
        (crowded / f"f{k:03d}.txt").write_text(str(k))
        (crowded / "sub" / f"g{k:03d}.txt").write_text(str(k))
    monkeypatch.setattr(confined, "MAX_ENTRIES", 50)
    files, skipped = confined.read_context_path(crowded)
    assert len(files) == 50 and len(skipped) == 1 and "no more than 50 names" in skipped[0]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("docs/\x00a.txt", "NUL byte"),
        ("docs/" + "n" * 5000, "File name too long"),
        ("docs" + "/x" * 3000, "cannot be opened"),
        ("docs/loop", "loop of symbolic links"),
    ],
    ids=["nul", "long-name", "long-path", "link-loop"],
)
def test_serve_refuses_hostile_path_names_clearly(tree: Path, tmp_path: Path, name: str, why: str) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from recursa.serve.openai_server import create_app
    from recursa.serve.settings import ServeSettings

    (tree / "docs" / "loop").symlink_to("loop")
    settings = ServeSettings(
        model=ROOT_MODEL, sub_model="scripted/oracle", trace_dir=tmp_path / "t", context_roots=(tree,)
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as http:
        body = {"model": "recursa", "messages": [{"role": "user", "content": DUMP}]}
        body["recursa"] = {"context_path": str(tree / name)}
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "recursa.context_path" and why in error["message"]
        assert len(error["message"]) < 400
        body["recursa"] = {"context_path": str(tree / "docs" / "sub")}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
