"""OpenEnv adapter: `RLMEnv` episodes served as an OpenEnv environment (the `openenv-core` package),
the kind TRL's trainers step over HTTP and WebSocket.

    app = create_openenv_app(RLMEnv(sub_model="openai/policy", base_url=URL), max_sessions=64)  # OpenEnvSettings
    # or: recursa openenv --sub-model openai/policy --base-url URL --family niah

Each OpenEnv session (one WebSocket connection of an `EnvClient`) is one `RecursaEnvironment`:

- `reset(question=..., context=...)` starts an episode over that context (a str, a list of str or
  a dict of str), or `reset(family=..., size_chars=..., seed=...)` one of a generated task
  (`recursa.tasks`), scored by its family; without either, the server's default family. The
  observation's `messages` are the conversation the policy continues (system prompt, question).
  With question and context, `expected_answer=` gives the episode a reward (1.0 for that answer,
  else 0.0); without it the reward is None and the trainer scores `answer` itself.
- `step(RLMAction(reply=...))` runs the policy's reply (or `message=`, an OpenAI assistant message
  with its token fields, and its `tool_calls` under `dialect="tools"`) as the root's turn; the
  observation's `messages` are what to append after the reply. `done` is True once the episode
  has ended; `reward` is then the scorer's (0.0 without an answer), None before and without a
  scorer. A new `reset` closes the session's episode first, and so does the end of the session.

Concurrency is OpenEnv's `max_concurrent_envs` (sessions at once) over one shared `RLMEnv`, whose
`max_live_repls`, budgets and turn limits hold across every session. One client address holds at
most its share of the sessions, and a session idle past its timeout is closed, socket and slot
(recursa.asgi.client_shares). Contexts come only as values
in the request, never as paths on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field, model_validator

from recursa.asgi.body_deadline import BodyDeadline
from recursa.asgi.client_shares import ClientShares
from recursa.asgi.local_only import LocalOnly
from recursa.env import Episode, RLMEnv
from recursa.env.shared import EnvError
from recursa.integrations.openenv_settings import CLI, PYTHON, OpenEnvSettings
from recursa.overrides import int_value, kind, refused_widening, text_value
from recursa.serve.admission import AdmissionLimit, BodyLimit
from recursa.serve.json_limits import JSONBounds
from recursa.tasks import families, generate
from recursa.version import __version__

# A request body or WebSocket message at most (uvicorn's default `ws_max_size`; `recursa openenv` sets it).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_CLOSE_SECONDS = 30.0  # a session's end waits this long for its episode to close from another thread


class RLMAction(Action):
    """The policy's reply to the conversation so far: its text, or its whole assistant message."""

    reply: str | None = Field(default=None, description="the reply's text (```repl blocks run)")
    message: dict[str, Any] | None = Field(
        default=None,
        description="instead of `reply`: an OpenAI assistant message (`content`, and optionally "
        "`token_ids`, `logprobs`, `prompt_token_ids`, `input_tokens`, `output_tokens`)",
    )

    @model_validator(mode="after")
    def _one_reply(self) -> RLMAction:
        if (self.reply is None) == (self.message is None):
            raise ValueError("give exactly one of `reply` (text) or `message` (an assistant message)")
        return self


class RLMObservation(Observation):
    """What the policy reads next; `reward` and `done` as OpenEnv defines them."""

    messages: list[dict[str, Any]] = Field(
        default_factory=list,
        description="reset: the conversation to continue; step: the messages to append after the reply",
    )
    answer: str | None = Field(default=None, description="the episode's answer, once done")
    stop_reason: str | None = Field(default=None, description="final, max_iterations, budget, timeout, error")
    task_id: str | None = None
    turn: int = 0


class RLMState(State):
    task_id: str | None = None
    run_id: str | None = None
    done: bool = False
    stop_reason: str | None = None


class RecursaEnvironment(Environment[RLMAction, RLMObservation, RLMState]):
    """One OpenEnv session: at most one open episode of the shared `RLMEnv` at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env: RLMEnv, *, family: str, size_chars: int) -> None:
        super().__init__()
        self.env = env
        self.family = family
        self.size_chars = size_chars
        self._episode: Episode | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = RLMState()
        self._closing: set[asyncio.Future[Any]] = set()

    async def reset_async(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        question: str | None = None,
        context: Any = None,
        family: str | None = None,
        size_chars: int | None = None,
        task_id: str | None = None,
        expected_answer: str | None = None,
        **kwargs: Any,
    ) -> RLMObservation:
        if kwargs:
            raise EnvError(
                f"reset() got unknown field(s) {', '.join(sorted(kwargs))}; it takes question and context, "
                "or family, size_chars and seed"
            )
        await self._close_episode()
        self._loop = asyncio.get_running_loop()
        if question is not None or context is not None:
            if family is not None or size_chars is not None:
                raise EnvError("reset() takes question and context, or family/size_chars/seed, not both")
            episode = await self.env.start(
                text_value("reset(question=...)", question),
                _context(context),
                task_id=task_id if task_id is None else text_value("reset(task_id=...)", task_id),
                scorer=_exact(expected_answer) if expected_answer is not None else None,
            )
        else:
            name = family if family is not None else self.family
            if name not in families():
                raise EnvError(f"reset(family={name!r}): choose one of {', '.join(families())}")
            size = self.size_chars
            if size_chars is not None:
                size = int_value("reset(size_chars=...)", size_chars, 1)
                if size > self.size_chars:  # a larger task costs the operator's sub-calls and memory
                    raise EnvError("reset(): " + refused_widening("size_chars", size, self.size_chars))
            # On a thread: a large task takes seconds to write, and the loop serves every session.
            task = await asyncio.to_thread(generate, name, size, seed=seed or 0)
            episode = await self.env.start_task(task)
        self._episode = episode
        self._state = RLMState(
            episode_id=episode_id or episode.run_id,
            step_count=0,
            task_id=episode.task_id,
            run_id=episode.run_id,
        )
        return RLMObservation(messages=list(episode.messages), task_id=episode.task_id)

    async def step_async(
        self, action: RLMAction, timeout_s: float | None = None, **kwargs: Any
    ) -> RLMObservation:
        episode = self._episode
        if episode is None:
            raise EnvError("step() before reset(): start an episode with reset() first")
        if episode.done:
            raise EnvError("this episode is done: read its reward and answer, then reset() for a new one")
        appended = await episode.step(action.message if action.message is not None else action.reply)
        self._state.step_count += 1
        self._state.done = episode.done
        self._state.stop_reason = episode.stop_reason
        return RLMObservation(
            messages=appended,
            done=episode.done,
            reward=episode.reward if episode.done else None,  # None: no scorer (the trainer scores)
            answer=episode.answer if episode.done else None,
            stop_reason=episode.stop_reason,
            task_id=episode.task_id,
            turn=episode.turn,
        )

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> RLMObservation:
        raise EnvError("RecursaEnvironment is asynchronous: use reset_async (OpenEnv's server does)")

    def step(self, action: RLMAction, timeout_s: float | None = None, **kwargs: Any) -> RLMObservation:
        raise EnvError("RecursaEnvironment is asynchronous: use step_async (OpenEnv's server does)")

    @property
    def state(self) -> RLMState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="recursa",
            description="A Recursive Language Model's root turns: the policy writes ```repl code over a "
            "context held in a sandboxed REPL; sub-calls and child RLMs run in the environment.",
            version=__version__,
        )

    def close(self) -> None:
        """Close the session's episode (OpenEnv calls this from a worker thread or from the loop)."""
        episode, loop = self._episode, self._loop
        self._episode = None
        if episode is None or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:  # on the loop itself: the close runs as a task of its own
            task = loop.create_task(episode.abort())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            return
        future = asyncio.run_coroutine_threadsafe(episode.abort(), loop)
        with contextlib.suppress(Exception):
            future.result(timeout=_CLOSE_SECONDS)

    async def _close_episode(self) -> None:
        episode, self._episode = self._episode, None
        if episode is not None:
            await episode.abort()


def _exact(expected: Any) -> Any:
    """A scorer for `reset(expected_answer=...)`: 1.0 when the answer is that text (case and
    surrounding space aside), else 0.0."""
    want = text_value("reset(expected_answer=...)", expected).strip().casefold()
    return lambda answer: float(answer.strip().casefold() == want)


def _context(value: Any) -> Any:
    """A context from a request: a str, a list of str or a dict of str (never a path on the server)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value
    raise EnvError(
        f"reset(context=...) is {kind(value)}; give the context as a str, a list of str or a dict of str"
    )


_ENVIRONMENT_PATHS = frozenset(("/reset", "/step", "/mcp"))  # HTTP requests that make an environment


def create_openenv_app(env: RLMEnv, *, settings: OpenEnvSettings | None = None, **given: Any) -> Any:
    """OpenEnv's FastAPI app serving `env`: /ws sessions (what `EnvClient` uses), /reset, /step,
    /state, /schema, /health. `given`: the server's settings (`OpenEnvSettings`, e.g.
    `max_sessions=64, family="niah"`), or `settings` already checked: at most `max_sessions`
    sessions at once, and as many HTTP resets and steps in progress (each makes an environment of
    its own); `size_chars` is a generated task's size, and the largest a reset may ask for. One
    client address holds at most `sessions_per_client` sessions and requests together (None: a
    quarter of `max_sessions`, and all of them for this machine's own programs), and a session with
    no message for `session_idle_timeout_s` is closed (recursa.asgi.client_shares).

    The server has no keys, so it answers only the programs of its machine and trainers elsewhere,
    never a web page (recursa.asgi.local_only); a body or message is at most MAX_MESSAGE_BYTES
    within the JSON bounds (recursa.serve.json_limits), and a body must arrive by its deadline."""
    s = settings if settings is not None else OpenEnvSettings.checked(PYTHON, **given)
    max_sessions = s.max_sessions

    def factory() -> RecursaEnvironment:
        return RecursaEnvironment(env, family=s.family, size_chars=s.size_chars)

    app = create_app(factory, RLMAction, RLMObservation, env_name="recursa", max_concurrent_envs=max_sessions)
    # Innermost first: the JSON bounds, the size cap, the body's deadline, the HTTP resets and steps
    # in progress (each holds an environment that openenv's session cap never counts), each client
    # address's share of those and of the sessions (and the sessions' idle close), the origin.
    app.add_middleware(JSONBounds)
    app.add_middleware(BodyLimit, max_bytes=MAX_MESSAGE_BYTES)
    app.add_middleware(BodyDeadline, timeout_s=s.body_timeout_s)
    told = CLI.label("max_sessions")
    app.add_middleware(
        AdmissionLimit, limit=max_sessions, told=(told, told), paths=_ENVIRONMENT_PATHS, post_only=True
    )
    app.add_middleware(
        ClientShares,
        total=max_sessions,
        per_client=s.sessions_per_client,
        idle_timeout_s=s.session_idle_timeout_s,
        flag=CLI.label("sessions_per_client"),
        idle_flag=CLI.label("session_idle_timeout_s"),
        paths=_ENVIRONMENT_PATHS,
    )
    app.add_middleware(
        LocalOnly, hint="OpenEnv clients (EnvClient, TRL) send no Origin and are served from anywhere"
    )
    return app
