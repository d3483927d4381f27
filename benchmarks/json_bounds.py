"""What a hostile request body costs `recursa serve` before it is refused: the standard parser
against the bounded one (recursa.serve.json_limits), in seconds and in peak memory, on a flood of
tiny messages and on a legitimate large document.

    python benchmarks/json_bounds.py [--messages 4000000]
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from recursa.serve.json_limits import TooMuchJSON, loads_bounded


def _measure(parse: Callable[[bytes], Any], raw: bytes, memory: bool) -> tuple[float, float, str]:
    if memory:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        parse(raw)
        outcome = "parsed"
    except TooMuchJSON:
        outcome = "refused"
    seconds = time.perf_counter() - started
    peak = 0
    if memory:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return seconds, peak / 1e6, outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=4_000_000)
    args = parser.parse_args()
    flood = (
        b'{"model": "recursa", "messages": ['
        + b'{"role":"user","content":"x"},' * args.messages
        + b'{"role":"user","content":"q"}]}'
    )
    text = "A line of a long report, with commas, [brackets] and {braces}.\n" * 1_000_000
    document = json.dumps({"model": "recursa", "messages": [{"role": "user", "content": text}]}).encode()
    print(f"{'body':<28}{'MB':>8}{'parser':>14}{'seconds':>10}{'peak MB':>10}  outcome")
    for name, raw in ((f"{args.messages:,} tiny messages", flood), ("one 64 MB document", document)):
        for label, parse in (("json.loads", json.loads), ("loads_bounded", loads_bounded)):
            seconds, _, outcome = _measure(parse, raw, memory=False)
            _, peak, _ = _measure(parse, raw, memory=True)
            print(f"{name:<28}{len(raw) / 1e6:>8.0f}{label:>14}{seconds:>10.2f}{peak:>10.0f}  {outcome}")


if __name__ == "__main__":
    main()
