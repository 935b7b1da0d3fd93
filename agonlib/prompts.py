"""Every prompt of the game, in one place (they are logged into each run's config.json).

``draft_prompt`` poses the problem. ``challenge_prompt`` shows the drafter's
masked summary as a rival's attempt (competitive reward) or a teammate's
(cooperative reward), then the instruction, then the problem; without exchange
the challenger simply gets ``draft_prompt``. ``challenge_summary`` is the summary it reads (with
``summary_mask: derived``, only the question's own numbers left; ``stated``, each no more often than the
question states it); ``challenge_texts`` renders the challenge prompts within ``max_prompt_tokens``,
dropping the start of a summary that does not fit rather than the system prompt. Prompts are chat
messages; :func:`render` applies the model's chat template (Qwen3's ``enable_thinking`` switch included).
"""

from __future__ import annotations

import logging

from .parsing import MASK, mask_derived_numbers

log = logging.getLogger(__name__)

MATH_SYSTEM = (
    "You are a careful math solver. Solve the problem step by step and end with "
    "the answer inside \\boxed{}."
)
CODE_SYSTEM = (
    "You are a careful competitive programmer. Explain your approach briefly, then "
    "give one complete Python 3 program in a single ```python fenced block. It must "
    "read the input from stdin and print the answer to stdout."
)

# One worked example before the problem: SmolLM2-135M boxes 16/16 answers with it
# and 0/12 without (experiments/LOG.md, 2026-12-02).
MATH_EXAMPLE = (
    {"role": "user", "content": "Anna has 12 pencils. She gives away 5 pencils. How many pencils does she have left?"},
    {"role": "assistant", "content": "Anna starts with 12 pencils and gives away 5, so she has 12 - 5 = 7 "
                                     "pencils left.\n\\boxed{7}"},
)

# The challenge turn (DESIGN.md §2 step 4), designed and measured with the gate (`python -m agonlib gate`;
# experiments/LOG.md, 2026-12-03): the earlier attempt first, then the instruction, then the bare question
# last — exactly what the drafter saw — so the turn ends like every turn the model has answered. On
# SmolLM2-135M (200 pairs) it took the untrained challenger from 0.015 to 0.25 accuracy (0.18 without
# exchange) and from 0.08 to 0.88 boxed answers. The framings differ only in the word naming the other solver.
OTHER_SOLVER = {"competitive": "rival", "cooperative": "teammate"}
# Two worked challenge turns (math): one earlier attempt wrong (the worked answer disagrees and is right),
# one right (it agrees), so the examples do not teach "always disagree".
CHALLENGE_EXAMPLES = (
    ("Ben has 9 stickers. He gives 4 stickers to a classmate. How many stickers does Ben have now?",
     f"Ben has 9 stickers and gets 4 more, so he has 9 + 4 = {MASK} stickers.",
     "Ben gives away 4 stickers, so he has 9 - 4 = 5 stickers.\n\\boxed{5}"),
    ("Lucy has 3 shells. She finds 6 more shells. What is the number of shells Lucy has in the end?",
     f"Lucy has 3 shells and finds 6 more, so she has 3 + 6 = {MASK} shells.",
     "Lucy finds 6 more shells, so she has 3 + 6 = 9 shells.\n\\boxed{9}"),
)
CHALLENGE_INSTRUCTION = {"math": "Solve it yourself and end with \\boxed{}.",
                         "code": "Solve it yourself and give one complete Python 3 program in a ```python block."}
EMPTY_SUMMARY = "(empty)"

def _system(task: str) -> str:
    if task not in ("math", "code"):
        raise ValueError(f"task must be 'math' or 'code', got {task!r}")
    return MATH_SYSTEM if task == "math" else CODE_SYSTEM


def _opening(task: str) -> list[dict]:
    """The system prompt, then (math) the worked example."""
    return [{"role": "system", "content": _system(task)}, *(MATH_EXAMPLE if task == "math" else ())]


def draft_prompt(question: str, task: str = "math") -> list[dict]:
    return [*_opening(task), {"role": "user", "content": question}]


def _challenge_turn(other: str, question: str, summary: str, task: str) -> str:
    return (f"A {other} tried this problem. Their work, with the answer hidden as {MASK}, may be wrong:\n"
            f"{summary.strip() or EMPTY_SUMMARY}\n\n{CHALLENGE_INSTRUCTION[task]}\n\n{question}")


def challenge_prompt(question: str, summary: str, reward: str = "competitive", task: str = "math") -> list[dict]:
    """The challenger's prompt: the opening, the worked challenge turns (math), then this problem's turn."""
    other = OTHER_SOLVER.get(reward)
    if other is None:
        raise ValueError(f"reward must be 'competitive' or 'cooperative', got {reward!r}")
    messages = _opening(task)
    for q, attempt, answer in CHALLENGE_EXAMPLES if task == "math" else ():
        messages += [{"role": "user", "content": _challenge_turn(other, q, attempt, task)},
                     {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": _challenge_turn(other, question, summary, task)}]


#: What stands before a summary whose start was dropped to fit the prompt budget (:func:`challenge_texts`).
OMITTED = "(the start of their work is omitted) … "


def challenge_texts(tokenizer, questions: list[str], summaries: list[str], reward: str, task: str,
                    thinking: bool, max_tokens: int) -> tuple[list[str], list[str]]:
    """Every challenge prompt rendered, and the summary each shows, within ``max_tokens`` tokens.

    A prompt over the budget keeps its opening, its worked turns, the instruction and the problem, and
    drops the start of the rival's summary instead (marked with :data:`OMITTED`; its end, where the
    attempt concludes, stays) — the generator would otherwise cut the prompt from the left, system
    prompt first. A prompt too long even with an empty summary is left to that cut. Each trimmed
    summary is counted in one warning.
    """
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    render_one = lambda q, s: render(tokenizer, challenge_prompt(q, s, reward, task), thinking)  # noqa: E731
    texts, shown, trimmed = [], [], 0
    for question, summary in zip(questions, summaries):
        text = render_one(question, summary)
        over = count(text) - max_tokens
        if over > 0 and count(render_one(question, OMITTED)) <= max_tokens:
            ids = tokenizer(summary, add_special_tokens=False)["input_ids"]
            drop = over + count(OMITTED)
            while True:  # a join can tokenise a little differently: drop a few more until it fits
                summary = OMITTED + tokenizer.decode(ids[drop:]) if drop < len(ids) else OMITTED
                text = render_one(question, summary)
                over = count(text) - max_tokens
                if over <= 0 or drop >= len(ids):
                    break
                drop += over
            trimmed += 1
        texts.append(text)
        shown.append(summary)
    if trimmed:
        log.warning("%d challenge prompt(s) over max_prompt_tokens=%d: the start of their summary was dropped "
                    "to fit.", trimmed, max_tokens)
    return texts, shown


MOA_INTRO = (
    "Several solvers attempted this problem independently. Their solutions, with "
    "their final answers, are below. Some may be wrong. Compare them, decide which "
    "reasoning is right, and give the final answer yourself."
)


def challenge_summary(summary: str, question: str, config) -> str:
    """What the challenger reads of a draft: its ``summary`` (DESIGN.md §2 step 3), and with ``summary_mask:
    derived`` (math) every number ``question`` does not state masked too; with ``stated`` also every use of
    the question's numbers beyond as often as it states them (:func:`~agonlib.parsing.mask_derived_numbers`)."""
    if config.summary_mask in ("derived", "stated") and config.task == "math":
        return mask_derived_numbers(summary, question, capped=config.summary_mask == "stated")
    return summary


#: What a placebo cascade's challenger reads instead of the draft's summary: no information about the draft.
PLACEBO_SUMMARY = "I read the problem carefully and worked through it one step at a time before answering."


def placebo_summary(summary: str) -> str:
    """:data:`PLACEBO_SUMMARY`'s words, repeated or cut to as many words as ``summary`` has.

    >>> placebo_summary("Add 3 and 4 to get […].")
    'I read the problem carefully and worked'
    """
    words, filler = len(summary.split()), PLACEBO_SUMMARY.split()
    return " ".join(filler[i % len(filler)] for i in range(words))


def moa_prompt(question: str, proposals: list[str], task: str = "math") -> list[dict]:
    """The untrained Mixture-of-Agents aggregator: the problem and all ``K`` proposals."""
    blocks = "\n\n".join(f"--- solution {k + 1} ---\n{p.strip() or '(empty)'}" for k, p in enumerate(proposals))
    user = f"Problem:\n{question}\n\n{MOA_INTRO}\n\n{blocks}\n--- end of solutions ---"
    return [*_opening(task), {"role": "user", "content": user}]


def render(tokenizer, messages: list[dict], thinking: bool = False) -> str:
    """The prompt text, ready for generation (Qwen3 honours ``enable_thinking``; others ignore it)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )


def all_prompts() -> dict:
    """The fixed prompt texts, for the run's config.json."""
    return {
        "math_system": MATH_SYSTEM, "code_system": CODE_SYSTEM,
        "other_solver": OTHER_SOLVER, "challenge_examples": [list(e) for e in CHALLENGE_EXAMPLES],
        "challenge_instruction": CHALLENGE_INSTRUCTION,
        "math_example": list(MATH_EXAMPLE), "moa_intro": MOA_INTRO,
    }
