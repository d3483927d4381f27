"""`recursa acp` with a stdio MCP server: what a prompt costs when the session keeps its server
connected, beside a prompt that connects the server anew (a new session per prompt, which is what
every prompt paid when servers were connected per run).

Driven by the agent-client-protocol package's own client against `recursa acp` in a subprocess; the
root model is the fake OpenAI-compatible server (in process, no latency) replying with one REPL cell
that calls the MCP tool, then FINAL. The MCP server is a one-tool server on the `mcp` package.

    python benchmarks/acp_mcp.py [--prompts 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from recursa.testing.fake_server import FakeServer

SERVER = """
import os, sys
from mcp.server.mcpserver import MCPServer

server = MCPServer("bench")

def add(a: int, b: int) -> int:
    '''Add two integers.'''
    return a + b

server.add_tool(add)
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
server.run("stdio")
"""
REPO = Path(__file__).resolve().parent.parent


def responder(model: str, messages: list[dict[str, Any]]) -> str:
    done = sum(1 for m in messages if m["role"] == "assistant")
    return "```repl\nprint(add(1, 2))\n```" if done == 0 else "FINAL(3)"


class Quiet:
    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        pass

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def on_connect(self, conn: Any) -> None:
        pass


async def measure(prompts: int, folder: Path, base_url: str) -> dict[str, list[float]]:
    from acp import PROTOCOL_VERSION, spawn_agent_process, text_block
    from acp.schema import McpServerStdio

    script = folder / "server.py"
    script.write_text(SERVER)
    starts = folder / "starts"
    starts.mkdir()
    stdio = McpServerStdio(name="bench", command=sys.executable, args=[str(script), str(starts)], env=[])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENAI_API_KEY": "sk-bench"}
    args = ["-m", "recursa.cli", "acp", "--model", "openai/root", "--base-url", base_url,
            "--trace-dir", str(folder / "traces")]  # fmt: skip
    times: dict[str, list[float]] = {"kept": [], "anew": []}
    async with spawn_agent_process(Quiet(), sys.executable, *args, env=env) as (conn, _proc):
        await conn.initialize(protocol_version=PROTOCOL_VERSION)
        session = await conn.new_session(cwd=str(folder), mcp_servers=[stdio])
        for i in range(prompts + 1):  # the first prompt warms the agent (imports, REPL start)
            start = time.perf_counter()
            await conn.prompt(session_id=session.session_id, prompt=[text_block(f"go {i}")])
            if i:
                times["kept"].append(time.perf_counter() - start)
        for i in range(prompts):
            start = time.perf_counter()
            fresh = await conn.new_session(cwd=str(folder), mcp_servers=[stdio])
            await conn.prompt(session_id=fresh.session_id, prompt=[text_block(f"again {i}")])
            times["anew"].append(time.perf_counter() - start)
            await conn.close_session(session_id=fresh.session_id)
    times["starts"] = [float(len(list(starts.iterdir())))]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5, help="prompts timed each way")
    args = parser.parse_args()
    with FakeServer(responder=responder) as fake, tempfile.TemporaryDirectory() as tmp:
        times = asyncio.run(measure(args.prompts, Path(tmp), fake.base_url))
    kept, anew = statistics.median(times["kept"]), statistics.median(times["anew"])
    print(f"{args.prompts} prompts each way; load average {os.getloadavg()[0]:.2f}")
    print("| MCP server | median prompt (s) | server starts |")
    print("| --- | --- | --- |")
    print(f"| kept by the session | {kept:.3f} | 1 |")
    print(f"| connected per prompt | {anew:.3f} | {args.prompts} |")
    print(f"(starts counted: {int(times['starts'][0])}; saved per prompt: {anew - kept:.3f} s)")


if __name__ == "__main__":
    main()
