"""The REPL worker: a standalone, stdlib-only script that runs generated code for one RLM run.

It must not import recursa: the same file is run by the local subprocess sandbox and shipped into
containers and remote sandboxes (over stdin: see stdio.py). The host starts it as

    python -I -u -X utf8 worker.py --fd N [--config JSON]    (N: our end of a socketpair)
    python -I -u -X utf8 worker.py --stdio [--lines] [--config JSON]   (frames over stdin/stdout)

Wire format, both directions: a 4-byte big-endian length, then a UTF-8 JSON object with an "op".
With --lines (remote sandboxes whose SDKs carry text, not bytes) each frame is one line of ASCII JSON.
  host -> worker: exec {id, code, max_output_chars}; load_context {kind, size, byte_lengths, keys,
                  transfer: "fd" | "inline" | "path"} (with "fd" the context fd rides on the same
                  sendmsg as the frame, via SCM_RIGHTS; with "inline" `size` raw bytes follow the
                  frame; with "path" the bytes are in the file `path`);
                  reply {id, ok, value | error: {kind, message}}; get_var {id, name}; list_vars {id};
                  standby (+ fd: the snapshots' control socket, see "Snapshots" below); shutdown
  worker -> host: ready {pid, ppid, python, hardening}; exec_done {id, stdout, stderr, omitted_chars,
                  error, final, restored_names, notes, duration_s}; call {id, fn, args};
                  cancel {id} (the code stopped waiting for that call); var {id, found, final};
                  vars {id, names}; context_loaded {kind, pieces, chars, duration_s};
                  snapshot {ok, sid, pid | error}; restored {pid, pgid, sid, old_worker_gone,
                  threads_lost} (the first frame of a snapshot that took over, on its new channel)
Nothing crossing the channel is ever pickled: the host only parses JSON.

Threads: a reader thread owns the incoming side. Replies wake the caller waiting on that call id
(so many user threads can call the host at once); everything else is queued to the main thread,
which runs it, so that SIGINT from the host interrupts running code with KeyboardInterrupt.

Processes (with config "keeper", which the local sandbox sets when it uses snapshots): the process
the host starts stays behind as a keeper, a child subreaper that only reaps; its child is the
worker; the worker keeps a forked snapshot of itself waiting (see "Snapshots"). Each asks to die
with its parent, so the whole tree goes when the host does.
"""

from __future__ import annotations

import builtins
import codecs
import collections
import io
import itertools
import json
import mmap
import os
import signal
import socket
import sys
import threading
import time
import weakref
from _queue import SimpleQueue  # queue.SimpleQueue itself; the queue module costs 1.4 ms to import
from collections.abc import Callable

# Startup is paid by every child RLM, so the worker imports only what the first request needs:
# typing is for annotations alone, and ast waits for the first cell (7 ms of CPU, incl. contextlib).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

MAX_FRAME_BYTES = 1 << 30  # refuse larger frames both ways: a bad length must not allocate the machine
_RECV_CHUNK = 256 * 1024
_JSON_DEPTH = 20
_REPL_FILE = "<repl>"

# ----------------------------------------------------------------------------------------------
# Exceptions generated code can see and catch.


class SubcallError(Exception):
    """A call to the host (llm_query, rlm_query, ...) failed; the message says why."""

    kind = "SubcallError"


class BudgetExceeded(SubcallError):
    """The host refused a call because it could break a hard budget cap."""

    kind = "BudgetExceeded"


class RemoteError(Exception):
    """An error reply from the host, before it is turned into the class the REPL code sees."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class ToolError(Exception):
    """A user tool failed (raised, timed out, returned something unusable); the message says why."""

    kind = "ToolError"


_ERROR_CLASSES: dict[str, type[Exception]] = {
    "SubcallError": SubcallError,
    "BudgetExceeded": BudgetExceeded,
    "ToolError": ToolError,
}


def error_for(kind: str, message: str) -> Exception:
    """The exception to raise in the REPL for an error reply: same class name when we have one."""
    cls = _ERROR_CLASSES.get(kind, SubcallError)
    exc = cls(message)
    exc.kind = kind  # type: ignore[attr-defined]  (keeps e.g. "LMError" visible to code that looks)
    return exc


# ----------------------------------------------------------------------------------------------
# Framing.


def encode_frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(data):,} bytes is over the {MAX_FRAME_BYTES:,}-byte channel limit")
    return len(data).to_bytes(4, "big") + data


def encode_line(obj: dict[str, Any]) -> bytes:
    """One frame as a line of ASCII JSON (--lines): survives transports that carry only text."""
    data = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(data):,} bytes is over the {MAX_FRAME_BYTES:,}-byte channel limit")
    return data + b"\n"


def decode_frame(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    obj = json.loads(str(data, "utf-8", "surrogatepass"))
    if not isinstance(obj, dict):
        raise ValueError("frame is not a JSON object")
    return obj


class SocketTransport:
    """A connected stream socket that may carry file descriptors (SCM_RIGHTS)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv(self) -> tuple[bytes, list[int]]:
        data, fds, _flags, _addr = socket.recv_fds(self.sock, _RECV_CHUNK, 4)
        return data, list(fds)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()


class StdioTransport:
    """Frames over a pair of pipes (containers, remote sandboxes). No fd passing."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd

    def recv(self) -> tuple[bytes, list[int]]:
        return os.read(self.rfd, _RECV_CHUNK), []

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view) :]

    def close(self) -> None:
        for fd in {self.rfd, self.wfd}:
            os.close(fd)


class _Reply:
    __slots__ = ("error", "event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.error: RemoteError | None = None


class WorkerChannel:
    """The worker's end of the channel: thread-safe calls to the host, and the main-thread inbox."""

    def __init__(self, transport: SocketTransport | StdioTransport, *, lines: bool = False) -> None:
        self.transport = transport
        self.lines = lines
        self.on_eof: Callable[[], None] = lambda: None  # last words before the process exits
        self.inbox: SimpleQueue[dict[str, Any]] = SimpleQueue()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Reply] = {}
        self._ids = itertools.count(1)
        self._main = threading.main_thread().ident
        # SIGINT must not land in the middle of a frame the main thread is writing: the handler
        # defers it while this is set and `send` raises it once the frame is out.
        self.main_sending = False
        self.interrupt_pending = False
        self.may_interrupt: Callable[[], bool] = lambda: False

    # -- sending ---------------------------------------------------------------------------------

    def send(self, obj: dict[str, Any]) -> None:
        frame = encode_line(obj) if self.lines else encode_frame(obj)
        on_main = threading.get_ident() == self._main
        if on_main:
            self.main_sending = True
        try:
            with self._send_lock:
                self.transport.sendall(frame)
        finally:
            if on_main:
                self.main_sending = False
                if self.interrupt_pending:
                    self.interrupt_pending = False
                    if self.may_interrupt():
                        raise KeyboardInterrupt

    def call(self, fn: str, args: dict[str, Any]) -> Any:
        """Ask the host to run `fn(args)` and wait for its reply. Safe from any thread."""
        call_id = next(self._ids)
        slot = _Reply()
        self._pending[call_id] = slot
        done = False
        try:
            self.send({"op": "call", "id": call_id, "fn": fn, "args": args})
            slot.event.wait()
            done = True
        finally:
            self._pending.pop(call_id, None)
            if not done:  # interrupted: let the host stop work nobody will read
                try:
                    self.send({"op": "cancel", "id": call_id})
                except (OSError, KeyboardInterrupt):
                    pass
        if slot.error is not None:
            raise slot.error
        return slot.value

    # -- receiving -------------------------------------------------------------------------------

    def close_copy(self) -> None:
        """In a forked snapshot: drop this process's copy of the channel (only the worker reads it)."""
        try:
            self.transport.close()
        except OSError:
            pass

    def start_reader(self) -> None:
        threading.Thread(target=self._read_loop, name="recursa-reader", daemon=True).start()

    def _read_loop(self) -> None:
        try:
            if self.lines:
                self._read_lines()
            else:
                self._read_frames()
        except BaseException:  # a broken channel leaves nothing to serve: never linger as an orphan
            pass
        try:
            self.on_eof()
        finally:
            os._exit(0)

    def _read_lines(self) -> None:
        buf = bytearray()
        while True:
            end = buf.find(b"\n")
            while end < 0:
                if len(buf) > MAX_FRAME_BYTES:
                    raise ValueError("oversized line from host")
                data, fds = self.transport.recv()
                for fd in fds:
                    os.close(fd)
                if not data:
                    return
                start = len(buf)
                buf += data
                end = buf.find(b"\n", start)
            line = bytes(buf[:end]).strip()
            del buf[: end + 1]
            if line and self._route(decode_frame(line)):
                return

    def _route(self, msg: dict[str, Any]) -> bool:
        """Deliver one decoded frame; True when the host asked us to stop."""
        if msg.get("op") == "reply":
            self._deliver(msg)
            return False
        self.inbox.put(msg)
        return msg.get("op") == "shutdown"

    def _read_frames(self) -> None:
        buf = bytearray()
        fds: collections.deque[int] = collections.deque()
        while True:
            while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
                if len(buf) >= 4 and int.from_bytes(buf[:4], "big") > MAX_FRAME_BYTES:
                    raise ValueError("oversized frame from host")
                data, new_fds = self.transport.recv()
                if not data:
                    return  # host went away
                buf += data
                fds.extend(new_fds)
            size = int.from_bytes(buf[:4], "big")
            msg = decode_frame(memoryview(buf)[4 : 4 + size])
            del buf[: 4 + size]
            op = msg.get("op")
            if op == "load_context" and msg.get("transfer") == "inline":
                msg["_buffer"], buf = _read_inline(self.transport, buf, int(msg.get("size", 0)))
            elif (op == "load_context" and msg.get("transfer") == "fd") or op == "standby":
                msg["_fd"] = fds.popleft() if fds else -1
            if self._route(msg):
                return

    def _deliver(self, msg: dict[str, Any]) -> None:
        slot = self._pending.get(msg.get("id"))  # type: ignore[arg-type]
        if slot is None:
            return  # the caller gave up (interrupted); drop the late reply
        if msg.get("ok"):
            slot.value = msg.get("value")
        else:
            err = msg.get("error") or {}
            slot.error = RemoteError(str(err.get("kind", "SubcallError")), str(err.get("message", "")))
        slot.event.set()


def _read_inline(
    transport: SocketTransport | StdioTransport, buf: bytearray, size: int
) -> tuple[Any, bytearray]:
    """Read `size` raw context bytes that follow a load_context frame into an anonymous map."""
    if size <= 0:
        return None, buf
    mm = mmap.mmap(-1, size)
    take = min(size, len(buf))
    mm[:take] = buf[:take]
    del buf[:take]
    pos = take
    while pos < size:
        data, _ = transport.recv()
        if not data:
            raise EOFError("host closed the channel during a context transfer")
        part = data[: size - pos]
        mm[pos : pos + len(part)] = part
        pos += len(part)
        buf += data[len(part) :]
    return mm, buf


# ----------------------------------------------------------------------------------------------
# Bounded output capture.


class BoundedText(io.TextIOBase):
    """A text stream that keeps the first and last `keep` characters and counts the rest.

    Printing 100 MB costs at most 2*keep characters of memory and never blocks.
    """

    def __init__(self, keep: int, name: str) -> None:
        super().__init__()
        self.keep = max(0, keep)
        self._name = name
        self.head: list[str] = []
        self.head_len = 0
        self.tail: collections.deque[str] = collections.deque()
        self.tail_len = 0
        self.dropped = 0
        self._lock = threading.Lock()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._name

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, s: str) -> int:  # type: ignore[override]
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        n = len(s)
        with self._lock:
            room = self.keep - self.head_len
            if room > 0:
                part = s[:room]
                self.head.append(part)
                self.head_len += len(part)
                s = s[room:]
            if s:
                if len(s) >= self.keep:
                    self.dropped += self.tail_len + len(s) - self.keep
                    self.tail.clear()
                    s = s[len(s) - self.keep :] if self.keep else ""
                    self.tail_len = 0
                if s:
                    self.tail.append(s)
                    self.tail_len += len(s)
                while self.tail_len > self.keep:  # drop whole chunks from the left, then trim one
                    first = self.tail[0]
                    excess = self.tail_len - self.keep
                    if len(first) <= excess:
                        self.tail.popleft()
                        self.tail_len -= len(first)
                        self.dropped += len(first)
                    else:
                        self.tail[0] = first[excess:]
                        self.tail_len -= excess
                        self.dropped += excess
        return n

    def parts(self) -> tuple[str, int, str]:
        with self._lock:
            return "".join(self.head), self.dropped, "".join(self.tail)


def _fit(head: str, dropped: int, tail: str, limit: int) -> tuple[str, int]:
    """Cut head+tail to `limit` characters around the middle; returns (text, omitted count)."""
    total = len(head) + len(tail)
    if total > limit:
        text = head + tail
        keep_head = (limit + 1) // 2
        keep_tail = limit - keep_head
        dropped += total - limit
        head, tail = text[:keep_head], text[len(text) - keep_tail :] if keep_tail else ""
    if dropped:
        return f"{head}\n[... {dropped:,} characters omitted ...]\n{tail}", dropped
    return head + tail, 0


class Capture:
    """stdout and stderr of one execution, cut to `limit` characters in total (stderr gets a third)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.out = BoundedText((self.limit + 1) // 2, "<stdout>")
        self.err = BoundedText((self.limit + 1) // 2, "<stderr>")

    def finish(self) -> tuple[str, str, int]:
        oh, od, ot = self.out.parts()
        eh, ed, et = self.err.parts()
        out_len, err_len = len(oh) + len(ot), len(eh) + len(et)
        err_share = min(err_len, max(self.limit // 3, self.limit - out_len))
        out_share = self.limit - err_share
        out, out_omitted = _fit(oh, od, ot, out_share)
        err, err_omitted = _fit(eh, ed, et, err_share)
        return out, err, out_omitted + err_omitted


# ----------------------------------------------------------------------------------------------
# Values crossing the channel.


def render(value: Any) -> str:
    try:
        return str(value)
    except Exception as exc:  # a broken __str__ or a 10**5000 int must not lose the answer path
        return f"<{type(value).__name__} that cannot be shown as text: {type(exc).__name__}: {exc}>"


def json_safe(value: Any, depth: int = 0) -> Any:
    """A JSON-able copy: scalars, lists (tuples become lists) and str-keyed dicts; else str(value)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value if type(value) is str else str.__str__(value)
    if isinstance(value, int):
        return int(value) if value.bit_length() < 10_000 else render(value)
    if isinstance(value, float):
        return float(value) if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if depth < _JSON_DEPTH:
        if isinstance(value, (list, tuple)):
            return [json_safe(v, depth + 1) for v in value]
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {str.__str__(k): json_safe(v, depth + 1) for k, v in value.items()}
    return render(value)


def final_payload(value: Any, protocol: str, var_name: str | None = None) -> dict[str, Any]:
    text = render(value)
    out: dict[str, Any] = {"text": text, "protocol": protocol, "var_name": var_name}
    safe = json_safe(value)
    if isinstance(safe, str) and safe == text:
        out["value_is_text"] = True  # a long str answer crosses the channel once, not twice
    else:
        out["value"] = safe
    return out


def _describe_size(value: Any) -> str:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        unit = " chars" if isinstance(value, str) else " bytes" if isinstance(value, bytes) else " items"
        return f" (len {len(value):,}{unit})"
    return ""


# ----------------------------------------------------------------------------------------------
# The REPL.


class Repl:
    """A persistent namespace that runs code like notebook cells.

    `call(fn, args)` reaches the host (raising `RemoteError` on an error reply). With
    `own_print=True` (the in-process sandbox, which must not touch the host's sys.stdout) the
    namespace gets its own `print` writing to the capture instead: then only print() and the
    displayed last expression are captured, not sys.stdout.write or output from imported modules.
    """

    def __init__(self, call: Callable[[str, dict[str, Any]], Any], *, own_print: bool = False) -> None:
        self._call_host = call
        self.own_print = own_print
        self.interruptible = False  # True only while user code runs (the SIGINT handler checks it)
        self._capture: Capture | None = None
        self._final: dict[str, Any] | None = None
        self._notes: list[str] = []
        # code object -> its cell's source lines, for tracebacks. Weak: a cell's lines live exactly as
        # long as code from it (functions it defined) does.
        self._sources: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()
        self._answer: dict[str, Any] = {"content": None, "ready": False}
        self._tool_ns: dict[str, Any] | None = None  # globals of sandbox tools, made on first use
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self._reserved = self._make_reserved()
        self.ns.update(self._reserved)

    # -- the names generated code sees -----------------------------------------------------------

    def _make_reserved(self) -> dict[str, Any]:
        call = self._call

        def llm_query(prompt: str, model: str | None = None) -> str:
            """Ask a sub-model one question; returns its reply text."""
            if not isinstance(prompt, str):
                raise TypeError(
                    f"llm_query expects one str prompt, got {type(prompt).__name__}; "
                    "for many prompts use llm_query_batched(prompts)"
                )
            return str(call("llm_query", {"prompt": prompt, "model": model}))

        def llm_query_batched(prompts: list[str], model: str | None = None) -> list[str]:
            """Ask a sub-model many questions at once (they run in parallel); replies in order."""
            prompts = _str_list(prompts, "llm_query_batched", "prompts")
            return self._batch_results(
                "llm_query_batched", call("llm_query_batched", {"prompts": prompts, "model": model})
            )

        def rlm_query(prompt: str, context: Any = None) -> str:
            """Ask a child RLM (its own REPL, `context` as its context); returns its answer."""
            if not isinstance(prompt, str):
                raise TypeError(f"rlm_query expects a str prompt, got {type(prompt).__name__}")
            return str(call("rlm_query", {"prompt": prompt, "context": _context_arg(context)}))

        def rlm_query_batched(prompts: list[str], contexts: list[Any] | None = None) -> list[str]:
            """Run many child RLMs in parallel; contexts[i] goes with prompts[i]."""
            prompts = _str_list(prompts, "rlm_query_batched", "prompts")
            if contexts is not None:
                if not isinstance(contexts, (list, tuple)) or len(contexts) != len(prompts):
                    raise ValueError("rlm_query_batched: contexts must be a list as long as prompts")
                contexts = [_context_arg(c) for c in contexts]
            args = {"prompts": prompts, "contexts": contexts}
            return self._batch_results("rlm_query_batched", call("rlm_query_batched", args))

        def FINAL(value: Any) -> None:
            """Hand back `value` as the final answer (the last call in a cell wins)."""
            self._final = final_payload(value, "FINAL")

        def FINAL_VAR(name: Any) -> None:
            """Hand back the value of the variable called `name` (a str) as the final answer."""
            self._final = self._final_var(name)

        def SHOW_VARS() -> None:
            """Print the variables you defined, with their types and sizes."""
            names = self.user_variables()
            if not names:
                self._write_out("No variables defined yet.\n")
                return
            lines = [f"  {n}: {type(self.ns[n]).__name__}{_describe_size(self.ns[n])}" for n in names]
            self._write_out("Variables:\n" + "\n".join(lines) + "\n")

        reserved: dict[str, Any] = {
            "context": None,
            "llm_query": llm_query,
            "llm_query_batched": llm_query_batched,
            "llm_batch": llm_query_batched,
            "rlm_query": rlm_query,
            "rlm_query_batched": rlm_query_batched,
            "FINAL": FINAL,
            "FINAL_VAR": FINAL_VAR,
            "answer": self._answer,
            "SHOW_VARS": SHOW_VARS,
            "BudgetExceeded": BudgetExceeded,
            "SubcallError": SubcallError,
            "ToolError": ToolError,
        }
        if self.own_print:
            reserved["print"] = self._print
        return reserved

    def _batch_results(self, fn: str, items: list[Any]) -> list[str]:
        """Keep every answer that came back; mark failed items, and raise only if all failed.

        Answers in a batch are paid for one by one, so one refused prompt must not throw away
        the rest.
        """
        failures = [item["__error__"] for item in items if isinstance(item, dict) and "__error__" in item]
        if not failures:
            return [str(item) for item in items]
        first = failures[0]
        if len(failures) == len(items):
            raise error_for(first["kind"], f"all {len(items)} prompts failed; first: {first['message']}")
        out = [
            f"[error] {item['__error__']['kind']}: {item['__error__']['message']}"
            if isinstance(item, dict) and "__error__" in item
            else str(item)
            for item in items
        ]
        warning = (
            f"{fn}: {len(failures)} of {len(items)} prompts failed and their entries start with "
            f"'[error]' (first: {first['kind']}: {first['message']})\n"
        )
        if self._capture is not None:
            self._capture.err.write(warning)
        else:
            sys.stderr.write(warning)
        return out

    def _call(self, fn: str, args: dict[str, Any]) -> Any:
        try:
            return self._call_host(fn, args)
        except RemoteError as err:
            raise error_for(err.kind, err.message) from None

    def _final_var(self, name: Any) -> dict[str, Any]:
        if isinstance(name, str):
            key = name.strip().strip("\"'`").strip()
            if key in self.ns and key not in ("__builtins__", "__name__"):
                return final_payload(self.ns[key], "FINAL_VAR", key)
        # FINAL_VAR(my_var) instead of FINAL_VAR("my_var"): the value itself arrived. Models do this
        # a lot; accept it when it is plainly a value (or the very object a variable holds).
        owner = next((v for v in self.user_variables() if self.ns[v] is name), None)
        if owner is not None or not isinstance(name, str):
            what = f"the value of `{owner}`" if owner else f"a {type(name).__name__} value"
            fix = f'FINAL_VAR("{owner}")' if owner else 'FINAL_VAR("my_var") or FINAL(value)'
            self._notes.append(f"FINAL_VAR got {what} instead of a variable name and used it; write {fix}.")
            return final_payload(name, "FINAL_VAR", owner)
        names = self.user_variables()
        defined = ", ".join(names[:30]) + (f" and {len(names) - 30} more" if len(names) > 30 else "")
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise NameError(
            f"FINAL_VAR({shown!r}): no variable named {shown!r} is defined (defined variables: "
            f"{defined or 'none'}). Pass the name of a variable as a string, or use FINAL(text) to "
            "answer with literal text."
        )

    def user_variables(self) -> list[str]:
        return sorted(
            n
            for n, v in self.ns.items()
            if not n.startswith("_") and n not in self._reserved and type(v) is not type(sys)
        )

    # -- output ----------------------------------------------------------------------------------

    def _write_out(self, text: str) -> None:
        if self._capture is not None and self.own_print:
            self._capture.out.write(text)
        else:
            sys.stdout.write(text)

    def _print(
        self, *args: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None, flush: bool = False
    ) -> None:
        cap = self._capture
        if cap is not None and (file is None or file is sys.stdout or file is sys.stderr):
            target: Any = cap.err if file is sys.stderr else cap.out
            builtins.print(*args, sep=sep, end=end, file=target)
        else:
            builtins.print(*args, sep=sep, end=end, file=file, flush=flush)

    # -- running code ----------------------------------------------------------------------------

    def execute(self, code: str, max_output_chars: int) -> dict[str, Any]:
        """Run one cell; returns the exec_done fields (without the id)."""
        started = time.perf_counter()
        cap = Capture(max_output_chars)
        self._capture, self._final, self._notes = cap, None, []
        saved = sys.stdout, sys.stderr
        if not self.own_print:
            sys.stdout, sys.stderr = cap.out, cap.err  # our own process: swapping is harmless here
        error: str | None = None
        try:
            self._run_cell(code, cap)
        except BaseException as exc:
            error = self._format_error(exc)
            cap.err.write(error + "\n")
        finally:
            if not self.own_print:
                sys.stdout, sys.stderr = saved
            self._capture = None
        restored = self._restore_reserved()
        final = self._final or self._take_answer()
        stdout, stderr, omitted = cap.finish()
        return {
            "partial": self._partial_answer(),
            "stdout": stdout,
            "stderr": stderr,
            "omitted_chars": omitted,
            "error": error,
            "final": final,
            "restored_names": restored,
            "notes": self._notes,
            "duration_s": time.perf_counter() - started,
        }

    def _run_cell(self, code: str, cap: Capture) -> None:
        import ast

        tree = ast.parse(code, _REPL_FILE, "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        lines = code.splitlines()
        body = compile(tree, _REPL_FILE, "exec", dont_inherit=True)  # no __future__ from this file
        self._remember(body, lines)
        expr = None
        if last is not None:
            expr = compile(ast.Expression(last.value), _REPL_FILE, "eval", dont_inherit=True)
            self._remember(expr, lines)
        self.interruptible = True
        try:
            exec(body, self.ns)
            result = eval(expr, self.ns) if expr is not None else None
        finally:
            self.interruptible = False
        if result is not None:
            cap.out.write(render_repr(result) + "\n")

    def _remember(self, code: Any, lines: list[str]) -> None:
        stack = [code]
        while stack:
            c = stack.pop()
            self._sources[c] = lines
            stack.extend(k for k in c.co_consts if hasattr(k, "co_consts"))

    def _format_error(self, exc: BaseException) -> str:
        if isinstance(exc, SyntaxError) and exc.filename == _REPL_FILE:
            import traceback  # only on errors: keeps worker startup short

            return "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_filename == _REPL_FILE:
                line = f'  File "{_REPL_FILE}", line {tb.tb_lineno}, in {code.co_name}'
                src = self._sources.get(code)
                if src and 0 < tb.tb_lineno <= len(src):
                    line += "\n    " + src[tb.tb_lineno - 1].strip()
                frames.append(line)
            tb = tb.tb_next
        message = render(exc)
        head = type(exc).__name__ + (f": {message}" if message else "")
        if isinstance(exc, SystemExit):
            head += " (exit() does not end the REPL; answer with FINAL(...) instead)"
        if isinstance(exc, KeyboardInterrupt):
            head = "KeyboardInterrupt: execution was interrupted"
        if frames:
            return "Traceback (most recent call last):\n" + "\n".join(frames) + "\n" + head
        return head

    def _restore_reserved(self) -> list[str]:
        restored = []
        current_answer = self.ns.get("answer")
        if current_answer is not self._answer and isinstance(current_answer, dict):
            # `answer = {"content": ..., "ready": True}` is a fair way to answer: adopt, don't scold.
            self._answer.clear()
            self._answer.update(current_answer)
            self.ns["answer"] = self._answer
        for name, value in self._reserved.items():
            if self.ns.get(name, _MISSING) is not value:
                self.ns[name] = value
                restored.append(name)
        if restored:
            self._notes.append(
                "These reserved names were overwritten or deleted by your code and have been restored: "
                + ", ".join(restored)
                + ". Store your own data under other names."
            )
        return restored

    def _partial_answer(self) -> str | None:
        """answer["content"] set but not ready: what a run that stops early can still hand back."""
        content = self._answer.get("content")
        if content is None or self._answer.get("ready"):
            return None
        return render(content)[:_PARTIAL_CHARS]

    def _take_answer(self) -> dict[str, Any] | None:
        ans = self._answer
        if not ans.get("ready"):
            return None
        final = final_payload(ans.get("content"), "answer")
        ans.clear()
        ans.update(content=None, ready=False)
        return final

    # -- user tools and engine-kept values ---------------------------------------------------------

    def define(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """Add reserved names: tools defined from source, stubs of host tools, or plain values.

        A tool whose source fails here (a module the sandbox lacks, say) becomes a stub that raises
        ToolError with the reason, so the run goes on and the model learns why when it calls it.
        """
        errors = []
        for entry in entries:
            name, kind = str(entry.get("name")), entry.get("kind")
            if kind == "source":
                try:
                    value = self._tool_from_source(name, str(entry.get("source", "")))
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                    errors.append(f"tool {name} could not be set up in the sandbox ({reason})")
                    value = self._broken_tool(name, reason)
            elif kind == "host":
                value = self._host_tool(name, str(entry.get("signature", "")), str(entry.get("doc", "")))
            else:
                value = entry.get("value")
            self._reserved[name] = value
            self.ns[name] = value
            self._tool_globals()[name] = value
        return {"errors": errors}

    def _tool_globals(self) -> dict[str, Any]:
        """The globals every sandbox tool shares: its imports, the other tools, `context`, llm_query."""
        if self._tool_ns is None:
            self._tool_ns = {"__name__": "recursa_tools", "__builtins__": builtins, **self._reserved}
        return self._tool_ns

    def _tool_from_source(self, name: str, source: str) -> Any:
        g = self._tool_globals()
        exec(compile(source, f"<tool {name}>", "exec", dont_inherit=True), g)
        if not callable(g.get(name)):
            raise NameError(f"the source did not define a function named {name}")
        return g[name]

    def _broken_tool(self, name: str, reason: str) -> Any:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise ToolError(f"{name} is unavailable: it could not be set up in the sandbox ({reason})")

        broken.__name__ = broken.__qualname__ = name
        return broken

    def _host_tool(self, name: str, signature: str, doc: str) -> Any:
        call = self._call

        def tool(*args: Any, **kwargs: Any) -> Any:
            try:
                return call("tool", {"name": name, "args": list(args), "kwargs": kwargs})
            except (TypeError, ValueError) as exc:  # only encoding the request raises these here
                raise TypeError(
                    f"{name}: its arguments go to the host as JSON, and this one cannot ({exc}); pass str, "
                    "numbers, bools, None, lists or dicts"
                ) from None

        tool.__name__ = tool.__qualname__ = name
        tool.__doc__ = f"{name}{signature}\n\n{doc}".rstrip()
        return tool

    # -- other requests --------------------------------------------------------------------------

    def get_var(self, name: str) -> dict[str, Any]:
        key = str(name).strip().strip("\"'`").strip()
        if key.startswith("__") or key not in self.ns:
            return {"found": False, "final": None}
        return {"found": True, "final": final_payload(self.ns[key], "FINAL_VAR", key)}

    def load_context(
        self,
        kind: str,
        source: ContextSource,
        byte_lengths: list[int],
        char_lengths: list[int],
        keys: list[str],
    ) -> dict[str, Any]:
        """Decode the context from `source`, holding at most one window of raw bytes at a time."""
        started = time.perf_counter()
        pieces = decode_pieces(source, byte_lengths, char_lengths)
        value: Any
        if kind == "str":
            value = pieces[0] if pieces else ""
        elif kind == "list":
            value = pieces
        elif kind == "dict":
            value = dict(zip(keys, pieces, strict=True))
        else:
            raise ValueError(f"unknown context kind {kind!r}")
        self._reserved["context"] = value
        self.ns["context"] = value
        if self._tool_ns is not None:
            self._tool_ns["context"] = value
        return {
            "kind": kind,
            "pieces": len(pieces),
            "chars": sum(map(len, pieces)),
            "duration_s": time.perf_counter() - started,
        }


_MISSING = object()
_PARTIAL_CHARS = 100_000


def render_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<{type(value).__name__} whose repr failed: {type(exc).__name__}: {exc}>"


def _str_list(values: Any, fn: str, what: str) -> list[str]:
    if isinstance(values, str) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{fn} expects a list of str {what}, got {type(values).__name__}")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(f"{fn}: {what}[{i}] is {type(v).__name__}, not str")
    return list(values)


def _context_arg(context: Any) -> Any:
    """A child context must be str, list[str] or dict[str, str]: what crosses the channel as JSON."""
    if context is None or isinstance(context, str):
        return context
    if isinstance(context, (list, tuple)) and all(isinstance(v, str) for v in context):
        return list(context)
    if isinstance(context, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in context.items()
    ):
        return dict(context)
    raise TypeError(
        f"a child context must be a str, list[str] or dict[str, str], not {type(context).__name__}; "
        "convert it to text first (e.g. json.dumps)"
    )


# ----------------------------------------------------------------------------------------------
# Context loading. Peak memory is what matters at 1 GB: the decoded context plus one window of
# raw bytes. A mapping of the whole buffer would count in this process's RSS next to the decoded
# text (2x); ASCII text is read straight into the str object (1x).

_WINDOW = 16 * 1024 * 1024


class ContextSource:
    """Random-access reads of the context bytes: from an fd (memfd) or an in-memory buffer.

    With `release` (the host keeps no copy of the buffer) every range read from the fd is freed at
    once (a hole punched into the memfd), so the context is never in memory twice: the str being
    built grows as the buffer shrinks, window by window.
    """

    def __init__(self, fd: int = -1, buffer: Any = None, release: bool = False) -> None:
        self.fd = fd
        self.buffer = buffer
        self.release = release and fd >= 0

    def read(self, size: int, pos: int) -> bytes:
        if self.buffer is not None:
            return bytes(self.buffer[pos : pos + size])
        chunks = []
        while size > 0:
            data = os.pread(self.fd, min(size, _RELEASE_STEP if self.release else 1 << 30), pos)
            if not data:
                raise EOFError("the context buffer is shorter than announced")
            chunks.append(data)
            self._free(pos, len(data))
            size -= len(data)
            pos += len(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_into(self, target: memoryview, pos: int) -> None:
        if self.buffer is not None:
            target[:] = self.buffer[pos : pos + len(target)]
            return
        done, step = 0, _RELEASE_STEP if self.release else 1 << 30
        while done < len(target):
            got = os.preadv(self.fd, [target[done : done + step]], pos + done)
            if got <= 0:
                raise EOFError("the context buffer is shorter than announced")
            self._free(pos + done, got)
            done += got

    def _free(self, pos: int, size: int) -> None:
        if self.release and not _punch_hole(self.fd, pos, size):
            self.release = False  # not supported here: the buffer goes when the load is done

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.buffer is not None and hasattr(self.buffer, "close"):
            self.buffer.close()
        self.buffer = None


# Read, then freed, this much at a time: the most the context is ever in memory twice.
_RELEASE_STEP = 4 * 1024 * 1024
_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2
_fallocate: Any = None


def _punch_hole(fd: int, pos: int, size: int) -> bool:
    """Free the pages of bytes [pos, pos + size) of a memfd (Linux fallocate); False if unsupported."""
    global _fallocate
    if _fallocate is None:
        try:
            import ctypes

            _fallocate = ctypes.CDLL(None, use_errno=True).fallocate
            _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        except (ImportError, OSError, AttributeError):
            _fallocate = False
    if not _fallocate:
        return False
    return _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, pos, size) == 0


def decode_pieces(source: ContextSource, byte_lengths: list[int], char_lengths: list[int]) -> list[str]:
    pieces: list[str] = []
    pos = i = 0
    while i < len(byte_lengths):
        n = byte_lengths[i]
        if n >= _WINDOW:
            ascii_only = i < len(char_lengths) and char_lengths[i] == n
            pieces.append(_read_large_piece(source, pos, n, ascii_only))
            pos += n
            i += 1
            continue
        j, total = i, 0
        while j < len(byte_lengths) and total + byte_lengths[j] <= _WINDOW:
            total += byte_lengths[j]
            j += 1
        window = source.read(total, pos)
        with memoryview(window) as view:
            offset = 0
            for k in range(i, j):
                m = byte_lengths[k]
                pieces.append(str(view[offset : offset + m], "utf-8", "surrogatepass"))
                offset += m
        del window
        pos += total
        i = j
    return pieces


def _read_large_piece(source: ContextSource, pos: int, size: int, ascii_only: bool) -> str:
    if ascii_only:
        text = _ascii_str_in_place(source, pos, size)
        if text is not None:
            return text
    decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")
    parts = []
    for start in range(0, size, _WINDOW):
        chunk = source.read(min(_WINDOW, size - start), pos + start)
        parts.append(decoder.decode(chunk, final=start + _WINDOW >= size))
        del chunk
    text = _join_in_huge_pages(parts)
    del parts
    return text


def _str_kind(part: str) -> int:
    """Bytes per character in `part`'s storage (1, 2 or 4), from its size: PEP 393, compact strs."""
    if part.isascii():
        return 1
    return (sys.getsizeof(part) - _COMPACT_HEADER) // (len(part) + 1)


_COMPACT_HEADER = sys.getsizeof("\xe9") - 2  # a non-ASCII compact str: header, 1 char, terminator
_WIDEN = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}


def _join_in_huge_pages(parts: list[str]) -> str:
    """Join `parts` into a str whose memory was advised for huge pages before it is written.

    A join fills its result at once, leaving it in 4 KiB pages that make every fork snapshot slow
    (see _advise_huge_pages). Here the result is allocated first, advised, then filled part by part,
    each part's characters widened to the result's width by encoding them (latin-1, UTF-16 or
    UTF-32 little-endian are exactly the 1-, 2- and 4-byte storage). Falls back to join without ctypes.
    """
    kind = max(map(_str_kind, parts), default=1)
    # The result must be canonical (PEP 393): ASCII-only text is stored and flagged as ASCII.
    ascii_only = all(part.isascii() for part in parts)
    maxchar = 0x7F if ascii_only else {1: 0xFF, 2: 0xFFFF, 4: 0x10FFFF}[kind]
    total = sum(map(len, parts))
    try:
        import ctypes

        new = ctypes.pythonapi.PyUnicode_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_ssize_t, ctypes.c_uint32]
        text = new(total, maxchar)
        if not total or _str_kind(text) != kind:
            return "".join(parts)
        data = id(text) + sys.getsizeof(text) - (total + 1) * kind  # the characters end the object
    except Exception:
        return "".join(parts)
    _advise_huge_pages(data, total * kind)
    offset = 0
    for part in parts:
        raw = part.encode(_WIDEN[kind], "surrogatepass")
        ctypes.memmove(data + offset, raw, len(raw))
        offset += len(raw)
        del raw
    return text


def _ascii_str_in_place(source: ContextSource, pos: int, size: int) -> str | None:
    """A fresh ASCII str whose character buffer the bytes are read straight into.

    UTF-8 of pure ASCII is the str's own storage, so this skips the second copy a decode needs.
    The str is filled before any other code can see it. Returns None where ctypes is unavailable.
    """
    try:
        import ctypes

        new = ctypes.pythonapi.PyUnicode_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_ssize_t, ctypes.c_uint32]
        text = new(size, 127)
        header = sys.getsizeof("") - 1  # a compact ASCII str's data follows its header
        storage = (ctypes.c_char * size).from_address(id(text) + header)
    except Exception:
        return None
    _advise_huge_pages(id(text) + header, size)  # before the first touch: faults take 2 MiB pages
    with memoryview(storage).cast("B") as target:
        source.read_into(target, pos)
    return text


_HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14


def _advise_huge_pages(addr: int, length: int) -> None:
    """Ask for transparent huge pages over a large context piece (Linux; ignored elsewhere).

    With THP in "madvise" mode (the common default) a 1 GB str otherwise sits in 262,144 4 KiB
    pages, and every fork snapshot copies that many page-table entries (about 18 ms per GB measured
    here); in 2 MiB pages the fork costs well under a millisecond, and filling the str takes 512
    page faults instead of 262,144. CPython allocates a str this large with mmap via malloc, so the
    range is anonymous private memory that the advice applies to.
    """
    start = (addr + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (addr + length) // _HUGE_PAGE * _HUGE_PAGE
    if end - start < _HUGE_PAGE or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: an error changes nothing
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------------------------
# Hardening: the one place. The lockdown itself lives in hardening.py next to this file.

HARDENING_FILE = "hardening.py"


def harden(config: dict[str, Any]) -> dict[str, Any]:
    """Lock the process down before any generated code runs; returns what was applied.

    With `config["hardening"]` (a spec dict from the host) the worker applies rlimits,
    capabilities, Landlock and seccomp through hardening.py and reports what the kernel accepted.
    Without it only core dumps are turned off (a crash must not write the context to disk).
    Called while the process has one thread: Landlock (before ABI 8) binds only the calling thread.
    """
    if sys.flags.no_site:
        _site_builtins()
    spec = config.get("hardening")
    if isinstance(spec, dict):
        try:
            return dict(_hardening_module().apply(spec))
        except Exception as exc:  # never claim a lockdown that did not happen; say why instead
            applied = _no_core_dumps()
            applied.update(requested=True, error=f"{type(exc).__name__}: {exc}")
            applied["warnings"] = [
                f"hardening failed ({type(exc).__name__}: {exc}); the REPL is not confined"
            ]
            return applied
    return _no_core_dumps()


_loaded: dict[str, Any] = {}


def _hardening_module() -> Any:
    """hardening.py, loaded once (a zygote loads it before it forks workers)."""
    if HARDENING_FILE not in _loaded:
        path = os.path.join(_source_dir(), HARDENING_FILE)
        _loaded[HARDENING_FILE] = _load_by_path("recursa_sandbox_hardening", path)
    return _loaded[HARDENING_FILE]


def _site_builtins() -> None:
    """Started with -S (no site-packages, no .pth code at start): keep exit(), quit() and help()."""
    try:
        import site

        site.setquit()
        site.setcopyright()
        site.sethelper()
    except Exception:
        pass


def _no_core_dumps() -> dict[str, Any]:
    applied: dict[str, Any] = {"requested": False, "rlimits": {}}
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        applied["rlimits"]["core"] = 0
    except (ImportError, ValueError, OSError):
        pass
    return applied


def _source_dir() -> str:
    """The folder of worker.py, also when this process runs its cached bytecode (__pycache__)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(here) if os.path.basename(here) == "__pycache__" else here


def _load_by_path(name: str, path: str) -> Any:
    # By explicit path, never via sys.path: this folder holds a module named subprocess.py.
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------
# Snapshots: timeouts that keep state.
#
# While a cell runs, a forked copy of this process (a snapshot) waits, idle, holding the state from
# before the cell; copy-on-write makes the fork cost page tables, not pages. If the cell cannot be
# stopped with SIGINT (a C loop holding the GIL, code that swallows KeyboardInterrupt) or kills the
# process, the host tells the snapshot to take over: it kills the stuck worker and carries on in its
# place, on a fresh channel the host hands it, with every variable from before the cell.
#
# The snapshot only ever reads the control socket (SOCK_SEQPACKET, so a snapshot killed mid-read
# cannot leave half a message for the next one): the worker's channel may hold half a frame that the
# dead worker's reader had started on, so it is never reused. Messages name the snapshot they are
# for ("sid"), so one sent to a snapshot that was just discarded is ignored by its successor.
#
# A snapshot does not use PR_SET_PDEATHSIG while it waits: its parent is the worker, and the worker
# dying is exactly when it is needed. It dies with the host instead through the control socket,
# whose other end only the host holds: end-of-file there means the host is gone (or replaced this
# worker), and the snapshot then also kills the worker it belongs to, even one stuck in C code.
#
# A snapshot stays in the worker's process group (seccomp denies setpgid, so that nothing in the
# sandbox escapes the host's group kill): it kills the stuck worker by pid, and the host removes
# whatever else the killed cell had started.

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Get `sig` (SIGKILL: even if stuck in C code) when the parent exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _kill_own_group(*_args: object) -> None:
    """The keeper's end when the host is gone: SIGKILL its process group, itself included.

    The group holds the worker, its snapshots and whatever the cells forked; those last ask for no
    parent-death signal, and would otherwise outlive the host (seccomp keeps them in the group)."""
    if os.getpgrp() == os.getpid():
        try:
            os.killpg(os.getpid(), signal.SIGKILL)
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)  # not a group leader: the others die with their parents


_PR_SET_CHILD_SUBREAPER = 36


def _split_off_keeper(channel_fd: int) -> None:
    """Fork; the parent stays behind as the keeper and never returns, the child is the worker.

    A snapshot that takes over outlives the worker that forked it, so something other than the
    worker must stay put: its parent. The keeper is a child subreaper, so orphans (a snapshot whose
    worker was killed, whatever the cell forked) become its children and are reaped here, never
    left as zombies of an init that may not reap; and under bwrap, which ends the whole namespace
    when its first process exits, the keeper is that first process. It exits once the last
    process below it is gone, and dies with the host (PR_SET_PDEATHSIG), taking everything along:
    every worker and snapshot below it asks to die with its parent too.
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        return  # no subreaper: run as a plain worker (a takeover then leaves an orphan to init)
    keeper = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with_parent()
        if os.getppid() != keeper:
            os._exit(0)
        return
    os.close(channel_fd)  # only the worker speaks to the host
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a group-wide Ctrl-C is for the worker
    # The keeper only waits, so it can take the host's death as a signal it handles (SIGTERM, not
    # the SIGKILL it asked for in main()) and take the whole group along.
    host = os.getppid()
    signal.signal(signal.SIGTERM, _kill_own_group)
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != host:
        _kill_own_group()  # the host died before the new request took effect
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if os.WIFSIGNALED(status):
            try:
                how = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
            except ValueError:
                how = f"killed by signal {os.WTERMSIG(status)}"
        else:
            how = f"exit code {os.waitstatus_to_exitcode(status)}"
        # For the host's crash report: it cannot wait for a process that is not its child.
        os.write(2, f"[recursa keeper] process {pid} ended: {how}\n".encode())


class Snapshots:
    """The snapshot of this worker that is ready to take over, if any."""

    def __init__(self) -> None:
        self.control: socket.socket | None = None  # from the host's `standby` frame
        self.pid = 0  # the waiting snapshot, 0 if none
        self._sids = itertools.count(1)

    @property
    def armed(self) -> bool:
        return self.control is not None

    def arm(self, fd: int) -> None:
        if fd < 0:
            return
        os.set_inheritable(fd, False)
        if self.control is not None:
            self.control.close()
        self.control = socket.socket(fileno=fd)

    def alive(self) -> bool:
        """False once the waiting snapshot has died (the host's process guard may kill it)."""
        if not self.pid:
            return False
        try:
            done, _status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            done = self.pid
        if done:
            self.pid = 0
        return not done

    def discard(self) -> None:
        pid, self.pid = self.pid, 0
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def take(self, chan: WorkerChannel) -> tuple[SocketTransport, dict[str, Any]] | None:
        """Replace the waiting snapshot with a fresh one of the current state.

        Returns None in this process. In the snapshot, returns only once it has been told to take
        over: with its new channel and the facts for the `restored` frame.
        Call from the main thread between requests, when no frame is half sent by it.
        """
        self.discard()
        sid = next(self._sids)
        parent = os.getpid()
        threads = max(0, threading.active_count() - 2)  # besides this thread and the channel reader
        rand = sys.modules.get("random")  # random reseeds itself in a forked child; keep its state
        rand_state = rand.getstate() if rand is not None else None
        try:
            pid = os.fork()
        except OSError as exc:
            chan.send({"op": "snapshot", "ok": False, "error": f"fork failed: {exc}"})
            return None
        if pid:
            self.pid = pid
            chan.send({"op": "snapshot", "ok": True, "sid": sid, "pid": pid})
            return None
        try:  # the snapshot: only this thread exists here; the channel's locks are left behind
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            chan.close_copy()
            fds = self._wait(parent, sid)
            transport, info = self._take_over(parent, fds)
            if rand is not None and rand_state is not None:
                rand.setstate(rand_state)
            info.update(op="restored", sid=sid, threads_lost=threads)
            return transport, info
        except BaseException:
            os._exit(1)

    def _wait(self, parent: int, sid: int) -> list[int]:
        """Block until the host says take over; act on interrupts meanwhile; exit when it is gone."""
        assert self.control is not None
        while True:
            data, fds, _flags, _addr = socket.recv_fds(self.control, 65536, 4)
            if not data:
                if os.getppid() == parent:
                    os.kill(parent, signal.SIGKILL)
                os._exit(0)
            try:
                msg = decode_frame(data)
            except ValueError:
                msg = {}
            op = msg.get("op")
            if msg.get("sid") == sid and op == "takeover" and len(fds) == 2:
                return fds
            for fd in fds:
                os.close(fd)
            if msg.get("sid") == sid and op == "interrupt" and os.getppid() == parent:
                try:
                    os.kill(parent, signal.SIGINT)  # in-band: for hosts that cannot see our pids
                except OSError:
                    pass  # refused (seccomp without Landlock signal scoping): the host falls back

    def _take_over(self, parent: int, fds: list[int]) -> tuple[SocketTransport, dict[str, Any]]:
        if os.getppid() == parent:  # else it already died on its own
            os.kill(parent, signal.SIGKILL)  # refused (PermissionError) is fatal: the host falls back
        deadline = time.monotonic() + 5.0
        while os.getppid() == parent and time.monotonic() < deadline:  # reparented once it is gone
            time.sleep(0.0005)
        gone = os.getppid() != parent
        _die_with_parent()  # our new parent: the pid namespace's init under bwrap, else a reaper
        for fd in fds:
            os.set_inheritable(fd, False)
        assert self.control is not None
        self.control.close()
        self.control = socket.socket(fileno=fds[1])
        info = {"pid": os.getpid(), "pgid": os.getpgid(0), "old_worker_gone": gone}
        return SocketTransport(socket.socket(fileno=fds[0])), info


# ----------------------------------------------------------------------------------------------
# Main loop.


class Server:
    """Runs requests on the main thread (so SIGINT interrupts user code) and keeps snapshots ready."""

    def __init__(self, transport: SocketTransport | StdioTransport, *, lines: bool = False) -> None:
        self.repl = Repl(self._call)
        self.snapshots = Snapshots()
        self.chan = self._connect(WorkerChannel(transport, lines=lines))

    def _call(self, fn: str, args: dict[str, Any]) -> Any:
        return self.chan.call(fn, args)  # through the current channel, which a takeover replaces

    def _connect(self, chan: WorkerChannel) -> WorkerChannel:
        chan.may_interrupt = lambda: self.repl.interruptible
        chan.on_eof = self._on_eof
        return chan

    def _on_eof(self) -> None:
        pid = self.snapshots.pid
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if not self.repl.interruptible:
            return  # a late SIGINT (the cell already finished) must not break the worker
        if self.chan.main_sending:
            self.chan.interrupt_pending = True
            return
        raise KeyboardInterrupt

    def run(self, config: dict[str, Any]) -> None:
        hardening = harden(config)
        ready = {
            "op": "ready",
            "pid": os.getpid(),
            "ppid": os.getppid(),  # the keeper, when there is one
            "python": sys.version.split()[0],
            "hardening": hardening,
        }
        self.chan.send(ready)
        self.chan.start_reader()
        while True:
            if signal.getsignal(signal.SIGINT) != self._on_sigint:  # code may have replaced it
                signal.signal(signal.SIGINT, self._on_sigint)
            msg = self.chan.inbox.get()
            op = msg.get("op")
            if op == "shutdown":
                break
            if op == "standby":
                self.snapshots.arm(int(msg.get("_fd", -1)))
                if self.snapshots.armed:
                    self._snapshot()
                continue
            if op == "exec" and self.snapshots.armed and not self.snapshots.alive():
                if self._snapshot():
                    continue  # this process is a snapshot that took over: that cell was not ours
            elif op == "load_context":
                self.snapshots.discard()  # its state is about to be out of date
            try:
                reply = _handle(self.repl, msg)
            except Exception as exc:  # a worker bug must answer, not leave the host waiting
                reply = _internal_error(msg, exc)
            if reply is not None:
                self.chan.send(reply)
            if op in ("exec", "load_context") and self.snapshots.armed:
                # Snapshot the state after this cell now, while the host reads the result and asks
                # its model: the next cell then starts without paying for the fork.
                self._snapshot()
        self.snapshots.discard()
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown: user threads must not keep the process alive

    def _snapshot(self) -> bool:
        """Take a fresh snapshot; True if this process is a snapshot that has since taken over."""
        took_over = False
        while True:
            taken = self.snapshots.take(self.chan)
            if taken is None:
                return took_over
            took_over = True
            transport, info = taken
            self.chan = self._connect(WorkerChannel(transport))
            self.chan.send(info)
            self.chan.start_reader()
            # Loop: this process is the worker now, and it needs a snapshot of its own.


def serve(
    transport: SocketTransport | StdioTransport, config: dict[str, Any], *, lines: bool = False
) -> None:
    import faulthandler

    faulthandler.enable()  # a segfault leaves a Python traceback in the worker log
    Server(transport, lines=lines).run(config)


def _handle(repl: Repl, msg: dict[str, Any]) -> dict[str, Any] | None:
    op, mid = msg.get("op"), msg.get("id")
    if op == "exec":
        res = repl.execute(str(msg.get("code", "")), int(msg.get("max_output_chars", 20_000)))
        return {"op": "exec_done", "id": mid, **res}
    if op == "get_var":
        return {"op": "var", "id": mid, **repl.get_var(str(msg.get("name", "")))}
    if op == "list_vars":
        return {"op": "vars", "id": mid, "names": repl.user_variables()}
    if op == "define":
        return {"op": "defined", "id": mid, **repl.define(list(msg.get("entries", [])))}
    if op == "load_context":
        transfer = msg.get("transfer")
        if transfer == "inline":
            source = ContextSource(buffer=msg.get("_buffer"))
        elif transfer == "path":
            source = ContextSource(fd=os.open(str(msg.get("path")), os.O_RDONLY | os.O_CLOEXEC))
        else:
            source = ContextSource(fd=int(msg["_fd"]), release=bool(msg.get("release")))
        try:
            info = repl.load_context(
                str(msg.get("kind")),
                source,
                list(msg.get("byte_lengths", [])),
                list(msg.get("char_lengths", [])),
                list(msg.get("keys", [])),
            )
        finally:
            source.close()
        return {"op": "context_loaded", "id": mid, **info}
    return None


def _internal_error(msg: dict[str, Any], exc: Exception) -> dict[str, Any] | None:
    text = f"internal worker error: {type(exc).__name__}: {exc}"
    op, mid = msg.get("op"), msg.get("id")
    if op == "exec":
        return {
            "op": "exec_done",
            "id": mid,
            "stdout": "",
            "stderr": text,
            "omitted_chars": 0,
            "error": text,
            "final": None,
            "restored_names": [],
            "notes": [],
            "duration_s": 0.0,
        }
    if op == "get_var":
        return {"op": "var", "id": mid, "found": False, "final": None, "error": text}
    if op == "list_vars":
        return {"op": "vars", "id": mid, "names": [], "error": text}
    if op == "define":
        return {"op": "defined", "id": mid, "errors": [text]}
    if op == "load_context":
        return {"op": "context_loaded", "id": mid, "error": text}
    return None


_USAGE = "usage: worker.py (--fd N | --stdio [--lines] | --zygote N) [--config JSON]"


def parse_args(argv: list[str]) -> tuple[int | None, dict[str, Any]]:
    """(--fd value or None for --stdio, config). Hand-rolled: argparse costs milliseconds at startup.

    --lines (with --stdio) is reported in the config as "_lines": True; --zygote N (N: a control
    socket, see zygote.py) as the fd N and "_zygote": True.
    """
    fd: int | None = None
    stdio = lines = zygote = False
    config: Any = {}
    args = iter(argv)
    for arg in args:
        if arg in ("--fd", "--zygote"):
            if fd is not None:
                raise SystemExit(f"give one of --fd and --zygote; {_USAGE}")
            fd = int(next(args, "-1"))
            zygote = arg == "--zygote"
        elif arg == "--stdio":
            stdio = True
        elif arg == "--lines":
            lines = True
        elif arg == "--config":
            config = json.loads(next(args, "{}"))
        else:
            raise SystemExit(f"unknown argument {arg!r}; {_USAGE}")
    if stdio == (fd is not None) or (fd is not None and fd < 0):
        raise SystemExit(f"give exactly one of --fd N, --zygote N and --stdio; {_USAGE}")
    if not isinstance(config, dict):
        raise SystemExit("--config must be a JSON object")
    if lines:
        if not stdio:
            raise SystemExit(f"--lines goes with --stdio; {_USAGE}")
        config["_lines"] = True
    if zygote:
        config["_zygote"] = True
    return fd, config


ZYGOTE_FILE = "zygote.py"


def main(argv: list[str] | None = None) -> None:
    fd, config = parse_args(sys.argv[1:] if argv is None else argv)
    lines = bool(config.pop("_lines", False))
    parent = os.getppid()
    _die_with_parent()  # a worker stuck in C code would otherwise outlive a host that was killed
    if os.getppid() != parent:
        os._exit(0)  # the parent died before the request took effect
    if config.pop("_zygote", False) and fd is not None:
        _preload()
        zygote = _load_by_path("recursa_sandbox_zygote", os.path.join(_source_dir(), ZYGOTE_FILE))
        zygote.serve(fd, _start, _prepare, _hardening_module().drop_all_capabilities)
    if fd is None:
        # Keep private copies of the pipes, then point fds 0/1 away from them so stray writes to
        # fd 1 (a C extension, a child process) cannot corrupt the frame stream.
        rfd, wfd = os.dup(0), os.dup(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
        serve(StdioTransport(rfd, wfd), config, lines=lines)
    else:
        _start(fd, config)


def _start(fd: int, config: dict[str, Any]) -> NoReturn:
    """Serve the host on the socket `fd`: a worker started afresh, or one a zygote just forked."""
    if config.pop("keeper", False):
        _split_off_keeper(fd)
    os.set_inheritable(fd, False)  # children of generated code must not hold the channel
    serve(SocketTransport(socket.socket(fileno=fd)), config)
    os._exit(0)


def _prepare(config: dict[str, Any]) -> None:
    """In a zygote, before it forks a worker with `config`: the hardening work every such worker
    would repeat (the Landlock rule walk, the seccomp program), done once for all of them."""
    spec = config.get("hardening")
    if isinstance(spec, dict):
        _hardening_module().prepare(spec)


def _preload() -> None:
    """What a worker otherwise imports on its first cell or while hardening: a zygote does it once
    for all the workers it forks."""
    import ast  # noqa: F401
    import faulthandler  # noqa: F401
    import importlib.util  # noqa: F401
    import resource  # noqa: F401
    import site  # noqa: F401
    import traceback  # noqa: F401

    _hardening_module()


if __name__ == "__main__":
    main()
