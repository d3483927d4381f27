"""The rules a root reply is read by: one ordered list, each rule named, with its reason and the
replies it reads. `recursa.loop.parse.read_reply(text, rules)` is the one entry point.

The paper's protocol is small: code in ```repl blocks, the answer as FINAL(...) or FINAL_VAR(name)
at the start of a line. Every other rule reads a habit of real models (their own fences, tool-call
formats, chat-template tokens, reasoning blocks, answers written without the parentheses, ...).

Order. Rules run in the order of `RULES`, stage by stage:
  text       mend the reply's text before anything is read (each a function: text, notes -> text);
  fences     how fenced blocks are read (switches of the fence reader, recursa/loop/fences.py);
  answer     how an answer written in prose is found, first match wins (recursa/loop/finals.py);
  code       Python written outside any ```repl block that still runs;
  last_call  answers only the last, forced call takes (turns are over, nothing else can come);
  turn       what a turn does with the reading: an answer written beside code (recursa/loop/blocks.py).

Choosing rules (for a dialect, a setting, a test): a `ReplyRules` is an immutable selection.
    ReplyRules()                                every rule, in order (the default)
    ReplyRules.strict()                         the paper's protocol only (`Rule.paper`)
    ReplyRules().without("boxed_answer", ...)   switch rules off, by name
    ReplyRules().only("final_at_line_start")    keep only these (and nothing else)
    ReplyRules().adding(rule, after="special_tokens")
                                                a rule of one's own: a `text` rule (its `apply`) runs at
                                                its place among the text rules; an `answer` rule (its
                                                `find`) is asked, in the order added, when no built-in
                                                answer rule found one
    ReplyRules(beside_code="always")            an answer beside code is taken once the code has run,
                                                confirmed or not (the `answer_beside_code` rule decides
                                                when it is on; off, such an answer always waits)
A setting names a rule set: RLM(dialect_options={"reply_rules": "strict"}) (`named_rules`).
Unknown names raise KeyError, so a misspelt switch fails at once. docs/reference/replies.md lists the
rules, generated from `RULES` at docs build (docs/hooks/reply_rules.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from recursa.errors import ConfigError
from recursa.loop import cleaning
from recursa.loop.fences import Fence, runnable_tags
from recursa.loop.finals import ProseFinal

Stage = Literal["text", "fences", "answer", "code", "last_call", "turn"]
STAGES: tuple[Stage, ...] = ("text", "fences", "answer", "code", "last_call", "turn")
# What a turn does with an answer written beside code: take it when the code's run confirms it,
# always once the code has run, or never (it waits for the next reply).
BesideCode = Literal["confirmed", "always", "never"]


@dataclass(frozen=True)
class Rule:
    name: str
    stage: Stage
    reason: str  # one line: the model habit it reads, and why reading it is right
    examples: tuple[str, ...]  # replies it reads (read differently with the rule off)
    paper: bool = False  # part of the paper's protocol: kept by ReplyRules.strict()
    apply: Callable[[str, list[str]], str] | None = None  # a text rule: text, notes -> text
    find: Callable[[list[str], Sequence[Fence]], ProseFinal | None] | None = None  # an answer rule


def _text(name: str, reason: str, *examples: str, paper: bool = False) -> Rule:
    return Rule(name, "text", reason, examples, paper, apply=getattr(cleaning, name))


RULES: tuple[Rule, ...] = (
    # -- text ------------------------------------------------------------------------------------
    _text(
        "line_endings",
        "Windows and old Mac line endings (\\r\\n, \\r) are read as \\n: a fence line must end where a line ends.",
        "```repl\r\nprint(1)\r\n```",
        paper=True,
    ),
    _text(
        "control_characters",
        "NULs and other control characters from a broken decoder are dropped.",
        "FINAL(4\x002)",
    ),
    _text(
        "invisible_characters",
        "Zero-width spaces, BOMs and word joiners (copied web text, some tokenizers) are dropped: "
        "behind one a fence or FINAL is not at the start of its line.",
        "\u200b```repl\nprint(1)\n```",
    ),
    _text(
        "odd_indentation",
        "Indentation in no-break or ideographic spaces becomes spaces: Python rejects it and fences behind it go unseen.",
        "```repl\nfor i in range(2):\n\u00a0\u00a0\u00a0\u00a0print(i)\n```",
    ),
    _text(
        "fullwidth_final",
        "FINAL written with fullwidth punctuation (Chinese-language replies: FINAL（42）, FINAL：42) or a "
        "no-break space before its parenthesis reads as FINAL(42).",
        "FINAL（42）",
    ),
    _text(
        "harmony_final_channel",
        "gpt-oss served without its parser: only the text after <|channel|>final<|message|> is the reply, the rest is reasoning.",
        "<|channel|>analysis<|message|>FINAL(draft)<|end|><|start|>assistant<|channel|>final<|message|>FINAL(42)",
    ),
    _text(
        "thinking_blocks",
        "<think>/<thinking>/<reasoning> blocks (R1, Qwen3, Claude's raw form) are reasoning, not the reply: "
        "code in them does not run, and the model is told.",
        "<think>\n```repl\nprint('draft')\n```\n</think>\nFINAL(42)",
        "Draft:\nFINAL(41)\n</think>\nFINAL(42)",
    ),
    _text(
        "python_tag",
        "Llama's code interpreter call (<|python_tag|>code<|eom_id|>) runs as a block.",
        "<|python_tag|>print(len(context))<|eom_id|>",
    ),
    _text(
        "execute_tags",
        "CodeAct's <execute> and OpenHands' <execute_ipython> run as blocks.",
        "<execute>\nprint(len(context))\n</execute>",
    ),
    _text(
        "hermes_tool_call",
        "Hermes/Qwen <tool_call> JSON whose arguments hold code runs as a block; another tool call is "
        "dropped with a note (there are no tools to call that way).",
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
    ),
    _text(
        "special_tokens",
        "Chat-template tokens a server did not strip (<|im_end|>, <|eot_id|>, <｜end▁of▁sentence｜>, "
        "<end_of_turn>, <ctrl94>) are dropped.",
        "FINAL 42<|im_end|>",
    ),
    _text(
        "end_of_sequence",
        "A trailing </s> end-of-sequence token is dropped.",
        "FINAL 42 </s>",
    ),
    # -- fences ----------------------------------------------------------------------------------
    Rule(
        "repl_fence",
        "fences",
        "Code in a ```repl block runs (the paper's protocol); fences with another language or none do "
        "not, and the model is told.",
        ("```repl\nprint(len(context))\n```",),
        paper=True,
    ),
    Rule(
        "python_fences",
        "fences",
        "```python (any case), ```py, ```python3, ```ipython and Gemini's ```tool_code run as ```repl "
        "does: models trained on notebooks write them.",
        ("```python\nprint(len(context))\n```", "```tool_code\nprint(1)\n```"),
    ),
    Rule(
        "final_spans_fences",
        "fences",
        "A FINAL( whose argument quotes fenced blocks is prose, all of it, up to its closing parenthesis.",
        ('FINAL("""Use:\n```repl\nprint(1)\n```\n""")',),
    ),
    Rule(
        "one_line_fence",
        "fences",
        "A whole block on one line (```repl print(1)```) runs.",
        ("```repl print(len(context))```",),
    ),
    Rule(
        "code_on_opener",
        "fences",
        "Code written on the opening fence's line (```python import re) is the block's first line.",
        ("```python import re\nprint(re.escape('a.b'))\n```",),
    ),
    Rule(
        "fences_in_strings",
        "fences",
        "A fence inside a triple-quoted string in code (a prompt template) is part of the string, not "
        "the block's end.",
        ('```repl\np = """Answer in\n```\nfenced form"""\nprint(p)\n```',),
    ),
    Rule(
        "doubled_opener",
        "fences",
        "An opener written twice (``` then ```python, or ```python then ```) counts once.",
        ("```\n```python\nprint(1)\n```", "```python\n```\nprint(1)\n```"),
    ),
    Rule(
        "unclosed_block",
        "fences",
        "A tagged fence met inside a runnable block means the block was never closed: it ends there "
        "and the new one starts (the model is told).",
        ("```repl\nprint(1)\n```repl\nprint(2)\n```",),
    ),
    Rule(
        "fence_on_last_code_line",
        "fences",
        "A closing fence written at the end of the code's last line (x = 5```) closes the block there.",
        ("```repl\nx = 5\nprint(x)```\nFINAL(5)",),
    ),
    Rule(
        "quoting_blocks",
        "fences",
        "A ```markdown block may quote fenced examples of its own; they do not run.",
        ("```markdown\nRun:\n```repl\nprint(1)\n```\n```",),
    ),
    Rule(
        "console_prompts",
        "fences",
        "A block written as a console session (>>> lines, output under them) runs its >>> lines only.",
        ("```python\n>>> x = 2\n>>> print(x)\n2\n```",),
    ),
    Rule(
        "fenced_final_text",
        "fences",
        "A runnable block that is only FINAL(text Python cannot read) is an answer in the wrong place, not code.",
        ("```repl\nFINAL(The answer is 42)\n```",),
    ),
    # -- answer ----------------------------------------------------------------------------------
    Rule(
        "final_var_at_line_start",
        "answer",
        "FINAL_VAR(name) at the start of a line answers with the REPL variable `name` (the paper's protocol).",
        ("FINAL_VAR(result)",),
        paper=True,
    ),
    Rule(
        "final_at_line_start",
        "answer",
        "FINAL(answer) at the start of a line answers (the paper's protocol); its argument ends at the "
        "parenthesis that closes it, a string or JSON value read whole.",
        ('FINAL("The answer is (b): 42")',),
        paper=True,
    ),
    Rule(
        "final_decoration",
        "answer",
        "Markdown or a label around an answer line (**FINAL**(x), - FINAL(x), **Answer:** FINAL(x), "
        "<answer>FINAL(x)) does not hide it.",
        ("**FINAL(42)**", "**Answer:** FINAL(42)"),
    ),
    Rule(
        "final_any_case",
        "answer",
        "final(42), Final(42), Final_Var(x): lower or title case counts with the parenthesis right after "
        'the word ("Final (and most important) point" is English).',
        ("final(42)", "Final_Var(total)"),
    ),
    Rule(
        "final_keyword_argument",
        "answer",
        "FINAL(answer=\"Paris\") or FINAL_VAR(name=\"x\"): the keyword's value is the answer, as the REPL's FINAL takes it.",
        ('FINAL(answer="Paris")',),
    ),
    Rule(
        "loose_final",
        "answer",
        "An answer written without parentheses (FINAL 345, FINAL: x, Final Answer: x, FINAL_VAR: x) is "
        "taken, marked loose.",
        ("FINAL 345", "Final Answer: Paris"),
    ),
    Rule(
        "answer_tags",
        "answer",
        "<answer>...</answer> (or <final_answer>, <final>; the last such) holds an answer written without FINAL.",
        ("I counted them.\n<answer>42</answer>",),
    ),
    Rule(
        "boxed_answer",
        "answer",
        "Math-trained models answer with \\boxed{...} (in $...$ or \\[...\\]); the last one, read to its "
        "matching brace, is the answer, also inside FINAL($\\boxed{42}$).",
        ("So the total is $\\boxed{42}$.", "FINAL($\\boxed{\\frac{1}{2}}$)"),
    ),
    # -- code ------------------------------------------------------------------------------------
    Rule(
        "unfenced_code",
        "code",
        "Python written outside any fence in a reply with no runnable block runs when it is plainly code "
        "(recursa/loop/unfenced.py); off, the model is told it did not run.",
        ("Let me look.\nprint(len(context))",),
    ),
    Rule(
        "bare_fence_code",
        "code",
        "Plain Python in a fence with no language (``` only) runs by the same test as unfenced code.",
        ("```\nprint(len(context))\n```",),
    ),
    # -- last_call -------------------------------------------------------------------------------
    Rule(
        "inline_final",
        "last_call",
        "FINAL(...) inside a sentence is not an answer while turns are left (often a plan), but the "
        "forced last call takes its argument rather than the whole reply.",
        ("So the answer is FINAL(42).",),
    ),
    Rule(
        "fenced_final",
        "last_call",
        "FINAL(...) alone in a plain fence (```\\nFINAL(42)\\n```) is what the forced last call takes.",
        ("```\nFINAL(42)\n```",),
    ),
    # -- turn ------------------------------------------------------------------------------------
    Rule(
        "answer_beside_code",
        "turn",
        "An answer written beside code is taken that turn when it cannot be a guess: FINAL_VAR(name) "
        "after the code ran cleanly and bound `name`, or a literal FINAL the code's own output shows.",
        ("```repl\nx = 6 * 7\nprint(x)\n```\nFINAL(42)", "```repl\ntotal = 6 * 7\n```\nFINAL_VAR(total)"),
    ),
)

_BUILT_IN = frozenset(r.name for r in RULES)


@dataclass(frozen=True)
class ReplyRules:
    """A selection of rules, in order, and what a turn does with an answer beside code."""

    rules: tuple[Rule, ...] = RULES
    beside_code: Literal["confirmed", "always"] = "confirmed"
    _known: frozenset[str] = field(default=_BUILT_IN, repr=False)
    # The tags of the fences that run, where only built-in text rules and no answer rule of one's
    # own are in force: then a reply of plain prose and such fences reads the same by no rule at
    # all (parse.py, `_plain`); else None. Derived from `rules`.
    plain_tags: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [r.name for r in self.rules]
        # `on` is asked a score of times per reply read: a set, not a scan of every rule each time.
        object.__setattr__(self, "_on", frozenset(names))
        object.__setattr__(self, "_stages", {st: tuple(r for r in self.rules if r.stage == st) for st in STAGES})
        own = any(r not in RULES for r in self.rules if r.stage in ("text", "answer"))
        object.__setattr__(self, "plain_tags", None if own else runnable_tags(names.__contains__))
        if len(set(names)) != len(names):
            raise ValueError(f"reply rules named twice: {sorted({n for n in names if names.count(n) > 1})}")
        unknown = set(names) - self._known
        if unknown:
            raise KeyError(f"unknown reply rules {sorted(unknown)}; add a rule of your own with adding()")

    @classmethod
    def strict(cls) -> ReplyRules:
        """The paper's protocol only: ```repl blocks, FINAL(...) and FINAL_VAR(name) on lines of their own."""
        return cls(tuple(r for r in RULES if r.paper))

    def on(self, name: str) -> bool:
        """Whether the rule `name` is in force (KeyError for a name no rule has)."""
        if name not in self._known:
            raise KeyError(f"no reply rule is named {name!r}")
        return name in self._on  # type: ignore[attr-defined]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rules)

    def without(self, *names: str) -> ReplyRules:
        self._check(names)
        return replace(self, rules=tuple(r for r in self.rules if r.name not in names))

    def only(self, *names: str) -> ReplyRules:
        self._check(names)
        return replace(self, rules=tuple(r for r in self.rules if r.name in names))

    def adding(self, rule: Rule, *, after: str | None = None, before: str | None = None) -> ReplyRules:
        """These rules and `rule` (a `text` rule with `apply`, or an `answer` rule with `find`),
        placed after or before the rule named (else at the end of its stage)."""
        if (rule.stage == "text" and rule.apply is None) or (rule.stage == "answer" and rule.find is None):
            raise ValueError(f"a {rule.stage} rule needs {'apply' if rule.stage == 'text' else 'find'}")
        if rule.stage not in ("text", "answer"):
            raise ValueError(f"rules of one's own are text or answer rules, not {rule.stage!r}")
        rules = list(self.rules)
        anchor = after or before
        if anchor is not None:
            self._check((anchor,))
            at = [r.name for r in rules].index(anchor) + (1 if after else 0)
        else:
            stages = [STAGES.index(r.stage) for r in rules]
            at = sum(1 for s in stages if s <= STAGES.index(rule.stage))
        rules.insert(at, rule)
        return replace(self, rules=tuple(rules), _known=self._known | {rule.name})

    def of_stage(self, stage: Stage) -> tuple[Rule, ...]:
        return self._stages[stage]  # type: ignore[attr-defined,no-any-return]

    def beside_code_taken(self) -> BesideCode:
        """What a turn does with an answer written beside code."""
        return self.beside_code if self.on("answer_beside_code") else "never"

    def _check(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in self._known]
        if unknown:
            raise KeyError(f"no reply rule is named {unknown}; the rules: {', '.join(sorted(self._known))}")


DEFAULT_RULES = ReplyRules()
# The rule sets a setting names: RLM(dialect_options={"reply_rules": "strict"}).
RULE_SETS: dict[str, ReplyRules] = {"default": DEFAULT_RULES, "strict": ReplyRules.strict()}


def named_rules(spec: ReplyRules | str) -> ReplyRules:
    """The rules `spec` names ("default", "strict"), or `spec` itself when it is a ReplyRules."""
    if isinstance(spec, ReplyRules):
        return spec
    if isinstance(spec, str) and spec in RULE_SETS:
        return RULE_SETS[spec]
    raise ConfigError(
        f"reply_rules={spec!r}: give one of {', '.join(map(repr, RULE_SETS))} (\"strict\": the paper's "
        "protocol only) or a recursa.loop.rules.ReplyRules"
    )


def rules_of(dialect: object, *, unfenced_code: bool = True) -> ReplyRules:
    """The rules a dialect reads replies by (its `rules`, else every rule), without the code rules
    when RLM(unfenced_code=False) says Python outside a ```repl fence does not run."""
    rules = getattr(dialect, "rules", None)
    rules = rules if isinstance(rules, ReplyRules) else DEFAULT_RULES
    return rules if unfenced_code else rules.without(*(r.name for r in rules.of_stage("code")))
