"""The `recursa` command. Every failure becomes a one-line message and a non-zero exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recursa.cli_options import (
    HelpFormatter,
    add_model_options,
    add_setting_flag,
    check_context,
    run_kwargs,
)
from recursa.config import METHOD_OWNED, METHOD_SETTINGS
from recursa.errors import ConfigError, RecursaError
from recursa.extras import install_hint
from recursa.terminal import for_terminal
from recursa.trace.redact import redact
from recursa.version import __version__

if TYPE_CHECKING:
    from recursa.rlm import RLM

# The run settings `recursa demo` takes as flags besides its models.
_DEMO_SETTINGS = ("sandbox", "dialect", "trace_dir")

# The task families `recursa demo` can generate (recursa.tasks.families(), listed here so that
# `recursa --help` does not import the task generators).
DEMO_FAMILIES = (
    "codeqa",
    "evidence-spans",
    "multihop-docs",
    "niah",
    "oolong",
    "oolong-pairs",
    "verbatim-copy",
)


class _Progress:
    """A one-line live status on stderr: turn, calls, tokens, dollars. Silent when not a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._status: Any = None
        self._reset()

    def _reset(self) -> None:
        self.turns = 0
        self.calls = 0
        self.tokens = 0
        self.usd = 0.0
        self.children = 0
        self.root: dict[str, dict[str, Any]] = {}  # the root run's run_start and run_end events

    def __enter__(self) -> _Progress:
        # Entered once per question by `recursa chat`, so each question counts from zero.
        self._reset()
        if self.enabled:
            from rich.console import Console

            self._status = Console(stderr=True).status("starting")
            self._status.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.__exit__(None, None, None)
            self._status = None

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "turn" and event.get("run_id") and not self.children:
            self.turns = event["turn"]
        elif kind == "lm_call" and "usage" in event:
            self.calls += 1
            self.tokens += event["usage"]["input_tokens"] + event["usage"]["output_tokens"]
            self.usd += event["usage"]["cost_usd"]
        elif kind == "run_start" and event.get("depth", 0) > 0:
            self.children += 1
        if kind in ("run_start", "run_end") and event.get("depth", 0) == 0:
            self.root[kind] = event  # what an interrupted `recursa run` reports
        if self._status is not None:
            self._status.update(
                f"turn {self.turns} · {self.calls} LM calls · {self.tokens:,} tokens · ${self.usd:.4f}"
                + (f" · {self.children} child runs" if self.children else "")
            )


def _positive_int(text: str) -> int:
    """argparse's `type=` for a count such as `demo --size`; argparse names the flag in the error."""
    try:
        value = int(text.replace("_", ""), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give one such as 200000") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small: give a whole number of at least 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recursa",
        description="Recursive Language Models: answer questions over contexts far larger than any model "
        "window. Start offline with `recursa demo`, or `recursa run QUESTION --context FILE --model "
        "scripted/gpt5-like`; `recursa models` lists the models and the environment variables read.",
    )
    parser.add_argument("--version", action="version", version=f"recursa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="answer a question over a context file or folder", formatter_class=HelpFormatter
    )
    run.add_argument("question", help="the question to answer over the context, in quotes")
    run.add_argument(
        "--context",
        required=True,
        help="a text file, a folder of text files (read recursively; undecodable and binary files are "
        "left out and listed), or - for stdin",
    )
    add_model_options(run)
    run.add_argument("--json", action="store_true", help="print the result as one JSON object")

    chat = sub.add_parser(
        "chat",
        help="ask several questions over one context, one per line (a session)",
        description="Questions from stdin, one per line, over one context in one REPL (variables and "
        "earlier answers carry over). Budget caps apply to each question. Ends at end of input, "
        "'exit', 'quit' or Ctrl-C.",
    )
    chat.add_argument("--context", required=True, help="a text file or a folder of text files")
    add_model_options(chat)
    chat.add_argument("--json", action="store_true", help="print each result as one JSON line")

    demo = sub.add_parser(
        "demo",
        help="an offline end-to-end run with a scripted model (no key needed)",
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--family", default="oolong", choices=DEMO_FAMILIES, help="the task family to generate")
    demo.add_argument("--size", type=_positive_int, default=1_200_000, help="context size in characters")
    demo.add_argument("--seed", type=int, default=7, help="seed of the generated task")
    demo.add_argument(
        "--model", default="scripted/gpt5-like", help="root model (`recursa models` lists them)"
    )
    demo.add_argument("--sub-model", default="scripted/oracle", help="model behind llm_query")
    for name in _DEMO_SETTINGS:  # as every command that starts runs has them
        add_setting_flag(demo, name)
    demo.add_argument("--json", action="store_true", help="print the report as one JSON object")

    models = sub.add_parser(
        "models",
        help="the model providers, the offline scripted models and the environment variables read",
        formatter_class=HelpFormatter,
    )
    models.add_argument("--json", action="store_true", help="print the listing as one JSON object")

    _add_bench_parser(sub)

    # Listed for --help only: main() hands `fake-server ...` to the fake server's own parser.
    sub.add_parser(
        "fake-server", help="a local fake OpenAI/Anthropic-compatible model server", add_help=False
    )

    from recursa.train.cli import add_export_parser

    add_export_parser(sub)

    from recursa.serve.commands import add_parsers as add_serving_parsers

    add_serving_parsers(sub, add_model_options)  # serve, mcp, view

    from recursa.integrations.openenv_cli import add_parser as add_openenv_parser

    add_openenv_parser(sub, add_model_options)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's help, nested ones (`export sft`) included, ends each option with its default."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for command in getattr(action, "choices", {}).values():
            command.formatter_class = HelpFormatter
            _show_defaults(command)


def _rlm_from_args(args: argparse.Namespace, on_event: Callable[[dict[str, Any]], None]) -> RLM:
    """The RLM that the options of `add_model_options` describe, every setting checked once and a
    bad one named as its flag."""
    from recursa import RLM
    from recursa.config import Spelling

    settings = {"model": args.model, **run_kwargs(args), "on_event": on_event}
    return RLM.configured(settings, Spelling("cli"))


def _cmd_run(args: argparse.Namespace) -> int:
    context: Any = "-" if args.context == "-" else check_context(args.context)
    progress = _Progress(not args.json)
    rlm = _rlm_from_args(args, progress)  # every setting checked before stdin is read
    if context == "-":
        context = sys.stdin.read()
    with progress:
        try:
            result = rlm.run(args.question, context)
        except KeyboardInterrupt:
            result = None
    if result is None:
        return _report_interrupted(args, progress)
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        print(for_terminal(result.answer, sys.stdout))
        u = result.usage
        print(
            f"\n[{result.stop_reason}] {result.iterations} turns · {u.llm_calls} LM calls · "
            f"{u.input_tokens:,} in / {u.output_tokens:,} out tokens · ${u.cost_usd:.4f} · "
            f"trace: {result.trace_path}",
            file=sys.stderr,
        )
        if result.error:
            print(for_terminal(f"stopped early: {result.error}", sys.stderr), file=sys.stderr)
        if result.skipped_files:
            from recursa.cli_chat import skipped_note

            print(skipped_note(result.skipped_files), file=sys.stderr)
    return 0 if result.stop_reason in ("final", "max_iterations") else 3


def _report_interrupted(args: argparse.Namespace, progress: _Progress) -> int:
    """Ctrl-C during `recursa run`. By now the run is cancelled: its REPL processes are gone and
    its trace ends with run_end. Say what it had done, any partial answer, and where the trace is."""
    from recursa.trace.writer import default_trace_dir

    start, end = progress.root.get("run_start"), progress.root.get("run_end", {})
    trace: Path | None = None
    if start is not None:
        folder = Path(args.trace_dir).expanduser() if args.trace_dir else default_trace_dir()
        trace = next(iter(folder.glob(f"*-{start['run_id']}.jsonl")), None)
    answer = end.get("answer") or ""
    usage = end.get("usage") or {}
    if args.json:
        summary = {
            "answer": answer,
            "stop_reason": "cancelled",
            "iterations": end.get("iterations", progress.turns),
            "usage": usage or None,
            "trace_path": str(trace) if trace else None,
            "run_id": start["run_id"] if start else None,
            "error": "interrupted (Ctrl-C)",
            "answer_protocol": end.get("answer_protocol"),
        }
        print(json.dumps(summary, ensure_ascii=False))
    elif start is not None:
        if answer:
            print(for_terminal(answer, sys.stdout))
        print(
            f"\n[cancelled] {end.get('iterations', progress.turns)} turns · "
            f"{usage.get('llm_calls', progress.calls)} LM calls · "
            f"${usage.get('cost_usd', progress.usd):.4f} · trace: {trace or 'not written'}",
            file=sys.stderr,
        )
    what = " (the answer above is partial)" if answer and not args.json else ""
    print(f"recursa: interrupted; the run was stopped{what}", file=sys.stderr)
    return 130


def _cmd_chat(args: argparse.Namespace) -> int:
    from recursa.cli_chat import Chat

    if args.context == "-":
        raise ConfigError(
            "recursa chat reads its questions from stdin, so the context cannot come from there too; "
            "save it to a file and pass --context FILE"
        )
    context = check_context(args.context)
    progress = _Progress(not args.json)
    return Chat(_rlm_from_args(args, progress), context, as_json=args.json, progress=progress).run()


def _cmd_demo(args: argparse.Namespace) -> int:
    from recursa import RLM
    from recursa.config import Spelling
    from recursa.demo import run_demo

    with _Progress(not args.json) as progress:
        settings = {name: getattr(args, name) for name in ("model", "sub_model", *_DEMO_SETTINGS)}
        rlm = RLM.configured(settings | {"on_event": progress}, Spelling("cli"))
        report = run_demo(rlm, args.family, args.size, args.seed)
    if args.json:
        print(json.dumps(report.to_dict(), ensure_ascii=False))
        return 0
    print(f"task:      {report.family}, {report.context_chars:,} characters of context")
    print(f"question:  {report.question}")
    print(f"answer:    {report.answer}")
    print(f"expected:  {report.expected}")
    print(f"score:     {report.score:.3f}")
    print(
        f"run:       {report.iterations} turns, {report.llm_calls} LM calls, {report.duration_s:.2f} s, "
        f"stop: {report.stop_reason}"
    )
    print(f"trace:     {report.trace_path}")
    return 0


def _add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark task families against RLMs and baselines",
        description="Benchmark task families against RLMs and baselines. A row is one run: the run "
        "settings below, budget caps included, hold per row.",
    )
    bench.add_argument("task", help="a task family (niah, oolong, oolong-pairs, multihop-docs, codeqa, ...)")
    bench.add_argument(
        "--sizes", default="8k,32k,131k", help="context sizes in tokens, e.g. 8k,32k,131k,1m,10m"
    )
    bench.add_argument("--n", type=int, default=3, help="instances per size")
    bench.add_argument("--seed", type=int, default=0, help="seed of the generated instances")
    bench.add_argument(
        "--method",
        default="base,rlm",
        help="base,codeact,codeact-bm25,codeact-subcalls,summary,rlm,rlm-nosub,rlm-tips,rlm-subtools",
    )
    # Every run setting holds per row (a row is one run), but those each method sets itself.
    add_model_options(
        bench,
        "scripted/gpt5-like",
        "scripted/oracle for a scripted --model, else --model",
        leave_out=METHOD_OWNED,
    )
    for name, declared in METHOD_SETTINGS.items():
        if declared.flag:
            add_setting_flag(bench, name)
    bench.add_argument(
        "--executor",
        default="local",
        choices=("local", "ray"),
        help="where instances run (ray: the ray extra)",
    )
    bench.add_argument(
        "--out", default=None, help="output folder (default: bench-results/TASK); re-use it to resume"
    )
    bench.add_argument("--knobs", default=None, help="family knobs, e.g. giveaway=0.0,pool=all")
    bench.add_argument(
        "--data",
        default=None,
        help="a local file of the real dataset (OOLONG, BrowseComp-Plus, LongBench v2)",
    )
    bench.add_argument("--concurrency", type=int, default=4, help="instances run at once (local executor)")
    bench.add_argument("--ray-actors", type=int, default=2, help="Ray actors, each running many rows")
    bench.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster to join, HOST:PORT or ray://HEAD:10001 (default: $RAY_ADDRESS's, else a local one)",
    )
    bench.add_argument("--json", action="store_true", help="print the summary as JSON")


def _cmd_bench(args: argparse.Namespace) -> int:
    from recursa.bench import run as run_bench
    from recursa.config import Spelling

    settings = run_kwargs(args)  # checked once, with the rows' settings, before any row runs
    settings |= {name: getattr(args, name) for name in METHOD_SETTINGS if hasattr(args, name)}
    report = run_bench(
        args.task,
        sizes=args.sizes,
        n=args.n,
        seed=args.seed,
        methods=args.method,
        model=args.model,
        executor=args.executor,
        out=args.out,
        knobs=args.knobs,
        data=args.data,
        concurrency=args.concurrency,
        ray_actors=args.ray_actors,
        ray_address=args.ray_address,
        progress=not args.json,
        spelling=Spelling("cli"),
        **settings,
    )
    if args.json:
        from recursa.bench import summary_table

        print(
            json.dumps(
                {
                    "out": str(report.out),
                    "ran": report.ran,
                    "skipped": report.skipped,
                    "summary": summary_table(report.rows),
                    "plots_skipped": report.plots_skipped,
                }
            )
        )
    else:
        print(report.summary_path.read_text(encoding="utf-8"))
        print(f"{report.ran} rows run, {report.skipped} already done; results in {report.results_path}")
        if report.plots_skipped:
            print(f"recursa bench: {report.plots_skipped}", file=sys.stderr)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from recursa.train.cli import run_export

    return run_export(args)


def _cmd_serving(args: argparse.Namespace) -> int:
    from recursa.serve.commands import run_command

    return run_command(args)


def _cmd_openenv(args: argparse.Namespace) -> int:
    from recursa.integrations.openenv_cli import run

    return run(args)


def _cmd_models(args: argparse.Namespace) -> int:
    from recursa.cli_models import listing, render

    data = listing()
    print(json.dumps(data, ensure_ascii=False) if args.json else render(data))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _cmd_run,
    "chat": _cmd_chat,
    "demo": _cmd_demo,
    "bench": _cmd_bench,
    "models": _cmd_models,
    "export": _cmd_export,
    "serve": _cmd_serving,
    "mcp": _cmd_serving,
    "acp": _cmd_serving,
    "view": _cmd_serving,
    "openenv": _cmd_openenv,
}


def _fake_server(argv: list[str]) -> int:
    try:
        from recursa.testing.fake_server import main as fake_main
    except ImportError:
        print(f"recursa fake-server: needs the server extra: {install_hint('server')}", file=sys.stderr)
        return 2
    try:
        return int(fake_main(argv) or 0)
    except OSError as exc:
        port = next((a.split("=", 1)[1] for a in argv if a.startswith("--port=")), None)
        if port is None and "--port" in argv[:-1]:
            port = argv[argv.index("--port") + 1]
        print(
            f"recursa fake-server: cannot listen on 127.0.0.1:{port or 8765} ({exc.strerror or exc}); "
            "another server may be using the port: pick another with --port N (0: any free port)",
            file=sys.stderr,
        )
        return 2


def _scrubbed(exc: BaseException, args: argparse.Namespace) -> str:
    """An error's message for the terminal, the settings it names as flags, without the key given on
    the command line or anything key-like (a provider's message may quote a header or a URL's
    ?key=). Paths stay: the reader is the user whose files they are."""
    from recursa.config import Spelling

    return redact(Spelling("cli").told(exc), getattr(args, "api_key", None), paths=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fake-server"]:
        # Its options belong to the fake server's own parser; argparse would take them for ours.
        return _fake_server(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except RecursaError as exc:
        print(f"recursa: error: {_scrubbed(exc, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("recursa: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # most often a path from the command line that cannot be read or written
        if os.environ.get("RECURSA_DEBUG"):
            raise
        where = f" {exc.filename}" if exc.filename else ""
        print(
            f"recursa: error: {exc.strerror or exc}:{where}. Check the path (does its folder exist, "
            "is it a file or a folder as expected, may you write there?) and try again.",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:  # no traceback reaches a CLI user; RECURSA_DEBUG=1 shows it
        if os.environ.get("RECURSA_DEBUG"):
            raise
        print(
            f"recursa: internal error ({type(exc).__name__}): {_scrubbed(exc, args).rstrip('.')}. "
            "Re-run with RECURSA_DEBUG=1 for details and report it.",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
