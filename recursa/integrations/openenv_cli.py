"""`recursa openenv`: RLMEnv episodes served as an OpenEnv environment (recursa/integrations/openenv.py).

The parser needs nothing optional; the command imports openenv-core when it runs, and says how to
install it when it is missing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from recursa.asgi.ports import port
from recursa.cli_options import add_setting_flag, run_kwargs, setting_values
from recursa.config import ENV_SPELLING, Spelling
from recursa.errors import ConfigError
from recursa.extras import install_hint
from recursa.integrations.openenv_settings import CLI, OPENENV_FLAGS, OPENENV_SETTINGS, OpenEnvSettings


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
    add_setting_flag(p, "max_live_repls")  # the environment's, beside its run settings' flags
    for name in OPENENV_FLAGS:
        add_setting_flag(p, OPENENV_SETTINGS[name])


def run(args: argparse.Namespace) -> int:
    from recursa.env import RLMEnv

    settings = OpenEnvSettings.checked(CLI, **setting_values(args, OPENENV_SETTINGS.values()))
    # The run settings and the environment's, checked once by RLMEnv and named as flags, before the
    # extra loads; --model is the policy, --sub-model (default: --model) answers llm_query.
    kwargs = run_kwargs(args)
    given = {**kwargs, "model": args.model, "sub_model": kwargs["sub_model"] or args.model}
    spelling = Spelling("cli", "RLMEnv", defaults=ENV_SPELLING.defaults)  # RLMEnv's defaults, as flags
    env = RLMEnv.configured(given | {"max_live_repls": args.max_live_repls}, spelling)
    try:
        import uvicorn

        from recursa.asgi.slow_clients import head_timeout_protocol, raise_descriptor_limit
        from recursa.integrations.openenv import MAX_MESSAGE_BYTES, create_openenv_app
    except ImportError:
        env.close()
        raise ConfigError(f"recursa openenv needs the openenv extra: {install_hint('openenv')}") from None
    app = create_openenv_app(env, settings=settings)
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
