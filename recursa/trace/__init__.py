"""Run traces: JSONL events written as they happen, read back as a tree."""

from recursa.trace.reader import RunNode, Trace, load
from recursa.trace.writer import TRACE_FORMAT

__all__ = [
    "TRACE_FORMAT",
    "RunNode",
    "Trace",
    "load",
]
