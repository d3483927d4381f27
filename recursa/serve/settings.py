"""What a serving process is allowed to do, decided once by its operator (CLI flags or code)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.budget import Budget
from recursa.config import DEFAULTS as D
from recursa.errors import ConfigError
from recursa.overrides import same_url
from recursa.trace.redact import Redactor

EventCallback = Callable[[dict[str, Any]], None]


@dataclass
class ServeSettings:
    """One RLM configuration served to many clients.

    Clients may tighten the operator's limits per request (a smaller budget, fewer iterations, a
    depth up to `max_depth_limit`) but never widen the budget. Context paths and URLs are off until
    the operator names the folders (`context_roots`) or turns URLs on (`allow_context_urls`),
    because either lets a client make the server read something on its behalf.
    """

    model: str
    sub_model: str | None = None
    base_url: str | None = None
    upstream_api_key: str | None = field(default=None, repr=False)  # for the model provider
    # Base URLs besides `base_url` a client may point its runs at while they use the operator's key
    # (`client_upstream`); any other URL a client names gets only a key the client sends itself.
    allowed_base_urls: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)  # one bearer key, shared by its holders
    # Client name -> that client's own bearer key: each is a caller of its own (recursa.serve.callers).
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    served_model_name: str = "recursa"
    max_depth: int = D.max_depth
    max_iterations: int = D.max_iterations
    budget: Budget = field(default_factory=Budget)
    sandbox: str = D.sandbox
    trace_dir: Path | None = None
    trace: bool = True
    context_roots: tuple[Path, ...] = ()
    allow_context_urls: bool = False
    # Context URLs reach only public addresses unless this is set (recursa.serve.urls).
    allow_private_urls: bool = False
    max_context_bytes: int = 2 * 1024**3
    url_timeout_s: float = 60.0
    max_runs: int = 64  # runs at once; later requests wait for a slot
    # Chat requests that may wait for a slot (recursa.serve.admission); more are a 429 at once.
    max_waiting: int = 256
    max_depth_limit: int = 3
    max_iterations_limit: int = 100
    max_question_chars: int = 50_000  # a longer "question" is treated as context
    # Image parts of one request (recursa.serve.images): how many, and their bytes together.
    max_images: int = 16
    max_image_bytes: int = 20 * 1024**2
    # Sessions (`extra_body={"recursa": {"session": id}}`): each open one keeps a REPL process.
    max_sessions: int = 32  # open at once; 0 turns sessions off
    # Open at once per caller (recursa.serve.callers.quota_of), so no one caller can take them all;
    # None: a quarter of max_sessions, at least 1, where clients have keys of their own, else all
    # of them (sessions_per_caller).
    max_sessions_per_caller: int | None = None
    session_ttl_s: float = 900.0  # an idle session is closed after this long
    # MCP clients connected over HTTP at once (the MCP SDK's transport sessions, some 40 KB each),
    # and one caller's share of them (recursa.serve.mcp_shares); None: as for the other shares.
    max_mcp_clients: int = 10_000
    max_mcp_clients_per_caller: int | None = None
    # Memory all idle sessions' REPL processes may hold together; past it the least recently used
    # idle sessions are closed (recursa.serve.session_memory).
    idle_sessions_memory_bytes: int = 4 * 1024**3
    # A caller's share (recursa.serve.callers.quota_of) of the run slots and of the requests that
    # may wait for one; None: a quarter of max_runs / max_waiting where clients have keys of their
    # own, else all of them (runs_per_caller, waiting_per_caller).
    max_runs_per_caller: int | None = None
    max_waiting_per_caller: int | None = None
    # A request body must have arrived this long after its head, plus a second per MiB it holds
    # (recursa.asgi.body_deadline), or the request is answered 408 and its connection closed.
    body_timeout_s: float = 60.0
    # Connections open at once, in all (None: half the process's file-descriptor limit) and from one
    # client address (None: a quarter of that); past either a new one is closed at once
    # (recursa.asgi.connections).
    max_connections: int | None = None
    max_connections_per_address: int | None = None
    rlm_options: dict[str, Any] = field(default_factory=dict)  # any other RLM(...) keyword
    on_event: EventCallback | None = None  # also gets every event of every run (e.g. OpenTelemetry)
    access_log: bool = True  # a line per request on the `recursa.serve.access` logger (INFO)
    metrics: bool = True  # Prometheus metrics at GET /metrics (needs prometheus-client)

    def __post_init__(self) -> None:
        self.context_roots = tuple(Path(p).expanduser().resolve() for p in self.context_roots)
        if self.trace_dir is not None:
            self.trace_dir = Path(self.trace_dir)
        if self.max_runs < 1:
            raise ConfigError("max_runs must be >= 1")
        if self.max_waiting < 0:
            raise ConfigError("max_waiting must be >= 0 (0: a request that finds no free run slot gets 429)")
        if self.max_sessions < 0:
            raise ConfigError("max_sessions must be >= 0 (0 turns sessions off)")
        if self.max_sessions_per_caller is not None and self.max_sessions_per_caller < 1:
            raise ConfigError(
                "max_sessions_per_caller must be >= 1 (None: a quarter of max_sessions); "
                "to turn sessions off set max_sessions=0"
            )
        if not self.session_ttl_s > 0:
            raise ConfigError("session_ttl_s must be a positive number of seconds")
        if not self.body_timeout_s > 0:
            raise ConfigError("body_timeout_s must be a positive number of seconds")
        if self.max_images < 0 or self.max_image_bytes < 0:
            raise ConfigError("max_images and max_image_bytes must be >= 0 (0: no image parts)")
        if self.idle_sessions_memory_bytes < 0:
            raise ConfigError("idle_sessions_memory_bytes must be >= 0")
        names = (
            "max_runs_per_caller",
            "max_connections",
            "max_connections_per_address",
            "max_mcp_clients_per_caller",
        )
        if self.max_mcp_clients < 1:
            raise ConfigError("max_mcp_clients must be >= 1")
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 (None: the default share)")
        if self.max_waiting_per_caller is not None and self.max_waiting_per_caller < 0:
            raise ConfigError("max_waiting_per_caller must be >= 0 (None: a quarter of max_waiting)")
        keys = list(self.api_keys.values()) + ([self.api_key] if self.api_key else [])
        if any(not isinstance(k, str) or not k for k in keys) or any(not n for n in self.api_keys):
            raise ConfigError("api_keys must map client names to non-empty keys")
        if len(set(keys)) != len(keys):
            raise ConfigError(
                "every client needs its own key: api_keys (and api_key) hold the same key twice"
            )
        if self.max_depth > self.max_depth_limit:
            self.max_depth_limit = self.max_depth

    def client_upstream(self, base_url: Any, api_key: Any, where: str) -> tuple[str | None, str | None]:
        """The (base URL, API key) for runs of a client that may name its own upstream (`where`:
        the field holding the client's `base_url` and `api_key`, for the error).

        The operator's key goes only to the configured base URL and `allowed_base_urls`: a URL the
        client chose would otherwise receive it. Elsewhere the client sends its own key, or the
        answer is a ConfigError naming the field and the ways out."""
        own = api_key if isinstance(api_key, str) and api_key else None
        if api_key is not None and own is None:
            raise ConfigError(f"{where}.api_key must be a non-empty string (your key for the model server)")
        if base_url is None:
            return self.base_url, own or self.upstream_api_key
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.base_url must be an http(s) URL such as http://127.0.0.1:8000/v1")
        if own is not None:
            return base_url, own
        allowed = [u for u in (self.base_url, *self.allowed_base_urls) if u]
        if any(same_url(base_url, u) for u in allowed):
            return base_url, self.upstream_api_key
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
        keys = [self.upstream_api_key, self.api_key, *self.api_keys.values()]
        return Redactor(keys, paths=not log)(text)

    def run_settings(self) -> dict[str, Any]:
        """The operator's settings of every run (`RLM.configured`'s, by the schema's names): the
        fields above that are run settings, and `rlm_options`."""
        return {
            "model": self.model,
            "sub_model": self.sub_model,
            "base_url": self.base_url,
            "api_key": self.upstream_api_key,
            "max_depth": self.max_depth,
            "max_iterations": self.max_iterations,
            "budget": self.budget,
            "sandbox": self.sandbox,
            "trace_dir": self.trace_dir,
            "trace": self.trace,
            "on_event": self.on_event,
            **self.rlm_options,
        }

    def run_limits(self) -> dict[str, Any]:
        """The operator's limits on what a client's run options may ask for (recursa/overrides.py):
        the depth and iterations limits, the budget, and the run settings the operator set."""
        return {
            **self.rlm_options,
            "max_depth": self.max_depth_limit,
            "max_iterations": self.max_iterations_limit,
            "budget": self.budget,
        }

    def run_models(self) -> list[str]:
        """The models the operator's key pays for: a client may pick among these without a key."""
        allowed = [m for m in self.rlm_options.get("allowed_models", ()) if isinstance(m, str)]
        return list(dict.fromkeys([self.model, self.sub_model or self.model, *allowed]))

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
