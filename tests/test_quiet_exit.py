"""Nothing recursa starts is left pending or prints at interpreter exit: a fresh process uses and
closes each public object with a blocking front door (RLM.run, a Session, RLMEnv's sync episode,
DSPy's RecursaInterpreter, the fake model server) and its stderr stays empty."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The sandbox's process guard polls every 50 ms; a shutdown inside that window left its task
# pending on a stopped loop. A long poll holds every shutdown inside the window, so the check
# does not depend on timing. At the end, whatever is still pending is destroyed as exit would.
SCRIPT = textwrap.dedent(
    """
    import gc, importlib.util
    import recursa.sandbox.guard as guard
    guard.POLL_S = 30.0

    from recursa import RLM
    from recursa.env import RLMEnv
    from recursa.testing.fake_server import FakeServer

    rlm = RLM("scripted/gpt5-like", sub_model="scripted/oracle", trace=False)
    assert rlm.run("How many words?", context="one two three").stop_reason == "final"
    session = rlm.session("one two three")
    session.ask("How many words?")
    session.close()

    env = RLMEnv(sub_model="scripted/oracle", trace=False)
    episode = env.start_sync("How many words?", "one two three")
    episode.step_sync("```repl\\nFINAL(len(context.split()))\\n```")
    assert episode.done
    episode.close_sync()
    env.close()

    if importlib.util.find_spec("dspy") is not None:
        from recursa.integrations.dspy import RecursaInterpreter
        interpreter = RecursaInterpreter()
        interpreter.execute("x = 1 + 1")
        interpreter.shutdown()

    with FakeServer() as server:
        assert server.base_url

    del rlm, session, env, episode
    guard._Watcher._by_loop.clear()  # what interpreter exit does to the class's registry
    gc.collect()
    """
)


def test_nothing_is_pending_or_printed_at_exit(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
