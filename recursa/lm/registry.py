"""From a "provider/model" string to a ready client."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from urllib.parse import urlsplit

from recursa.errors import ConfigError
from recursa.lm.base import LMClient
from recursa.lm.retry import RetryPolicy

# A provider's factory: (model, *, base_url, api_key, timeout, retry) -> LMClient. Given as
# "module:attribute", it is imported on first use, so using one provider never imports the others'
# modules. Packages above lm add theirs with `register_provider` (recursa registers "scripted").
ProviderFactory = Callable[..., LMClient]
_FACTORIES: dict[str, str | ProviderFactory] = {
    "openai": "recursa.lm.openai_client:OpenAIClient",
    "anthropic": "recursa.lm.anthropic_client:AnthropicClient",
    # "client/<name>" is an LM client object given to RLM(model=...) (lm/custom.py), never built.
    "client": "recursa.lm.custom:refuse_by_name",
}


def register_provider(name: str, factory: str | ProviderFactory) -> None:
    """Serve "name/<model>" specs with `factory` (a callable or a "module:attribute" path)."""
    _FACTORIES[name.strip().lower()] = factory


def providers() -> tuple[str, ...]:
    """The provider names a model name may start with, in the order they were registered ("client",
    which stands for an object given to RLM(model=...), is not one to type)."""
    return tuple(p for p in _FACTORIES if p != "client")


_FORM = (
    "expected 'provider/model', e.g. 'openai/gpt-5-mini', 'anthropic/claude-sonnet-4-5', "
    "'scripted/gpt5-like', or 'openai/<served model>' with base_url= for vLLM, SGLang, Ollama, llama.cpp"
)


def parse_model(spec: str) -> tuple[str, str]:
    """Split "provider/model" at the first slash; the model name may contain more slashes."""
    if not isinstance(spec, str) or "/" not in spec:
        raise ConfigError(f"model {spec!r} names no provider: {_FORM}. Providers: {', '.join(providers())}.")
    provider, model = spec.split("/", 1)
    provider = provider.strip().lower()
    model = model.strip()
    if provider not in _FACTORIES:
        raise ConfigError(
            f"unknown provider {provider!r} in model {spec!r}; valid providers: "
            f"{', '.join(providers())} ({_FORM})"
        )
    if not model:
        raise ConfigError(f"model {spec!r} has an empty model name: {_FORM}")
    return provider, model


def make_client(
    spec: str,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    retry: RetryPolicy | None = None,
) -> LMClient:
    """A client for ``spec``. Raises ConfigError for an unknown provider or a missing API key."""
    provider, model = parse_model(spec)
    if base_url:  # an empty value (e.g. RECURSA_BASE_URL='') means none, as the SDKs take it
        check_base_url(base_url)
    policy = retry or RetryPolicy()
    factory = _FACTORIES[provider]
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
    return factory(model, base_url=base_url, api_key=api_key, timeout=timeout, retry=policy)


def check_base_url(base_url: object) -> None:
    """An http(s) URL with a host, or ConfigError: a typo here otherwise surfaces only as a failed
    connection on the first call, after the sandbox has started."""
    parts = urlsplit(base_url) if isinstance(base_url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"«base_url» {base_url!r} is not an http(s) URL; pass the server's address with its scheme, "
            "e.g. «base_url='http://localhost:8000/v1'»."
        )
