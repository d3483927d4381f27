"""The dry run of a cell that the worker makes after each snapshot (sandbox/worker/rehearsal.py)."""

from __future__ import annotations

import asyncio
import builtins
import json
from typing import Any

import pytest

from recursa.context import build_payload
from recursa.sandbox import SubprocessSandbox
from recursa.sandbox.worker import rehearsal


def test_rehearsal_leaves_no_trace_and_calls_no_replaced_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(builtins, "print", lambda *args, **kw: calls.append(args))
    before = set(vars(builtins))
    rehearsal.rehearse()
    assert calls == []
    assert set(vars(builtins)) == before


async def test_a_cell_that_replaced_print_is_not_run_between_cells() -> None:
    async def host(fn: str, args: dict[str, Any]) -> Any:
        return None

    sb = SubprocessSandbox()
    await sb.start(host)
    try:
        first = await sb.execute(
            "import builtins\n"
            "seen = []\n"
            "_print = builtins.print\n"
            "builtins.print = lambda *a, **k: (seen.append(a), _print(*a, **k))",
            30,
        )
        assert first.error is None
        await asyncio.sleep(0.2)  # the snapshot is taken and the rehearsal runs while we wait
        second = await sb.execute(
            "import json\nprint(json.dumps([len(seen), sorted(k for k in globals() if k == '_x')]))", 30
        )
        assert second.error is None and not second.restarted
        # One call: this cell's own print. The rehearsal neither reached the user's replacement
        # nor left its scratch variable in the user's namespace.
        assert json.loads(second.stdout.splitlines()[0]) == [0, []]
    finally:
        await sb.close()


@pytest.mark.parametrize("snapshots", [True, False])
async def test_the_rehearsal_after_the_context_leaves_the_first_cell_as_it_was(snapshots: bool) -> None:
    # After load_context the worker also rehearses (the first cell's one-time work, `import ast`,
    # then happens while the host waits for its model), with or without snapshots.
    async def host(fn: str, args: dict[str, Any]) -> Any:
        return None

    sb = SubprocessSandbox(snapshots=snapshots)
    await sb.start(host)
    try:
        await sb.load_context(build_payload("the context"))
        await asyncio.sleep(0.2)  # the rehearsal runs while we wait
        first = await sb.execute(
            "import json\nprint(json.dumps([context, sorted(k for k in globals() if k in ('_x', '_out'))]))",
            30,
        )
        assert first.error is None and not first.restarted
        assert json.loads(first.stdout.splitlines()[0]) == ["the context", []]
    finally:
        await sb.close()
