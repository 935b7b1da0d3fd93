"""Problem sets: one row shape for every source, and :func:`load_problems`.

Every source yields JSON-serialisable rows::

    {"id": str, "question": str, "answer": str | None, "difficulty": ..., "source": str}

Math rows carry the gold ``answer`` as a string (the grader reads it as
LaTeX/plain text). Code rows carry ``answer=None`` and
``tests=[{"input": str, "output": str}, ...]`` instead.

Sources (``load_problems(source, split, n, seed, **kw)``):

====================  ==========  ================================================
source                splits      what
====================  ==========  ================================================
``synthetic``         train/test  offline arithmetic word problems (agonlib.data.synthetic)
``deepmath``          train/test  DeepMath-103K, ``difficulty >= 7``, self-checked golds
``math500``           test        MATH-500 (hub ``HuggingFaceH4/MATH-500``)
``gsm8k``             train/test  GSM8K, config ``main`` (hub ``openai/gsm8k``)
``aime2024``          test        AIME 2024 (hub ``HuggingFaceH4/aime_2024``)
``codecontests``      train/test  CodeContests, streamed (agonlib.data.codecontests)
``code_handwritten``  train/test  hand-written stdin/stdout problems (both: all)
====================  ==========  ================================================

Hub sources are read with ``datasets.load_dataset`` at run time by id and
revision (never committed); each loader also takes ``data_files=`` (a local
parquet/jsonl file or list of files in the hub schema), which the tests use
with fixtures they write. Malformed rows (empty question, missing or
non-string answer, ...) are skipped, counted and logged, never fatal; pass a
dict as ``stats=`` to receive the counts (``kept``, ``malformed/<why>``,
``filtered/<why>``).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, TypedDict

from .code_problems import code_problems
from .codecontests import load_code_contests
from .hub import (  # noqa: F401  (DataLoadError is re-exported for callers)
    DataLoadError,
    HubSource,
    answer_or_issue,
    collect_rows,
    hub_rows,
    normalize_answer,
    question_issue,
    report_counts,
    sample_rows,
    split_by_question,
)
from .synthetic import synthetic_problems, synthetic_split


class Problem(TypedDict):
    """One problem row; code rows add ``tests`` (see :class:`CodeProblem`)."""

    id: str
    question: str
    answer: str | None
    difficulty: float | int | None
    source: str


class CodeProblem(Problem):
    tests: list[dict]


# TODO: pin each revision to a commit sha of its hub repo (learnt online, e.g.
# `huggingface_hub.HfApi().dataset_info(repo_id).sha`); until then "main" is
# read, which can change under a run.
DEEPMATH = HubSource("zwhe99/DeepMath-103K", "train", ("question", "final_answer", "difficulty", "topic"))
MATH500 = HubSource("HuggingFaceH4/MATH-500", "test", parquet=False)  # a jsonl file on the hub
GSM8K = HubSource("openai/gsm8k", "test", ("question", "answer"), config="main")
AIME2024 = HubSource("HuggingFaceH4/aime_2024", "train", ("id", "problem", "answer"))


# --- DeepMath-103K hard split ------------------------------------------------------


def _default_self_check(golds: list[str]) -> list[bool]:
    """Grade ``\\boxed{gold}`` against ``gold`` with the project's math grader, in one batch."""
    verify = importlib.import_module("agonlib.grading.math_grader")  # lazy: the verifier spawns workers
    boxed = ["\\boxed{%s}" % gold for gold in golds]
    batch = getattr(verify, "grade_math_batch", None)
    if batch is not None:
        return [bool(ok) for ok in batch(boxed, golds, thinking=False)]
    return [bool(verify.grade_math(b, g, thinking=False)) for b, g in zip(boxed, golds)]


def _checked(self_check: Callable[[str], object], gold: str) -> bool:
    try:
        return bool(self_check(gold))
    except Exception:  # a checker that raises counts as a failed check, never a crash
        return False


@dataclass
class DeepMathSplit:
    train: list[dict]
    test: list[dict]
    stats: dict = field(default_factory=dict)


def load_deepmath_hard(*, min_difficulty: float = 7.0, test_size: int = 500, seed: int = 0,
                       self_check: Callable[[str], object] | None | bool = None, data_files=None,
                       revision: str | None = None, streaming: bool = True) -> DeepMathSplit:
    """DeepMath-103K rows with ``difficulty >= min_difficulty``, split train/test.

    Golds that do not verify against themselves (``self_check(gold)`` false or
    raising) are dropped and counted under ``stats["dropped/self_check_failed"]``:
    a gold the grader cannot read would make its problem unsolvable. The
    default (``None``) grades ``\\boxed{gold}`` against ``gold`` with
    :func:`agonlib.grading.grade_math` (batched through ``grade_math_batch``
    when the verifier has it); ``self_check=False`` skips the check.
    Repeated questions are dropped (``dropped/duplicate_question``). The test
    set is ``test_size`` problems drawn with ``seed``; train is the rest, both
    disjoint by question text. Ids are ``deepmath-<sha1(question)[:12]>``.
    """
    tally, seen, kept = Counter(), set(), []
    for raw in hub_rows(DEEPMATH, data_files=data_files, revision=revision, streaming=streaming):
        tally["rows_read"] += 1
        question, difficulty = raw.get("question"), raw.get("difficulty")
        answer, why = answer_or_issue(raw.get("final_answer"))
        why = question_issue(question) or why
        if why is None and (isinstance(difficulty, bool) or not isinstance(difficulty, (int, float))):
            why = "malformed/non_numeric_difficulty"
        if why:
            tally[why] += 1
            continue
        if difficulty < min_difficulty:
            tally["filtered/below_min_difficulty"] += 1
            continue
        key = question.strip()
        if key in seen:
            tally["dropped/duplicate_question"] += 1
            continue
        seen.add(key)
        kept.append({"id": "deepmath-" + hashlib.sha1(key.encode()).hexdigest()[:12], "question": key,
                     "answer": answer, "difficulty": float(difficulty), "source": "deepmath",
                     "topic": raw.get("topic")})
    if self_check is not False:
        golds = [row["answer"] for row in kept]
        passed = _default_self_check(golds) if self_check is None else [_checked(self_check, g) for g in golds]
        tally["dropped/self_check_failed"] += passed.count(False)
        kept = [row for row, ok in zip(kept, passed) if ok]
    train, test = split_by_question(kept, test_size, seed)
    stats = dict(tally)
    report_counts(f"deepmath (difficulty >= {min_difficulty})", len(kept), tally, stats)
    stats.update(train=len(train), test=len(test))
    return DeepMathSplit(train, test, stats)


# --- evaluation sets ----------------------------------------------------------------


def _problem_answer(source: str, id_of, difficulty=lambda raw: None):
    """A row converter for sets with ``problem`` and ``answer`` columns (MATH-500, AIME)."""

    def convert(i: int, raw: dict):
        answer, why = answer_or_issue(raw.get("answer"))
        why = question_issue(raw.get("problem")) or why
        if why:
            return why
        return {"id": f"{source}-{id_of(i, raw)}", "question": raw["problem"].strip(),
                "answer": normalize_answer(answer), "difficulty": difficulty(raw), "source": source}

    return convert


def load_math500(n: int | None = None, seed: int = 0, *, data_files=None, revision: str | None = None,
                 stats: dict | None = None) -> list[dict]:
    """MATH-500 (columns ``problem``, ``answer``, ``level``, ``unique_id``)."""
    convert = _problem_answer("math500", lambda i, raw: str(raw.get("unique_id") or i).removesuffix(".json"),
                              lambda raw: raw.get("level"))
    rows = collect_rows("math500", hub_rows(MATH500, data_files=data_files, revision=revision), convert, stats)
    return sample_rows(rows, n, seed)


def gsm8k_final_answer(solution: str) -> str | None:
    """The number after ``####`` in a GSM8K solution, thousands separators dropped.

    >>> gsm8k_final_answer("3 + 4 = 7 apples\\n#### 1,007")
    '1007'
    """
    if not isinstance(solution, str) or "####" not in solution:
        return None
    final = solution.rsplit("####", 1)[1].strip()
    return normalize_answer(final, thousands=True) if final else None


def load_gsm8k(split: str = "test", n: int | None = None, seed: int = 0, *, data_files=None,
               revision: str | None = None, stats: dict | None = None) -> list[dict]:
    """GSM8K (config ``main``; columns ``question``, ``answer`` with the result after ``####``)."""

    def convert(i: int, raw: dict):
        why = question_issue(raw.get("question"))
        answer = gsm8k_final_answer(raw.get("answer"))
        if why or answer is None:
            return why or "malformed/missing_answer"
        return {"id": f"gsm8k-{split}-{i}", "question": raw["question"].strip(), "answer": answer,
                "difficulty": None, "source": "gsm8k"}

    rows = collect_rows("gsm8k", hub_rows(GSM8K, split=split, data_files=data_files, revision=revision), convert, stats)
    return sample_rows(rows, n, seed)


def load_aime2024(n: int | None = None, seed: int = 0, *, data_files=None, revision: str | None = None,
                  stats: dict | None = None) -> list[dict]:
    """AIME 2024 (30 problems; columns ``id``, ``problem``, ``answer`` as a string like ``"033"``)."""
    convert = _problem_answer("aime2024", lambda i, raw: raw.get("id", i))
    rows = collect_rows("aime2024", hub_rows(AIME2024, data_files=data_files, revision=revision), convert, stats)
    return sample_rows(rows, n, seed)


# --- one entry point ----------------------------------------------------------------


def _synthetic(split, n, seed, levels=(1, 2), test_size=200):
    if split == "test":
        if n is not None and n > test_size:
            raise ValueError(f"n={n} test problems asked for but test_size={test_size}; raise test_size.")
        return synthetic_problems(test_size if n is None else n, levels, seed, stream="test")
    return synthetic_split(1000 if n is None else n, test_size, levels, seed)[0]


def _deepmath(split, n, seed, **kw):
    parts = load_deepmath_hard(seed=seed, **kw)
    rows = parts.train if split == "train" else parts.test
    return rows if n is None else rows[:n]


def _codecontests(split, n, seed, **kw):
    return load_code_contests(split, n, **kw)


_SOURCES: dict[str, tuple[tuple[str, ...], Callable]] = {
    "synthetic": (("train", "test"), _synthetic),
    "deepmath": (("train", "test"), _deepmath),
    "math500": (("test",), lambda split, n, seed, **kw: load_math500(n, seed, **kw)),
    "gsm8k": (("train", "test"), lambda split, n, seed, **kw: load_gsm8k(split, n, seed, **kw)),
    "aime2024": (("test",), lambda split, n, seed, **kw: load_aime2024(n, seed, **kw)),
    "codecontests": (("train", "valid", "test"), _codecontests),
    "code_handwritten": (("train", "test"), lambda split, n, seed: code_problems(n)),
}
SOURCES = tuple(_SOURCES)


def load_problems(source: str, split: str = "train", n: int | None = None, seed: int = 0, **kw) -> list[dict]:
    """Rows of ``source`` for ``split`` (see the module docstring for sources).

    ``n`` caps the number of rows (eval sets: a seeded sample in original
    order). Extra keywords go to the source's loader, e.g. ``levels`` and
    ``test_size`` for ``synthetic``; ``min_difficulty``, ``test_size``,
    ``self_check``, ``data_files`` for ``deepmath``.

    >>> len(load_problems("synthetic", "test", n=3, levels=(1,)))
    3
    """
    if source not in _SOURCES:
        near = difflib.get_close_matches(source, SOURCES, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"Unknown problem source {source!r}.{hint} Valid sources: {', '.join(SOURCES)}.")
    splits, loader = _SOURCES[source]
    if split not in splits:
        raise ValueError(f"Source {source!r} has no {split!r} split; use one of {', '.join(splits)}.")
    accepted = _keywords(source)
    unknown = sorted(set(kw) - set(accepted))
    if unknown:
        raise TypeError(f"load_problems({source!r}) got unexpected keyword(s) {', '.join(unknown)}; "
                        f"it accepts: {', '.join(accepted) or 'none'}.")
    return loader(split, n, seed, **kw)


def _keywords(source: str) -> list[str]:
    """The extra keywords a source's loader takes (beyond split, n, seed)."""
    targets = {"deepmath": load_deepmath_hard, "math500": load_math500, "gsm8k": load_gsm8k,
               "aime2024": load_aime2024, "codecontests": load_code_contests}
    fn = targets.get(source, _SOURCES[source][1])
    params = inspect.signature(fn).parameters
    return [name for name, p in params.items()
            if name not in ("split", "n", "seed") and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def problems_for(config, split: str) -> list[dict]:
    """The train or held-out test problems a run's config names (``dataset`` and its keys)."""
    seed = config.seed
    if config.dataset == "synthetic":
        return load_problems("synthetic", split, seed=seed, levels=tuple(config.levels),
                             test_size=config.test_size)
    if config.dataset == "deepmath":
        return load_problems("deepmath", split, seed=seed, min_difficulty=config.min_difficulty,
                             test_size=config.test_size)
    if config.dataset == "codecontests":
        return load_problems("codecontests", "train" if split == "train" else "test")
    return load_problems(config.dataset, split, seed=seed)
