"""Containers and remote sandboxes: the worker over a stdio stream.

No container engine and no Modal or E2B account exist here, so:
- the stdio host runs against a local interpreter started the way a container starts it (the worker
  program and the context arrive over stdin): a real test of the stream path;
- `docker`/`podman` get tests of their command lines, plus a stand-in engine CLI that runs the
  command locally, so that interrupts and kills really go through `<engine> kill`;
- Modal and E2B get stand-ins for their SDK modules that run the worker as a local process;
- one integration test runs a real container where `docker info` succeeds.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from recursa.context import build_payload
from recursa.errors import ConfigError
from recursa.sandbox import SANDBOXES, ContainerSandbox, E2BSandbox, ModalSandbox, make_sandbox
from recursa.sandbox.containers import _docker_info_ok
from recursa.sandbox.proc import running as _alive
from recursa.sandbox.stdio import BOOTSTRAP, StdioSandbox, worker_argv, worker_source
from recursa.sandbox.worker.wire import decode_frame, encode_frame

C_LOOP = "sum(range(10**13))"


class Host:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, fn: str, args: dict[str, Any]) -> Any:
        self.calls.append((fn, args))
        if fn == "llm_query_batched":
            return [f"echo:{p}" for p in args["prompts"]]
        return f"echo:{args.get('prompt')}"


async def _exercise(sb: Any, host: Host) -> None:
    """What every stream-based sandbox must do: state, context, call-backs, both kinds of timeout."""
    await sb.load_context(build_payload(["añb", "🙂", "x" * 100_000]))
    r = await sb.execute("kept = 41\n[len(c) for c in context]", 10)
    assert r.stdout == "[3, 1, 100000]\n", r
    r = await sb.execute("llm_query_batched(['a', 'b'])", 10)
    assert r.stdout == "['echo:a', 'echo:b']\n"
    r = await sb.execute("before = 1\nwhile True:\n    pass", 0.5)
    assert r.timed_out and not r.restarted and "KeyboardInterrupt" in (r.error or "")
    assert (await sb.execute("kept + before", 10)).stdout == "42\n"
    r = await sb.execute(C_LOOP, 0.5)  # no snapshots over a stream: restarted, and the model is told
    assert r.timed_out and r.restarted and not r.restored
    (note,) = r.notes
    assert "all variables were lost" in note and "`context` is loaded again" in note
    assert "no snapshot to restore from" in note
    r = await sb.execute("print(context[1])\nkept", 10)
    assert r.stdout == "🙂\n" and r.error is not None and "NameError" in r.error
    r = await sb.execute("FINAL(context[0])", 10)
    assert r.final is not None and r.final.text == "añb"


# -- the stdio stream against a local interpreter ------------------------------------------------


async def test_stdio_sandbox_runs_the_worker_sent_over_stdin() -> None:
    host = Host()
    sb = StdioSandbox([sys.executable], grace_s=0.3)
    await sb.start(host)
    pid = sb.pid
    try:
        await _exercise(sb, host)
        assert sb.pid != pid  # the restart
    finally:
        await sb.close()
    assert pid is not None and not _alive(pid)


def test_worker_command_line() -> None:
    argv = worker_argv(["python3"], lines=True, config={"a": 1})
    n = str(len(worker_source()))
    assert argv == ["python3", "-I", "-u", "-c", BOOTSTRAP, n, "--stdio", "--lines", "--config", '{"a": 1}']
    assert worker_source().isascii()  # line-based SDK transports carry it as text
    compile(BOOTSTRAP, "<bootstrap>", "exec")


def test_bootstrap_reads_exactly_the_program_and_leaves_the_frames() -> None:
    """The program and a first frame arrive in one write; the worker must still see the frame."""
    from recursa.sandbox.protocol import FrameDecoder, encode_frame

    proc = subprocess.Popen(
        worker_argv([sys.executable]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        code = {"op": "exec", "id": 1, "code": "6 * 7", "max_output_chars": 100}
        proc.stdin.write(worker_source() + encode_frame(code))
        proc.stdin.flush()
        decoder, frames = FrameDecoder(), []
        while len(frames) < 2:
            frames += decoder.feed(os.read(proc.stdout.fileno(), 65536))
        assert frames[0]["op"] == "ready" and (frames[1]["op"], frames[1]["stdout"]) == ("exec_done", "42\n")
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


# -- docker and podman -----------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_container_command_line(engine: str) -> None:
    sb = make_sandbox(
        engine, image="python:3.12-slim", memory="2g", cpus=0.5, pids_limit=64, engine_path=engine
    )
    assert isinstance(sb, ContainerSandbox)
    argv = sb.command()
    image_at = argv.index("python:3.12-slim")
    opts, inner = argv[:image_at], argv[image_at + 1 :]
    assert opts[:3] == [engine, "run", "--interactive"]

    def value(flag: str) -> str:
        return opts[opts.index(flag) + 1]

    assert "--rm" in opts and "--read-only" in opts and "--init" in opts
    assert value("--network") == "none"
    assert value("--memory") == "2g" and value("--memory-swap") == "2g"
    assert value("--cpus") == "0.5" and value("--pids-limit") == "64"
    assert value("--cap-drop") == "ALL" and value("--security-opt") == "no-new-privileges"
    assert value("--user") == "65534:65534"
    assert value("--tmpfs").startswith("/tmp:rw,") and value("--workdir") == "/tmp"
    assert value("--name") == sb.container_name and sb.container_name.startswith("recursa-")
    assert not any(o in ("-v", "--volume", "--mount", "--privileged") for o in opts)  # nothing of the host
    assert not any(o in ("-e", "--env") and "KEY" in value(o) for o in opts)
    assert inner == worker_argv(["python3"])
    assert sb.context_transfer == "inline"
    assert sb.isolation["level"] == "container" and sb.isolation["network"] == "none"
    assert sb.isolation["snapshots"] is False
    assert sb.command() != argv  # a fresh container name per worker


def test_unknown_engine_and_kinds() -> None:
    with pytest.raises(ConfigError, match="docker, podman"):
        ContainerSandbox("lxc")
    assert {"docker", "podman", "modal", "e2b"} <= set(SANDBOXES)


# A stand-in for the engine's CLI: `run` executes the command after the image locally (the
# worker, as the container would), `kill [--signal S] NAME` signals it. It records every call.
_FAKE_ENGINE = textwrap.dedent(
    """\
    #!{python}
    import os, signal, sys
    state = {state!r}
    with open(os.path.join(state, "calls"), "a") as log:
        log.write(" ".join(sys.argv[1:2] + [a for a in sys.argv[2:] if len(a) < 200]) + "\\n")
    args = sys.argv[1:]
    if args[0] == "run":
        with_value = {{"--name", "--network", "--tmpfs", "--workdir", "--env", "--memory", "--memory-swap",
                      "--cpus", "--pids-limit", "--cap-drop", "--security-opt", "--user", "--ulimit",
                      "--log-driver"}}
        i, name = 1, None
        while args[i].startswith("-"):
            if args[i] == "--name":
                name = args[i + 1]
            i += 2 if args[i] in with_value else 1
        command = args[i + 1 :]
        with open(os.path.join(state, name), "w") as f:
            f.write(str(os.getpid()))
        os.execv({python!r}, [{python!r}] + command[1:])
    if args[0] == "kill":
        sig = signal.SIGKILL
        if args[1] == "--signal":
            sig = getattr(signal, "SIG" + args[2])
        with open(os.path.join(state, args[-1])) as f:
            os.kill(int(f.read()), sig)
    """
)


@pytest.fixture
def fake_engine(tmp_path: Path) -> tuple[str, Path]:
    script = tmp_path / "fake-docker"
    script.write_text(_FAKE_ENGINE.format(python=sys.executable, state=str(tmp_path)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), tmp_path


async def test_container_interrupts_and_kills_go_through_the_engine(fake_engine: tuple[str, Path]) -> None:
    path, state = fake_engine
    host = Host()
    # The interrupt goes through a start of the engine script: on a loaded machine that took more
    # than 0.3 s, and the cell that should have been interrupted was killed.
    sb = ContainerSandbox("docker", engine_path=path, grace_s=2.0)
    await sb.start(host)
    first = sb.container_name
    try:
        await _exercise(sb, host)
        second = sb.pid
    finally:
        await sb.close()
    calls = (state / "calls").read_text().splitlines()
    assert f"kill --signal INT {first}" in calls  # the interrupt
    assert f"kill {first}" in calls  # the cell that ignored it
    assert sum(c.startswith("run ") for c in calls) == 2 and sb.container_name != first
    assert second is not None and not _alive(second)  # close(): it stopped by itself (shutdown)


@pytest.mark.skipif(not _docker_info_ok(), reason="no container engine here: `docker info` fails")
async def test_real_docker_container() -> None:
    host = Host()
    image = os.environ.get("RECURSA_TEST_IMAGE", "python:3.11-slim")
    sb = ContainerSandbox("docker", image=image, grace_s=1.0)
    await sb.start(host)
    try:
        await _exercise(sb, host)
        r = await sb.execute("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", 10)
        assert r.error is not None  # --network none
        r = await sb.execute("open('/etc/x', 'w')", 10)
        assert r.error is not None  # read-only root
    finally:
        await sb.close()


# -- Modal and E2B, with stand-ins for their SDKs ----------------------------------------------------


class _Aio:
    """A Modal-style method: `await thing.method.aio(...)`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.aio = fn


class _Chunks:
    """An async iterable of text chunks read from a stream (what Modal's StreamReader yields)."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[str]:
        while chunk := await self.stream.read(65536):
            yield chunk.decode()


class _ModalProcess:
    """What `Sandbox.exec` returns: text stdout/stderr chunks, a buffered stdin with `drain`."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.stdout, self.stderr = _Chunks(proc.stdout), _Chunks(proc.stderr)
        self.stdin = _ModalStdin(proc.stdin)


class _ModalStdin:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.drain = _Aio(writer.drain)

    def write(self, data: bytes) -> None:
        self.writer.write(data)


class _ModalFile:
    def __init__(self, path: str) -> None:
        self.fh = open(path, "wb")  # closed by close.aio, as Modal's file handles are
        self.write = _Aio(self._write)
        self.close = _Aio(self._close)

    async def _write(self, data: bytes) -> None:
        self.fh.write(data)

    async def _close(self) -> None:
        self.fh.close()


class _ModalSandbox:
    def __init__(self, fake: FakeModal) -> None:
        self.fake = fake
        self.exec = _Aio(self._exec)
        self.open = _Aio(self._open)
        self.terminate = _Aio(self._terminate)

    async def _exec(self, *args: str) -> _ModalProcess:
        self.fake.log.append(("exec", args))
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self.fake.procs.append(proc)
        return _ModalProcess(proc)

    async def _open(self, path: str, mode: str) -> _ModalFile:
        assert mode == "wb"
        self.fake.files.append(path)
        return _ModalFile(path)

    async def _terminate(self) -> None:
        self.fake.log.append(("terminate", None))
        for proc in self.fake.procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


class FakeModal:
    """The parts of the `modal` module the adapter uses, running commands as local processes."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.procs: list[asyncio.subprocess.Process] = []
        self.files: list[str] = []
        self.App = type("App", (), {"lookup": _Aio(self._lookup)})
        self.Image = type(
            "Image",
            (),
            {
                "debian_slim": staticmethod(lambda python_version: f"debian_slim:{python_version}"),
                "from_registry": staticmethod(lambda tag: f"registry:{tag}"),
            },
        )
        self.Sandbox = type("Sandbox", (), {"create": _Aio(self._create)})

    async def _lookup(self, name: str, create_if_missing: bool = False) -> str:
        self.log.append(("lookup", (name, create_if_missing)))
        return f"app:{name}"

    async def _create(self, **kwargs: Any) -> _ModalSandbox:
        self.log.append(("create", kwargs))
        return _ModalSandbox(self)


async def test_modal_adapter_with_a_stand_in_sdk() -> None:
    fake = FakeModal()
    host = Host()
    sb = ModalSandbox(sdk=fake, python=sys.executable, cpu=2.0, memory_mb=1024, timeout_s=600, grace_s=0.3)
    await sb.start(host)
    try:
        await _exercise(sb, host)
    finally:
        await sb.close()
    kinds = [k for k, _ in fake.log]
    assert kinds[:2] == ["lookup", "create"] and kinds[-1] == "terminate"
    create = fake.log[1][1]
    assert create["image"] == "debian_slim:3.11" and create["app"] == "app:recursa"
    assert (create["block_network"], create["cpu"], create["memory"], create["timeout"]) == (
        True,
        2.0,
        1024,
        600,
    )
    execs = [args for k, args in fake.log if k == "exec"]
    workers = [a for a in execs if a[0] == sys.executable]
    assert len(workers) == 2 and workers[0] == tuple(worker_argv([sys.executable], lines=True))
    assert ("kill", "-INT") in [a[:2] for a in execs] and ("kill", "-KILL") in [a[:2] for a in execs]
    assert len(fake.files) == 1  # uploaded once; the restarted worker loaded the same file
    os.unlink(fake.files[0])
    assert all(p.returncode is not None for p in fake.procs)


class FakeE2B:
    """The parts of the `e2b` module the adapter uses, running commands as local processes."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.files: list[str] = []
        fake = self

        class Handle:
            def __init__(self, proc: asyncio.subprocess.Process, pumps: list[asyncio.Task[None]]) -> None:
                self.pid, self._proc, self._pumps = proc.pid, proc, pumps

            async def wait(self) -> int:
                await asyncio.gather(*self._pumps)
                return await self._proc.wait()

        class Commands:
            async def run(
                self,
                cmd: str,
                background: bool = False,
                stdin: bool = False,
                on_stdout: Callable[[str], Any] | None = None,
                on_stderr: Callable[[str], Any] | None = None,
                timeout: float = 60,
            ) -> Any:
                fake.log.append(("run", (cmd, background, stdin, timeout)))
                proc = await asyncio.create_subprocess_exec(
                    "bash",
                    "-c",
                    cmd,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
                fake.procs[proc.pid] = proc

                async def pump(stream: asyncio.StreamReader | None, to: Callable[[str], Any] | None) -> None:
                    assert stream is not None
                    while chunk := await stream.read(65536):
                        if to is not None:
                            to(chunk.decode())

                pumps = [
                    asyncio.ensure_future(pump(proc.stdout, on_stdout)),
                    asyncio.ensure_future(pump(proc.stderr, on_stderr)),
                ]
                handle = Handle(proc, pumps)
                if not background:
                    await handle.wait()
                return handle

            async def send_stdin(self, pid: int, data: str) -> None:
                writer = fake.procs[pid].stdin
                assert writer is not None
                writer.write(data.encode())
                await writer.drain()

            async def kill(self, pid: int) -> bool:
                fake.log.append(("kill", pid))
                fake.procs[pid].kill()
                return True

        class Files:
            async def write(self, path: str, data: Any) -> None:
                fake.files.append(path)
                body = data.read() if hasattr(data, "read") else data
                await asyncio.to_thread(Path(path).write_bytes, body)

        class AsyncSandbox:
            def __init__(self) -> None:
                self.commands, self.files = Commands(), Files()

            @classmethod
            async def create(cls, **kwargs: Any) -> AsyncSandbox:
                fake.log.append(("create", kwargs))
                return cls()

            async def kill(self) -> None:
                fake.log.append(("sandbox_kill", None))
                for proc in fake.procs.values():
                    if proc.returncode is None:
                        proc.kill()
                    await proc.wait()

        self.AsyncSandbox = AsyncSandbox


async def test_e2b_adapter_with_a_stand_in_sdk() -> None:
    fake = FakeE2B()
    host = Host()
    sb = E2BSandbox(sdk=fake, python=sys.executable, template="py311", timeout_s=900, grace_s=0.3)
    await sb.start(host)
    try:
        await _exercise(sb, host)
    finally:
        await sb.close()
    assert fake.log[0] == ("create", {"timeout": 900, "allow_internet_access": False, "template": "py311"})
    runs = [args for k, args in fake.log if k == "run"]
    workers = [r for r in runs if r[0].startswith("exec ")]
    assert len(workers) == 2 and workers[0] == (sb.worker_command(), True, True, 0)
    assert any(r[0].startswith("kill -INT ") for r in runs)
    assert any(k == "kill" for k, _ in fake.log)  # the worker that ignored the interrupt
    assert fake.log[-1] == ("sandbox_kill", None)
    assert len(fake.files) == 1
    os.unlink(fake.files[0])


def test_missing_sdks_name_their_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "modal", None)  # an import of it now fails
    monkeypatch.setitem(sys.modules, "e2b", None)
    with pytest.raises(ConfigError, match=r"pip install .*\[modal\]"):
        make_sandbox("modal")
    with pytest.raises(ConfigError, match=r"pip install .*\[e2b\]"):
        make_sandbox("e2b")


def test_an_idle_worker_in_a_stream_exits_at_end_of_stream() -> None:
    proc = subprocess.Popen(worker_argv([sys.executable]), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stdin is not None
    proc.stdin.write(worker_source())
    proc.stdin.close()  # the host went away
    assert proc.wait(timeout=10) == 0


def test_a_worker_in_a_stream_busy_in_a_cell_that_calls_nothing_exits_when_its_host_goes_away() -> None:
    # A container's or remote worker has no parent that dies with the host: its reader thread reads
    # the stream for the whole of every cell (worker/server.py, `_watches`), calls or none.
    proc = subprocess.Popen(
        worker_argv([sys.executable]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write(worker_source())
        cell = "import os\nos.write(2, b'spinning\\n')\nwhile True:\n    pass"
        proc.stdin.write(encode_frame({"op": "exec", "id": 1, "code": cell, "max_output_chars": 100}))
        proc.stdin.flush()
        size = int.from_bytes(proc.stdout.read(4), "big")
        assert decode_frame(proc.stdout.read(size))["op"] == "ready"
        assert proc.stderr.readline() == b"spinning\n"
        proc.stdin.close()  # the host went away
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
