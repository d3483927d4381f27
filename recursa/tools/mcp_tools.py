"""MCP servers' tools as host tools: connected on the host (the sandbox stays closed), offered to
the REPL code by name and to sub-models through function calling, closed with their call tree.

Each server's connection lives in a task of its own: the `mcp` client's transports are anyio
task groups, which must be left by the task that entered them, while the calls come from
whichever task runs a REPL cell or a sub-model.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import keyword
import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from recursa.errors import ConfigError
from recursa.tools.mcp_config import McpServerSpec
from recursa.tools.mcp_process import find_server, kill_group, new_mark
from recursa.tools.runner import ToolFailure
from recursa.tools.spec import _DOC_CHARS, RESERVED_NAMES, HostToolOptions, Tool

_CLOSE_SECONDS = 10.0  # a server that does not shut down within this is cancelled (its process killed)
_JSON_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}


@dataclass(frozen=True)
class _Listed:
    name: str  # the tool's own name on its server
    description: str
    schema: dict[str, Any]
    output: dict[str, Any] | None  # the schema of its structured result, when it declares one

    @property
    def wrapped(self) -> bool:
        """The result is `{"result": value}`: how MCP servers (the `mcp` package's, FastMCP) give a
        value that is not an object as structured content. The code gets the value itself."""
        props = (self.output or {}).get("properties")
        return isinstance(props, dict) and list(props) == ["result"]


class McpConnection:
    """One connected server: `call(tool, arguments)` from any task until `aclose()`."""

    def __init__(self, spec: McpServerSpec) -> None:
        self.spec = spec
        self.listed: list[_Listed] = []
        self._client: Any = None
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._mark = new_mark() if spec.command is not None else {}
        # A stdio server's process, killed if this connection is dropped or abandoned unclosed.
        self._reaper: weakref.finalize[Any, Any] | None = None

    async def open(self) -> None:
        self._task = asyncio.create_task(self._hold(), name=f"recursa-mcp-{self.spec.name}")
        try:
            async with asyncio.timeout(self.spec.connect_timeout):
                await asyncio.shield(self._ready)
        except TimeoutError:
            await self.aclose()
            raise ConfigError(
                f"{self.spec.where()} did not answer within {self.spec.connect_timeout:g} s; check that it "
                "starts (run its command by hand) or raise its 'connect_timeout'."
            ) from None
        except BaseException:
            await self.aclose()
            raise

    async def _hold(self) -> None:
        from mcp import Client

        try:
            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(Client(await self._target(stack)))
                pid = find_server(self._mark) if self._mark else None
                if pid is not None:
                    self._reaper = weakref.finalize(self, kill_group, pid)
                self.listed = await _list_tools(client, self.spec)
                self._client = client
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(_connect_error(self.spec, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._client = None
            if self._reaper is not None:  # closed in order: the pid is reaped and may be reused
                self._reaper.detach()

    async def _target(self, stack: contextlib.AsyncExitStack) -> Any:
        spec = self.spec
        if spec.command is not None:
            from mcp.client.stdio import StdioServerParameters

            # The server's environment is the mcp package's short safe list plus the entry's env:
            # the host's API keys are not passed on.
            return StdioServerParameters(
                command=spec.command, args=list(spec.args), env={**spec.env, **self._mark}, cwd=spec.cwd
            )
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        http = await stack.enter_async_context(
            httpx2.AsyncClient(headers=spec.headers, timeout=httpx2.Timeout(spec.connect_timeout, read=300.0))
        )
        return streamable_http_client(str(spec.url), http_client=http)

    async def call(self, tool: _Listed, arguments: dict[str, Any]) -> Any:
        client = self._client
        if client is None:
            raise ToolFailure(f"{self.spec.where()} is not connected any more; its tools cannot be called.")
        try:
            # The tool runner's deadline (the spec's timeout) comes first; this one is a backstop.
            result = await client.call_tool(
                tool.name, arguments, read_timeout_seconds=self.spec.timeout + 5.0
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise ToolFailure(f"{tool.name} on {self.spec.where()} failed: {_message(exc)}") from None
        return _result_value(tool, result, self.spec.max_result_chars)

    def kill_now(self) -> None:
        """Without an event loop (an abandoned run): kill a stdio server's process at once; the
        connection's task ends on its own loop when that loop runs again."""
        if self._reaper is not None:
            self._reaper()
        with contextlib.suppress(RuntimeError):  # that loop may be closed already
            self._loop.call_soon_threadsafe(self._stop.set)

    async def aclose(self) -> None:
        self._stop.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            async with asyncio.timeout(_CLOSE_SECONDS):
                await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        except Exception:  # a server that failed on the way out: nothing is left to reap
            pass


class McpServers:
    """The connected servers of one call tree, and their tools."""

    def __init__(self, connections: list[McpConnection]) -> None:
        self.connections = connections

    @classmethod
    async def connect(cls, specs: Iterable[McpServerSpec]) -> McpServers:
        """Connect every server at once; if one fails, the others are closed and the error names it."""
        connections = [McpConnection(spec) for spec in specs]
        outcomes = await asyncio.gather(*(c.open() for c in connections), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            await asyncio.gather(*(c.aclose() for c in connections))
            raise failures[0]
        return cls(connections)

    def tools(self, taken: set[str]) -> tuple[list[Tool], list[Tool]]:
        """(REPL tools, sub-model tools). A tool keeps its own name unless another server's tool or a
        name in `taken` (user tools, the REPL's own names) has it: then the server's name prefixes it."""
        counts: dict[str, int] = {}
        for conn in self.connections:
            for listed in conn.listed:
                own = _identifier(listed.name)
                counts[own] = counts.get(own, 0) + 1
        repl: list[Tool] = []
        sub: list[Tool] = []
        used = set(taken)
        for conn in self.connections:
            for listed in conn.listed:
                name = _identifier(listed.name)
                if counts[name] > 1 or _unusable(name, used):
                    name = _identifier(f"{conn.spec.name}_{listed.name}")
                base, n = name, 2
                while _unusable(name, used):
                    name, n = f"{base}_{n}", n + 1
                used.add(name)
                tool = _make_tool(conn, listed, name)
                if conn.spec.use in ("repl", "both"):
                    repl.append(tool)
                if conn.spec.use in ("sub_models", "both"):
                    sub.append(tool)
        return repl, sub

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.connections))

    def kill_now(self) -> None:
        """Kill every stdio server's process now, without an event loop (CallTree.abandon)."""
        for conn in self.connections:
            conn.kill_now()


async def _list_tools(client: Any, spec: McpServerSpec) -> list[_Listed]:
    found: list[_Listed] = []
    cursor: str | None = None
    for _ in range(100):  # a server whose pages never end cannot hold the run's start
        page = await client.list_tools(cursor=cursor)
        for tool in page.tools:
            if spec.tools is None or tool.name in spec.tools:
                schema = tool.input_schema if isinstance(tool.input_schema, dict) else {"type": "object"}
                output = tool.output_schema if isinstance(tool.output_schema, dict) else None
                found.append(
                    _Listed(tool.name, (tool.description or tool.title or "").strip(), schema, output)
                )
        cursor = page.next_cursor
        if not cursor:
            break
    if spec.tools is not None:
        missing = sorted(set(spec.tools) - {t.name for t in found})
        if missing:
            raise ConfigError(
                f"{spec.where()} has no tool named {', '.join(map(repr, missing))}; fix its 'tools' list."
            )
    return found


def _make_tool(conn: McpConnection, listed: _Listed, name: str) -> Tool:
    params, rendered = _signature(listed.schema)
    if listed.output is not None:
        returns = listed.output["properties"]["result"] if listed.wrapped else listed.output
        rendered += f" -> {_type(returns)}"
    sig = inspect.Signature(params) if params is not None else None

    async def call_mcp_tool(*args: Any, **kwargs: Any) -> Any:
        if sig is None:
            arguments = dict(kwargs)
            if args:
                raise ToolFailure(f"{name} takes keyword arguments only: {name}(**{{...}}).")
        else:
            bound = sig.bind(*args, **kwargs)
            # None for an argument without a schema default means "not given": the server's default.
            arguments = {k: v for k, v in bound.arguments.items() if v is not None or _has_default(listed, k)}
        return await conn.call(listed, arguments)

    if sig is not None:
        call_mcp_tool.__signature__ = sig  # type: ignore[attr-defined]
    doc = listed.description
    if len(doc) > _DOC_CHARS:
        doc = doc[:_DOC_CHARS].rstrip() + " ..."
    origin = f"[MCP server {conn.spec.name}" + (f", tool {listed.name}]" if name != listed.name else "]")
    options = HostToolOptions(timeout=conn.spec.timeout, max_calls=conn.spec.max_calls)
    return Tool(
        name=name,
        fn=call_mcp_tool,
        where="host",
        signature=rendered,
        doc=f"{origin} {doc}".strip(),
        options=options,
        parameters=listed.schema,
    )


def _has_default(listed: _Listed, key: str) -> bool:
    prop = listed.schema.get("properties", {}).get(key)
    return isinstance(prop, dict) and "default" in prop


def _signature(schema: dict[str, Any]) -> tuple[list[inspect.Parameter] | None, str]:
    """Parameters for binding the REPL's call, and the signature shown to the root, from the tool's
    JSON schema: required arguments first, then the optional ones with their defaults."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = (
        [k for k in schema.get("required", []) if k in props]
        if isinstance(schema.get("required"), list)
        else []
    )
    order = [*required, *(k for k in props if k not in required)]
    if not all(k.isidentifier() and not keyword.iskeyword(k) for k in order):
        shown = ", ".join(f"{k!r}: {_type(props[k])}" for k in order)
        return None, f"(**arguments)  # arguments: {{{shown}}}"
    params: list[inspect.Parameter] = []
    shown_parts: list[str] = []
    for key in order:
        prop = props[key] if isinstance(props[key], dict) else {}
        kind = _type(prop)
        if key in required:
            params.append(inspect.Parameter(key, inspect.Parameter.POSITIONAL_OR_KEYWORD))
            shown_parts.append(f"{key}: {kind}")
        else:
            default = prop.get("default")
            params.append(inspect.Parameter(key, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
            shown_parts.append(f"{key}: {kind} = {default!r}")
    return params, f"({', '.join(shown_parts)})"


def _type(prop: Any) -> str:
    """A JSON schema as a Python type hint a model reads at a glance."""
    if not isinstance(prop, dict):
        return "Any"
    if "enum" in prop and isinstance(prop["enum"], list):
        return "Literal[" + ", ".join(repr(v) for v in prop["enum"][:12]) + "]"
    for union in ("anyOf", "oneOf"):
        if isinstance(prop.get(union), list):
            return " | ".join(dict.fromkeys(_type(p) for p in prop[union])) or "Any"
    kind = prop.get("type")
    if isinstance(kind, list):
        return " | ".join(_type({**prop, "type": k}) for k in kind) or "Any"
    if kind == "array":
        items = prop.get("items")
        return f"list[{_type(items)}]" if isinstance(items, dict) else "list"
    if kind == "object":
        return "dict"
    return _JSON_TYPES.get(str(kind), "Any")


def _identifier(name: str) -> str:
    ident = re.sub(r"\W", "_", name)
    return f"_{ident}" if not ident or ident[0].isdigit() else ident


def _unusable(name: str, used: set[str]) -> bool:
    return name in used or name in RESERVED_NAMES or keyword.iskeyword(name) or hasattr(builtins, name)


def _result_value(tool: _Listed, result: Any, limit: int) -> Any:
    """What the code gets: the structured result when the server gives one, else the text of its
    content (images and audio as a note of their type and size); an error result raises."""
    parts: list[str] = []
    for item in result.content or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {item.mime_type}, {len(item.data) * 3 // 4:,} bytes, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource {item.uri}]")
        elif kind == "resource":
            parts.append(getattr(item.resource, "text", None) or f"[resource {item.resource.uri}]")
    text = "\n".join(parts)
    if result.is_error:
        raise ToolFailure(f"{tool.name} returned an error: {_cut(text, 2_000) or '(no message)'}")
    structured = result.structured_content
    if tool.wrapped and isinstance(structured, dict) and list(structured) == ["result"]:
        structured = structured["result"]
    if structured is not None and len(repr(structured)) <= limit:
        return structured
    return _cut(text, limit)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit:,} more characters cut; ask the tool for less]"


def _connect_error(spec: McpServerSpec, exc: BaseException) -> BaseException:
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return exc
    return ConfigError(f"could not connect to {spec.where()}: {_message(exc)}")


def _message(exc: BaseException) -> str:
    """The innermost cause of an error (anyio wraps a transport's failure in exception groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
