"""Every figure of the reproduction, drawn only from run files (STYLE.md item 9).

Inputs, nothing else: ``runs/<profile>/<run>/{config.json, metrics.jsonl,
eval.jsonl, final_eval.json, rollouts.jsonl}`` and ``results/<profile>.csv``
(folders from :mod:`agonlib.paths`). Outputs: ``figures/<profile>/<name>.png``
and ``.svg``, one consistent style, titles naming the profile and the number of
seeds. Figures are drawn on matplotlib ``Figure`` objects with the Agg canvas —
no pyplot, no GUI backend, no global figure state — and saved byte-for-byte
reproducibly (fixed SVG ids, no timestamps), so rerunning a figure notebook on
the same run files rewrites identical files.

What each figure reads:

* ``pass1_over_training`` — ``eval.jsonl`` (periodic held-out pass@1 of the
  headline system: ``cascade_AB`` for Agon-style runs, ``grpo`` for vanilla
  GRPO) and ``metrics.jsonl`` (the drafter's training accuracy each step).
* ``final_pass1`` — ``results/<profile>.csv`` beside the paper's numbers
  (:mod:`agonlib.paper`).
* ``length_over_training`` — ``metrics.jsonl``: mean completion length per role.
* ``final_length_distribution`` — ``final_eval.json``'s per-item
  ``final_len_distribution`` of the headline system; a run without a final
  evaluation falls back to its last logged rollouts (``rollouts.jsonl``), and
  the legend says so.
* ``accuracy_vs_length`` — every logged rollout (``rollouts.jsonl``: length and
  correctness of drafts and challenges), binned by length; and each evaluated
  system's mean final length against its pass@1 (``final_eval.json``).
* ``conversion_rates`` — ``metrics.jsonl``: conversion (challenger right where
  the drafter was wrong), regression and tiebreak rates.
* ``ab_divergence`` — ``eval.jsonl``: the relative Frobenius distance of the two
  adapters' weight updates (``A_B_weight_divergence``, logged at every periodic
  evaluation) and how often A and B give different answers
  (``A_B_disagreement``); the final evaluation's disagreement as a star.

Not saved with the others: ``learning_curve`` — one run's (or a few runs')
``eval.jsonl`` pass@1 per system and ``metrics.jsonl`` accuracy per role, which
the training notebooks show inline (:mod:`agonlib.study.notebook`).

A figure whose inputs are missing is still written, with a note saying which
files to produce (and a logged warning): the set of figure files never depends
on how far the runs got.
"""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..runs import read_jsonl
from .paper import CELL_LABELS, PAPER_FINAL_LEN, PAPER_ROWS, PAPER_SETTING, cell_of, comparison
from .paths import output_paths

log = logging.getLogger(__name__)

STYLE = {
    "figure.dpi": 100, "savefig.dpi": 150, "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9,
    "figure.titlesize": 11, "legend.fontsize": 8, "legend.frameon": False, "axes.grid": True,
    "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False, "lines.linewidth": 1.6,
    "lines.markersize": 4, "svg.hashsalt": "agon", "svg.fonttype": "none",
}
CELL_ORDER = ("agon", "fixed_roles", "coop_exchange", "comp_no_exchange", "coop_no_exchange", "grpo", "grpo_2n")
CELL_COLORS = {"agon": "#d62728", "fixed_roles": "#ff7f0e", "coop_exchange": "#2ca02c",
               "comp_no_exchange": "#9467bd", "coop_no_exchange": "#8c564b", "grpo": "#1f77b4",
               "grpo_2n": "#17becf"}
OTHER_COLOR = "#7f7f7f"
PAPER_COLOR = "#bdbdbd"
NOTE_STYLE = dict(ha="center", va="center", fontsize=9, color="#555555", wrap=True)
LENGTH_FIGURES = ("length_over_training", "final_length_distribution", "accuracy_vs_length")
RESULTS_FIGURES = ("pass1_over_training", "final_pass1", "conversion_rates", "ab_divergence")


# --- run files ----------------------------------------------------------------------------

@dataclass
class Run:
    """The files of one run directory, as read from disk."""

    name: str
    dir: Path
    config: dict
    metrics: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    final: dict | None = None
    rollouts: list = field(default_factory=list)

    @property
    def cell(self) -> str:
        return cell_of(self.config.get("run_name", self.name))

    @property
    def seed(self):
        return self.config.get("seed")

    @property
    def is_agon(self) -> bool:
        return self.config.get("mode", "agon") == "agon"

    @property
    def headline(self) -> str:
        """The system that stands for the run: the A→B cascade, or the GRPO adapter."""
        return "cascade_AB" if self.is_agon else "grpo"

    @property
    def color(self) -> str:
        return CELL_COLORS.get(self.cell, OTHER_COLOR)

    @property
    def label(self) -> str:
        base = CELL_LABELS.get(self.cell, self.name)
        return base if not self.seed else f"{base}, seed {self.seed}"


def load_run(path: str | Path) -> Run | None:
    """One run directory's files; ``None`` (with a logged warning) when ``config.json`` is missing or unreadable."""
    path = Path(path)
    if not (path / "config.json").is_file():
        log.warning("Skipping %s: no config.json (not a run directory, or its run never started).", path)
        return None
    try:
        config = json.loads((path / "config.json").read_text())["config"]
        final = json.loads((path / "final_eval.json").read_text()) if (path / "final_eval.json").exists() else None
    except (json.JSONDecodeError, KeyError) as err:
        log.warning("Skipping %s: unreadable config.json or final_eval.json (%s).", path, err)
        return None
    return Run(name=path.name, dir=path, config=config, metrics=read_jsonl(path / "metrics.jsonl"),
               evals=read_jsonl(path / "eval.jsonl"), final=final, rollouts=read_jsonl(path / "rollouts.jsonl"))


def load_runs(runs_dir: str | Path) -> list[Run]:
    """Every run directory under ``runs_dir`` (those with a ``config.json``), in the cells' order."""
    found = (load_run(path) for path in sorted(Path(runs_dir).glob("*")) if (path / "config.json").is_file())
    runs = [run for run in found if run is not None]
    order = {cell: i for i, cell in enumerate(CELL_ORDER)}
    return sorted(runs, key=lambda r: (order.get(r.cell, len(order)), r.seed or 0, r.name))


# --- helpers ------------------------------------------------------------------------------

@dataclass
class FigureFile:
    """One saved figure: its files and the data it plots (plain JSON values)."""

    name: str
    paths: list[Path]
    data: dict
    note: str | None = None  # why parts of the figure are empty


def _new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    fig = Figure(figsize=(width * ncols if ncols > 1 else width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _seeds_text(runs) -> str:
    n = len({r.seed for r in runs})
    return f"{n} seed" + ("" if n == 1 else "s")


def _title(fig, what: str, profile: str, runs) -> None:
    runs = list(runs)
    tail = f"profile {profile} · {_seeds_text(runs)} · {len(runs)} run" + ("" if len(runs) == 1 else "s")
    fig.suptitle(f"{what}\n{tail}" if runs else f"{what}\nprofile {profile} · no runs yet")


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, **NOTE_STYLE)


def _save(fig, fig_dir: Path, name: str, data: dict, notes: list[str]) -> FigureFile:
    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = [fig_dir / f"{name}.png", fig_dir / f"{name}.svg"]
    fig.savefig(paths[0], metadata={"Software": None})
    fig.set_layout_engine("none")  # keep the layout just computed: the SVG needs no second pass
    fig.savefig(paths[1], metadata={"Date": None, "Creator": None})
    note = " ".join(notes) or None
    data = {"title": fig.get_suptitle(), **data}
    if note:
        log.warning("Figure %s: %s", name, note)
    return FigureFile(name=name, paths=paths, data=data, note=note)


def _num(value) -> float:
    """A logged value as a float; ``None`` (NaN written as null) stays NaN."""
    return float("nan") if value is None else float(value)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(int(r["step"]), _num(r[key])) for r in rows if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _rolling(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values, NaNs ignored (NaN where a window holds none)."""
    out = []
    for i in range(len(values)):
        got = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(got) / len(got) if got else float("nan"))
    return out


def _window(runs) -> int:
    longest = max((len(r.metrics) for r in runs), default=0)
    return max(1, round(longest / 10))


def _smoothing_text(window: int) -> str:
    return f" (trailing mean over {window} steps)" if window > 1 else ""


def _clean(values) -> list:
    return [None if isinstance(v, float) and math.isnan(v) else v for v in values]


def _legend(fig, axes) -> None:
    """One legend for the whole figure, below the panels: each run once, however many panels show it."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(4, len(handles)))


def _line(ax, run: Run, xs, ys, data: dict, key: str, **kw) -> None:
    """One run's series against training steps (integer ticks; markers where points are few)."""
    marker = "o" if len(xs) <= 12 else None
    ax.plot(xs, ys, color=run.color, marker=marker, label=run.label, **kw)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    data.setdefault(key, {})[run.name] = {"x": list(xs), "y": _clean(ys)}


def _cells(runs: list[Run]) -> list[list[Run]]:
    """Runs grouped by cell (its seeds together), in the order of ``runs``."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.cell, []).append(run)
    return list(groups.values())


def _curves(ax, runs: list[Run], series, data: dict, key: str) -> list[str]:
    """One curve per cell: a single run as it is; several seeds as their mean, with a band from min to max.

    ``series(run) -> (steps, values)``. The mean is taken at the steps every seed logged (a note
    says when a seed logged steps the others did not); the data keeps each seed's values beside
    it (``data[key][cell]``); a single run stays under its own name. Returns the notes.
    """
    notes = []
    for seeds in _cells(runs):
        if len(seeds) == 1:
            xs, ys = series(seeds[0])
            _line(ax, seeds[0], xs, ys, data, key)
            continue
        per_seed = [dict(zip(*series(run))) for run in seeds]
        steps = sorted(set.intersection(*(set(values) for values in per_seed)))
        if any(len(values) > len(steps) for values in per_seed):
            notes.append(f"{key}: {seeds[0].cell}'s mean covers the {len(steps)} steps all its seeds logged "
                         f"(one seed logged {max(len(v) for v in per_seed)}).")
        columns = [[values[step] for values in per_seed] for step in steps]
        mean = [_nanmean(col) for col in columns]
        low = [min((v for v in col if not math.isnan(v)), default=float("nan")) for col in columns]
        high = [max((v for v in col if not math.isnan(v)), default=float("nan")) for col in columns]
        run = seeds[0]
        marker = "o" if len(steps) <= 12 else None
        label = f"{CELL_LABELS.get(run.cell, run.cell)} ({len(seeds)} seeds)"
        ax.plot(steps, mean, color=run.color, marker=marker, label=label)
        ax.fill_between(steps, low, high, color=run.color, alpha=0.15, linewidth=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        data.setdefault(key, {})[run.cell] = {"x": steps, "y": _clean(mean), "low": _clean(low),
                                              "high": _clean(high), "seeds": {r.name: _clean([v[s] for s in steps])
                                                                            for r, v in zip(seeds, per_seed)}}
    return notes


def _nanmean(values) -> float:
    got = [v for v in values if not math.isnan(v)]
    return sum(got) / len(got) if got else float("nan")


def _periodic_systems(runs: list[Run]) -> dict[str, str]:
    """Per cell, the system its periodic evaluations scored: the headline (the cascade, the GRPO adapter)
    when every seed logged it, else the first one every seed logged (``A`` on the cpu profile)."""
    chosen = {}
    for seeds in _cells(runs):
        common = set.intersection(*(set(_evaluated_systems(run)) for run in seeds))
        ordered = [s for s in _evaluated_systems(seeds[0]) if s in common]
        if ordered:
            chosen[seeds[0].cell] = seeds[0].headline if seeds[0].headline in common else ordered[0]
    return chosen


# --- figures --------------------------------------------------------------------------------

def pass1_over_training(runs: list[Run], profile: str, fig_dir: Path) -> FigureFile:
    fig, (ax_eval, ax_train) = _new_figure(2, 5.2, 4.0)
    data, notes = {}, []
    system = _periodic_systems(runs)
    evaluated = [r for r in runs if r.cell in system]
    notes += _curves(ax_eval, evaluated, lambda run: _series(run.evals, f"{system[run.cell]}/pass@1"), data,
                     "eval_pass1")
    if not evaluated:
        notes.append("No periodic evaluations (eval.jsonl) yet.")
        _note(ax_eval, "no periodic evaluations yet\n(eval.jsonl is written every eval_every steps)")
    shown = sorted(set(system.values()), key=lambda s: (s != "cascade_AB", s))
    ax_eval.set(title="held-out pass@1 at periodic evaluations\n(" + ", ".join(shown or ["—"])
                + "; the GRPO adapter as grpo)", xlabel="training step", ylabel="pass@1", ylim=(-0.02, 1.02))
    window = _window(runs)
    trained = [r for r in runs if r.metrics]
    notes += _curves(ax_train, trained, lambda run: _rolled(run, "drafter/accuracy", window), data,
                     "train_accuracy")
    if not trained:
        notes.append("No training metrics (metrics.jsonl) yet.")
        _note(ax_train, "no training steps logged yet\n(run the training notebooks 01–06)")
    ax_train.set(title="drafter accuracy on training problems" + _smoothing_text(window), xlabel="training step",
                 ylabel="accuracy", ylim=(-0.02, 1.02))
    _legend(fig, (ax_eval, ax_train))
    _title(fig, "pass@1 over training" + _band_text(runs), profile, runs)
    return _save(fig, fig_dir, "pass1_over_training", data, notes)


def _rolled(run: Run, key: str, window: int) -> tuple[list[int], list[float]]:
    xs, ys = _series(run.metrics, key)
    return xs, _rolling(ys, window)


def _band_text(runs) -> str:
    return " · several seeds: mean, band min–max" if any(len(seeds) > 1 for seeds in _cells(runs)) else ""


def final_pass1(results_csv: Path, profile: str, fig_dir: Path) -> FigureFile:
    fig, (ax,) = _new_figure(1, 10.0, 4.6)
    notes = []
    table = pd.read_csv(results_csv) if results_csv.exists() else None
    if table is None:
        notes.append(f"No results table at {results_csv}.")
    compare = comparison(table if table is not None else pd.DataFrame(columns=["run", "system", "pass@1",
                                                                             "n_problems", "seed"]))
    x = list(range(len(compare)))
    width = 0.38
    paper = [v if v == v and v is not None else 0.0 for v in compare["paper pass@1"]]
    ours = compare["ours pass@1"].tolist()
    ax.bar([i - width / 2 for i in x], paper, width, color=PAPER_COLOR, hatch="//", edgecolor="white",
           label=f"paper ({PAPER_SETTING}), quoted")
    colors = [CELL_COLORS.get(row.cell, OTHER_COLOR) for row in PAPER_ROWS]
    ours_h = [v if v is not None and v == v else 0.0 for v in ours]
    ax.bar([i + width / 2 for i in x], ours_h, width, color=colors)
    for i, row in compare.iterrows():  # 95% intervals: across seeds, or Wilson for one seed
        low, high = row.get("ours low"), row.get("ours high")
        if low is not None and high is not None and low == low and high == high:
            ax.errorbar(i + width / 2, ours_h[i], yerr=[[ours_h[i] - low], [high - ours_h[i]]], fmt="none",
                        ecolor="black", capsize=3, linewidth=1)
    labelled_ba = False
    for i, row in compare.iterrows():
        if row["paper pass@1"] is not None and row["paper pass@1"] == row["paper pass@1"]:
            ax.text(i - width / 2, row["paper pass@1"] + 0.01, f"{row['paper pass@1']:.0%}", ha="center",
                    va="bottom", fontsize=7)
        else:
            ax.text(i - width / 2, 0.01, "no\npaper\nvalue", ha="center", va="bottom", fontsize=6, color="#777777")
        if row["ours pass@1"] is not None and row["ours pass@1"] == row["ours pass@1"]:
            ax.text(i + width / 2, row["ours pass@1"] + 0.01, f"{row['ours pass@1']:.0%}", ha="center",
                    va="bottom", fontsize=7)
            if len(row["per seed"]) > 1:
                ax.plot([i + width / 2] * len(row["per seed"]), row["per seed"], "k.", markersize=3)
        else:
            ax.text(i + width / 2, 0.01, "not\nrun" if PAPER_ROWS[i].cell or PAPER_ROWS[i].system == "moa"
                    else "not\nrun\n(4B)", ha="center", va="bottom", fontsize=6, color="#777777")
        if row["ours B→A"] is not None and row["ours B→A"] == row["ours B→A"]:
            ax.plot(i + width / 2, row["ours B→A"], "kD", markersize=4,
                    label=None if labelled_ba else "ours, B→A cascade")
            labelled_ba = True
    top = max([*paper, *ours_h, 0.0])
    ax.set(xticks=x, ylabel="pass@1 (held-out)", ylim=(0, max(0.7, top + 0.12)))
    ax.set_xticklabels([r.label for r in PAPER_ROWS], rotation=20, ha="right")

    handles, labels = ax.get_legend_handles_labels()
    handles.append(Patch(facecolor="#555555", label=f"ours (profile {profile}), coloured by run"))
    ax.legend(handles=handles, loc="upper left")
    n_problems = compare["n_problems"].dropna()
    sub = "ours: A→B cascade (◆ B→A), GRPO adapter, untrained MoA; mean over seeds, 95% interval" + (
        f"; {int(n_problems.max())} held-out problems" if len(n_problems) else "")
    ax.set_title(sub, fontsize=8)
    if table is not None and not len(compare["ours pass@1"].dropna()):
        notes.append("The results table has no evaluated runs (run 07_evaluation).")
        _note(ax, "no evaluated runs in the results table yet (run 07_evaluation, then 09_results)")
    elif table is None:
        _note(ax, f"no results table yet ({results_csv.name}): run 07_evaluation, then 09_results")
    seeds = table["seed"].dropna().unique() if table is not None and "seed" in table else []
    n_seeds = len(seeds)
    fig.suptitle(f"Final pass@1: the paper beside ours\nprofile {profile} · {n_seeds} seed"
                 + ("" if n_seeds == 1 else "s"))
    data = {"comparison": json.loads(compare.to_json(orient="records"))}
    return _save(fig, fig_dir, "final_pass1", data, notes)


def length_over_training(runs: list[Run], profile: str, fig_dir: Path) -> FigureFile:
    fig, axes = _new_figure(2, 5.2, 4.0)
    data, notes = {}, []
    window = _window(runs)
    for ax, role in zip(axes, ("drafter", "challenger")):
        shown = [r for r in runs if any(f"{role}/len_mean" in row for row in r.metrics)]
        notes += _curves(ax, shown, lambda run, role=role: _rolled(run, f"{role}/len_mean", window), data, role)
        if not shown:
            notes.append(f"No {role} lengths logged.")
            _note(ax, f"no {role} completions logged yet" + ("\n(vanilla GRPO has no challenger)"
                                                             if role == "challenger" else ""))
        ax.set(title=f"{role} completion length" + _smoothing_text(window), xlabel="training step",
               ylabel="mean completion length (tokens)")
    _legend(fig, axes)
    _title(fig, "Trace length over training, per role" + _band_text(runs), profile, runs)
    return _save(fig, fig_dir, "length_over_training", data, notes)


def _final_lengths(run: Run) -> tuple[list[int], str] | None:
    """The headline system's final-stage lengths, and where they come from."""
    if run.final and isinstance(run.final.get(run.headline), dict):
        lens = run.final[run.headline].get("final_len_distribution")
        if lens:
            return [int(v) for v in lens], f"final eval, {run.headline}"
    if run.rollouts:
        last = run.rollouts[-1]
        key = "challenge_len" if run.is_agon else "draft_len"
        lens = [item[key] for p in last.get("problems", []) for item in p.get("rollouts", []) if key in item]
        if lens:
            return [int(v) for v in lens], f"logged rollouts, step {last.get('step')}"
    return None


def final_length_distribution(runs: list[Run], profile: str, fig_dir: Path) -> FigureFile:
    fig, (ax_hist, ax_box) = _new_figure(2, 5.2, 4.0)
    data, notes = {}, []
    found = {r.name: _final_lengths(r) for r in runs}
    found = {k: v for k, v in found.items() if v is not None}
    focus = [r for r in runs if r.name in found and r.cell in ("agon", "grpo", "grpo_2n")]
    if focus:
        everything = [v for r in focus for v in found[r.name][0]]
        lo, hi = min(everything), max(everything)
        bins = [lo - 0.5, hi + 0.5] if lo == hi else 20
        for run in focus:
            lens, source = found[run.name]
            ax_hist.hist(lens, bins=bins, range=None if lo == hi else (lo, hi), histtype="step", linewidth=1.8,
                         color=run.color, label=f"{run.label} ({source})")
        ax_hist.legend(loc="best")
    else:
        notes.append("No final-stage lengths for the Agon or GRPO runs.")
        _note(ax_hist, "no final evaluation or logged rollouts\nfor the Agon / GRPO runs yet")
    ax_hist.set(title="Agon vs vanilla GRPO", xlabel="final-stage length (tokens)", ylabel="count")
    shown = [r for r in runs if r.name in found]
    if shown:
        box = ax_box.boxplot([found[r.name][0] for r in shown], orientation="horizontal", showmeans=True,
                             patch_artist=True, tick_labels=[r.label for r in shown],
                             medianprops={"color": "black"},
                             meanprops={"marker": "^", "markerfacecolor": "black", "markeredgecolor": "black"})
        for patch, run in zip(box["boxes"], shown):
            patch.set(facecolor=run.color, alpha=0.45)
        ax_box.invert_yaxis()
    else:
        _note(ax_box, "no runs with final-stage lengths yet")
    ax_box.set(title="every run (headline system; ▲ mean)", xlabel="final-stage length (tokens)")
    for run in shown:
        data[run.name] = {"lengths": found[run.name][0], "source": found[run.name][1]}
    paper = f"paper ({PAPER_SETTING}): ~{PAPER_FINAL_LEN['agon'] / 1000:.1f}k (Agon) vs " \
            f"~{PAPER_FINAL_LEN['grpo'] / 1000:.1f}k tokens (GRPO)"
    _title(fig, f"Final-stage length distributions — {paper}", profile, shown or runs)
    return _save(fig, fig_dir, "final_length_distribution", data, notes)


def accuracy_vs_length(runs: list[Run], profile: str, fig_dir: Path) -> FigureFile:
    fig, (ax_bins, ax_eval) = _new_figure(2, 5.2, 4.0)
    data, notes = {}, []
    logged = {}
    for run in runs:
        pairs = []
        for record in run.rollouts:
            for problem in record.get("problems", []):
                for item in problem.get("rollouts", []):
                    pairs.append((item["draft_len"], item["draft_correct"]))
                    if "challenge_len" in item:
                        pairs.append((item["challenge_len"], item["challenge_correct"]))
        if pairs:
            logged[run.name] = pairs
    if logged:
        top = max(max(L for L, _ in p) for p in logged.values())
        cap = max([r.config.get("max_new_tokens", 0) for r in runs] + [top])
        n_bins = 8
        edges = [cap * i / n_bins for i in range(n_bins + 1)]
        for run in (r for r in runs if r.name in logged):
            xs, ys, ns = [], [], []
            for lo, hi in zip(edges, edges[1:]):
                inside = [c for L, c in logged[run.name] if lo < L <= hi or (lo == 0 and L == 0)]
                if inside:
                    xs.append((lo + hi) / 2)
                    ys.append(sum(inside) / len(inside))
                    ns.append(len(inside))
            ax_bins.plot(xs, ys, color=run.color, label=run.label)
            ax_bins.scatter(xs, ys, s=[6 + 40 * n / max(ns) for n in ns], color=run.color)
            data.setdefault("binned", {})[run.name] = {"x": xs, "accuracy": ys, "n": ns}
        ax_bins.legend(loc="best")
    else:
        notes.append("No logged rollouts (rollouts.jsonl).")
        _note(ax_bins, "no logged rollouts yet")
    ax_bins.set(title="logged training rollouts (drafts + challenges;\nmarker size ∝ count)",
                xlabel="completion length (tokens, binned)", ylabel="accuracy", ylim=(-0.02, 1.02))
    markers = {"base": "s", "moa": "P", "A": "^", "B": "v", "cascade_AB": "o", "cascade_BA": "D", "grpo": "o"}
    evaluated = [r for r in runs if r.final]
    for run in evaluated:
        for system, res in run.final.items():
            if isinstance(res, dict) and "pass@1" in res:
                ax_eval.scatter(res["mean_final_len"], res["pass@1"], color=run.color,
                                marker=markers.get(system, "o"), s=30)
                data.setdefault("final", []).append({"run": run.name, "system": system,
                                                     "mean_final_len": res["mean_final_len"],
                                                     "pass@1": res["pass@1"]})
    if evaluated:
        handles = [Line2D([], [], color=r.color, marker="o", linestyle="", label=r.label) for r in evaluated]
        seen = sorted({d["system"] for d in data.get("final", [])}, key=list(markers).index)
        handles += [Line2D([], [], color="k", marker=markers[s], linestyle="", label=s) for s in seen]
        ax_eval.legend(handles=handles, loc="best", ncols=2)
    else:
        notes.append("No final evaluations (final_eval.json).")
        _note(ax_eval, "no final evaluations yet (run 07_evaluation)")
    ax_eval.set(title="final evaluation, every system", xlabel="mean final-stage length (tokens)",
                ylabel="pass@1", ylim=(-0.02, 1.02))
    _title(fig, "Accuracy vs length", profile, runs)
    return _save(fig, fig_dir, "accuracy_vs_length", data, notes)


def conversion_rates(runs: list[Run], profile: str, fig_dir: Path) -> FigureFile:
    fig, axes = _new_figure(3, 4.0, 4.0)
    data, notes = {}, []
    agon = [r for r in runs if r.is_agon and r.metrics]
    window = _window(agon)
    panels = (("challenger/conversion_rate_given_wrong", "conversion: challenger right | drafter wrong"),
              ("challenger/regression_rate_given_right", "regression: challenger wrong | drafter right"),
              ("challenger/tiebreak_rate", "tiebreak: challenger shorter | both right"))
    for ax, (key, title) in zip(axes, panels):
        notes += _curves(ax, agon, lambda run, key=key: _rolled(run, key, window), data, key.split("/")[1])
        if not agon:
            _note(ax, "no Agon-style runs logged yet\n(vanilla GRPO has no challenger)")
        # three panels side by side: the smoothing note on its own line, or the titles run into each other
        ax.set(title=title + ("\n" + _smoothing_text(window).strip() if window > 1 else ""),
               xlabel="training step", ylabel="rate", ylim=(-0.02, 1.02))
    if not agon:
        notes.append("No Agon-style runs with metrics.")
    _legend(fig, axes)
    _title(fig, "Conversion, regression and tiebreak rates over training (rates over pairs where defined)"
           + _band_text(agon), profile, agon)
    return _save(fig, fig_dir, "conversion_rates", data, notes)


def ab_divergence(runs: list[Run], profile: str, fig_dir: Path) -> FigureFile:
    fig, (ax_w, ax_d) = _new_figure(2, 5.2, 4.0)
    data, notes = {}, []
    agon = [r for r in runs if r.is_agon]
    with_evals = [r for r in agon if any("A_B_weight_divergence" in row for row in r.evals)]
    for run in with_evals:
        xs, ys = _series(run.evals, "A_B_weight_divergence")
        _line(ax_w, run, xs, ys, data, "weight_divergence")
        xs, ys = _series(run.evals, "A_B_disagreement")
        _line(ax_d, run, xs, ys, data, "answer_disagreement")
    for run in agon:
        meta = (run.final or {}).get("meta") or {}
        value, ckpt = meta.get("A_B_disagreement"), meta.get("checkpoint")
        if value is not None and ckpt and "step-" in ckpt:
            step = int(str(ckpt).rsplit("step-", 1)[1])
            ax_d.plot(step, value, "*", color=run.color, markersize=10)
            data.setdefault("final_disagreement", {})[run.name] = {"step": step, "value": value}
    if "final_disagreement" in data:
        ax_d.plot([], [], "*", color="black", markersize=10, label="final evaluation (colour: run)")
    if not with_evals:
        notes.append("No periodic evaluations with A/B divergence (eval.jsonl).")
        _note(ax_w, "no periodic evaluations of Agon-style runs yet\n(eval.jsonl, every eval_every steps)")
    ax_w.set(title="weight divergence ‖ΔW_A − ΔW_B‖ / (‖ΔW_A‖ + ‖ΔW_B‖)\n(mean over LoRA layers)",
             xlabel="training step", ylabel="relative Frobenius distance", ylim=(-0.02, 1.02))
    ax_d.set(title="answer disagreement of A and B\n(held-out problems; ★ final evaluation)",
             xlabel="training step", ylabel="fraction of different answers", ylim=(-0.02, 1.02))
    _legend(fig, (ax_w, ax_d))
    if not ax_d.lines:
        _note(ax_d, "no A/B disagreement recorded yet")
    _title(fig, "A–B divergence over training", profile, agon)
    return _save(fig, fig_dir, "ab_divergence", data, notes)


# --- one run's learning curve (the training notebooks 01–06, inline) ------------------------

SYSTEM_ORDER = ("A", "B", "cascade_AB", "cascade_BA", "grpo")
CURVE_COLORS = {"A": "#1f77b4", "B": "#ff7f0e", "cascade_AB": "#d62728", "cascade_BA": "#9467bd",
                "grpo": "#1f77b4", "drafter": "#1f77b4", "challenger": "#d62728"}
CURVE_STYLES = ("-", "--", ":", "-.")


def _evaluated_systems(run: Run) -> list[str]:
    """The systems a run's periodic evaluations scored (``<system>/pass@1`` keys of ``eval.jsonl``)."""
    found = {key.rsplit("/", 1)[0] for row in run.evals for key in row if key.endswith("/pass@1")}
    return sorted(found, key=lambda s: (SYSTEM_ORDER.index(s) if s in SYSTEM_ORDER else len(SYSTEM_ORDER), s))


def _curve_style(run: Run, key: str, index: int, many: bool) -> dict:
    """One run: a colour per system or role. Several runs: a colour per run, a line style per system or role."""
    if many:
        return {"color": run.color, "linestyle": CURVE_STYLES[index % len(CURVE_STYLES)],
                "label": f"{run.label}: {key}"}
    return {"color": CURVE_COLORS.get(key, OTHER_COLOR), "linestyle": "-", "label": key}


def learning_curve(runs: list[Run]) -> tuple[Figure, dict]:
    """The learning curve of one run, or of a few side by side (notebook 01: ``grpo`` and ``grpo_2n``).

    Left: held-out pass@1 of every system the periodic evaluation scored
    (``eval.jsonl``, every ``eval_every`` steps). Right: each role's accuracy on
    its training problems (``metrics.jsonl``): dots each step, the line a
    trailing mean. Returns the figure (not saved anywhere: a training notebook
    shows it inline, :func:`figure_png`) and the plotted values.
    """
    with matplotlib.rc_context(STYLE):
        fig, (ax_eval, ax_train) = _new_figure(2, 5.2, 4.0)
        data = {"eval_pass1": {}, "train_accuracy": {}}
        many = len(runs) > 1
        for run in runs:
            for i, system in enumerate(_evaluated_systems(run)):
                xs, ys = _series(run.evals, f"{system}/pass@1")
                ax_eval.plot(xs, ys, marker="o", **_curve_style(run, system, i, many))
                data["eval_pass1"].setdefault(run.name, {})[system] = {"x": xs, "y": _clean(ys)}
        sizes = sorted({int(row["n_problems"]) for run in runs for row in run.evals if row.get("n_problems")})
        on = f" on {'/'.join(map(str, sizes))} problems" if sizes else ""
        if data["eval_pass1"]:
            ax_eval.legend(loc="best")
        else:
            _note(ax_eval, "no periodic evaluation logged (eval.jsonl):\neval_every is 0, or the run\n"
                           "has not reached its first evaluation")
        ax_eval.set(title=f"held-out pass@1 (periodic evaluation{on})", xlabel="training step", ylabel="pass@1",
                    ylim=(-0.02, 1.02))
        window = _window(runs)
        for run in runs:
            roles = [role for role in ("drafter", "challenger") if any(f"{role}/accuracy" in r for r in run.metrics)]
            for i, role in enumerate(roles):
                xs, ys = _series(run.metrics, f"{role}/accuracy")
                style = _curve_style(run, role, i, many)
                smooth = _rolling(ys, window)
                if window > 1:
                    ax_train.plot(xs, ys, linestyle="none", marker="o", markersize=3, alpha=0.35,
                                  color=style["color"])
                ax_train.plot(xs, smooth, marker="o" if len(xs) <= 12 else None, **style)
                data["train_accuracy"].setdefault(run.name, {})[role] = {"x": xs, "y": _clean(ys),
                                                                         "smoothed": _clean(smooth)}
        if data["train_accuracy"]:
            ax_train.legend(loc="best")
        else:
            _note(ax_train, "no training steps logged yet (metrics.jsonl)")
        ax_train.set(title="training accuracy per role" + _smoothing_text(window), xlabel="training step",
                     ylabel="accuracy", ylim=(-0.02, 1.02))
        for ax in (ax_eval, ax_train):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if data["eval_pass1"] and data["train_accuracy"]:
            ax_eval.set_xlim(ax_train.get_xlim())  # one step axis for both panels
        profiles = sorted({str(run.config.get("profile")) for run in runs})
        steps = max((int(row["step"]) for run in runs for row in run.metrics), default=0)
        fig.suptitle(f"Learning curve: {', '.join(run.label for run in runs) or 'no run'}\n"
                     f"profile {', '.join(profiles) or '?'} · {steps} step{'' if steps == 1 else 's'} logged")
        data["window"] = window
    return fig, data


def figure_png(fig: Figure) -> bytes:
    """A figure as PNG bytes (no timestamp: the same figure gives the same bytes)."""
    buffer = io.BytesIO()
    with matplotlib.rc_context(STYLE):
        fig.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


# --- entry points ---------------------------------------------------------------------------

def make_figures(profile: str, which=None, *, out_dir: str | Path | None = None) -> list[FigureFile]:
    """Draw the figures named in ``which`` (default: all) for a profile; returns what was saved.

    ``which`` may be ``"length"`` (notebook 08), ``"results"`` (notebook 09), or a
    list of figure names.
    """
    names = {"length": LENGTH_FIGURES, "results": RESULTS_FIGURES, None: LENGTH_FIGURES + RESULTS_FIGURES}
    chosen = names[which] if which is None or isinstance(which, str) and which in names else (
        (which,) if isinstance(which, str) else tuple(which))
    unknown = sorted(set(chosen) - set(LENGTH_FIGURES + RESULTS_FIGURES))
    if unknown:
        raise ValueError(f"Unknown figure(s) {', '.join(unknown)}; figures are "
                         f"{', '.join(LENGTH_FIGURES + RESULTS_FIGURES)}.")

    paths = output_paths(profile, out_dir)
    runs = load_runs(paths.runs)
    if not runs:
        log.warning("No runs under %s: every figure will say so.", paths.runs)
    drawn = []
    with matplotlib.rc_context(STYLE):
        for name in chosen:
            if name == "final_pass1":
                drawn.append(final_pass1(paths.results / f"{profile}.csv", profile, paths.figures))
            else:
                drawn.append(globals()[name](runs, profile, paths.figures))
    return drawn


def show(figures: list[FigureFile]) -> None:
    """Display saved figures in a notebook (the PNG files themselves), with their notes."""
    from IPython.display import Image, display

    for fig in figures:
        print(f"{fig.name}: {', '.join(str(p) for p in fig.paths)}" + (f"\n  note: {fig.note}" if fig.note else ""))
        display(Image(filename=str(fig.paths[0])))
