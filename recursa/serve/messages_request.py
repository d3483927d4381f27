"""From an Anthropic Messages API request body (`POST /v1/messages`) to the same run a Chat
Completions request makes: `system` and the `messages` turns become the messages that
recursa.serve.request turns into a question and a context, and the fields become the same
AnswerShape (recursa.serve.fields). Only the shapes differ; the rules are shared.

No field is dropped silently: each is honoured, accepted with the reason it changes nothing
(NO_EFFECT, in docs/serving.md too), or refused with a 400 naming it (REFUSED).
- `system`: a system message before the turns (so, like a system message in Chat Completions,
  part of the context the RLM reads);
- `max_tokens` (required, as Anthropic's API requires it): a cap on the answer, as
  `max_completion_tokens`; `stop_sequences`: the answer is cut before the first one it completes;
- `temperature`, `top_p`, `top_k`, `output_config.effort`: sent with the root model's calls;
- `output_config.format` json_schema: the answer's JSON Schema, as `response_format`;
- `thinking` (enabled or adaptive): the run's steps come back as a thinking block;
- `tools` with a `tool_choice` forcing one tool: the answer is that tool's `tool_use` block, and
  a replayed conversation may hold it and its `tool_result` (recursa.serve.messages_tools);
  `tool_choice` none: accepted (the RLM calls none of the client's tools). Tools the model could
  choose among are refused, as an RLM never calls the client's tools.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recursa.serve.api_error import bad
from recursa.serve.fields import AnswerShape, check_known, check_types, read_sampling
from recursa.serve.images import InlineImage, anthropic_image
from recursa.serve.messages_tools import TOOLS_WHY, ToolReplay, parse_tools
from recursa.serve.request import (
    InputMessage,
    RunRequest,
    build_request,
    provider_of,
    read_content,
    recursa_options,
    request_object,
    served_model,
    stream_flag,
)
from recursa.serve.settings import ServeSettings

TURN_ROLES = ("user", "assistant")
MAX_STOP_SEQUENCES = 64
EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING_TYPES = ("enabled", "adaptive", "disabled")

# Accepted without effect, each with the reason the docs give (docs/serving.md).
NO_EFFECT = {
    "metadata": "`user_id` is an end-user id for the provider's abuse monitoring; the server's operator is "
    "the provider's user",
    "user_profile_id": "as metadata.user_id",
    "workspace_id": "this server has no workspaces; its keys say who the caller is",
    "service_tier": "the server has one tier",
    "speed": "the server has one speed",
    "inference_geo": "the server's operator chooses where the root model runs",
    "cache_control": "recursa keeps the root's history append-only, so provider caches hit anyway",
    "diagnostics": "as `cache_control`: the server keeps no prompt cache of its own to diagnose",
    "context_management": "an RLM keeps the input out of the model's window, so there is nothing to compact",
}
# Refused: field -> why an RLM cannot honour it.
REFUSED = {
    "container": "this server runs the RLM's code in its own sandbox, not in Anthropic's containers",
    "mcp_servers": "an RLM uses the tools its server's operator gives it (RLM(tools=...)), not servers a "
    "request names",
}
HONOURED = (
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "output_config",
    "thinking",
    "tools",
    "tool_choice",
    "recursa",
)
STANDARD = frozenset((*HONOURED, *NO_EFFECT, *REFUSED))
# Content blocks an RLM does not read, and why (the 400's message names the block and the fix).
_NOT_TEXT = "an RLM reads text: send the text itself, as a text block or as recursa.context"
_BLOCKS_WHY = {
    "document": _NOT_TEXT + " (or, on the server, recursa.context_path)",
    "search_result": _NOT_TEXT,
    "container_upload": "this server runs no Anthropic containers; " + _NOT_TEXT,
    "server_tool_use": "this server runs none of Anthropic's own tools, so there is no call to replay: "
    + TOOLS_WHY,
}
# Blocks of the answers this server gave, as a client replays its conversation: the steps of an
# earlier run (its thinking block) are not part of what was said, so they are left out.
_REPLAYED = ("thinking", "redacted_thinking")


@dataclass
class MessagesRequest:
    """A Messages request: the run it asks for, and how its answer comes back."""

    req: RunRequest
    thinking: bool = False  # the run's steps come back as a thinking block


def parse_messages_request(body: Any, settings: ServeSettings) -> MessagesRequest:
    """Validate a Messages body. Raises ApiError (400/404) naming the field and the fix."""
    body = request_object(body)
    model = served_model(body, settings)
    check_known(body, STANDARD, REFUSED, "Messages API")
    _check_no_effect(body)
    extra = recursa_options(body)
    messages = _system(body.get("system")) + _turns(body.get("messages"))
    if extra.get("question") is None and messages[-1].role == "assistant":
        raise bad(
            f"{messages[-1].where} is an assistant turn for the answer to continue (a prefill): an RLM "
            "writes its answer from its own code and cannot continue a given start; end `messages` with "
            "the user's question",
            messages[-1].where,
        )
    shape, thinking = _shape(body, provider_of(settings.model), settings.run.get("sampling"))
    return MessagesRequest(
        build_request(model, stream_flag(body), extra, messages, shape, settings), thinking
    )


def _check_no_effect(body: dict[str, Any]) -> None:
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise bad('`metadata` must be an object such as {"user_id": "..."}', "metadata")
        user = metadata.get("user_id")
        if user is not None and not isinstance(user, str):
            raise bad("`metadata.user_id` must be a string", "metadata.user_id")
    strings = ("user_profile_id", "workspace_id", "service_tier", "speed", "inference_geo")
    check_types(body, strings, str, "a string")
    check_types(body, ("cache_control", "diagnostics", "context_management"), dict, "an object")


# -- system and messages --------------------------------------------------------------------------


def _system(value: Any) -> list[InputMessage]:
    if value is None or value == "":
        return []
    if not isinstance(value, (str, list)):
        raise bad("`system` must be a string or a list of text blocks", "system")
    text, _ = read_content(value, "system", _system_block)
    return [InputMessage("system", text, [], "system")] if text else []


def _system_block(block: dict[str, Any], kind: Any, at: str) -> str:
    if kind == "text" and isinstance(block.get("text"), str):
        return str(block["text"])
    raise bad(f'{at} must be a text block {{"type": "text", "text": ...}}', at)


def _turns(raw: Any) -> list[InputMessage]:
    if not isinstance(raw, list) or not raw:
        raise bad("`messages` must be a non-empty list of {role, content} turns", "messages")
    out: list[InputMessage] = []
    replay = ToolReplay()
    for i, turn in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise bad(f"{where} must be an object with `role` and `content`", where)
        role = turn.get("role")
        if role == "system":
            raise bad(
                f"{where}.role: the Messages API has no system turns; send it as `system`", f"{where}.role"
            )
        if role not in TURN_ROLES:
            raise bad(f"{where}.role must be user or assistant", f"{where}.role")
        content = turn.get("content")
        if not isinstance(content, (str, list)):
            raise bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        replay.begin(role)
        text, images, results = _turn_content(content, f"{where}.content", role, replay)
        # Tool results first (they answer the turn before), then what the user wrote; a turn of
        # results only is no user message, as in chat a tool message after the question is not one.
        out.extend(results)
        if text or images or not results:
            out.append(InputMessage(role, text, images, where))
    return out


def _turn_content(
    content: Any, where: str, role: str, replay: ToolReplay
) -> tuple[str, list[Any], list[InputMessage]]:
    """A turn's text, its image blocks, and its tool_result blocks as tool messages."""
    results: list[InputMessage] = []

    def block(part: dict[str, Any], kind: Any, at: str) -> str | None:
        if kind == "tool_use":
            replay.call(part, role, at)
            return None  # the call is not context, as a replayed tool_calls message in chat
        if kind == "tool_result":
            replay.result(part, role, at)
            output, images = read_content(part.get("content"), f"{at}.content", _block)
            results.append(InputMessage("tool", output, images, at))
            return None
        return _block(part, kind, at)

    text, images = read_content(content, where, block)
    return text, images, results


def _block(block: dict[str, Any], kind: Any, at: str) -> str | InlineImage | None:
    if kind == "text" and isinstance(block.get("text"), str):
        return str(block["text"])
    if kind == "image":
        return anthropic_image(block, at)
    if kind in _REPLAYED:
        return None
    if isinstance(kind, str) and kind in _BLOCKS_WHY:
        raise bad(f"{at}: {kind} blocks are not taken here: {_BLOCKS_WHY[kind]}", at, "unsupported_content")
    raise bad(f'{at} must be a text block {{"type": "text", "text": ...}}', at)


# -- what the answer must be ----------------------------------------------------------------------


def _shape(
    body: dict[str, Any], provider: str | None, operator: Mapping[str, Mapping[str, Any]] | None
) -> tuple[AnswerShape, bool]:
    shape = AnswerShape()
    shape.max_answer_tokens = _max_tokens(body)
    shape.stop = _stop_sequences(body.get("stop_sequences"))
    effort = _output_config(body.get("output_config"), shape)
    temperature = body.get("temperature")
    # Anthropic's range is narrower than OpenAI's (0 to 2), which the shared check knows.
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 1:
        raise bad("`temperature` must be a number from 0 to 1", "temperature")
    asked = {name: body.get(name) for name in ("temperature", "top_p", "top_k")}
    if effort is not None:
        asked["reasoning_effort"] = effort
    read_sampling(asked, provider, shape, {"reasoning_effort": "output_config.effort"}, operator)
    top_k = shape.sampling.get("top_k")
    if top_k is not None and top_k < 1:
        raise bad("`top_k` must be a positive integer", "top_k")
    parse_tools(body.get("tools"), body.get("tool_choice"), shape)
    return shape, _thinking(body.get("thinking"))


def _max_tokens(body: dict[str, Any]) -> int:
    if "max_tokens" not in body or body["max_tokens"] is None:
        raise bad(
            "`max_tokens` is required (as Anthropic's API requires it): the most tokens the answer may "
            "have; a longer answer is cut, with stop_reason max_tokens",
            "max_tokens",
        )
    value = body["max_tokens"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(
            "`max_tokens` must be a positive integer (0, which pre-warms a prompt cache, has no meaning for "
            "an RLM run)",
            "max_tokens",
        )
    return value


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if (
        not isinstance(value, list)
        or len(value) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and s for s in value)
    ):
        raise bad(
            f"`stop_sequences` must be a list of up to {MAX_STOP_SEQUENCES} non-empty strings",
            "stop_sequences",
        )
    return tuple(value)


def _output_config(value: Any, shape: AnswerShape) -> str | None:
    """Set the answer's schema from `output_config.format`; the root model's effort, if asked."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"format", "effort"}:
        raise bad(
            '`output_config` must be an object with `format` ({"type": "json_schema", "schema": {...}}) '
            "and/or `effort`",
            "output_config",
        )
    spec = value.get("format")
    if spec is not None:
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(schema, dict):
            raise bad(
                '`output_config.format` must be {"type": "json_schema", "schema": {...}}',
                "output_config.format",
            )
        shape.kind, shape.schema = "json_schema", schema
    effort = value.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad(f"`output_config.effort` must be one of {', '.join(EFFORTS)}", "output_config.effort")
    # OpenAI-compatible root models take up to "xhigh": "max" asks for the most there is.
    return "xhigh" if effort == "max" else effort


def _thinking(value: Any) -> bool:
    if value is None:
        return False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in THINKING_TYPES:
        raise bad(
            '`thinking` must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
            '{"type": "disabled"}',
            "thinking",
        )
    budget = value.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise bad("`thinking.budget_tokens` must be a non-negative integer", "thinking.budget_tokens")
    return kind != "disabled"
