"""Scripted models: the roots' REPL code really solves the tasks, faults recover, the client reports usage.

The harness below is deliberately small: it runs a root's ```repl blocks with plain `exec` in a
dict namespace (context, llm_query backed by the oracle policy, FINAL/FINAL_VAR/answer), feeds
the printed output back as the next user message, and follows the engine's answer rules (a prose
FINAL next to code is ignored). The real engine runs the same policies through the real sandbox.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import pytest

from recursa.errors import ConfigError
from recursa.lm.base import CallMeta, LMClient, LMRequest
from recursa.lm.tokens import count_message_tokens, count_tokens
from recursa.scripted import get_policy, policy_names
from recursa.scripted.catalog import _POLICIES
from recursa.scripted.client import ScriptedClient
from recursa.scripted.conversation import read
from recursa.tasks import Task, generate
from recursa.tasks.oolong import LABELS, QUESTION_KINDS

_FENCE = re.compile(r"```repl[ \t]*\n(.*?)\n```", re.DOTALL)
_PROSE_FINAL_VAR = re.compile(r"^FINAL_VAR\(\s*[\"']?(\w+)[\"']?\s*\)", re.MULTILINE)
_PROSE_FINAL = re.compile(r"^FINAL\((.*)\)[ \t]*$", re.MULTILINE)
LAST_CALL = "You have used all 8 turns. No more code will run. Reply now with your final answer."


class _Answered(Exception):
    pass


@dataclass
class Run:
    answer: str | None
    messages: list[dict[str, str]]
    outputs: list[str] = field(default_factory=list)
    llm_calls: int = 0
    child_runs: int = 0
    ignored_finals: int = 0  # prose FINALs written next to code, which the engine does not accept

    @property
    def replies(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "assistant"]


class Harness:
    def __init__(
        self,
        sub: str = "oracle",
        *,
        system: str = "You are an RLM root.",
        max_turns: int = 10,
        max_depth: int = 2,
        output_limit: int = 20_000,
        cpu_timeout: float = 5.0,  # CPU seconds: a sub-call per line of a 100k context took >1 s on a loaded machine
    ) -> None:
        self.sub_name = sub
        self.sub = get_policy(sub)
        self.system = system
        self.max_turns = max_turns
        self.max_depth = max_depth
        self.output_limit = output_limit
        self.cpu_timeout = cpu_timeout

    def run(self, root: str, question: str, context: Any, depth: int = 0) -> Run:
        policy = get_policy(root)
        first = f"<question>\n{question}\n</question>\n\nThe context is in the REPL variable `context`."
        run = Run(None, [{"role": "system", "content": self.system}, {"role": "user", "content": first}])
        ns = self._namespace(run, context, depth)
        for _turn in range(self.max_turns):
            reply = policy(run.messages)
            run.messages.append({"role": "assistant", "content": reply})
            blocks = _FENCE.findall(reply)
            prose = _FENCE.sub("", reply)
            if not blocks:
                named = _PROSE_FINAL_VAR.search(prose)
                literal = _PROSE_FINAL.search(prose)
                if named and named.group(1) in ns:
                    run.answer = str(ns[named.group(1)])
                    return run
                if literal:
                    run.answer = literal.group(1)
                    return run
                run.messages.append({"role": "user", "content": "Your reply had no code and no answer."})
                continue
            run.ignored_finals += bool(_PROSE_FINAL_VAR.search(prose) or _PROSE_FINAL.search(prose))
            printed: list[str] = ns["__printed__"]
            printed.clear()
            for code in blocks:
                if self._execute(code, ns, printed):
                    run.answer = ns["__answer__"]
                    return run
            output = "".join(printed) or "(no output)"
            if len(output) > self.output_limit:
                half = self.output_limit // 2
                output = f"{output[:half]}\n... [{len(output) - 2 * half:,} characters omitted] ...\n{output[-half:]}"
            run.outputs.append(output)
            run.messages.append({"role": "user", "content": "REPL output:\n" + output})
        return run

    def last_call(self, root: str, run: Run) -> str:
        """What a root answers when the engine runs out of turns."""
        return get_policy(root)([*run.messages, {"role": "user", "content": LAST_CALL}])

    def _execute(self, code: str, ns: dict[str, Any], printed: list[str]) -> bool:
        def stop(_signum: int, _frame: Any) -> None:
            raise TimeoutError(f"execution exceeded {self.cpu_timeout} s and was interrupted")

        # CPU-time alarm: SIGALRM belongs to pytest-timeout, and `while True: pass` burns CPU anyway.
        previous = signal.signal(signal.SIGVTALRM, stop)
        signal.setitimer(signal.ITIMER_VIRTUAL, self.cpu_timeout)
        try:
            exec(compile(code, "<repl>", "exec"), ns)
        except _Answered:
            return True
        except BaseException as exc:
            printed.append("".join(traceback.format_exception_only(type(exc), exc)))
        finally:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            signal.signal(signal.SIGVTALRM, previous)
        if ns["answer"].get("ready"):
            ns["__answer__"] = str(ns["answer"].get("content"))
            return True
        return False

    def _namespace(self, run: Run, context: Any, depth: int) -> dict[str, Any]:
        ns: dict[str, Any] = {"__printed__": []}

        def _print(*args: Any, sep: str = " ", end: str = "\n", **_kw: Any) -> None:
            ns["__printed__"].append(sep.join(str(a) for a in args) + end)

        def llm_query(prompt: str, model: str | None = None) -> str:
            run.llm_calls += 1
            return self.sub([{"role": "user", "content": prompt}])

        def rlm_query(prompt: str, context: Any = None) -> str:
            if depth + 1 >= self.max_depth:  # as the engine does at the last level: a plain call
                return llm_query(prompt if context is None else f"{prompt}\n\n{_as_text(context)}")
            run.child_runs += 1
            child = self.run(self.sub_name, prompt, context if context is not None else prompt, depth + 1)
            return child.answer or ""

        def final(value: Any) -> None:
            ns["__answer__"] = str(value)
            raise _Answered

        def final_var(name: str) -> None:
            ns["__answer__"] = str(ns[name])
            raise _Answered

        ns.update(
            context=context,
            print=_print,
            llm_query=llm_query,
            llm_query_batched=lambda prompts, model=None: [llm_query(p) for p in prompts],
            rlm_query=rlm_query,
            rlm_query_batched=lambda prompts, contexts=None: [
                rlm_query(p, c) for p, c in zip(prompts, contexts or [None] * len(prompts), strict=True)
            ],
            FINAL=final,
            FINAL_VAR=final_var,
            answer={"content": None, "ready": False},
            SHOW_VARS=lambda: _print(sorted(k for k in ns if not k.startswith("_"))),
        )
        return ns


def _as_text(context: Any) -> str:
    if isinstance(context, str):
        return context
    if isinstance(context, dict):
        return "\n\n".join(f"### {k}\n{v}" for k, v in context.items())
    return "\n\n".join(str(x) for x in context)


def solve(root: str, task: Task, **harness: Any) -> Run:
    return Harness(**harness).run(root, task.question, task.context)


# -- names and knobs -----------------------------------------------------------------------------


def test_builtin_policies_and_knobs() -> None:
    assert {"gpt5-like", "qwen-coder-like", "no-subcalls", "base-llm", "oracle"} <= set(policy_names())
    assert callable(get_policy("gpt5-like:noise=0.1,fault=syntax+loop,batch=50"))
    assert callable(get_policy("oracle:noise=0.2,seed=3"))
    with pytest.raises(KeyError, match="gpt5-like"):
        get_policy("gpt6-like")
    with pytest.raises(ValueError, match=r"unknown knob.*temperature.*known: fault"):
        get_policy("gpt5-like:temperature=2")
    with pytest.raises(ValueError, match="unknown fault"):
        get_policy("gpt5-like:fault=segfault")
    with pytest.raises(ValueError, match="noise"):
        get_policy("oracle:noise=1.5")
    with pytest.raises(ValueError, match="unknown knob"):
        get_policy("oracle:fault=loop")


def test_zero_argument_factories_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_POLICIES, "_test-echo", lambda: lambda messages: "echo")
    assert get_policy("_test-echo")([]) == "echo"
    with pytest.raises(ValueError, match="takes no knobs"):
        get_policy("_test-echo:noise=1")


# -- roots solve the tasks -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["niah", "oolong"])
@pytest.mark.parametrize("root", ["gpt5-like", "qwen-coder-like"])
def test_roots_with_subcalls_solve_the_tasks(root: str, family: str) -> None:
    task = generate(family, 100_000, seed=7, **({"question": "count"} if family == "oolong" else {}))
    run = solve(root, task)
    assert run.answer is not None and task.score(run.answer) == 1.0, (run.answer, task.gold)
    assert read(run.messages).steps[:2] == ["peek", "solve"] and len(run.replies) == 3
    if family == "oolong":
        lines = task.meta["n_lines"]
        if root == "gpt5-like":
            assert run.llm_calls <= lines // 100  # a few large batches
        else:
            assert run.llm_calls >= lines  # the over-caller: one call per line


@pytest.mark.parametrize("kind", QUESTION_KINDS)
@pytest.mark.parametrize("root", ["gpt5-like", "qwen-coder-like"])
def test_roots_answer_every_oolong_question_kind(root: str, kind: str) -> None:
    for seed in range(2):
        task = generate("oolong", 30_000, seed=seed, question=kind)
        run = solve(root, task)
        assert run.answer is not None and task.score(run.answer) == 1.0, (kind, run.answer, task.gold)
        if kind in ("user_count", "year_count"):  # lines outside the filter never reach a sub-model
            if root == "qwen-coder-like":  # one call per line, so the filter shows in the count
                assert run.llm_calls < 0.5 * task.meta["n_lines"]


def test_answer_protocols_differ_by_persona() -> None:
    task = generate("oolong", 20_000, seed=1, question="count")
    gpt5, qwen, plain = (solve(p, task) for p in ("gpt5-like", "qwen-coder-like", "no-subcalls"))
    assert gpt5.replies[-1].rstrip().endswith("FINAL_VAR(result)") and "```" not in gpt5.replies[-1]
    assert 'FINAL_VAR("result")' in qwen.replies[-1] and "```repl" in qwen.replies[-1]
    assert read(qwen.messages).steps == ["peek", "solve", "final"]
    assert 'answer["ready"] = True' in plain.replies[-1]
    niah_run = solve("gpt5-like", generate("niah", 20_000, seed=1))
    assert re.search(r"^FINAL\(\d{7}\)$", niah_run.replies[-1], re.MULTILINE)


def test_no_subcalls_is_exact_on_niah_and_weaker_on_oolong() -> None:
    for seed in range(3):
        task = generate("niah", 100_000, seed=seed)
        run = solve("no-subcalls", task)
        assert run.answer is not None and task.score(run.answer) == 1.0
        assert run.llm_calls == 0 and "llm_query" not in "".join(run.replies)
    scores = []
    for seed in range(6):
        task = generate("oolong", 50_000, seed=seed, question="count")
        run = solve("no-subcalls", task)
        assert run.llm_calls == 0 and run.answer is not None
        scores.append(task.score(run.answer))
    assert sum(scores) / len(scores) < 0.6


@pytest.mark.parametrize("shape", ["list", "dict"])
@pytest.mark.parametrize("root", ["gpt5-like", "qwen-coder-like", "no-subcalls"])
def test_roots_handle_list_and_dict_contexts(root: str, shape: str) -> None:
    task = generate("niah", 60_000, seed=4, shape=shape)
    run = solve(root, task)
    assert run.answer is not None and task.score(run.answer) == 1.0


def test_a_regex_miss_falls_back_to_subcalls() -> None:
    # The needle rephrased so the regex misses it: the sub-models still find it, chunk by chunk.
    task = generate("niah", 120_000, seed=2, distractors=0)
    key = task.meta["key"]
    context = task.context.replace(f"magic number for {key} is", f"magic number for {key} is, as noted,")
    run = Harness().run("gpt5-like", task.question, context)
    assert run.answer == task.gold
    assert run.llm_calls >= 3  # it asked about every chunk rather than give up
    assert "regex hits for" in run.outputs[1] and ": []" in run.outputs[1].splitlines()[0]


# -- faults --------------------------------------------------------------------------------------

_FAULT_EVIDENCE = {
    "syntax": lambda run: any("SyntaxError" in out for out in run.outputs),
    "loop": lambda run: any("TimeoutError" in out for out in run.outputs),
    "bigprint": lambda run: any("characters omitted" in out for out in run.outputs),
    "wrong-final": lambda run: run.ignored_finals == 1,
}


@pytest.mark.parametrize("family", ["niah", "oolong"])
@pytest.mark.parametrize("fault", list(_FAULT_EVIDENCE))
def test_every_fault_happens_once_and_the_root_still_answers(fault: str, family: str) -> None:
    task = generate(family, 100_000, seed=3)
    run = solve(f"gpt5-like:fault={fault}", task, cpu_timeout=0.5)
    assert _FAULT_EVIDENCE[fault](run), run.outputs
    assert run.answer is not None and task.score(run.answer) == 1.0


@pytest.mark.parametrize("root", ["qwen-coder-like", "no-subcalls"])
def test_all_faults_at_once_for_the_other_personas(root: str) -> None:
    task = generate("niah", 50_000, seed=9)
    run = solve(f"{root}:fault=syntax+loop+bigprint+wrong-final", task, cpu_timeout=0.5)
    assert all(check(run) for check in _FAULT_EVIDENCE.values())
    assert run.answer is not None and task.score(run.answer) == 1.0
    assert len(run.replies) == 5  # two fault turns, peek, solve, answer


# -- recursion, the oracle as a child root, and the engine's last call ----------------------------


@pytest.mark.parametrize("family", ["niah", "oolong"])
@pytest.mark.parametrize("max_depth", [1, 2])
def test_recursive_root_hands_chunks_to_children(family: str, max_depth: int) -> None:
    task = generate(family, 100_000, seed=5, **({"question": "most_common"} if family == "oolong" else {}))
    run = solve("gpt5-like:recurse=1,chunk=30000", task, max_depth=max_depth)
    assert run.answer is not None and task.score(run.answer) == 1.0, (run.answer, task.gold)
    assert "rlm_query_batched" in run.replies[1]
    if max_depth == 2:
        assert run.child_runs >= 3  # real child RLMs, run by the oracle acting as gpt5-like
    else:
        assert run.child_runs == 0 and run.llm_calls >= 3  # children became plain calls


def test_oracle_solves_as_a_child_root() -> None:
    for family in ("niah", "oolong"):
        task = generate(family, 40_000, seed=6)
        run = solve("oracle", task)
        assert run.answer is not None and task.score(run.answer) == 1.0


def test_last_call_gets_a_prose_answer() -> None:
    task = generate("oolong", 20_000, seed=2, question="count")
    harness = Harness(max_turns=2)  # peek and solve ran; then the engine asks for the answer
    run = harness.run("qwen-coder-like", task.question, task.context)
    assert run.answer is None
    reply = harness.last_call("qwen-coder-like", run)
    assert "```" not in reply
    literal = _PROSE_FINAL.search(reply)
    assert literal and task.score(literal.group(1)) == 1.0


def test_a_rejected_answer_is_given_again_as_literal_text() -> None:
    task = generate("oolong", 20_000, seed=4, question="count")
    run = solve("gpt5-like", task)
    policy = get_policy("gpt5-like")
    rejected = "FINAL_VAR(result) names no variable in the REPL (defined: none yet)."
    retry = policy([*run.messages, {"role": "user", "content": rejected}])
    literal = _PROSE_FINAL.search(retry)
    assert "```" not in retry and literal and task.score(literal.group(1)) == 1.0


def test_system_prompt_without_subcalls_or_with_answer_dict_only() -> None:
    task = generate("oolong", 20_000, seed=3, question="count")
    no_calls = Harness(system="- No model calls are available from code in this run: work with code alone.")
    run = no_calls.run("gpt5-like", task.question, task.context)
    assert run.llm_calls == 0 and run.answer is not None
    dict_only = Harness(system='The only way to answer: in code, set `answer["content"]` ...')
    run = dict_only.run("gpt5-like", task.question, task.context)
    assert 'answer["ready"] = True' in run.replies[-1]
    assert run.answer is not None and task.score(run.answer) == 1.0


def test_unknown_questions_get_a_generic_map_reduce() -> None:
    docs = [generate("niah", 30_000, seed=s, distractors=0).context for s in range(3)]
    docs[1] += " The harbour master of Porto keeps a green parrot called Admiral Biscuit."
    question = "What is the name of the green parrot that the harbour master keeps?"
    for root in ("gpt5-like", "qwen-coder-like", "no-subcalls"):
        run = Harness().run(root, question, docs)
        assert run.answer is not None and "Admiral Biscuit" in run.answer, (root, run.answer)


def test_policies_are_stateless_across_interleaved_conversations() -> None:
    runs = [solve("gpt5-like", generate(f, 30_000, seed=1)) for f in ("niah", "oolong")]
    policy = get_policy("gpt5-like")  # one instance serving both conversations, turn by turn
    for turn in range(3):
        for run in runs:
            cut = [i for i, m in enumerate(run.messages) if m["role"] == "assistant"][turn]
            assert policy(run.messages[:cut]) == run.messages[cut]["content"]


# -- the oracle and base-llm ---------------------------------------------------------------------


def _classification_prompt(instances: list[str]) -> str:
    header = "Classify each question below into one of: " + ", ".join(LABELS) + ".\n\nQuestions:\n"
    return header + "\n".join(f"{i}: {text}" for i, text in enumerate(instances))


def test_oracle_labels_instances_and_noise_flips_a_seeded_fraction() -> None:
    task = generate("oolong", 100_000, seed=4)
    instances = [line.split("Instance: ", 1)[1] for line in task.context.split("\n")]
    truth = task.hidden["labels"]
    prompt = _classification_prompt(instances)
    clean = get_policy("oracle")([{"role": "user", "content": prompt}])
    assert clean.splitlines() == [f"{i}: {label}" for i, label in enumerate(truth)]
    noisy = get_policy("oracle:noise=0.1")
    answer = noisy([{"role": "user", "content": prompt}])
    assert answer == noisy([{"role": "user", "content": prompt}])  # deterministic
    wrong = [i for i, line in enumerate(answer.splitlines()) if line != f"{i}: {truth[i]}"]
    assert 0.07 < len(wrong) / len(truth) < 0.13
    repeated = {}  # the same instance gets the same (possibly wrong) label wherever it appears
    for text, line in zip(instances, answer.splitlines(), strict=True):
        assert repeated.setdefault(text, line.split(": ", 1)[1]) == line.split(": ", 1)[1]
    other_seed = get_policy("oracle:noise=0.1,seed=1")([{"role": "user", "content": prompt}])
    assert other_seed != answer
    single = (
        f"Which label fits? Labels: {', '.join(LABELS)}.\nQuestion: {instances[0]}\nReply with the label."
    )
    assert get_policy("oracle")([{"role": "user", "content": single}]) == truth[0]


def test_oracle_answers_needle_whole_task_combine_and_generic_prompts() -> None:
    oracle = get_policy("oracle")

    def ask(prompt: str) -> str:
        return oracle([{"role": "user", "content": prompt}])

    niah = generate("niah", 20_000, seed=2)
    assert ask(niah.question + "\n\n" + niah.context) == niah.gold
    assert ask(niah.question + "\n\nNothing to see here.") == "NONE"
    task = generate("oolong", 20_000, seed=2, question="user_count")
    assert task.score(ask(task.question + "\n\n" + task.context)) == 1.0
    combine = (
        "Question: Which colour is the door?\n\nPartial answers:\n1. NONE\n2. The door is painted red.\n"
    )
    assert ask(combine) == "The door is painted red."
    generic = "Question: Where does the ferry captain live?\n\nText:\nThe sky is grey. The ferry captain lives in Bergen."
    assert ask(generic) == "The ferry captain lives in Bergen."


def test_base_llm_reads_needles_in_its_prompt_and_guesses_oolong_labels() -> None:
    base = get_policy("base-llm")
    for seed in range(3):
        task = generate("niah", 100_000, seed=seed)
        reply = base([{"role": "user", "content": task.context + "\n\n" + task.question}])
        assert task.score(reply) == 1.0
        cut = task.context[: task.hidden["needle_offset"]]  # the needle fell outside its window
        assert task.score(base([{"role": "user", "content": cut + "\n\n" + task.question}])) == 0.0
    scores = []
    for seed in range(6):
        task = generate("oolong", 50_000, seed=seed, question="count")
        reply = base([{"role": "user", "content": task.context + "\n\n" + task.question}])
        assert re.search(r"Answer: \d+$", reply)
        scores.append(task.score(reply))
    assert sum(scores) / len(scores) < 0.6  # keyword labels, not judgement
    as_root = base(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "<question>\nhi\n</question>"}]
    )
    assert as_root.startswith("FINAL(")


# -- the client ----------------------------------------------------------------------------------


def _request(messages: list[dict[str, str]], max_output_tokens: int = 4_000) -> LMRequest:
    return LMRequest(messages=messages, max_output_tokens=max_output_tokens, meta=CallMeta(call_id="c1"))


async def test_client_reports_usage_and_zero_cost() -> None:
    client = ScriptedClient("scripted/gpt5-like")
    assert isinstance(client, LMClient) and client.provider == "scripted" and client.model == "gpt5-like"
    task = generate("niah", 5_000, seed=1)
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": f"<question>\n{task.question}\n</question>"},
    ]
    response = await client.complete(_request(messages))
    assert "```repl" in response.text and "# step: peek" in response.text
    assert response.input_tokens == count_message_tokens(messages)
    assert response.output_tokens == count_tokens(response.text)
    assert (response.cached_tokens, response.provider_cost_usd, response.model) == (0, 0.0, "gpt5-like")
    truncated = await client.complete(_request(messages, max_output_tokens=10))
    assert truncated.finish_reason == "length" and truncated.output_tokens <= 10
    await client.aclose()


async def test_client_runs_large_prompts_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def factory(knobs: dict[str, str]) -> Any:
        def policy(messages: list[dict[str, str]]) -> str:
            seen.append(threading.get_ident())
            return "ok"

        return policy

    monkeypatch.setitem(_POLICIES, "_test-thread-probe", factory)
    client = ScriptedClient("_test-thread-probe", latency_s=0.2)
    loop_thread = threading.get_ident()
    small = await client.complete(_request([{"role": "user", "content": "x" * 1_000}]))
    big = await client.complete(_request([{"role": "user", "content": "x" * 300_000}]))
    assert small.text == big.text == "ok"
    assert seen[0] == loop_thread and seen[1] != loop_thread
    # Many concurrent calls overlap their latency instead of queueing behind each other.
    started = asyncio.get_running_loop().time()
    await asyncio.gather(*(client.complete(_request([{"role": "user", "content": "y"}])) for _ in range(20)))
    assert asyncio.get_running_loop().time() - started < 2.0  # one after another: 4 s


async def test_latency_knob_in_the_model_name() -> None:
    client = ScriptedClient("scripted/oracle:latency=0.05,noise=0.1")
    assert client.latency_s == 0.05 and client.model == "oracle:latency=0.05,noise=0.1"
    loop = asyncio.get_running_loop()
    started = loop.time()
    response = await client.complete(_request([{"role": "user", "content": "Question: hi?"}]))
    assert loop.time() - started >= 0.05 and response.text == "NONE"
    with pytest.raises(ConfigError, match="latency"):
        ScriptedClient("oracle:latency=soon")


def test_client_rejects_unknown_models_and_knobs() -> None:
    with pytest.raises(ConfigError, match="gpt5-like"):
        ScriptedClient("no-such-model")
    with pytest.raises(ConfigError, match="unknown knob"):
        ScriptedClient("oracle:colour=blue")
