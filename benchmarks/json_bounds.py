"""What a request body costs `recursa serve` before it is refused or handed on: the standard parser
against the bounded one (recursa.serve.json_limits), in seconds and in peak memory, on a flood of
tiny messages, on a legitimate large document, and on an everyday request (a chat with tools,
past the 64 brackets that send a body through the count), timed over many requests.

    python benchmarks/json_bounds.py [--messages 4000000] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from recursa.serve.json_limits import TooMuchJSON, loads_bounded


def _measure(parse: Callable[[bytes], Any], raw: bytes, memory: bool, repeat: int) -> tuple[float, float, str]:
    if memory:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        for _ in range(repeat):
            parse(raw)
        outcome = "parsed"
    except TooMuchJSON:
        outcome = "refused"
    seconds = (time.perf_counter() - started) / repeat
    peak = 0
    if memory:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return seconds, peak / 1e6, outcome


def _everyday() -> bytes:
    """A chat of 40 turns with 8 function tools: some 30 KB and 400 brackets."""
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a record up, by id [or name], in the archive.",
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "string"}, "fields": {"type": "array", "items": {"type": "string"}}},
                "required": ["id"],
            },
        },
    }
    messages = [{"role": "system", "content": "You are careful; cite {sources} as [1], [2]."}]
    for i in range(40):
        messages.append({"role": "user", "content": f"Question {i}: what happened to record {i}, and why?"})
        messages.append({"role": "assistant", "content": f"Record {i} was archived [{i}] on day {i * 3}."})
    body = {"model": "recursa", "messages": messages, "tools": [tool] * 8, "temperature": 0.2}
    return json.dumps(body).encode()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=4_000_000)
    parser.add_argument("--repeat", type=int, default=2_000, help="times the everyday request is parsed")
    args = parser.parse_args()
    flood = (
        b'{"model": "recursa", "messages": ['
        + b'{"role":"user","content":"x"},' * args.messages
        + b'{"role":"user","content":"q"}]}'
    )
    text = "A line of a long report, with commas, [brackets] and {braces}.\n" * 1_000_000
    document = json.dumps({"model": "recursa", "messages": [{"role": "user", "content": text}]}).encode()
    bodies = (
        (f"{args.messages:,} tiny messages", flood, 1),
        ("one 64 MB document", document, 1),
        ("an everyday chat request", _everyday(), args.repeat),
    )
    print(f"{'body':<28}{'KB':>10}{'parser':>14}{'ms':>10}{'peak MB':>10}  outcome")
    for name, raw, repeat in bodies:
        for label, parse in (("json.loads", json.loads), ("loads_bounded", loads_bounded)):
            seconds, _, outcome = _measure(parse, raw, False, repeat)
            _, peak, _ = _measure(parse, raw, True, 1)
            ms = f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.0f}"
            print(f"{name:<28}{len(raw) / 1e3:>10,.0f}{label:>14}{ms:>10}{peak:>10.0f}  {outcome}")


if __name__ == "__main__":
    main()
