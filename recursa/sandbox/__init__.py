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

import warnings
from typing import Any

from recursa.errors import ConfigError
from recursa.sandbox.base import CallbackError, CallHandler, ExecResult, FinalAnswer, Sandbox
from recursa.sandbox.cluster import RaySandbox
from recursa.sandbox.containers import ContainerSandbox
from recursa.sandbox.forkserver import ForkServer
from recursa.sandbox.inprocess import InProcessSandbox
from recursa.sandbox.policy import Hardening
from recursa.sandbox.remote import E2BSandbox, ModalSandbox
from recursa.sandbox.stdio import StdioSandbox
from recursa.sandbox.subprocess import SubprocessSandbox

SANDBOX_KINDS = ("auto", "subprocess", "inprocess", "docker", "podman", "modal", "e2b", "ray")

__all__ = [
    "SANDBOX_KINDS",
    "CallHandler",
    "CallbackError",
    "ContainerSandbox",
    "E2BSandbox",
    "ExecResult",
    "FinalAnswer",
    "ForkServer",
    "Hardening",
    "InProcessSandbox",
    "ModalSandbox",
    "RaySandbox",
    "Sandbox",
    "StdioSandbox",
    "SubprocessSandbox",
    "make_sandbox",
]


def make_sandbox(kind: str = "auto", **options: Any) -> Sandbox:
    """A sandbox by name; `options` go to its constructor. Raises ConfigError for unknown kinds."""
    if kind == "auto":
        options.setdefault("bwrap", None)  # namespaces when bwrap is installed and works here
        return SubprocessSandbox(**options)
    if kind == "subprocess":
        return SubprocessSandbox(**options)
    if kind == "inprocess":
        warnings.warn(
            'sandbox="inprocess" runs generated code inside this process with no isolation '
            "(your files, environment and API keys are reachable); use it only for debugging.",
            stacklevel=2,
        )
        return InProcessSandbox(**options)
    if kind in ("docker", "podman"):
        return ContainerSandbox(kind, **options)
    if kind == "modal":
        return ModalSandbox(**options)  # ConfigError naming the extra when the SDK is missing
    if kind == "e2b":
        return E2BSandbox(**options)
    if kind == "ray":
        return RaySandbox(make_sandbox=make_sandbox, **options)  # ConfigError naming the extra
    raise ConfigError(f"unknown sandbox {kind!r}; choose one of: {', '.join(SANDBOX_KINDS)}")
