"""The verifiers plugin id `recursa-verifiers`: verifiers imports plugins by a top-level module name,
so this module re-exports the harness and taskset of `recursa.integrations.verifiers`.

    --env.taskset.id recursa-verifiers --env.agent.harness.id recursa-verifiers
"""

from recursa.integrations.verifiers import (
    RecursaHarness,
    RecursaHarnessConfig,
    RecursaTask,
    RecursaTaskData,
    RecursaTaskset,
    RecursaTasksetConfig,
)

__all__ = [
    "RecursaHarness",
    "RecursaHarnessConfig",
    "RecursaTask",
    "RecursaTaskData",
    "RecursaTaskset",
    "RecursaTasksetConfig",
]
