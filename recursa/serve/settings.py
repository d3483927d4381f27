"""What a serving process is allowed to do, decided once by its operator: the server's settings,
each declared once below (name, type, default, bounds, help, its flag and the commands that take
it), with the operator's run settings (`RLMConfig`'s, by name) beside them.

`ServeSettings(...)`, the flags of `recursa serve`, `mcp` and `acp` (recursa/serve/commands.py) and
the settings page of the docs all derive from these declarations; a bad value is named as the
caller wrote it (`ServeSettings(max_runs=0)`, `--max-runs 0`). To add a server setting, add a field:

    my_limit: int = served(8, "what it bounds, for the docs and --help", flag="--my-limit",
                           on=("serve", "mcp"), ge=1)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from recursa.config import (
    SETTINGS,
    Invalid,
    RLMConfig,
    Schema,
    Setting,
    Spelling,
    declarations,
    setting,
    setting_of,
)
from recursa.configure import build_config
from recursa.errors import ConfigError
from recursa.lm.prices import PriceBook
from recursa.overrides import same_url
from recursa.trace.redact import Redactor

EventCallback = Callable[[dict[str, Any]], None]
# The commands that serve an RLM; a server setting's flag is on those its declaration names.
Command = Literal["serve", "mcp", "acp"]
_SERVE: tuple[Command, ...] = ("serve",)
_SERVERS: tuple[Command, ...] = ("serve", "mcp")  # (mcp: over HTTP or stdio)
# ServeSettings' own names for run settings where they differ: `api_key` is the clients' bearer key.
RUN_NAMES = {"api_key": "upstream_api_key"}
Paths = Annotated[tuple[Annotated[Path, Field(strict=False)], ...], Field(strict=False)]  # or a list of str
Urls = Annotated[tuple[str, ...], Field(strict=False)]
_COMPARED = ("max_depth", "max_iterations", "budget")


def served(default: Any = None, help: str = "", *, on: tuple[Command, ...] = (), **declared: Any) -> Any:
    """A server setting's declaration: `setting(...)`'s, and `on`, the commands whose flags include it."""
    info = setting(default, help, **declared)
    info.json_schema_extra["on"] = on
    return info


class ServeSettings(Schema):
    """One RLM configuration served to many clients.

    Clients may tighten the operator's limits per request (a smaller budget, fewer iterations, a
    depth up to `max_depth_limit`) but never widen the budget. Context paths and URLs are off until
    the operator names the folders (`context_roots`) or turns URLs on (`allow_context_urls`),
    because either lets a client make the server read something on its behalf.

    Any keyword that is a run setting (`model=`, `max_depth=`, `budget=`, `rlm_options={...}`, the
    provider's key as `upstream_api_key=`) goes to `run`, checked by the run settings' schema.
    """

    run: dict[str, Any] = served(help="the operator's run settings, RLMConfig's by name, that every run starts from; a client changes only what each one's policy lets it (docs/serving.md)", factory=dict, what="a dict of run setting names to values", example="{'model': 'openai/gpt-5-mini', 'max_depth': 1}")
    api_key: str | None = served(None, "one bearer key clients send (Authorization: Bearer, or x-api-key), shared by its holders; None: no auth", flag="--api-key", on=_SERVERS, repr=False)
    api_keys: dict[str, str] = served(help="client name -> that client's own bearer key: each is a caller of its own, whose sessions no other client can list, join or close (with api_key or instead of it)", flag="--api-keys-file FILE", on=_SERVERS, factory=dict, repr=False, what="a dict of client names to distinct, non-empty keys", example="{'alice': 'sk-alice-...'}")
    allowed_base_urls: Urls = served(help="model server URLs besides the base URL a client's session may name while it uses the operator's key; any other URL a client names must come with the client's own key", flag="--allow-base-url URL", on=("acp",), factory=tuple, what="a list of http(s) URLs", example="['http://127.0.0.1:8000/v1']")
    served_model_name: str = served("recursa", "the model name clients ask for", flag="--served-model-name", on=_SERVE)
    context_roots: Paths = served(help="folders whose files requests may name as context (none: no paths; recursa mcp over stdio: the working folder)", flag="--allow-path DIR", on=_SERVERS, factory=tuple, what="a list of folders", example="['~/docs']")
    allow_context_urls: bool = served(False, "let requests name a context URL to fetch", flag="--allow-urls", on=_SERVE)
    allow_private_urls: bool = served(False, "with allow_context_urls: also fetch loopback, private, link-local and other non-public addresses (recursa.serve.urls)", flag="--allow-private-urls", on=_SERVE)
    max_context_bytes: int = served(2 << 30, "bytes a request's context may hold (a body, a file, a folder, a URL)", example="1 << 30", ge=1)
    url_timeout_s: float = served(60.0, "seconds a context URL may take to download", gt=0)
    max_runs: int = served(64, "runs at once; later requests wait for a slot", flag="--max-runs", on=_SERVERS, ge=1)
    max_waiting: int = served(256, "requests that may wait for a run slot; more get HTTP 429 at once (recursa.serve.admission)", flag="--max-waiting", on=_SERVERS, ge=0)
    max_depth_limit: int = served(3, "the deepest max_depth a client may ask for (at least the operator's max_depth)", ge=0)
    max_iterations_limit: int = served(100, "the most max_iterations a client may ask for", ge=1)
    max_question_chars: int = served(50_000, "a longer question is treated as context", example="50_000", ge=1)
    max_images: int = served(16, "image parts one request may hold (0: none; recursa.serve.images)", flag="--max-images", on=_SERVE, ge=0)
    max_image_bytes: int = served(20 << 20, "bytes all image parts of one request may hold together", flag="--max-image-bytes", on=_SERVE, example=str(20 << 20), ge=0)
    max_sessions: int = served(32, "sessions open at once, each with its REPL (more: refused); 0 turns sessions off (an ACP agent needs at least 1)", flag="--max-sessions", on=(*_SERVERS, "acp"), ge=0)
    max_sessions_per_caller: int | None = served(None, "sessions one caller (a client key; the shared key is one caller whatever X-Recursa-Client it sends) may keep open at once, so no one caller can take them all (default: a quarter of max_sessions where clients have keys of their own, else all)", flag="--max-sessions-per-caller N", on=_SERVERS, example="8", ge=1)
    session_ttl_s: float = served(900.0, "seconds an idle session stays open", flag="--session-ttl SECONDS", on=_SERVERS, gt=0)
    max_mcp_clients: int = served(10_000, "MCP clients connected over HTTP at once (the MCP SDK's transport sessions, some 40 KB each)", example="10_000", ge=1)
    max_mcp_clients_per_caller: int | None = served(None, "one caller's share of max_mcp_clients (default: as for the other shares; recursa.serve.mcp_shares)", example="100", ge=1)
    idle_sessions_memory_bytes: int = served(4 << 30, "memory all idle sessions' REPL processes may hold together; past it the least recently used idle sessions are closed (recursa.serve.session_memory)", flag="--idle-sessions-memory MIB", on=_SERVERS, unit=("MiB", 1 << 20), example=str(4 << 30), ge=0)
    max_runs_per_caller: int | None = served(None, "runs one caller (a client key; the shared key is one caller) may have going at once (default: a quarter of max_runs where clients have keys of their own, else all)", flag="--max-runs-per-caller N", on=_SERVERS, example="16", ge=1)
    max_waiting_per_caller: int | None = served(None, "requests of one caller that may wait for a run slot; more get HTTP 429 (default: a quarter of max_waiting where clients have keys of their own, else all)", flag="--max-waiting-per-caller N", on=_SERVERS, example="64", ge=0)
    body_timeout_s: float = served(60.0, "seconds a request body may take to arrive after its head, plus a second per MiB it holds; else HTTP 408 and the connection is closed (recursa.asgi.body_deadline)", flag="--body-timeout SECONDS", on=_SERVERS, gt=0)
    max_connections: int | None = served(None, "connections open at once; past it a new one is closed at once (default: half the file-descriptor limit; recursa.asgi.connections)", flag="--max-connections N", on=_SERVERS, example="4096", ge=1)
    max_connections_per_address: int | None = served(None, "connections open at once from one client address (default: a quarter of max_connections)", flag="--max-connections-per-address N", on=_SERVERS, example="1024", ge=1)
    access_log: bool = served(True, "a line per request on the `recursa.serve.access` logger (the command: on stderr)", flag="--access-log", on=_SERVE)
    metrics: bool = served(True, "Prometheus metrics at GET /metrics (needs prometheus-client)", flag="--metrics", on=_SERVE)
    _checked: tuple[RLMConfig, PriceBook, Spelling] = PrivateAttr()  # the run settings as checked

    def __init__(self, *, spelling: Spelling | None = None, **values: Any) -> None:
        """The settings of `values`; a bad one is a ConfigError naming it as `spelling` writes it
        (default: as the Python argument it is, `ServeSettings(max_runs=0)`)."""
        spelling = dataclasses.replace(spelling or Spelling("python", "ServeSettings"), schema=SERVER_SETTINGS)
        run = {**values.pop("rlm_options", {}), **values.pop("run", {})}
        run |= {name: values.pop(name) for name in list(values) if name in SETTINGS and name not in SERVER_SETTINGS}
        if "upstream_api_key" in values:
            run["api_key"] = values.pop("upstream_api_key")
        try:
            self.__pydantic_validator__.validate_python({**values, "run": run}, self_instance=self)
        except ValidationError as exc:
            raise spelling.error(exc, type(self), values) from None
        run_spelling = dataclasses.replace(spelling, schema={}, names=RUN_NAMES if spelling.form == "python" else {})
        if "model" not in run:
            raise ConfigError(f"{spelling.owner}(...) needs the root model: {run_spelling.assign('model', repr('openai/gpt-5-mini'))}", setting="model")
        # Checked as every run's will be, once (check_models goes on from this check); kept as given
        # (a sub_model left out follows an ACP session's model, and each run makes its own tools and
        # clients of them).
        config, prices = build_config(run, run_spelling)
        self._checked = (config, prices, run_spelling)
        self.max_depth_limit = max(self.max_depth_limit, config.max_depth)

    @classmethod
    def checked(cls, spelling: Spelling, **values: Any) -> ServeSettings:
        return cls(spelling=spelling, **values)

    def check_models(self) -> None:
        """What RLM(...) checks beyond the schema (a provider, a key and a price for each model the
        operator's runs call; a budget that lets the root's first call through), on the run
        settings as they were checked when these settings were made: `recursa serve` and `mcp` fail
        at start-up, not on the first request (`acp`'s sessions may name their own model)."""
        from recursa.rlm import check_runs

        check_runs(*self._checked)

    @field_validator("context_roots")
    @classmethod
    def _folders(cls, roots: tuple[Path, ...]) -> tuple[Path, ...]:
        for root in roots:
            if not Path(root).expanduser().is_dir():
                raise Invalid(f"a list of folders; {str(root)[:200]!r} is not a folder", "['~/docs']")
        return tuple(Path(p).expanduser().resolve() for p in roots)

    @field_validator("api_keys")
    @classmethod
    def _distinct(cls, keys: dict[str, str], info: Any) -> dict[str, str]:
        held = list(keys.values()) + ([info.data["api_key"]] if info.data.get("api_key") else [])
        if any(not k for k in held) or any(not name for name in keys):
            raise Invalid("a dict of client names to non-empty keys", "{'alice': 'sk-alice-...'}")
        if len(set(held)) != len(held):
            raise Invalid("a key per client: it (with api_key) holds the same key twice", "{'alice': 'sk-alice-...', 'bob': 'sk-bob-...'}")
        return keys

    @field_validator("allowed_base_urls")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise Invalid(f"a list of http(s) URLs; {url[:200]!r} is not one", "['http://127.0.0.1:8000/v1']")
        return urls

    @property
    def model(self) -> str:
        """The root model (a run setting every ServeSettings has)."""
        return self.run["model"]

    def client_upstream(self, base_url: Any, api_key: Any, where: str) -> tuple[str | None, str | None]:
        """The (base URL, API key) for runs of a client that may name its own upstream (`where`:
        the field holding the client's `base_url` and `api_key`, for the error).

        The operator's key goes only to the configured base URL and `allowed_base_urls`: a URL the
        client chose would otherwise receive it. Elsewhere the client sends its own key, or the
        answer is a ConfigError naming the field and the ways out."""
        own = api_key if isinstance(api_key, str) and api_key else None
        if api_key is not None and own is None:
            raise ConfigError(f"{where}.api_key must be a non-empty string (your key for the model server)")
        operators = self.run.get("base_url"), self.run.get("api_key")
        if base_url is None:
            return operators[0], own or operators[1]
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.base_url must be an http(s) URL such as http://127.0.0.1:8000/v1")
        if own is not None:
            return base_url, own
        allowed = [u for u in (operators[0], *self.allowed_base_urls) if u]
        if any(same_url(base_url, u) for u in allowed):
            return base_url, operators[1]
        raise ConfigError(
            f"{where}.base_url {base_url[:200]!r} is not a URL this agent's operator allowed, and the "
            "operator's API key is sent only to those. Send your own key for that server in "
            f"{where}.api_key, use the configured base URL, or ask the operator to allow it "
            "(recursa acp --allow-base-url URL)"
        )

    def redact(self, text: str, *, log: bool = False) -> str:
        """`text` (an error message for a client or, `log=True`, the operator's log) without this
        server's keys (the model provider's, its clients') or anything key-like; and, unless it is
        for the log, without the host's file paths (trace/hostpaths.py)."""
        keys = [self.run.get("api_key"), self.api_key, *self.api_keys.values()]
        return Redactor(keys, paths=not log)(text)

    def run_settings(self) -> dict[str, Any]:
        """The operator's settings of every run (`RLM.configured`'s, by the schema's names): `run`,
        with the depth, turns and budget a client's are compared with (the schema's by default)."""
        return {name: setting_of(name).default for name in _COMPARED} | self.run

    def run_limits(self) -> dict[str, Any]:
        """The operator's limits on what a client's run options may ask for (recursa/overrides.py):
        the depth and iterations limits, the budget, and the operator's values of the run settings a
        client may set (those only the operator sets stay out of a client's messages: its base URL)."""
        return {
            **{name: value for name, value in self.run.items() if setting_of(name).client != "operator"},
            "max_depth": self.max_depth_limit,
            "max_iterations": self.max_iterations_limit,
            "budget": self.run_settings()["budget"],
        }

    def run_models(self) -> list[str]:
        """The models the operator's key pays for: a client may pick among these without a key."""
        allowed = [m for m in self.run.get("allowed_models", ()) if isinstance(m, str)]
        return list(dict.fromkeys([self.model, self.run.get("sub_model") or self.model, *allowed]))

    @property
    def sessions_per_caller(self) -> int:
        """How many sessions one caller may hold open at once."""
        return self._share(self.max_sessions_per_caller, self.max_sessions, 1)

    @property
    def mcp_clients_per_caller(self) -> int:
        """How many MCP transport sessions one caller may hold open at once."""
        return self._share(self.max_mcp_clients_per_caller, self.max_mcp_clients, 1)

    @property
    def runs_per_caller(self) -> int:
        """How many runs one caller may have going at once."""
        return self._share(self.max_runs_per_caller, self.max_runs, 1)

    @property
    def waiting_per_caller(self) -> int:
        """How many of one caller's requests may wait for a run slot."""
        return self._share(self.max_waiting_per_caller, self.max_waiting, min(1, self.max_waiting))

    def _share(self, given: int | None, total: int, least: int) -> int:
        """A caller's share: as the operator gave it; by default a quarter of the server's (at least
        `least`) where clients have keys of their own, and the whole server where every request is
        the one caller there is (no key, or only the shared one): a smaller share would only leave
        the rest idle."""
        if given is not None:
            return given
        return max(least, total // 4) if self.api_keys else total

    @property
    def model_names(self) -> list[str]:
        """Names a request's `model` may use: the served name and the root model itself."""
        return list(dict.fromkeys([self.served_model_name, self.model]))


SERVER_SETTINGS: dict[str, Setting] = declarations(ServeSettings)


def _signature() -> inspect.Signature:
    """The constructor as callers use it: the server's settings by name, then any run setting
    (`model=`, `max_depth=`, `budget=`, ...) as keywords. Pydantic would otherwise show the custom
    `__init__`'s `**values` until the schema is built and the fields alone after it."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    spelling = inspect.Parameter("spelling", keyword, default=None, annotation="Spelling | None")
    fields = [
        inspect.Parameter(
            name, keyword, default=info.get_default(call_default_factory=True), annotation=info.annotation
        )
        for name, info in ServeSettings.model_fields.items()
    ]
    run = inspect.Parameter("run_settings", inspect.Parameter.VAR_KEYWORD, annotation=Any)
    return inspect.Signature([spelling, *fields, run])


ServeSettings.model_rebuild()  # its schema now, so that pydantic's signature is not set after ours
ServeSettings.__signature__ = _signature()  # type: ignore[assignment]
# How the operator sets the server's settings, as a client's message names them (`--max-runs`).
OPERATOR = Spelling("cli", schema=SERVER_SETTINGS)
# The flags of the run slots and the requests that may wait for one, in all and per caller.
ADMISSION_FLAGS = (
    f"{OPERATOR.label('max_runs')} plus {OPERATOR.label('max_waiting')}",
    f"{OPERATOR.label('max_runs_per_caller')} plus {OPERATOR.label('max_waiting_per_caller')}",
)
# The flags of each command: the settings whose declarations name it.
FLAGS: dict[Command, tuple[str, ...]] = {
    command: tuple(n for n, f in ServeSettings.model_fields.items() if command in f.json_schema_extra["on"])  # type: ignore[index,operator]
    for command in ("serve", "mcp", "acp")
}
