"""recursa's own routes: `GET /health`, `GET /metrics` (Prometheus) and the caller's sessions
(`GET /v1/recursa/sessions`, `DELETE /v1/recursa/sessions/{id}`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from recursa.serve.api_error import ApiError
from recursa.serve.chat import RunService
from recursa.serve.incoming import authorize
from recursa.serve.observe import Metrics
from recursa.serve.settings import ServeSettings


def recursa_routes(settings: ServeSettings, service: RunService, metrics: Metrics | None) -> APIRouter:
    routes = APIRouter()

    @routes.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": settings.served_model_name,
            "active_runs": len(service.active),
            "served": service.served,
            "cancelled": service.cancelled,
            "sessions": len(service.sessions.open),
        }

    if metrics is not None:

        @routes.get("/metrics")
        async def prometheus(request: Request) -> Response:
            authorize(settings, request)  # runs, tokens and spend are the operator's business
            body, content_type = metrics.render()
            return Response(body, media_type=content_type)

    @routes.get("/v1/recursa/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        caller = authorize(settings, request)
        # Under a key several people may share, an id is the only thing that guards a session.
        owned = service.sessions.owned_by(caller.owner)
        return {"object": "list", "data": [h.describe(with_id=caller.private) for h in owned]}

    @routes.delete("/v1/recursa/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> dict[str, Any]:
        caller = authorize(settings, request)
        if not await service.sessions.close(caller.owner, session_id):
            raise ApiError(
                404, f"no open session {session_id!r} (it may have expired)", code="session_not_found"
            )
        return {"id": session_id, "object": "recursa.session", "deleted": True}

    return routes
