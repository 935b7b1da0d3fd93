"""Hand-written stdin/stdout programming problems for offline code runs.

A small, easy set written for this project: the ``smoke`` code run and the
code-grader tests use it, so nothing has to be downloaded to exercise the
code path. Each problem reads standard input and writes standard output, has
3-5 tests, and keeps a reference Python solution beside it (in
:data:`REFERENCE_SOLUTIONS`, not in the rows, so a prompt built from a row
can never show it). ``tests/test_data.py`` runs every reference solution
against its tests.

Rows have the code-row shape of :mod:`agonlib.data`::

    {"id": "hw-sum-two", "question": "...", "answer": None, "difficulty": 1,
     "source": "code_handwritten", "tests": [{"input": "3 4\\n", "output": "7\\n"}, ...]}
"""

from __future__ import annotations

import copy

SOURCE = "code_handwritten"


def _t(inp: str, out: str) -> dict:
    return {"input": inp, "output": out}


_PROBLEMS = [
    {
        "id": "hw-sum-two",
        "difficulty": 1,
        "question": "Read two integers a and b on one line, separated by a space. Print a + b.",
        "tests": [_t("3 4\n", "7\n"), _t("-5 5\n", "0\n"), _t("1000000000 1000000000\n", "2000000000\n"),
                  _t("0 0\n", "0\n")],
        "solution": "a, b = map(int, input().split())\nprint(a + b)\n",
    },
    {
        "id": "hw-reverse",
        "difficulty": 1,
        "question": "Read one line containing a word made of lowercase letters. Print the word reversed.",
        "tests": [_t("hello\n", "olleh\n"), _t("a\n", "a\n"), _t("racecar\n", "racecar\n"), _t("abc\n", "cba\n")],
        "solution": "print(input().strip()[::-1])\n",
    },
    {
        "id": "hw-vowels",
        "difficulty": 1,
        "question": ("Read one line of text. Print how many of its characters are vowels "
                     "(a, e, i, o, u, in either case)."),
        "tests": [_t("Hello World\n", "3\n"), _t("rhythm\n", "0\n"), _t("AEIOU aeiou\n", "10\n"),
                  _t("Programming is fun\n", "5\n")],
        "solution": "s = input()\nprint(sum(ch in 'aeiouAEIOU' for ch in s))\n",
    },
    {
        "id": "hw-max-list",
        "difficulty": 1,
        "question": ("The first line holds n (1 <= n <= 1000). The second line holds n integers. "
                     "Print the largest of them."),
        "tests": [_t("5\n3 9 -2 7 9\n", "9\n"), _t("1\n-4\n", "-4\n"), _t("3\n-1 -2 -3\n", "-1\n")],
        "solution": "input()\nprint(max(map(int, input().split())))\n",
    },
    {
        "id": "hw-fizzbuzz",
        "difficulty": 1,
        "question": ("Read an integer n (1 <= n <= 100). For each i from 1 to n print one line: "
                     "FizzBuzz if i is divisible by 15, Fizz if divisible by 3, Buzz if divisible by 5, "
                     "otherwise i itself."),
        "tests": [_t("5\n", "1\n2\nFizz\n4\nBuzz\n"), _t("1\n", "1\n"),
                  _t("15\n", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n")],
        "solution": ("n = int(input())\nfor i in range(1, n + 1):\n"
                     "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)\n"),
    },
    {
        "id": "hw-factorial",
        "difficulty": 1,
        "question": "Read an integer n (0 <= n <= 20). Print n! (the product 1 * 2 * ... * n; 0! = 1).",
        "tests": [_t("0\n", "1\n"), _t("5\n", "120\n"), _t("10\n", "3628800\n"), _t("20\n", "2432902008176640000\n")],
        "solution": "n = int(input())\nr = 1\nfor i in range(2, n + 1):\n    r *= i\nprint(r)\n",
    },
    {
        "id": "hw-prime",
        "difficulty": 2,
        "question": "Read an integer n (1 <= n <= 10^9). Print YES if n is prime and NO otherwise.",
        "tests": [_t("2\n", "YES\n"), _t("1\n", "NO\n"), _t("91\n", "NO\n"), _t("97\n", "YES\n"),
                  _t("1000000007\n", "YES\n")],
        "solution": ("n = int(input())\nok = n >= 2\nd = 2\nwhile ok and d * d <= n:\n"
                     "    if n % d == 0:\n        ok = False\n    d += 1\nprint('YES' if ok else 'NO')\n"),
    },
    {
        "id": "hw-digit-sum",
        "difficulty": 1,
        "question": "Read a non-negative integer n with at most 100 digits. Print the sum of its decimal digits.",
        "tests": [_t("0\n", "0\n"), _t("12345\n", "15\n"), _t("999999999999999999999\n", "189\n")],
        "solution": "print(sum(int(ch) for ch in input().strip()))\n",
    },
    {
        "id": "hw-word-count",
        "difficulty": 1,
        "question": ("Read one line of text. Print the number of words in it, where words are separated "
                     "by one or more spaces."),
        "tests": [_t("the quick brown fox\n", "4\n"), _t("   spaced    out   \n", "2\n"), _t("one\n", "1\n")],
        "solution": "print(len(input().split()))\n",
    },
    {
        "id": "hw-second-largest",
        "difficulty": 2,
        "question": ("The first line holds n (2 <= n <= 1000). The second line holds n integers, at least two of "
                     "them different. Print the second largest distinct value."),
        "tests": [_t("5\n1 3 3 2 5\n", "3\n"), _t("2\n7 -7\n", "-7\n"), _t("4\n4 4 4 1\n", "1\n")],
        "solution": "input()\nvals = sorted(set(map(int, input().split())))\nprint(vals[-2])\n",
    },
    {
        "id": "hw-gcd",
        "difficulty": 2,
        "question": "Read two positive integers a and b (up to 10^12) on one line. Print their greatest common divisor.",
        "tests": [_t("12 18\n", "6\n"), _t("7 13\n", "1\n"), _t("1000000000000 250\n", "250\n")],
        "solution": "a, b = map(int, input().split())\nwhile b:\n    a, b = b, a % b\nprint(a)\n",
    },
    {
        "id": "hw-running-total",
        "difficulty": 2,
        "question": ("The first line holds n (1 <= n <= 1000). The second line holds n integers. Print their "
                     "running totals on one line, separated by spaces."),
        "tests": [_t("4\n1 2 3 4\n", "1 3 6 10\n"), _t("1\n-5\n", "-5\n"), _t("3\n5 -5 5\n", "5 0 5\n")],
        "solution": ("input()\ntotal, out = 0, []\nfor x in map(int, input().split()):\n"
                     "    total += x\n    out.append(total)\nprint(*out)\n"),
    },
]

REFERENCE_SOLUTIONS: dict[str, str] = {p["id"]: p["solution"] for p in _PROBLEMS}


def code_problems(n: int | None = None) -> list[dict]:
    """The hand-written problems as rows (fresh copies), the first ``n`` if given.

    >>> rows = code_problems(2)
    >>> rows[0]["id"], rows[0]["answer"], rows[0]["tests"][0]
    ('hw-sum-two', None, {'input': '3 4\\n', 'output': '7\\n'})
    """
    rows = [{"id": p["id"], "question": p["question"], "answer": None, "difficulty": p["difficulty"],
             "source": SOURCE, "tests": copy.deepcopy(p["tests"])} for p in _PROBLEMS]
    return rows if n is None else rows[:n]


def reference_solution(problem_id: str) -> str:
    """The reference Python solution of a hand-written problem."""
    try:
        return REFERENCE_SOLUTIONS[problem_id]
    except KeyError:
        raise KeyError(f"No hand-written problem {problem_id!r}; known ids: {', '.join(REFERENCE_SOLUTIONS)}.") from None
