"""A REPL cell that floods the host with raw `call` frames: what it costs the host.

    python benchmarks/channel_flood.py [--seconds 3] [--delay 0.5]

The cell finds the worker's channel socket and writes `llm_query` call frames to it for
`--seconds`; the host's handler answers each after `--delay` seconds. Printed: frames the cell got
written, calls the handler served, the longest the host's event loop waited past a 5 ms tick, the
most asyncio tasks alive at once, and the host's peak RSS. Before the host applied backpressure
(recursa/sandbox/connection.py) one such cell held the loop for seconds and grew memory by
hundreds of MB; run it on an older checkout to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

from recursa.sandbox import SubprocessSandbox

CELL = """
import json, os, socket, time
fd = None
for n in range(3, 256):
    try:
        s = socket.socket(fileno=n)
    except OSError:
        continue
    try:
        if s.family == socket.AF_UNIX and s.type == socket.SOCK_STREAM:
            fd = n
    finally:
        s.detach()

def frame(obj):
    data = json.dumps(obj).encode()
    return len(data).to_bytes(4, "big") + data

# Sent as a call sends it (`lend=True`): the worker's reader thread then takes the host's replies
# off the channel while the cell writes. A cell that never has them read blocks only itself.
import gc
chan = next(o for o in gc.get_objects() if type(o).__name__ == "WorkerChannel")
chan.send({"op": "call", "id": 10**9 - 1, "fn": "llm_query", "args": {"prompt": "x"}}, lend=True)

blob = b"".join(frame({"op": "call", "id": 10**9 + i, "fn": "llm_query", "args": {"prompt": "x"}}) for i in range(2000))
end, sent = time.time() + SECONDS, 0
while time.time() < end:
    os.write(fd, blob)
    sent += 2000
print(sent)
"""


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long the cell writes (default 3)")
    parser.add_argument("--delay", type=float, default=0.5, help="seconds per handled call (default 0.5)")
    args = parser.parse_args()
    served = 0

    async def handler(fn: str, call: dict) -> str:
        nonlocal served
        served += 1
        await asyncio.sleep(args.delay)
        return "ok"

    sandbox = SubprocessSandbox()
    await sandbox.start(handler)
    lag = 0.0
    tasks = 0

    async def tick() -> None:
        nonlocal lag, tasks
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            lag = max(lag, time.perf_counter() - before - 0.005)
            tasks = max(tasks, len(asyncio.all_tasks()))

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    result = await sandbox.execute(CELL.replace("SECONDS", str(args.seconds)), timeout=600)
    took = time.perf_counter() - started
    after = await sandbox.execute("print('still answering')", timeout=30)
    ticker.cancel()
    await sandbox.close()
    rows = [
        ("frames written by the cell", result.stdout.strip() or result.error or "?"),
        ("calls the handler served", f"{served:,}"),
        ("cell duration", f"{took:.1f} s"),
        ("host loop: longest wait past a 5 ms tick", f"{lag * 1000:.1f} ms"),
        ("host: most asyncio tasks alive", f"{tasks:,}"),
        ("host: peak RSS", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB"),
        ("next cell", after.stdout.strip() or str(after.error)),
    ]
    width = max(len(name) for name, _ in rows) + 2
    for name, value in rows:
        print(f"{name:<{width}}{value}")


if __name__ == "__main__":
    asyncio.run(main())
