r"""Parsing completions: the think / summary / answer split of DESIGN.md §2 step 3.

A completion of a thinking model looks like ``<think> ... </think> final text``.
Everything is graded on the *final text* (after the last ``</think>``), the
answer is the content of its last ``\boxed{...}``, and the challenger sees only
the *summary*: the final text with every box and every "final answer" statement
removed, and every whole-token occurrence of the extracted answer masked.

Worked example::

    >>> think, summary, answer = split_completion(
    ...     "<think>2+2 is 4, surely.</think>We add: 2+2=4. The final answer is $\\boxed{4}$.")
    >>> think, answer
    ('2+2 is 4, surely.', '4')
    >>> summary
    'We add: 2+2=[…].'

A thinking model that never closes ``</think>`` (truncated) has no final text:
its summary is empty and its answer is ``None``. A non-thinking model's final
text is the whole completion.

A draft without a complete box (unboxed, or cut off inside ``\\boxed{…``) has
no answer to grade, but it still states one: the unclosed box tail is dropped
and a *fallback* answer — the number after the last ``=``, else the last
number — is masked, so the challenger cannot copy it (DESIGN.md §2 step 3)::

    >>> split_completion("She has 5+2=7 apples, so \\boxed{7", thinking=False)
    Split(think='', summary='She has 5+2=[…] apples, so', answer=None)

For code tasks (``task="code"``) the "answer" is the last fenced code block and
the summary is the final text without that block (the explanation only).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import NamedTuple

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MASK = "[…]"

_BRACE_RE = re.compile(r"\\(?:boxed|fbox)\s*\{|\{|\}")
# A sentence that states the final answer is removed whole (found sentence by
# sentence: linear time). A period followed by a non-space (``2.5``) does not
# end a sentence.
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
_FINAL_ANSWER = re.compile(r"\bfinal\s+answer\b", re.IGNORECASE)
_ANSWER_LABEL = re.compile(r"\s*[>*#_]*\s*answer[ \t*_]*:", re.IGNORECASE)
# Math delimiters a removed box can leave empty around itself.
_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


class Split(NamedTuple):
    think: str
    summary: str
    answer: str | None


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """Every outermost complete ``\\boxed{...}`` as ``(start, end, content)``, braces balanced.

    One left-to-right pass (linear even for adversarial nesting).

    >>> _boxes(r"a \\boxed{\\frac{1}{2}} b \\boxed{3")  # the second never closes
    [(2, 21, '\\\\frac{1}{2}')]
    """
    return _scan_boxes(text)[0]


def _unclosed_box(text: str) -> int | None:
    """Where the first box that never closes starts (a draft cut off inside ``\\boxed{…``), else ``None``.

    >>> _unclosed_box(r"\\boxed{1} so \\boxed{2")
    13
    """
    unclosed = _scan_boxes(text)[1]
    return unclosed[0] if unclosed else None


def _scan_boxes(text: str) -> tuple[list[tuple[int, int, str]], list[int]]:
    """``(outermost complete boxes, starts of boxes still open at the end)``."""
    found, open_boxes, depth = [], [], 0  # open_boxes: (start, content_start, depth outside)
    for m in _BRACE_RE.finditer(text):
        token = m.group()
        if token == "}":
            if depth == 0:
                continue  # a stray closing brace outside any group
            depth -= 1
            if open_boxes and open_boxes[-1][2] == depth:
                start, content_start, _ = open_boxes.pop()
                found.append((start, m.end(), text[content_start : m.start()]))
        else:
            if token != "{":
                open_boxes.append((m.start(), m.end(), depth))
            depth += 1
    found.sort()
    # A box nested inside another is part of the outer one, not a box of its own.
    outer: list[tuple[int, int, str]] = []
    for box in found:
        if not outer or box[0] >= outer[-1][1]:
            outer.append(box)
    return outer, [start for start, _, _ in open_boxes]


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{}``, stripped; ``None`` if there is none.

    >>> last_boxed(r"\\boxed{1} then \\boxed{ x^{2} }")
    'x^{2}'
    """
    boxes = _boxes(text)
    return boxes[-1][2].strip() if boxes else None


def final_text(text: str, thinking: bool = True) -> str | None:
    """The text after the last ``</think>``; ``None`` if a thinking model never closed it.

    >>> final_text("<think>hmm</think> 42"), final_text("<think>hmm ..."), final_text("42", thinking=False)
    (' 42', None, '42')
    """
    if not thinking:
        return text
    cut = text.rfind(THINK_CLOSE)
    return None if cut < 0 else text[cut + len(THINK_CLOSE) :]


def _think_part(text: str, thinking: bool) -> str:
    if not thinking:
        return ""
    cut = text.rfind(THINK_CLOSE)
    think = text if cut < 0 else text[:cut]
    think = think.strip()
    return think[len(THINK_OPEN) :].strip() if think.startswith(THINK_OPEN) else think


def remove_boxes(text: str) -> str:
    """Drop every complete box, and the math delimiters around it if it filled them alone.

    >>> remove_boxes(r"So $x=2$ and $\\boxed{4}$.")
    'So $x=2$ and .'
    """
    for start, end, _ in reversed(_boxes(text)):
        before, after = text[:start], text[end:]
        # A ``$`` before the box opens a span only if an odd number of them precede it.
        inside_dollars = before.replace("$$", "").count("$") % 2 == 1
        inside_double = before.count("$$") % 2 == 1
        for left, right in _DELIMITERS:
            if (left == "$" and not inside_dollars) or (left == "$$" and not inside_double):
                continue
            if before.rstrip().endswith(left) and after.lstrip().startswith(right):
                before = before.rstrip()[: -len(left)]
                after = after.lstrip()[len(right) :]
                break
        text = before + after
    return text


def remove_final_answer_statements(text: str) -> str:
    """Drop each sentence or line that states the final answer ("The final answer is …", "Answer: …").

    >>> remove_final_answer_statements("We add 2 and 2. The final answer is 4. Done")
    'We add 2 and 2. Done'
    """
    kept, pos = [], 0
    for m in [*_SENTENCE_END.finditer(text), None]:
        end = len(text) if m is None else m.end()
        if end <= pos and m is not None:
            continue
        sentence = text[pos:end]
        if _FINAL_ANSWER.search(sentence) or _ANSWER_LABEL.match(sentence):
            if sentence.endswith("\n") and kept and not kept[-1].endswith("\n"):
                kept.append("\n")  # the line break the dropped line ended with
        else:
            kept.append(sentence)
        pos = end
    return "".join(kept)


# A whole token: not touching a letter, digit, underscore, or a decimal point that continues a number.
_TOKEN_START, _TOKEN_END = r"(?<![\w.])", r"(?![\w]|\.\d)"


# English number words, 0-999 ("seven", "Twenty-one", "one hundred and five"): a model that writes its
# result in words states it as surely as in digits. Longest alternatives first, so "seventeen" is not "seven".
_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
          "sixteen seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_BELOW_100 = (rf"(?:(?:{'|'.join(_TENS)})(?:[- ](?:{'|'.join(_UNITS[9:0:-1])}))?"
              rf"|{'|'.join(sorted(_UNITS, key=len, reverse=True))})")
_NUMBER_WORD = re.compile(rf"\b(?:(?:{'|'.join(_UNITS[9:0:-1])}) hundred(?:(?: and)? {_BELOW_100})?|{_BELOW_100})\b",
                          re.IGNORECASE)


def number_word_value(words: str) -> int | None:
    """The value of an English number word or phrase, or ``None``.

    >>> number_word_value("Seven"), number_word_value("twenty-one"), number_word_value("one hundred and five")
    (7, 21, 105)
    """
    if not _NUMBER_WORD.fullmatch(words.strip()):
        return None
    total = 0
    for word in re.split(r"[- ]+", words.strip().lower()):
        if word == "hundred":
            total *= 100
        elif word in _UNITS:
            total += _UNITS.index(word)
        elif word in _TENS:
            total += 20 + 10 * _TENS.index(word)
    return total


def mask_answer(text: str, answer: str | None) -> str:
    """Mask whole-token occurrences of ``answer``: ``2+2=4`` → ``2+2=[…]``, ``40`` stays.

    A match may not touch a letter, digit, underscore or a decimal point that
    continues a number, so ``4`` is masked in ``is 4.`` but not in ``4.5`` or ``x4``.
    A whole-number answer is masked in words too (``seven``, ``Twenty-one``).

    >>> mask_answer("There are seven marbles, 7 in all", "7")
    'There are […] marbles, […] in all'
    """
    answer = (answer or "").strip()
    if not answer:
        return text
    text = re.sub(_TOKEN_START + re.escape(answer) + _TOKEN_END, MASK, text)
    if answer.isdigit():
        text = _NUMBER_WORD.sub(lambda m: MASK if number_word_value(m.group()) == int(answer) else m.group(), text)
    return text


_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:/\d+)?")


def fallback_answer(text: str) -> str | None:
    """The answer an unboxed draft states: the number after the last ``=``, else the last number.

    >>> fallback_answer("3 + 4 = 7, so she has 7 left"), fallback_answer("she has 9 - 2"), fallback_answer("no idea")
    ('7', '2', None)
    """
    after_equals = _NUMBER.search(text, text.rfind("=") + 1) if "=" in text else None
    if after_equals is not None:
        return after_equals.group()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


_WHOLE_NUMBER = re.compile(_TOKEN_START + _NUMBER.pattern + _TOKEN_END)
# A number as the derived masks read it: in digits, or in words (counted as its digits).
_ANY_NUMBER = re.compile(f"{_WHOLE_NUMBER.pattern}|{_NUMBER_WORD.pattern}", re.IGNORECASE)


def _number_key(token: str) -> str:
    """``"-5"`` → ``"5"``, ``"Seven"`` → ``"7"``: digits and words of one value count as one number."""
    value = number_word_value(token)
    return str(value) if value is not None else token.lstrip("-")


def mask_derived_numbers(summary: str, question: str, capped: bool = False) -> str:
    """Mask every whole-token number of ``summary`` that ``question`` does not state (``summary_mask: derived``).

    What is left is the draft's method over the question's own numbers: a wrong draft that reached the
    gold on the way (``10 - 4 = 6 … 10 + 6 = 16``) can no longer hand it to the challenger. Numbers in
    words count as their digits, in the summary and in the question (``seven`` is ``7``).

    ``capped`` (``summary_mask: stated``) also keeps each of the question's numbers at most as often as the
    question states it as a whole token (the first occurrences), so a result that happens to equal one of
    them (``has 2 eggs, uses 1 … 2 - 1 = 1``) is masked too: the summary can state no non-negative number
    more often than the question does. (A signed use counts against the unsigned number, so a negative
    gold can still show: ``-5`` where the question says ``5``; experiments/LOG.md, 2026-12-07.)

    >>> mask_derived_numbers("She has 10 - 4 = 6, then 6 + 10 = 16 pens.", "Nora has 10 pens and uses 4.")
    'She has 10 - 4 = […], then […] + 10 = […] pens.'
    >>> mask_derived_numbers("2 - 1 = 1 egg left", "Mia has 2 eggs and uses 1.", capped=True)
    '2 - 1 = […] egg left'
    >>> mask_derived_numbers("Ten minus three leaves seven.", "Ana has 10 pens and loses 3.")
    'Ten minus three leaves […].'
    """
    if capped:
        left = Counter(_number_key(n) for n in _ANY_NUMBER.findall(question))
    else:
        stated = _NUMBER.findall(question) + _NUMBER_WORD.findall(question)
        left = Counter({_number_key(n): math.inf for n in stated})

    def keep(m: re.Match) -> str:
        number = _number_key(m.group())
        if left[number] <= 0:
            return MASK
        left[number] -= 1
        return m.group()

    return _ANY_NUMBER.sub(keep, summary)


def _tidy(text: str) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines()]
    out: list[str] = []
    for line in lines:  # collapse runs of blank lines left by removals
        if line or (out and out[-1]):
            out.append(line)
    return re.sub(r"[ \t]{2,}", " ", "\n".join(out)).strip()


def last_code_block(text: str) -> str | None:
    """The body of the last fenced code block (```` ```python ... ``` ````), or ``None``."""
    blocks = _FENCE_RE.findall(text)
    return blocks[-1][1] if blocks else None


def split_completion(text: str, thinking: bool = True, task: str = "math") -> Split:
    """Split a completion into ``(think, summary, answer)`` (DESIGN.md §2 step 3).

    ``task="math"``: answer = last ``\\boxed{}`` of the final text; summary = final
    text without boxes and final-answer statements, answer occurrences masked.
    ``task="code"``: answer = the last fenced code block; summary = final text
    without that block.
    """
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    if task not in ("math", "code"):
        raise ValueError(f"task must be 'math' or 'code', got {task!r}")
    think = _think_part(text, thinking)
    final = final_text(text, thinking)
    if final is None:  # truncated inside <think>: a format failure, nothing to show
        return Split(think, "", None)
    if task == "code":
        matches = list(_FENCE_RE.finditer(final))
        if not matches:
            return Split(think, _tidy(final), None)
        last = matches[-1]
        return Split(think, _tidy(final[: last.start()] + final[last.end() :]), last.group(2))
    answer = last_boxed(final)
    # An unboxed draft still states its answer in prose (or inside the box it never closed):
    # read a fallback from the text, box tail included, then drop that tail.
    stated = answer if answer is not None else fallback_answer(final)
    cut = _unclosed_box(final)
    if cut is not None:
        final = final[:cut]
    summary = remove_final_answer_statements(remove_boxes(final))
    return Split(think, _tidy(mask_answer(summary, stated)), answer)


def extract_summary(text: str, thinking: bool = True, task: str = "math") -> str:
    """The challenger's view of a draft: ``split_completion(text, thinking).summary``."""
    return split_completion(text, thinking, task).summary
