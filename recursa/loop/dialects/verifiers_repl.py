"""The REPL side of dialect="verifiers": the code that makes recursa's REPL behave, for the model, as
the worker of Prime Intellect's RLM environment (verifiers 0.1.14) does.

That worker runs each cell in a namespace holding `extra_data` (the path of a folder with the input
data as files, which is also its working directory) and `answer = {"ready": False, "content": ""}`;
it evaluates a cell's last expression apart and shows its repr as `Out[n]` (n counting the cells
run), and reports an exception as its traceback after the cell's output. Before each cell the
environment overwrites `.messages` in that folder with the conversation so far (JSONL).

Here a cell goes to recursa's REPL as one call of a helper defined by `cell_code` itself (so a
model that deletes the helper does not break the next cell): it writes the transcript, runs the
model's code the same way, and leaves {status, result, execution_count} in `RESULT_NAME` for the
host to read. The model's stdout and stderr reach the host as the REPL's own output.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any, Literal

RESULT_NAME = "_rlm_vf_result"
_HELPER = "_rlm_vf_cell"
_ROOT = "_rlm_vf_root"  # the folder, where `.messages` goes whatever the model does to extra_data
ExtraData = Literal["folder", "value"]
_NOTHING: Any = object()

# Runs in the REPL, once per cell (a no-op once the helper exists). Only the model's frames are
# kept in a traceback ("<cell>", and "<unknown>" for a cell that does not parse): the frames of
# the helper itself are recursa's, not the model's.
_DEFINE = """
if "_rlm_vf_cell" not in globals():
    def _rlm_vf_define():
        import ast, os, traceback
        count = [0]

        def shown_traceback(exc):
            te = traceback.TracebackException.from_exception(exc)
            te.stack = traceback.StackSummary.from_list(
                [f for f in te.stack if f.filename in ("<cell>", "<unknown>")]
            )
            text = "".join(te.format())
            if not text.startswith("Traceback"):
                text = "Traceback (most recent call last):\\n" + text
            return text

        def cell(code, transcript, folder, cap, taken=None):
            namespace = globals()
            namespace["_rlm_vf_result"] = None  # an interrupted cell leaves no record of an earlier one
            if taken is not None and isinstance(namespace.get("answer"), dict):
                namespace["answer"].clear()  # as the environment keeps it once set, for the later calls
                namespace["answer"].update({"ready": True, "content": taken[0]})
            if transcript is not None and folder:
                with open(os.path.join(folder, ".messages"), "w", encoding="utf-8") as f:
                    f.write(transcript)
            count[0] += 1
            out = {"status": "ok", "result": None, "execution_count": count[0]}
            try:
                body = list(ast.parse(code, mode="exec").body)
                last = body.pop() if body and isinstance(body[-1], ast.Expr) else None
                if body:
                    exec(compile(ast.Module(body=body, type_ignores=[]), "<cell>", "exec"), namespace, namespace)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace, namespace)
                    if value is not None:
                        out["result"] = repr(value)[:cap]
            except Exception as exc:
                out["status"] = "error"
                out["result"] = shown_traceback(exc)[:cap]
            namespace["_rlm_vf_result"] = out

        return cell

    _rlm_vf_cell = _rlm_vf_define()
    del _rlm_vf_define
"""


def setup_code(extra_data: ExtraData, folder_context: bool, host_pid: int) -> str:
    """Code run once in a fresh REPL: the answer dict as the environment starts it, and
    `extra_data`. "folder": a folder holding the context as the environment writes it (a str as
    context.txt, a list or dict as context.json, a folder context's files under their own names),
    made the working directory; "value": the context itself (the environment's earlier releases)."""
    lines = ["answer.clear()", 'answer.update({"ready": False, "content": ""})']
    if extra_data == "value":
        return "\n".join([*lines, "extra_data = context"])
    # An in-process REPL (sandbox="inprocess", for debugging) shares the host's working directory:
    # it is left as it is there.
    lines += [
        # A folder's image file is a line about it in `context` (recursa/confined.py, image_entry):
        # its bytes stay on the host, so it has no file here.
        "def _rlm_vf_image(text):",
        "    return text.startswith('[image file: ') and 'llm_query(prompt, images=[' in text",
        "def _rlm_vf_folder():",
        "    import json, os, tempfile",
        "    root = os.path.join(tempfile.mkdtemp(prefix='rlm_'), 'rlm_fs')",
        "    os.makedirs(root)",
        f"    if {folder_context!r} and isinstance(context, dict):",
        "        for name, text in context.items():",
        "            path = os.path.normpath(os.path.join(root, name))",
        "            if not path.startswith(root + os.sep) or _rlm_vf_image(text):",
        "                continue",
        "            os.makedirs(os.path.dirname(path), exist_ok=True)",
        "            with open(path, 'w', encoding='utf-8') as f:",
        "                f.write(text)",
        "    elif isinstance(context, str):",
        "        with open(os.path.join(root, 'context.txt'), 'w', encoding='utf-8') as f:",
        "            f.write(context)",
        "    else:",
        "        with open(os.path.join(root, 'context.json'), 'w', encoding='utf-8') as f:",
        "            f.write(json.dumps(context, ensure_ascii=True, allow_nan=False))",
        f"    if os.getpid() != {int(host_pid)}:",
        "        os.chdir(root)",
        "    return root",
        f"extra_data = {_ROOT} = _rlm_vf_folder()",
        "del _rlm_vf_folder, _rlm_vf_image",
    ]
    return "\n".join(lines)


def cell_code(code: str, transcript: str | None, cap: int, taken: Any = _NOTHING) -> str:
    """The REPL code that runs one call's `code` (`transcript`: the new `.messages`, or None; `cap`:
    characters of a repr or traceback worth sending back, as the output is cut there anyway;
    `taken`: the content of an answer an earlier call of the reply set, which recursa's REPL took
    and cleared, put back ready first)."""
    again = "None" if taken is _NOTHING else f"({_literal(taken)},)"
    return _DEFINE + f"{_HELPER}({code!r}, {transcript!r}, globals().get({_ROOT!r}), {int(cap)}, {again})\n"


def _literal(value: Any) -> str:
    """`value` as Python source (a JSON-safe value is one, but for a float such as nan: its text)."""
    text = repr(value)
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return repr(str(value))
    return text


def read_result(value: Any) -> dict[str, Any]:
    """The helper's record of the cell, as the environment's worker reports it (without the output,
    which the REPL returned as its own)."""
    if isinstance(value, Mapping) and value.get("status") in ("ok", "error"):
        return dict(value)
    # The cell replaced the record's name, or the helper did not run (the REPL refused the cell).
    return {"status": "ok", "result": None, "execution_count": 0}


def transcript_lines(messages: list[dict[str, Any]]) -> str:
    """JSONL, one message per line, as the environment writes `.messages` (no trailing blank line
    for an empty transcript)."""
    if not messages:
        return ""
    return "\n".join(json.dumps(m, ensure_ascii=False) for m in messages) + "\n"
