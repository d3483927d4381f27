"""From an OpenAI chat-completions request body to an RLM question, context and settings.

The rules (documented in docs/serving.md, "Messages to question and context"):
- the last user message is the question; every other message (as "[role]\\n text") and every
  attached text file part is the context;
- with nothing else to be the context, or a "question" longer than `max_question_chars`, the whole
  last user message becomes the context and the RLM carries out its request (`RLM.completion`);
- image parts make the context a dict: each document under the field it came from, each image by
  its name (recursa.serve.images);
- `extra_body={"recursa": {...}}` may name the question, an inline context, a server-side
  `context_path` or a `context_url`, per-request `max_depth`, `max_iterations` and budget caps, and
  a `session` id (recursa.serve.sessions decides what a later request of a session means).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recursa.config import BUDGET_CAPS, SETTINGS, Spelling
from recursa.errors import ConfigError
from recursa.loop.subcalls import PROMPT_AS_CONTEXT_QUESTION
from recursa.overrides import client_settings
from recursa.serve.api_error import ApiError, bad
from recursa.serve.fields import AnswerShape, parse_shape
from recursa.serve.images import InlineImage, chat_image, context_images
from recursa.serve.settings import ServeSettings

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
BUDGET_KEYS = tuple(BUDGET_CAPS)
# The run settings a request may send under `recursa`: every setting the schema lets a client set
# or lower (its `client` policy), by its schema name and checked by that policy, and a budget's caps
# one by one too. Models ("choose") stay the operator's: a request brings no key of its own.
SETTING_KEYS = frozenset((*(n for n, s in SETTINGS.items() if s.client in ("tighten", "client")), *BUDGET_KEYS))
RECURSA_KEYS = ("question", "context", "context_path", "context_url", "session", *sorted(SETTING_KEYS))
REQUEST_SPELLING = Spelling("dotted", "recursa")
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
NEW_SESSION = "new"  # recursa.session "new": the server picks an unguessable id and returns it


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None when there is none."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def key_matches(token: str | None, api_key: str) -> bool:
    # Constant-time comparison: response timing must not reveal how much of a guess matched.
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())


@dataclass(frozen=True)
class Caller:
    """Who sent a request (recursa.serve.callers decides): its sessions' namespace, and whether it
    is one client's own identity or a key that several people may share."""

    owner: str  # names and digests only, never a secret
    private: bool


@dataclass
class RunRequest:
    """The run a client asked for, whichever wire API it spoke (Chat Completions, Responses,
    Messages): its question, context, limits, session and answer shape."""

    model: str
    question: str
    context: Any = None  # str | list[str] | dict[str, str | image bytes]; None when a path or URL names it
    context_path: str | None = None
    context_url: str | None = None
    stream: bool = False
    settings: dict[str, Any] = field(default_factory=dict)  # the request's run settings, checked
    completion_mode: bool = False  # the question is PROMPT_AS_CONTEXT_QUESTION
    # For sessions: what the client asked and where the context came from, before the rules above
    # turned them into `question` and `context`.
    session: str | None = None
    asked: str = ""  # recursa.question, else the last user message's text
    explicit: str | None = None  # "context", "context_path" or "context_url" when one was given
    docs: list[tuple[str, str]] = field(default_factory=list)  # (role or "file", "[header]\n text")
    sent: frozenset[str] = frozenset()  # the recursa option names the request gave
    caller: Caller = Caller("open", False)  # who sent it (the server sets it)
    shape: AnswerShape = field(default_factory=AnswerShape)  # response_format, sampling, stop, ...


def parse_chat_request(body: Any, settings: ServeSettings) -> RunRequest:
    """Validate a request body. Raises ApiError (400/404) naming the field and the fix."""
    body = request_object(body)
    model = served_model(body, settings)
    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad("`n` must be 1: an RLM run gives one answer (send n requests for n answers)", "n")
    extra = recursa_options(body)
    messages = _messages(body.get("messages"))
    shape = parse_shape(body, provider_of(settings.model), settings.run.get("sampling"))
    return build_request(model, stream_flag(body), extra, messages, shape, settings)


def request_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def served_model(body: dict[str, Any], settings: ServeSettings) -> str:
    """The request's `model`, which must be one of the names this server answers to (404 if not)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("`model` is required: use one of " + ", ".join(settings.model_names), "model")
    if model not in settings.model_names:
        raise ApiError(
            404,
            f"The model {model!r} does not exist on this server; it serves "
            + ", ".join(repr(n) for n in settings.model_names),
            param="model",
            code="model_not_found",
        )
    return model


def stream_flag(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise bad("`stream` must be true or false", "stream")
    return stream


def recursa_options(body: dict[str, Any]) -> dict[str, Any]:
    """recursa's own options: the `recursa` object (sent with extra_body={"recursa": {...}})."""
    extra = body.get("recursa") or {}
    if not isinstance(extra, dict):
        raise bad('`recursa` (sent with extra_body={"recursa": {...}}) must be an object', "recursa")
    unknown = sorted(set(extra) - set(RECURSA_KEYS))
    if unknown:
        raise bad(f"unknown recursa option(s) {unknown}; known: {', '.join(RECURSA_KEYS)}", "recursa")
    return extra


def build_request(
    model: str,
    stream: bool,
    extra: dict[str, Any],
    messages: list[InputMessage],
    shape: AnswerShape,
    settings: ServeSettings,
) -> RunRequest:
    """The run a request asks for, whichever API it came through (Chat Completions or Responses):
    the same rules turn its messages and recursa options into a question, a context and limits."""
    req = RunRequest(model=model, question="", stream=stream, sent=frozenset(extra))
    req.shape = shape
    req.session = _session_id(extra.get("session"))
    _apply_settings(req, extra, settings)
    _apply_context(req, messages, extra, settings)
    return req


# -- messages -------------------------------------------------------------------------------------


@dataclass
class InputMessage:
    """One message of a request, whichever API it came through: its role, its text, its files and
    images (`files` as read_content gives them sorts into both)."""

    role: str
    text: str
    files: list[Any]  # (name, text) of each text file; InlineImage parts go to `images`
    where: str = "messages"  # the request field it came from, for errors ("messages[2]", "input")
    images: list[InlineImage] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.images = [*self.images, *(f for f in self.files if isinstance(f, InlineImage))]
        self.files = [f for f in self.files if not isinstance(f, InlineImage)]


def _messages(raw: Any) -> list[InputMessage]:
    if not isinstance(raw, list) or not raw:
        raise bad("`messages` must be a non-empty list of {role, content} objects", "messages")
    out: list[InputMessage] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with `role` and `content`", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        text, files = _content(m.get("content"), f"{where}.content")
        out.append(InputMessage(role, text, files, where))
    return out


def _content(content: Any, where: str) -> tuple[str, list[Any]]:
    return read_content(content, where, _part)


def _part(part: dict[str, Any], kind: Any, at: str) -> str | tuple[str, str] | InlineImage:
    if kind == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])  # an assistant message replayed as the SDK typed it
    if kind == "file":
        return file_part(part.get("file"), at)
    if kind == "image_url":
        return chat_image(part, at)
    if kind == "input_audio":
        raise bad(f"{at}: {kind} parts are not supported; an RLM reads text (send text or a text file)", at)
    raise bad(f"{at} must be a text part, a file part or (in an assistant message) a refusal part", at)


PartReader = Callable[[dict[str, Any], Any, str], str | tuple[str, str] | InlineImage | None]


def read_content(content: Any, where: str, read_part: PartReader) -> tuple[str, list[Any]]:
    """The text and inline files of a message's `content`: a string, or a list of parts that
    `read_part(part, type, where)` reads into a text, a (name, text) file, an image or None (a part
    left out). The APIs share the walk and name their parts differently."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content parts", where)
    texts: list[str] = []
    files: list[Any] = []
    for j, part in enumerate(content):
        fields = part if isinstance(part, dict) else {}
        read = read_part(fields, fields.get("type"), f"{where}[{j}]")
        if read is None:
            continue
        if isinstance(read, str):
            texts.append(read)
        else:
            files.append(read)
    return "\n".join(texts), files


def file_part(file: Any, at: str, holder: str = ".file") -> tuple[str, str]:
    """(name, text) of an inline text file; `holder`: where the file's fields sit under `at`
    (Chat Completions: the part's `file` object; Responses: the part itself)."""
    if not isinstance(file, dict):
        raise bad(f"{at}{holder} must be an object with `file_data` (base64) and `filename`", at)
    if file.get("file_id") and not file.get("file_data"):
        raise bad(f"{at}: file_id references are not supported here; send the file inline as file_data", at)
    data = file.get("file_data")
    if not isinstance(data, str) or not data:
        raise bad(f"{at}{holder}.file_data must be the file's bytes in base64 (optionally a data: URL)", at)
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{at}{holder}.file_data is not valid base64", at) from None
    name = str(file.get("filename") or f"file-{at}")
    try:
        return name, raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(f"{at}: file {name!r} is not UTF-8 text; convert it to text first", at) from None


# -- question and context -------------------------------------------------------------------------


def _apply_context(
    req: RunRequest, messages: list[InputMessage], extra: dict[str, Any], settings: ServeSettings
) -> None:
    explicit = [k for k in ("context", "context_path", "context_url") if extra.get(k) is not None]
    if len(explicit) > 1:
        raise bad(
            f"give at most one of recursa.context, context_path, context_url (got {explicit})", "recursa"
        )
    question = extra.get("question")
    if question is not None and (not isinstance(question, str) or not question.strip()):
        raise bad("recursa.question must be a non-empty string", "recursa.question")

    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    listed = messages[-1].where.partition("[")[0] if messages else "messages"  # "messages" or "input"
    if question is None and last_user is None:
        raise bad(f"`{listed}` has no user message: the last user message is the question", listed)
    # Where an empty question came from: the client can only fix what the error names.
    empty = _empty_question(None if last_user is None else messages[last_user].where)

    if question is not None:
        req.question = question
        others = messages  # every message is context when the question comes separately
    else:
        assert last_user is not None
        req.question = messages[last_user].text
        others = [m for i, m in enumerate(messages) if i != last_user]
    req.asked = req.question

    images = [image for m in messages for image in m.images]
    if explicit:
        key = explicit[0]
        if images:
            raise bad(
                f"{images[0].where}: image parts are images of the context the messages make, and this "
                f"request names its context with recursa.{key}; send the context as messages, or the "
                "images in the folder a context_path names",
                images[0].where,
            )
        req.explicit = key
        value = extra[key]
        if key == "context":
            if not _context_value_ok(value):
                raise bad("recursa.context must be a string, a list of strings or an object of strings", key)
            req.context = value
        elif not isinstance(value, str) or not value:
            raise bad(f"recursa.{key} must be a non-empty string", f"recursa.{key}")
        elif key == "context_path":
            req.context_path = value
        else:
            req.context_url = value
        if not req.question.strip():
            raise empty
        return

    # Each document keeps a header ("[role]" or "[file: name]") unless it is the only one; with
    # images the context is a dict, each document under the field it came from.
    pieces = [(m.role, m.text, f"[{m.role}]\n{m.text}", f"{m.where} ({m.role})") for m in others if m.text]
    pieces += [
        ("file", text, f"[file: {name}]\n{text}", f"file: {name}") for m in messages for name, text in m.files
    ]
    named = context_images(images, settings)
    req.docs = [(kind, header) for kind, _, header, _ in pieces]
    req.docs += [("image", f"[image: {name}] {i.fingerprint()}") for name, i in zip(named, images, strict=True)]
    docs = [(text, header, key) for _, text, header, key in pieces]
    if (not docs and not named) or len(req.question) > settings.max_question_chars:
        # Nothing else to read (or the "question" is itself a document): the whole request is the
        # context and the RLM carries it out, as RLM.completion does.
        if req.question:
            asked_at = messages[last_user].where if last_user is not None else "recursa.question"
            docs.append((req.question, f"[user]\n{req.question}", f"{asked_at} (user)"))
        req.question = PROMPT_AS_CONTEXT_QUESTION
        req.completion_mode = True
    if not docs and not named:
        raise bad("the request is empty: send a user message with the question (and context)", listed)
    if not req.question.strip():
        raise empty
    if named:
        keyed: dict[str, Any] = {}
        for text, _, key in docs:
            keyed[_unique(key, keyed)] = text
        req.context = keyed | {_unique(name, keyed): value for name, value in named.items()}
    else:
        req.context = docs[0][0] if len(docs) == 1 else [header for _, header, _ in docs]


def _unique(key: str, taken: dict[str, Any]) -> str:
    n, unique = 2, key
    while unique in taken:
        unique, n = f"{key} ({n})", n + 1
    return unique


def _empty_question(where: str | None) -> ApiError:
    at = f"{where}.content" if where and where.endswith("]") else (where or "recursa.question")
    return bad(
        f"the question is empty: the last user message ({at}) is the question; put the question there, "
        "or send it as recursa.question",
        at,
    )


def provider_of(model: Any) -> str | None:
    # A model given as a client object (not "provider/name") has no provider to check fields against.
    return model.split("/", 1)[0].strip().lower() if isinstance(model, str) and "/" in model else None


def _session_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _SESSION_ID.fullmatch(value):
        raise bad(
            "recursa.session must be an id of 1 to 128 letters, digits and . _ : - "
            '(send "new" and the server picks one, returned in recursa.session; or pick a random one, '
            "e.g. a UUID4, and send it with every question of the session)",
            "recursa.session",
        )
    return value


def _context_value_ok(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, str) for v in value)
    if isinstance(value, dict):
        return bool(value) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    return False


# -- per-request settings ---------------------------------------------------------------------


def _apply_settings(req: RunRequest, extra: dict[str, Any], settings: ServeSettings) -> None:
    """The request's run settings, each checked by the schema's policy for what a client may set
    (recursa/overrides.py): the depth and turns up to the operator's limits and budget caps no
    higher. (The top-level sampling fields, the root's, were checked with the answer's shape.)"""
    asked = {k: v for k, v in extra.items() if k in SETTING_KEYS}
    try:
        req.settings = client_settings(asked, settings.run_limits(), REQUEST_SPELLING, models=None)
    except ConfigError as exc:
        raise bad(REQUEST_SPELLING.told(exc), f"recursa.{exc.setting}" if exc.setting else "recursa") from None
