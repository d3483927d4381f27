"""What a model's text may do to the terminal it is printed on: show itself, nothing more.

An answer is the model's, and through a document in the context anyone's: escape sequences in it
would move the cursor, retitle the window, overwrite what was printed before, or (OSC 52, in some
terminals) write the clipboard. On a terminal every control character but newline and tab is shown
as its escape; output that goes to a pipe or a file is data, and is left as it is.
"""

from __future__ import annotations

import re
from typing import TextIO

# C0 controls but \t and \n, DEL, and the C1 controls (\x9b is a one-character CSI).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def for_terminal(text: str, stream: TextIO) -> str:
    """`text` as it may be printed on `stream`."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no such method, or a closed stream
        tty = False
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text) if tty else text
