"""`recursa models`: which models the command line can use, what each is for, and the environment
variables it reads (with whether each is set, never its value)."""

from __future__ import annotations

import os
from typing import Any

from recursa.cli_options import ENV_VARS

PROVIDERS = {
    "openai": "OpenAI's API (key: OPENAI_API_KEY), or any OpenAI-compatible server with --base-url: "
    "vLLM, SGLang, Ollama, llama.cpp, LiteLLM proxy (no key needed for a local one)",
    "anthropic": "Anthropic's API (key: ANTHROPIC_API_KEY)",
    "scripted": "offline stand-ins that write real REPL code: no key, no network, deterministic",
}
EXAMPLES = {
    "openai": [
        "openai/gpt-5-mini",
        "openai/gpt-5-nano",
        "openai/<served name> --base-url http://localhost:8000/v1",
    ],
    "anthropic": ["anthropic/claude-sonnet-4-5", "anthropic/claude-haiku-4-5"],
}
SCRIPTED = {
    "gpt5-like": "root: chunks the context and batches llm_query sub-calls, like a GPT-5 root in the paper",
    "qwen-coder-like": "root: fewer, larger sub-call batches, like the paper's Qwen3-Coder root",
    "no-subcalls": "root: answers with code alone, no sub-calls (the paper's ablation)",
    "base-llm": "root: answers from the prompt in one reply, like a plain model (a baseline)",
    "oracle": "sub-model: answers sub-prompts of the built-in benchmark tasks from their hidden ground "
    "truth, anything else with the sentence of the prompt closest to its question (a keyword "
    "search); the --sub-model to pair with a scripted root",
}


def listing() -> dict[str, Any]:
    from recursa.lm.registry import providers
    from recursa.scripted import policy_names

    names = policy_names()
    return {
        "providers": [
            {"name": p, "what": PROVIDERS.get(p, "registered by a plugin"), "examples": EXAMPLES.get(p, [])}
            for p in providers()
        ],
        "scripted": [
            {"model": f"scripted/{n}", "what": SCRIPTED.get(n, "registered by a caller")} for n in names
        ],
        "environment": [
            {"name": name, "what": what, "set": bool(os.environ.get(name))} for name, what in ENV_VARS.items()
        ],
    }


def render(data: dict[str, Any]) -> str:
    lines = ["Providers (--model provider/name):"]
    for p in data["providers"]:
        lines.append(f"  {p['name']:<11} {p['what']}")
        lines += [f"  {'':<11}   e.g. {e}" for e in p["examples"]]
    lines += ["", "Scripted models (offline; e.g. --model scripted/gpt5-like --sub-model scripted/oracle):"]
    lines += [f"  {s['model']:<27} {s['what']}" for s in data["scripted"]]
    lines += ["", "Environment variables read:"]
    lines += [
        f"  {e['name']:<22} {'set  ' if e['set'] else 'unset'}  {e['what']}" for e in data["environment"]
    ]
    return "\n".join(lines)
