"""Anthropic's Messages API: `POST /v1/messages` (recursa.serve.messages_api) and its token count,
which an RLM cannot give."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from recursa.serve.chat import RunService
from recursa.serve.incoming import authorize, read_json
from recursa.serve.messages_api import create_message, no_token_count
from recursa.serve.settings import ServeSettings


def anthropic_routes(settings: ServeSettings, service: RunService) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/messages")
    async def messages(request: Request) -> Any:
        caller = authorize(settings, request)
        body = await read_json(request, settings.max_context_bytes)
        return await create_message(service, request, caller, body)

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Any:
        authorize(settings, request)
        raise no_token_count()

    return routes
