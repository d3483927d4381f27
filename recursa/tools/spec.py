"""What a user tool is: a Python function, where it runs, and how it is described to models.

A REPL tool either runs inside the sandbox (a self-contained function, shipped as source) or in the
host (`@host_tool`: the REPL calls it over the request channel, so it may use the network, a database
or an index the sandbox cannot reach). Sub-model tools (`RLM(sub_tools=...)`) always run in the host.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import json
import keyword
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from recursa.errors import ConfigError
from recursa.trace.redact import looks_secret, redact

F = TypeVar("F", bound=Callable[..., Any])

# Names the REPL already defines; a tool must not take one (it would be restored over the tool).
RESERVED_NAMES = frozenset(
    {
        "context",
        "llm_query",
        "llm_query_batched",
        "llm_batch",
        "rlm_query",
        "rlm_query_batched",
        "FINAL",
        "FINAL_VAR",
        "answer",
        "SHOW_VARS",
        "BudgetExceeded",
        "SubcallError",
        "ToolError",
        "history",
        "root_history",
        "print",
    }
)
# The docstring shown to models is cut here: tools are described, not documented in full.
_DOC_CHARS = 1_500


@dataclass(frozen=True)
class HostToolOptions:
    """Limits for a tool that runs in the host: per call and for the whole run."""

    timeout: float = 60.0
    max_calls: int | None = None  # per call tree; None: unlimited
    max_concurrency: int | None = None  # calls of this tool at once; None: unlimited


def host_tool(
    fn: F | None = None,
    *,
    timeout: float = 60.0,
    max_calls: int | None = None,
    max_concurrency: int | None = None,
) -> Any:
    """Mark `fn` to run in the host process; the REPL calls it over the request channel.

    Use it bare (`@host_tool`) or with limits (`@host_tool(timeout=10, max_calls=100)`). The
    function may be sync (run in a worker thread) or async; its arguments and result must be JSON
    values (str, numbers, bools, None, lists, dicts with str keys).
    """
    options = HostToolOptions(timeout=timeout, max_calls=max_calls, max_concurrency=max_concurrency)
    if options.timeout <= 0 or (max_calls is not None and max_calls < 1):
        raise ConfigError("host_tool(timeout=...) must be > 0 and max_calls, if given, >= 1.")
    if max_concurrency is not None and max_concurrency < 1:
        raise ConfigError("host_tool(max_concurrency=...) must be >= 1 when given.")

    def mark(f: F) -> F:
        if not callable(f):
            raise ConfigError(f"@host_tool decorates a function, not {type(f).__name__}.")
        f.__recursa_host_tool__ = options  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


@dataclass
class Tool:
    """One user function as the engine sees it."""

    name: str
    fn: Callable[..., Any]
    where: Literal["sandbox", "host"]
    signature: str  # e.g. "(query: str, k: int = 5) -> list[str]"
    doc: str
    options: HostToolOptions = field(default_factory=HostToolOptions)
    source: str = ""  # for sandbox tools: the code that defines it (imports, constants, def)
    parameters: dict[str, Any] = field(default_factory=dict)  # JSON schema, for function calling

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def describe(self) -> str:
        """One bullet for the root's prompt: name, signature, docstring."""
        where = " (runs outside the sandbox)" if self.where == "host" else ""
        head = f"- `{self.name}{self.signature}`{where}"
        if not self.doc:
            return head
        return head + ": " + textwrap.indent(self.doc, "  ").lstrip()

    def to_function(self) -> dict[str, Any]:
        """How a sub-model is offered it (recursa/lm/tool_format.py turns this into each API's shape)."""
        return {"name": self.name, "description": self.doc or self.name, "parameters": self.parameters}

    def to_worker(self) -> dict[str, Any]:
        """How the worker defines it: from source, or as a stub that calls the host."""
        if self.where == "sandbox":
            return {"name": self.name, "kind": "source", "source": self.source}
        return {"name": self.name, "kind": "host", "signature": self.signature, "doc": self.doc}


def make_tools(functions: list[Any], *, where: str = "RLM(tools=...)", host: bool = False) -> list[Tool]:
    """Validate `RLM(tools=...)` entries; a mistake raises ConfigError naming the fix, and the
    argument as `where` (the caller's own spelling of it). `host`: every tool runs in the host."""
    tools: list[Tool] = []
    seen: set[str] = set()
    # Tools may call each other: in the sandbox they share one namespace, so those names resolve.
    siblings = {getattr(fn, "__name__", "") for fn in functions}
    for fn in functions:
        tool = _one_tool(fn, where, siblings, host)
        if tool.name in seen:
            raise ConfigError(f"{where}: two tools are named {tool.name!r}; give each a unique name.")
        seen.add(tool.name)
        tools.append(tool)
    return tools


def make_sub_tools(functions: list[Any], *, where: str = "RLM(sub_tools=...)") -> list[Tool]:
    """Sub-model tools always run in the host: the sub-model asks, the host calls, the model reads."""
    tools = make_tools(functions, where=where, host=True)
    for tool in tools:
        tool.parameters = _parameters_schema(tool, where)
    return tools


def _parameters_schema(tool: Tool, where: str) -> dict[str, Any]:
    """The JSON schema of a function's arguments, from its signature and type hints (via pydantic)."""
    import pydantic

    try:
        hints = typing.get_type_hints(tool.fn)
    except Exception:  # unresolvable annotations: describe those arguments as "any value"
        hints = {}
    fields: dict[str, Any] = {}
    for param in inspect.signature(tool.fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(
                f"{where}: {tool.name} takes *{param.name}; a model can only fill named "
                "arguments, so list them explicitly."
            )
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (hints.get(param.name, Any), default)
    try:
        schema = pydantic.create_model(f"{tool.name}_arguments", **fields).model_json_schema()
    except Exception as exc:
        raise ConfigError(
            f"{where}: the arguments of {tool.name} cannot be described as JSON ({exc}); "
            "annotate them with JSON types (str, int, float, bool, list[...], dict[str, ...])."
        ) from None
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return schema


def _one_tool(fn: Any, where: str, siblings: set[str], host: bool) -> Tool:
    if not callable(fn) or isinstance(fn, type):
        raise ConfigError(f"{where} takes functions; got {type(fn).__name__} {fn!r}.")
    name = getattr(fn, "__name__", "")
    if not name.isidentifier() or keyword.iskeyword(name) or name == "<lambda>":
        raise ConfigError(
            f"{where}: {fn!r} has no usable name ({name!r}); define it with `def` and a Python "
            "identifier as its name."
        )
    if name in RESERVED_NAMES:
        raise ConfigError(
            f"{where}: the tool name {name!r} is reserved in the REPL; rename the function "
            f"(reserved: {', '.join(sorted(RESERVED_NAMES))})."
        )
    if hasattr(builtins, name):
        raise ConfigError(
            f"{where}: the tool name {name!r} would hide Python's builtin {name}(); rename it."
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: cannot read the signature of {name}; use a plain def.") from None
    doc = inspect.getdoc(fn) or ""
    if len(doc) > _DOC_CHARS:
        doc = doc[:_DOC_CHARS].rstrip() + " ..."
    options = getattr(fn, "__recursa_host_tool__", None)
    if isinstance(options, HostToolOptions) or host:
        return Tool(name, fn, "host", _render_signature(sig), doc, options or HostToolOptions())
    return Tool(name, fn, "sandbox", _render_signature(sig), doc, source=_sandbox_source(fn, name, siblings))


def _render_signature(sig: inspect.Signature) -> str:
    # Annotations under `from __future__ import annotations` are strings already; render both kinds.
    return str(sig).replace("'", "")


def _sandbox_source(fn: Any, name: str, siblings: set[str]) -> str:
    """Source that defines `fn` inside the sandbox: the modules and constants it uses, then its def.

    Only a self-contained function can move: one that closes over host objects, or reads a global
    that is neither a module nor a JSON-like constant, must be a host tool instead.
    """
    fix = f"make {name} self-contained (imports inside the function) or mark it @recursa.host_tool"
    if not isinstance(fn, types.FunctionType):
        raise ConfigError(f"tool {name!r} is not a plain Python function; {fix}.")
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(f"tool {name!r} is async; the REPL calls tools synchronously: {fix}.")
    if fn.__closure__:
        free = ", ".join(fn.__code__.co_freevars)
        raise ConfigError(
            f"tool {name!r} closes over host variables ({free}), so it cannot run in the sandbox; {fix}."
        )
    try:
        body = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise ConfigError(
            f"the source of tool {name!r} cannot be read (defined interactively?); {fix}."
        ) from None
    body = _strip_decorators(body)
    secret_here = "holds what looks like a secret (a key, token or password), and secrets never enter the sandbox"
    where_secret = "mark the tool @recursa.host_tool (it then runs in the host, where the secret stays)"
    tree = _def_node(body)
    for label, value in _literals(tree):
        if looks_secret(label, value):
            raise ConfigError(
                f"tool {name!r} {secret_here}: its source writes one out ({label or 'a literal'}); {where_secret}, "
                "or pass the value as an argument if the code may see it."
            )
    preamble = []
    # Defaults are evaluated where the def runs: the globals they name are shipped (and checked) too.
    in_defaults = {n.id for d in (*tree.args.defaults, *tree.args.kw_defaults) if d for n in ast.walk(d)
                   if isinstance(n, ast.Name)} if tree else set()  # fmt: skip
    for global_name in sorted(_global_names(fn.__code__) | in_defaults):
        if global_name in siblings or hasattr(builtins, global_name) or global_name in RESERVED_NAMES:
            continue
        if global_name not in fn.__globals__:
            continue  # defined in the REPL at call time (e.g. a variable the model makes), or a typo
        value = fn.__globals__[global_name]
        if isinstance(value, types.ModuleType):
            preamble.append(_import_line(global_name, value))
        elif _is_constant(value):
            if _holds_secret(global_name, value):
                raise ConfigError(
                    f"tool {name!r} reads the global {global_name!r}, which {secret_here}; {where_secret}, "
                    "or pass the value as an argument if the code may see it."
                )
            preamble.append(f"{global_name} = {value!r}")
        else:
            raise ConfigError(
                f"tool {name!r} uses the global {global_name!r} ({type(value).__name__}), which cannot be "
                f"shipped to the sandbox; {fix}."
            )
    return "\n".join([*preamble, body])


def _def_node(source: str) -> ast.FunctionDef | None:
    try:
        node = ast.parse(source).body[0]
    except (SyntaxError, IndexError, ValueError, RecursionError, MemoryError):
        return None
    return node if isinstance(node, ast.FunctionDef) else None


def _literals(tree: ast.FunctionDef | None) -> list[tuple[str, str]]:
    """The str literals of a def but its docstring, each with the name it is given where it has one
    (a parameter's default, a keyword argument, a dict key, an assignment's target)."""
    if tree is None:
        return []
    named: dict[int, str] = {}
    args = tree.args
    positional = [*args.posonlyargs, *args.args]
    for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True):
        named[id(default)] = arg.arg
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if default is not None:
            named[id(default)] = arg.arg
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg:
            named[id(node.value)] = node.arg
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    named[id(value)] = key.value
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and node.value is not None:
                    named[id(node.value)] = target.id
    doc = tree.body[0].value if tree.body and isinstance(tree.body[0], ast.Expr) else None
    return [
        (named.get(id(node), ""), node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node is not doc
    ]


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _import_line(alias: str, module: types.ModuleType) -> str:
    full = module.__name__
    if "." in full and alias == full.rsplit(".", 1)[1]:
        parent, leaf = full.rsplit(".", 1)
        return f"from {parent} import {leaf}"
    return f"import {full}" if alias == full else f"import {full} as {alias}"


def _is_constant(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        try:
            json.dumps(list(value) if isinstance(value, (set, frozenset)) else value)
        except (TypeError, ValueError):
            return False
        return True
    return False


def _holds_secret(name: str, value: Any) -> bool:
    """Whether a constant a sandbox tool reads is secret-like by its name or its value (the
    REPL's code could read it back from the tool's globals): what a message would be scrubbed of."""
    if isinstance(value, str):
        return looks_secret(name, value)
    line = f"{name} = {value!r}"
    return redact(line, paths=False) != line


def _strip_decorators(source: str) -> str:
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("def ", "async def ")):
            return "\n".join(lines[i:]) + "\n"
    return source
