"""What the root is told when a reply did not move the run on: no code, an empty reply, fenced code
that did not run, or the last call for an answer."""

from __future__ import annotations

from recursa.loop.parse import Reply
from recursa.sandbox.base import ExecResult

NO_CODE_MESSAGE = (
    "Your reply had no ```repl code block and no final answer, so nothing ran. Write code in a "
    "block that starts with ```repl and ends with ``` on a line of its own, or answer with FINAL(...) / "
    "FINAL_VAR(name): when you have the answer, write FINAL(your answer) on a line of its own, with "
    "the parentheses, or FINAL_VAR(name) for a variable you already assigned in the REPL."
)
LAST_CALL_MESSAGE = (
    "You have used all {n} turns. No more code will run. Reply now with your final answer on a line "
    "of its own: FINAL(your answer), or FINAL_VAR(variable_name) for a value already in the REPL."
)


def fence_hint(parsed: Reply) -> str:
    """Why fenced code in the reply did not run, when it had some."""
    if not parsed.skipped_tags:
        return ""
    tags = sorted({f"```{t}" for t in parsed.skipped_tags if t})
    bare = sum(1 for t in parsed.skipped_tags if not t)
    kinds = ", ".join([*tags, *(["a bare ```"] if bare else [])])
    n = len(parsed.skipped_tags)
    what = (
        "a code fence without the `repl` tag; it did not run"
        if n == 1
        else f"{n} code fences without the `repl` tag; they did not run"
    )
    return f" (Your reply had {what} ({kinds}). Only blocks opened with ```repl or ```python run.)"


def why_stop_after(
    res: ExecResult, unfenced: bool, blocks_left: int, *, out_of_reply_time: float | None = None
) -> str | None:
    """Why the rest of a reply's blocks do not run after this one (the note for the model), or None.

    - Code written outside a fence that answers: as with a prose FINAL next to code, the model has
      not seen the output, so the answer waits for it.
    - The reply's time for code ran out (`out_of_reply_time`: its seconds, when this block was cut
      by it or ended with none of it left): its blocks together may take no longer than that.
    - A block that ran out of time: the later ones would start from its unfinished state, and since
      each may take the whole timeout, a reply of many blocks that all loop forever (a degenerate
      generation) would hold the turn that many times over.
    """
    if res.final is not None and unfenced:
        protocol = res.final.protocol
        how = 'set answer["ready"]' if protocol == "answer" else f"called {protocol}(...)"
        return (
            f"Your code {how} in the same reply that wrote the code, before you had seen its output, so "
            "it was not taken as the answer. If the output confirms it, give the answer again in your next "
            "reply."
        )
    if res.final is not None:
        return None
    later = f"the {blocks_left} block(s) after it in your reply were not run"
    if out_of_reply_time is not None and (res.timed_out or blocks_left > 0):
        budget = f"The time for all the code of one reply ({out_of_reply_time:g} s for its blocks together)"
        if not res.timed_out:
            return f"{budget} was used up by the end of this block, so {later}. Do less per reply."
        what = (
            f"so this block was interrupted and {later}" if blocks_left else "so this block was interrupted"
        )
        return f"{budget} ran out during this block, {what}. Split the work over several replies."
    if res.timed_out and blocks_left > 0:
        return (
            f"This block ran out of time, so {later} (they would have started from its unfinished "
            "state). Make this step faster, then send the rest again."
        )
    return None
