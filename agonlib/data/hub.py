"""Reading hub data sets, and the row checks every problem source shares.

Hub data sets are read at run time by id and revision with
``datasets.load_dataset`` (never committed), or from local ``data_files`` in
the same schema (the tests write such fixtures). Rows that cannot be used are
skipped and counted under a reason — ``malformed/<why>`` for broken rows,
``filtered/<why>`` or ``dropped/<why>`` for rows a loader chose not to keep —
and the counts are logged (a warning when anything was malformed) and handed
back through a ``stats`` dict.
"""

from __future__ import annotations

import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import datasets

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubSource:
    """Where a hub data set lives. ``columns`` are projected when the files are parquet."""

    repo_id: str
    split: str
    columns: tuple[str, ...] | None = None
    config: str | None = None
    revision: str = "main"  # see the TODO on the constants in agonlib.data
    parquet: bool = True


class DataLoadError(RuntimeError):
    """A hub or local data set could not be read; the message says what to do."""


# --- answers and rows --------------------------------------------------------------

_INT = re.compile(r"^[+-]?\d+$")
_INT_FLOAT = re.compile(r"^([+-]?\d+)\.0*$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")


def normalize_answer(text, *, thousands: bool = False) -> str:
    """Canonical form of a gold answer; anything not number-like is only stripped.

    >>> normalize_answer(" 033 "), normalize_answer("27.0"), normalize_answer("-0")
    ('33', '27', '0')
    >>> normalize_answer("1,234", thousands=True), normalize_answer("\\\\frac{1}{2}")
    ('1234', '\\\\frac{1}{2}')

    ``thousands=True`` (GSM8K) drops thousands separators; it is off by
    default because in MATH-style answers ``1,234`` may be a list.
    """
    s = str(text).strip()
    if len(s) >= 2 and s[0] == s[-1] == "$":
        s = s[1:-1].strip()
    if thousands and _THOUSANDS.match(s):
        s = s.replace(",", "")
    m = _INT_FLOAT.match(s)
    if m:
        s = m.group(1)
    if _INT.match(s):
        return str(int(s))
    return s


def question_issue(question) -> str | None:
    if not isinstance(question, str):
        return "malformed/non_string_question" if question is not None else "malformed/missing_question"
    return None if question.strip() else "malformed/empty_question"


def answer_or_issue(answer) -> tuple[str | None, str | None]:
    """(answer as a string, None) or (None, why it is unusable)."""
    if answer is None:
        return None, "malformed/missing_answer"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return None, "malformed/non_string_answer"
    text = str(answer).strip()
    return (text, None) if text else (None, "malformed/empty_answer")


def report_counts(name: str, kept: int, tally: Counter, stats: dict | None) -> None:
    """Log what was kept and skipped; warn when rows were malformed."""
    if stats is not None:
        stats.update({"kept": kept, **tally})
    detail = ", ".join(f"{why}: {k}" for why, k in sorted(tally.items()))
    malformed = sum(k for why, k in tally.items() if why.startswith("malformed/"))
    (log.warning if malformed else log.info)("%s: kept %d rows%s", name, kept, f" (skipped {detail})" if detail else "")


def collect_rows(name: str, rows: Iterable[dict], to_problem: Callable[[int, dict], dict | str],
             stats: dict | None) -> list[dict]:
    """Map raw rows to problems; ``to_problem`` returns a row or a skip reason."""
    out, tally = [], Counter()
    for i, raw in enumerate(rows):
        result = to_problem(i, raw) if isinstance(raw, dict) else "malformed/not_a_mapping"
        if isinstance(result, str):
            tally[result] += 1
        else:
            out.append(result)
    report_counts(name, len(out), tally, stats)
    return out


def sample_rows(rows: list[dict], n: int | None, seed: int) -> list[dict]:
    """All rows, or a seeded sample of ``n`` that keeps the original order."""
    if n is None or n >= len(rows):
        return rows
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]


def split_by_question(rows: list[dict], test_size: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Seeded train/test split that is disjoint by question text.

    Rows repeating an earlier question are dropped (the first is kept); which
    question lands where does not depend on the input order, since questions
    are sorted before the seeded shuffle.
    """
    unique = {}
    for row in rows:
        unique.setdefault(row["question"].strip(), row)
    if test_size > len(unique):
        raise ValueError(f"test_size={test_size} but only {len(unique)} distinct problems remain; lower test_size.")
    ordered = [unique[q] for q in sorted(unique)]
    random.Random(seed).shuffle(ordered)
    return ordered[test_size:], ordered[:test_size]


# --- reading hub data ---------------------------------------------------------------


def _builder_for(data_files) -> str:
    first = data_files
    while isinstance(first, (dict, list, tuple)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    suffix = Path(str(first)).suffix.lower()
    builders = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
    if suffix not in builders:
        raise DataLoadError(f"Cannot read {first}: use a .parquet, .jsonl, .json or .csv file.")
    return builders[suffix]


def _as_strings(data_files):
    """Paths as strings, keeping the str | list | {split: ...} shape datasets accepts."""
    if isinstance(data_files, dict):
        return {split: _as_strings(files) for split, files in data_files.items()}
    if isinstance(data_files, (list, tuple)):
        return [str(p) for p in data_files]
    return str(data_files)


def hub_rows(source: HubSource, *, split: str | None = None, data_files=None, revision: str | None = None,
             streaming: bool = True) -> Iterator[dict]:
    """Raw rows of a hub data set (or of local ``data_files`` in its schema).

    On the hub, parquet data sets are read with column projection
    (``load_dataset(..., columns=[...])``, supported by datasets 4.x for
    parquet), so with ``streaming=True`` only the needed columns travel —
    DeepMath's R1 traces (~2 GB) are never fetched. Local ``data_files`` are
    always streamed (nothing is written to the datasets cache).
    """
    split = split or source.split
    where = str(data_files) if data_files is not None else f"{source.repo_id}@{revision or source.revision}"
    try:
        if data_files is not None:
            builder, files = _builder_for(data_files), _as_strings(data_files)
            kwargs = {"columns": list(source.columns)} if builder == "parquet" and source.columns else {}
            ds = datasets.load_dataset(builder, data_files=files, split=split if isinstance(files, dict) else "train",
                                       streaming=True, **kwargs)
        else:
            kwargs = {"columns": list(source.columns)} if source.parquet and source.columns else {}
            ds = datasets.load_dataset(source.repo_id, source.config, split=split,
                                       revision=revision or source.revision, streaming=streaming, **kwargs)
        yield from ds
    except DataLoadError:
        raise
    except Exception as err:
        raise DataLoadError(
            f"Could not read {where} ({type(err).__name__}: {err}). Hub data needs network access (the cpu and "
            "smoke profiles use offline synthetic data); or pass data_files= pointing at a local copy.") from err
