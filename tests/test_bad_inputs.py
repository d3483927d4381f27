"""The bad-input corpus, played case by case.

Every case is data in tests/bad_inputs/*.json (one file per category): a name, a driver, the
input and the expected outcome. A user mistake must end in a message that names the problem and
the fix, with no traceback (the CLI: a non-zero exit and one paragraph on stderr); a bad model
reply must reach the model as a hint in its next prompt while the run still finishes; a truncated
trace must still give back what was written before the cut; files that existed before a failure
must be left as they were.

Value tags in the data ("$bytes_hex", "$repeat", "$path", ...) stand for inputs JSON cannot hold;
see `decode`. File specs ("text", "hex", "sparse", "trace", ...) build the files a case needs; see
`make_files`. A case with "known_gap" documents a failure that is reported but not fixed yet: it
runs as a strict xfail, so fixing the gap makes it fail until the mark is removed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import recursa.errors
from recursa import RLM, Budget
from recursa.bench.sizes import BenchError
from recursa.lm.base import Message
from recursa.scripted import register
from recursa.trace import load
from recursa.train.errors import ExportError
from tests.cli_launcher import CliLauncher, Job, clean_env

CORPUS = Path(__file__).parent / "bad_inputs"
CATEGORIES = ("config", "models", "contexts", "cli", "replies", "traces", "requests")
DRIVERS = ("rlm", "budget", "run", "replies", "trace", "cli", "request")
REPLAY = "bad-input-replay"  # the scripted model that plays a case's replies
ROOT = f"scripted/{REPLAY}"
ERRORS: dict[str, type[BaseException]] = {
    "ConfigError": recursa.errors.ConfigError,
    "ContextError": recursa.errors.ContextError,
    "BenchError": BenchError,
    "ExportError": ExportError,
    "ValueError": ValueError,
}


def _load_corpus() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for path in sorted(CORPUS.glob("*.json")):
        for case in json.loads(path.read_text(encoding="utf-8"))["cases"]:
            cases.append({**case, "category": path.stem})
    return cases


CASES = _load_corpus()


def _params(cases: list[dict[str, Any]]) -> list[Any]:
    out = []
    for case in cases:
        gap = case.get("known_gap")
        marks = [pytest.mark.xfail(reason=gap, strict=True)] if gap else []
        out.append(pytest.param(case, id=f"{case['category']}/{case['name']}", marks=marks))
    return out


# -- inputs ------------------------------------------------------------------------------------


def _nested(depth: int, leaf: Any) -> Any:
    """A dict of a list of a dict ... `depth` levels deep, ending in `leaf`."""
    value = leaf
    for level in range(depth):
        value = {f"level{level}": value} if level % 2 else [value]
    return {"root": value}


def decode(value: Any, tmp: Path) -> Any:
    """A JSON value from the corpus as the Python value the case passes."""
    if isinstance(value, list):
        return [decode(v, tmp) for v in value]
    if not isinstance(value, dict):
        return value
    tags = [k for k in value if k.startswith("$")]
    if not tags:
        return {k: decode(v, tmp) for k, v in value.items()}
    tag, arg = tags[0], value[tags[0]]
    makers: dict[str, Callable[[], Any]] = {
        "$bytes_hex": lambda: bytes.fromhex(arg),
        "$repeat": lambda: value.get("prefix", "") + arg * value["times"] + value.get("suffix", ""),
        "$set": lambda: set(decode(arg, tmp)),
        "$object": lambda: object(),
        "$float": lambda: float(arg),
        "$path": lambda: Path(arg) if arg.startswith("/") else tmp / arg,
        "$nested": lambda: _nested(arg, value.get("leaf", "text")),
        "$budget": lambda: Budget(**decode(arg, tmp)),
        "$generator": lambda: (item for item in decode(arg, tmp)),
        "$pairs": lambda: {decode(k, tmp): decode(v, tmp) for k, v in arg},  # keys JSON cannot hold
    }
    if tag not in makers:
        raise ValueError(f"unknown value tag {tag!r} in the corpus")
    return makers[tag]()


@dataclass
class SampleTrace:
    """A real trace of a finished two-turn run, with non-ASCII text late in it, to cut up."""

    data: bytes
    run_id: str
    question: str

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.data.splitlines()]

    def cut(self, how: str) -> bytes:
        lines = self.data.rstrip(b"\n").split(b"\n")
        last_char = self.data.rindex("日".encode())
        cuts: dict[str, Callable[[], bytes]] = {
            "whole": lambda: self.data,
            "half_last_line": lambda: b"\n".join(lines[:-1]) + b"\n" + lines[-1][: len(lines[-1]) // 2],
            "mid_char_last_line": lambda: self.data[: last_char + 1],
            "half_first_line": lambda: lines[0][: len(lines[0]) // 2],
            "first_line_only": lambda: lines[0] + b"\n",
            "no_last_line": lambda: b"\n".join(lines[:-1]) + b"\n",
            "junk_lines_inside": lambda: (
                b"\n".join([lines[0], b"[1, 2]", b'{"no_type": true}', b'"text"', *lines[1:]]) + b"\n"
            ),
        }
        return cuts[how]()


def _fill(text: str, root: Path, sample: SampleTrace | None) -> str:
    text = text.replace("{tmp}", str(root))
    return text.replace("{run_id}", sample.run_id) if sample else text


def make_files(spec: dict[str, dict[str, Any]], root: Path, sample: SampleTrace | None = None) -> None:
    for rel, how in spec.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if "dir" in how:
            path.mkdir(exist_ok=True)
        elif "text" in how:
            path.write_text(_fill(how["text"], root, sample), encoding="utf-8")
        elif "hex" in how:
            path.write_bytes(bytes.fromhex(how["hex"]))
        elif "sparse" in how:
            with open(path, "wb") as fh:  # no blocks are written: a 1 TB file costs nothing on disk
                fh.truncate(how["sparse"])
        elif "trace" in how:
            assert sample is not None, "a trace file needs the sample trace"
            path.write_bytes(sample.cut(how["trace"]))
        elif "json_lines" in how:
            rows = [_fill(json.dumps(row, ensure_ascii=False), root, sample) for row in how["json_lines"]]
            path.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
        else:
            raise ValueError(f"unknown file spec {how!r}")


# -- a scripted root that plays a case's replies ------------------------------------------------

_REPLIES: dict[str, list[str]] = {}
_SEEN: dict[str, list[list[Message]]] = {}


@register(REPLAY)
def _replay(knobs: dict[str, str]) -> Callable[[list[Message]], str]:
    key = knobs["case"]

    def policy(messages: list[Message]) -> str:
        _SEEN[key].append([dict(m) for m in messages])  # type: ignore[misc]
        replies = _REPLIES[key]
        turn = sum(1 for m in messages if m["role"] == "assistant")
        return replies[min(turn, len(replies) - 1)]

    return policy


def _play(key: str, replies: list[str], trace_dir: Path, max_iterations: int) -> Any:
    _REPLIES[key] = replies
    _SEEN[key] = []
    rlm = RLM(
        f"{ROOT}:case={key}", sub_model="scripted/oracle", trace_dir=trace_dir, max_iterations=max_iterations
    )
    return rlm.run("What is the secret number?", "The secret number is 42.")


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleTrace:
    question = "Où est le numéro secret ? 日本"
    _REPLIES["sample"] = [
        "Je regarde.\n```repl\nn = len(context)\nprint('longueur', n, '日本語')\n```",
        "FINAL(réponse : 42, 日本)",
    ]
    _SEEN["sample"] = []
    rlm = RLM(f"{ROOT}:case=sample", sub_model="scripted/oracle", trace_dir=tmp_path_factory.mktemp("sample"))
    result = rlm.run(question, "Le numéro secret est 42. 日本語 " * 20)
    assert result.stop_reason == "final" and result.trace_path
    data = Path(result.trace_path).read_bytes()
    # The cuts below rely on this shape: run_start first, run_end last, non-ASCII in the last line.
    lines = data.rstrip(b"\n").split(b"\n")
    assert b'"run_start"' in lines[0] and b'"run_end"' in lines[-1] and "日".encode() in lines[-1]
    return SampleTrace(data, load(result.trace_path).root.run_id, question)


# -- checks -------------------------------------------------------------------------------------


def check_message(text: str, expect: dict[str, Any], where: str) -> None:
    """A message a person reads: says what is wrong and what to do, in one paragraph, no traceback."""
    assert text.strip(), f"{where}: no message at all"
    assert "Traceback" not in text, f"{where}: a traceback reached the user:\n{text}"
    assert "\n\n" not in text.strip(), f"{where}: more than one paragraph:\n{text}"
    for part in ("problem", "fix"):
        for needle in expect[part]:
            assert needle in text, f"{where}: the message does not name the {part} ({needle!r}):\n{text}"
    for needle in expect.get("absent", []):  # e.g. the Python form of a fix, shown to a CLI user
        assert needle not in text, f"{where}: the message should not contain {needle!r}:\n{text}"


def expect_raise(expect: dict[str, Any], action: Callable[[], Any]) -> None:
    with pytest.raises(BaseException) as info:
        action()
    exc = info.value
    assert type(exc).__name__ == expect["raises"], f"raised {type(exc).__name__}: {exc}"
    check_message(str(exc), expect, expect["raises"])


# -- drivers ------------------------------------------------------------------------------------


def drive_rlm(case: dict[str, Any], tmp: Path) -> None:
    spec = case["input"]
    make_files(spec.get("files", {}), tmp)
    model = decode(spec.get("model", "scripted/gpt5-like"), tmp)
    kwargs = decode(spec.get("kwargs", {}), tmp)
    expect_raise(case["expect"], lambda: RLM(model, **kwargs))


def drive_budget(case: dict[str, Any], tmp: Path) -> None:
    kwargs = decode(case["input"]["kwargs"], tmp)
    expect_raise(case["expect"], lambda: Budget(**kwargs))


def drive_run(case: dict[str, Any], tmp: Path, sample: SampleTrace) -> None:
    spec, expect = case["input"], case["expect"]
    make_files(spec.get("files", {}), tmp, sample)
    context = decode(spec["context"], tmp)
    question = spec.get("question", "What is the secret number?")
    rlm = RLM("scripted/gpt5-like", sub_model="scripted/oracle", trace_dir=tmp / "traces")
    if "raises" in expect:
        expect_raise(expect, lambda: rlm.run(question, context))
        return
    result = rlm.run(question, context)
    assert result.stop_reason in expect["stop_reason"], (result.stop_reason, result.error)
    assert load(result.trace_path).root.end is not None


def drive_replies(case: dict[str, Any], tmp: Path) -> None:
    spec, expect = case["input"], case["expect"]
    replies = [decode(r, tmp) for r in spec["replies"]]
    key = case["name"]
    result = _play(key, replies, tmp, max_iterations=spec.get("max_iterations", 4))
    seen = _SEEN[key]
    assert result.stop_reason == expect["stop_reason"], (result.stop_reason, result.error)
    if "answer" in expect:
        assert result.answer == expect["answer"]
    if "next_prompt" in expect:
        hint = expect["next_prompt"]
        call = seen[hint.get("call", 1)]
        check_hint(call[-1]["content"], hint)
    trace = load(result.trace_path)
    assert trace.root.end is not None and trace.root.stop_reason == expect["stop_reason"]


def check_hint(text: str, hint: dict[str, Any]) -> None:
    """The message the model gets after a bad reply: names the problem and the way out, or shows
    what the code did."""
    assert hint.get("shows") or (hint.get("problem") and hint.get("fix")), hint
    for part in ("problem", "fix", "shows"):
        for needle in hint.get(part, []):
            assert needle in text, f"the next prompt does not name the {part} ({needle!r}):\n{text[:2000]}"


def drive_trace(case: dict[str, Any], tmp: Path, sample: SampleTrace) -> None:
    spec, expect = case["input"], case["expect"]
    make_files({"trace.jsonl": spec["file"]}, tmp, sample)
    path = tmp / "trace.jsonl"
    if "raises" in expect:
        expect_raise(expect, lambda: load(path))
        return
    want = expect["readable"]
    trace = load(path)
    full = sample.events()
    kept = {"all": len(full), "all_but_last": len(full) - 1, "first": 1}[want["kept"]]
    # Every event written before the cut comes back, in order and unchanged; junk lines do not.
    assert trace.events == full[:kept]
    assert trace.root.question == sample.question
    assert (trace.root.end is not None) == (kept == len(full))
    if "truncated" in want:
        assert trace.truncated == want["truncated"]


# -- the CLI, as a user runs it: one process per case --------------------------------------------
#
# Cases marked "fresh" run as `python -m recursa.cli ...`. The others run in processes forked from
# one launcher that has imported recursa.cli (tests/cli_launcher.py): each is still its own process
# with its own cwd, environment, stdin, stdout, stderr and exit status; only the ~0.5 s import is
# paid once instead of per case, which keeps this file fast on a busy two-core machine.


@dataclass
class CliOutcome:
    returncode: int
    stdout: str
    stderr: str
    root: Path
    before: dict[str, bytes]


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def _cli_env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    env = clean_env()
    env["XDG_CACHE_HOME"] = str(root / "cache")  # default trace folder: never the user's
    # matplotlib's font cache lives under XDG_CACHE_HOME too: built afresh per case, it cost every
    # bench case seconds (long enough, on a loaded machine, to reach the launcher's 60 s alarm).
    env.setdefault("MPLCONFIGDIR", str(_user_cache() / "matplotlib"))
    env.update(extra)
    return env


@dataclass
class _Job:
    case: dict[str, Any]
    root: Path
    argv: list[str]
    env: dict[str, str]
    before: dict[str, bytes]
    holds: list[socket.socket] = field(default_factory=list)  # a port kept busy while the case runs

    def outcome(self, proc: subprocess.CompletedProcess[str]) -> CliOutcome:
        return CliOutcome(proc.returncode, proc.stdout, proc.stderr, self.root, self.before)


def _prepare(case: dict[str, Any], root: Path, sample: SampleTrace) -> _Job:
    spec, expect = case["input"], case["expect"]
    make_files(spec.get("files", {}), root, sample)
    if spec.get("fifo"):
        os.mkfifo(root / spec["fifo"])
    holds: list[socket.socket] = []
    argv = [_fill(a, root, sample) for a in spec["argv"]]
    if spec.get("busy_port"):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        holds.append(held)
        argv = [a.replace("{port}", str(held.getsockname()[1])) for a in argv]
    watched = [*expect.get("unchanged", []), *expect.get("kept_rows", {})]
    return _Job(
        case,
        root,
        argv,
        _cli_env(root, spec.get("env", {})),
        {rel: (root / rel).read_bytes() for rel in watched},
        holds,
    )


def _run_fresh(job: _Job) -> CliOutcome:
    proc = subprocess.run(
        [sys.executable, "-m", "recursa.cli", *job.argv],
        cwd=job.root,
        env=job.env,
        input=job.case["input"].get("stdin", ""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return job.outcome(proc)


@pytest.fixture(scope="module")
def cli_outcomes(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    sample: SampleTrace,
    cli_launcher: CliLauncher,
) -> dict[str, CliOutcome]:
    """The CLI cases this session selected, all run up front, fresh processes beside forked ones."""
    selected = {
        item.callspec.params["case"]["name"]
        for item in request.session.items
        # Other modules parametrize a "case" too (test_replies): only this module's cases count.
        if item.path == request.path
        and hasattr(item, "callspec")
        and isinstance(item.callspec.params.get("case"), dict)
    }
    jobs = [
        _prepare(c, tmp_path_factory.mktemp(c["name"]), sample)
        for c in CASES
        if c["driver"] == "cli" and c["name"] in selected
    ]
    fresh = [j for j in jobs if j.case["input"].get("fresh")]
    forked = [j for j in jobs if not j.case["input"].get("fresh")]
    # A child that hangs (say, reading /dev/zero) dies at its timeout instead of stalling the suite.
    launched = [Job(j.argv, j.root, j.env, j.case["input"].get("stdin", ""), timeout=60) for j in forked]
    with ThreadPoolExecutor(max_workers=2) as pool:
        fresh_done = pool.map(_run_fresh, fresh)
        forked_done = [j.outcome(p) for j, p in zip(forked, cli_launcher.run_all(launched), strict=True)]
        outcomes = [*fresh_done, *forked_done]
    for job in jobs:
        for held in job.holds:
            held.close()
    return {job.case["name"]: outcome for job, outcome in zip([*fresh, *forked], outcomes, strict=True)}


def drive_cli(case: dict[str, Any], outcome: CliOutcome) -> None:
    expect, proc = case["expect"], outcome
    shown = f"exit {proc.returncode}\nstdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stdout + proc.stderr, shown
    code = expect["exit"]
    if code == "nonzero":
        assert proc.returncode != 0, shown
    else:
        assert proc.returncode == code, shown
    if proc.returncode != 0:
        check_message(proc.stderr, expect, "stderr")
    else:
        for needle in expect.get("problem", []) + expect.get("fix", []):
            assert needle in proc.stdout + proc.stderr, shown
    for rel in expect.get("unchanged", []):
        assert (outcome.root / rel).read_bytes() == outcome.before[rel], (
            f"{rel} was changed by a failed command"
        )
    for rel, n in expect.get("kept_rows", {}).items():
        now = (outcome.root / rel).read_bytes()
        assert now.startswith(outcome.before[rel]), f"{rel}: rows written before were lost"
        rows = [json.loads(line) for line in now.splitlines() if _is_json(line)]
        assert len(rows) >= n, f"{rel}: {len(rows)} readable rows, expected at least {n}"
    for rel, needles in expect.get("file_contains", {}).items():
        text = (outcome.root / rel).read_text(encoding="utf-8")
        for needle in needles:
            assert needle in text, f"{rel} does not contain {needle!r}"


def drive_request(case: dict[str, Any]) -> None:
    """A request body `recursa serve` refuses: an error naming the field and the fix (a Chat
    Completions body, or a Responses or Messages one when it says "$api": "responses" or "messages")."""
    pytest.importorskip("fastapi")
    from recursa.serve.messages_request import parse_messages_request
    from recursa.serve.request import ApiError, parse_chat_request
    from recursa.serve.responses_request import parse_responses_request
    from recursa.serve.settings import ServeSettings

    body = dict(case["input"]["body"])
    model = body.pop("$model", "scripted/gpt5-like")
    parsers = {
        "chat": parse_chat_request,
        "responses": parse_responses_request,
        "messages": parse_messages_request,
    }
    parse = parsers[body.pop("$api", "chat")]
    body.setdefault("model", "recursa")
    expect = case["expect"]
    with pytest.raises(ApiError) as info:
        parse(body, ServeSettings(model=model))
    error = info.value
    assert error.status == expect["status"], error.body()
    assert error.param == expect["param"], error.body()
    if "code" in expect:
        assert error.code == expect["code"], error.body()
    check_message(error.message, expect, "the error message")


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


# -- the tests ----------------------------------------------------------------------------------


@pytest.fixture
def no_api_keys(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.endswith("_API_KEY"):
            monkeypatch.delenv(name)
    yield


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input(
    case: dict[str, Any], tmp_path: Path, no_api_keys: None, request: pytest.FixtureRequest
) -> None:
    driver = case["driver"]
    if driver == "rlm":
        drive_rlm(case, tmp_path)
    elif driver == "budget":
        drive_budget(case, tmp_path)
    elif driver == "run":
        drive_run(case, tmp_path, request.getfixturevalue("sample"))
    elif driver == "replies":
        drive_replies(case, tmp_path)
    elif driver == "trace":
        drive_trace(case, tmp_path, request.getfixturevalue("sample"))
    elif driver == "request":
        drive_request(case)
    else:
        drive_cli(case, request.getfixturevalue("cli_outcomes")[case["name"]])


def test_the_corpus_is_complete_and_well_formed() -> None:
    """At least 45 cases over every category the issue names; each failure names problem and fix."""
    assert len(CASES) >= 45
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names)), "case names must be unique"
    assert {c["category"] for c in CASES} == set(CATEGORIES)
    for case in CASES:
        assert case["driver"] in DRIVERS, case["name"]
        assert case.get("why"), f"{case['name']}: say in 'why' what mistake the case stands for"
        expect = case["expect"]
        failing = "raises" in expect or expect.get("exit", 0) != 0
        if failing:
            assert expect.get("problem") and expect.get("fix"), (
                f"{case['name']}: name the problem and the fix"
            )
        if "raises" in expect:
            assert expect["raises"] in ERRORS, case["name"]
        if case["driver"] == "replies":
            assert "next_prompt" in expect or "answer" in expect, case["name"]
