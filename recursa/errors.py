"""Exceptions users can catch. Every message names the problem and the fix."""

from __future__ import annotations

from recursa.outcomes import BudgetLimit


class RecursaError(Exception):
    """Base class of every error recursa raises on purpose.

    A message written below the front doors names a setting as `«name»`, `«name=»` or
    `«name=example»`; `str(error)` is the message as a Python caller writes them (`name`, `name=`,
    `name=example`), and a front door names them its own way from the schema's declaration
    (`Spelling.told(error)`: `--flag`, `--flag example`, `recursa.name`). `template` keeps the marks."""

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(plain(message), *args)
        self._marked = message

    @property
    def template(self) -> str:
        """The message with its marks, while `args` still hold that message. Code that rewrites
        `args` (a scrub of secrets, a note appended) without `reword` makes `str(error)` the
        message: marks are lost then, never the rewrite."""
        if self.args and self.args[0] == plain(self._marked):
            return self._marked
        return str(self)

    def reword(self, template: str) -> None:
        """Replace the message (marks kept), in place: the error's class and attributes stay."""
        self.args = (plain(template), *self.args[1:])
        self._marked = template


def plain(template: str) -> str:
    """A message's settings as a Python caller writes them: the marks `«` and `»` left out."""
    return template.replace("«", "").replace("»", "")


def template_of(error: BaseException) -> str:
    """The message of `error` with the settings it names still marked (its plain text otherwise)."""
    return getattr(error, "template", None) or str(error)


class ConfigError(RecursaError, ValueError):
    """The RLM was configured in a way that cannot work (unknown provider, missing key, no price...).
    `setting`: the setting at fault, by the schema's name, where one is."""

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


class ContextError(RecursaError, ValueError):
    """The context cannot be used (empty, undecodable, unreadable path, unsupported type)."""


class BudgetExceeded(RecursaError):
    """A call was refused because its worst case would break a hard budget cap.

    Raised before the call is sent, so the cap itself is never exceeded.
    """

    def __init__(self, limit: BudgetLimit, message: str) -> None:
        super().__init__(message)
        self.limit: BudgetLimit = limit


class LMError(RecursaError):
    """A model call failed for good (after retries, or a non-retryable error)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        # Seconds the provider asked us to wait (a Retry-After header); retries honour it.
        self.retry_after = retry_after


class ContextLengthError(LMError):
    """The prompt is longer than the model accepts: send less text per call."""


class SandboxError(RecursaError):
    """The REPL process failed in a way the run cannot recover from."""


class SandboxLost(SandboxError):
    """The machine that held the REPL is gone (a cluster node died or left): the run stops with
    stop_reason "error" and this message, which names the machine; other runs go on."""
