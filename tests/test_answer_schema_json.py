"""answer_schema as a JSON Schema dict (what an OpenAI response_format carries): the schema is
checked up front, an answer is validated as JSON text or as a value, and the errors name the path."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jsonschema")

from recursa.errors import ConfigError
from recursa.loop.answer_schema import AnswerCheck
from recursa.sandbox.base import FinalAnswer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name"],
    "additionalProperties": False,
}


def _final(value):
    text = value if isinstance(value, str) else json.dumps(value)
    return FinalAnswer(text=text, value=value, protocol="FINAL")


def test_a_valid_answer_as_text_or_value_is_rendered_as_json():
    check = AnswerCheck.of(SCHEMA)
    for given in ('{"name": "Ada", "tags": ["x"]}', {"name": "Ada", "tags": ["x"]}):
        value, errors = check.check(_final(given))
        assert errors == [] and value == {"name": "Ada", "tags": ["x"]}
        assert json.loads(check.render(value)) == value
    assert '"required": ["name"]' in check.instructions()


def test_errors_name_the_path_and_the_problem():
    check = AnswerCheck.of(SCHEMA)
    _, errors = check.check(_final({"tags": [1], "extra": True}))
    text = "\n".join(errors)
    assert "'name' is a required property" in text
    assert "tags.0: 1 is not of type 'string'" in text
    assert "Additional properties are not allowed" in text
    _, errors = check.check(_final("not json at all"))
    assert errors and "not JSON text" in errors[0]
    assert "does not match the required schema" in check.feedback(errors)


def test_an_invalid_schema_is_refused_before_the_run():
    with pytest.raises(ConfigError, match="not a valid JSON Schema"):
        AnswerCheck.of({"type": "no-such-type"})
