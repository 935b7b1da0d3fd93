"""Everything about a run directory: its files, read and written in one place (DESIGN.md §3).

A run directory (``experiments/runs/<profile>/<run>/``) holds::

    config.json        the resolved config, prompts, versions, machine (written at the start)
    metrics.jsonl      one row per training step
    rollouts.jsonl     sampled drafts, summaries and challenges every few steps
    eval.jsonl         the periodic evaluations
    segments.jsonl     one row each time training starts or resumes: step, machine, dtype, commit
    final_eval.json    the final evaluation
    checkpoints/step-NNNNNN/   adapters/, trainer_state.pt, COMPLETE (written last)

The trainer writes these files, everything else only reads them — the results
table, the figures, the pipeline's skip logic, the evaluation and the CLI all go
through this module, so the format lives in one file.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import peft
import torch
import transformers

from . import prompts
from .config import REPO_ROOT, Config, ConfigError, load_config, recorded_values
from .models import init_noise

log = logging.getLogger(__name__)

CHECKPOINT_DONE = "COMPLETE"  # written last: a checkpoint without it is partial and ignored
JSONL_FILES = ("metrics.jsonl", "rollouts.jsonl", "eval.jsonl")  # rows by step: cut back on resume
SEGMENTS = "segments.jsonl"  # never cut: the history of the run's machines


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

def machine() -> dict:
    """This machine, as a run records it: platform, CPU model and its vector unit, cores."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return {"platform": platform.platform(), "processor": platform.processor(), "cpu_model": model,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count()}


def commit() -> str | None:
    """The repository's commit (with ``+dirty`` for uncommitted changes), or ``None`` outside git."""
    try:
        run = lambda *args: subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,  # noqa: E731
                                           timeout=10, check=True).stdout.strip()
        return run("rev-parse", "--short", "HEAD") + ("+dirty" if run("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def write_run_config(config: Config, run_dir: Path, policies=None, generation: dict | None = None,
                     fork: dict | None = None) -> None:
    """``config.json``: the resolved config, every prompt, library versions, the machine, and a fork's source."""
    info = {
        "config": config.to_dict(),
        "prompts": {**prompts.all_prompts(), "placebo_summary": prompts.PLACEBO_SUMMARY},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "peft": peft.__version__},
        "machine": machine(),
    }
    if policies is not None:
        info["model"] = {"model_loader": policies.model_loader, "device": str(policies.device),
                         "dtype": str(policies.dtype), **policies.memory_report()}
    if generation is not None:
        info["generation"] = generation
    if fork is not None:
        info["fork"] = fork
    (run_dir / "config.json").write_text(json.dumps(info, indent=2, default=str) + "\n")


def recorded_run_info(run_dir: Path) -> dict:
    """The whole ``config.json`` of a run directory (``{}`` without a readable one)."""
    try:
        return json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def append_segment(run_dir: Path, from_step: int, policies) -> dict:
    """One row of ``segments.jsonl``: a training segment starting after ``from_step`` steps, and where."""
    row = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "from_step": from_step, "dtype": str(policies.dtype).removeprefix("torch."),
           "device": str(policies.device), "commit": commit(), "machine": machine()}
    append_jsonl(Path(run_dir) / SEGMENTS, row)
    return row


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


def resolve_checkpoint(source: str | Path) -> Path:
    """A complete checkpoint directory: ``source`` itself, or a run directory's newest one."""
    source = Path(source)
    if (source / CHECKPOINT_DONE).exists():
        return source
    found = complete_checkpoints(source)
    if found:
        return found[-1]
    raise CheckpointError(f"init_from={str(source)!r} is neither a complete checkpoint (a directory with "
                          f"{CHECKPOINT_DONE}) nor a run directory with one: train the trunk first, or point "
                          "init_from at its run directory.")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def unusable_checkpoint(run_dir: Path, path: Path, err: Exception) -> CheckpointError:
    """The error for a checkpoint that does not load, naming the older one to fall back on."""
    older = [p.name for p in complete_checkpoints(run_dir) if p != path]
    way_out = f"Delete it to resume from {older[-1]}." if older else "No older checkpoint exists."
    return CheckpointError(f"Checkpoint {path} cannot be loaded ({type(err).__name__}: {err}). {way_out}")


def check_resume_dtype(path: Path, state: dict, policies, config: Config) -> None:
    """Refuse to resume a checkpoint under another dtype than it was trained in (``dtype: auto`` resolves
    to bf16 on a CPU with AMX, fp32 on an AVX2 one): the run would silently change its arithmetic."""
    saved = state.get("dtype") or (recorded_run_info(config.run_dir).get("model") or {}).get("dtype")
    now = str(policies.dtype)
    if saved is not None and saved != now:
        pin = saved.removeprefix("torch.")
        raise CheckpointError(
            f"Checkpoint {path} was trained in {pin} (on {state.get('device', 'an unrecorded device')}); "
            f"here dtype={config.dtype!r} resolves to {now.removeprefix('torch.')}. A run never resumes "
            f"under another dtype: pin it with --set dtype={pin} (dtype: {pin} in a YAML), or start a new run. "
            "float32 runs on every CPU; bfloat16 is ~400x slower on a CPU without AVX512-BF16 or AMX.")


def fork_start(policies, source: str, adapters: tuple[str, ...], config: Config) -> dict:
    """Load a trunk checkpoint's adapter ``A`` into every adapter, ``B`` plus its init noise; returns the source.

    ``B − A`` is then exactly ``B``'s Gaussian init (:func:`agonlib.models.init_noise`), so the pair starts
    apart as at the paper's init. The optimizers are the caller's fresh ones.
    """
    checkpoint = resolve_checkpoint(source)
    trunk_dtype = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False).get("dtype")
    if trunk_dtype is not None and trunk_dtype != str(policies.dtype):
        raise CheckpointError(f"init_from={source!r} was trained in {trunk_dtype}, this run loads "
                              f"{policies.dtype}: pin dtype to the trunk's (--set dtype="
                              f"{trunk_dtype.removeprefix('torch.')}).")
    folder = checkpoint / "adapters"
    for name in adapters:
        policies.load_adapter(name, folder, source="A")
    if "B" in adapters:
        with torch.no_grad():
            for param, noise in init_noise(policies.model, config):
                param.add_(noise.to(param.dtype))
    log.info("Forked from %s (step %d).", checkpoint, checkpoint_step(checkpoint))
    return {"source": str(checkpoint), "step": checkpoint_step(checkpoint),
            "adapter_A_sha256": file_sha256(folder / "A" / "adapter_model.safetensors")}


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
