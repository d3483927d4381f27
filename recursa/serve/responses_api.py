"""`POST /v1/responses`: the Responses API, answered by the same runs as Chat Completions.

The request is parsed by recursa.serve.responses_request, run by recursa.serve.chat's RunService
(admission, sessions, cancellation), and answered in the Responses shape by
recursa.serve.responses_wire.

`previous_response_id` continues a session: this server stores no responses, but it remembers,
per caller, which session each response of a session ran in (ResponseChain), so a follow-up that
names such a response is the next question in the same REPL. Any other id is a 400 that says how
to continue a conversation here.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from fastapi import Request
from starlette.responses import Response

from recursa.serve.bodies import JSONBody
from recursa.serve.callers import quota_of
from recursa.serve.chat import SESSION_HEADER, RunService
from recursa.serve.observe import RUN_STATE_KEY
from recursa.serve.request import Caller, bad
from recursa.serve.responses_request import ResponsesRequest, parse_responses_request
from recursa.serve.responses_wire import ResponsesSSE, new_id, response_body
from recursa.serve.steps import all_steps

_CHAIN_LIMIT = 100_000  # remembered responses; the oldest are forgotten first
_CHAIN_SHARE = 4  # one caller holds at most 1/_CHAIN_SHARE of them: its own oldest go first


class ResponseChain:
    """(caller, response id) -> the session the response ran in. Ids only, never content.

    Bounded as a whole and per caller (recursa.serve.callers.quota_of): a caller past its share
    forgets its own oldest responses, so one caller's flood of requests cannot push everyone
    else's out."""

    def __init__(self, limit: int = _CHAIN_LIMIT) -> None:
        self.limit = limit
        self.share = max(1, limit // _CHAIN_SHARE)
        self._sessions: dict[tuple[str, str], str] = {}  # in the order they were recorded
        self._held: dict[str, deque[tuple[str, str]]] = {}  # per quota; may hold forgotten keys

    def record(self, owner: str, response_id: str, session_id: str) -> None:
        key = (owner, response_id)
        quota = quota_of(owner)
        held = self._held.setdefault(quota, deque())
        while held and (len(held) >= self.share or held[0] not in self._sessions):
            self._sessions.pop(held.popleft(), None)  # its own oldest (or one already forgotten)
        self._sessions[key] = session_id
        held.append(key)
        while len(self._sessions) > self.limit:
            del self._sessions[next(iter(self._sessions))]
        if len(self._held) > self.limit:  # callers whose every response was forgotten
            self._held = {q: h for q, h in self._held.items() if any(k in self._sessions for k in h)}

    def session_of(self, owner: str, response_id: str) -> str | None:
        return self._sessions.get((owner, response_id))


async def create_response(
    service: RunService, chain: ResponseChain, request: Request, caller: Caller, body: Any
) -> Response:
    call = parse_responses_request(body, service.settings)
    req = call.req
    req.caller = caller
    if call.previous_response_id is not None:
        _continue(service, chain, call, caller)
    run = await service.prepare(req)
    setattr(request.state, RUN_STATE_KEY, run)  # the access log names its run
    response_id = new_id("resp")
    if req.session is not None:  # set by now, also when the client asked for a "new" one
        chain.record(caller.owner, response_id, req.session)
    if req.stream:
        return ResponsesSSE(service, call, run, response_id)
    result = await service.outcome(run, request.receive)
    steps = all_steps(run.events_so_far()) if call.summary else None
    headers = {SESSION_HEADER: req.session} if req.session else None
    return JSONBody(response_body(call, response_id, result, steps), headers=headers)


def _continue(service: RunService, chain: ResponseChain, call: ResponsesRequest, caller: Caller) -> None:
    """Point the request at the session its previous response ran in."""
    previous = call.previous_response_id
    assert previous is not None
    session = chain.session_of(caller.owner, previous)
    if session is None:
        raise bad(
            f"previous_response_id {previous!r} is not a response of one of your sessions: this server "
            "stores no responses. To continue a conversation, send the whole conversation as `input`, or "
            'open a session with extra_body={"recursa": {"session": "new"}} on the first request and '
            "then pass its response's id as previous_response_id",
            "previous_response_id",
            "previous_response_not_found",
        )
    asked = call.req.session
    if asked is not None and asked != session:
        raise bad(
            f"previous_response_id belongs to another session than recursa.session {asked!r}; send one of them",
            "previous_response_id",
        )
    if service.sessions.find(caller.owner, session) is None:
        raise bad(
            f"the session of response {previous!r} has closed (idle sessions close after "
            f"{service.settings.session_ttl_s:g} s); start again without previous_response_id",
            "previous_response_id",
            "session_closed",
        )
    call.req.session = session
