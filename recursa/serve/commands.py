"""The `serve`, `mcp` and `view` subcommands. Heavy imports (FastAPI, mcp) happen only when a
command runs, so `recursa --help` stays fast and works without the extras."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recursa.asgi.ports import port
from recursa.errors import ConfigError
from recursa.extras import install_hint

if TYPE_CHECKING:
    from recursa.serve.settings import ServeSettings

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
    serve.add_argument(
        "--api-key",
        default=os.environ.get("RECURSA_SERVE_API_KEY"),
        help="clients must send it as a bearer key or in x-api-key (default: $RECURSA_SERVE_API_KEY; none: "
        "no auth)",
    )
    serve.add_argument(
        "--no-access-log",
        action="store_true",
        help="no line per request on stderr (default: a line per request)",
    )
    serve.add_argument(
        "--no-metrics", action="store_true", help="no Prometheus metrics at GET /metrics (default: served)"
    )
    serve.add_argument("--served-model-name", default="recursa", help="the model name clients ask for")
    _add_access_options(serve)
    serve.add_argument("--allow-urls", action="store_true", help="let requests name a context URL to fetch")
    serve.add_argument(
        "--allow-private-urls",
        action="store_true",
        help="with --allow-urls: also fetch loopback, private, link-local and other non-public addresses",
    )
    serve.add_argument("--max-runs", type=int, default=64, help="runs at once; later requests wait")
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests that may wait for a run slot; more get HTTP 429 (default: 256)",
    )
    serve.add_argument(
        "--max-images", type=int, default=16, help="image parts one request may hold (0: none)"
    )
    serve.add_argument(
        "--max-image-bytes",
        type=int,
        default=20 * 1024**2,
        help="bytes all image parts of one request may hold together",
    )
    _add_session_options(serve)
    _add_share_options(serve)

    mcp = sub.add_parser("mcp", help="a Model Context Protocol server (stdio, or --http)")
    add_model_options(mcp)
    mcp.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="with --http: address to listen on")
    mcp.add_argument("--port", type=port, default=8001, help="with --http: port to listen on")
    mcp.add_argument("--path", default="/mcp", help="the HTTP endpoint path")
    mcp.add_argument(
        "--api-key",
        default=os.environ.get("RECURSA_SERVE_API_KEY"),
        help="with --http: clients must send it as a bearer key (default: $RECURSA_SERVE_API_KEY; none: no auth)",
    )
    _add_access_options(mcp)
    _add_session_options(mcp)
    _add_share_options(mcp)

    acp = sub.add_parser(
        "acp",
        help="an Agent Client Protocol agent on stdin/stdout (for editors such as Zed, and verifiers)",
        description="Speaks ACP over stdio: each prompt is one RLM run; embedded text resources are the "
        f"context, otherwise the prompt's text is. Needs the acp extra: {install_hint('acp')}.",
    )
    add_model_options(acp)
    acp.add_argument(
        "--allow-base-url",
        action="append",
        default=None,
        metavar="URL",
        help="a model server URL a client's session _meta may name while using this agent's API key "
        "(repeatable; --base-url is always allowed). Any other URL a client names must come with the "
        "client's own api_key",
    )
    acp.add_argument(
        "--max-sessions",
        type=int,
        default=32,
        help="sessions open at once, each able to run a prompt (more: refused)",
    )

    view = sub.add_parser("view", help="a trace viewer in the browser")
    view.add_argument("trace", help="a trace file (.jsonl), e.g. a result's trace_path")
    view.add_argument("--port", type=port, default=0, help="port on 127.0.0.1 (default: any free port)")
    view.add_argument("--host", default="127.0.0.1", help="address to listen on")
    view.add_argument("--html", metavar="OUT", help="write a standalone HTML file instead of serving")
    view.add_argument("--no-browser", action="store_true", help="do not open a browser")


def _add_session_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-sessions",
        type=int,
        default=32,
        help="sessions open at once, each with its REPL (more: refused); 0 turns sessions off",
    )
    p.add_argument(
        "--max-sessions-per-caller",
        type=int,
        default=None,
        metavar="N",
        help="sessions one caller (a client key; the shared key is one caller whatever X-Recursa-Client "
        "it sends) may keep open at once, so no one caller can take them all (default: a quarter of "
        "--max-sessions where clients have keys of their own, else all)",
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="an idle session is closed after this long",
    )


def _apply_session_options(settings: ServeSettings, args: argparse.Namespace) -> None:
    settings.max_sessions = args.max_sessions
    settings.max_sessions_per_caller = args.max_sessions_per_caller
    settings.session_ttl_s = args.session_ttl
    if settings.max_sessions < 0 or not settings.session_ttl_s > 0:
        raise ConfigError("--max-sessions must be >= 0 and --session-ttl a positive number of seconds")
    if args.max_sessions_per_caller is not None and args.max_sessions_per_caller < 1:
        raise ConfigError(
            "--max-sessions-per-caller must be >= 1 (leave it out for a quarter of --max-sessions); "
            "--max-sessions 0 turns sessions off"
        )


def _add_share_options(p: argparse.ArgumentParser) -> None:
    """What one caller, one connection and one body may take (recursa.serve.shares, asgi/)."""
    p.add_argument(
        "--max-runs-per-caller",
        type=int,
        default=None,
        metavar="N",
        help="runs one caller (a client key; the shared key is one caller) may have going at once "
        "(default: a quarter of --max-runs where clients have keys of their own, else all)",
    )
    p.add_argument(
        "--max-waiting-per-caller",
        type=int,
        default=None,
        metavar="N",
        help="requests of one caller that may wait for a run slot; more get HTTP 429 (default: a "
        "quarter of --max-waiting where clients have keys of their own, else all)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a request body must arrive within this, plus a second per MiB (default: 60); else HTTP 408",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="connections open at once (default: half the file-descriptor limit)",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=int,
        default=None,
        metavar="N",
        help="connections open at once from one client address (default: a quarter of --max-connections)",
    )
    p.add_argument(
        "--idle-sessions-memory",
        type=int,
        default=4096,
        metavar="MIB",
        help="memory all idle sessions' REPLs may hold together; past it the least recently used idle "
        "sessions are closed (default: 4096)",
    )


def _apply_share_options(settings: ServeSettings, args: argparse.Namespace) -> None:
    for flag, value, least in (
        ("--max-runs-per-caller", args.max_runs_per_caller, 1),
        ("--max-waiting-per-caller", args.max_waiting_per_caller, 0),
        ("--max-connections", args.max_connections, 1),
        ("--max-connections-per-address", args.max_connections_per_address, 1),
    ):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be >= {least} (leave it out for the default)")
    if not args.body_timeout > 0 or args.idle_sessions_memory < 0:
        raise ConfigError(
            "--body-timeout must be a positive number of seconds and --idle-sessions-memory >= 0"
        )
    settings.max_runs_per_caller = args.max_runs_per_caller
    settings.max_waiting_per_caller = args.max_waiting_per_caller
    settings.body_timeout_s = args.body_timeout
    settings.max_connections = args.max_connections
    settings.max_connections_per_address = args.max_connections_per_address
    settings.idle_sessions_memory_bytes = args.idle_sessions_memory * 1024 * 1024


def _protocol(settings: ServeSettings) -> Any:
    """uvicorn's HTTP protocol for this server: the head timeout and the connection caps, below a
    descriptor limit lifted toward the hard limit first (this process is the CLI's)."""
    from recursa.asgi.slow_clients import head_timeout_protocol, raise_descriptor_limit

    raise_descriptor_limit()
    return head_timeout_protocol(
        max_connections=settings.max_connections, per_address=settings.max_connections_per_address
    )


def _add_access_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help="one client per line, `NAME KEY`: each key is a caller of its own, whose sessions no other "
        "client can list, join or close (with --api-key or instead of it)",
    )
    p.add_argument(
        "--allow-path",
        action="append",
        default=None,
        metavar="DIR",
        help="a folder whose files requests may name as context (repeatable)",
    )
    p.add_argument("--otel", action="store_true", help="emit OpenTelemetry GenAI spans (global tracer)")


def run_command(args: argparse.Namespace) -> int:
    return {"serve": _serve, "mcp": _mcp, "acp": _acp, "view": _view}[args.command](args)


def _settings(args: argparse.Namespace, roots: list[str]) -> Any:
    from recursa.cli_options import rlm_kwargs
    from recursa.serve.settings import ServeSettings

    for root in roots:
        if not Path(root).expanduser().is_dir():
            raise ConfigError(f"--allow-path {root!r} is not a folder")
    on_event = None
    if getattr(args, "otel", False):
        from recursa.trace.otel import OtelListener

        on_event = OtelListener()
    kwargs = rlm_kwargs(args)
    # What ServeSettings has no field of its own for goes to every run's RLM(...).
    own = {f.name for f in dataclasses.fields(ServeSettings)}
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
    return ServeSettings(
        api_keys=_read_api_keys(args.api_keys_file) if getattr(args, "api_keys_file", None) else {},
        model=args.model,
        sub_model=kwargs["sub_model"],
        base_url=kwargs["base_url"],
        upstream_api_key=kwargs.get("api_key"),
        max_depth=kwargs["max_depth"],
        max_iterations=kwargs["max_iterations"],
        budget=kwargs["budget"],
        sandbox=kwargs["sandbox"],
        trace_dir=Path(args.trace_dir) if args.trace_dir else None,
        context_roots=tuple(Path(r) for r in roots),
        api_key=getattr(args, "api_key", None),
        on_event=on_event,
        rlm_options=options,
    )


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


def _check_model(settings: Any) -> None:
    """Fail at start-up, not on the first request, for a bad model name, key or price."""
    from recursa.config import Spelling
    from recursa.rlm import RLM

    RLM.configured(settings.run_settings() | {"trace": False}, Spelling("cli"))


def _check_options(settings: Any) -> None:
    """Fail at start-up for a bad run option (--exec-timeout 0, --max-depth -1) where the model is not
    checked then (an ACP session may name its own model and key): sessions cannot change these."""
    from recursa.config import RLMConfig, Spelling

    given = {k: v for k, v in settings.run_settings().items() if k in RLMConfig.model_fields}
    RLMConfig.checked(Spelling("cli"), **given | {"sub_model": settings.sub_model or settings.model})


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from recursa.serve.openai_server import create_app
    except ImportError:
        raise ConfigError(f"recursa serve needs the server extra: {install_hint('server')}") from None
    settings = _settings(args, args.allow_path or [])
    settings.served_model_name = args.served_model_name
    settings.allow_context_urls = args.allow_urls
    settings.allow_private_urls = args.allow_private_urls
    settings.max_runs = args.max_runs
    settings.max_waiting = args.max_waiting
    if args.max_images < 0 or args.max_image_bytes < 0:
        raise ConfigError("--max-images and --max-image-bytes take a number >= 0 (0: no image parts)")
    settings.max_images, settings.max_image_bytes = args.max_images, args.max_image_bytes
    settings.access_log = not args.no_access_log
    settings.metrics = not args.no_metrics
    _apply_session_options(settings, args)
    _apply_share_options(settings, args)
    _check_model(settings)
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
    try:
        from recursa.serve.mcp_server import build_mcp_server, http_app
    except ImportError:
        raise ConfigError(f"recursa mcp needs the mcp extra: {install_hint('mcp')}") from None
    # stdio: the client that launched us is the user, so their working folder is readable by
    # default; over HTTP nothing is, unless --allow-path says so.
    roots = args.allow_path if args.allow_path is not None else ([] if args.http else [os.getcwd()])
    settings = _settings(args, roots)
    _apply_session_options(settings, args)
    _apply_share_options(settings, args)
    _check_model(settings)
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
    try:
        from recursa.serve.acp_agent import serve_stdio
    except ImportError:
        raise ConfigError(f"recursa acp needs the acp extra: {install_hint('acp')}") from None
    settings = _settings(args, [])
    for url in args.allow_base_url or []:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"--allow-base-url {url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000/v1"
            )
    settings.allowed_base_urls = tuple(args.allow_base_url or [])
    if args.max_sessions < 1:
        raise ConfigError(f"--max-sessions {args.max_sessions}: give a whole number >= 1")
    settings.max_sessions = args.max_sessions
    _check_options(settings)
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
