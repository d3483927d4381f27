"""A dry run of a cell right after a snapshot is taken, while the host waits for its model.

Forking the snapshot shares every page of this process with it, and the first write to a page
afterwards copies it (a copy-on-write fault: several microseconds on a virtual machine). An
ordinary cell writes a few hundred pages that the interpreter and the cell machinery reuse from
cell to cell: reference counts of shared objects, allocator pools, frames, the capture, the
decoded request and the encoded reply. Going through the same steps once on throwaway objects
takes those faults while nobody waits rather than in the next cell (benchmarks/turn_overhead.py:
the worker's exec time of a trivial cell 0.51 -> 0.32 ms with snapshots on).

It also runs once after the context is loaded, snapshots or not: the first cell would otherwise
import `ast` itself (about 2 ms on the critical path of the run's first cell, e.g. a fan-out's).

It touches no user state (a scratch namespace, a capture nobody reads, a reply encoded and
dropped). Its code runs with the builtins as they were when the worker started, so a cell that
replaced `builtins.print` does not have its replacement called here.
"""

from __future__ import annotations

import builtins

from .capture import Capture
from .wire import decode_frame, encode_frame

_FILE = "<rehearsal>"
_REQUEST = b'{"op":"exec","id":0,"code":"_x = 1\\nprint(_x)\\n_x","max_output_chars":20000}'
_BUILTINS = dict(vars(builtins))  # as they were before any cell ran
_compile, _exec, _eval, _repr, _int = compile, exec, eval, repr, int


def rehearse() -> None:
    import ast  # here, not at worker start-up: that does not need it

    request = decode_frame(_REQUEST)
    cap = Capture(_int(request["max_output_chars"]))
    scratch = {"__builtins__": _BUILTINS, "_out": cap.out}
    tree = ast.parse("_x = 1\nprint(_x, file=_out)\n_x", _FILE, "exec")
    last = tree.body.pop()
    _exec(_compile(tree, _FILE, "exec", dont_inherit=True), scratch)
    value = _eval(_compile(ast.Expression(last.value), _FILE, "eval", dont_inherit=True), scratch)
    cap.out.write(_repr(value) + "\n")
    stdout, stderr, omitted = cap.finish()
    encode_frame(
        {
            "op": "exec_done",
            "id": request["id"],
            "partial": None,
            "stdout": stdout,
            "stderr": stderr,
            "omitted_chars": omitted,
            "error": None,
            "final": None,
            "restored_names": [],
            "notes": [],
            "duration_s": 0.0,
        }
    )
