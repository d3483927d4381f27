"""RLMEnv(max_memory_bytes=...): one memory bound over all the environment's live REPLs.

Each REPL's own cap is far above what these episodes take; only the environment's bound stops
them. Three episodes each hold 160 MiB under a 400 MiB bound: the kernel kills one of the REPLs'
processes, that episode's observation says why, and the others keep their state; a start while
the REPLs hold the bound is refused with a reason the trainer can read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recursa.env import ReplsFull, RLMEnv
from recursa.errors import ConfigError
from recursa.sandbox import cgroups

HOLD = 160 << 20
GRAB = f"held = bytearray({HOLD})\nfor i in range(0, len(held), 4096):\n    held[i] = 1\nprint('holding')"


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


def make_env(tmp_path: Path, bound: int | str | None) -> RLMEnv:
    return RLMEnv(max_depth=0, trace_dir=tmp_path, exec_timeout=60, max_memory_bytes=bound)


@pytest.mark.skipif(cgroups.memory_available() is None, reason="this host can make no memory control group")
async def test_the_environments_repls_together_stay_under_its_bound(tmp_path: Path) -> None:
    env = make_env(tmp_path, 400 << 20)
    episodes = []
    try:
        seen = []
        for n in range(3):
            episode = await env.start("q?", "ctx", task_id=f"t{n}")
            episodes.append(episode)
            seen.append((await episode.step(code(GRAB)))[0]["content"])
        assert env.memory_pool is not None and env.memory_pool.enforced is not None
        assert env.memory_pool.used() <= 400 << 20
        # A REPL killed while idle says so at its episode's next step; every episode goes on.
        for episode in episodes:
            obs = await episode.step(code("print(len(held))"))
            seen.append(obs[0]["content"])
            assert any(word in obs[0]["content"] for word in (str(HOLD), "restored", "restarted")), obs
        told = [text for text in seen if "together reached their memory bound (400 MiB)" in text]
        assert told, "\n----\n".join(seen)  # without the bound all three hold their 160 MiB
        assert sum(str(HOLD) in text for text in seen[3:]) >= 2, seen  # the others kept their state
    finally:
        for episode in episodes:
            await episode.close()
        await env.aclose()


async def test_a_start_is_refused_while_the_repls_hold_the_bound(tmp_path: Path) -> None:
    env = make_env(tmp_path, 128 << 20)
    first = await env.start("q?", "ctx")
    try:
        await first.step(code(f"held = bytearray({100 << 20})\nfor i in range(0, len(held), 4096):\n    held[i] = 1"))
        with pytest.raises(ReplsFull, match=r"max_memory_bytes=134217728.*close finished episodes"):
            await env.start("q?", "ctx")
    finally:
        await first.close()
        await env.aclose()


def test_a_bad_bound_names_the_option() -> None:
    with pytest.raises(ConfigError, match="max_memory_bytes"):
        RLMEnv(max_depth=0, max_memory_bytes=1000)
    assert RLMEnv(max_depth=0, max_memory_bytes=None).memory_pool is None
    assert RLMEnv(max_depth=0).memory_pool is not None  # bounded by default


def test_bounds_are_shared_within_one_sandbox_kind_only() -> None:
    # The SkyRL adapter shares one environment's bounds with the others of a process: a local
    # environment never takes a cluster's (or a thread sandbox's) memory bound for its own.
    threads = RLMEnv(max_depth=0, sandbox="inprocess")
    local, other = RLMEnv(max_depth=0), RLMEnv(max_depth=0)
    own_pool = local.memory_pool
    local.share_bounds(threads)
    assert local.quota is threads.quota and own_pool is not None and local.memory_pool is own_pool
    other.share_bounds(local)
    assert other.quota is threads.quota and other.memory_pool is own_pool
    for env in (threads, local, other):
        env.close()
