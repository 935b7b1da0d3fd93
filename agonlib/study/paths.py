"""Where a reproduction writes: run directories, results tables, figures, executed notebooks.

By default everything lands in the repository (DESIGN.md §3)::

    experiments/runs/<profile>/<run>/        one directory per training run
    experiments/runs/<profile>/notebooks/    the executed notebooks of `reproduce`
    experiments/results/<profile>.csv|.md    the results table
    figures/<profile>/                       every figure, PNG and SVG

An output root (the notebooks' ``out_dir`` parameter, ``reproduce --out-dir``,
or the ``AGON_OUT_DIR`` environment variable) moves all of it under one folder
— ``<root>/runs/<profile>/…``, ``<root>/results/``, ``<root>/figures/<profile>/``
— so that tests and CI never write into the repository's committed figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..config import REPO_ROOT, RUNS_DIR

OUT_DIR_ENV = "AGON_OUT_DIR"
FIGURES_DIR = REPO_ROOT / "figures"
RESULTS_DIR = REPO_ROOT / "experiments" / "results"


@dataclass(frozen=True)
class OutputPaths:
    """The output folders of one profile, under the repository or under an output root."""

    profile: str
    root: Path | None = None  # None: the repository's own folders

    @property
    def runs(self) -> Path:
        return (self.root / "runs" if self.root else RUNS_DIR) / self.profile

    @property
    def results(self) -> Path:
        return self.root / "results" if self.root else RESULTS_DIR

    @property
    def figures(self) -> Path:
        return (self.root / "figures" if self.root else FIGURES_DIR) / self.profile

    @property
    def notebooks(self) -> Path:
        return self.runs / "notebooks"

    def run_dir(self, run_name: str) -> Path:
        return self.runs / run_name


def output_paths(profile: str, out_dir: str | Path | None = None) -> OutputPaths:
    """The folders of ``profile``: under ``out_dir``, else ``$AGON_OUT_DIR``, else the repository."""
    root = out_dir if out_dir not in (None, "") else os.environ.get(OUT_DIR_ENV) or None
    return OutputPaths(profile=str(profile), root=Path(root).expanduser().resolve() if root else None)
