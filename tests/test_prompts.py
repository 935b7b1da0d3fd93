"""The challenge prompt (agonlib.prompts): the structure the gate measured, and a controlled 2×2."""

import difflib

import pytest

from agonlib import prompts
from agonlib.parsing import MASK, last_boxed


def _words(messages):
    return " ".join(m["content"] for m in messages).split()


@pytest.mark.parametrize("task", ["math", "code"])
def test_framings_differ_only_in_the_word_naming_the_other_solver(task):
    rival = prompts.challenge_prompt("How many?", f"2 + 2 = {MASK}.", "competitive", task)
    mate = prompts.challenge_prompt("How many?", f"2 + 2 = {MASK}.", "cooperative", task)
    changed = [(a, b) for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=_words(rival), b=_words(mate)).get_opcodes()
               if op != "equal" for a, b in zip(_words(rival)[i1:i2], _words(mate)[j1:j2])]
    assert changed and set(changed) == {("rival", "teammate")}
    assert [m["role"] for m in rival] == [m["role"] for m in mate]


def test_the_turn_shows_the_attempt_then_the_instruction_then_the_question():
    question = "Tom has 5 apples and eats 2. How many are left?"
    turn = prompts.challenge_prompt(question, f"5 - 2 = {MASK}.", "competitive")[-1]
    assert turn["role"] == "user" and turn["content"].endswith(question)  # ends as the drafter's turn does
    body = turn["content"]
    assert body.index(f"5 - 2 = {MASK}.") < body.index("\\boxed{}") < body.index(question)
    # an empty summary (a thinking draft that never closed </think>) is shown as such
    assert prompts.EMPTY_SUMMARY in prompts.challenge_prompt(question, "  ", "competitive")[-1]["content"]


def test_worked_challenges_teach_agreeing_and_disagreeing():
    verdicts = []
    for question, attempt, answer in prompts.CHALLENGE_EXAMPLES:
        assert MASK in attempt and last_boxed(answer) is not None
        stated = attempt.split("=")[-1]  # the attempt's own result is masked: compare its expression instead
        verdicts.append(attempt.split(" = ")[0].split()[-3:] == answer.split(" = ")[0].split()[-3:])
        assert MASK in stated
    assert sorted(verdicts) == [False, True]  # one attempt wrong (disagree), one right (agree)


def test_unknown_reward_is_an_error():
    with pytest.raises(ValueError, match="competitive"):
        prompts.challenge_prompt("q", "s", "friendly")


def test_a_challenge_over_the_budget_drops_the_start_of_its_summary_not_the_system_prompt(smoke_policies):
    tok = smoke_policies.tokenizer
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    question = "Tom has 5 apples and eats 2. How many are left?"
    steps = " ".join(f"Step {k}: {k} + {k} = {2 * k}." for k in range(1, 80))
    summary = f"{steps} So the answer is {MASK}."
    empty = count(prompts.render(tok, prompts.challenge_prompt(question, "", "competitive")))
    budget = empty + 60  # room for about a tenth of the summary
    [text, short], [shown, kept] = prompts.challenge_texts(tok, [question] * 2, [summary, "5 - 2 = 3."],
                                                           "competitive", "math", False, budget)
    assert count(text) <= budget and count(short) <= budget
    assert prompts.MATH_SYSTEM in text and text.count(question) == 1  # opening and problem intact
    assert shown.startswith(prompts.OMITTED) and shown.endswith(f"So the answer is {MASK}.")  # its end kept
    assert shown[len(prompts.OMITTED):] in summary and len(shown) < len(summary) / 5
    assert kept == "5 - 2 = 3."  # a prompt within the budget is rendered as it always was
    assert short == prompts.render(tok, prompts.challenge_prompt(question, kept, "competitive"))
    # a budget that not even an empty summary fits: left to the generator's cut from the left
    [text], [shown] = prompts.challenge_texts(tok, [question], [summary], "competitive", "math", False, empty - 5)
    assert shown == summary and count(text) > empty
