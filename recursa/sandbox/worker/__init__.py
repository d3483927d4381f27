"""The REPL worker: the standard-library-only program that runs generated code for one RLM run.

Nothing here imports recursa, and the host imports only what it shares with the worker (the frame
encoding in wire.py, the REPL for the in-process sandbox, the Landlock ABI probe). The worker
process itself does not run this file: start.py loads the folder as a package of its own.
"""
