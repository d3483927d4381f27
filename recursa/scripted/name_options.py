"""Typed knobs of the built-in scripted models, parsed from the suffix of the model name."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from recursa.scripted.policy import Knobs

FAULTS = ("syntax", "loop", "bigprint", "wrong-final")

ROOT_KNOBS = ("fault", "noise", "seed", "batch", "chunk", "recurse", "window", "attention", "style")
STYLES = ("clean", "messy")  # how a root writes its replies (messy: the forms real models use; messy.py)
ORACLE_KNOBS = ("noise", "seed", "window")
BASE_KNOBS = ("seed", "window", "attention")
# GPT-5's input window in tokens: what the scripted models accept before a context-length error.
DEFAULT_WINDOW = 272_000


@dataclass(frozen=True)
class Settings:
    faults: tuple[str, ...] = ()  # misbehaviours a root shows once before recovering
    noise: float = 0.0  # fraction of labels the sub-model gets wrong (seeded by instance hash)
    seed: int = 0
    batch: int = 150  # instance lines per classification sub-prompt
    chunk: int = 50_000  # characters of text per sub-prompt
    recurse: bool = False  # hand chunks to child RLMs (rlm_query_batched) instead of plain sub-calls
    window: int = (
        DEFAULT_WINDOW  # prompt tokens accepted (recursa.lm.tokens count); beyond: ContextLengthError
    )
    # How many prompt tokens a model reading raw context in its own window attends to fully; past
    # that, facts are noticed with probability (attention / prompt tokens) ** 0.5 (context rot).
    attention: int = 32_000
    style: str = "clean"


def parse_settings(raw: Knobs, allowed: Iterable[str], policy: str) -> Settings:
    allowed = tuple(allowed)
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown knob(s) {', '.join(unknown)} for scripted model {policy!r}; "
            f"known: {', '.join(allowed) or 'none'}"
        )
    try:
        faults = tuple(f for f in raw.get("fault", "").replace("|", "+").split("+") if f)
        settings = Settings(
            faults=faults,
            noise=float(raw.get("noise", 0.0)),
            seed=int(raw.get("seed", 0)),
            batch=int(raw.get("batch", 150)),
            chunk=int(raw.get("chunk", 50_000)),
            recurse=raw.get("recurse", "0").lower() in ("1", "true", "yes", "on"),
            window=_tokens(raw.get("window", str(DEFAULT_WINDOW))),
            attention=_tokens(raw.get("attention", "32000")),
            style=raw.get("style", "clean").lower(),
        )
    except ValueError as exc:
        raise ValueError(f"bad knob value for scripted model {policy!r}: {exc}") from None
    bad = [f for f in settings.faults if f not in FAULTS]
    if bad:
        raise ValueError(f"unknown fault(s) {', '.join(bad)}; faults: {', '.join(FAULTS)} (join with '+')")
    if settings.style not in STYLES:
        raise ValueError(f"unknown style {settings.style!r}; styles: {', '.join(STYLES)}")
    if not 0.0 <= settings.noise <= 1.0:
        raise ValueError(f"noise must be between 0 and 1, got {settings.noise}")
    if settings.batch < 1 or settings.chunk < 1_000:
        raise ValueError("batch must be >= 1 and chunk >= 1000")
    if settings.window < 100 or settings.attention < 100:
        raise ValueError("window and attention must be >= 100 tokens")
    return settings


def _tokens(text: str) -> int:
    """ "272000", "272k" or "1m" -> tokens."""
    low = text.strip().lower()
    scale = 1_000 if low.endswith("k") else 1_000_000 if low.endswith("m") else 1
    return int(float(low.rstrip("km")) * scale)
