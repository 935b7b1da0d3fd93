"""Which of the paper's orderings hold on a profile: paired differences with intervals (DESIGN.md §8).

An ordering is one claim of the paper about two systems, each a system of one
cell (``("agon", "cascade_AB")``): Agon's cascade scores above compute-matched
GRPO, its final stage is shorter, rotating roles beat fixed ones …

Within one seed every run evaluates the same held-out problems with the same
per-problem sampling seeds (:mod:`agonlib.evaluation`), so two systems are
paired item by item. For each ordering:

* **per seed**, the difference ``first − second`` of pass@1 (or of the mean
  final-stage length);
* **across seeds**, the mean difference with a 95% t-interval: the seeds are the
  replicates, so this interval decides the verdict whenever there are two or
  more; with one seed, the paired t-interval of the item differences does;
* **pooled over seeds**, the per-problem transitions (``first only``: right in
  the first system, wrong in the second; ``second only``: the reverse) and an
  exact McNemar p-value.

With several samples per problem the samples of one problem are not
independent: a problem's difference is the mean over its samples, and McNemar
reads each problem's first sample. Items pair by position, so both systems must
have evaluated the same number of problems and samples in that seed (the same
profile gives the same held-out problems for one seed; the system's name is not
part of any sampling seed). The cascade's second stage draws from its own
seeds: pairing is by problem, not by shared random numbers.

The verdict is ``holds`` when the interval lies wholly on the paper's side of
zero — and, for pass@1, McNemar agrees (p < 0.05, with more problems right only
in the system the interval puts ahead) — ``reversed`` when both say the other
side, and ``not separated`` otherwise, also when the interval has no width to
judge (identical differences, up to float rounding). Two seeds give t = 12.7 and so almost
never separate; one seed's interval measures evaluation noise only, not the
spread between training seeds (the ``interval`` column says which, and such a
verdict carries "(1 seed)"). Eleven
orderings at 95% each: expect one false ``holds`` in twenty tables by chance.
A worked example: three seeds with differences +0.05, −0.02, +0.03 have mean
+0.02 and interval [−0.07, +0.11]: not separated.

:func:`against` sets a variant's report (some cells retrained with one setting changed) beside the base
report of the same seeds: per-system differences and the orderings with the variant's cells, intervals only.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..evaluation import mcnemar_exact, mean_interval
from ..parsing import mask_answer
from ..runs import read_jsonl, recorded_config
from .paper import cell_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ordering:
    claim: str
    first: tuple[str, str]  # (cell, system)
    second: tuple[str, str]
    measure: str = "pass@1"  # or "final_len": mean tokens of the completion whose answer counts
    expect: str = "higher"  # the paper's side: first's measure is "higher" or "lower" than second's


AGON, GRPO_2N, GRPO = ("agon", "cascade_AB"), ("grpo_2n", "grpo"), ("grpo", "grpo")

#: The paper's orderings (DESIGN.md §1), each cell by its deployment system (as in :mod:`.paper`).
ORDERINGS = (
    Ordering("Agon above GRPO-2N (compute-matched)", AGON, GRPO_2N),
    Ordering("Agon above GRPO (N)", AGON, GRPO),
    Ordering("Agon above cooperation + exchange", AGON, ("coop_exchange", "cascade_AB")),
    Ordering("Agon above competition, no exchange", AGON, ("comp_no_exchange", "cascade_AB")),
    Ordering("Agon above cooperation, no exchange", AGON, ("coop_no_exchange", "cascade_AB")),
    Ordering("rotating roles above fixed roles", AGON, ("fixed_roles", "cascade_AB")),
    Ordering("Agon's cascade A→B above its adapter A alone", AGON, ("agon", "A")),
    Ordering("Agon's cascade B→A above its adapter B alone", ("agon", "cascade_BA"), ("agon", "B")),
    Ordering("Agon's adapter A alone above GRPO-2N", ("agon", "A"), GRPO_2N),
    Ordering("Agon's final stage shorter than GRPO-2N's", AGON, GRPO_2N, "final_len", "lower"),
    Ordering("Agon's final stage shorter than GRPO's", AGON, GRPO, "final_len", "lower"),
)

#: An interval narrower than this (relative to its bounds) has no width: its seeds agree but for float rounding.
WIDTH_TOLERANCE = 1e-9
COLUMNS = ["claim", "measure", "first", "second", "seeds", "per seed", "difference", "low", "high", "interval",
           "problems", "first only", "second only", "McNemar p", "verdict"]
ALPHA = 0.05


def load_evaluations(runs_dir: str | Path) -> dict:
    """``{(cell, seed): final_eval}`` for every evaluated run under ``runs_dir``."""
    found = {}
    for run_dir in sorted(p for p in Path(runs_dir).glob("*") if (p / "final_eval.json").exists()):
        result = json.loads((run_dir / "final_eval.json").read_text())
        seed = (result.get("meta") or {}).get("seed")
        if seed is None:
            seed = (recorded_config(run_dir) or {}).get("seed", 0)
        key = (cell_of(run_dir.name), int(seed))
        if key in found:
            log.warning("%s is a second evaluated run of cell %s, seed %s: it replaces the first in the verdict.",
                        run_dir.name, *key)
        found[key] = result
    return found


def _items(result: dict, system: str, measure: str) -> tuple[list[list[float]], tuple] | None:
    """One system's values per problem (a list of its samples' correctness or final-stage lengths) and the
    evaluation's shape ``(problems, samples)``; ``None`` when the system or its per-item lists are missing."""
    entry = result.get(system)
    if not isinstance(entry, dict):
        return None
    values = entry.get("correct") if measure == "pass@1" else entry.get("final_len_distribution")
    if not values:
        return None
    samples = int(entry.get("n_samples") or 1)
    problems = int(entry.get("n_problems") or len(values) // samples)
    if problems * samples != len(values):
        return None
    per_problem = [[float(v) for v in values[p * samples : (p + 1) * samples]] for p in range(problems)]
    return per_problem, (problems, samples)


def judge(low: float, high: float, expect: str) -> str:
    """``holds`` / ``reversed`` / ``not separated`` from a 95% interval of ``first − second``.

    >>> judge(0.01, 0.2, "higher"), judge(-0.3, -0.1, "higher"), judge(-0.1, 0.2, "higher")
    ('holds', 'reversed', 'not separated')
    >>> judge(-30.0, -5.0, "lower")
    'holds'
    >>> judge(0.1 - 1e-16, 0.1 + 1e-16, "higher")  # seeds equal but for float rounding: no width to judge
    'not separated'
    """
    if math.isnan(low) or math.isnan(high) or not high - low > WIDTH_TOLERANCE * max(1.0, abs(low), abs(high)):
        return "not separated"  # no interval, or none with a width to judge
    above, below = low > 0, high < 0
    if (above and expect == "higher") or (below and expect == "lower"):
        return "holds"
    if above or below:
        return "reversed"
    return "not separated"


def ordering_row(ordering: Ordering, evaluations: dict) -> dict:
    """One ordering's figures over every seed where both of its systems were evaluated on the same items."""
    per_seed, pooled = [], []
    seeds = sorted({seed for (_, seed) in evaluations})
    for seed in seeds:
        first = evaluations.get((ordering.first[0], seed))
        second = evaluations.get((ordering.second[0], seed))
        if first is None or second is None:
            continue
        a = _items(first, ordering.first[1], ordering.measure)
        b = _items(second, ordering.second[1], ordering.measure)
        if a is None or b is None or a[1] != b[1]:  # pairs only the same problems and samples
            continue
        per_seed.append(statistics.fmean(x for p in a[0] for x in p) - statistics.fmean(x for p in b[0] for x in p))
        pooled.extend(zip(a[0], b[0]))
    if not per_seed:
        return {**_head(ordering, per_seed), "verdict": "not evaluated"}
    # A problem's difference is the mean over its samples: samples of one problem are not independent.
    diffs = [statistics.fmean(x) - statistics.fmean(y) for x, y in pooled]
    counts = None
    if ordering.measure == "pass@1":  # each problem's first sample
        counts = (sum(1 for x, y in pooled if x[0] > y[0]), sum(1 for x, y in pooled if x[0] < y[0]))
    return _judged(ordering, per_seed, len(diffs), counts, mean_interval(diffs)[1:])


def _head(ordering: Ordering, per_seed: list[float]) -> dict:
    return {"claim": ordering.claim, "measure": ordering.measure, "first": " ".join(ordering.first),
            "second": " ".join(ordering.second), "seeds": len(per_seed), "per seed": _per_seed_text(ordering, per_seed)}


def _per_seed_text(ordering: Ordering, per_seed: list[float]) -> str:
    return " ".join(f"{d:+.3f}" if ordering.measure == "pass@1" else f"{d:+.1f}" for d in per_seed)


def _judged(ordering: Ordering, per_seed: list[float], problems: int, counts: tuple[int, int] | None,
            one_seed_interval: tuple[float, float] = (float("nan"), float("nan"))) -> dict:
    """The row of an ordering from its per-seed differences, its paired problems, its McNemar counts
    (``first only``, ``second only``; ``None`` for lengths) and, for one seed, the interval of its items."""
    row = _head(ordering, per_seed)
    if len(per_seed) > 1:
        (mean, low, high), kind = mean_interval(per_seed), f"t over {len(per_seed)} seeds"
    else:
        (mean, (low, high)), kind = (per_seed[0], one_seed_interval), "problems, 1 seed"
    row.update({"difference": mean, "low": low, "high": high, "interval": kind, "problems": problems})
    word = judge(low, high, ordering.expect)
    if counts is not None:
        p = mcnemar_exact(*counts)
        row.update({"first only": counts[0], "second only": counts[1], "McNemar p": p})
        # McNemar must agree, on the interval's side: more problems right in the first only when it is above.
        if p >= ALPHA or (counts[0] > counts[1]) != (low > 0):
            word = "not separated"
    # One seed's interval holds evaluation noise only: a second training seed can move a cell by more.
    row["verdict"] = word if len(per_seed) > 1 else f"{word} (1 seed)"
    return row


def _table(rows: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=COLUMNS)
    for column in ("seeds", "problems", "first only", "second only"):
        table[column] = table[column].astype("Int64")  # counts stay integers beside the missing ones
    return table


def orderings(runs_dir: str | Path, which=ORDERINGS) -> pd.DataFrame:
    """Every ordering of the paper, judged on the runs under ``runs_dir`` (one row each)."""
    evaluations = load_evaluations(runs_dir)
    return _table([ordering_row(o, evaluations) for o in which])


ORDERINGS_HEADING = "## The paper's orderings"


class ReportError(ValueError):
    """Reports that cannot be judged together: a missing table, a seed twice, a CSV beside another's Markdown."""


def read_report_table(report_md: str | Path, heading: str) -> list[list[str]]:
    """The rows (header first) of the table under the section of a results report starting ``heading``."""
    lines = Path(report_md).read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        raise ReportError(f"{report_md} has no section starting {heading!r}: not a results report.")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def read_report_orderings(report_md: str | Path) -> pd.DataFrame:
    """The orderings table of a results report (``<profile>.md``, written by :mod:`.results`), as written."""
    rows = read_report_table(report_md, ORDERINGS_HEADING)
    if not rows or rows[0] != COLUMNS:
        raise ReportError(f"{report_md}: the orderings table's columns are not {COLUMNS}.")
    return pd.DataFrame(rows[1:], columns=COLUMNS)


def _csv_values(table: pd.DataFrame, report: Path) -> dict:
    """``{(cell, seed): {system: (pass@1, mean final-stage length, problems)}}`` from a results table."""
    values: dict = {}
    for row in table[table["pass@1"].notna()].to_dict("records"):
        key, system = (cell_of(row["run"]), int(row["seed"])), row["system"]
        if system in values.setdefault(key, {}):
            raise ReportError(f"{report} lists {system} of cell {key[0]}, seed {key[1]} twice.")
        values[key][system] = (float(row["pass@1"]), float(row["mean_final_len"]), int(row["n_problems"]))
    return values


def _differences(ordering: Ordering, values: dict) -> dict[int, float]:
    """``{seed: first − second}`` for every seed of ``values`` with both systems on the same number of problems."""
    measure = 0 if ordering.measure == "pass@1" else 1
    out = {}
    for seed in sorted({seed for (_, seed) in values}):
        first = values.get((ordering.first[0], seed), {}).get(ordering.first[1])
        second = values.get((ordering.second[0], seed), {}).get(ordering.second[1])
        if first is not None and second is not None and first[2] == second[2]:
            out[seed] = first[measure] - second[measure]
    return out


def combine(reports, which=ORDERINGS) -> pd.DataFrame:
    """The paper's orderings judged over the seeds of several results reports, from their files alone.

    Each report is a results table ``<name>.csv`` (:func:`agonlib.study.results.collect`) with its
    ``<name>.md`` beside it, as committed under ``experiments/results/``: seeds trained apart (another
    session, another clone) are judged together without their run directories. A seed's difference is
    the difference of the two systems' pass@1 (or mean final-stage length) in the CSV — the means of the
    same items that :func:`ordering_row` differences. The McNemar counts are the sums of the reports'
    ``first only`` / ``second only`` columns, which is what pooling over seeds does. What the files
    cannot give is one seed's interval over its items: an ordering with one seed in all is left to its
    own report.
    A seed may appear in one report only, and each report's own ``per seed`` column must equal the
    differences its CSV gives (a CSV beside the wrong Markdown file stops here).
    """
    values: dict = {}
    tables: list[pd.DataFrame] = []  # each report's orderings, as written
    for report in map(Path, reports):
        csv, md = report.with_suffix(".csv"), report.with_suffix(".md")
        for path in (csv, md):
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing: a report is a results CSV with its Markdown beside it.")
        own = _csv_values(pd.read_csv(csv), csv)
        shared = sorted({seed for _, seed in own} & {seed for _, seed in values})
        if shared:
            raise ReportError(f"{csv} repeats seed(s) {shared} of an earlier report: each seed may be counted once.")
        table = read_report_orderings(md).set_index("claim")
        for ordering in which:
            if ordering.claim not in table.index:
                raise ReportError(f"{md} has no row for {ordering.claim!r}.")
            text = _per_seed_text(ordering, list(_differences(ordering, own).values()))
            if table.loc[ordering.claim, "per seed"] != text:
                raise ReportError(f"{md} gives {table.loc[ordering.claim, 'per seed']!r} for {ordering.claim!r} "
                                  f"but {csv.name} gives {text!r}: they are not one report.")
        values.update(own)
        tables.append(table)
    rows = []
    for ordering in which:
        per_seed = list(_differences(ordering, values).values())
        if len(per_seed) < 2:  # one seed's interval is over its items, which only its run directories hold
            word = "not evaluated" if not per_seed else "one seed: judged in its own report"
            rows.append({**_head(ordering, per_seed), "verdict": word})
            continue
        cells = [table.loc[ordering.claim] for table in tables if table.loc[ordering.claim, "per seed"]]
        problems = sum(int(cell["problems"]) for cell in cells)
        counts = None
        if ordering.measure == "pass@1":
            counts = tuple(sum(int(cell[column]) for cell in cells) for column in ("first only", "second only"))
        rows.append(_judged(ordering, per_seed, problems, counts))
    return _table(rows)


def against(variant_csv: str | Path, base_csv: str | Path, which=ORDERINGS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A variant (some cells retrained with one setting changed) against the base report of the same seeds.

    First table: each (cell, system) of the variant, ``variant − base`` of pass@1 per seed, and the mean
    with its t-interval over the seeds. Second: every ordering over the variant's seeds, with the variant's
    cells in place of the base's (the other cells stay the base's, which is right only where the setting
    cannot move them: a summary mask moves every cell's cascade) beside the base's own. Intervals only: McNemar needs the runs' per-problem outcomes, which reports do not keep.
    """
    variant = _csv_values(pd.read_csv(variant_csv), Path(variant_csv))
    base = _csv_values(pd.read_csv(base_csv), Path(base_csv))
    seeds = {seed for _, seed in variant}
    diffs: dict[tuple[str, str], list[float]] = {}
    for (cell, seed), systems in sorted(variant.items()):
        for system, (value, _, problems) in systems.items():
            old = base.get((cell, seed), {}).get(system)
            if old is not None and old[2] == problems:
                diffs.setdefault((cell, system), []).append(value - old[0])

    def interval(values: list[float]) -> dict:
        return dict(zip(("difference", "low", "high"), mean_interval(values)))

    systems = pd.DataFrame([{"cell": cell, "system": system, "per seed": " ".join(f"{d:+.3f}" for d in ds),
                             **interval(ds)} for (cell, system), ds in diffs.items()])
    base = {key: value for key, value in base.items() if key[1] in seeds}
    rows = []
    for ordering in which:
        mine, theirs = (list(_differences(ordering, v).values()) for v in ({**base, **variant}, base))
        rows.append({"claim": ordering.claim, "per seed": _per_seed_text(ordering, mine), **interval(mine),
                     **{f"base {k}": v for k, v in interval(theirs).items()}})
    return systems, pd.DataFrame(rows)


LEAK_GOAL = 0.01  # issue 15: a summary should state the gold in at most 1% of training pairs


def leak_rates(runs_dir: str | Path) -> pd.DataFrame:
    """Training leak rate (``challenger/leak_rate``: the summary still states the gold) of each exchange cell.

    One row per cell: its seeds, each seed's mean over its steps (and the mean of those),
    the worst single step of any seed, and whether every seed's mean stays within :data:`LEAK_GOAL`.
    From the logged sample rounds (``rollouts.jsonl``) it also counts the leaks by the draft's
    correctness: a right draft that still states the gold is a masking failure; a wrong draft
    can state the gold as a step of its reasoning (``5 + 2 = 7`` before boxing 8), which
    masking the drafter's own answer does not and should not remove — and on small arithmetic
    the gold is often a number of the question itself (``has 2, loses 1``: gold 1), which the
    challenger reads anyway; those wrong-draft leaks are counted apart.
    """
    per_cell: dict[str, list[tuple[float, float]]] = {}
    logged: dict[str, dict[str, int]] = {}
    for run_dir in sorted(p for p in Path(runs_dir).glob("*") if (p / "metrics.jsonl").exists()):
        config = recorded_config(run_dir) or {}
        if config.get("mode") != "agon" or not config.get("exchange", True):
            continue
        rates = [r["challenger/leak_rate"] for r in read_jsonl(run_dir / "metrics.jsonl")
                 if isinstance(r.get("challenger/leak_rate"), (int, float))]
        if not rates:
            continue
        cell = cell_of(run_dir.name)
        per_cell.setdefault(cell, []).append((statistics.fmean(rates), max(rates)))
        counts = logged.setdefault(cell, {"right": 0, "right leaked": 0, "wrong": 0, "wrong leaked": 0,
                                          "gold in question": 0})
        for record in read_jsonl(run_dir / "rollouts.jsonl"):
            for problem in record.get("problems", []):
                # the whole-token rule of the masking itself: would masking the gold change the question?
                question = problem.get("question", "")
                in_question = mask_answer(question, str(problem.get("answer", ""))) != question
                for item in problem.get("rollouts", []):
                    if "leaked" in item and "draft_correct" in item:
                        kind = "right" if item["draft_correct"] else "wrong"
                        counts[kind] += 1
                        counts[f"{kind} leaked"] += bool(item["leaked"])
                        counts["gold in question"] += bool(item["leaked"]) and kind == "wrong" and in_question
    goal = f"every seed ≤ {LEAK_GOAL}"
    columns = ["cell", "seeds", "leak rate (mean of seeds)", "per seed (mean over steps)", "worst step", goal,
               "logged: right drafts leaking", "logged: wrong drafts leaking", "of which the gold is in the question"]
    rows = [{"cell": cell, "seeds": len(seeds), "leak rate (mean of seeds)": statistics.fmean(m for m, _ in seeds),
             "per seed (mean over steps)": " ".join(f"{m:.3f}" for m, _ in seeds),
             "worst step": max(w for _, w in seeds), goal: all(m <= LEAK_GOAL for m, _ in seeds),
             "logged: right drafts leaking": f"{logged[cell]['right leaked']} / {logged[cell]['right']}",
             "logged: wrong drafts leaking": f"{logged[cell]['wrong leaked']} / {logged[cell]['wrong']}",
             "of which the gold is in the question": logged[cell]["gold in question"]}
            for cell, seeds in sorted(per_cell.items())]
    return pd.DataFrame(rows, columns=columns)
