"""Typed answers: `run(..., answer_schema=Model)` checks the final value and tells the model what failed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic.errors import PydanticSchemaGenerationError

from recursa.errors import ConfigError
from recursa.sandbox.base import FinalAnswer

# The schema is shown to the model once, in its first message; a huge one is cut.
_SCHEMA_CHARS = 6_000
_SHOWN_ERRORS = 8


@dataclass(frozen=True)
class AnswerCheck:
    schema: Any
    adapter: TypeAdapter[Any]
    json_schema: str

    @classmethod
    def of(cls, schema: Any) -> AnswerCheck:
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(schema)
            text = json.dumps(adapter.json_schema(), ensure_ascii=False)
        except (PydanticSchemaGenerationError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"answer_schema={schema!r} is not a type pydantic can validate ({exc}); pass a pydantic "
                "model class, a dataclass, a TypedDict or a type such as list[str]."
            ) from None
        if len(text) > _SCHEMA_CHARS:
            text = text[:_SCHEMA_CHARS] + " ..."
        return cls(schema, adapter, text)

    def instructions(self) -> str:
        return (
            "Your final answer must be a value matching this JSON schema (build it in code as a dict or "
            f"list and return it with FINAL_VAR, or give it as JSON text):\n{self.json_schema}"
        )

    def check(self, final: FinalAnswer) -> tuple[Any, list[str]]:
        """(the validated value, []), or (None, what failed: one "field: reason" per problem)."""
        value = final.value
        try:
            if isinstance(value, str):
                try:
                    return self.adapter.validate_json(value), []
                except ValidationError:
                    return self.adapter.validate_python(value), []
            return self.adapter.validate_python(value), []
        except ValidationError as exc:
            errors = [
                f"{'.'.join(str(p) for p in err['loc']) or '(the value)'}: {err['msg']}"
                for err in exc.errors()[:_SHOWN_ERRORS]
            ]
            more = exc.error_count() - len(errors)
            if more > 0:
                errors.append(f"... and {more} more")
            return None, errors

    def feedback(self, errors: list[str]) -> str:
        """What the model is told when its answer does not fit."""
        return (
            "Your answer does not match the required schema, so it was not accepted:\n"
            + "\n".join(f"- {e}" for e in errors)
            + f"\nThe schema again: {self.json_schema}\nFix the value and answer again."
        )

    def render(self, value: Any) -> str:
        """The validated value as the result's text: JSON, so it parses back the same."""
        return self.adapter.dump_json(value).decode("utf-8")
