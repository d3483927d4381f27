"""Root prompt tokens of a 10-turn run under each dialect (docs/dialects.md, docs/performance.md).

One RLM run per dialect over the same context and question, with a root that writes the same code
every turn, in the form the dialect asks for (a ```repl block, or a call of the code tool), and
answers on the last turn. The root is an LM client object in this process: it counts each request's
prompt tokens (recursa's count, the tools offered included) and says nothing of its own. The table
gives the tokens of the first request, of the last, and summed over the run: what a dialect's
prompts, per-turn messages and output formatting cost.

    python benchmarks/dialect_tokens.py [--turns 10] [--output-chars 400]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

from recursa import RLM
from recursa.errors import ConfigError
from recursa.lm.base import LMRequest, LMResponse, ToolCall
from recursa.lm.tokens import count_message_tokens, count_tokens
from recursa.loop.dialects import dialect_names

CONTEXT = "\n".join(f"line {i}: user {i % 37} asked about item {i * 7 % 101}" for i in range(2_000))
QUESTION = "How many lines mention item 42?"
TOOL_DIALECTS = ("tools", "verifiers")


class Root:
    """A root that runs one step per turn and answers on the last; it records prompt tokens."""

    provider = "bench"
    model = "root"

    def __init__(self, dialect: str, turns: int, output_chars: int) -> None:
        self.dialect, self.turns, self.output_chars = dialect, turns, output_chars
        self.prompts: list[int] = []

    async def complete(self, request: LMRequest) -> LMResponse:
        tokens = count_message_tokens(request.messages) + count_tokens(json.dumps(request.tools or []))
        self.prompts.append(tokens)
        turn = len(self.prompts)
        if turn < self.turns:
            code = f"hits = [l for l in context.splitlines() if l.endswith(' 42')]\nprint(str(hits)[:{self.output_chars}])"
        else:
            code = "answer['content'] = str(len(hits))\nanswer['ready'] = True"
        if self.dialect == "verifiers" and turn >= self.turns - 1:
            # Its turn limit ends the run before the last reply's calls run: the answer is set a turn
            # earlier, and the last reply, with no call, ends the rollout.
            if turn == self.turns:
                return LMResponse("Done.", tokens, 20)
            code += "\nanswer['content'] = str(len(hits))"
        if self.dialect in TOOL_DIALECTS:
            call = ToolCall(f"call_{turn}", "call_python_repl", {"code": code})
            return LMResponse("", tokens, 20, tool_calls=[call])
        if self.dialect == "skyrl" and turn >= self.turns:  # SkyRL's REPL answers by FINAL_VAR only
            return LMResponse("```repl\nn = str(len(hits))\n```\nFINAL_VAR(n)", tokens, 20)
        return LMResponse(f"Step {turn}.\n```repl\n{code}\n```", tokens, 20)

    async def aclose(self) -> None:
        return None


def measure(dialect: str, turns: int, output_chars: int) -> dict[str, Any]:
    root = Root(dialect, turns, output_chars)
    with tempfile.TemporaryDirectory() as traces:
        try:
            rlm = RLM(root, max_depth=0, max_iterations=turns, dialect=dialect, trace_dir=traces)
        except ConfigError as exc:
            return {"dialect": dialect, "skipped": str(exc).split(";")[-1].strip()}
        result = rlm.run(QUESTION, CONTEXT)
    return {
        "dialect": dialect,
        "turns": len(root.prompts),
        "first": root.prompts[0],
        "last": root.prompts[-1],
        "total": sum(root.prompts),
        "answer": result.answer,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--output-chars", type=int, default=400, help="REPL output printed per turn")
    args = parser.parse_args()
    rows = [measure(d, args.turns, args.output_chars) for d in dialect_names()]
    print(f"root prompt tokens of a {args.turns}-turn run ({args.output_chars} characters printed per turn)")
    print(f"{'dialect':<10} {'turns':>5} {'first':>7} {'last':>7} {'total':>9}  answer")
    for row in rows:
        if "skipped" in row:
            print(f"{row['dialect']:<10} skipped: {row['skipped']}")
            continue
        print(
            f"{row['dialect']:<10} {row['turns']:>5} {row['first']:>7,} {row['last']:>7,} {row['total']:>9,}  "
            f"{row['answer']}"
        )


if __name__ == "__main__":
    main()
