"""The paper's headline numbers (DESIGN.md §1), quoted as reference, and which of our runs each matches.

The paper's numbers are Qwen3-0.6B on DeepMath-hard; ours are whatever profile
the results table comes from. They are put side by side to compare *orderings
and gaps*, not absolute values — on the ``cpu`` profile (a 135M model on
arithmetic word problems) the absolute numbers cannot match.

Our value for a row: the Agon-style cells report the deployment mode, the
``A→B`` cascade (``cascade_AB``; ``B→A`` is given beside it); vanilla GRPO
reports its one adapter (``grpo``); the untrained MoA baseline is ``moa``.
Several seeds of one cell are averaged. A run's cell is its run name without a
``-seed<k>`` suffix (the naming of :func:`agonlib.pipeline.run_name_for`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

from ..evaluation import mean_interval


@dataclass(frozen=True)
class PaperRow:
    label: str
    paper_pass1: float | None  # None: the paper reports no number for this run
    cell: str | None  # our experiment cell (experiments/cells.yaml); None: not run here
    system: str  # the system of final_eval.json that stands for the row


# DESIGN.md §1, in the paper's order (lowest first), plus our extra runs.
PAPER_ROWS = (
    PaperRow("untrained MoA", 0.076, None, "moa"),  # "~7.6% (61/8)"
    PaperRow("vanilla GRPO", 0.30, "grpo", "grpo"),
    PaperRow("vanilla GRPO, 2N (compute-matched)", None, "grpo_2n", "grpo"),
    PaperRow("competition, no exchange", 0.32, "comp_no_exchange", "cascade_AB"),
    PaperRow("cooperation + exchange", 0.46, "coop_exchange", "cascade_AB"),
    PaperRow("cooperation, no exchange", None, "coop_no_exchange", "cascade_AB"),
    PaperRow("Agon, fixed roles", 0.52, "fixed_roles", "cascade_AB"),
    PaperRow("vanilla GRPO on Qwen3-4B", 0.59, None, "(not run: 4B base)"),
    PaperRow("Agon (competition + exchange, rotating)", 0.61, "agon", "cascade_AB"),
)

#: Final-stage trace length in tokens (DESIGN.md §1): Agon vs vanilla GRPO.
PAPER_FINAL_LEN = {"agon": 3500, "grpo": 8100}
PAPER_SETTING = "Qwen3-0.6B, DeepMath-hard"

#: Short labels of our cells, used in every figure legend.
CELL_LABELS = {
    "agon": "Agon",
    "fixed_roles": "Agon, fixed roles",
    "coop_exchange": "coop. + exchange",
    "comp_no_exchange": "comp., no exchange",
    "coop_no_exchange": "coop., no exchange",
    "grpo": "GRPO (N)",
    "grpo_2n": "GRPO (2N)",
}


def cell_of(run_name: str) -> str:
    """``agon-seed2`` → ``agon``."""
    return re.sub(r"-seed\d+$", "", str(run_name))


def _interval(mine) -> tuple[float | None, float | None]:
    """95% interval of our value: across seeds (t) with two or more, else the one run's Wilson interval."""
    if not len(mine):
        return None, None
    if len(mine) > 1:
        _, low, high = mean_interval(mine["pass@1"])
        return low, high
    first = mine.iloc[0]
    low, high = first.get("pass@1_lo"), first.get("pass@1_hi")
    return (None if low != low else low), (None if high != high else high)


def comparison(table):
    """The paper's table beside ours, one row per :data:`PAPER_ROWS` entry (a DataFrame).

    ``table`` is the results table (:func:`agonlib.results.collect`, one row per
    run and system). Columns: the paper's label and pass@1, our pass@1 (mean over
    seeds) with its 95% interval (across seeds with several, else Wilson) and the
    system it comes from, ``B→A`` for the cascades, the per-seed values, the runs
    used and the number of held-out problems.
    """
    rows = []
    evaluated = table[table["pass@1"].notna()] if len(table) else table
    cells = evaluated["run"].map(cell_of) if len(evaluated) else pd.Series(dtype=str)
    for row in PAPER_ROWS:
        if row.system == "moa":
            mine = evaluated[evaluated["system"] == "moa"]
        elif row.cell is None:
            mine = evaluated.iloc[0:0]
        else:
            mine = evaluated[(cells == row.cell) & (evaluated["system"] == row.system)]
        other = (evaluated[(cells == row.cell) & (evaluated["system"] == "cascade_BA")]
                 if row.system == "cascade_AB" else evaluated.iloc[0:0])
        low, high = _interval(mine)
        rows.append({
            "run": row.label,
            "paper pass@1": row.paper_pass1,
            "ours pass@1": float(mine["pass@1"].mean()) if len(mine) else None,
            "ours low": low,
            "ours high": high,
            "ours system": row.system,
            "ours B→A": float(other["pass@1"].mean()) if len(other) else None,
            "per seed": [round(float(v), 4) for v in mine["pass@1"]],
            "our runs": ", ".join(sorted(set(mine["run"]))) or "—",
            "n_problems": int(mine["n_problems"].max()) if len(mine) and mine["n_problems"].notna().any() else None,
        })
    return pd.DataFrame(rows)
