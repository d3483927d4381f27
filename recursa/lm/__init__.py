"""Model clients behind one small protocol, plus the shared limiter, retry policy and price book."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recursa.lm.base import CallMeta, LMClient, LMRequest, LMResponse, Message
from recursa.lm.prices import ModelPrice
from recursa.lm.registry import register_provider

if TYPE_CHECKING:
    from recursa.lm.anthropic_client import AnthropicClient
    from recursa.lm.openai_client import OpenAIClient

__all__ = [
    "AnthropicClient",
    "CallMeta",
    "LMClient",
    "LMRequest",
    "LMResponse",
    "Message",
    "ModelPrice",
    "OpenAIClient",
    "register_provider",
]

_LAZY = {
    "OpenAIClient": "recursa.lm.openai_client",
    "AnthropicClient": "recursa.lm.anthropic_client",
}


def __getattr__(name: str) -> Any:
    # The clients load on first use: importing recursa.lm should not import aiohttp.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recursa.lm' has no attribute {name!r}")
