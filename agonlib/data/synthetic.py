"""Offline synthetic arithmetic word problems (the ``cpu`` and ``smoke`` data).

Each problem is built from a small structured form — a starting quantity and
a list of operations — and then told as a story::

    start = ["count", 7]            ops = [["add", 5]]
    "Tom has 7 apples. He buys 5 more apples. How many apples does Tom have now?"  -> "12"

Difficulty levels grade the number of steps and the size of the numbers:

=====  =====  =================================  ===========
level  steps  operations                         numbers up to
=====  =====  =================================  ===========
1      1      add, subtract                      10
2      2      add, subtract                      20
3      2      + multiply / divide, grouped start 50
4      3      any                                100
5      4      any                                300
=====  =====  =================================  ===========

Every answer is an exact non-negative integer (subtraction never goes below
zero and division always divides evenly). Names, objects and phrasings are
drawn from lists, so a small model cannot learn one sentence shape.

Randomness is explicit: problem ``i`` of a stream comes from its own
``random.Random`` seeded by ``(stream, seed, level, i)``, never from the global RNG,
so a list of ``n`` problems is a prefix of a list of ``n + k`` problems.
Rows carry their structured form under ``"work"`` so tests (and anyone
auditing a problem) can recompute the answer with :func:`solve`.
"""

from __future__ import annotations

import random
from typing import Iterable

SOURCE = "synthetic"
LEVELS = (1, 2, 3, 4, 5)

# level -> (steps, allowed ops, max number)
_LEVEL_SPEC = {
    1: (1, ("add", "sub"), 10),
    2: (2, ("add", "sub"), 20),
    3: (2, ("add", "sub", "mul", "div"), 50),
    4: (3, ("add", "sub", "mul", "div"), 100),
    5: (4, ("add", "sub", "mul", "div"), 300),
}

# (name, subject pronoun, object pronoun)
_PEOPLE = [
    ("Tom", "he", "him"), ("Mia", "she", "her"), ("Ravi", "he", "him"), ("Lena", "she", "her"),
    ("Omar", "he", "him"), ("Aiko", "she", "her"), ("Jonas", "he", "him"), ("Priya", "she", "her"),
    ("Diego", "he", "him"), ("Sofia", "she", "her"), ("Kwame", "he", "him"), ("Nora", "she", "her"),
    ("Felix", "he", "him"), ("Yara", "she", "her"), ("Sam", "they", "them"), ("Alex", "they", "them"),
]
_FRIENDS = ["a friend", "a neighbour", "the teacher", "a cousin", "the coach", "a classmate"]

# (singular, plural, verb for getting more (base form), container for grouped starts)
_THINGS = [
    ("apple", "apples", "buy", "basket"), ("marble", "marbles", "win", "bag"),
    ("stamp", "stamps", "collect", "album page"), ("pencil", "pencils", "buy", "box"),
    ("cookie", "cookies", "bake", "tray"), ("sticker", "stickers", "get", "sheet"),
    ("shell", "shells", "find", "bucket"), ("book", "books", "borrow", "shelf"),
    ("coin", "coins", "save", "jar"), ("flower", "flowers", "pick", "vase"),
    ("card", "cards", "trade for", "deck"), ("egg", "eggs", "collect", "carton"),
    ("balloon", "balloons", "blow up", "pack"), ("toy car", "toy cars", "buy", "crate"),
]
_REFLEXIVE = {"he": "himself", "she": "herself", "they": "themselves"}
_POSSESSIVE = {"he": "his", "she": "her", "they": "their"}


def solve(work: dict) -> int:
    """Recompute the answer of a problem from its structured form.

    >>> solve({"start": ["count", 7], "ops": [["add", 5], ["mul", 2]]})
    24
    >>> solve({"start": ["groups", 3, 4], "ops": [["sub", 2]]})
    10
    """
    start = work["start"]
    value = start[1] * start[2] if start[0] == "groups" else start[1]
    for op, k in work["ops"]:
        if op == "add":
            value += k
        elif op == "sub":
            value -= k
        elif op == "mul":
            value *= k
        elif op == "div":
            if value % k:
                raise ValueError(f"{value} is not divisible by {k}")
            value //= k
        else:
            raise ValueError(f"unknown operation {op!r}")
        if value < 0:
            raise ValueError("a synthetic problem went below zero")
    return value


def _count(n: int, thing: tuple, more: bool = False) -> str:
    """``5 apples``, ``1 apple``, ``5 more apples``."""
    return f"{n} {'more ' if more else ''}{thing[0] if n == 1 else thing[1]}"


def _verb(base: str, pronoun: str) -> str:
    """Present tense for a pronoun: ``buy`` -> ``buys``, ``blow up`` -> ``blows up``."""
    if pronoun == "they":
        return base
    head, _, rest = base.partition(" ")
    return f"{head}s {rest}".rstrip()


def _pick_op(rng: random.Random, ops: tuple, value: int, top: int) -> tuple[str, int]:
    """Choose an operation that keeps the answer a non-negative integer <= top."""
    choices = list(ops)
    rng.shuffle(choices)
    for op in choices:
        if op == "add" and value < top:
            return op, rng.randint(1, min(top - value, max(2, top // 2)))
        if op == "sub" and value >= 1:
            return op, rng.randint(1, value)
        if op == "mul" and 2 <= value <= top // 2:
            return op, rng.randint(2, min(5, top // value))
        if op == "div" and value >= 4:
            divisors = [d for d in range(2, 10) if value % d == 0 and value // d >= 1]
            if divisors:
                return op, rng.choice(divisors)
    return "add", rng.randint(1, max(1, top // 4))


def _times(k: int) -> str:
    return {2: "twice", 3: "three times"}.get(k, f"{k} times")


def _story(op: str, k: int, who: tuple, thing: tuple, rng: random.Random) -> str:
    name, he, him = who
    He, v = he.capitalize(), (lambda base: _verb(base, he))
    friend = rng.choice(_FRIENDS)
    phrasings = {
        "add": [
            f"{He} {v(thing[2])} {_count(k, thing, more=True)}.",
            f"Then {friend} gives {him} {_count(k, thing)}.",
            f"Later {he} {v('get')} {_count(k, thing, more=True)}.",
        ],
        "sub": [
            f"{He} {v('give')} {_count(k, thing)} to {friend}.",
            f"Then {he} {v('lose')} {_count(k, thing)}.",
            f"{name} uses {_count(k, thing)} for a school project.",
        ],
        "mul": [
            f"Then the number of {thing[1]} {he} {'have' if he == 'they' else 'has'} becomes {_times(k)} as large.",
            f"{He} {v('end')} up with {_times(k)} as many {thing[1]} as before.",
        ],
        "div": [
            f"{He} {v('split')} the {thing[1]} into {k} equal groups and {v('keep')} one group.",
            f"{He} {v('share')} the {thing[1]} equally among {k} children, including {_REFLEXIVE[he]}, "
            f"and {v('keep')} {_POSSESSIVE[he]} share.",
        ],
    }
    return rng.choice(phrasings[op])


def _question(level: int, rng: random.Random) -> tuple[str, dict]:
    steps, ops, top = _LEVEL_SPEC[level]
    who, thing = rng.choice(_PEOPLE), rng.choice(_THINGS)
    name = who[0]
    if level >= 3 and rng.random() < 0.5:
        groups, each = rng.randint(2, 6), rng.randint(2, max(2, top // 10))
        start = ["groups", groups, each]
        opening = f"{name} has {groups} {thing[3]}s with {_count(each, thing)} in each."
    else:
        start = ["count", rng.randint(2, top)]
        opening = f"{name} has {_count(start[1], thing)}."
    value = solve({"start": start, "ops": []})
    sentences, work_ops = [opening], []
    # from level 3 on, one step (at a random place) is a multiplication or division
    forced = rng.randrange(steps) if level >= 3 else -1
    for step in range(steps):
        op, k = _pick_op(rng, ("mul", "div") if step == forced else ops, value, top)
        work_ops.append([op, k])
        value = solve({"start": ["count", value], "ops": [[op, k]]})
        sentences.append(_story(op, k, who, thing, rng))
    ending = rng.choice([
        f"How many {thing[1]} does {name} have now?",
        f"How many {thing[1]} does {name} have at the end?",
        f"What is the number of {thing[1]} {name} has in the end?",
    ])
    return " ".join(sentences + [ending]), {"start": start, "ops": work_ops}


def synthetic_problems(n: int, levels: Iterable[int] = (1, 2), seed: int = 0, stream: str = "train") -> list[dict]:
    """``n`` distinct problems, levels taken round-robin from ``levels``.

    Deterministic in ``(n, levels, seed, stream)`` and independent of the
    global RNG; duplicate question texts are skipped (the next index is used),
    so the questions in one list are unique. Ids look like
    ``syn-train-L2-0-17`` (stream, level, seed, index).

    >>> rows = synthetic_problems(2, levels=(1,), seed=0)
    >>> sorted(rows[0])
    ['answer', 'difficulty', 'id', 'question', 'source', 'work']
    >>> rows[0]["answer"] == str(solve(rows[0]["work"]))
    True
    """
    levels = tuple(levels)
    bad = [lv for lv in levels if lv not in _LEVEL_SPEC]
    if not levels or bad:
        raise ValueError(f"synthetic levels must be a non-empty subset of {LEVELS}, got {levels}.")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}.")
    rows, seen, i = [], set(), 0
    while len(rows) < n:
        level = levels[i % len(levels)]
        rng = random.Random(f"agon-synthetic/{stream}/{seed}/L{level}/{i}")
        question, work = _question(level, rng)
        if question not in seen:
            seen.add(question)
            rows.append({"id": f"syn-{stream}-L{level}-{seed}-{i}", "question": question,
                         "answer": str(solve(work)), "difficulty": level, "source": SOURCE, "work": work})
        i += 1
        if i > 50 * n + 1000:
            raise RuntimeError(f"could not find {n} distinct synthetic problems for levels {levels}.")
    return rows


def synthetic_split(n_train: int, n_test: int, levels: Iterable[int] = (1, 2),
                    seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and test problems, disjoint by question text.

    The test set is the first ``n_test`` problems of the ``test`` stream; the
    train set is drawn from the ``train`` stream with any test question
    skipped. A test set of ``n_test`` is a prefix of a larger one, so a train
    set built against ``test_size=T`` is also disjoint from any smaller test set.
    """
    test = synthetic_problems(n_test, levels, seed, stream="test")
    held_out = {row["question"] for row in test}
    train, extra = [], 0
    while len(train) < n_train:
        pool = synthetic_problems(n_train + extra, levels, seed, stream="train")
        train = [row for row in pool if row["question"] not in held_out][:n_train]
        extra += max(8, n_train - len(train))
    return train, test
