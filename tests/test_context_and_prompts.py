import os
from pathlib import Path

import pytest

from recursa.context import build_payload
from recursa.errors import ConfigError, ContextError
from recursa.loop.prompts import PromptSettings, first_message, system_prompt, template_for


def test_str_context_round_trips_through_the_buffer():
    text = "héllo wörld\n" * 1000
    p = build_payload(text)
    assert p.kind == "str" and p.info.total_chars == len(text)
    assert p.read_bytes().decode() == text
    p.close()


def test_list_and_dict_contexts_keep_piece_boundaries():
    p = build_payload(["ab", "ç", ""])
    assert p.byte_lengths == [2, 2, 0] and p.info.chunk_lengths == [2, 1, 0]
    d = build_payload({"a.txt": "x", "b.txt": "yz"})
    assert d.keys == ["a.txt", "b.txt"] and d.info.total_chars == 3


def test_path_file_and_directory(tmp_path: Path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    p = build_payload(tmp_path)
    assert p.kind == "dict" and p.keys == ["a.txt", "sub/b.md"]
    assert p.info.skipped_files == ["bin.dat (not UTF-8 text)"]
    assert build_payload(tmp_path / "a.txt").info.total_chars == 5


@pytest.mark.parametrize(
    ("context", "needle"),
    [
        ("", "empty"),
        ([], "empty"),
        (b"\xff\xfe", "not valid UTF-8"),
        (["ok", 3], "element 1 is int"),
        ({"k": b"x"}, "value of key 'k'"),
        (3.5, "unsupported context type float"),
        (Path("/nonexistent/x.txt"), "does not exist"),
    ],
)
def test_bad_contexts_name_the_problem(context, needle):
    with pytest.raises(ContextError, match=needle):
        build_payload(context)


def test_payload_fd_is_closed_once():
    p = build_payload("abc")
    fd = p.fd
    p.close()
    p.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_root_sees_metadata_never_the_context():
    secret_tail = "THE-HIDDEN-END"
    text = "x" * 5000 + secret_tail
    p = build_payload(text)
    msg = first_message("Where is it?", p.info)
    assert "<question>\nWhere is it?\n</question>" in msg
    assert "5,014 characters" in msg
    assert secret_tail not in msg
    assert len(msg) < 1000


def test_many_chunks_are_summarised_in_constant_size():
    small = build_payload([f"doc {i}" for i in range(30)])
    big = build_payload([f"doc {i}" for i in range(100_000)])
    assert "their lengths in characters: 5, 5" in first_message("q", small.info)
    summary = first_message("q", big.info)
    assert "100,000 elements" in summary and "median" in summary
    assert len(summary) < 1200


def test_templates_per_family_and_depth_text():
    info = build_payload("abc").info
    default = system_prompt(template_for("openai/gpt-5"), info, PromptSettings(1, 20_000, 500_000))
    qwen = system_prompt(template_for("openai/Qwen/Qwen3-Coder"), info, PromptSettings(1, 20_000, 100_000))
    assert "llm_query_batched" in default and "$max_output_chars" not in default
    assert "Never call a model once per line" in qwen and "Never call a model once per line" not in default
    assert "plain model calls" in default  # depth 1: rlm_query falls back to a model call
    deep = system_prompt(template_for("x/y"), info, PromptSettings(2, 20_000, 500_000))
    assert "its own REPL" in deep
    none = system_prompt(template_for("x/y"), info, PromptSettings(0, 20_000, 500_000))
    assert "No model calls are available" in none
    assert 'answer["ready"] = True' in system_prompt(
        template_for("x", "answer-dict"), info, PromptSettings(1, 200, 1000)
    )


def test_unknown_template_is_a_clear_error():
    with pytest.raises(ConfigError, match="neither a built-in template"):
        template_for("x", "no-such-template")
