"""Adapters to trainers and agent frameworks, each behind an optional extra.

- `recursa.integrations.dspy`: a DSPy `CodeInterpreter` on recursa's sandbox, for `dspy.RLM` (`recursa[dspy]`).
- `recursa.integrations.skyrl`: a SkyRL-gym `BaseTextEnv` registered as "recursa-rlm" (`recursa[skyrl]`).
- `recursa.integrations.verifiers`: a verifiers harness that runs `recursa acp` (`recursa[verifiers]`).

Importing this package imports none of them.
"""
