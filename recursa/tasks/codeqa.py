"""Four-option questions over a generated code repository (LongBench-v2 CodeQA-like).

The context is a dict of path -> Python source. A question asks what a call returns; answering
needs the entry file, the helpers it imports from two to four other files, and the constants
those import from config modules. Hard negatives: every helper name is also defined, with a
different body, in unrelated modules (a grep for `def scale` finds many), and config constants
are shadowed in other config files. The wrong options are what careless readings give: the
first definition grep finds, the shadowed constant, the branch not taken. Scored with
LongBench's answer pattern ("The correct answer is (X)").
"""

from __future__ import annotations

import re
from typing import Any

from recursa.tasks.base import Family, Task, context_chars, register_family, seeded_rng, task_id
from recursa.tasks.code_eval import evaluate, module_path

FAMILY = "codeqa"
_AREAS = ("billing", "routing", "storage", "metrics", "auth", "search", "ingest", "render", "sched", "cache")
_MODULES = ("core", "util", "helpers", "engine", "policy", "adapters", "models", "pipeline", "rules", "ops")
_FUNCS = (
    "scale",
    "adjust",
    "normalize",
    "combine",
    "weight",
    "clamp_up",
    "shift",
    "blend",
    "settle",
    "spread",
    "fold",
    "tally",
    "offset",
    "boost",
    "trim",
)
_CONSTS = ("RATE", "OFFSET", "FACTOR", "LIMIT", "STEP", "BASE", "MARGIN")
_DOC_WORDS = (
    "Helpers for the {area} service. Values are integers; callers pass small positive numbers.",
    "Internal {area} logic kept apart from the public API so it can change freely.",
    "Numeric adjustments used by the {area} pipeline. See the design notes for context.",
)
QUESTION_FORM = (
    "What is the correct answer to this question: In this repository, what value does "
    "`{module}.{function}({arg})` return?\nChoices:\n(A) {A}\n(B) {B}\n(C) {C}\n(D) {D}\n\n"
    'Format your response as follows: "The correct answer is (insert answer here)".'
)
_QUESTION_RE = re.compile(r"what value does `([\w.]+)\.(\w+)\((-?\d+)\)` return\?")
_CHOICE_RE = re.compile(r"^\(([A-D])\) (.+)$", re.MULTILINE)


def _expr(rng: Any, names: list[str], calls: list[str]) -> str:
    """A small integer expression over `n`, the given names and one-argument calls."""
    terms = ["n", str(rng.randint(1, 9)), *names]
    left = rng.choice(terms)
    op = rng.choice(("+", "-", "*", "+"))
    right = rng.choice(terms)
    text = f"{left} {op} {right}"
    if calls:
        call = rng.choice(calls)
        text = f"{call}({text}) + {rng.randint(1, 9)}" if rng.random() < 0.5 else f"{text} + {call}(n)"
    return text


def _function(rng: Any, name: str, names: list[str], calls: list[str]) -> str:
    threshold = rng.randint(2, 12)
    body = [
        f"def {name}(n):",
        f"    value = {_expr(rng, names, calls)}",
        f"    if n > {threshold}:",
        f"        value = value + {rng.choice(names) if names else rng.randint(1, 9)}",
        f"    return value % {rng.randint(50, 997)}",
    ]
    return "\n".join(body) + "\n"


def _module_source(
    rng: Any, area: str, imports: list[str], consts: dict[str, int], functions: list[str]
) -> str:
    lines = [f'"""{rng.choice(_DOC_WORDS).format(area=area)}"""', ""]
    lines += imports
    if imports:
        lines.append("")
    lines += [f"{k} = {v}" for k, v in consts.items()]
    if consts:
        lines.append("")
    return "\n".join(lines) + "\n\n" + "\n\n".join(functions)


def _filler_module(rng: Any, area: str, target: int) -> str:
    consts = {c: rng.randint(1, 40) for c in rng.sample(_CONSTS, 2)}
    functions = []
    size = 200
    names = list(consts)
    used: set[str] = set()
    while size < target and len(used) < 60:
        name = rng.choice(_FUNCS) + ("" if rng.random() < 0.6 else f"_{rng.randint(2, 9)}")
        if name in used:
            continue  # one definition per name and module, as in real code
        used.add(name)
        fn = _function(rng, name, names, [])
        functions.append(fn)
        size += len(fn) + 2
    return _module_source(rng, area, [], consts, functions)


def _chain_files(rng: Any, hops: int) -> tuple[dict[str, str], str, str]:
    """The files a question needs: entry -> helper -> ... plus two config modules."""
    areas = rng.sample(_AREAS, min(len(_AREAS), hops + 1))
    files: dict[str, str] = {}
    config_mod = f"pkg.{areas[0]}.config"
    shadow_mod = f"pkg.{areas[-1]}.config"
    config_consts = {c: rng.randint(2, 30) for c in rng.sample(_CONSTS, 3)}
    files[module_path(config_mod)] = _module_source(rng, areas[0], [], config_consts, [])
    # The shadow config holds the same names with other values: the wrong file to read them from.
    shadow = {c: v + rng.randint(1, 9) for c, v in config_consts.items()}
    files[module_path(shadow_mod)] = _module_source(rng, areas[-1], [], shadow, [])
    chain_funcs = rng.sample(_FUNCS, hops + 1)
    modules = [f"pkg.{areas[i % len(areas)]}.{rng.choice(_MODULES)}_{i}" for i in range(hops + 1)]
    # Build from the last helper back to the entry point, each importing the next.
    for i in reversed(range(hops + 1)):
        const_names = rng.sample(list(config_consts), 2)
        imports = [f"from {config_mod} import {', '.join(const_names)}"]
        calls: list[str] = []
        if i < hops:
            alias = f"_{chain_funcs[i + 1]}"
            imports.append(f"from {modules[i + 1]} import {chain_funcs[i + 1]} as {alias}")
            calls.append(alias)
        fn = _function(rng, chain_funcs[i], const_names, calls)
        # A same-module decoy with a similar name keeps the file from being trivially short.
        decoy = _function(rng, chain_funcs[i] + "_legacy", const_names, [])
        files[module_path(modules[i])] = _module_source(rng, areas[i % len(areas)], imports, {}, [fn, decoy])
    # Hard negatives: each chain function name defined again elsewhere, with another body.
    for i, name in enumerate(chain_funcs):
        decoy_mod = f"pkg.{rng.choice(_AREAS)}.{rng.choice(_MODULES)}_x{i}"
        consts = {c: rng.randint(2, 30) for c in rng.sample(_CONSTS, 2)}
        files[module_path(decoy_mod)] = _module_source(
            rng, "shared", [], consts, [_function(rng, name, list(consts), [])]
        )
    return files, modules[0], chain_funcs[0]


def _options(rng: Any, gold: int, wrong: list[int]) -> tuple[list[str], str]:
    values = [gold]
    for w in wrong:
        if w not in values:
            values.append(w)
    while len(values) < 4:
        candidate = gold + rng.choice((-1, 1)) * rng.randint(1, 12)
        if candidate not in values:
            values.append(candidate)
    values = values[:4]
    rng.shuffle(values)
    letter = "ABCD"[values.index(gold)]
    return [str(v) for v in values], letter


DEFAULT_KNOBS: dict[str, Any] = {"hops": None}


def generate_codeqa(size_chars: int, seed: int, *, hops: int | None) -> Task:
    if hops is not None and not 2 <= int(hops) <= 4:
        raise ValueError(f"codeqa hops must be 2, 3 or 4, got {hops!r}")
    rng = seeded_rng(FAMILY, size_chars, seed)
    n_hops = int(hops) if hops is not None else rng.randint(2, 4)
    files, entry_module, entry_function = _chain_files(rng, n_hops)
    arg = rng.randint(3, 20)
    gold = evaluate(files, entry_module, entry_function, arg)
    if gold is None:  # the generator and the reader disagree: a bug, not a user error
        raise RuntimeError("codeqa could not evaluate its own repository")
    # Wrong options: careless readings of the same files (computed before the filler, so fast).
    needed = dict(files)
    decoys_first = dict(sorted(needed.items(), key=lambda kv: "_x" not in kv[0]))
    wrong = [evaluate(decoys_first, entry_module, entry_function, arg, naive=True)]
    configs = [p for p in needed if p.endswith("/config.py")]
    swapped = dict(needed)
    swapped[configs[0]], swapped[configs[1]] = needed[configs[1]], needed[configs[0]]
    wrong.append(evaluate(swapped, entry_module, entry_function, arg))
    wrong.append(evaluate(needed, entry_module, entry_function, arg + 1))
    # Filler modules up to the target size, some reusing the helper names.
    total = context_chars(files)
    index = 0
    while total < size_chars:
        target = min(max(1_500, rng.randint(2_000, 6_000)), max(300, size_chars - total))
        path = module_path(f"pkg.{rng.choice(_AREAS)}.{rng.choice(_MODULES)}_{index}")
        if path not in files:
            files[path] = _filler_module(rng, path.split("/")[1], target)
            total += len(files[path])
        index += 1
    options, letter = _options(rng, gold, [w for w in wrong if w is not None])
    items = list(files.items())
    rng.shuffle(items)
    context = dict(items)
    question = QUESTION_FORM.format(
        module=entry_module,
        function=entry_function,
        arg=arg,
        A=options[0],
        B=options[1],
        C=options[2],
        D=options[3],
    )
    knobs = {"hops": hops}
    return Task(
        id=task_id(FAMILY, size_chars, seed, knobs, DEFAULT_KNOBS),
        family=FAMILY,
        question=question,
        context=context,
        gold=letter,
        meta={
            "target_chars": size_chars,
            "size_chars": context_chars(context),
            "n_files": len(context),
            "hops": n_hops,
            "entry": f"{entry_module}.{entry_function}({arg})",
            "value": gold,
            "options": options,
            "knobs": knobs,
        },
    )


def parse_question(text: str) -> tuple[str, str, int, dict[str, str]] | None:
    """(module, function, argument, {letter: option}) of a codeqa question, or None."""
    m = _QUESTION_RE.search(text)
    if m is None:
        return None
    choices = dict(_CHOICE_RE.findall(text))
    return m.group(1), m.group(2), int(m.group(3)), choices


def extract_choice(response: str) -> str | None:
    """LongBench v2's extraction: "The correct answer is (X)", then "The correct answer is X"."""
    text = response.replace("*", "")
    m = re.search(r"The correct answer is \(([A-D])\)", text)
    if m:
        return m.group(1)
    m = re.search(r"The correct answer is ([A-D])", text)
    return m.group(1) if m else None


def score_choice(task: Task, answer: str) -> float:
    return 1.0 if extract_choice(answer) == task.gold else 0.0


def solve_codeqa(task: Task) -> str:
    """Read the call through the repository's imports and pick the option that matches."""
    parsed = parse_question(task.question)
    if parsed is None or not isinstance(task.context, dict):
        raise ValueError(f"task {task.id} is not a generated codeqa task")
    module, function, arg, choices = parsed
    value = evaluate(task.context, module, function, arg)
    letter = next((k for k, v in choices.items() if v == str(value)), "none")
    return f"The correct answer is ({letter})"


# Strategy for the root (rlm-tips): what works on this family, in our words.
TIPS = (
    "The answer is what the code really computes. Start from the module and function named in the "
    "question, follow its imports to the files they name (the same function name is defined "
    "differently in unrelated modules, and constants are shadowed in other config files), read only "
    "those pieces, work out the value, and pick the option that equals it."
)


register_family(
    Family(
        name=FAMILY,
        generator=generate_codeqa,
        scorer=score_choice,
        knobs=DEFAULT_KNOBS,
        description="four-option questions over a generated repository whose answers span several files",
        solver=solve_codeqa,
        tips=TIPS,
    )
)
