"""Everything about a run directory: its files, read and written in one place (DESIGN.md §3).

A run directory (``experiments/runs/<profile>/<run>/``) holds::

    config.json        the resolved config, prompts, versions, machine (written at the start)
    metrics.jsonl      one row per training step
    rollouts.jsonl     sampled drafts, summaries and challenges every few steps
    eval.jsonl         the periodic evaluations
    final_eval.json    the final evaluation
    checkpoints/step-NNNNNN/   adapters/, trainer_state.pt, COMPLETE (written last)

The trainer writes these files, everything else only reads them — the results
table, the figures, the pipeline's skip logic, the evaluation and the CLI all go
through this module, so the format lives in one file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import sys
from pathlib import Path

import peft
import torch
import transformers

from . import prompts
from .config import Config, ConfigError, load_config, recorded_values

log = logging.getLogger(__name__)

CHECKPOINT_DONE = "COMPLETE"  # written last: a checkpoint without it is partial and ignored
JSONL_FILES = ("metrics.jsonl", "rollouts.jsonl", "eval.jsonl")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names it and the way out."""


# --- JSONL records -------------------------------------------------------------------------

def _jsonable(value):
    """NaN and infinities become null: strict JSON for every reader, not only Python's."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}, default=float) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a line that does not parse (a kill mid-write) is skipped with a warning."""
    if not Path(path).exists():
        return []
    rows, bad = [], 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    if bad:
        log.warning("%s: skipped %d line(s) that are not valid JSON (a write cut short?).", path, bad)
    return rows


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the rows of steps ``<= last_step`` (a resumed run replays the later ones)."""
    if not path.exists():
        return
    kept = [row for row in read_jsonl(path) if row.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(row) + "\n" for row in kept))


def last_logged_step(run_dir: Path) -> int:
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return int(rows[-1]["step"]) if rows else 0


# --- config.json ---------------------------------------------------------------------------

def write_run_config(config: Config, run_dir: Path, policies=None, generation: dict | None = None) -> None:
    """``config.json``: the resolved config, every prompt, library versions and the machine."""
    info = {
        "config": config.to_dict(),
        "prompts": prompts.all_prompts(),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "peft": peft.__version__},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count()},
    }
    if policies is not None:
        info["model"] = {"model_loader": policies.model_loader, "device": str(policies.device),
                         "dtype": str(policies.dtype), **policies.memory_report()}
    if generation is not None:
        info["generation"] = generation
    (run_dir / "config.json").write_text(json.dumps(info, indent=2, default=str) + "\n")


def recorded_config(run_dir: Path) -> dict | None:
    """The raw config values a run directory recorded, or ``None`` (no or unreadable ``config.json``)."""
    try:
        return recorded_values(json.loads((Path(run_dir) / "config.json").read_text())["config"])
    except (OSError, json.JSONDecodeError, KeyError):
        return None


def load_run_config(run_dir: Path) -> Config:
    """The config a run directory was trained with (its ``config.json``), with clear errors."""
    saved = Path(run_dir) / "config.json"
    if not saved.exists():
        raise FileNotFoundError(f"{run_dir} has no config.json: is it a run directory?")
    try:
        values = recorded_values(json.loads(saved.read_text())["config"])
        return load_config(values.pop("profile"), **values)
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"{saved} is not a readable run config ({type(err).__name__}: {err}).") from None


# --- checkpoints ---------------------------------------------------------------------------

def complete_checkpoints(run_dir: Path) -> list[Path]:
    """A run's complete checkpoints, oldest first; partial ones (no marker, ``.tmp``) are skipped."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    found = sorted(p for p in root.glob("step-*") if p.is_dir())
    complete = [p for p in found if not p.name.endswith(".tmp") and (p / CHECKPOINT_DONE).exists()]
    for p in sorted(set(found) - set(complete)):
        log.warning("Ignoring partial checkpoint %s (no %s marker).", p, CHECKPOINT_DONE)
    return complete


def checkpoint_step(checkpoint: Path) -> int:
    """``.../step-000030`` → 30."""
    return int(Path(checkpoint).name.split("-")[1])


def last_checkpoint_step(run_dir: Path) -> int:
    ckpts = complete_checkpoints(run_dir)
    return checkpoint_step(ckpts[-1]) if ckpts else 0


def latest_adapters(run_dir: Path) -> Path | None:
    """The adapters of a run's newest complete checkpoint (``None`` without one)."""
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] / "adapters" if ckpts else None


def write_checkpoint(run_dir: Path, step: int, state: dict, save_adapters) -> Path:
    """``checkpoints/step-NNNNNN/``, atomically: ``save_adapters(dir)``, ``trainer_state.pt``, then the marker.

    Written under a ``.tmp`` name and renamed: a kill leaves either the old state or the new one.
    """
    final = Path(run_dir) / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_adapters(tmp / "adapters")
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / CHECKPOINT_DONE).write_text(f"step {step}\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final
