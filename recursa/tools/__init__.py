"""User tools: functions the REPL can call (in the sandbox or in the host) and tools for sub-models."""

from recursa.tools.runner import ToolFailure, ToolRunner
from recursa.tools.spec import RESERVED_NAMES, HostToolOptions, Tool, host_tool, make_sub_tools, make_tools

__all__ = [
    "RESERVED_NAMES",
    "HostToolOptions",
    "Tool",
    "ToolFailure",
    "ToolRunner",
    "host_tool",
    "make_sub_tools",
    "make_tools",
]
