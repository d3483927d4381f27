"""`recursa chat`: several questions over one context from the command line, one session for all.

Questions come from stdin one per line (with a "> " prompt on a terminal). Each answer goes to
stdout and a short status line to stderr; a question that fails says why and the chat goes on.
The chat ends at end of input, at "exit" or "quit", or at Ctrl-C, and then names its trace file.

The session runs on an `asyncio.Runner` driven from the main thread: the loop runs while a question
is being answered and waits, idle, while the user types. Ctrl-C therefore arrives in the main
thread either way (at the prompt, or through the runner, which cancels the question), and closing
the runner cancels and awaits every task the session left behind, so nothing leaks at exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import IO, Any

from recursa.errors import RecursaError
from recursa.result import RLMResult
from recursa.rlm import RLM
from recursa.session import Session
from recursa.terminal import for_terminal

EXIT_WORDS = ("exit", "quit")
_ANSWERED = ("final", "max_iterations")


def skipped_note(skipped: list[str]) -> str:
    """The files of a context folder that were left out, and why, for stderr."""
    # File names are anyone's: escape control characters before they reach a terminal.
    shown = [s if s.isprintable() else s.encode("unicode_escape").decode("ascii") for s in skipped[:10]]
    more = f"; and {len(skipped) - 10} more" if len(skipped) > 10 else ""
    return f"left out of the context folder: {'; '.join(shown)}{more}"


def status_line(result: RLMResult) -> str:
    u = result.usage
    return (
        f"[{result.stop_reason}] {result.iterations} turns · {u.llm_calls} LM calls · "
        f"{u.input_tokens + u.output_tokens:,} tokens · ${u.cost_usd:.4f}"
    )


def read_questions(stdin: IO[str], interactive: bool) -> Iterator[str]:
    """Non-blank lines, stripped, until end of input or an exit word."""
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stdout)  # Ctrl-D leaves the cursor after the prompt
                return
        else:
            line = stdin.readline()
            if not line:
                return
        question = line.strip()
        if not question:
            continue
        if question.lower() in EXIT_WORDS:
            return
        yield question


class Chat:
    """One chat over one context. `run()` returns the process exit code."""

    def __init__(
        self,
        rlm: RLM,
        context: Path,
        *,
        as_json: bool = False,
        progress: AbstractContextManager[Any] | None = None,
        stdin: IO[str] | None = None,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
    ) -> None:
        self.rlm = rlm
        self.context = context
        self.as_json = as_json
        self.progress = progress
        self.stdin = stdin or sys.stdin
        self.out = stdout or sys.stdout
        self.err = stderr or sys.stderr
        self.interactive = self.stdin.isatty() and self.stdin is sys.stdin
        self.asked = 0

    def run(self) -> int:
        session = self.rlm.session(self.context)
        if self.interactive:
            _line_editing()
            self._note(
                f"recursa chat: {self.rlm.config.model} over {self.context}. Ask a question per line; "
                "'exit', Ctrl-D or Ctrl-C ends the chat."
            )
        code = 0
        with asyncio.Runner() as runner:
            try:
                # Load the context before the first prompt: a bad one is reported before anyone types.
                runner.run(session.astart())
            except RecursaError as exc:
                self._note(f"recursa: error: {exc}")
                self._close(runner, session)
                return 2
            try:
                for question in read_questions(self.stdin, self.interactive):
                    self._answer(runner, session, question)
            except KeyboardInterrupt:
                if self.interactive:
                    print(file=self.out)  # the cursor may still be after the prompt
                self._note("recursa: interrupted")
                code = 130
            finally:
                self._close(runner, session)
        return code

    def _answer(self, runner: asyncio.Runner, session: Session, question: str) -> None:
        """Ask one question and show the outcome; a failure is reported and the chat goes on."""
        self.asked += 1
        try:
            with self.progress if self.progress is not None else nullcontext():
                result = runner.run(session.aask(question))
        except RecursaError as exc:
            self._failed(question, f"recursa: this question failed: {exc}. Ask another, or 'exit'.")
            return
        except Exception as exc:  # no traceback reaches a CLI user; RECURSA_DEBUG=1 shows it
            if os.environ.get("RECURSA_DEBUG"):
                raise
            self._failed(
                question,
                f"recursa: internal error ({type(exc).__name__}): {str(exc).rstrip('.')}. "
                "Re-run with RECURSA_DEBUG=1 for details and report it.",
            )
            return
        self._show(question, result)

    def _show(self, question: str, result: RLMResult) -> None:
        if self.as_json:
            self._print({"question": question, **result.to_dict()})
            return
        if result.answer:
            self._print(result.answer)
        if self.asked == 1 and result.skipped_files:  # the context is loaded once, with the first
            self._note(skipped_note(result.skipped_files))
        self._note(status_line(result))
        if result.stop_reason not in _ANSWERED:
            why = result.error or "no reason given"
            what = "a partial answer is above" if result.answer else "no answer"
            self._note(f"recursa: this question stopped early ({why}); {what}. Ask another, or 'exit'.")

    def _failed(self, question: str, message: str) -> None:
        if self.as_json:
            self._print({"question": question, "answer": "", "stop_reason": "error", "error": message})
        self._note(message)

    def _close(self, runner: asyncio.Runner, session: Session) -> None:
        try:
            runner.run(session.aclose())
        except KeyboardInterrupt:
            # A second Ctrl-C while closing: the runner's own close still cancels what is left.
            pass
        except Exception as exc:
            self._note(f"recursa: warning: closing the session failed ({type(exc).__name__}: {exc})")
        if session.trace_path is not None:
            n = len(session.results)
            self._note(f"chat over after {n} question{'s' if n != 1 else ''} · trace: {session.trace_path}")
        elif not self.asked:
            self._note("no questions asked")

    def _print(self, value: Any) -> None:
        text = for_terminal(value, self.out) if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        print(text, file=self.out, flush=True)

    def _note(self, text: str) -> None:
        print(text, file=self.err, flush=True)


def _line_editing() -> None:
    # Importing readline gives input() history and cursor keys; it is missing on some platforms.
    try:
        import readline  # noqa: F401
    except ImportError:
        pass
