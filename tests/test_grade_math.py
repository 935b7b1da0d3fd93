"""The math grader: a table of answers, bad inputs, and an adversarial battery.

The table pins math-verify 0.9's judgement through ``grade_math`` (worker pool
included); the battery feeds inputs that hang or blow up sympy and checks that
each returns 0 within its timeout plus a second, and that the pool still grades
a normal answer afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from agonlib.grading import math_grader as verify
from agonlib.grading.math_grader import STATS, grade_math, grade_math_batch, score_math


def box(answer: str) -> str:
    return "<think>working...</think> So the answer is $\\boxed{%s}$." % answer


# (completion, gold, thinking, expected)
CASES = [
    # equivalent forms of one half
    (box("0.5"), "\\frac{1}{2}", True, 1),
    (box("\\frac{1}{2}"), "0.5", True, 1),
    (box("1/2"), "\\frac12", True, 1),
    # fractions: \dfrac, unreduced, a close-but-wrong decimal, a negative fraction
    (box("\\dfrac{3}{4}"), "0.75", True, 1),
    (box("\\frac{2}{4}"), "\\frac{1}{2}", True, 1),
    (box("0.33"), "\\frac{1}{3}", True, 0),
    (box("-\\frac{1}{2}"), "-0.5", True, 1),
    # intervals: same, different endpoint type, unbounded
    (box("(1,2]"), "(1,2]", True, 1),
    (box("[1,2]"), "(1,2]", True, 0),
    (box("(-\\infty, 3)"), "(-\\infty,3)", True, 1),
    # sets: order does not matter, a missing element does; a bare list vs a set
    (box("\\{1,2,3\\}"), "\\{3,2,1\\}", True, 1),
    (box("\\{1,2\\}"), "\\{1,2,3\\}", True, 0),
    (box("2, 3"), "\\{2,3\\}", True, 1),
    # units and text around numbers are dropped
    (box("5\\text{ cm}"), "5", True, 1),
    (box("5 cm"), "5", True, 1),
    (box("90^\\circ"), "90", True, 1),
    (box("\\$5"), "5", True, 1),
    (box("10\\%"), "10", True, 1),
    # plain wrong answers
    (box("6"), "5", True, 0),
    (box("27.5"), "27", True, 0),
    # several boxes: the last one wins, either way round
    (box("3") + " Wait, actually $\\boxed{4}$.", "4", True, 1),
    (box("4") + " Hmm, no: $\\boxed{3}$.", "4", True, 0),
    # no box at all, and an empty box
    ("<think>t</think> The answer is 4.", "4", True, 0),
    (box(""), "0", True, 0),
    # thinking models: an unclosed <think> scores 0 even with a right box inside
    ("<think>the answer is \\boxed{4}", "4", True, 0),
    # ...and only the text after the last </think> counts
    ("<think>\\boxed{4}</think> so \\boxed{5}", "4", True, 0),
    ("<think>\\boxed{5}</think> so \\boxed{4}", "4", True, 1),
    # thinking=False grades the whole text; thinking=True needs </think>
    ("The answer is \\boxed{4}", "4", False, 1),
    ("The answer is \\boxed{4}", "4", True, 0),
    ("The answer is 4", "4", False, 0),
    # text answers, case-insensitive, and a multiple-choice letter
    (box("\\text{Yes}"), "\\text{Yes}", True, 1),
    (box("yes"), "\\text{Yes}", True, 1),
    (box("\\text{(B)}"), "B", True, 1),
    # negative numbers: the sign matters
    (box("-7"), "-7", True, 1),
    (box("7"), "-7", True, 0),
    # square roots, rationalised or not
    (box("\\sqrt{2}"), "2^{1/2}", True, 1),
    (box("\\frac{\\sqrt{2}}{2}"), "\\frac{1}{\\sqrt{2}}", True, 1),
    (box("\\sqrt{3}"), "\\sqrt{2}", True, 0),
    # pi: symbolic, a multiple, and a decimal within math-verify's rounding
    (box("\\pi"), "\\pi", True, 1),
    (box("2\\pi"), "\\pi", True, 0),
    (box("3.14159265"), "\\pi", True, 1),
    # leading zeros and trailing .0
    (box("007"), "7", True, 1),
    (box("27.0"), "27", True, 1),
    # thousands separator
    (box("1,000"), "1000", True, 1),
    # algebra: an expanded square, an equation whose right side is the answer
    (box("x^2+2x+1"), "(x+1)^2", True, 1),
    (box("x=3"), "3", True, 1),
    # infinity, Euler's number, a column vector
    (box("\\infty"), "\\infty", True, 1),
    (box("e"), "e", True, 1),
    (box("\\begin{pmatrix}1\\\\2\\end{pmatrix}"), "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True, 1),
    # math-verify quirks pinned on purpose: "1e3" is not read as 1000, 1/0 is no number
    (box("1e3"), "1000", True, 0),
    (box("\\frac{1}{0}"), "1", True, 0),
    # a gold that is already boxed is not boxed twice; a numeric gold is fine
    (box("12"), "\\boxed{12}", True, 1),
    (box("12"), 12, True, 1),
]


@pytest.mark.parametrize("completion,gold,thinking,expected", CASES)
def test_grade_math_table(completion, gold, thinking, expected):
    assert grade_math(completion, gold, thinking=thinking) == expected


def test_batch_agrees_with_single_and_in_process():
    completions = [c for c, *_ in CASES]
    golds = [g for _, g, *_ in CASES]
    thinking = [t for *_, t, _ in CASES]
    expected = [e for *_, e in CASES]
    # one batch per thinking flag, as the trainer calls it
    for flag in (True, False):
        idx = [i for i, t in enumerate(thinking) if t == flag]
        got = grade_math_batch([completions[i] for i in idx], [golds[i] for i in idx],
                               thinking=flag, workers=2)
        assert got == [expected[i] for i in idx]
    # the unsandboxed scorer (benchmark baseline) gives the same answers
    assert [score_math(c, str(g), t) for c, g, t in zip(completions, golds, thinking)] == expected


# inputs that are not strings, or make no sense: 0, never an exception
BAD_INPUTS = [
    (None, "4"),  # no completion
    (box("4"), None),  # no gold
    (123, "123"),  # a completion that is not a string
    (b"\\boxed{4}", "4"),  # bytes
    (box("4"), ""),  # an empty gold
    (box("4"), True),  # a bool gold
    (box("4"), ["4"]),  # a list gold
    ("\\boxed{" * 1000, "4"),  # a thousand unclosed boxes
    ("\x00\ud800" + box("4"), "\ud800"),  # NUL and a lone surrogate
]


@pytest.mark.parametrize("completion,gold", BAD_INPUTS)
def test_bad_inputs_score_zero(completion, gold):
    assert grade_math(completion, gold) == 0


def test_bad_arguments_do_not_raise():
    assert grade_math(box("4"), "4", timeout_s=float("nan")) == 1  # falls back to the default
    assert grade_math(box("4"), "4", timeout_s=-1) == 1
    assert grade_math_batch([], []) == []
    with pytest.raises(ValueError, match="one gold per completion"):
        grade_math_batch([box("4")], [])  # a caller bug, said plainly


def test_works_off_the_main_thread():
    # math-verify's own signal.alarm timeout raises off the main thread; ours does not
    out = []
    t = threading.Thread(target=lambda: out.append(grade_math(box("0.5"), "1/2")))
    t.start()
    t.join(30)
    assert out == [1]


# --------------------------------------------------------------------------- #
# Adversarial battery.
# --------------------------------------------------------------------------- #

TIMEOUT_S = 1.0
SLACK_S = 1.0  # "returns within timeout + 1 s"

ADVERSARIAL = [
    "\\boxed{9^{9^{9^{9}}}}",  # exponent tower: a 370-million-digit integer
    "\\boxed{10^{10^{10}}}",  # ten billion digits
    "\\boxed{(10^{10})!}",  # huge factorial
    "\\boxed{((10^{5})!)!}",  # factorial of a factorial
    "\\boxed{" + "\\frac{1}{" * 400 + "2" + "}" * 400 + "}",  # 400 nested fractions
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",  # 3000 nested parentheses
    "\\boxed{" + "+".join(["x^{%d}" % i for i in range(3000)]) + "}",  # a 3000-term polynomial
    "\\boxed{" * 30000 + "x",  # 30000 unclosed boxes: quadratic brace matching
]


@pytest.mark.parametrize("answer", ADVERSARIAL, ids=lambda a: a[:24])
def test_adversarial_math_returns_in_time(answer):
    grade_math(box("1"), "1", timeout_s=5)  # a warm pool, so only the grading is timed
    before = STATS.as_dict()
    t0 = time.monotonic()
    score = grade_math(answer, "3", thinking=False, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - t0
    print(f"\n{answer[:30]!r}: {elapsed:.2f}s, stats delta "
          f"{ {k: v - before[k] for k, v in STATS.as_dict().items()} }")
    assert score == 0
    assert elapsed < TIMEOUT_S + SLACK_S
    assert grade_math(box("\\frac{6}{4}"), "1.5", timeout_s=5) == 1  # the pool still works


def test_timeout_is_counted_and_logged(caplog):
    before = STATS.timeouts
    with caplog.at_level("WARNING", logger="agonlib.grading.math_grader"):
        assert grade_math("\\boxed{9^{9^{9^{9}}}}", "3", thinking=False, timeout_s=0.5) == 0
    assert STATS.timeouts == before + 1
    assert "timed out" in caplog.text


def test_batch_with_hangs_grades_the_rest():
    good = [box(str(i)) for i in range(6)]
    hangs = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{10^{10^{10}}}"]
    completions = hangs[:1] + good[:3] + hangs[1:] + good[3:]
    golds = ["3"] + ["0", "1", "2"] + ["3"] + ["3", "4", "5"]
    t0 = time.monotonic()
    got = grade_math_batch(completions, golds, thinking=False, timeout_s=TIMEOUT_S, workers=2)
    elapsed = time.monotonic() - t0
    # the boxes inside box() follow a </think>, so thinking=False still finds them
    assert got == [0, 1, 1, 1, 0, 1, 1, 1]
    assert elapsed < 2 * TIMEOUT_S + SLACK_S  # the two hangs at worst run one after another


def test_a_worker_killed_from_outside_is_replaced():
    grade_math(box("1"), "1")
    pool = verify._POOL
    assert pool is not None and pool.workers
    for w in list(pool.workers):  # as if the kernel's OOM killer struck
        os.kill(w.pid, signal.SIGKILL)
    time.sleep(0.2)
    before = STATS.crashes
    assert grade_math_batch([box("2"), box("3")], ["2", "4"], workers=2) == [1, 0]
    assert STATS.crashes == before  # dead idle workers are replaced before they get a job


def test_shutdown_and_restart():
    verify.shutdown()
    assert verify._POOL is None
    assert grade_math(box("2"), "2") == 1  # a new pool starts lazily


def test_missing_verifier_scores_zero_with_a_clear_error(monkeypatch, caplog):
    verify.shutdown()
    # the workers' interpreter cannot import math_verify
    monkeypatch.setattr(verify, "_BOOT", "import sys; sys.modules['math_verify'] = None; "
                        + verify._BOOT)
    before = STATS.crashes
    with caplog.at_level("ERROR", logger="agonlib.grading.math_grader"):
        assert grade_math(box("4"), "4") == 0
    assert STATS.crashes == before + 1
    assert "pip install 'math-verify" in caplog.text
    verify.shutdown()
