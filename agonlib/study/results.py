"""The results table: every recorded run of a profile, read only from run directories.

``collect(profile)`` reads ``experiments/runs/<profile>/*/`` (``config.json``,
``metrics.jsonl``, ``final_eval.json``) into one pandas DataFrame — one row per
(run, system) — and writes ``experiments/results/<profile>.csv`` and ``.md``.
Runs without a ``final_eval.json`` are listed with their training figures only.
Nothing is re-evaluated here: evaluation writes ``final_eval.json`` once
(``agonlib.evaluate``, in ``agonlib.evaluation``), and this module only reads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd

from ..config import REPO_ROOT, RUNS_DIR
from ..evaluation import mean_interval
from ..runs import read_jsonl, recorded_config
from .paper import cell_of
from .verdict import ORDERINGS_HEADING, leak_rates, orderings

log = logging.getLogger(__name__)

RESULTS_DIR = REPO_ROOT / "experiments" / "results"
COLUMNS = ["run", "system", "pass@1", "pass@1_lo", "pass@1_hi", "pass@k", "mean_final_len", "tokens_per_problem",
           "n_problems", "steps", "eval_step", "wall_time_s", "seed"]
SEED_COLUMNS = ["cell", "system", "seeds", "pass@1 mean", "pass@1_lo", "pass@1_hi", "per seed", "mean_final_len"]


def run_rows(run_dir: Path) -> list[dict]:
    """One row per evaluated system of a run directory (or one training-only row)."""
    config = recorded_config(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    common = {
        "run": config.get("run_name", run_dir.name),
        "steps": metrics[-1]["step"] if metrics else 0,
        "wall_time_s": sum(r.get("time/step_s", 0.0) for r in metrics),
        "seed": config.get("seed"),
        "eval_step": None,
    }
    final = run_dir / "final_eval.json"
    if not final.exists():
        return [{**common, "system": "(not evaluated)"}]
    evaluation = json.loads(final.read_text())
    checkpoint = (evaluation.get("meta") or {}).get("checkpoint")
    # The step of the checkpoint that was evaluated (training may have gone on past it).
    common["eval_step"] = int(checkpoint.rsplit("step-", 1)[1]) if checkpoint and "step-" in checkpoint else None
    rows = []
    for system, res in evaluation.items():
        if not isinstance(res, dict) or "pass@1" not in res:
            continue
        ks = sorted((key for key in res if key.startswith("pass@") and key[5:].isdigit() and key != "pass@1"),
                    key=lambda key: int(key.split("@")[1]))
        low, high = res.get("pass@1_ci") or (None, None)
        rows.append({
            **common, "system": system, "pass@1": res["pass@1"], "pass@1_lo": low, "pass@1_hi": high,
            "pass@k": res[ks[-1]] if ks else None,
            "mean_final_len": res.get("mean_final_len"), "tokens_per_problem": res.get("tokens_per_problem"),
            "n_problems": res.get("n_problems"),
        })
    return rows


def collect(profile: str, runs_dir: str | Path | None = None, write: bool = True):
    """Every recorded run of ``profile`` as a DataFrame; also written as CSV and Markdown."""
    root = Path(runs_dir) if runs_dir else RUNS_DIR / profile
    rows = []
    for run_dir in sorted(p for p in root.glob("*") if (p / "config.json").exists()):
        rows.extend(run_rows(run_dir))
    table = pd.DataFrame(rows, columns=COLUMNS)
    if write:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        table.to_csv(RESULTS_DIR / f"{profile}.csv", index=False)
        (RESULTS_DIR / f"{profile}.md").write_text(report(table, root) + "\n")
    return table


def across_seeds(table):
    """One row per (cell, system): the mean pass@1 over seeds with a 95% t-interval (DESIGN.md §8).

    A cell's runs are its seeds (``agon``, ``agon-seed1`` …). With one seed the
    interval is that run's Wilson interval over the held-out problems. A seed evaluated twice counts
    once, its later row (as in the verdict, ``verdict.load_evaluations``), with a warning; seeds
    evaluated on different numbers of problems are averaged with a warning that says so.
    """
    evaluated = table[table["pass@1"].notna()] if len(table) else table
    rows = []
    for (cell, system), group in evaluated.groupby([evaluated["run"].map(cell_of), "system"], sort=True):
        repeated = group["seed"].duplicated(keep="last") & group["seed"].notna()
        if repeated.any():
            log.warning("Cell %s, system %s: seed(s) %s evaluated more than once; the later run counts.",
                        cell, system, sorted(set(group.loc[repeated, "seed"])))
            group = group[~repeated]
        if group["n_problems"].nunique() > 1:
            log.warning("Cell %s, system %s: its seeds were evaluated on different numbers of problems (%s); "
                        "their mean mixes those evaluations.", cell, system, sorted(set(group["n_problems"])))
        mean, low, high = mean_interval(group["pass@1"])
        if len(group) == 1:
            low, high = group["pass@1_lo"].iloc[0], group["pass@1_hi"].iloc[0]
        rows.append({"cell": cell, "system": system, "seeds": len(group), "pass@1 mean": mean,
                     "pass@1_lo": low, "pass@1_hi": high,
                     "per seed": " ".join(f"{v:.3f}" for v in group["pass@1"]),
                     "mean_final_len": float(group["mean_final_len"].mean())})
    return pd.DataFrame(rows, columns=SEED_COLUMNS)


def across_reports(reports):
    """:func:`across_seeds` over the seeds of several committed results tables (``<name>.csv``), read alone.

    What ``python -m agonlib verdict --out`` writes beside the orderings: every system's mean pass@1 over
    all the reports' seeds, with its interval. The verdict has already refused a seed two reports share.
    """
    tables = [pd.read_csv(Path(report).with_suffix(".csv")) for report in reports]
    return across_seeds(pd.concat(tables, ignore_index=True))


def comparisons(runs_dir: str | Path):
    """Every paired comparison recorded in the runs' ``final_eval.json`` (exact McNemar), a DataFrame."""
    rows = []
    for run_dir in sorted(p for p in Path(runs_dir).glob("*") if (p / "final_eval.json").exists()):
        found = json.loads((run_dir / "final_eval.json").read_text()).get("comparisons") or {}
        rows += [{"run": run_dir.name, "comparison": name, **test} for name, test in sorted(found.items())]
    return pd.DataFrame(rows, columns=["run", "comparison", "n", "fixed", "broken", "p_value"])


def report(table, runs_dir: str | Path) -> str:
    """The Markdown results file: the paper's orderings judged, seeds aggregated with intervals,
    training leak rates, paired tests within runs, then every run."""
    parts = [f"{ORDERINGS_HEADING} (difference first − second: mean over seeds, 95% interval; "
             "agonlib.study.verdict)", "", to_markdown(orderings(runs_dir)),
             "", "## pass@1 across seeds (mean, 95% interval; one seed: Wilson)", "", to_markdown(across_seeds(table)),
             "", "## Training leak rate of the exchange cells (summaries that still state the gold)", "",
             to_markdown(leak_rates(runs_dir)),
             "", "## Paired comparisons within each run (same problems, same seeds; exact McNemar)", "",
             to_markdown(comparisons(runs_dir)), "", "## Every run", "", to_markdown(table)]
    return "\n".join(parts)


def to_markdown(table) -> str:
    """A GitHub table without the optional ``tabulate`` dependency."""
    def cell(v):
        if v is None or (not isinstance(v, (list, tuple)) and pd.isna(v)):
            return "—"
        if isinstance(v, float):
            return f"{v:.3f}" if v == 0 or abs(v) >= 0.001 else f"{v:.1e}"  # small p-values keep their size
        return str(v)

    head = "| " + " | ".join(table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([head, rule, *body])
