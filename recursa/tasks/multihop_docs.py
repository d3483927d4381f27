"""Multi-hop questions over 10 to 5,000 generated documents (BrowseComp-Plus-like).

A seeded world of made-up people, companies, universities and cities, one document per entity.
A question names an anchor by two attributes ("the company that was founded in 1987 and has its
headquarters in Velmora") and chains 2-4 relations from it ("the person who founded that company;
then the university where that person studied; ..."). Hard negatives: other entities of the
anchor's type share its year or its city, names share words ("Orvane Systems", "Orvane Labs"),
documents mention entities in passing without stating facts, and facts may use an alias that
only the alias line of the entity's own document resolves. The context is a list of documents;
answers are scored by normalised exact match over the final entity's name and aliases.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any

from recursa.tasks.base import Family, Task, context_chars, register_family, seeded_rng, task_id
from recursa.tasks.multihop_facts import (
    ANCHOR_RELATION,
    FACT_FORMS,
    MENTION_FORMS,
    RELATIONS,
    YEAR_OF,
    Chain,
    parse_question,
)
from recursa.tasks.names import unique_words
from recursa.tasks.niah import _sentence

FAMILY = "multihop-docs"
_COUNTRIES = (
    "Arvelia | Borunda | Calistra | Dovenne | Estmark | Feralia | Gostavia | Halvoria | Istrene | "
    "Jorvania | Kelmora | Lunaris"
).split(" | ")
_COMPANY_SUFFIX = ("Systems", "Labs", "Works", "Holdings", "Dynamics", "Industries", "Partners")
_CHAINS = {
    2: (("founded_by", "born_in"), ("works_at", "headquartered_in"), ("studied_at", "located_in")),
    3: (
        ("founded_by", "studied_at", "located_in"),
        ("acquired_by", "founded_by", "born_in"),
        ("works_at", "founded_by", "studied_at"),
    ),
    4: (
        ("acquired_by", "founded_by", "studied_at", "located_in"),
        ("works_at", "acquired_by", "founded_by", "born_in"),
        ("founded_by", "works_at", "founded_by", "born_in"),
    ),
}
_START_TYPE = {chain: RELATIONS[chain[0]][0] for hops in _CHAINS.values() for chain in hops}


@dataclass
class Entity:
    name: str
    type: str
    aliases: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # relation or attribute -> name or value


@dataclass
class World:
    entities: dict[str, Entity]
    by_type: dict[str, list[str]]

    def follow(self, start: str, relations: tuple[str, ...]) -> str:
        current = start
        for relation in relations:
            current = self.entities[current].facts[relation]
        return current


def _make_world(rng: Any, n_docs: int) -> World:
    counts = {
        "city": max(3, n_docs * 15 // 100),
        "university": max(2, n_docs * 10 // 100),
        "company": max(4, n_docs * 35 // 100),
    }
    counts["person"] = max(3, n_docs - sum(counts.values()))
    taken: set[str] = set()
    cities = unique_words(rng, counts["city"], taken=taken)
    taken.update(cities)
    roots = unique_words(rng, max(2, counts["company"] // 2), taken=taken)
    taken.update(roots)
    companies: list[str] = []
    seen: set[str] = set()
    while len(companies) < counts["company"]:
        name = f"{rng.choice(roots)} {rng.choice(_COMPANY_SUFFIX)}"
        if name not in seen:
            seen.add(name)
            companies.append(name)
    firsts = unique_words(rng, max(4, counts["person"] // 3), syllables=(2, 2), taken=taken)
    lasts = unique_words(rng, max(4, counts["person"] // 2), syllables=(2, 3), taken=taken | set(firsts))
    people: list[str] = []
    seen = set()
    while len(people) < counts["person"]:
        name = f"{rng.choice(firsts)} {rng.choice(lasts)}"
        if name not in seen:
            seen.add(name)
            people.append(name)
    universities: list[str] = []
    while len(universities) < counts["university"]:
        i = len(universities)
        name = (
            f"University of {cities[i]}"
            if i < len(cities)
            else f"{rng.choice(lasts)} {rng.choice(('Institute', 'College', 'Academy'))}"
        )
        if name not in universities:
            universities.append(name)
    entities: dict[str, Entity] = {}
    for c in cities:
        entities[c] = Entity(c, "city", facts={"country": rng.choice(_COUNTRIES)})
    for u in universities:
        alias = [u.split(" of ", 1)[1] + " University"] if u.startswith("University of ") else []
        entities[u] = Entity(
            u,
            "university",
            alias,
            {"located_in": rng.choice(cities), "founded_year": rng.randint(1850, 1990)},
        )
    for c in companies:
        initials = "".join(w[0] for w in c.split()) + rng.choice(("", "X", "Co"))
        entities[c] = Entity(
            c,
            "company",
            [f"{c.split()[0]} {initials}"],
            {"headquartered_in": rng.choice(cities), "founded_year": rng.randint(1960, 2015)},
        )
    for p in people:
        entities[p] = Entity(
            p,
            "person",
            [],
            {
                "born_in": rng.choice(cities),
                "birth_year": rng.randint(1940, 1995),
                "studied_at": rng.choice(universities),
                "works_at": rng.choice(companies),
            },
        )
    for c in companies:
        entities[c].facts["founded_by"] = rng.choice(people)
        if rng.random() < 0.4:
            other = rng.choice(companies)
            if other != c:
                entities[c].facts["acquired_by"] = other
    by_type = {"city": cities, "university": universities, "company": companies, "person": people}
    return World(entities, by_type)


def _anchor_key(world: World, name: str) -> tuple[int, str]:
    e = world.entities[name]
    return e.facts[YEAR_OF[e.type]], e.facts[ANCHOR_RELATION[e.type]]


def _pick_chain(rng: Any, world: World, hops: int) -> tuple[str, tuple[str, ...]]:
    relations = rng.choice(_CHAINS[hops])
    start_type = _START_TYPE[relations]
    start = rng.choice(world.by_type[start_type])
    # Make the chain exist: every hop's relation is set, and no hop comes back to an earlier entity.
    current, visited = start, {start}
    for relation in relations:
        facts = world.entities[current].facts
        object_type = RELATIONS[relation][1]
        if relation not in facts or facts[relation] in visited:
            options = [x for x in world.by_type[object_type] if x not in visited]
            facts[relation] = rng.choice(options)
        current = facts[relation]
        visited.add(current)
    return start, relations


def _make_anchor_unique(rng: Any, world: World, start: str, path: list[str]) -> None:
    """The anchor's (year, city) pair names it alone; others share one half of it (hard negatives)."""
    e = world.entities[start]
    year_key, city_key = YEAR_OF[e.type], ANCHOR_RELATION[e.type]
    peers = [x for x in world.by_type[e.type] if x != start]
    negatives = [x for x in peers if x not in path]  # chain entities keep their facts
    for _ in range(200):
        if all(_anchor_key(world, p) != _anchor_key(world, start) for p in peers):
            break
        e.facts[year_key] = e.facts[year_key] + rng.choice((-1, 1)) * rng.randint(1, 30)
    else:  # pragma: no cover - 200 re-draws always find a free year in practice
        raise RuntimeError("could not make the anchor unique")
    if len(negatives) >= 2:
        same_year, same_city = rng.sample(negatives, 2)
        world.entities[same_year].facts[year_key] = e.facts[year_key]
        if world.entities[same_year].facts[city_key] == e.facts[city_key]:
            world.entities[same_year].facts[city_key] = rng.choice(
                [c for c in world.by_type["city"] if c != e.facts[city_key]]
            )
        world.entities[same_city].facts[city_key] = e.facts[city_key]
        if world.entities[same_city].facts[year_key] == e.facts[year_key]:
            world.entities[same_city].facts[year_key] += 1


def _document(rng: Any, world: World, entity: Entity, target: int) -> str:
    head = f"Title: {entity.name}\n"
    if entity.aliases:
        head += "Also known as: " + "; ".join(entity.aliases) + "\n"
    sentences = []
    for kind, value in entity.facts.items():
        subject = (
            rng.choice([entity.name, *entity.aliases])
            if entity.aliases and rng.random() < 0.3
            else entity.name
        )
        form = rng.choice(FACT_FORMS[kind])
        obj = value
        if (
            isinstance(value, str)
            and value in world.entities
            and world.entities[value].aliases
            and rng.random() < 0.3
        ):
            obj = rng.choice(
                world.entities[value].aliases
            )  # an alias only the object's own document resolves
        sentences.append(form.format(S=subject, O=obj, Y=value, C=value))
    names = list(world.entities)
    for _ in range(rng.randint(1, 3)):
        sentences.append(rng.choice(MENTION_FORMS).format(S=entity.name, O=rng.choice(names)))
    rng.shuffle(sentences)
    body = " ".join(sentences)
    size = len(head) + 1 + len(body)
    fillers: list[str] = []
    while size < target:
        s = _sentence(rng)
        fillers.append(s)
        size += len(s) + 1
    # Facts sit at seeded places among the filler, not all at the top.
    parts = fillers
    for s in sentences:
        parts.insert(rng.randint(0, len(parts)), s)
    return head + "\n" + " ".join(parts)


DEFAULT_KNOBS: dict[str, Any] = {"hops": None, "n_docs": None}


def default_docs(size_chars: int) -> int:
    return min(max(10, round(size_chars / 8_000)), 5_000)


def generate_multihop(size_chars: int, seed: int, *, hops: int | None, n_docs: int | None) -> Task:
    if hops is not None and int(hops) not in _CHAINS:
        raise ValueError(f"multihop-docs hops must be 2, 3 or 4, got {hops!r}")
    docs_wanted = int(n_docs) if n_docs else default_docs(size_chars)
    if not 10 <= docs_wanted <= 5_000:
        raise ValueError(f"multihop-docs n_docs must be between 10 and 5000, got {n_docs!r}")
    rng = seeded_rng(FAMILY, size_chars, seed)
    world = _make_world(rng, docs_wanted)
    n_hops = int(hops) if hops is not None else rng.randint(2, 4)
    start, relations = _pick_chain(rng, world, n_hops)
    path = [start]
    for relation in relations:
        path.append(world.entities[path[-1]].facts[relation])
    _make_anchor_unique(rng, world, start, path)
    year, city = _anchor_key(world, start)
    chain = Chain(world.entities[start].type, year, city, relations)
    answer = world.follow(start, relations)
    order = list(world.entities)
    rng.shuffle(order)
    per_doc = max(200, size_chars // len(order) - 2)
    docs = [_document(rng, world, world.entities[name], per_doc) for name in order]
    aliases = [answer, *world.entities[answer].aliases]
    knobs = {"hops": hops, "n_docs": n_docs}
    return Task(
        id=task_id(FAMILY, size_chars, seed, knobs, DEFAULT_KNOBS),
        family=FAMILY,
        question=chain.question(),
        context=docs,
        gold=answer,
        meta={
            "target_chars": size_chars,
            "size_chars": context_chars(docs),
            "n_docs": len(docs),
            "hops": len(relations),
            "aliases": aliases,
            "path": path,
            "gold_docs": sorted(order.index(p) for p in path),
            "knobs": knobs,
        },
        hidden={"world": world, "start": start},
    )


_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD-style: lower case, punctuation and articles dropped, whitespace collapsed."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_exact_answer(answer: str) -> str:
    """The text after the last 'Exact Answer:' (BrowseComp's form), else the last non-empty line."""
    m = re.findall(r"exact answer\s*:\s*(.+)", answer, flags=re.IGNORECASE)
    if m:
        return m[-1].strip()
    lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def alias_match(answer: str, aliases: list[str]) -> float:
    got = normalize_answer(extract_exact_answer(answer))
    return 1.0 if got and any(got == normalize_answer(a) for a in aliases) else 0.0


def score_multihop(task: Task, answer: str) -> float:
    return alias_match(answer, task.meta.get("aliases") or [task.gold])


def solve_multihop(task: Task) -> str:
    world: World = task.hidden["world"]
    chain = parse_question(task.question)
    if chain is None:
        raise ValueError(f"task {task.id} has no multi-hop question")
    return "Exact Answer: " + world.follow(task.hidden["start"], chain.relations)


# Strategy for the root (rlm-tips): what works on this family, in our words.
TIPS = (
    "Work one hop at a time. First find the single entity that has both properties the question "
    "starts from (other entities share one of them): ask sub-models over groups of documents, then "
    "check the candidate's own document. For each hop, read the document about the entity found so "
    'far. Names may appear under an alias listed on a document\'s "Also known as" line.'
)


register_family(
    Family(
        name=FAMILY,
        generator=generate_multihop,
        scorer=score_multihop,
        knobs=DEFAULT_KNOBS,
        description="2-4 hop questions over 10-5,000 generated documents with hard negatives (BrowseComp-Plus-like)",
        solver=solve_multihop,
        tips=TIPS,
    )
)
