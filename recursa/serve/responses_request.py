"""From an OpenAI Responses API request body (`POST /v1/responses`) to the same run a Chat
Completions request makes: its `input` items and `instructions` become the messages that
recursa.serve.request turns into a question and a context, and its fields become the same
AnswerShape (recursa.serve.fields). Only the shapes differ; the rules are shared.

No field is dropped silently: each is honoured, accepted with the reason it changes nothing
(NO_EFFECT, in docs/serving.md too), or refused with a 400 naming it (REFUSED).
- `instructions`: a system message before the input (so, like a system message in Chat
  Completions, part of the context the RLM reads);
- `text.format` json_schema / json_object: the answer's JSON Schema, as `response_format`;
- `tools` with a `tool_choice` forcing one function: the answer is that function's call;
- `temperature`, `top_p`, `reasoning.effort`: sent with the root model's calls;
- `reasoning.summary`: the run's steps come back as a reasoning item (streamed as they happen);
- `max_output_tokens`: a cap on the answer, as `max_completion_tokens`;
- `previous_response_id`: continues the session the earlier response ran in (recursa.serve.sessions);
- `metadata`: checked and echoed in the response, as OpenAI does; nothing is stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from recursa.serve.api_error import bad
from recursa.serve.fields import (
    AnswerShape,
    check_known,
    check_no_effect,
    check_types,
    force_function,
    read_sampling,
)
from recursa.serve.images import InlineImage, responses_image
from recursa.serve.request import (
    InputMessage,
    RunRequest,
    build_request,
    file_part,
    provider_of,
    read_content,
    recursa_options,
    request_object,
    served_model,
    stream_flag,
)
from recursa.serve.settings import ServeSettings

INPUT_ROLES = ("user", "system", "developer", "assistant")
SUMMARY_KINDS = ("auto", "concise", "detailed")

# Accepted without effect, each with the reason the docs give (docs/serving.md).
NO_EFFECT = {
    "store": "this server stores no responses (each run has its trace); previous_response_id works within "
    "a session",
    "user": "an end-user id for the provider's abuse monitoring; the server's operator is the provider's user",
    "safety_identifier": "as `user`",
    "prompt_cache_key": "recursa keeps the root's history append-only, so provider caches hit anyway",
    "prompt_cache_retention": "as `prompt_cache_key`",
    "prompt_cache_options": "as `prompt_cache_key`",
    "service_tier": "the server has one tier",
    "parallel_tool_calls": "a forced function is called once",
    "stream_options": "nothing in the stream is optional here",
    "truncation": "an RLM keeps the input out of the model's window, so there is nothing to truncate",
    "context_management": "an RLM keeps the input out of the model's window, so there is nothing to compact",
    "max_tool_calls": "it caps OpenAI's hosted tools, which this server does not run",
    "include": "it asks for outputs of hosted tools and encrypted reasoning, which this server does not "
    "return (message.output_text.logprobs is refused)",
    "image": "an RLM answers in text only",
    "background_options": "only with background, which is refused",
}
# Refused: field -> why an RLM cannot honour it.
REFUSED = {
    "top_logprobs": "an RLM's answer is not sampled token by token from one model, so it has no log-probabilities",
    "background": "this server answers while the connection is open and stores no responses to poll; "
    "stream the response instead",
    "conversation": "this server keeps no conversations; continue a session with previous_response_id",
    "prompt": "this server keeps no prompt templates; send the instructions and input themselves",
    "moderation": "this server runs no moderation of its own",
    "access_programs": "this server has no access programs",
}
HONOURED = (
    "model",
    "input",
    "instructions",
    "stream",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "reasoning",
    "tools",
    "tool_choice",
    "previous_response_id",
    "metadata",
    "recursa",
)
STANDARD = frozenset((*HONOURED, *NO_EFFECT, *REFUSED))
TOOLS_WHY = (
    "an RLM runs its own code (with the tools its server gives it) and never hands a tool call back "
    "to the client; to get a typed answer, send text.format json_schema or force one function with "
    'tool_choice={"type": "function", "name": ...}; tool_choice "none" is accepted'
)
_ECHOED = ("max_output_tokens", "previous_response_id", "temperature", "top_p", "user")
# Instructions longer than this are not echoed back: here they are often the context itself (a
# whole document), which the response (and each of a stream's lifecycle events) would repeat.
ECHO_INSTRUCTIONS_CHARS = 4_000


@dataclass
class ResponsesRequest:
    """A Responses request: the run it asks for, and what its response echoes back."""

    req: RunRequest
    previous_response_id: str | None = None
    summary: bool = False  # reasoning.summary: the run's steps come back as a reasoning item
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def parse_responses_request(body: Any, settings: ServeSettings) -> ResponsesRequest:
    """Validate a Responses body. Raises ApiError (400/404) naming the field and the fix."""
    body = request_object(body)
    model = served_model(body, settings)
    check_known(body, STANDARD, REFUSED, "Responses API")
    check_no_effect(body)
    _check_no_effect(body)
    extra = recursa_options(body)
    messages = _instructions(body.get("instructions")) + _input(body.get("input"))
    shape, summary = _shape(body, provider_of(settings.model), settings.run.get("sampling"))
    req = build_request(model, stream_flag(body), extra, messages, shape, settings)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad("`previous_response_id` must be the id of an earlier response", "previous_response_id")
    echo = {name: body.get(name) for name in _ECHOED}
    instructions = body.get("instructions")
    echo.update(
        instructions=instructions if instructions and len(instructions) <= ECHO_INSTRUCTIONS_CHARS else None,
        metadata=body.get("metadata") or {},
        text=body.get("text") or {"format": {"type": "text"}},
        tools=body.get("tools") or [],
        tool_choice=body.get("tool_choice") or "auto",
        reasoning=body.get("reasoning"),
        parallel_tool_calls=body.get("parallel_tool_calls", True),
        truncation=body.get("truncation") or "disabled",
    )
    return ResponsesRequest(req, previous, summary, echo)


def _check_no_effect(body: dict[str, Any]) -> None:
    """The Responses-only fields of NO_EFFECT (the ones both APIs share are checked by fields.py)."""
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise bad('`truncation` must be "auto" or "disabled"', "truncation")
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list) or not all(isinstance(i, str) for i in include)
    ):
        raise bad("`include` must be a list of strings", "include")
    if include and "message.output_text.logprobs" in include:
        raise bad(
            f"`include` message.output_text.logprobs is not supported: {REFUSED['top_logprobs']}", "include"
        )
    max_calls = body.get("max_tool_calls")
    if max_calls is not None and (
        isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0
    ):
        raise bad("`max_tool_calls` must be a non-negative integer", "max_tool_calls")
    check_types(body, ("context_management",), list, "a list")
    check_types(body, ("prompt_cache_options", "image", "background_options"), dict, "an object")


# -- instructions and input -----------------------------------------------------------------------


def _instructions(value: Any) -> list[InputMessage]:
    if value is None or value == "":
        return []
    if not isinstance(value, str):
        raise bad("`instructions` must be a string", "instructions")
    return [InputMessage("system", value, [], "instructions")]


def _input(raw: Any) -> list[InputMessage]:
    if isinstance(raw, str):
        return [InputMessage("user", raw, [], "input")]
    if not isinstance(raw, list) or not raw:
        raise bad("`input` must be a string or a non-empty list of input items", "input")
    out: list[InputMessage] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object (a message such as {{role, content}})", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise bad(f"{where}.role must be one of {', '.join(INPUT_ROLES)}", f"{where}.role")
            text, files = _content(item.get("content"), f"{where}.content")
            out.append(InputMessage(role, text, files, where))
        elif kind == "function_call_output":
            # A tool's output the client replays, kept as Chat Completions keeps a tool message.
            text, files = _content(item.get("output"), f"{where}.output")
            out.append(InputMessage("tool", text, files, where))
        elif kind in ("function_call", "reasoning"):
            continue  # a replayed call (its arguments are not context) or a replayed summary of steps
        elif kind == "item_reference":
            raise bad(
                f"{where}: item references are not supported; this server stores no items, send the item",
                where,
            )
        else:
            raise bad(
                f"{where}: input items of type {kind!r} are not supported; send messages (and "
                "function_call_output items)",
                f"{where}.type",
            )
    return out


def _content(content: Any, where: str) -> tuple[str, list[Any]]:
    return read_content(content, where, _part)


def _part(part: dict[str, Any], kind: Any, at: str) -> str | tuple[str, str] | InlineImage:
    if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    if kind == "input_file":
        if part.get("file_url") and not part.get("file_data"):
            raise bad(
                f"{at}: file_url is not fetched here; send the file inline as file_data, or name a "
                "URL with recursa.context_url",
                at,
            )
        return file_part(part, at, holder="")
    if kind == "input_image":
        return responses_image(part, at)
    if kind == "input_audio":
        raise bad(f"{at}: {kind} parts are not supported; an RLM reads text (send text or a text file)", at)
    raise bad(f"{at} must be an input_text, output_text, input_file or input_image part", at)


# -- the answer's shape ---------------------------------------------------------------------------


def _shape(
    body: dict[str, Any], provider: str | None, operator: Mapping[str, Mapping[str, Any]] | None
) -> tuple[AnswerShape, bool]:
    shape = AnswerShape()
    _text(body.get("text"), shape)
    _tools(body.get("tools"), body.get("tool_choice"), shape)
    effort, summary = _reasoning(body.get("reasoning"))
    picked = {name: body.get(name) for name in ("temperature", "top_p")}
    picked["reasoning_effort"] = effort
    read_sampling(picked, provider, shape, {"reasoning_effort": "reasoning.effort"}, operator)
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise bad("`max_output_tokens` must be a positive integer", "max_output_tokens")
    shape.max_answer_tokens = limit
    return shape, summary


def _text(value: Any, shape: AnswerShape) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad('`text` must be an object such as {"format": {"type": "text"}}', "text")
    verbosity = value.get("verbosity")
    if verbosity not in (None, "low", "medium", "high"):
        raise bad('`text.verbosity` must be "low", "medium" or "high"', "text.verbosity")
    spec = value.get("format")
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return
    if kind == "json_object":
        shape.kind, shape.schema = "json_object", {"type": "object"}
        return
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if kind != "json_schema" or not isinstance(schema, dict):
        raise bad(
            '`text.format` must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "name": ..., "schema": {...}}',
            "text.format",
        )
    shape.kind, shape.schema = "json_schema", schema


def _tools(tools: Any, choice: Any, shape: AnswerShape) -> None:
    if choice == "none" or (not tools and choice in (None, "auto")):
        return  # no tool to call, or none allowed: the RLM calls none of the client's, as always
    if choice is None:
        raise bad(f"`tools` are not supported here: {TOOLS_WHY}", "tools", "unsupported_parameter")
    if choice == "auto":
        force_function(None, choice, shape, TOOLS_WHY)
    if choice == "required":
        force_function(_functions(tools), choice, shape, TOOLS_WHY, "text.format")
        return
    name = choice.get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad(
            '`tool_choice` must be "none", "required" (with one function tool) or '
            f'{{"type": "function", "name": ...}}: {TOOLS_WHY}',
            "tool_choice",
            "unsupported_parameter",
        )
    force_function(_functions(tools), name, shape, TOOLS_WHY, "text.format")


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' JSON Schema."""
    if not isinstance(tools, list) or not tools:
        raise bad("`tools` must be a non-empty list of function tools when tool_choice names one", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        name = tool.get("name") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(
                f"tools[{i}] is a {kind!r} tool: only function tools are taken here, and only to force "
                f"the answer's shape ({TOOLS_WHY})",
                f"tools[{i}]",
                "unsupported_parameter",
            )
        if not isinstance(name, str) or not name:
            raise bad(
                f'tools[{i}] must be {{"type": "function", "name": ..., "parameters": {{...}}}}',
                f"tools[{i}]",
            )
        params = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].parameters must be a JSON Schema object", f"tools[{i}].parameters")
        out[name] = params
    return out


def _reasoning(value: Any) -> tuple[str | None, bool]:
    """(effort, whether the steps come back as a reasoning summary)."""
    if value is None:
        return None, False
    if not isinstance(value, dict):
        raise bad('`reasoning` must be an object such as {"effort": "low", "summary": "auto"}', "reasoning")
    effort = value.get("effort")  # checked with the other sampling options
    summary = value.get("summary", value.get("generate_summary"))
    if summary is not None and summary not in SUMMARY_KINDS:
        raise bad(f"`reasoning.summary` must be one of {', '.join(SUMMARY_KINDS)}", "reasoning.summary")
    return effort, summary is not None
