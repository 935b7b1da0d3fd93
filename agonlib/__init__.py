"""agonlib — Agon: competitive cross-model RL with implicit rival grading.

The public API (DESIGN.md §7). Heavy modules (torch, transformers) load on first
use, so ``import agonlib`` stays fast for the CLI and the notebooks' first cell.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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
# Modules that live in a subpackage keep their old names: what the notebooks call lives in agonlib.study
# (`agonlib.results.collect(profile)`, DESIGN.md §7), the generation modules in agonlib.generation. Each
# old name is an attribute of the package, and `import agonlib.rollouts` / `from agonlib.backends import …`
# load the moved module itself (the same object, so patching one patches the other).
_MOVED = {name: f"study.{name}" for name in ("results", "paper", "paths", "pipeline", "plots", "reproduce")}
_MOVED.update({"rollouts": "generation", "decode": "generation.fast", "backends": "generation.backends",
               "vllm_reference": "generation.vllm_reference"})

__all__ = sorted(_EXPORTS) + sorted(_MOVED)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in _MOVED:
        return importlib.import_module(f".{_MOVED[name]}", __name__)
    raise AttributeError(f"module 'agonlib' has no attribute {name!r}")


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``agonlib.<old name>`` and hands back the module it moved to."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f".{_MOVED[spec.name.rpartition('.')[2]]}", __name__)
        spec.loader_state = module.__spec__  # the import system sets __spec__ to ours: exec_module puts it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
