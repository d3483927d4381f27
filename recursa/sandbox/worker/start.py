"""The worker's entry point: the script the host runs, as its cached bytecode (bytecode.py).

The worker is this folder, a package of standard-library modules, one idea each: wire.py (frames
and the channel), errors.py, capture.py, values.py, repl.py, prose.py, context.py, keeper.py, snapshots.py
and server.py (the main loop); the lockdown in hardening.py with landlock.py, seccomp.py and
syscalls.py; the fork server in zygote.py. It must not import recursa, and this folder must not
go on sys.path (its module names would shadow the standard library's for generated code). So this
script makes the folder a package of its own, `recursa_worker`, whose only search path is this
folder, and runs the server from it. Containers and remote sandboxes get the same modules over
their stdin instead (stdio.py bundles them).
"""

import os
import sys

PACKAGE = "recursa_worker"


def _folder() -> str:
    """This script's folder, also when the interpreter runs its cached bytecode (__pycache__)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(here) if os.path.basename(here) == "__pycache__" else here


if __name__ == "__main__":
    package = type(sys)(PACKAGE)
    package.__path__ = [_folder()]
    sys.modules[PACKAGE] = package
    __import__(f"{PACKAGE}.server", fromlist=["_"]).main()
