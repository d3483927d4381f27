"""The standard Chat Completions fields beside `model`, `messages`, `n` and `stream`: what each
means for an RLM. No field is dropped silently: each is honoured, accepted with a documented
reason why it changes nothing, or refused with a 400 that names it and says why.

- `response_format` json_schema / json_object: the RLM's final answer must match the schema (the
  root model is told it, a mismatch is sent back to it); the content returned is the JSON text.
- `tools` with `tool_choice` forcing one function: the same, with that function's parameters as the
  schema; the answer comes back as a call of that function (structured output, as LangChain's
  `with_structured_output(method="function_calling")` asks for it). Tools the model may choose
  among are refused: an RLM runs its own code and never hands a tool call back to the client.
- sampling fields (temperature, top_p, seed, penalties, reasoning_effort; vLLM's top_k, min_p,
  repetition_penalty): sent with the root model's own calls, each checked by the schema's
  declaration (`SamplingOptions` in recursa/config.py): its bounds, and reasoning_effort no more
  than the operator's sampling gives the root (recursa/overrides.py).
- `stop`, `max_completion_tokens` / `max_tokens`: applied to the final answer (cut at the first stop
  sequence; cut at about 4 characters per token, with finish_reason "length", and the root model
  is told the limit).
- fields without a meaning for an RLM run (user, metadata, store, ...): accepted and checked.
Any other top-level field is a 400: recursa's own options go under `extra_body={"recursa": {...}}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from recursa.config import SAMPLING_SETTINGS, Spelling
from recursa.errors import ConfigError
from recursa.overrides import client_sampling
from recursa.serve.api_error import bad

CHARS_PER_TOKEN = 4  # how the answer limit turns tokens into characters (no tokenizer is assumed)
# What each provider's API takes of them; others are refused for that provider, not sent to fail.
_PROVIDER_SAMPLING = {"anthropic": frozenset(("temperature", "top_p", "top_k"))}

# Accepted without effect, each with the reason the docs give (docs/serving.md).
NO_EFFECT = {
    "user": "an end-user id for the provider's abuse monitoring; the server's operator is the provider's user",
    "safety_identifier": "as `user`",
    "metadata": "tags for stored completions; this server stores none (each run has its trace)",
    "store": "this server stores no completions for later retrieval (each run has its trace)",
    "prompt_cache_key": "recursa keeps the root's history append-only, so provider caches hit anyway",
    "prompt_cache_retention": "as `prompt_cache_key`",
    "service_tier": "the server has one tier",
    "verbosity": "the answer's length follows the question; cap it with max_completion_tokens",
    "parallel_tool_calls": "a forced function is called once",
    "modalities": 'only ["text"] is accepted',
}
# Refused: field -> why an RLM cannot honour it.
REFUSED = {
    "logprobs": "an RLM's answer is not sampled token by token from one model, so it has no log-probabilities",
    "top_logprobs": "an RLM's answer is not sampled token by token from one model, so it has no log-probabilities",
    "logit_bias": "an RLM's answer is not sampled token by token from one model, so token biases cannot apply",
    "audio": "an RLM answers in text only",
    "prediction": "an RLM's answer is not one model's output, so a predicted output cannot speed it up",
    "web_search_options": "the server's operator can give the RLM a search tool (RLM(tools=...))",
    "functions": "an RLM runs its own code and returns no function calls; use response_format for a typed answer",
    "function_call": "an RLM runs its own code and returns no function calls; use response_format for a typed answer",
}
HONOURED = (
    "response_format",
    "tools",
    "tool_choice",
    *SAMPLING_SETTINGS,
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
)
STANDARD = frozenset(("model", "messages", "n", "stream", "recursa", *HONOURED, *NO_EFFECT, *REFUSED))
_TOOLS_WHY = (
    "an RLM runs its own code (with the tools its server gives it) and never hands a tool call back "
    "to the client; to get a typed answer, send response_format json_schema or force one function "
    'with tool_choice={"type": "function", "function": {"name": ...}}; tool_choice "none" is accepted'
)


@dataclass
class AnswerShape:
    """What a request asks of the answer and of the root model's calls."""

    kind: str = "text"  # "text" | "json_object" | "json_schema" | "tool"
    schema: dict[str, Any] | None = None  # the JSON Schema the final answer must match
    tool_name: str | None = None  # kind "tool": the function whose arguments the answer is
    sampling: dict[str, Any] = field(default_factory=dict)  # sent with the root model's calls
    stop: tuple[str, ...] = ()
    max_answer_tokens: int | None = None
    # stream_options.include_usage: a last chunk with `choices: []` and the usage, as OpenAI sends it.
    include_usage: bool = False

    @property
    def max_answer_chars(self) -> int | None:
        return None if self.max_answer_tokens is None else self.max_answer_tokens * CHARS_PER_TOKEN

    def tips(self) -> str | None:
        """What the root model is told about the answer's length, if the client capped it."""
        if self.max_answer_tokens is None:
            return None
        return (
            f"The final answer must be at most {self.max_answer_tokens:,} tokens (about "
            f"{self.max_answer_chars:,} characters); a longer one is cut off."
        )

    def first_stop(self, answer: str) -> tuple[int, str] | None:
        """Where the answer stops and the stop sequence that stops it: the one whose first
        occurrence ends first, as a model writing the answer would have stopped there."""
        found: tuple[int, str] | None = None
        for seq in self.stop:
            at = answer.find(seq)
            if at >= 0 and (found is None or at + len(seq) < found[0] + len(found[1])):
                found = (at, seq)
        return found

    def cut(self, answer: str) -> tuple[str, bool]:
        """The answer as the client gets it, and whether the token limit cut it."""
        stop = self.first_stop(answer)
        if stop is not None:
            answer = answer[: stop[0]]
        limit = self.max_answer_chars
        if limit is not None and len(answer) > limit:
            return answer[:limit], True
        return answer, False


def check_known(body: dict[str, Any], standard: frozenset[str], refused: dict[str, str], api: str) -> None:
    """A 400 for a field `api` does not have, or one this server refuses (`refused`: why), when set."""
    unknown = sorted(set(body) - standard)
    if unknown:
        raise bad(
            f"unknown field(s) {', '.join(unknown)}: this server takes the standard {api} fields; "
            'recursa\'s own options go under extra_body={"recursa": {...}} (see docs/serving.md)',
            unknown[0],
            "unknown_parameter",
        )
    for name, why in refused.items():
        value = body.get(name)
        # A value that asks for nothing (top_logprobs 0, logit_bias {}, function_call "none") is as
        # good as none: clients fill fields in with their empty values.
        if (
            value is None
            or value is False
            or value in ({}, [], "none")
            or (type(value) is int and value == 0)
        ):
            continue
        raise bad(f"`{name}` is not supported: {why}", name, "unsupported_parameter")


def parse_shape(
    body: dict[str, Any], provider: str | None, operator: Mapping[str, Mapping[str, Any]] | None = None
) -> AnswerShape:
    """Check every standard field of `body`. `provider`: the served root model's provider, when
    known (a sampling field its API does not take is refused rather than sent to fail); `operator`:
    the operator's sampling per role, which a sampling field may only tighten (read_sampling)."""
    check_known(body, STANDARD, REFUSED, "Chat Completions")
    check_no_effect(body)
    shape = AnswerShape()
    _response_format(body.get("response_format"), shape)
    _tools(body.get("tools"), body.get("tool_choice"), shape)
    read_sampling(body, provider, shape, operator=operator)
    shape.stop = _stop(body.get("stop"))
    shape.max_answer_tokens = _max_tokens(body)
    shape.include_usage = _include_usage(body.get("stream_options"))
    return shape


def check_types(body: dict[str, Any], names: tuple[str, ...], kind: type, what: str) -> None:
    """A 400 naming the first of `names` that is present but not a `kind` ("must be `what`")."""
    for name in names:
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise bad(f"`{name}` must be {what}", name)


def check_no_effect(body: dict[str, Any]) -> None:
    strings = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier")
    check_types(body, (*strings, "verbosity"), str, "a string")
    check_types(body, ("store", "parallel_tool_calls"), bool, "true or false")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise bad("`metadata` must be an object of at most 16 string keys and string values", "metadata")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad('`modalities` must be ["text"]: an RLM answers in text only', "modalities")


def _include_usage(options: Any) -> bool:
    """stream_options: `include_usage` is honoured, `include_obfuscation` has nothing to pad (the
    answer comes in fixed-size pieces); both must be booleans. Sent without streaming, it does nothing."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad('`stream_options` must be an object such as {"include_usage": true}', "stream_options")
    for key in ("include_usage", "include_obfuscation"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad(f"`stream_options.{key}` must be true or false", f"stream_options.{key}")
    return options.get("include_usage") is True


def _response_format(value: Any, shape: AnswerShape) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        shape.kind, shape.schema = "json_object", {"type": "object"}
        return
    if kind != "json_schema":
        raise bad(
            '`response_format` must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            "response_format",
        )
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad(
            "`response_format.json_schema.schema` must be a JSON Schema object", "response_format.json_schema"
        )
    shape.kind, shape.schema = "json_schema", schema


def _tools(tools: Any, choice: Any, shape: AnswerShape) -> None:
    # No tools offered (`[]` as absent, as the Responses API takes it): "auto" has nothing to pick.
    if choice == "none" or (tools in (None, []) and choice in (None, "auto")):
        return  # the model may call no tool, which is what an RLM does anyway
    if choice is None:
        raise bad(f"`tools` are not supported here: {_TOOLS_WHY}", "tools", "unsupported_parameter")
    if choice in ("auto", "required"):
        force_function(None if choice == "auto" else _functions(tools), choice, shape, _TOOLS_WHY)
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad(
            '`tool_choice` must be "none", "required" (with one tool) or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    force_function(_functions(tools), name, shape, _TOOLS_WHY)


def force_function(
    functions: dict[str, dict[str, Any]] | None,
    choice: str,
    shape: AnswerShape,
    why: str,
    format_field: str = "response_format",
    spelled: str | None = None,
) -> None:
    """Make the function a request forces (`choice`: "auto", "required" or a function's name;
    `functions`: name -> parameters' JSON Schema) the answer's shape; refuse, saying `why`, any
    choice that would leave the model free to pick a tool. Shared by the APIs' shapes of tools
    (`format_field`: the API's field for a JSON answer, which cannot be asked for as well;
    `spelled`: how the API writes "auto" or "required", for the error)."""
    shown = spelled or f'"{choice}"'
    if choice == "auto" or functions is None:
        raise bad(f"tool_choice {shown} is not supported: {why}", "tool_choice", "unsupported_parameter")
    if choice == "required":
        if len(functions) != 1:
            raise bad(
                f"tool_choice {shown} with {len(functions)} tools is not supported: {why}",
                "tool_choice",
                "unsupported_parameter",
            )
        name = next(iter(functions))
    else:
        name = choice
        if name not in functions:
            raise bad(f"tool_choice names {name!r}, which is not among `tools`", "tool_choice")
    if shape.kind != "text":
        raise bad(f"send either {format_field} or a forced tool_choice, not both", "tool_choice")
    shape.kind, shape.tool_name, shape.schema = "tool", name, functions[name]


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' JSON Schema."""
    if not isinstance(tools, list) or not tools:
        raise bad("`tools` must be a non-empty list of function tools when tool_choice names one", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(name, str):
            raise bad(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}',
                f"tools[{i}]",
            )
        params = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON Schema object", f"tools[{i}]")
        out[name] = params
    return out


def read_sampling(
    body: dict[str, Any],
    provider: str | None,
    shape: AnswerShape,
    fields: dict[str, str] | None = None,
    operator: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """The sampling options among `body` (by the schema's names) into `shape`, as the root's
    options: each checked once, by its declaration and by its policy over `operator` (the operator's
    sampling per role: reasoning_effort no more than the root's), as `recursa.sampling`'s are
    (recursa/overrides.py). `fields`: the request field an option came from where the API names it
    otherwise (Responses: reasoning.effort)."""
    spelling = Spelling("field", names=fields or {})
    asked = {name: body[name] for name in SAMPLING_SETTINGS if body.get(name) is not None}
    try:
        root = client_sampling({"root": asked}, operator, spelling, at=lambda _: spelling)["root"]
    except ConfigError as exc:
        raise bad(str(exc), spelling.label(exc.setting or "")) from None
    out = {name: root[name] for name in asked}
    shape.sampling = out
    allowed = _PROVIDER_SAMPLING.get(provider or "")
    if allowed is not None:
        for name in out:
            if name not in allowed:
                field_name = spelling.label(name)
                raise bad(
                    f"`{field_name}` cannot be applied: this server's root model is an {provider} model, whose "
                    f"API takes only {', '.join(sorted(allowed))} of the sampling fields",
                    field_name,
                    "unsupported_parameter",
                )


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > 4 or not all(isinstance(s, str) and s for s in value):
        raise bad("`stop` must be a non-empty string or a list of up to 4 of them", "stop")
    return tuple(value)


def _max_tokens(body: dict[str, Any]) -> int | None:
    limits = []
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"`{name}` must be a positive integer", name)
        limits.append(value)
    return min(limits) if limits else None
