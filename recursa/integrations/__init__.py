"""Adapters to trainers and agent frameworks, each behind an optional extra.

- `recursa.integrations.skyrl`: a SkyRL-gym `BaseTextEnv` registered as "recursa-rlm" (`recursa[skyrl]`).
- `recursa.integrations.verifiers`: a verifiers harness that runs `recursa acp` (`recursa[verifiers]`).

Importing this package imports none of them.
"""
