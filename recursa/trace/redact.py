"""Keep API keys (and host paths) out of traces, logs, error messages and what the host tells the sandbox.

The one scrubber for every text that leaves the host's hands (trace lines, an exception's message
sent into the REPL or to a client, a log line). It removes:
- the secrets it is given (a run's configured keys; 4 characters or more in messages, 8 in whole
  trace lines) and the values of the environment's key variables (names ending in API_KEY, TOKEN,
  SECRET, PASSWORD, ACCESS_KEY), 8 characters or more;
- the shapes of common provider keys (`sk-...`, `sk-ant-...`, `AIza...`, `hf_...`, `ghp_...`), even
  when it was not told the value;
- credentials in header form (`Authorization: Bearer ...`, `x-api-key: ...`, `Cookie: ...`) and
  bare bearer tokens; an AWS access key id;
- key-like query parameters (`?key=`, `&api_key=`, `access_token=`, `sig=`, a signed URL's
  `X-Amz-Signature=`...), a URL's password (with or without a user name), and a random segment of
  a URL's path (a webhook's secret, a share link's id: 20 characters or more, mixed as below);
- whatever any name that ends in a secret's word is set to (`DB_PASS=...`, `"stripe_secret": "..."`,
  `MY_TOKEN: ...`), whatever the name's start: only the known keys' names were caught before;
- a long random token on its own (32 characters or more of letters and digits with upper case,
  lower case and digits all in it: a key, a signed path's signature), however it is labelled.
Only values of 8 token characters or more are taken (6 after a secret's name), so code that builds
such a header or URL from a variable (`f"Bearer {token}"`, `key = key`) reads the same afterwards;
hex digests and UUIDs (no upper case) are not taken for random tokens.
Messages also lose the host's file paths (trace/hostpaths.py), except where the reader is the
operator: the CLI's messages and the server's log are made with `paths=False`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from recursa.errors import RecursaError
from recursa.trace.hostpaths import scrub_paths

REDACTED = "[REDACTED]"

_TOKEN = r"[A-Za-z0-9._~+/=%-]{8,}"
# Shapes of the most common provider keys, caught even when we were not told the value. No `\b` in
# front: it keeps the regex engine from skipping ahead to the first letters, 3x slower on a trace
# line; the character before a match is checked instead (_outside_word).
_COMMON_SHAPES = re.compile(r"sk-(?:ant-|proj-)?[A-Za-z0-9_\-]{16,}|AIza[0-9A-Za-z_\-]{30,}")
_MORE_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|xox[abpr]-[A-Za-z0-9-]{10,})"
)
# `Authorization: Bearer x`, `"x-api-key": "x"` (also JSON-escaped inside a string).
_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization|x-api-key|api-key|x-goog-api-key|x-auth-token|set-cookie|cookie)"
    r"((?:\\?[\"'])?\s*[:=]\s*(?:\\?[\"'])?)((?:bearer|basic|token)\s+)?" + _TOKEN
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)" + _TOKEN)
_QUERY = re.compile(
    r"(?i)([?&;](?:api[_-]?key|apikey|key|access[_-]?token|auth[_-]?token|token|secret|client[_-]?secret"
    r"|password|passwd|sig|signature|x-(?:amz|goog)-(?:signature|credential|security-token))=)" + _TOKEN
)
# `NAME = value` (or `"name": "value"`, `NAME: value`) where the name's last word is a secret's:
# `*_KEY`, `*_SECRET`, `*_PASS`, `*_TOKEN`... The word must end the name (`monkey`, `tokens`,
# `max_tokens` are not secrets' names).
_ASSIGNED = re.compile(
    r"(?i)\b((?:[a-z0-9]+[_.-])*(?:api_?key|key|secret|pass|passwd|password|passphrase|pwd|token"
    r"|credentials?)\b(?:\\?[\"'])?\s*[:=]\s*(?:\\?[\"'])?)(?!\[REDACTED\])([^\s\"'`,;()\[\]{}<>]{6,})"
)
# A random-looking token: long, and upper case, lower case and digits all in it.
_RANDOM = re.compile(r"(?<![A-Za-z0-9_+=-])[A-Za-z0-9_+-]{32,}={0,2}(?![A-Za-z0-9_+=-])")
# A URL's password, with or without a user name (`redis://:pw@host`).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@")
# A random segment of a URL's path that is a signature or a capability: a Slack or Discord webhook's
# secret, a share link's id. 20 characters or more; upper case, lower case and digits all in it.
_URL = re.compile(r"\bhttps?://[^\s\"'<>`]+")
_PATH_SECRET = re.compile(r"(?<=/)[A-Za-z0-9_-]{20,}(?=[/?#]|$)")
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")
_KEY_ENV_NAME = re.compile(r"(?i)(API_?KEY|TOKEN|SECRET|PASSWORD|ACCESS_KEY)$")


# Past this many characters a message loses its middle before the patterns run: they take time in
# proportion to the text, on the caller's thread (often the event loop), and a cell's 10 MB
# exception held a served process's loop for half a minute. Known keys and common key shapes are
# taken out of the whole text first.
_MESSAGE_CHARS = 20_000


class Redactor:
    """Replaces keys in text with [REDACTED] and host paths with `<host path>/NAME` (see the module
    doc); `secrets`: the keys a run was configured with, beside those the environment holds;
    `paths=False`: keep paths, for text only the operator reads (a CLI message, a server log)."""

    def __init__(self, secrets: Iterable[str | None] | None = None, *, paths: bool = True) -> None:
        self.paths = paths
        # Folders the sandboxes of this run work in: their paths are shown relative (hostpaths.py).
        self.shown: list[str] = []
        given = [s for s in (secrets or []) if s and len(s) >= 4]
        values = given + [v for name, v in os.environ.items() if _KEY_ENV_NAME.search(name) and len(v) >= 8]
        # Longest first, so a key that contains another is replaced whole. A configured key shorter
        # than 8 characters (a local server's) is taken out of messages only: in a whole trace line
        # it would match ordinary words.
        ordered = sorted(set(values), key=len, reverse=True)
        self._secrets = [s for s in ordered if len(s) >= 8]
        self._short = [s for s in ordered if len(s) < 8]

    def __call__(self, text: str) -> str:
        """Everything the module doc lists: for messages (an exception's, a log line), whose middle
        past _MESSAGE_CHARS is left out."""
        text = self.bulk(text)
        if len(text) > _MESSAGE_CHARS:
            half = _MESSAGE_CHARS // 2
            text = f"{text[:half]}\n... [{len(text) - 2 * half:,} characters left out] ...\n{text[-half:]}"
        if self.paths:
            text = scrub_paths(text, self.shown)
        for secret in self._short:
            if secret in text:
                text = text.replace(secret, REDACTED)
        text = _MORE_SHAPES.sub(REDACTED, text)
        text = _HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3) or ''}{REDACTED}", text)
        text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)
        text = _QUERY.sub(lambda m: m.group(1) + REDACTED, text)
        text = _USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
        if "://" in text:
            text = _URL.sub(_url_paths, text)
        text = _AWS_KEY_ID.sub(REDACTED, text)
        text = _ASSIGNED.sub(lambda m: m.group(1) + REDACTED, text)
        return _RANDOM.sub(lambda m: REDACTED if _looks_random(m.group(0)) else m.group(0), text)

    def bulk(self, text: str) -> str:
        """The known keys and the common key shapes only: for whole trace lines (model replies,
        REPL output), where running every pattern would cost several ms per 100 KB. Messages from
        the host (errors) are scrubbed in full where they are made. Paths stay: this text is the
        model's and the sandbox's own, which sees its own paths."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        if "sk-" in text or "AIza" in text:
            text = _COMMON_SHAPES.sub(lambda m: _outside_word(text, m), text)
        return text

    def exception(self, exc: BaseException) -> BaseException:
        """`exc` with its message scrubbed (in place, so its class and attributes stay)."""
        first: tuple[object, ...] = ()
        if isinstance(exc, RecursaError) and exc.args:
            exc.reword(self(exc.template))  # the marked message doors render; args[0] is made from it
            first = exc.args[:1]
        rest = exc.args[len(first) :]
        if any(isinstance(a, str) for a in rest):
            exc.args = (*first, *(self(a) if isinstance(a, str) else a for a in rest))
        if isinstance(exc, OSError):  # its message is made from these, not from args
            for name in ("filename", "filename2"):
                value = getattr(exc, name, None)
                if isinstance(value, str):
                    quote = '"' if "'" in value else "'"  # quoted, a path with spaces is taken whole
                    setattr(exc, name, self(f"{quote}{value}{quote}")[1:-1])
        return exc


def _url_paths(m: re.Match[str]) -> str:
    url = m.group(0)
    scheme_host, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if not slash:
        return url
    path = _PATH_SECRET.sub(lambda p: REDACTED if _looks_random(p.group(0)) else p.group(0), path)
    return f"{scheme_host}{sep}{host}/{path}"


def _looks_random(token: str) -> bool:
    return (
        any(c.isupper() for c in token)
        and any(c.islower() for c in token)
        and any(c.isdigit() for c in token)
    )


def looks_secret(name: str, value: str) -> bool:
    """Whether `name = value` would be scrubbed from a message: a secret's name, or a value of a
    key's shape (for what must not leave the host at all, such as a sandbox tool's constants)."""
    return bool(_ASSIGNED.fullmatch(f"{name}={value}")) or redact(value, paths=False) != value


def _outside_word(text: str, m: re.Match[str]) -> str:
    at = m.start()
    return m.group(0) if at and (text[at - 1].isalnum() or text[at - 1] == "_") else REDACTED


def redact(text: str, *secrets: str | None, paths: bool = True) -> str:
    """`text` scrubbed in full by a Redactor that also knows `secrets` (`paths`: as Redactor's)."""
    return Redactor(secrets, paths=paths)(text)
