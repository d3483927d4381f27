"""How a stuck or dead REPL was replaced, and what the model is told about its variables.

Three ways, from best to worst:
- `snapshot`: the worker's waiting snapshot took over, with the state from before the cell;
- `fresh`: no cell had run since the worker started, so starting one again (context and
  definitions replayed) restores that state exactly; the worker keeps no snapshot of it;
- `restart`: there was no snapshot to take over, and every variable is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Where the REPL was lost: while running a cell, found dead between cells, or reading a variable.
Where = Literal["cell", "between", "read"]


@dataclass(frozen=True)
class Recovery:
    how: Literal["snapshot", "fresh", "restart"]
    reloaded: bool  # the context was loaded into the new worker again
    why_not: str = ""  # why no snapshot took over (for `restart`)
    restored: dict[str, Any] = field(default_factory=dict)  # the snapshot's `restored` frame

    @property
    def kept(self) -> bool:
        """Whether the state from before the cell is back."""
        return self.how != "restart"

    def note(self, what: str, where: Where) -> str:
        """The sentence for the model; `what` says what happened ("the REPL process died (...)")."""
        reload = " (`context` is loaded again)" if self.reloaded else ""
        if self.how == "fresh":
            if where == "cell":
                return (
                    f"{what}; the REPL was restored to its state before this cell (started again{reload}: "
                    "no earlier cell had run, so nothing else was lost)."
                )
            return f"{what} before any code ran; it was started again{reload}."
        if self.how == "snapshot":
            lost = self._lost_with_the_process()
            if where == "cell":
                return (
                    f"{what}; the REPL was restored to its state before this cell: variables this cell set or "
                    f"changed are lost, earlier ones are kept.{lost}"
                )
            return (
                f"{what}; it was restored {'from a snapshot of' if where == 'between' else 'to'} its state at "
                f"the end of your last code block, so your variables are kept.{lost}"
            )
        gone = f"all variables were lost{reload} (no snapshot to restore from: {self.why_not})"
        if where == "cell":
            return f"{what}; the REPL was restarted and {gone}"
        return f"{what}{' and was' if where == 'between' else ', so it was'} restarted: {gone}."

    def _lost_with_the_process(self) -> str:
        """What a snapshot cannot bring back: threads and processes the old worker was running."""
        out = ""
        threads, procs = self.restored.get("threads_lost"), self.restored.get("strays_killed")
        if isinstance(threads, int) and threads > 0:
            out += f" {threads} thread(s) started by earlier code are no longer running."
        if isinstance(procs, int) and procs > 0:
            out += f" {procs} process{'es' if procs > 1 else ''} started by earlier code were stopped."
        return out
