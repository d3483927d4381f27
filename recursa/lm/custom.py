"""Model clients the user brings: any object with a `complete` method drives an RLM.

`RLM(model=my_client)` takes an object that implements `LMClient` (recursa/lm/base.py): a
`complete(request: LMRequest)` method, `async def` or a plain `def` (run in a thread so it cannot
block the event loop), that returns an `LMResponse` (usage and cost as the backend reports them)
or just the reply text (usage is then estimated, and marked so). `model` and `provider` attributes
are optional: they name the client in traces and usage, and let its price be looked up.

Each client gets a model spec `client/<name>` that the rest of recursa uses like any other
("provider/model") name; the gateway routes that spec to the object. recursa never closes a
client it was given: its owner does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import weakref
from typing import Any

from recursa.errors import ConfigError, LMError
from recursa.lm.base import LMClient, LMRequest, LMResponse
from recursa.lm.billing import estimate_prompt_tokens, estimate_text_tokens
from recursa.lm.prices import PriceBook
from recursa.lm.registry import parse_model

CLIENT_PROVIDER = "client"
# Sync clients run in threads of their own pool: the loop's default pool has a handful of threads
# (CPU count + 4), which would cap a fan-out of sub-calls far below max_concurrency.
_SYNC_THREADS = 64
_NAME_CHARS = 64


def refuse_by_name(model: str, **_: Any) -> LMClient:
    """The registry's factory for "client/..." names: those are objects, not something to build."""
    raise ConfigError(
        f"'client/{model}' names an LM client object given to RLM(model=...): pass the object itself, "
        "e.g. RLM(model=my_client), or a 'provider/model' name such as 'openai/gpt-5-mini'."
    )


class ForeignClient:
    """An `LMClient` around the user's object: checks what it returns, runs a sync one in threads."""

    provider = CLIENT_PROVIDER

    def __init__(self, target: Any, name: str) -> None:
        self.target = target
        self.model = name
        self.spec = f"{CLIENT_PROVIDER}/{name}"
        self._complete = target.complete
        self._is_async = inspect.iscoroutinefunction(self._complete)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def complete(self, request: LMRequest) -> LMResponse:
        try:
            if self._is_async:
                result = await self._complete(request)
            else:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._threads(), self._complete, request
                )
                if inspect.isawaitable(result):  # a plain def that hands back a coroutine
                    result = await result
        except LMError:
            raise
        except Exception as exc:
            raise LMError(f"{self.spec}: the client raised {type(exc).__name__}: {exc}") from exc
        return self._response(result, request)

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                _SYNC_THREADS, thread_name_prefix="recursa-client"
            )
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool

    def _response(self, result: Any, request: LMRequest) -> LMResponse:
        if isinstance(result, LMResponse):
            if not isinstance(result.text, str):
                raise LMError(f"{self.spec}: complete() returned an LMResponse whose text is not a str")
            return result
        if isinstance(result, str):
            return LMResponse(
                text=result,
                input_tokens=estimate_prompt_tokens(request.messages),
                output_tokens=estimate_text_tokens(result),
                model=self.model,
                usage_estimated=True,
            )
        raise LMError(
            f"{self.spec}: complete() returned {type(result).__name__}; return the reply as a str, or an "
            "LMResponse(text=..., input_tokens=..., output_tokens=...) to report usage."
        )

    async def aclose(self) -> None:
        """Nothing of the user's is closed here; only the threads made for a sync client stop."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def client_name(target: Any) -> str:
    """The name a client goes by in specs, traces and usage: its `model`, else its class."""
    model = getattr(target, "model", None)
    name = model if isinstance(model, str) and model.strip() else type(target).__name__
    return name.strip()[:_NAME_CHARS]


def wrap_client(target: Any, argument: str) -> ForeignClient:
    """A ForeignClient for `target`, or ConfigError naming `argument` and what is missing."""
    complete = getattr(target, "complete", None)
    if complete is None or not callable(complete):
        what = "has no `complete` method" if complete is None else "has a `complete` that is not callable"
        raise ConfigError(
            f"{argument} got a {type(target).__name__} object, which {what}. Pass a 'provider/model' name "
            "(e.g. 'openai/gpt-5-mini'), or an LM client: an object with `complete(self, request: "
            "LMRequest)` (async or not) that returns the reply text or an LMResponse. See docs/clients.md."
        )
    return ForeignClient(target, client_name(target))


class ClientSet:
    """The client objects one RLM was given, by the spec each goes by."""

    def __init__(self) -> None:
        self.clients: dict[str, ForeignClient] = {}

    def spec(self, value: Any, argument: str) -> str:
        """`value` as a model spec: a str as it is, a client object as `client/<name>` (its own)."""
        if isinstance(value, str):
            return value
        if value is None or isinstance(value, (int, float, bytes, list, tuple, dict)):
            # Plain data, not an object meant as a client: the mistake is in the name.
            try:
                parse_model(value)  # type: ignore[arg-type]
            except ConfigError as exc:
                raise ConfigError(
                    f"{argument}: {exc} Or pass an LM client object (docs/clients.md)."
                ) from None
        for spec, client in self.clients.items():
            if client.target is value:
                return spec
        client = wrap_client(value, argument)
        spec, n = client.spec, 2
        while spec in self.clients:  # two objects that give the same name
            spec, n = f"{client.spec}-{n}", n + 1
        client.spec, client.model = spec, spec.split("/", 1)[1]
        self.clients[spec] = client
        return spec

    def alias_prices(self, prices: PriceBook) -> None:
        """A client whose `provider` and `model` name a model with a known price is charged that
        price, unless RLM(prices=...) gives one for its spec."""
        for spec, client in self.clients.items():
            provider = getattr(client.target, "provider", None)
            model = getattr(client.target, "model", None)
            if not (isinstance(provider, str) and isinstance(model, str)) or prices.known(
                CLIENT_PROVIDER, client.model
            ):
                continue
            price = prices.price(provider.strip().lower(), model.strip())
            if price is not None:
                prices.overrides[spec] = price
