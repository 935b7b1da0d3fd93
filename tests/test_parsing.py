r"""The think / summary / answer split of DESIGN.md §2 step 3 (agonlib/parsing.py).

Table tests: each case is one line with a comment saying what it pins. The
summary is what the challenger reads, so the cases lean on leaks: every box, every
"final answer" statement and every whole-token restatement of the answer must go,
and nothing else may be damaged.
"""

import re
import time

import pytest

from agonlib import extract_summary, split_completion
from agonlib.metrics import leaks
from agonlib.parsing import MASK, last_boxed, mask_answer, mask_derived_numbers

M = MASK  # "[…]"

# --- last_boxed ----------------------------------------------------------------------------

LAST_BOXED = [
    # a plain box
    (r"so \boxed{4}", "4"),
    # nested braces inside the box stay balanced
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    # deeper nesting
    (r"\boxed{\sqrt{\frac{a^{2}}{b}}}", r"\sqrt{\frac{a^{2}}{b}}"),
    # several boxes: the last one wins
    (r"\boxed{1} no wait \boxed{2}", "2"),
    # a box inside a box belongs to the outer one
    (r"\boxed{a + \boxed{b}}", r"a + \boxed{b}"),
    # an unclosed box is no box ...
    (r"\boxed{3", None),
    # ... and does not hide an earlier complete one
    (r"\boxed{1} then \boxed{3", "1"),
    # no box at all
    ("the answer is 4", None),
    # content is stripped; \fbox counts; a space before the brace is allowed
    (r"\boxed{ 7 }", "7"),
    (r"\fbox{9}", "9"),
    (r"\boxed {9}", "9"),
    # a stray closing brace before the box is ignored
    (r"} oops \boxed{5}", "5"),
    # an empty box is an empty answer, not None
    (r"\boxed{}", ""),
]


@pytest.mark.parametrize("text,expected", LAST_BOXED)
def test_last_boxed_table(text, expected):
    assert last_boxed(text) == expected


def test_last_boxed_is_linear_on_unclosed_nesting():
    # 100k unclosed boxes: a quadratic scan would take minutes. The bound is ~40x the
    # time measured on a loaded 2-core machine (0.12 s), so it only fires on a real regression.
    start = time.perf_counter()
    assert last_boxed("\\boxed{" * 100_000) is None
    assert time.perf_counter() - start < 5.0


# --- split_completion: math ----------------------------------------------------------------

SPLIT = [
    # (text, thinking, (think, summary, answer))
    # the docstring's worked example: box and final-answer sentence gone, 4 masked
    (r"<think>2+2 is 4, surely.</think>We add: 2+2=4. The final answer is $\boxed{4}$.", True,
     ("2+2 is 4, surely.", f"We add: 2+2={M}.", "4")),
    # a thinking model that never closed </think> (truncated): no summary, no answer
    (r"<think>I think it is \boxed{4}", True, (r"I think it is \boxed{4}", "", None)),
    # several </think>: only the text after the last one is final
    (r"<think>a</think>b \boxed{1}</think>c \boxed{5}", True, (r"a</think>b \boxed{1}", "c", "5")),
    # Qwen3's template opens <think> in the prompt: the completion holds only the close tag
    (r"hmm, 6*7</think>It is 6*7. \boxed{42}", True, ("hmm, 6*7", "It is 6*7.", "42")),
    # thinking=False: the whole completion is the final text (a <think> tag is just text)
    (r"<think>x</think>So 3. \boxed{3}", False, ("", f"<think>x</think>So {M}.", "3")),
    # multiple boxes: the last is the answer, every box is removed from the summary
    (r"First \boxed{1}, then \boxed{2}.", False, ("", "First , then .", "2")),
    # nested braces: the answer keeps them, the summary loses the whole box
    (r"Half of one: \boxed{\frac{1}{2}}", False, ("", "Half of one:", r"\frac{1}{2}")),
    # the answer restated in LaTeX is masked too
    (r"So $x = \frac{1}{2}$, hence \boxed{\frac{1}{2}}", False, ("", f"So $x = {M}$, hence", r"\frac{1}{2}")),
    # math delimiters emptied by box removal go: $…$, \[…\], \(…\), $$…$$
    (r"Thus $\boxed{7}$ and \[\boxed{7}\] and \(\boxed{7}\) and $$\boxed{7}$$ end", False,
     ("", "Thus and and and end", "7")),
    # an unclosed box (cut off at the token cap) is no answer; its tail goes and its number is masked
    (r"It is 3 \boxed{3", False, ("", f"It is {M}", None)),
    # no box: the last number is the answer the draft states, masked (a fallback; answer stays None)
    ("I got 4 apples.", False, ("", f"I got {M} apples.", None)),
    # no box, no number: nothing to mask
    ("I do not know.", False, ("", "I do not know.", None)),
    # "The final answer is …" sentence removed, the rest kept; the number after the last = is masked
    ("Add them: 5+7=12. The final answer is 12. Done.", False, ("", f"Add them: 5+7={M}. Done.", None)),
    # "Final Answer: 12" line removed
    ("Add them.\nFinal Answer: 12\nCheck: ok.", False, ("", "Add them.\nCheck: ok.", None)),
    # a "**Final Answer**" heading and the box under it both go
    ("We add 5 and 7.\n\n**Final Answer**\n\\boxed{12}", False, ("", "We add 5 and 7.", "12")),
    # "**Answer:** 12" (a bare answer line) goes as well
    ("We add 5 and 7.\n**Answer:** 12", False, ("", "We add 5 and 7.", None)),
    # a decimal inside a final-answer sentence does not end the sentence early
    ("Half is 2.5 so the final answer is 2.5 indeed. Next.", False, ("", "Next.", None)),
    # the answer masked in several places, whole tokens only (40, 4.5, x4 stay)
    (r"4 apples, 4 pears: 4+40+4.5+x4, so 4. \boxed{4}", False,
     ("", f"{M} apples, {M} pears: {M}+40+4.5+x4, so {M}.", "4")),
    # a negative answer: -4 masked, a bare 4 is a different token and stays
    (r"We get -4 and 4 and -4. \boxed{-4}", False, ("", f"We get {M} and 4 and {M}.", "-4")),
    # an empty box masks nothing
    (r"Nothing here \boxed{}", False, ("", "Nothing here", "")),
]


# Unboxed and truncated drafts in the style SmolLM2-135M writes on the synthetic problems:
# about a fifth of its drafts have no complete box. With nothing extracted, nothing used to
# be masked, and a challenger that copied the stated number earned the conversion bonus.
UNBOXED = [
    # (draft, summary the challenger reads)
    # cut off at the token cap inside the box: the tail goes, the equation's result is masked
    ("Tom has 8 marbles and gives away 3, so he has 8 - 3 = 5 marbles left.\n\\boxed{5",
     f"Tom has 8 marbles and gives away 3, so he has 8 - 3 = {M} marbles left."),
    # cut off right after the box opened: the number after the last = is still the answer
    ("Mia starts with 6 apples and buys 4 more: 6 + 4 = 10. \\boxed{", f"Mia starts with 6 apples and buys 4 more: 6 + 4 = {M}."),
    # no box at all, answer stated in prose after the last =
    ("Sam had 9 pens. He lost 2. 9 - 2 = 7. Sam has 7 pens now.", f"Sam had 9 pens. He lost 2. 9 - 2 = {M}. Sam has {M} pens now."),
    # no =: the last number is the stated answer
    ("Lily has 4 cats and 3 dogs, that is 7 pets", f"Lily has 4 cats and 3 dogs, that is {M} pets"),
    # a number after the last = that is glued to a word stays (whole tokens only)
    ("So 5 + 5 = 10 and 10apples.", f"So 5 + 5 = {M} and 10apples."),
    # a negative result after the last =
    ("2 - 5 = -3, below zero", f"2 - 5 = {M}, below zero"),
    # a complete box earlier and an unclosed one later: the box's answer is masked, the tail dropped
    ("First 2 + 2 = \\boxed{4}. Wait, 2 + 3 = \\boxed{5", "First 2 + 2 = . Wait, 2 + 3 ="),
]


@pytest.mark.parametrize("draft,summary", UNBOXED)
def test_unboxed_drafts_do_not_leak(draft, summary):
    think, got, answer = split_completion(draft, thinking=False)
    assert answer == last_boxed(draft)  # grading still needs a complete box
    assert got == summary


# ``summary_mask: derived``: wrong SmolLM2-135M drafts of the gate (2026-12-06) that reached the gold on
# the way; the answer mask alone leaves the gold (6, 8) in their summaries, this one does not.
DERIVED = [
    # (question, summary after the answer mask, summary the challenger reads)
    ("Nora has 10 pencils. Nora uses 4 pencils for a school project. How many pencils does Nora have at the end?",
     f"she has 10 - 4 = 6 pencils remaining at the end. So, Nora has 10 + 6 = {M} pencils.",
     f"she has 10 - 4 = {M} pencils remaining at the end. So, Nora has 10 + {M} = {M} pencils."),
    ("Kwame has 3 marbles. Later he gets 5 more marbles. How many marbles does Kwame have at the end?",
     f"we know that 3 + 5 = 8 marbles. So Kwame had 3 - 5 = {M} marble left.",
     f"we know that 3 + 5 = {M} marbles. So Kwame had 3 - 5 = {M} marble left."),
    # the question's numbers stay, signed or not; decimals, fractions and numbers glued to words as whole tokens
    ("Ann has 2.5 kg and 12 bags.", "2.5 + 12 = 14.5 kg, -12 is 1/2 of 3x and 12th",
     f"2.5 + 12 = {M} kg, -12 is {M} of 3x and 12th"),
    # nothing derived: unchanged
    ("Tom has 6 cards and gives 2 away.", "Tom gives away 2 of his 6 cards.", "Tom gives away 2 of his 6 cards."),
]


@pytest.mark.parametrize("question,summary,masked", DERIVED)
def test_mask_derived_numbers_keeps_only_the_questions_numbers(question, summary, masked):
    assert mask_derived_numbers(summary, question) == masked


# ``summary_mask: stated``: the same, and each of the question's numbers kept no more often than the
# question states it (its first uses), so a result equal to one of them is masked too (a logged training
# leak's question, gold 1).
STATED = [
    ("Mia has 2 eggs. Mia uses 1 egg. How many eggs does Mia have left?",
     f"Mia has 2 eggs and uses 1 egg, so 2 - 1 = 1 egg is left, and {M}.",
     f"Mia has 2 eggs and uses 1 egg, so {M} - {M} = {M} egg is left, and {M}."),
    # a derived number is masked as by ``derived``; a question stating a number twice keeps two of its uses
    ("Nora has 10 pencils and uses 4, then 4 more.", "10 - 4 - 4 = 2, not 4",
     f"10 - 4 - 4 = {M}, not {M}"),
    # a number glued to a word in the question is not stated as a whole token: no use of it kept
    ("A 3x3 grid has 9 cells.", "3 rows of 3 make 9", f"{M} rows of {M} make 9"),
    # signed uses count against the unsigned number
    ("Tom has 6 cards and gives 2 away.", "Tom gives away 2 of his 6 cards: 6 - 2 = -2?",
     f"Tom gives away 2 of his 6 cards: {M} - {M} = {M}?"),
]


@pytest.mark.parametrize("question,summary,masked", STATED)
def test_stated_mask_keeps_each_question_number_no_more_often_than_the_question(question, summary, masked):
    got = mask_derived_numbers(summary, question, capped=True)
    assert got == masked
    # what the leak check counts: no unsigned number, the gold included, stated more often than the question
    for gold in {*re.findall(r"\d+", summary)}:
        assert not leaks(got, gold, question), gold


def test_unclosed_box_after_think_is_stripped():
    # a thinking model that closed </think> and was cut off inside its box
    text = "<think>6*7 is 42</think>So 6 * 7 = 42, the answer is \\boxed{42"
    assert split_completion(text, thinking=True) == ("6*7 is 42", f"So 6 * 7 = {M}, the answer is", None)


@pytest.mark.parametrize("text,thinking,expected", SPLIT)
def test_split_completion_table(text, thinking, expected):
    assert tuple(split_completion(text, thinking=thinking)) == expected


def test_extract_summary_is_the_split_summary():
    text = r"<think>hmm</think>So 2+2=4. \boxed{4}"
    assert extract_summary(text) == split_completion(text).summary == f"So 2+2={M}."
    assert extract_summary(text, thinking=False) == f"<think>hmm</think>So 2+2={M}."


@pytest.mark.parametrize(
    "text,summary",
    [
        # Only delimiters *emptied by box removal* may go. Two adjacent inline formulas
        # must not be merged ("$x=1$ $y=2$" -> "$x=1y=2$"), and display math keeps its $$.
        (r"Take $x=1$ $y=2$ and $$z^2 = 9$$ then \boxed{3}", "Take $x=1$ $y=2$ and $$z^2 = 9$$ then"),
        # a box *between* two formulas: the closing $ before it and the opening $ after it
        # are not a pair around it
        (r"We have $a=1$ \boxed{2} $b=3$.", "We have $a=1$ $b=3$."),
        # the same with \( \): closing then opening, not a pair
        (r"We have \(a=1\) \boxed{2} \(b=3\).", r"We have \(a=1\) \(b=3\)."),
        # a box that shares its delimiters with other math leaves them (and their content)
        (r"So $x = \boxed{5}$.", "So $x = $."),
    ],
)
def test_math_delimiters_away_from_boxes_are_kept(text, summary):
    assert extract_summary(text, thinking=False) == summary


# --- mask_answer ---------------------------------------------------------------------------

MASKS = [
    # (text, answer, masked)
    # whole-token: the equation's result is masked ...
    ("2+2=4", "4", f"2+2={M}"),
    # ... a longer number containing it is not
    ("40", "4", "40"),
    # a decimal continuing it is not
    ("4.5", "4", "4.5"),
    # a sentence-final period does not protect it
    ("it is 4.", "4", f"it is {M}."),
    # a letter or digit glued to it protects it, on either side
    ("x4 4x 14", "4", "x4 4x 14"),
    # a decimal point before it: 0.4 is not 4
    ("0.4", "4", "0.4"),
    # several occurrences, all masked
    ("4, 4 and 4", "4", f"{M}, {M} and {M}"),
    # a decimal answer: 2.5 masked, 12.5 and 2.55 are other numbers
    ("2.5 12.5 2.55", "2.5", f"{M} 12.5 2.55"),
    # LaTeX answers are matched literally (regex characters escaped)
    (r"x=\frac{1}{2} and \frac{1}{2}.", r"\frac{1}{2}", f"x={M} and {M}."),
    # brackets and parentheses in the answer
    ("the pair (1, 2) and [1, 2]", "(1, 2)", f"the pair {M} and [1, 2]"),
    # answer None or blank: nothing to mask
    ("2+2=4", None, "2+2=4"),
    ("2+2=4", "  ", "2+2=4"),
    # the answer is stripped before matching
    ("2+2=4", " 4 ", f"2+2={M}"),
]


@pytest.mark.parametrize("text,answer,expected", MASKS)
def test_mask_answer_table(text, answer, expected):
    assert mask_answer(text, answer) == expected


# --- code tasks and odd inputs --------------------------------------------------------------

CODE = [
    # (text, thinking, (think, summary, answer))
    # the last fenced block is the answer; the summary keeps the explanation and earlier blocks
    ("Read n, print n+1.\n```python\nprint(1)\n```\nBetter:\n```python\nprint(int(input())+1)\n```\nDone.",
     False, ("", "Read n, print n+1.\n```python\nprint(1)\n```\nBetter:\n\nDone.", "print(int(input())+1)\n")),
    # no fenced block: no answer, the whole text is the summary
    ("I would loop over the input.", False, ("", "I would loop over the input.", None)),
    # an unclosed (truncated) block is no answer
    ("Plan.\n```python\nprint(1)", False, ("", "Plan.\n```python\nprint(1)", None)),
    # thinking: the block must come after </think>
    ("<think>```python\nprint(0)\n```</think>Use a sum.\n```python\nprint(sum([1]))\n```", True,
     ("```python\nprint(0)\n```", "Use a sum.", "print(sum([1]))\n")),
    # an unclosed <think>: nothing, even with a code block inside
    ("<think>```python\nprint(0)\n```", True, ("```python\nprint(0)\n```", "", None)),
]


@pytest.mark.parametrize("text,thinking,expected", CODE)
def test_code_split_table(text, thinking, expected):
    assert tuple(split_completion(text, thinking=thinking, task="code")) == expected


@pytest.mark.parametrize(
    "value,thinking,expected",
    [
        # None is an empty completion
        (None, True, ("", "", None)),
        (None, False, ("", "", None)),
        # a number is read as its text (and, unboxed, masked as the answer it states)
        (123, False, ("", M, None)),
        # a number with thinking=True has no </think>: a format failure
        (123, True, ("123", "", None)),
    ],
)
def test_non_str_input(value, thinking, expected):
    assert tuple(split_completion(value, thinking=thinking)) == expected


def test_unknown_task_is_an_error():
    with pytest.raises(ValueError, match="task must be 'math' or 'code'"):
        split_completion("text \\boxed{1}", thinking=False, task="prose")


def test_summary_of_a_long_line_is_fast():
    # A final text of ~12k characters without sentence breaks (a degenerate RL sample,
    # ~3k tokens: the paper's final-stage length) must not take seconds. A linear
    # parse takes milliseconds; 2 s leaves a wide margin on a loaded machine.
    text = "word " * 2_400 + r"\boxed{4}"
    start = time.perf_counter()
    summary = extract_summary(text, thinking=False)
    elapsed = time.perf_counter() - start
    assert summary.startswith("word word")
    assert elapsed < 2.0, f"extract_summary took {elapsed:.1f} s on a {len(text)}-character line"
