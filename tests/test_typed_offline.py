"""Typed answers offline: the scripted roots answer a schema-bound question with a value that
validates, built from the schema and what their code found (`RLM.run(answer_schema=...)` here;
through `recursa serve` and real clients in test_serve_clients.py and test_serve_dropin.py)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from recursa import RLM
from recursa.scripted.answer_forms import marked_fields, schema_value
from recursa.tasks import generate

TASK = generate("niah", 20_000, seed=5)  # the needle: a number the root's code finds
NEEDLE = int(TASK.gold)


class Risk(BaseModel):
    title: str
    severity: int


class Finding(BaseModel):
    kind: Literal["number", "word"]
    score: float = Field(ge=0, le=1)
    tags: list[str] = Field(min_length=2)
    note: str | None


@pytest.mark.parametrize("root", ["gpt5-like", "qwen-coder-like", "no-subcalls"])
def test_every_scripted_root_answers_a_schema_with_what_it_found(tmp_path, root):
    rlm = RLM(f"scripted/{root}", sub_model="scripted/oracle", trace_dir=tmp_path)
    result = rlm.run(TASK.question, context=TASK.context, answer_schema=list[Risk])
    assert result.stop_reason == "final" and result.error is None
    assert result.value == [Risk(title=TASK.gold, severity=NEEDLE)]


def test_schema_values_keep_to_enums_bounds_lengths_and_refs():
    schema = Finding.model_json_schema()
    value = schema_value(schema, "a number: 4922546")
    assert Finding.model_validate(value) == Finding(
        kind="number", score=1.0, tags=["a number: 4922546"] * 2, note="a number: 4922546"
    )
    nested = {
        "$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}},
        "$ref": "#/$defs/N",
    }
    assert isinstance(schema_value(nested, "x"), dict)  # a schema that refers to itself ends


def test_marked_fields_are_the_last_paragraphs():
    question = (
        "[[ ## question ## ]]\nWhat?\n\nRespond with the fields `[[ ## reasoning ## ]]`, then "
        "`[[ ## answer ## ]]`, and then ending with the marker for `[[ ## completed ## ]]`."
    )
    assert marked_fields(question) == ["reasoning", "answer"]
    assert marked_fields("[[ ## answer ## ]] is a heading here") == []  # no closing marker asked for
