"""A front door's arguments made into a checked `RLMConfig`: what RLM, RLMEnv and the baselines share.

The schema (recursa/config.py) checks each value; this adds what needs more than one setting or more
than the schema's layer: client objects given as models, tools made from functions, tool names that
clash between `tools` and `sub_tools`, and a key and a price for each model a run pays for. Every
message names the argument as `spelling` writes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from recursa.config import RLMConfig, Spelling
from recursa.errors import ConfigError
from recursa.lm.custom import ClientSet
from recursa.lm.prices import PriceBook
from recursa.lm.registry import make_client, parse_model
from recursa.loop.dialects import make_dialect
from recursa.sandbox import SANDBOXES
from recursa.tools.mcp_config import parse_mcp_servers
from recursa.tools.mcp_tools import McpServers
from recursa.tools.spec import Tool, make_sub_tools, make_tools


def build_config(given: Mapping[str, Any], spelling: Spelling) -> tuple[RLMConfig, PriceBook]:
    """The config of `given` (each setting as the caller named and passed it; the caller's own
    defaults, `spelling.defaults`, where it passed none) and the prices it runs at, client objects'
    aliases included. `budget=None` means no caps."""
    values = {**spelling.defaults, **{spelling.schema_name(k): v for k, v in given.items()}}
    if values.get("budget") is None:
        values.pop("budget", None)
    clients = ClientSet()
    values["model"] = clients.spec(values.get("model"), spelling.argument("model"))
    sub = values.get("sub_model")
    values["sub_model"] = values["model"] if sub in (None, "") else clients.spec(sub, spelling.argument("sub_model"))
    if isinstance(allowed := values.get("allowed_models"), list | tuple):
        where = spelling.argument("allowed_models", items=True)
        values["allowed_models"] = [clients.spec(m, where) for m in allowed]
    for name, make in (("tools", make_tools), ("sub_tools", make_sub_tools)):
        if name in values:
            values[name] = make(list(values[name]), where=spelling.argument(name))
    if "mcp_servers" in values:
        values["mcp_servers"] = _mcp_servers(values["mcp_servers"], spelling.argument("mcp_servers"))
    config = RLMConfig.checked(spelling, **values, clients=dict(clients.clients))
    try:  # made once now, so a wrong name, option or a missing peer package fails before any spend
        make_dialect(config.dialect, config.dialect_options)
    except ConfigError as exc:
        raise ConfigError(f"{spelling.given('dialect', config.dialect)}: {spelling.told(exc)}") from None
    _check_tool_names(config.tools, config.sub_tools, spelling)
    kind = SANDBOXES[config.sandbox]
    if kind.preflight is not None:  # Ray missing or its cluster's address dead: now, not at the first REPL
        kind.preflight(config.sandbox_options or {})
    parse_model(config.model)  # the root's name chooses its prompt, whoever answers its calls
    prices = PriceBook(config.prices)
    clients.alias_prices(prices)
    return config, prices


def check_models(config: RLMConfig, prices: PriceBook, specs: Iterable[str], spelling: Spelling) -> None:
    """Each model named by `specs` that a run will call has a provider and a key (a client is made
    now, not mid-run), and a price when a dollar budget is set."""
    for spec in specs:
        provider, name = parse_model(spec)
        if spec not in config.clients:
            make_client(spec, base_url=config.base_url, api_key=config.api_key)
        if config.budget.max_usd is not None and not prices.known(provider, name):
            example = f'{{"{spec}": {{"input_per_mtok": 0.25, "output_per_mtok": 2.0}}}}'
            usd, tokens = spelling.label("max_usd"), spelling.label("max_tokens")
            raise ConfigError(
                f"{usd} is set but no price is known for {spec!r}: drop {usd} and cap {tokens} instead, "
                f"or give its price with {spelling.assign('prices', example)} (US dollars per million tokens)."
            )


def _mcp_servers(given: Any, where: str) -> list[Any]:
    """Server entries checked; servers connected already (`McpServers`, in a list) kept as they are:
    each run uses them and leaves them open for the next."""
    if isinstance(given, list | tuple):
        connected = [g for g in given if isinstance(g, McpServers)]
        if connected:
            return [*connected, *parse_mcp_servers([g for g in given if not isinstance(g, McpServers)], where)]
    return list(parse_mcp_servers(given, where))


def _check_tool_names(tools: list[Tool], sub_tools: list[Tool], spelling: Spelling) -> None:
    for sub in sub_tools:
        for tool in tools:
            if tool.name == sub.name and tool.fn is not sub.fn:
                raise ConfigError(
                    f"{spelling.owner}(tools=..., sub_tools=...): two different functions are named "
                    f"{tool.name!r}; rename one (the same function may be in both lists)."
                )
