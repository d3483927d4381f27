"""recursa: Recursive Language Models.

from recursa import RLM, Budget
rlm = RLM("openai/gpt-5-mini", sub_model="openai/gpt-5-nano", budget=Budget(max_usd=2.0))
result = rlm.run("Which user asked the most location questions?", context=text)
"""

from recursa.budget import Budget
from recursa.confined import ConfinedPath
from recursa.errors import (
    BudgetExceeded,
    ConfigError,
    ContextError,
    ContextLengthError,
    LMError,
    RecursaError,
    SandboxError,
)
from recursa.lm.registry import register_provider
from recursa.result import RLMResult
from recursa.rlm import RLM
from recursa.session import Session
from recursa.tools.spec import host_tool
from recursa.usage import ModelUsage, Usage
from recursa.version import __version__

# The offline models live beside lm, not inside it: lm knows them only through its registry.
register_provider("scripted", "recursa.scripted.client:scripted_provider")

__all__ = [
    "RLM",
    "Budget",
    "BudgetExceeded",
    "ConfigError",
    "ConfinedPath",
    "ContextError",
    "ContextLengthError",
    "LMError",
    "ModelUsage",
    "RLMResult",
    "RecursaError",
    "SandboxError",
    "Session",
    "Usage",
    "__version__",
    "host_tool",
]
