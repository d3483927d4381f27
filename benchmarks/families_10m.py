"""Every task family at 10M tokens (40M characters): generation time, and one RLM run with the
scripted gpt5-like root and the oracle sub-model (score, turns, sub-calls, wall time).

This is the "10M-token generation and oracle run" the test suite leaves out (it takes minutes).

    python benchmarks/families_10m.py [--tokens 10m] [--families niah,oolong,...] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from recursa.bench.sizes import CHARS_PER_TOKEN, parse_size
from recursa.methods.base import MethodSettings, get_method
from recursa.tasks import families, generate


async def one(family: str, tokens: int, seed: int, trace_dir: str) -> None:
    started = time.perf_counter()
    task = await asyncio.to_thread(generate, family, tokens * CHARS_PER_TOKEN, seed=seed)
    generated = time.perf_counter() - started
    settings = MethodSettings(model="scripted/gpt5-like", sub_model="scripted/oracle", trace_dir=trace_dir)
    started = time.perf_counter()
    result = await get_method("rlm").run(task, settings)
    ran = time.perf_counter() - started
    print(
        f"| {family} | {task.size_chars:,} | {generated:.1f} | {task.score(result.answer):.3f} | "
        f"{result.iterations} | {result.sub_calls:,} | {len(result.answer):,} | {ran:.1f} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="10m")
    parser.add_argument("--families", default=",".join(families()))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokens = parse_size(args.tokens)
    print(
        "| family | context chars | generate (s) | RLM score | turns | sub-calls | answer chars | RLM wall (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as trace_dir:
        for family in args.families.split(","):
            asyncio.run(one(family.strip(), tokens, args.seed, trace_dir))


if __name__ == "__main__":
    main()
