"""agonlib — Agon: competitive cross-model RL with implicit rival grading.

The public API (DESIGN.md §7). Heavy modules (torch, transformers) load on first
use, so ``import agonlib`` stays fast for the CLI and the notebooks' first cell.
"""

from __future__ import annotations

import importlib
import warnings

# tqdm.auto warns once inside a Jupyter kernel without ipywidgets, then prints text bars —
# which is what an executed (papermill) notebook should hold anyway.
warnings.filterwarnings("ignore", message="IProgress not found")

__version__ = "0.1.0"

_EXPORTS = {
    "load_config": "config",
    "Config": "config",
    "ConfigError": "config",
    "load_policies": "models",
    "Policies": "models",
    "split_completion": "parsing",
    "extract_summary": "parsing",
    "grade_math": "grading",
    "grade_code": "grading",
    "train": "trainer",
    "evaluate": "evaluation",
}
# What the notebooks call lives in agonlib.study; `agonlib.results.collect(profile)` (DESIGN.md §7) and
# the other study modules stay reachable as attributes of the package.
_SUBMODULES = {name: f".study.{name}" for name in ("results", "paper", "paths", "pipeline", "plots", "reproduce")}

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name], __name__)
    raise AttributeError(f"module 'agonlib' has no attribute {name!r}")
