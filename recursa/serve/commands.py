"""The `serve`, `mcp`, `acp` and `view` subcommands. The servers' flags are made from their
settings' declarations (recursa/serve/settings.py). Heavy imports (FastAPI, mcp) happen only when
a command runs, so `recursa --help` stays fast and works without the extras."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recursa.asgi.ports import port
from recursa.errors import ConfigError
from recursa.extras import install_hint
from recursa.serve.settings import FLAGS, SERVER_SETTINGS, Command, ServeSettings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parsers(sub: Any, add_model_options: Callable[[argparse.ArgumentParser], None]) -> None:
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (Chat Completions and Responses APIs, and Anthropic's "
        "Messages API): an RLM as a model",
    )
    add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="port to listen on")
    _add_keys(serve)
    _add_server_flags(serve, "serve")

    mcp = sub.add_parser("mcp", help="a Model Context Protocol server (stdio, or --http)")
    add_model_options(mcp)
    mcp.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="with --http: address to listen on")
    mcp.add_argument("--port", type=port, default=8001, help="with --http: port to listen on")
    mcp.add_argument("--path", default="/mcp", help="the HTTP endpoint path")
    _add_keys(mcp)
    _add_server_flags(mcp, "mcp")

    acp = sub.add_parser(
        "acp",
        help="an Agent Client Protocol agent on stdin/stdout (for editors such as Zed, and verifiers)",
        description="Speaks ACP over stdio: each prompt is one RLM run; embedded text resources are the "
        f"context, otherwise the prompt's text is. Needs the acp extra: {install_hint('acp')}.",
    )
    add_model_options(acp)
    _add_server_flags(acp, "acp")

    view = sub.add_parser("view", help="a trace viewer in the browser")
    view.add_argument("trace", help="a trace file (.jsonl), e.g. a result's trace_path")
    view.add_argument("--port", type=port, default=0, help="port on 127.0.0.1 (default: any free port)")
    view.add_argument("--host", default="127.0.0.1", help="address to listen on")
    view.add_argument("--html", metavar="OUT", help="write a standalone HTML file instead of serving")
    view.add_argument("--no-browser", action="store_true", help="do not open a browser")


def _add_server_flags(p: argparse.ArgumentParser, command: Command) -> None:
    """The flags of the server settings whose declarations name `command` (recursa/serve/settings.py)."""
    from recursa.cli_options import add_setting_flag

    for name in FLAGS[command]:
        if name not in _KEYS:
            add_setting_flag(p, SERVER_SETTINGS[name])


_KEYS = ("api_key", "api_keys")  # their flags are _add_keys'


def _add_keys(p: argparse.ArgumentParser) -> None:
    """The clients' keys (ServeSettings.api_key, api_keys), read from the environment or a file so
    that they stay out of argv and `ps`; and --otel, every run's events as OpenTelemetry spans."""
    shared, own = SERVER_SETTINGS["api_key"], SERVER_SETTINGS["api_keys"]
    p.add_argument(
        "--api-key", default=os.environ.get("RECURSA_SERVE_API_KEY"),
        help=f"{shared.help} (default: $RECURSA_SERVE_API_KEY)",
    )
    p.add_argument("--api-keys-file", metavar="FILE", help=f"{own.help}; one `NAME KEY` line per client")
    p.add_argument("--otel", action="store_true", help="emit OpenTelemetry GenAI spans (global tracer)")


def _protocol(settings: ServeSettings) -> Any:
    """uvicorn's HTTP protocol for this server: the head timeout and the connection caps, below a
    descriptor limit lifted toward the hard limit first (this process is the CLI's)."""
    from recursa.asgi.slow_clients import head_timeout_protocol, raise_descriptor_limit

    raise_descriptor_limit()
    return head_timeout_protocol(
        max_connections=settings.max_connections, per_address=settings.max_connections_per_address
    )


def run_command(args: argparse.Namespace) -> int:
    return {"serve": _serve, "mcp": _mcp, "acp": _acp, "view": _view}[args.command](args)


def _settings(args: argparse.Namespace, command: Command, **given: Any) -> ServeSettings:
    """The settings the command's flags give (`given`: the command's own defaults), checked by the
    schema and named as flags."""
    from recursa.cli_options import run_kwargs, setting_values
    from recursa.config import Spelling

    # The run settings, every run's RLM(...): checked once, by ServeSettings, named as flags.
    run = {"model": args.model, **run_kwargs(args)}
    if getattr(args, "otel", False):
        from recursa.trace.otel import OtelListener

        run["on_event"] = OtelListener()
    if getattr(args, "api_keys_file", None):
        given["api_keys"] = _read_api_keys(args.api_keys_file)
    given |= setting_values(args, [SERVER_SETTINGS[name] for name in FLAGS[command]])  # api_key's too
    return ServeSettings.checked(Spelling("cli"), run=run, **given)


def _read_api_keys(path: str) -> dict[str, str]:
    """`NAME KEY` per line (blank lines and # comments skipped); keys stay out of argv and `ps`."""
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-keys-file {path!r} cannot be read: {exc}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 2 or fields[0] in keys:
            raise ConfigError(
                f"--api-keys-file {path!r} line {number}: expected `NAME KEY` with a name used once "
                "(one client per line)"
            )
        keys[fields[0]] = fields[1]
    if not keys:
        raise ConfigError(f"--api-keys-file {path!r} names no client; write one `NAME KEY` per line")
    return keys


def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args, "serve")  # a bad flag is told before the heavy imports
    try:
        import uvicorn

        from recursa.serve.openai_server import create_app
    except ImportError:
        raise ConfigError(f"recursa serve needs the server extra: {install_hint('server')}") from None
    settings.check_models()  # a bad model name, key or price fails now, not on the first request
    if settings.metrics:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"GET /metrics needs prometheus-client: {install_hint('server')}, or pass --no-metrics"
            ) from None
    app = create_app(settings)
    protocol = _protocol(settings)
    sock = _listen(args.host, args.port)  # a busy port is reported before the URL is announced
    _warn_if_open("recursa serve", args.host, settings)
    print(
        f"recursa serve: {settings.model} as model {settings.served_model_name!r} at "
        f"http://{args.host}:{args.port}/v1 (Anthropic clients: base URL http://{args.host}:{args.port})",
        file=sys.stderr,
    )
    if settings.access_log:
        _print_access_log()
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, http=protocol, backlog=protocol.caps.backlog
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 0


def _warn_if_open(command: str, host: str, settings: ServeSettings) -> None:
    if host not in LOOPBACK and not settings.api_key and not settings.api_keys:
        print(
            f"{command}: warning: listening on {host} without --api-key; anyone who can reach "
            "this port can spend your model budget",
            file=sys.stderr,
        )


def _cannot_listen(host: str, port: int, exc: OSError) -> ConfigError:
    busy = exc.errno == errno.EADDRINUSE
    return ConfigError(
        f"cannot listen on {host}:{port} ({exc.strerror}); "
        + (
            "another program is using the port: stop it, or pick another with --port N"
            if busy
            else "check --host and --port"
        )
    )


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so that a port in use is one clear line, not a traceback."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} does not resolve ({exc.strerror}); use e.g. 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise _cannot_listen(host, port, exc) from None
    sock.set_inheritable(True)
    return sock


def _print_access_log() -> None:
    # The command owns its process: the access log goes to stderr, one line per request.
    import logging

    from recursa.serve.observe import access_log

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("recursa serve: %(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    access_log.propagate = False


def _mcp(args: argparse.Namespace) -> int:
    # stdio: the client that launched us is the user, so their working folder is readable by
    # default; over HTTP nothing is, unless --allow-path says so.
    settings = _settings(args, "mcp", context_roots=() if args.http else (os.getcwd(),))
    try:
        from recursa.serve.mcp_server import build_mcp_server, http_app
    except ImportError:
        raise ConfigError(f"recursa mcp needs the mcp extra: {install_hint('mcp')}") from None
    settings.check_models()  # a bad model name, key or price fails now, not on the first request
    server = build_mcp_server(settings)
    if not args.http:
        server.run("stdio")
        return 0
    import uvicorn

    app = http_app(server, settings, path=args.path, host=args.host)
    protocol = _protocol(settings)
    sock = _listen(args.host, args.port)  # a busy port is reported before the URL is announced
    _warn_if_open("recursa mcp", args.host, settings)
    print(f"recursa mcp: streamable HTTP at http://{args.host}:{args.port}{args.path}", file=sys.stderr)
    config = uvicorn.Config(app, log_level="warning", http=protocol, backlog=protocol.caps.backlog)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _acp(args: argparse.Namespace) -> int:
    settings = _settings(args, "acp")  # the model is checked per session: a session may name its own
    if settings.max_sessions < 1:
        raise ConfigError("--max-sessions 0: an ACP agent runs every prompt in a session; give 1 or more")
    try:
        from recursa.serve.acp_agent import serve_stdio
    except ImportError:
        raise ConfigError(f"recursa acp needs the acp extra: {install_hint('acp')}") from None
    import asyncio

    asyncio.run(serve_stdio(settings))
    return 0


def _view(args: argparse.Namespace) -> int:
    from recursa.trace.viewer import TraceFormatError, ViewerServer, export_html

    trace = Path(args.trace).expanduser()
    if not trace.is_file():
        raise ConfigError(f"no trace file at {str(trace)!r}; pass a .jsonl file from a run's trace_path")
    try:
        if args.html:
            out = export_html(trace, args.html)
            print(f"recursa view: wrote {out} ({out.stat().st_size:,} bytes)", file=sys.stderr)
            return 0
        viewer = ViewerServer(trace, host=args.host, port=args.port)
    except TraceFormatError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        if args.html or exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise _cannot_listen(args.host, args.port, exc) from None
    print(f"recursa view: {viewer.url}  (Ctrl+C to stop)", file=sys.stderr)
    if not args.no_browser:
        import webbrowser

        webbrowser.open(viewer.url)
    try:
        viewer.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        viewer.stop()
    return 0
