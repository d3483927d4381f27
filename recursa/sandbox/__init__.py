"""Sandboxes: persistent Python REPLs that run generated code and call back to the host.

`make_sandbox("auto")` gives the default local worker process, hardened (rlimits, Landlock, seccomp)
and inside bubblewrap namespaces where bwrap is installed; `"subprocess"` is the same worker without
bwrap. `"inprocess"` runs the REPL in a host thread without any isolation (debugging only, and it
says so with a warning). Every sandbox's `isolation` says what is actually enforced.

A `ForkServer` forks workers from one warm zygote inside bwrap (forkserver.py): call trees with
child RLMs use one, so that a burst of children does not start a burst of interpreters.

The same worker also runs in a container (`"docker"`, `"podman"`: containers.py) or in a remote
sandbox (`"modal"`, `"e2b"`: remote.py, optional extras), over its stdin and stdout, and on the
nodes of a Ray cluster (`"ray"`: cluster/, the node's own local sandbox run by a host actor there).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from recursa.errors import ConfigError
from recursa.sandbox.base import ExecResult, Sandbox
from recursa.sandbox.cluster import RaySandbox
from recursa.sandbox.cluster.pool import preflight as ray_preflight
from recursa.sandbox.cluster.pool import release_loop as ray_release
from recursa.sandbox.containers import ContainerSandbox
from recursa.sandbox.forkserver import ForkServer
from recursa.sandbox.inprocess import InProcessSandbox
from recursa.sandbox.policy import Hardening
from recursa.sandbox.remote import E2BSandbox, ModalSandbox
from recursa.sandbox.subprocess import SubprocessSandbox

__all__ = [
    "SANDBOXES",
    "ExecResult",
    "ForkServer",
    "Hardening",
    "InProcessSandbox",
    "Sandbox",
    "SubprocessSandbox",
    "make_sandbox",
]


@dataclass(frozen=True)
class SandboxKind:
    """One value of `sandbox=`: how to make it, and what the rest of recursa needs to know of it.

    Adding a kind is one entry in `SANDBOXES`: RLM(sandbox=...), RLMEnv, the CLI's --sandbox choices,
    the check of `sandbox_options` and the settings page all read this mapping."""

    make: Callable[..., Sandbox]  # options -> a sandbox (not started)
    options_of: type  # the class whose keyword parameters are the kind's `sandbox_options`
    help: str
    forks: bool = False  # its workers can fork from a shared ForkServer (recursa/sandbox/forkserver.py)
    snapshots: bool = False  # its REPLs keep state-keeping snapshots (the `snapshots` option)
    image: bool = False  # it runs in an image of its own: the REPL imports what that image installs
    # What can be checked of the kind and its options before any run (a missing extra, a cluster
    # address that does not answer): ConfigError, raised when the config is built.
    preflight: Callable[[dict[str, Any]], None] | None = None
    # What the kind keeps per event loop for its REPLs (a Ray pool's streams to the nodes), let go
    # when an environment on that loop closes.
    release: Callable[[], Awaitable[None]] | None = None
    # The class whose options the kind's own **kwargs pass on to the sandbox it runs (a Ray node's
    # local one): those are checked too, as they are where that sandbox runs here.
    passes_on: type | None = None

    def option_names(self) -> list[str] | None:
        """The `sandbox_options` this kind takes, or None when it takes any (a **kwargs constructor
        that passes them on to no known class)."""
        if self.passes_on is None and _takes_any(self.options_of):
            return None
        names = _options_of(self.options_of)
        return sorted(names | _options_of(self.passes_on) if self.passes_on is not None else names)


def _takes_any(cls: Callable[..., Any]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())


def _options_of(cls: Callable[..., Any]) -> set[str]:
    """The keyword arguments of `cls` a user may set: those with a default (one without is recursa's
    to give: a container's kind, the Ray sandbox's maker)."""
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(cls).parameters
    return {n for n, p in params.items() if p.kind in keyword and p.default is not p.empty}


def _auto(**options: Any) -> Sandbox:
    options.setdefault("bwrap", None)  # namespaces when bwrap is installed and works here
    return SubprocessSandbox(**options)


def _inprocess(**options: Any) -> Sandbox:
    warnings.warn(
        'sandbox="inprocess" runs generated code inside this process with no isolation '
        "(your files, environment and API keys are reachable); use it only for debugging.",
        stacklevel=3,
    )
    return InProcessSandbox(**options)


SANDBOXES: dict[str, SandboxKind] = {
    "auto": SandboxKind(
        _auto, SubprocessSandbox, "a hardened worker process, inside bubblewrap where bwrap works", forks=True,
        snapshots=True,
    ),
    "subprocess": SandboxKind(
        SubprocessSandbox, SubprocessSandbox, "the same hardened worker without bubblewrap", forks=True,
        snapshots=True,
    ),
    "inprocess": SandboxKind(_inprocess, InProcessSandbox, "a thread of this process, no isolation (debugging)"),
    "docker": SandboxKind(
        lambda **o: ContainerSandbox("docker", **o), ContainerSandbox, "the worker in a Docker container", image=True
    ),
    "podman": SandboxKind(
        lambda **o: ContainerSandbox("podman", **o), ContainerSandbox, "the worker in a Podman container", image=True
    ),
    "modal": SandboxKind(ModalSandbox, ModalSandbox, "a Modal sandbox (the modal extra)", image=True),
    "e2b": SandboxKind(E2BSandbox, E2BSandbox, "an E2B sandbox (the e2b extra)", image=True),
    "ray": SandboxKind(
        lambda **o: RaySandbox(make_sandbox=make_sandbox, **o),
        RaySandbox,
        "the node's own local sandbox on a Ray cluster, run by a host actor there (the ray extra)",
        snapshots=True,  # the node's local sandbox takes them
        preflight=ray_preflight,
        release=ray_release,
        passes_on=SubprocessSandbox,  # the node's local sandbox ("auto" or "subprocess")
    ),
}


def sandbox_kind(kind: Any, where: str = "make_sandbox") -> SandboxKind:
    """The registered kind named `kind`; a ConfigError naming `where` and the choices otherwise."""
    found = SANDBOXES.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise ConfigError(f"{where}: unknown sandbox {kind!r}; choose one of: {', '.join(SANDBOXES)}")
    return found


def make_sandbox(kind: str = "auto", **options: Any) -> Sandbox:
    """A sandbox by name (a key of `SANDBOXES`); `options` go to its constructor. Raises ConfigError
    for unknown kinds; "modal" and "e2b" raise it naming the extra when their SDK is missing."""
    return sandbox_kind(kind).make(**options)
