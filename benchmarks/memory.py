"""Peak memory and trace size against context size.

For each size: peak RSS of the host process and of the REPL worker above their baselines (the
host's baseline is taken after the context string exists: it is the user's own object), the peak
of the machine's shared memory (where the context's memfd is counted: no RSS shows it), the sum
over the context size; and the trace file's size. The sum adds three peaks that need not happen
at once (the buffer shrinks as the worker's copy grows), so it is an upper bound.

    python benchmarks/memory.py [--sizes-mb 10,100,500] [--kind str|list]
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, resource
from pathlib import Path
size, kind, tmp = int(sys.argv[1]), sys.argv[2], sys.argv[3]

def hwm(pid="self"):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
def rss(pid="self"):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

from recursa import RLM
line = "Date: Jan 01, 2020 || User: 12345 || Instance: what is the capital of some country?\n"
if kind == "str":
    context = line * (size // len(line))
else:
    context = [line * 100] * (size // (len(line) * 100))
    context = [s[:-1] + str(i) for i, s in enumerate(context)]  # distinct objects, like real data
peaks = {}
def on_event(e):
    pass
# Peak of the worker is read from inside the run: the generated code reports its own VmHWM.
code = "import os\nhwm=[l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\nFINAL(hwm.split()[1])"
from recursa.scripted import register
os.environ["RECURSA_MEM_CODE"] = code
import recursa.scripted as s
@register("mem-root")
def _factory():
    return lambda messages: "```repl\n" + code + "\n```"
import threading, time
def shmem():
    for line in open("/proc/meminfo"):
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
shm = {"base": shmem(), "peak": 0, "on": True}
def sample():
    while shm["on"]:
        shm["peak"] = max(shm["peak"], shmem() - shm["base"])
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
base = rss()
# reset the host's high-water mark so the peak is measured from here (Linux >= 4.0)
open("/proc/self/clear_refs", "w").write("5")
rlm = RLM("scripted/mem-root", trace_dir=tmp)
r = rlm.run("q", context)
worker_peak = int(r.answer) * 1024
host_peak = hwm()
shm["on"] = False
print(json.dumps({"host_extra": host_peak - base, "worker_peak": worker_peak, "buffer_peak": shm["peak"],
                  "trace_bytes": os.path.getsize(r.trace_path), "chars": sum(map(len, context)) if kind != "str" else len(context)}))
"""


def worker_baseline() -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "1000", "str", tempfile.mkdtemp()],
        capture_output=True,
        text=True,
        check=True,
    )
    import json

    return json.loads(out.stdout)["worker_peak"]


def main() -> None:
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="10,100,500")
    ap.add_argument("--kind", default="str", choices=["str", "list"])
    args = ap.parse_args()
    wbase = worker_baseline()
    print(f"context kind: {args.kind}; worker baseline RSS {wbase / 2**20:.1f} MB")
    print(
        f"{'MB':>6} {'host +MB':>9} {'buffer +MB':>11} {'worker +MB':>11} {'total/ctx':>10} {'trace KB':>9}"
    )
    for mb in (int(x) for x in args.sizes_mb.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(mb * 2**20), args.kind, tmp], capture_output=True, text=True
            )
            if out.returncode:
                print(out.stderr[-2000:])
                continue
            row = json.loads(out.stdout)
        chars = row["chars"]
        host, buffer, worker = row["host_extra"], row["buffer_peak"], row["worker_peak"] - wbase
        print(
            f"{chars / 2**20:>6.0f} {host / 2**20:>9.1f} {buffer / 2**20:>11.1f} {worker / 2**20:>11.1f} "
            f"{(host + buffer + worker) / chars:>10.2f} {row['trace_bytes'] / 1024:>9.1f}"
        )
        gc.collect()


if __name__ == "__main__":
    main()
