"""A TCP port as a command-line flag takes it: every `--port` of the servers goes through `port`."""

from __future__ import annotations

import argparse

MAX_PORT = 65_535


def port(text: str) -> int:
    """argparse's `type=` for a port: a whole number from 0 (any free port) to 65535.

    argparse reports the error as "argument --port: ...", so the message names the flag."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a port number: give a whole number from 0 (any free port) to {MAX_PORT}"
        ) from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"{value} is not a port: give a number from 0 (any free port) to {MAX_PORT}"
        )
    return value
