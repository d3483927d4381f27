"""`recursa openenv`: RLMEnv episodes served as an OpenEnv environment (recursa/integrations/openenv.py).

The parser needs nothing optional; the command imports openenv-core when it runs, and says how to
install it when it is missing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from recursa.asgi.client_shares import IDLE_TIMEOUT_S
from recursa.asgi.ports import port
from recursa.errors import ConfigError
from recursa.extras import install_hint


def add_parser(sub: Any, add_model_options: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "openenv",
        help="an OpenEnv environment (TRL, OpenEnv clients): the trainer writes the root's turns, "
        "recursa runs them",
        description="Serves RLM episodes over OpenEnv's HTTP/WebSocket API: reset starts an episode "
        "(a question and context, or a generated task), step runs the policy's reply. --model names "
        "the policy (it picks the prompt template); --sub-model at --base-url answers llm_query.",
    )
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8010, help="port to listen on")
    p.add_argument("--max-sessions", type=int, default=64, help="OpenEnv sessions (episodes) at once")
    p.add_argument(
        "--max-sessions-per-client",
        type=int,
        default=None,
        help="sessions (and HTTP resets and steps in progress) one client address may hold; default: a "
        "quarter of --max-sessions, and all of them for this machine's own programs",
    )
    p.add_argument(
        "--session-idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="seconds a session may go without a message before the server closes it",
    )
    p.add_argument(
        "--max-live-repls", type=int, default=256, help="REPL processes alive at once, children included"
    )
    p.add_argument("--family", default="niah", help="task family a reset without a question generates")
    p.add_argument("--size", type=int, default=20_000, help="context characters of a generated task")


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from recursa.asgi.slow_clients import head_timeout_protocol, raise_descriptor_limit
        from recursa.integrations.openenv import MAX_MESSAGE_BYTES, create_openenv_app
    except ImportError:
        raise ConfigError(f"recursa openenv needs the openenv extra: {install_hint('openenv')}") from None
    from recursa.cli_options import rlm_kwargs
    from recursa.env import RLMEnv

    kwargs = rlm_kwargs(args)
    kwargs["max_turns"] = kwargs.pop("max_iterations")
    if args.max_sessions < 1:
        raise ConfigError(f"--max-sessions {args.max_sessions}: give a whole number >= 1")
    if args.max_sessions_per_client is not None and args.max_sessions_per_client < 1:
        raise ConfigError(f"--max-sessions-per-client {args.max_sessions_per_client}: give a whole number >= 1")
    if not args.session_idle_timeout > 0:
        raise ConfigError(f"--session-idle-timeout {args.session_idle_timeout}: give a number of seconds > 0")
    env = RLMEnv(
        kwargs.pop("sub_model") or args.model,
        model=args.model,
        max_live_repls=args.max_live_repls,
        **kwargs,
    )
    app = create_openenv_app(
        env,
        max_sessions=args.max_sessions,
        family=args.family,
        size_chars=args.size,
        sessions_per_client=args.max_sessions_per_client,
        session_idle_timeout_s=args.session_idle_timeout,
    )
    # The servers' connection handling: a request head's time limit, connections capped below the
    # descriptor limit, lifted toward the hard limit first (per address and in all), and a
    # WebSocket message's size.
    raise_descriptor_limit()
    protocol = head_timeout_protocol()
    print(f"recursa openenv: http://{args.host}:{args.port} (OpenEnv /ws, /reset, /step)", file=sys.stderr)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        http=protocol,
        backlog=protocol.caps.backlog,
        ws_max_size=MAX_MESSAGE_BYTES,
    )
    return 0
