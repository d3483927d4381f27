"""OOLONG-style counting: label every line with sub-models, then aggregate in code."""

from __future__ import annotations

from recursa.scripted.conversation import fill
from recursa.scripted.heuristics import HEURISTIC_SOURCE
from recursa.scripted.name_options import Settings
from recursa.scripted.strategy import AS_TEXT, Strategy, header
from recursa.tasks import oolong
from recursa.tasks.oolong import LABELS, OolongQuery

_PRELUDE = """
import re
from collections import Counter

LABELS = __LABELS__
STEMS = (("abbrev", "abbreviation"), ("descri", LABELS[0]), ("abstract", LABELS[0]), ("human", "human being"),
         ("person", "human being"), ("numer", "numeric value"), ("number", "numeric value"),
         ("locat", "location"), ("place", "location"), ("entit", "entity"))


def parse_row(line):
    fields = {}
    for part in line.split("||"):
        key, _, value = part.partition(":")
        fields[key.strip().lower()] = value.strip()
    return fields


def norm_label(reply):
    low = " ".join(str(reply).lower().replace("_", " ").split())
    for lab in LABELS:
        if lab in low:
            return lab
    for stem, lab in STEMS:
        if stem in low:
            return lab
    return None


lines = [line for line in as_text(context).splitlines() if "Instance:" in line]
print(f"{len(lines):,} instance lines")
"""

# Only the lines the question is about need labels: filter them in code first, for free.
_FILTER = """
lines = [line for line in lines if in_scope(parse_row(line))]
rows = [parse_row(line) for line in lines]
instances = [row.get("instance", "") for row in rows]
print(f"{len(rows):,} of them are in scope")
"""

_BATCHED = """
HEADER = (
    "Classify each question below into exactly one of these labels: " + ", ".join(LABELS) + ".\\n"
    "Reply with one line per question, in the form <line number>: <label>, and nothing else.\\n\\n"
    "Questions:\\n"
)
BATCH = __BATCH__
ANSWER_LINE = re.compile(r"^[\\s*]*(\\d+)[\\s*]*[:.)\\]-]\\s*(.+?)\\s*$", re.M)
labels = [None] * len(rows)


def ask(indices):
    return HEADER + "\\n".join(f"{i}: {instances[i]}" for i in indices)


def absorb(reply):
    if not isinstance(reply, str):  # a failed item of a batch
        return
    for m in ANSWER_LINE.finditer(reply):
        i = int(m.group(1))
        if 0 <= i < len(labels):
            lab = norm_label(m.group(2))
            if lab:
                labels[i] = lab


batches = [list(range(s, min(s + BATCH, len(rows)))) for s in range(0, len(rows), BATCH)]
for reply in llm_query_batched([ask(b) for b in batches]):
    absorb(reply)
missing = [i for i, lab in enumerate(labels) if lab is None]
if missing:  # lines a reply skipped or garbled: ask again in small batches
    for reply in llm_query_batched([ask(missing[k : k + 20]) for k in range(0, len(missing), 20)]):
        absorb(reply)
    missing = [i for i, lab in enumerate(labels) if lab is None]
print(f"labelled {len(rows) - len(missing):,}/{len(rows):,} lines with {len(batches)} batched sub-calls")
"""

_PER_ITEM = """
labels = []
for text in instances:
    reply = llm_query(
        "Which one of these labels fits the question below? Labels: " + ", ".join(LABELS) + ".\\n"
        f"Question: {text}\\nReply with the label only."
    )
    labels.append(norm_label(reply))
missing = [i for i, lab in enumerate(labels) if lab is None]
print(f"labelled {len(rows) - len(missing):,}/{len(rows):,} lines, one llm_query each")
"""

_NONE = """
labels = [guess_label(text) for text in instances]
print("labelled every line with keyword rules (no sub-model calls)")
"""

_AGGREGATE = """
counts = Counter(lab for lab in labels if lab)
print("label counts in scope:", {lab: counts[lab] for lab in LABELS})
"""

_RECURSIVE = """
PER_CHILD = __PER_CHILD__
parts = ["\\n".join(lines[s : s + PER_CHILD]) for s in range(0, len(lines), PER_CHILD)]
QUESTIONS = __CHILD_QUESTIONS__
prompts, contexts, asked = [], [], []
for part in parts:
    for lab, question in QUESTIONS.items():
        prompts.append(question)
        contexts.append(part)
        asked.append(lab)
answers = rlm_query_batched(prompts, contexts)
counts = Counter()
for lab, reply in zip(asked, answers):
    numbers = re.findall(r"-?\\d+", str(reply).split(":")[-1])
    if numbers:
        counts[lab] += int(numbers[0])
print(f"{len(parts)} parts x {len(QUESTIONS)} questions to child RLMs; counts:", dict(counts))
"""


def _scope_code(query: OolongQuery) -> str:
    if query.kind == "user_compare":
        users = [str(query.user), str(query.other_user)]
        return f"def in_scope(row):\n    return row.get('user') in {users!r}\n"
    if query.user is not None:
        return f"def in_scope(row):\n    return row.get('user') == {str(query.user)!r}\n"
    if query.year is not None:
        return f"def in_scope(row):\n    return row.get('date', '').endswith({str(query.year)!r})\n"
    return "def in_scope(row):\n    return True\n"


_MONTH_CODE = """
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]


def day_key(text):
    month, day, year = text.replace(",", "").split()
    return (int(year), MONTHS.index(month) + 1, int(day))
"""


def _result_code(query: OolongQuery) -> str:
    if query.kind == "user_most":
        return (
            f"per_user = Counter(row['user'] for row, lab in zip(rows, labels) if lab == {query.label!r})\n"
            "best = max(sorted(per_user, key=int), key=lambda u: per_user[u]) if per_user else 'none'\n"
            'result = f"User: {best}"\n'
        )
    if query.kind == "user_compare":
        return (
            f"a = sum(1 for row, lab in zip(rows, labels) if row['user'] == {str(query.user)!r} and lab == {query.label!r})\n"
            f"b = sum(1 for row, lab in zip(rows, labels) if row['user'] == {str(query.other_user)!r} and lab == {query.label!r})\n"
            'relation = "more common than" if a > b else "less common than" if a < b else "same frequency as"\n'
            f'result = f"Answer: user {query.user} is {{relation}} user {query.other_user}"\n'
        )
    if query.kind in ("first_date", "last_date"):
        pick = "min" if query.kind == "first_date" else "max"
        return (
            _MONTH_CODE
            + f"days = [row['date'] for row, lab in zip(rows, labels) if lab == {query.label!r}]\n"
            + f'result = "Date: " + ({pick}(days, key=day_key) if days else "none")\n'
        )
    if query.kind in ("count", "user_count", "year_count"):
        return f'result = f"Answer: {{counts[{query.label!r}]}}"\n'
    if query.kind == "most_common":
        return 'result = "Label: " + max(LABELS, key=lambda lab: counts[lab])\n'
    if query.kind == "least_common":
        return 'result = "Label: " + min(LABELS, key=lambda lab: counts[lab])\n'
    return (
        f"a, b = counts[{query.label!r}], counts[{query.other!r}]\n"
        'relation = "more common than" if a > b else "less common than" if a < b else "same frequency as"\n'
        f'result = f"Answer: {query.label} is {{relation}} {query.other}"\n'
    )


def _child_questions(query: OolongQuery) -> dict[str, str]:
    """One count question per label the answer needs (the lines are already filtered to scope)."""
    needed = {
        "most_common": LABELS,
        "least_common": LABELS,
        "compare": (query.label, query.other),
    }.get(query.kind, (query.label,))
    return {str(lab): OolongQuery("count", label=lab).text() for lab in needed}


def _code(query: OolongQuery, style: str, settings: Settings) -> str:
    if style == "recursive" and query.kind in oolong.EXTRA_KINDS:
        style = "batched"  # the per-child count questions cannot answer user and date questions
    if style == "recursive":
        work = [_RECURSIVE]
    else:
        labelling = {"batched": _BATCHED, "per-item": _PER_ITEM, "none": HEURISTIC_SOURCE + _NONE}[style]
        work = [labelling, _AGGREGATE]
    code = header(
        "solve",
        AS_TEXT,
        _PRELUDE,
        _scope_code(query),
        _FILTER,
        *work,
        _result_code(query),
        'print("RESULT:", result)',
    )
    return fill(
        code,
        labels=list(LABELS),
        batch=settings.batch,
        per_child=max(settings.batch * 4, 200),
        child_questions=_child_questions(query),
    )


OOLONG = Strategy("oolong", oolong.parse_question, _code)
