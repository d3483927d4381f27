"""Every JSON body the server sends, whole or as SSE events, as valid UTF-8 whatever its text holds.

An answer is text a model's code wrote: a str in the REPL can hold surrogates (bytes decoded with
`surrogateescape`, a string cut inside a UTF-16 pair), which have no UTF-8 form. Encoded as they
are, they made the body fail to encode after the run had finished: a 500 (which the SDKs retry,
running the question again) or a stream cut off mid-way. A pair goes out as the character it
encodes and a lone one as U+FFFD (recursa.lm.base.utf8_json).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from recursa.lm.base import utf8_json


class JSONBody(JSONResponse):
    """A JSON response whose body is valid UTF-8 whatever its strings hold."""

    def render(self, content: Any) -> bytes:
        return utf8_json(content)


def sse_event(value: Any, kind: str | None = None) -> bytes:
    """One SSE event carrying `value` as JSON, with an `event:` line when `kind` is given."""
    head = f"event: {kind}\n".encode() if kind else b""
    return head + b"data: " + utf8_json(value) + b"\n\n"
