"""Typed answers: `run(..., answer_schema=Model)` checks the final value and tells the model what failed.

The schema is a type pydantic validates (a model class, a dataclass, `list[str]`, ...) or a JSON
Schema given as a dict (what an OpenAI `response_format` carries), checked with `jsonschema`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic.errors import PydanticSchemaGenerationError

from recursa.errors import ConfigError
from recursa.extras import install_hint
from recursa.sandbox.base import FinalAnswer

# The schema is shown to the model once, in its first message; a huge one is cut.
_SCHEMA_CHARS = 6_000
_SHOWN_ERRORS = 8


@dataclass(frozen=True)
class AnswerCheck:
    schema: Any
    adapter: TypeAdapter[Any] | None  # None for a JSON Schema dict
    json_schema: str
    validator: Any = None  # a jsonschema validator, for a JSON Schema dict

    @classmethod
    def of(cls, schema: Any) -> AnswerCheck:
        if isinstance(schema, dict):
            return cls._of_json_schema(schema)
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(schema)
            text = json.dumps(adapter.json_schema(), ensure_ascii=False)
        except (PydanticSchemaGenerationError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"answer_schema={schema!r} is not a type pydantic can validate ({exc}); pass a pydantic "
                "model class, a dataclass, a TypedDict, a type such as list[str], or a JSON Schema as a dict."
            ) from None
        return cls(schema, adapter, _cut(text))

    @classmethod
    def _of_json_schema(cls, schema: dict[str, Any]) -> AnswerCheck:
        try:
            import jsonschema
        except ImportError:
            raise ConfigError(
                "a JSON Schema dict as answer_schema needs the jsonschema package: " + install_hint("server")
            ) from None
        try:
            validator_class = jsonschema.validators.validator_for(schema)
            validator_class.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ConfigError(f"answer_schema is not a valid JSON Schema: {exc.message}") from None
        text = json.dumps(schema, ensure_ascii=False)
        return cls(schema, None, _cut(text), validator_class(schema))

    def instructions(self) -> str:
        return (
            "Your final answer must be a value matching this JSON schema (build it in code as a dict or "
            f"list and return it with FINAL_VAR, or give it as JSON text):\n{self.json_schema}"
        )

    def check(self, final: FinalAnswer) -> tuple[Any, list[str]]:
        """(the validated value, []), or (None, what failed: one "field: reason" per problem)."""
        value = final.value
        if self.validator is not None:
            return self._check_json(value)
        assert self.adapter is not None
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

    def _check_json(self, value: Any) -> tuple[Any, list[str]]:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                return None, [f"(the value): not JSON text ({exc.msg} at character {exc.pos})"]
        found = sorted(self.validator.iter_errors(value), key=lambda e: list(e.path))
        if not found:
            return value, []
        errors = [
            f"{'.'.join(str(p) for p in err.path) or '(the value)'}: {err.message}"
            for err in found[:_SHOWN_ERRORS]
        ]
        if len(found) > _SHOWN_ERRORS:
            errors.append(f"... and {len(found) - _SHOWN_ERRORS} more")
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
        if self.adapter is None:
            return json.dumps(value, ensure_ascii=False)
        return self.adapter.dump_json(value).decode("utf-8")


def _cut(text: str) -> str:
    return text if len(text) <= _SCHEMA_CHARS else text[:_SCHEMA_CHARS] + " ..."
