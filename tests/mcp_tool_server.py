"""An MCP server for the MCP-tools tests, on the `mcp` package's own server: run as a script it
serves stdio; `build(name)` gives the server for its streamable-HTTP app.

    python tests/mcp_tool_server.py NAME    # tools prefixed by nothing; NAME shows in `whoami`

With STARTS_DIR in its environment, each start leaves a file named by its pid there.
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel


class Weather(BaseModel):
    city: str
    celsius: float


def build(name: str) -> MCPServer:
    server = MCPServer(name)

    def add(a: int, b: int = 10) -> int:
        """Add two integers."""
        return a + b

    def pid() -> int:
        """This server's process id."""
        return os.getpid()

    def whoami() -> str:
        """Name this server, and whether the host's API key reached its environment."""
        return f"{name} key={os.environ.get('OPENAI_API_KEY', 'absent')} token={os.environ.get('TOOL_TOKEN', 'none')}"

    def weather(city: str) -> Weather:
        """Today's weather in a city (structured output)."""
        return Weather(city=city, celsius=21.5)

    def fail(reason: str) -> str:
        """Always fails with `reason`."""
        raise ToolError(f"cannot do it: {reason}")

    def big(n: int) -> str:
        """Return n characters."""
        return "x" * n

    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return "late"

    def search_docs(query: str, limit: int = 3) -> list[str]:
        """Search the docs."""
        return [f"{query} result {i}" for i in range(limit)]

    for fn in (add, pid, whoami, weather, fail, big, slow, search_docs):
        server.add_tool(fn)
    server.add_tool(
        lambda text: text.upper(), name="print", description="Shout text (a name that would hide a builtin)."
    )
    return server


if __name__ == "__main__":
    if os.environ.get("STARTS_DIR"):
        open(os.path.join(os.environ["STARTS_DIR"], str(os.getpid())), "w").close()
    build(sys.argv[1] if len(sys.argv) > 1 else "stdio").run("stdio")
