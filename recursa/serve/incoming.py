"""What every route does first with a request: who is calling (`authorize`) and its JSON body,
read within the size cap and the JSON bounds (`read_json`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from recursa.public_fetch import read_capped
from recursa.serve.api_error import ApiError, bad
from recursa.serve.callers import CLIENT_HEADER, identify
from recursa.serve.chat import ClientGone
from recursa.serve.json_limits import (
    MAX_NESTING,
    PARSE_IN_THREAD_BYTES,
    TooDeepJSON,
    TooMuchJSON,
    loads_bounded,
    shape_problem,
)
from recursa.serve.request import Caller
from recursa.serve.settings import ServeSettings


def authorize(settings: ServeSettings, request: Request) -> Caller:
    """The request's caller, or ApiError 401 / 400 (recursa.serve.callers)."""
    headers = request.headers
    return identify(
        settings, headers.get("authorization", ""), headers.get(CLIENT_HEADER), headers.get("x-api-key")
    )


async def read_json(request: Request, max_bytes: int) -> Any:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # Read as it came, a compressed body was "not valid JSON", which sent its sender looking in
        # the wrong place; inflating it would need a cap on what it inflates to as well.
        raise ApiError(
            415,
            f"request bodies with Content-Encoding {encoding!r} are not accepted here; send the JSON "
            "uncompressed",
            code="unsupported_content_encoding",
        )
    try:
        raw = await read_capped(
            request.headers.get("content-length"), request.stream(), max_bytes, _too_large(max_bytes)
        )
    except ClientDisconnect:  # it left mid-body, or took longer than the body deadline
        raise ClientGone from None
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, which JSON readers may ignore
    try:
        if len(raw) > PARSE_IN_THREAD_BYTES:
            body = await asyncio.to_thread(loads_bounded, raw)
        else:
            body = loads_bounded(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON") from None
    except TooMuchJSON as exc:
        raise ApiError(
            413,
            f"the request body holds {exc}, past what a request may hold; send fewer messages, or a large "
            "context as one string (recursa.context) or a file part",
            code="request_too_large",
        ) from None
    except (TooDeepJSON, RecursionError):
        raise bad(
            f"the request body nests JSON arrays or objects too deeply (at most {MAX_NESTING} levels)"
        ) from None
    problem = shape_problem(body)
    if problem is not None:
        field, what = problem
        raise ApiError(
            413,
            f"`{field}` holds {what}; send a large context as one string (recursa.context) or a file part",
            param=field,
            code="request_too_large",
        )
    return body


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {max_bytes:,} bytes")
