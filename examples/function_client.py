"""Worked example: drive an RLM with your own model function, no provider SDK involved.

Any object with a `complete(request)` method is an LM client (`recursa.lm.LMClient`): wrap a
function, an Azure or Bedrock SDK, a local inference library. `complete` may be `async def` or a
plain `def` (recursa runs it in a thread), and returns the reply text, or an `LMResponse` when you
know the token counts and cost (they then show up in `result.usage`).

    python examples/function_client.py          # offline: the "models" below are plain functions

Here the root "model" is a function that writes one REPL block, and the sub-model counts vowels.
Replace them with calls to your own model.
"""

from __future__ import annotations

from collections.abc import Callable

from recursa import RLM
from recursa.lm import LMRequest, LMResponse, Message


class FunctionClient:
    """Any function from chat messages to reply text, as an LM client."""

    def __init__(self, fn: Callable[[list[Message]], str], name: str) -> None:
        self.fn = fn
        self.model = name  # how it is named in result.usage.by_model and traces ("client/<name>")

    def complete(self, request: LMRequest) -> LMResponse:
        text = self.fn(request.messages)
        # Report usage when you know it; returning `text` alone also works (then it is estimated).
        words_in = sum(len(str(m.get("content") or "").split()) for m in request.messages)
        return LMResponse(
            text=text, input_tokens=words_in, output_tokens=len(text.split()), provider_cost_usd=0.0
        )


def root_model(messages: list[Message]) -> str:
    """Stands in for a root model: looks at the context in code, asks the sub-model, answers."""
    if any(m["role"] == "assistant" for m in messages):
        return "FINAL(done)"
    return (
        "I will split the context into lines and ask the sub-model about each.\n"
        "```repl\n"
        "lines = context.splitlines()\n"
        "counts = llm_query_batched(['How many vowels are in: ' + line for line in lines])\n"
        "FINAL(sum(int(c) for c in counts))\n"
        "```"
    )


def vowel_counter(messages: list[Message]) -> str:
    """Stands in for a sub-model: answers the prompt it is given."""
    text = str(messages[-1]["content"]).split(":", 1)[1]
    return str(sum(ch in "aeiou" for ch in text.lower()))


def main() -> None:
    rlm = RLM(
        model=FunctionClient(root_model, "my-root"),
        sub_model=FunctionClient(vowel_counter, "my-counter"),
        trace=False,
    )
    result = rlm.run("How many vowels does the text have?", "An RLM reads\nlong contexts\nin code")
    print("answer:", result.answer)
    for model, usage in result.usage.by_model.items():
        print(f"{model}: {usage.llm_calls} calls, {usage.input_tokens} in, {usage.output_tokens} out")


if __name__ == "__main__":
    main()
