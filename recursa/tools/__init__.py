"""User tools: functions the REPL can call (in the sandbox or in the host) and tools for sub-models.

Internal (docs/reference/python.md): `recursa.host_tool` is the public name; import the rest from
the modules.
"""
