"""Every prompt of the game, in one place (they are logged into each run's config.json).

``draft_prompt`` poses the problem. ``challenge_prompt`` poses it again with the
drafter's summary, framed as a rival's attempt (competitive reward) or a
teammate's (cooperative reward); without exchange the challenger simply gets
``draft_prompt``. Prompts are chat messages; :func:`render` applies the model's
chat template (Qwen3's ``enable_thinking`` switch included).
"""

from __future__ import annotations

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

RIVAL_INTRO = (
    "A rival solver attempted this problem before you. Below is a summary of their "
    "solution with the final answer hidden. It may contain mistakes: check it "
    "critically and solve the problem yourself. You score extra if you are right "
    "where the rival was wrong."
)
TEAMMATE_INTRO = (
    "A teammate attempted this problem before you. Below is a summary of their "
    "solution with the final answer hidden. Use it to help you, and solve the "
    "problem yourself."
)
EMPTY_SUMMARY = "(the previous attempt gave no summary)"


def _system(task: str) -> str:
    if task not in ("math", "code"):
        raise ValueError(f"task must be 'math' or 'code', got {task!r}")
    return MATH_SYSTEM if task == "math" else CODE_SYSTEM


def _opening(task: str) -> list[dict]:
    """The system prompt, then (math) the worked example."""
    return [{"role": "system", "content": _system(task)}, *(MATH_EXAMPLE if task == "math" else ())]


def draft_prompt(question: str, task: str = "math") -> list[dict]:
    return [*_opening(task), {"role": "user", "content": question}]


def challenge_prompt(question: str, summary: str, reward: str = "competitive", task: str = "math") -> list[dict]:
    intro = {"competitive": RIVAL_INTRO, "cooperative": TEAMMATE_INTRO}.get(reward)
    if intro is None:
        raise ValueError(f"reward must be 'competitive' or 'cooperative', got {reward!r}")
    user = (
        f"Problem:\n{question}\n\n{intro}\n\n"
        f"--- summary of the previous attempt ---\n{summary.strip() or EMPTY_SUMMARY}\n"
        "--- end of summary ---"
    )
    return [*_opening(task), {"role": "user", "content": user}]


MOA_INTRO = (
    "Several solvers attempted this problem independently. Their solutions, with "
    "their final answers, are below. Some may be wrong. Compare them, decide which "
    "reasoning is right, and give the final answer yourself."
)


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
        "rival_intro": RIVAL_INTRO, "teammate_intro": TEAMMATE_INTRO,
        "math_example": list(MATH_EXAMPLE), "moa_intro": MOA_INTRO,
    }
