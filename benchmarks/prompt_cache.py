"""Provider prompt caching: the billed input cost of a 20-turn root, before and after.

One RLM run whose root writes `--turns` code turns (each printing `--output-chars` of REPL output,
so the history grows every turn) and then answers, against the fake server in each API shape:

- Anthropic Messages (`anthropic/claude-sonnet-4-5`): before, the requests carry no `cache_control`
  marks (the same client with marking turned off), so nothing is cached; after, recursa marks the
  system prompt and the last two user turns and the fake server writes and reads the cache as
  Anthropic does (writes at 1.25x input, reads at 0.1x, prefixes of at least 1,024 tokens).
- OpenAI Chat Completions (`openai/gpt-5-mini`): the provider caches any repeated prefix on its own
  (recursa keeps the root's history append-only and sends `prompt_cache_key` to api.openai.com);
  before is a server without a prefix cache, after the fake server's vLLM-style block cache.

Costs are recursa's own accounting (`result.usage`, priced by genai-prices at list prices), and
the fake server's counts of read and written tokens are shown beside them.

    python benchmarks/prompt_cache.py [--turns 20] [--output-chars 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from typing import Any

from recursa import RLM
from recursa.lm.anthropic_client import AnthropicClient
from recursa.lm.base import LMRequest, LMResponse
from recursa.testing.fake_server import FakeServer

SHAPES = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-5-mini"}


class Unmarked(AnthropicClient):
    """The Anthropic client as it was before prompt caching: no cache_control marks."""

    async def complete(self, request: LMRequest) -> LMResponse:
        request.cache_key = None
        return await super().complete(request)


def responder(turns: int, output_chars: int):
    def respond(model: str, messages: list[dict[str, Any]]) -> str:
        done = sum(1 for m in messages if m["role"] == "assistant")
        if done >= turns:
            return "FINAL(done)"
        return f"Step {done}.\n```repl\nprint('{done}:' + 'x' * {output_chars})\n```"

    return respond


async def run(shape: str, cached: bool, turns: int, output_chars: int, workdir: str) -> tuple[Any, dict]:
    model = SHAPES[shape]
    server = FakeServer(responder=responder(turns, output_chars), cache_blocks=65_536 if cached else 0)
    with server:
        url = server.root_url if shape == "anthropic" else server.base_url
        root: Any = f"{shape}/{model}"
        if shape == "anthropic" and not cached:
            root = Unmarked(model, base_url=url, api_key="bench")
        rlm = RLM(
            root,
            base_url=url,
            api_key="bench",
            max_depth=0,
            max_iterations=turns + 5,
            max_output_chars=output_chars + 200,
            trace_dir=workdir,
            sandbox="inprocess" if os.environ.get("RECURSA_BENCH_INPROCESS") else "auto",
        )
        try:
            result = await rlm.arun("Run the steps, then answer.", "a small context")
        finally:
            if isinstance(root, Unmarked):
                await root.aclose()  # a client object given to RLM is its owner's to close
        seen = {
            "requests": len(server.requests),
            "read": sum(r.cached_tokens for r in server.requests),
            "written": sum(r.cache_write_tokens for r in server.requests),
        }
    return result, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--output-chars", type=int, default=3000)
    args = parser.parse_args()
    print(
        f"{args.turns}-turn root, {args.output_chars:,} characters of REPL output a turn; load "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'shape':10} {'model':18} {'cache':>6} {'calls':>5} {'input tok':>10} {'read':>9} "
        f"{'written':>8} {'input $':>9} {'total $':>9} {'input saved':>11}"
    )
    with tempfile.TemporaryDirectory() as workdir:
        for shape, model in SHAPES.items():
            before_input = None
            for cached in (False, True):
                result, seen = asyncio.run(run(shape, cached, args.turns, args.output_chars, workdir))
                if result.stop_reason != "final":
                    print(
                        f"failed: {shape} ({'after' if cached else 'before'}) stopped: {result.stop_reason}"
                    )
                u = result.usage
                out_cost = u.output_tokens * output_rate(result, shape, model)
                input_cost = u.cost_usd - out_cost
                if before_input is None:
                    before_input = input_cost
                saved = 1 - input_cost / before_input if before_input else 0.0
                print(
                    f"{shape:10} {model:18} {'after' if cached else 'before':>6} {u.llm_calls:>5} "
                    f"{u.input_tokens:>10,} {u.cached_tokens:>9,} {u.cache_write_tokens:>8,} "
                    f"{input_cost:>9.4f} {u.cost_usd:>9.4f} {saved:>11.0%}"
                )
                if (seen["read"], seen["written"]) != (u.cached_tokens, u.cache_write_tokens):
                    print(
                        f"failed: the server counted {seen} but the run {u.cached_tokens} read, "
                        f"{u.cache_write_tokens} written"
                    )


def output_rate(result: Any, shape: str, model: str) -> float:
    """USD per output token at the model's list price (to split a run's cost into input and output)."""
    from recursa.lm.prices import PriceBook

    price = PriceBook().price(shape, model)
    return 0.0 if price is None else price.output_per_mtok / 1e6


if __name__ == "__main__":
    main()
