"""Cached sub-calls (`cache_subcalls=True`): sub-calls sent and what they cost, with and without.

A GRPO-style group: `--group` samples of one generated task, stepped as `RLMEnv` episodes of one
`task_id` by scripted roots (the trainer's engine, in process) of two personas, `gpt5-like` and
`qwen-coder-like`, alternating: samples of one persona repeat each other's sub-calls exactly,
samples of the other batch the same lines differently, so only part of the group's work repeats.
Sub-calls go over HTTP to the fake OpenAI-compatible server's `scripted/oracle`, priced at
`--price` (input, output USD per million tokens; default gpt-5-mini's list price). Every task
family is run once with the cache off and once on; the answers must be the same.

    python benchmarks/subcall_cache.py [--families oolong,niah,multihop-docs,codeqa] [--group 8] [--chars 80000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from dataclasses import dataclass

from recursa.env import RLMEnv
from recursa.scripted import get_policy
from recursa.tasks import generate
from recursa.testing.fake_server import FakeServer

PERSONAS = ("gpt5-like", "qwen-coder-like")
SUB = "scripted/oracle"


@dataclass
class Outcome:
    sent: int = 0
    hits: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    saved_usd: float = 0.0
    answers: tuple[str, ...] = ()


async def run_group(server: FakeServer, task, group: int, cache: bool, prices: dict, workdir: str) -> Outcome:
    server.reset()
    env = RLMEnv(
        f"openai/{SUB}",
        model="openai/policy",  # the trainer's engine writes the root's turns: never called
        base_url=server.base_url,
        api_key="bench",
        trace=False,
        trace_dir=workdir,
        prices=prices,
        cache_subcalls=cache,
        max_turns=12,
    )
    out = Outcome()

    async def sample(i: int) -> str:
        policy = get_policy(PERSONAS[i % len(PERSONAS)])
        episode = await env.start(task.question, task.context, task_id=task.id)
        try:
            while not episode.done:
                reply = await asyncio.to_thread(policy, episode.messages)
                await episode.step(reply)
            sub = episode.usage.by_model.get(f"openai/{SUB}")
            if sub is not None:
                out.hits += sub.cache_hits
                out.saved_usd += sub.cache_saved_usd
                out.cost_usd += sub.cost_usd
            return episode.answer
        finally:
            await episode.close()

    try:
        answers = await asyncio.gather(*(sample(i) for i in range(group)))
    finally:
        await env.aclose()
    subs = [r for r in server.requests if r.model == SUB and r.ok]
    out.sent = len(subs)
    out.input_tokens = sum(r.prompt_tokens for r in subs)
    out.output_tokens = sum(r.completion_tokens for r in subs)
    out.answers = tuple(answers)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="oolong,niah,multihop-docs,codeqa")
    parser.add_argument("--group", type=int, default=8, help="samples of one task (episodes of one task_id)")
    parser.add_argument("--chars", type=int, default=80_000, help="context size of each task, in characters")
    parser.add_argument("--price", default="0.25,2.0", help="sub-model input,output USD per million tokens")
    args = parser.parse_args()
    rate_in, rate_out = (float(v) for v in args.price.split(","))
    prices = {f"openai/{SUB}": {"input_per_mtok": rate_in, "output_per_mtok": rate_out}}
    print(
        f"group of {args.group} samples ({' / '.join(PERSONAS)} alternating), contexts of "
        f"{args.chars:,} characters, sub-calls priced at ${rate_in}/${rate_out} per M in/out; load "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'family':14} {'cache':>5} {'sub-calls sent':>14} {'cache hits':>10} {'input tok':>10} "
        f"{'sub cost $':>11} {'saved $':>9} {'saved':>6}"
    )
    with FakeServer(latency_s=0.0) as server, tempfile.TemporaryDirectory() as workdir:
        for family in args.families.split(","):
            task = generate(family, args.chars, seed=7)
            off = asyncio.run(run_group(server, task, args.group, False, prices, workdir))
            on = asyncio.run(run_group(server, task, args.group, True, prices, workdir))
            if off.answers != on.answers:
                print(
                    f"failed: {family}: the answers differ with the cache on: {off.answers} vs {on.answers}"
                )
            for label, o in (("off", off), ("on", on)):
                saved = 1 - o.cost_usd / off.cost_usd if off.cost_usd else 0.0
                print(
                    f"{family:14} {label:>5} {o.sent:>14} {o.hits:>10} {o.input_tokens:>10,} "
                    f"{o.cost_usd:>11.5f} {o.saved_usd:>9.5f} {saved:>6.0%}"
                )


if __name__ == "__main__":
    main()
