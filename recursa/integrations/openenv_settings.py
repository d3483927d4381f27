"""The settings of an OpenEnv server (`create_openenv_app`, `recursa openenv`), each declared once:
the function's keywords, the command's flags and the settings page of the docs derive from them.

Light on purpose: the command's parser reads these without openenv-core installed.
"""

from __future__ import annotations

import copy

from pydantic import field_validator

from recursa.config import Invalid, Schema, Setting, Spelling, declarations, setting
from recursa.serve.settings import SERVER_SETTINGS, ServeSettings


class OpenEnvSettings(Schema):
    """What an OpenEnv server over one shared `RLMEnv` allows (its runs' settings are the RLMEnv's)."""

    max_sessions: int = setting(64, "OpenEnv sessions (episodes) at once, and as many HTTP resets and steps in progress (each makes an environment of its own)", flag="--max-sessions", ge=1)
    sessions_per_client: int | None = setting(None, "sessions (and HTTP resets and steps in progress) one client address may hold; default: a quarter of max_sessions, and all of them for this machine's own programs (recursa.asgi.client_shares)", flag="--max-sessions-per-client N", example="16", ge=1)
    # As long as recursa serve's sessions may idle: a policy's slowest turn fits well within it.
    session_idle_timeout_s: float = setting(SERVER_SETTINGS["session_ttl_s"].default, "seconds a session may go without a message before the server closes it", flag="--session-idle-timeout SECONDS", gt=0)
    family: str = setting("niah", "the task family a reset without a question generates (recursa.tasks)", flag="--family")
    size_chars: int = setting(20_000, "context characters of a generated task, and the most a reset may ask for", flag="--size", example="20_000", ge=1)
    # The same deadline as recursa serve's, by the same declaration.
    body_timeout_s: float = copy.copy(ServeSettings.model_fields["body_timeout_s"])

    @field_validator("family")
    @classmethod
    def _family(cls, name: str) -> str:
        from recursa.tasks import families

        if name not in families():
            raise Invalid(f"a task family, one of {', '.join(families())}", "'niah'")
        return name


OPENENV_SETTINGS: dict[str, Setting] = declarations(OpenEnvSettings)
# The command's flags: the settings that declare one.
OPENENV_FLAGS = tuple(name for name, s in OPENENV_SETTINGS.items() if s.flag)
PYTHON = Spelling("python", "create_openenv_app", schema=OPENENV_SETTINGS)
CLI = Spelling("cli", schema=OPENENV_SETTINGS)
