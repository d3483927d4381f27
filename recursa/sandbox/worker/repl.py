"""The REPL: a persistent namespace that runs the model's code like notebook cells."""

from __future__ import annotations

import builtins
import sys
import time
import weakref
from collections.abc import Callable

from .capture import Capture
from .context import ContextSource, decode_pieces
from .errors import BudgetExceeded, RemoteError, SubcallError, ToolError, error_for
from .images import batch_images_arg, images_arg
from .prose import answer_annotations, final_hint, mend, prose_answer
from .values import describe_size, final_payload, one_answer, render, render_repr

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_REPL_FILE = "<repl>"


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
        self._answer_is_users = False  # the code bound `answer` to a value of its own (see _restore_reserved)
        self._tool_ns: dict[str, Any] | None = None  # globals of sandbox tools, made on first use
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self._reserved = self._make_reserved()
        self.ns.update(self._reserved)
        # Other spellings of FINAL / FINAL_VAR that models write (final(42), Final_Var("x")). Not
        # reserved: code that binds one of these names keeps its own value, and they are not listed
        # among the user's variables while they hold the alias.
        answer, by_name = self._reserved["FINAL"], self._reserved["FINAL_VAR"]
        self._aliases: dict[str, Any] = {
            **dict.fromkeys(("final", "Final", "FINAL_ANSWER", "final_answer", "Final_Answer"), answer),
            **dict.fromkeys(("final_var", "Final_var", "Final_Var"), by_name),
        }
        self.ns.update(self._aliases)

    # -- the names generated code sees -----------------------------------------------------------

    def _make_reserved(self) -> dict[str, Any]:
        call = self._call

        def llm_query(prompt: str, model: str | None = None, images: Any = None) -> str:
            """Ask a sub-model one question, optionally about images (bytes, names of the context's
            image files, or https URLs); returns its reply text."""
            if not isinstance(prompt, str):
                raise TypeError(
                    f"llm_query expects one str prompt, got {type(prompt).__name__}; "
                    "for many prompts use llm_query_batched(prompts)"
                )
            args = {"prompt": prompt, "model": model}
            if images is not None:
                args["images"] = images_arg(images)
            return str(call("llm_query", args))

        def llm_query_batched(prompts: list[str], model: str | None = None, images: Any = None) -> list[str]:
            """Ask a sub-model many questions at once (they run in parallel); replies in order.
            `images[i]` goes with prompts[i]: one image, a list of images, or None."""
            prompts = _str_list(prompts, "llm_query_batched", "prompts")
            args: dict[str, Any] = {"prompts": prompts, "model": model}
            if images is not None:
                args["images"], args["image_data"] = batch_images_arg(images, len(prompts))
            return self._batch_results("llm_query_batched", call("llm_query_batched", args))

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

        def FINAL(*args: Any, **kwargs: Any) -> None:
            """Hand back one value as the final answer (the last call in a cell wins)."""
            self._final = final_payload(one_answer("FINAL", args, kwargs), "FINAL")

        def FINAL_VAR(*args: Any, **kwargs: Any) -> None:
            """Hand back the value of the variable called `name` (a str) as the final answer."""
            self._final = self._final_var(one_answer("FINAL_VAR", args, kwargs))

        def SHOW_VARS() -> None:
            """Print the variables you defined, with their types and sizes."""
            names = self.user_variables()
            if not names:
                self._write_out("No variables defined yet.\n")
                return
            lines = [f"  {n}: {type(self.ns[n]).__name__}{describe_size(self.ns[n])}" for n in names]
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
                return final_payload(self._named_value(key), "FINAL_VAR", key)
        if name is self._answer:  # FINAL_VAR(answer) with the answer dict: what it holds
            return final_payload(self._answer.get("content"), "FINAL_VAR", "answer")
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
        # `type(n) is str` first: code may key globals() with an object of its own, whose methods
        # (startswith, __lt__) would run here, outside any cell's timeout.
        return sorted(
            n
            for n, v in self.ns.items()
            if type(n) is str
            and not n.startswith("_")
            and (n not in self._reserved or (n == "answer" and v is not self._answer))
            and v is not self._aliases.get(n, _MISSING)
            and type(v) is not type(sys)
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

        try:
            tree = ast.parse(code, _REPL_FILE, "exec")
        except SyntaxError:
            # FINAL(The answer is 42) is not Python: read as text where that makes the cell compile.
            code, notes = mend(code, self._is_answer_call)
            if not notes:
                raise
            self._notes.extend(notes)
            tree = ast.parse(code, _REPL_FILE, "exec")
        self._notes.extend(answer_annotations(tree, self._is_answer_call))
        statements = list(tree.body)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        lines = code.splitlines()
        body = None  # a cell of one expression (`print(x)`) has no statements before it to compile
        if tree.body:
            body = compile(tree, _REPL_FILE, "exec", dont_inherit=True)  # no __future__ from this file
            self._remember(body, lines)
        expr = None
        if last is not None:
            expr = compile(ast.Expression(last.value), _REPL_FILE, "eval", dont_inherit=True)
            self._remember(expr, lines)
        self.interruptible = True
        try:
            if body is not None:
                exec(body, self.ns)
            result = eval(expr, self.ns) if expr is not None else None
        except NameError as exc:
            tree.body = statements
            cell = tuple(c for c in (body, expr) if c is not None)
            taken = prose_answer(exc, tree, code, cell, self._is_answer_call)
            if taken is None:
                hint = final_hint(exc, tree, cell)
                if hint is not None:
                    self._notes.append(hint)
                raise
            text, note = taken
            self._final = final_payload(text, "FINAL")
            self._notes.append(note)
            result = None
        finally:
            self.interruptible = False
        if result is not None:
            cap.out.write(render_repr(result) + "\n")

    def _is_answer_call(self, name: str) -> bool:
        """Whether `name` in a cell still means FINAL / FINAL_VAR (the code may have rebound it)."""
        value = self.ns.get(name, _MISSING)
        return value is not _MISSING and (
            value is self._reserved.get(name) or value is self._aliases.get(name)
        )

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
        current_answer = self.ns.get("answer", _MISSING)
        if current_answer is not self._answer and current_answer is not _MISSING:
            if isinstance(current_answer, dict) and (
                "content" in current_answer or "ready" in current_answer
            ):
                # `answer = {"content": ..., "ready": True}` is a fair way to answer: adopt, don't scold.
                self._answer.clear()
                self._answer.update(current_answer)
                self.ns["answer"] = self._answer
            elif not self._answer_is_users:
                # `answer = 42` (the paper's own prompt writes `answer = llm_query(...)`): the model's
                # variable, kept as it is and returned by FINAL_VAR("answer"). The dict protocol is
                # set aside until the name is free again (`del answer`).
                self._answer_is_users = True
                self._notes.append(
                    '`answer` now holds your own value, kept as it is: FINAL_VAR("answer") returns it. '
                    "(The answer dict protocol is off until you `del answer`.)"
                )
        if current_answer is _MISSING or current_answer is self._answer:
            self._answer_is_users = False
        for name, value in self._aliases.items():
            self.ns.setdefault(name, value)  # quietly back once the code has freed the name (`del final`)
        for name, value in self._reserved.items():
            if name == "answer" and self._answer_is_users:
                continue
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
        try:
            final = final_payload(ans.get("content"), 'answer["content"]')
        except TypeError as exc:
            self._notes.append(f"{exc}. It was not taken as the answer.")
            ans["ready"] = False
            return None
        final["protocol"] = "answer"
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
        try:
            return {"found": True, "final": final_payload(self._named_value(key), "FINAL_VAR", key)}
        except TypeError as exc:
            return {"found": True, "final": None, "error": str(exc)}

    def _named_value(self, key: str) -> Any:
        """What FINAL_VAR(key) answers with: for the answer dict itself, what it holds, not the dict."""
        value = self.ns[key]
        return value.get("content") if key == "answer" and value is self._answer else value

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
