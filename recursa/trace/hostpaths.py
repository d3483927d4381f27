"""Keep the host's file paths out of what it tells the sandbox, the model, a trace or a client.

A host tool that fails with `FileNotFoundError: ... '/home/alice/secrets/x.txt'`, a traceback
through `/usr/lib/python3.11/...`, a context file's resolved path: each tells a hostile model or
client who runs the host and how it is laid out. Every absolute path in such a message becomes
`<host path>/NAME`: the file's name stays (it is what the message is about, and the model can act on
it), the folders before it go. The exception's type and the rest of the message are untouched.

What is kept as it is, and why:
- paths under a folder the sandbox itself works in (its scratch folder, which is its cwd, HOME and
  TMPDIR at the same path inside and out) are shown relative to it (`./out.txt`): the code already
  names them that way, and the folder's own location says nothing the code cannot read with getcwd();
- `/dev/...` (the same on every Linux host) and URL routes such as `/v1/chat/completions` (a server's
  API, not a file);
- relative paths: they say nothing about where they are.
The context path a user gave is NOT kept: the model is never told it (a folder's files are keyed by
their names inside it), and on a server it can be the resolved target of a link the client never saw.
A home folder's own name (`/home/alice`) and the login's name are dropped too, not kept as the "file
name". The operator's own views (the CLI's messages, the server's log) keep the paths: see Redactor.
"""

from __future__ import annotations

import getpass
import os
import re
from collections.abc import Iterable

HOST_PATH = "<host path>"

# A path's start: not inside a word, a URL (`//host/a/b`: the slash after the host follows a letter)
# or a path already shown as `<host path>/x` or `./x`. `file://` URLs and `../../home/...` (which
# climbs to a named folder) are taken on purpose.
_START = r"(?:(?<![\w.~>/\\-])|(?<=file://)|(?<=\.\.))"
# A component of an unquoted path ends at white space and at the punctuation prose and tracebacks put
# around a path (`"...", line 3`, `x.py:12`, `(at /a/b)`); a quoted one runs to its closing quote.
_PART = r"[^\s/\\:'\"`<>|;,()\[\]{}]+"
_WINDOWS = r"(?:[A-Za-z]:|\\\\[^\\\s'\"]+)\\+[^\\\s'\"<>|:;,()]+(?:\\+[^\\\s'\"<>|:;,()]+)*"
# Two components at least when unquoted: a lone `/x` in prose is as often a ratio or a unit (`MB /s`).
# (`~user/x` counts with one: the user's name is what it gives away.)
_UNQUOTED = re.compile(rf"{_START}(?:{_WINDOWS}|/{_PART}(?:/{_PART})+/?|~[\w.-]*/{_PART}(?:/{_PART})*/?)")
_QUOTED_START = r"(?:/|~[\w.-]*/|[A-Za-z]:\\|\\\\)"
_QUOTED = re.compile(rf"'({_QUOTED_START}[^'\n]*)'" + rf'|"({_QUOTED_START}[^"\n]*)"')
# The same paths as other formats write them: JSON with escaped slashes (`\/home\/alice\/x`) and
# URL-encoded (`?path=%2Fhome%2Falice%2Fx`).
_ESCAPED = re.compile(r"(?<![\w>\\])(?:\\/[^\s\\/'\"<>|;,()\[\]{}:]+){2,}")
_ENCODED = re.compile(r"(?i)(?<![\w%])(?:%2F[\w.~+-]+){2,}")
_KEPT = re.compile(r"^/(?:dev/|v\d+[a-z]*(?:/|$))")
_HOME_PARENTS = frozenset({"home", "Users", "export", "u", "users"})


def _login_names() -> frozenset[str]:
    names = {os.environ.get("USER"), os.environ.get("LOGNAME"), os.path.basename(os.path.expanduser("~"))}
    try:
        names.add(getpass.getuser())
    except (OSError, KeyError):  # no passwd entry for this uid (a container's random user)
        pass
    return frozenset(n for n in names if n and n not in ("/", "root"))


_LOGINS = _login_names()


def scrub_paths(text: str, shown: Iterable[str] = ()) -> str:
    """`text` with every absolute host path replaced as the module doc says; `shown`: folders the
    sandbox works in, whose paths are shown relative to them."""
    if "/" not in text and "\\" not in text and "%2" not in text.upper():
        return text
    roots = [r.rstrip("/") for r in shown if r and r != "/"]

    def one(path: str) -> str:
        return _neutral(path, roots)

    text = _QUOTED.sub(lambda m: f"'{one(m[1])}'" if m[1] is not None else f'"{one(m[2])}"', text)
    text = _UNQUOTED.sub(lambda m: one(m.group(0)), text)
    text = _ESCAPED.sub(lambda m: one(m.group(0).replace("\\/", "/")).replace("/", "\\/"), text)
    return _ENCODED.sub(lambda m: one(re.sub("(?i)%2F", "/", m.group(0))).replace("/", "%2F"), text)


def _neutral(path: str, roots: list[str]) -> str:
    if _KEPT.match(path):
        return path
    for root in roots:
        if path == root:
            return "."
        if path.startswith(root + "/"):
            return "./" + path[len(root) + 1 :]
    sep = "\\" if "\\" in path and not path.startswith("/") else "/"
    parts = [p for p in re.split(r"[\\/]+", path) if p]
    if not parts:
        return path
    name = parts[-1]
    home_folder = len(parts) == 2 and parts[0] in _HOME_PARENTS
    if home_folder or name in _LOGINS or name.startswith("~") or re.fullmatch(r"[A-Za-z]:", name):
        return HOST_PATH
    return f"{HOST_PATH}{sep}{name}"
