"""Generated code may only call the models the RLM was configured with."""

from __future__ import annotations

import pytest

from recursa.errors import ConfigError
from tests.test_escapes import feedback_before
from tests.test_rlm_openai import ROOT, SUB, code, make_rlm

PROBE = (
    "for m in ({models}):\n"
    "    try:\n"
    "        print(m, '->', llm_query('hi', model=m))\n"
    "    except SubcallError as e:\n"
    "        print(m, 'refused:', e)\n"
    "try:\n"
    "    llm_query_batched(['a', 'b'], model='openai/expensive-model')\n"
    "except SubcallError as e:\n"
    "    print('batch refused:', e)"
)


def models_asked(server) -> set[str]:
    return {r.model for r in server.requests}


def test_a_model_outside_the_configuration_is_refused_naming_the_allowed_ones(server, script, tmp_path):
    models = "'openai/expensive-model', 'expensive-model', 'anthropic/claude-opus-4-1', 'sub-model', 'openai/root-model'"
    script.root("root-model", code(PROBE.format(models=models)), code("FINAL('next turn ok')"))
    script.sub("sub-model", lambda p: "from sub").sub("root-model", lambda p: "from root")
    result = make_rlm(server, tmp_path, sandbox="subprocess").run("q", "ctx")
    assert result.answer == "next turn ok", result.error
    seen = feedback_before(server, 2)
    allowed = f"llm_query(model=...) may use: {SUB}, {ROOT}"
    for refused in ("openai/expensive-model", "expensive-model", "anthropic/claude-opus-4-1"):
        assert f"{refused} refused: model '{refused}' is not available to this run; {allowed}" in seen
    assert "batch refused: model 'openai/expensive-model' is not available" in seen
    assert "sub-model -> from sub" in seen and "openai/root-model -> from root" in seen
    # Nothing was sent for a refused model, not even to check it exists.
    assert models_asked(server) == {"root-model", "sub-model"}


def test_allowed_models_adds_models_and_the_root_is_told_which(server, script, tmp_path):
    models = "'openai/expensive-model', 'cheap-model', 'openai/other'"
    script.root("root-model", code(PROBE.format(models=models)), code("FINAL('next turn ok')"))
    script.sub("expensive-model", lambda p: "E").sub("cheap-model", lambda p: "C")
    rlm = make_rlm(
        server,
        tmp_path,
        sandbox="subprocess",
        allowed_models=["openai/expensive-model", "openai/cheap-model"],
    )
    result = rlm.run("q", "ctx")
    assert result.answer == "next turn ok", result.error
    seen = feedback_before(server, 2)
    assert "openai/expensive-model -> E" in seen and "cheap-model -> C" in seen
    assert "openai/other refused" in seen and "openai/cheap-model" in seen.split("openai/other refused")[1]
    system = server.requests[0].messages[0]["content"]
    assert f"`model=` may name one of: {SUB}, {ROOT}, openai/expensive-model, openai/cheap-model" in system


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("openai/x", "must be a list of model names"),
        ([3], "model 3 names no provider"),
        (["x"], "names no provider"),
    ],
)
def test_bad_allowed_models_fail_at_construction(server, tmp_path, value, match):
    with pytest.raises(ConfigError, match=match):
        make_rlm(server, tmp_path, allowed_models=value)
