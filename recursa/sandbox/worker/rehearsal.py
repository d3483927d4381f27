"""A dry run of a cell right after a snapshot is taken, while the host waits for its model.

Forking the snapshot shares every page of this process with it, and the first write to a page
afterwards copies it (a copy-on-write fault: several microseconds on a virtual machine). An
ordinary cell writes a few hundred pages that the interpreter and the cell machinery reuse from
cell to cell: reference counts of shared objects, allocator pools, frames, the capture, the
decoded request and the encoded reply. Going through the same steps once on throwaway objects
takes those faults while nobody waits rather than in the next cell (docs/performance.md, "Figures behind choices in the code").

It also runs once after the context is loaded, snapshots or not: the first cell would otherwise
import `ast` itself, on the critical path of the run's first cell (e.g. a fan-out's).

It touches no user state: the cell runs in a REPL of its own (its own namespace and capture; it
never swaps sys.stdout), and the reply is encoded and dropped. Its code runs with the builtins as
they were when the worker started, so a cell that replaced `builtins.print` does not have its
replacement called here. The server also lends the channel's reading to its reader thread and takes
it back once, for that path's faults (server.py).
"""

from __future__ import annotations

import builtins

from .repl import Repl
from .wire import decode_frame, encode_frame

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# No print(): the scratch REPL's own print calls builtins.print, which a cell may have replaced.
_REQUEST = b'{"op":"exec","id":0,"code":"_x = 1\\n_x","max_output_chars":20000}'
_BUILTINS = dict(vars(builtins))  # as they were before any cell ran
_scratch: Repl | None = None


def rehearse() -> None:
    """One cell through the REPL's own code (which imports `ast` on first use), in a REPL of its
    own (made on first use, and kept: its objects are then the same pages every time), then its
    answer encoded and dropped."""
    global _scratch
    if _scratch is None:
        _scratch = Repl(_no_host, own_print=True)  # own print: sys.stdout is never swapped here
        _scratch.ns["__builtins__"] = _BUILTINS
    request = decode_frame(_REQUEST)
    reply = _scratch.execute(str(request["code"]), int(request["max_output_chars"]))
    encode_frame({"op": "exec_done", "id": request["id"], **reply})


def _no_host(fn: str, args: dict[str, Any]) -> Any:
    raise RuntimeError("the rehearsal makes no calls")
