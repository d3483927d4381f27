"""Evidence spans over many generated papers (SkyRL-like), scored by character-span F1.

The context is a dict of paper id -> paper text (title, abstract, sections). A question asks for
every sentence, in any paper, that reports a measured result of one method on one dataset. Hard
negatives: results of the same method on other datasets, of other methods on the same dataset, of
a variant with a similar name ("Varnet-L" next to "Varnet"), and sentences that name both without
reporting a result ("We plan to evaluate Varnet on Qorsa-12k in future work."). The answer is a
JSON list of {"paper_id", "text"} objects (or one sentence per line); each text is located in its
paper and the located character spans are compared with the gold spans: F1 over characters.

REPL tools (`Task.tools`, sandbox tools over `context`, in `evidence_tools`): `list_papers()`,
`search(query, k=10)`, `extract_section(paper_id, section)`, `get_paper_abstract(paper_id)`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from recursa.tasks.base import Family, Task, context_chars, register_family, seeded_rng, task_id
from recursa.tasks.evidence_tools import TOOLS
from recursa.tasks.names import unique_words
from recursa.tools.spec import make_tools

FAMILY = "evidence-spans"
SECTIONS = ("Introduction", "Methods", "Results", "Discussion")
_METRICS = ("accuracy", "F1", "recall", "precision", "BLEU", "exact match")
RESULT_FORMS = (
    "On {D}, {M} reaches {V} {X}.",
    "{M} obtains {V} {X} on the {D} benchmark.",
    "We measure {V} {X} for {M} on {D}.",
    "Evaluated on {D}, {M} scores {V} {X}.",
)
MENTION_FORMS = (
    "We plan to evaluate {M} on {D} in future work.",
    "Unlike earlier reports, we did not run {M} on {D}.",
    "{M} was designed with datasets such as {D} in mind.",
    "Whether {M} transfers to {D} remains an open question.",
)
_FILLER = (
    "Prior work has studied this problem from several angles.",
    "We describe the training setup in detail below.",
    "All experiments use the same preprocessing pipeline.",
    "Hyperparameters were chosen on a held-out split.",
    "The results suggest that scale alone does not explain the gains.",
    "We release our code and data to support replication.",
    "Ablations isolate the contribution of each component.",
    "Error analysis reveals several recurring failure modes.",
    "The approach builds on a long line of related methods.",
    "Limitations of the evaluation are discussed at the end.",
    "Each run was repeated with three random seeds.",
    "Compute budgets were matched across all baselines.",
)
QUESTION_FORM = (
    "Find every sentence, in any of the papers, that reports a measured result of the method {M} on "
    "the dataset {D}. Sentences that only mention both, or report results of other methods, other "
    "datasets or other variants (such as {M}-L), do not count. Answer with a JSON list of objects "
    '{{"paper_id": <paper id>, "text": <the exact sentence>}}, one per sentence.'
)
_QUESTION_RE = re.compile(r"reports a measured result of the method (\S+) on the dataset (\S+)\. Sentences")

# The REPL tools as one source text (what the sandbox runs to define them), for use outside an RLM.
TOOLS_SOURCE = "\n\n".join(tool.source for tool in make_tools(list(TOOLS)))


def _value(rng: Any, metric: str) -> str:
    return f"{rng.randint(10, 99)}.{rng.randint(0, 9)}" + (
        "%" if metric in ("accuracy", "recall", "precision") else ""
    )


def _result(rng: Any, method: str, dataset: str) -> str:
    metric = rng.choice(_METRICS)
    return rng.choice(RESULT_FORMS).format(M=method, D=dataset, V=_value(rng, metric), X=metric)


def _paper(rng: Any, pid: str, title: str, planted: dict[str, list[str]], target: int) -> str:
    """A paper whose sections hold the planted sentences at seeded places among filler."""
    sections = {"Abstract": [], **{s: [] for s in SECTIONS}}
    for section, sentences in planted.items():
        sections[section].extend(sentences)
    size = len(title) + 60 + sum(len(s) + 1 for sentences in planted.values() for s in sentences)
    names = list(sections)
    while size < target:
        s = rng.choice(_FILLER)
        sections[rng.choice(names)].append(s)
        size += len(s) + 1
    for sentences in sections.values():
        rng.shuffle(sentences)
    lines = [f"Title: {title}", "## Abstract", " ".join(sections["Abstract"]) or rng.choice(_FILLER)]
    for s in SECTIONS:
        lines += [f"## {s}", " ".join(sections[s]) or rng.choice(_FILLER)]
    return "\n".join(lines)


DEFAULT_KNOBS: dict[str, Any] = {"n_papers": None, "n_gold": None}


def generate_evidence(size_chars: int, seed: int, *, n_papers: int | None, n_gold: int | None) -> Task:
    rng = seeded_rng(FAMILY, size_chars, seed)
    papers_wanted = int(n_papers) if n_papers else min(max(3, size_chars // 6_000), 20_000)
    words = unique_words(rng, 40)
    methods, datasets = words[:20], [f"{w}-{rng.choice((5, 12, 40, 100))}k" for w in words[20:]]
    method, dataset = methods[0], datasets[0]
    gold_count = int(n_gold) if n_gold else rng.randint(2, 6)
    if not 1 <= gold_count <= papers_wanted * 2:
        raise ValueError(
            f"evidence-spans n_gold must be between 1 and twice the number of papers, got {n_gold!r}"
        )
    ids = [f"P{i:05d}" for i in range(papers_wanted)]
    rng.shuffle(ids)
    plan: dict[str, dict[str, list[str]]] = {pid: {} for pid in ids}
    gold_sentences: list[tuple[str, str]] = []
    for i in range(gold_count):
        pid = ids[i % len(ids)]
        sentence = _result(rng, method, dataset)
        plan[pid].setdefault(rng.choice(("Results", "Results", "Abstract", "Discussion")), []).append(
            sentence
        )
        gold_sentences.append((pid, sentence))
    # Hard negatives, spread over gold and other papers alike.
    for _ in range(max(4, gold_count * 3)):
        pid = rng.choice(ids)
        kind = rng.randrange(4)
        if kind == 0:
            sentence = _result(rng, method, rng.choice(datasets[1:]))
        elif kind == 1:
            sentence = _result(rng, rng.choice(methods[1:]), dataset)
        elif kind == 2:
            sentence = _result(rng, f"{method}-L", dataset)
        else:
            sentence = rng.choice(MENTION_FORMS).format(M=method, D=dataset)
        plan[pid].setdefault(rng.choice(SECTIONS), []).append(sentence)
    for pid in ids:  # background results of unrelated pairs
        for _ in range(rng.randint(1, 3)):
            plan[pid].setdefault("Results", []).append(
                _result(rng, rng.choice(methods[1:]), rng.choice(datasets[1:]))
            )
    per_paper = max(400, size_chars // papers_wanted - 60)
    context: dict[str, str] = {}
    for pid in sorted(ids):
        title = f"{rng.choice(methods)} and {rng.choice(('robust', 'efficient', 'scalable', 'sparse'))} {rng.choice(('retrieval', 'parsing', 'ranking', 'tagging'))}"
        context[pid] = _paper(rng, pid, title, plan[pid], per_paper)
    spans = []
    for pid, sentence in gold_sentences:
        start = context[pid].index(sentence)
        spans.append([pid, start, start + len(sentence)])
    gold = json.dumps([{"paper_id": pid, "text": s} for pid, s in gold_sentences], ensure_ascii=False)
    knobs = {"n_papers": n_papers, "n_gold": n_gold}
    return Task(
        id=task_id(FAMILY, size_chars, seed, knobs, DEFAULT_KNOBS),
        family=FAMILY,
        question=QUESTION_FORM.format(M=method, D=dataset),
        context=context,
        gold=gold,
        meta={
            "target_chars": size_chars,
            "size_chars": context_chars(context),
            "n_papers": len(context),
            "method": method,
            "dataset": dataset,
            "gold_spans": spans,
            "knobs": knobs,
        },
        tools=TOOLS,
    )


def parse_question(text: str) -> tuple[str, str] | None:
    m = _QUESTION_RE.search(text)
    return (m.group(1), m.group(2)) if m else None


def predicted_items(answer: str) -> list[tuple[str | None, str]]:
    """(paper_id or None, text) from a JSON list (of objects or strings), else one per line."""
    text = answer.strip()
    start, end = text.find("["), text.rfind("]")
    if 0 <= start < end:
        try:
            data = json.loads(text[start : end + 1])
        except ValueError:
            data = None
        if isinstance(data, list):
            out: list[tuple[str | None, str]] = []
            for item in data:
                if isinstance(item, dict) and isinstance(item.get("text"), str):
                    pid = item.get("paper_id")
                    out.append((str(pid) if pid is not None else None, item["text"]))
                elif isinstance(item, str):
                    out.append((None, item))
            return out
    items: list[tuple[str | None, str]] = []
    for line in text.splitlines():
        line = line.strip().lstrip("-*• ").strip()
        m = re.match(r"^\[?(P\d+)\]?[:\s]+(.+)$", line)
        if m:
            items.append((m.group(1), m.group(2).strip()))
        elif line:
            items.append((None, line))
    return items


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(xs: list[tuple[int, int]], ys: list[tuple[int, int]]) -> int:
    total, i, j = 0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def span_f1(answer: str, gold_spans: list[list[Any]], papers: dict[str, str]) -> dict[str, float]:
    """Character-level precision, recall and F1 of the located answer spans against the gold spans."""
    predicted: dict[str, list[tuple[int, int]]] = {}
    unlocated = 0
    for pid, text in predicted_items(answer):
        text = text.strip()
        if not text:
            continue
        where = [pid] if pid in papers else []
        where += [p for p in papers if p != pid] if len(papers) <= 20_000 else []
        for candidate in where:
            at = papers[candidate].find(text)
            if at >= 0:
                predicted.setdefault(candidate, []).append((at, at + len(text)))
                break
        else:
            unlocated += len(text)
    gold: dict[str, list[tuple[int, int]]] = {}
    for pid, a, b in gold_spans:
        gold.setdefault(pid, []).append((a, b))
    pred_m = {p: _merge(v) for p, v in predicted.items()}
    gold_m = {p: _merge(v) for p, v in gold.items()}
    pred_len = sum(b - a for v in pred_m.values() for a, b in v) + unlocated
    gold_len = sum(b - a for v in gold_m.values() for a, b in v)
    hit = sum(_overlap(pred_m[p], gold_m[p]) for p in pred_m if p in gold_m)
    if gold_len == 0:
        f1 = 1.0 if pred_len == 0 else 0.0
        return {"precision": f1, "recall": f1, "f1": f1}
    precision = hit / pred_len if pred_len else 0.0
    recall = hit / gold_len
    f1 = 2 * precision * recall / (precision + recall) if hit else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def score_evidence(task: Task, answer: str) -> float:
    assert isinstance(task.context, dict)
    return span_f1(answer, task.meta["gold_spans"], task.context)["f1"]


def evidence_metrics(task: Task, answer: str) -> dict[str, float]:
    assert isinstance(task.context, dict)
    found = span_f1(answer, task.meta["gold_spans"], task.context)
    return {"precision": found["precision"], "recall": found["recall"]}


def solve_evidence(task: Task) -> str:
    """Every sentence of the result forms naming exactly the asked method and dataset."""
    asked = parse_question(task.question)
    assert asked is not None and isinstance(task.context, dict)
    method, dataset = asked
    found = []
    for pid, text in task.context.items():
        for sentence, m, d in result_sentences(text):
            if (m, d) == (method, dataset):
                found.append({"paper_id": pid, "text": sentence})
    return json.dumps(found, ensure_ascii=False)


def _result_patterns() -> list[re.Pattern[str]]:
    out = []
    for form in RESULT_FORMS:
        p = re.escape(form)
        p = p.replace(r"\{M\}", r"(?P<M>[\w-]+)").replace(r"\{D\}", r"(?P<D>[\w-]+)")
        p = p.replace(r"\{V\}", r"[\d.]+%?").replace(r"\{X\}", r"[\w ]+?")
        out.append(re.compile(p))
    return out


_RESULTS = _result_patterns()


def result_sentences(text: str) -> list[tuple[str, str, str]]:
    """(sentence, method, dataset) for every sentence of `text` that reports a result."""
    out = []
    for sentence in re.split(r"(?<=[.!?])\s+|\n+", text):
        sentence = sentence.strip()
        for pattern in _RESULTS:
            m = pattern.fullmatch(sentence)
            if m:
                out.append((sentence, m.group("M"), m.group("D")))
                break
    return out


# Strategy for the root (rlm-tips): what works on this family, in our words.
TIPS = (
    "Use the REPL helpers (search, list_papers, extract_section) to narrow to the papers that name both "
    "the method and the dataset, have sub-models pick the sentences that report a measured result of "
    "exactly that pair (not variants, other pairs or plans), keep only sentences found verbatim in "
    "their paper, and return the JSON list with FINAL_VAR."
)


register_family(
    Family(
        name=FAMILY,
        generator=generate_evidence,
        scorer=score_evidence,
        knobs=DEFAULT_KNOBS,
        description="exact evidence sentences across many generated papers, character-span F1 (SkyRL-like)",
        solver=solve_evidence,
        metrics=evidence_metrics,
        tips=TIPS,
    )
)
