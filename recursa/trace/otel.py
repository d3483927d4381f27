"""OpenTelemetry spans from the same events as the JSONL trace, following the GenAI semantic
conventions: `invoke_agent recursa` per RLM run, `chat <model>` per LM call (tokens, cached
tokens, finish reason, cost), `execute_tool repl` per REPL execution.

    from recursa.trace.otel import OtelListener
    rlm = RLM("openai/gpt-5-mini", on_event=OtelListener())   # the global tracer provider

Only `opentelemetry-api` is needed here; with no SDK configured every span is a no-op. Install
the `otel` extra (SDK + OTLP exporter) or run under `opentelemetry-instrument` to export. Message
and code content is not recorded unless `capture_content=True` or the standard environment
variable OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true asks for it.

Nesting: a run's root calls and its child runs are children of its `invoke_agent` span; sub-calls
made by code are children of the `execute_tool` span of the execution that made them (they are
held until that execution ends, since its span can only be created once its start is known).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from recursa.version import __version__

CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_PROVIDERS = {"openai": "openai", "anthropic": "anthropic", "scripted": "recursa.scripted"}
_CONTENT_CHARS = 20_000


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _model_parts(spec: Any) -> tuple[str, str]:
    provider, _, name = str(spec or "").partition("/")
    return _PROVIDERS.get(provider, provider or "unknown"), name or str(spec or "")


class OtelListener:
    """An `on_event` callback for `RLM(...)`. One instance may serve many runs at once (state is
    kept per run id, under a lock)."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        capture_content: bool | None = None,
        agent_name: str = "recursa",
    ) -> None:
        self.tracer = trace.get_tracer("recursa", __version__, tracer_provider=tracer_provider)
        if capture_content is None:
            capture_content = os.environ.get(CAPTURE_ENV, "").strip().lower() in ("1", "true", "yes")
        self.capture = capture_content
        self.agent_name = agent_name
        self._lock = threading.Lock()
        self._runs: dict[str, Span] = {}
        self._roots: dict[str, str] = {}  # run id -> root run id (the conversation)
        self._pending: dict[str, list[dict[str, Any]]] = {}  # sub-call events awaiting their exec

    def __call__(self, event: dict[str, Any]) -> None:
        handler: Callable[[dict[str, Any]], None] | None = getattr(
            self, "_on_" + str(event.get("type")), None
        )
        if handler is None:
            return
        with self._lock:
            handler(event)

    # -- runs ------------------------------------------------------------------------------------
    def _on_run_start(self, e: dict[str, Any]) -> None:
        run_id = str(e.get("run_id"))
        parent_id = e.get("parent_run_id")
        parent = self._runs.get(str(parent_id)) if parent_id else None
        root = self._roots.get(str(parent_id), run_id) if parent_id else run_id
        self._roots[run_id] = root
        provider, model = _model_parts(e.get("model"))
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": self.agent_name,
            "gen_ai.agent.id": run_id,
            "gen_ai.conversation.id": root,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "recursa.depth": int(_num(e.get("depth"))),
        }
        if parent_id:
            attributes["recursa.parent_run_id"] = str(parent_id)
        context = e.get("context")
        if isinstance(context, dict) and isinstance(context.get("total_chars"), int):
            attributes["recursa.context.chars"] = context["total_chars"]
        if self.capture and e.get("question"):
            attributes["gen_ai.input.messages"] = _messages_json([{"role": "user", "content": e["question"]}])
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(
            f"invoke_agent {self.agent_name}",
            context=ctx,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=_ns(_num(e.get("ts"))),
        )
        self._runs[run_id] = span
        self._pending[run_id] = []

    def _on_run_end(self, e: dict[str, Any]) -> None:
        run_id = str(e.get("run_id"))
        span = self._runs.pop(run_id, None)
        if span is None:
            return
        # Sub-calls of an execution that never finished (a cancelled run) still get spans.
        for call in self._pending.pop(run_id, []):
            self._chat_span(call, span)
        usage = e.get("usage") if isinstance(e.get("usage"), dict) else {}
        span.set_attribute("gen_ai.usage.input_tokens", int(_num(usage.get("input_tokens"))))
        span.set_attribute("gen_ai.usage.output_tokens", int(_num(usage.get("output_tokens"))))
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", int(_num(usage.get("cached_tokens"))))
        span.set_attribute("recursa.cost_usd", _num(usage.get("cost_usd")))
        span.set_attribute("recursa.llm_calls", int(_num(usage.get("llm_calls"))))
        span.set_attribute("recursa.stop_reason", str(e.get("stop_reason")))
        span.set_attribute("recursa.iterations", int(_num(e.get("iterations"))))
        if self.capture and e.get("answer") is not None:
            span.set_attribute(
                "gen_ai.output.messages", _messages_json([{"role": "assistant", "content": e["answer"]}])
            )
        if e.get("stop_reason") in ("error", "cancelled"):
            span.set_attribute("error.type", str(e.get("stop_reason")))
            span.set_status(Status(StatusCode.ERROR, str(e.get("error") or e.get("stop_reason"))))
        span.end(end_time=_ns(_num(e.get("ts"))))
        self._roots.pop(run_id, None)

    # -- LM calls and executions -----------------------------------------------------------------
    def _on_lm_call(self, e: dict[str, Any]) -> None:
        run_id = str(e.get("run_id"))
        if e.get("purpose") == "sub" and run_id in self._pending:
            self._pending[run_id].append(e)
            return
        parent = self._runs.get(run_id)
        if parent is not None:
            self._chat_span(e, parent)

    @staticmethod
    def _call_start(e: dict[str, Any]) -> float:
        return _num(e.get("ts")) - _num(e.get("latency_s")) + _num(e.get("queued_s"))

    def _chat_span(self, e: dict[str, Any], parent: Span) -> None:
        provider, model = _model_parts(e.get("model"))
        end = _num(e.get("ts"))
        start = self._call_start(e)
        usage = e.get("usage") if isinstance(e.get("usage"), dict) else {}
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": self._roots.get(str(e.get("run_id")), str(e.get("run_id"))),
            "recursa.call_id": str(e.get("call_id")),
            "recursa.purpose": str(e.get("purpose")),
            "recursa.depth": int(_num(e.get("depth"))),
        }
        if usage:
            attributes["gen_ai.usage.input_tokens"] = int(_num(usage.get("input_tokens")))
            attributes["gen_ai.usage.output_tokens"] = int(_num(usage.get("output_tokens")))
            attributes["gen_ai.usage.cache_read.input_tokens"] = int(_num(usage.get("cached_tokens")))
            attributes["recursa.cost_usd"] = _num(usage.get("cost_usd"))
        if e.get("finish_reason"):
            attributes["gen_ai.response.finish_reasons"] = [str(e["finish_reason"])]
        if e.get("attempts"):
            attributes["recursa.attempts"] = int(_num(e.get("attempts")))
        if self.capture:
            if e.get("new_messages") is not None:
                attributes["gen_ai.input.messages"] = _messages_json(e["new_messages"])
            elif e.get("prompt") is not None:
                attributes["gen_ai.input.messages"] = _messages_json(
                    [{"role": "user", "content": e["prompt"]}]
                )
            if e.get("response") is not None:
                attributes["gen_ai.output.messages"] = _messages_json(
                    [{"role": "assistant", "content": e["response"]}]
                )
        span = self.tracer.start_span(
            f"chat {model}",
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=_ns(start),
        )
        if e.get("error"):
            span.set_attribute("error.type", "budget_refused" if e.get("refused") else "lm_error")
            span.set_status(Status(StatusCode.ERROR, str(e["error"])[:500]))
        span.end(end_time=_ns(end))

    def _on_exec(self, e: dict[str, Any]) -> None:
        run_id = str(e.get("run_id"))
        parent = self._runs.get(run_id)
        if parent is None:
            return
        end = _num(e.get("ts"))
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "repl",
            "gen_ai.tool.type": "function",
            "gen_ai.tool.call.id": f"{run_id}.t{e.get('turn')}.b{e.get('block')}",
            "gen_ai.conversation.id": self._roots.get(run_id, run_id),
            "recursa.turn": int(_num(e.get("turn"))),
            "recursa.timed_out": bool(e.get("timed_out")),
        }
        if self.capture:
            attributes["gen_ai.tool.call.arguments"] = str(e.get("code") or "")[:_CONTENT_CHARS]
            output = (e.get("stdout") or "") + (e.get("stderr") or "")
            attributes["gen_ai.tool.call.result"] = output[:_CONTENT_CHARS]
        # duration_s may be measured inside the REPL process, a little shorter than the host saw;
        # the execution began no later than the first sub-call it made.
        pending = self._pending.get(run_id, [])
        start = min([end - _num(e.get("duration_s"))] + [self._call_start(c) for c in pending])
        span = self.tracer.start_span(
            "execute_tool repl",
            context=trace.set_span_in_context(parent),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=_ns(start),
        )
        for call in pending:
            self._chat_span(call, span)
        self._pending[run_id] = []
        if e.get("error") or e.get("timed_out"):
            span.set_attribute("error.type", "timeout" if e.get("timed_out") else "exception")
            span.set_status(Status(StatusCode.ERROR, str(e.get("error") or "timed out")[:500]))
        span.end(end_time=_ns(end))

    def _on_tool_call(self, e: dict[str, Any]) -> None:
        """A user tool run in the host (from REPL code or a sub-model): its own execute_tool span."""
        run_id = str(e.get("run_id"))
        parent = self._runs.get(run_id)
        if parent is None:
            return
        end = _num(e.get("ts"))
        name = str(e.get("tool") or "tool")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": self._roots.get(run_id, run_id),
            "recursa.tool.caller": str(e.get("caller") or "repl"),
        }
        if self.capture:
            for key, attribute in (
                ("arguments", "gen_ai.tool.call.arguments"),
                ("result", "gen_ai.tool.call.result"),
            ):
                if e.get(key) is not None:
                    attributes[attribute] = str(e[key])[:_CONTENT_CHARS]
        span = self.tracer.start_span(
            f"execute_tool {name}",
            context=trace.set_span_in_context(parent),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=_ns(end - _num(e.get("duration_s"))),
        )
        if e.get("error"):
            span.set_attribute("error.type", "tool_error")
            span.set_status(Status(StatusCode.ERROR, str(e["error"])[:500]))
        span.end(end_time=_ns(end))


def _messages_json(messages: list[dict[str, Any]]) -> str:
    """GenAI semconv message shape: [{"role", "parts": [{"type": "text", "content"}]}]."""
    shaped = [
        {
            "role": m.get("role"),
            "parts": [{"type": "text", "content": str(m.get("content") or "")[:_CONTENT_CHARS]}],
        }
        for m in messages
        if isinstance(m, dict)
    ]
    return json.dumps(shaped, ensure_ascii=False)


def fan_out(*listeners: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    """One on_event callback that calls each of `listeners` (None entries are skipped)."""
    active = [listener for listener in listeners if listener is not None]

    def call_all(event: dict[str, Any]) -> None:
        for listener in active:
            listener(event)

    return call_all
