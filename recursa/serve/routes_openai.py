"""OpenAI's APIs: `POST /v1/chat/completions`, `POST /v1/responses` (recursa.serve.responses_api)
and the model list (`GET /v1/models`, also what Anthropic's clients read)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from recursa.serve.api_error import ApiError
from recursa.serve.bodies import JSONBody
from recursa.serve.chat import SESSION_HEADER, RunService
from recursa.serve.incoming import authorize, read_json
from recursa.serve.observe import RUN_STATE_KEY
from recursa.serve.request import parse_chat_request
from recursa.serve.responses_api import ResponseChain, create_response
from recursa.serve.settings import ServeSettings


def openai_routes(settings: ServeSettings, service: RunService, started: int) -> APIRouter:
    routes = APIRouter()
    chain = ResponseChain()  # which session each response ran in, for previous_response_id
    since = datetime.fromtimestamp(started, UTC).isoformat().replace("+00:00", "Z")

    def model_card(name: str) -> dict[str, Any]:
        # OpenAI's fields and Anthropic's side by side: each SDK reads its own and ignores the others.
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "recursa",
            "type": "model",
            "display_name": name,
            "created_at": since,
        }

    @routes.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(settings, request)
        names = settings.model_names
        cards = [model_card(n) for n in names]
        return {
            "object": "list",
            "data": cards,
            "has_more": False,
            "first_id": names[0],
            "last_id": names[-1],
        }

    @routes.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request) -> dict[str, Any]:
        authorize(settings, request)
        if name not in settings.model_names:
            raise ApiError(404, f"The model {name!r} does not exist on this server", code="model_not_found")
        return model_card(name)

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        caller = authorize(settings, request)
        body = await read_json(request, settings.max_context_bytes)
        req = parse_chat_request(body, settings)
        req.caller = caller
        run = await service.prepare(req)
        setattr(request.state, RUN_STATE_KEY, run)  # the access log names its run
        if req.stream:
            return service.stream(req, run)
        headers = {SESSION_HEADER: req.session} if req.session else None
        return JSONBody(await service.complete(req, run, request.receive), headers=headers)

    @routes.post("/v1/responses")
    async def responses(request: Request) -> Any:
        caller = authorize(settings, request)
        body = await read_json(request, settings.max_context_bytes)
        return await create_response(service, chain, request, caller, body)

    return routes
