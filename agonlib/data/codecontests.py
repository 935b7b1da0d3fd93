"""CodeContests (hub ``deepmind/code_contests``), streamed, as code rows.

Kept: problems that read stdin and write stdout, have at least one test, pass
the rating/difficulty filter and (by default) have a Python 3 reference
solution, so a Python-writing policy can solve them. Each row::

    {"id": "cc-train-1548_E", "question": <description>, "answer": None,
     "difficulty": <cf_rating or None>, "source": "codecontests",
     "tests": [{"input": ..., "output": ...}, ...], "time_limit_s": 2.0}

Hub schema assumed (datasets card of ``deepmind/code_contests``): ``name``,
``description``; ``public_tests`` / ``private_tests`` / ``generated_tests``
as ``{"input": [str], "output": [str]}``; ``difficulty`` an int label
(0 UNKNOWN_DIFFICULTY, 1 EASY … 6 EXTERNAL, 7 A … 28 V, see
:data:`DIFFICULTY_NAMES`); ``solutions`` as ``{"language": [int], "solution":
[str]}`` with 3 = PYTHON3; ``cf_rating`` an int (0 = unknown);
``input_file`` / ``output_file`` strings (non-empty = file I/O);
``time_limit`` as ``{"seconds": int, "nanos": int}``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

from .hub import HubSource, hub_rows, question_issue, report_counts

# revision "main": see the TODO on the hub constants in agonlib.data
CODECONTESTS = HubSource(
    "deepmind/code_contests", "train",
    ("name", "description", "public_tests", "private_tests", "generated_tests", "difficulty", "solutions",
     "cf_rating", "input_file", "output_file", "time_limit"),
)
PYTHON3 = 3
DIFFICULTY_NAMES = ("UNKNOWN_DIFFICULTY", "EASY", "MEDIUM", "HARD", "HARDER", "HARDEST", "EXTERNAL",
                    *"ABCDEFGHIJKLMNOPQRSTUV")
# A statement that names a file like input.txt / output.txt / a.in expects file I/O.
_FILE_IO = re.compile(r"\b[\w-]+\.(?:txt|in|out|dat)\b", re.IGNORECASE)


def _difficulty_ids(difficulties: Iterable[int | str] | None) -> set[int] | None:
    if difficulties is None:
        return None
    ids = set()
    for d in difficulties:
        if isinstance(d, str):
            if d.upper() not in DIFFICULTY_NAMES:
                raise ValueError(f"Unknown CodeContests difficulty {d!r}; use one of {', '.join(DIFFICULTY_NAMES)}.")
            ids.add(DIFFICULTY_NAMES.index(d.upper()))
        else:
            ids.add(int(d))
    return ids


def collect_tests(raw: dict, max_tests: int | None = 10, max_test_chars: int | None = 50_000) -> list[dict]:
    """Public, then private, then generated tests; repeated inputs dropped.

    Tests whose input + output exceed ``max_test_chars`` are left out (huge
    generated cases dominate grading time); at most ``max_tests`` are kept.

    >>> collect_tests({"public_tests": {"input": ["1\\n", "1\\n"], "output": ["2\\n", "2\\n"]}})
    [{'input': '1\\n', 'output': '2\\n'}]
    """
    tests, seen = [], set()
    for field in ("public_tests", "private_tests", "generated_tests"):
        block = raw.get(field) or {}
        for inp, out in zip(block.get("input") or [], block.get("output") or []):
            if not isinstance(inp, str) or not isinstance(out, str) or inp in seen:
                continue
            if max_test_chars is not None and len(inp) + len(out) > max_test_chars:
                continue
            seen.add(inp)
            tests.append({"input": inp, "output": out})
            if max_tests is not None and len(tests) >= max_tests:
                return tests
    return tests


def _time_limit_s(raw: dict) -> float | None:
    limit = raw.get("time_limit")
    if not isinstance(limit, dict) or limit.get("seconds") is None:
        return None
    return float(limit.get("seconds") or 0) + float(limit.get("nanos") or 0) / 1e9 or None


def load_code_contests(split: str = "train", n: int | None = None, *, min_rating: int | None = None,
                       max_rating: int | None = None, difficulties: Iterable[int | str] | None = None,
                       max_tests: int | None = 10, max_test_chars: int | None = 50_000,
                       require_python: bool = True, data_files=None, revision: str | None = None,
                       streaming: bool = True, stats: dict | None = None) -> list[dict]:
    """Stream CodeContests ``split`` (train | valid | test) and keep usable problems.

    - ``min_rating`` / ``max_rating``: keep ``cf_rating`` in this range
      (inclusive); when either is set, problems without a rating are dropped.
    - ``difficulties``: keep these difficulty labels (ints or names like
      ``"EASY"``, ``"A"``).
    - ``require_python``: keep only problems with a Python 3 solution.
    - ``n``: stop after ``n`` kept problems (stream order, deterministic for a
      pinned revision).
    """
    wanted = _difficulty_ids(difficulties)
    out, tally, ids = [], Counter(), Counter()
    for raw in hub_rows(CODECONTESTS, split=split, data_files=data_files, revision=revision, streaming=streaming):
        if n is not None and len(out) >= n:
            break
        why = None if isinstance(raw, dict) else "malformed/not_a_mapping"
        why = why or question_issue(raw.get("description"))
        if why is None and not isinstance(raw.get("name"), str):
            why = "malformed/missing_name"
        if why is None:
            why = _filter_reason(raw, min_rating, max_rating, wanted, require_python)
        tests = [] if why else collect_tests(raw, max_tests, max_test_chars)
        if why is None and not tests:
            why = "filtered/no_tests"
        if why:
            tally[why] += 1
            continue
        rating = raw.get("cf_rating")
        # "1548_E. Gregor and the Two Painters" -> cc-train-1548_E; names can repeat across sources
        base = f"cc-{split}-{re.sub(r'[^A-Za-z0-9]+', '_', raw['name'].split('.')[0]).strip('_')}"
        ids[base] += 1
        out.append({"id": base if ids[base] == 1 else f"{base}-{ids[base]}",
                    "question": raw["description"].strip(), "answer": None,
                    "difficulty": rating if isinstance(rating, int) and rating > 0 else None,
                    "source": "codecontests", "tests": tests, "time_limit_s": _time_limit_s(raw)})
    report_counts(f"codecontests/{split}", len(out), tally, stats)
    return out


def _filter_reason(raw: dict, min_rating, max_rating, wanted: set[int] | None, require_python: bool) -> str | None:
    if (raw.get("input_file") or raw.get("output_file")) or _FILE_IO.search(raw["description"]):
        return "filtered/file_io"
    if min_rating is not None or max_rating is not None:
        rating = raw.get("cf_rating")
        if not isinstance(rating, int) or rating <= 0:
            return "filtered/no_rating"
        if (min_rating is not None and rating < min_rating) or (max_rating is not None and rating > max_rating):
            return "filtered/rating_out_of_range"
    if wanted is not None and raw.get("difficulty") not in wanted:
        return "filtered/difficulty"
    if require_python and PYTHON3 not in ((raw.get("solutions") or {}).get("language") or []):
        return "filtered/no_python3_solution"
    return None
