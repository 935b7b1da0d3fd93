"""The steps the numbered notebooks call: check the environment, train a cell, evaluate, collect.

Each function is one notebook step, so that the notebooks stay thin (a
``parameters`` cell, then calls into here) and the same steps run from Python::

    from agonlib.study import pipeline
    pipeline.train_cell("smoke", "agon", steps=1, out_dir="/tmp/agon")   # skipped when already trained
    pipeline.evaluate_runs("smoke", out_dir="/tmp/agon")                  # skipped when already evaluated
    pipeline.collect_results("smoke", out_dir="/tmp/agon")               # the results table

Run names: a cell's name for seed 0 (``agon``), ``<cell>-seed<k>`` otherwise,
so several seeds of a cell live side by side under ``runs/<profile>/``.

Skipping (STYLE.md item 9): a training run counts as done when its final
checkpoint is complete (or, with no checkpoint left, when it has a
``final_eval.json`` and logged every step); an unfinished one resumes from its
newest checkpoint; a run directory trained with other settings is an error
(never silently skipped or mixed), ``force=True`` retrains it. An evaluation
counts as done when ``final_eval.json`` holds every wanted system for the
run's newest checkpoint. ``force=True`` redoes either from scratch.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import platform
import shutil
import sys
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import pandas as pd
import peft
import torch
import transformers

from ..agon import play_round
from ..config import Config, ConfigError, load_config
from ..data import problems_for
from ..evaluation import default_systems, evaluate
from ..models import load_policies, pick_device, resolved_dtype, usable_cores, use_unsloth
from ..runs import (last_checkpoint_step, last_logged_step, latest_adapters, load_run_config, read_jsonl,
                    recorded_config, recorded_run_info)
from ..trainer import Trainer, train
from .paths import output_paths
from .results import collect, report

log = logging.getLogger(__name__)

#: Systems evaluated once per seed (they do not depend on training): on the baseline run only.
UNTRAINED_SYSTEMS = ("base", "moa")


# --- names and configs -----------------------------------------------------------------

def run_name_for(cell: str, seed: int = 0) -> str:
    """``agon`` for seed 0, ``agon-seed1`` for seed 1: seeds of one cell side by side."""
    return cell if seed == 0 else f"{cell}-seed{seed}"


def cell_config(profile: str, cell: str, *, seed: int = 0, steps: int | None = None,
                out_dir: str | Path | None = None, **overrides) -> Config:
    """The config of one experiment cell of ``experiments/cells.yaml`` on ``profile``.

    ``steps=None`` keeps the profile's default; ``out_dir`` is an output root (see
    :mod:`agonlib.paths`), not the run directory itself.
    """
    values = {"seed": seed, "run_name": run_name_for(cell, seed), **overrides}
    if steps is not None:
        values["steps"] = steps
    config = load_config(profile, cell=cell, **values)
    paths = output_paths(config.profile, out_dir)
    if paths.root is not None and "out_dir" not in overrides:
        config = config.replace(out_dir=str(paths.run_dir(config.run_name)))
    return config


def settings_changed(config: Config) -> dict:
    """``{key: (recorded, requested)}`` where a run directory's ``config.json`` differs from ``config``.

    Keys a resumed run may change (``steps``, schedules, ``out_dir``) do not count; the dtype the run was
    trained in does (``dtype: auto`` resolves to bf16 on some CPUs and fp32 on others), as ``dtype (resolved)``.
    """
    recorded = recorded_config(config.run_dir)
    if recorded is None:
        return {}
    changed = {k: (recorded[k], v) for k, v in config.to_dict().items()
               if k in recorded and recorded[k] != v and k not in Trainer.RESUMABLE_CHANGES}
    model = recorded_run_info(config.run_dir).get("model") or {}
    trained_in = model.get("dtype", "").removeprefix("torch.")
    # With transformers the weights load in the resolved dtype; Unsloth may load another (the trainer checks).
    if trained_in and model.get("model_loader") == "transformers" and trained_in != resolved_dtype(config):
        changed["dtype (resolved)"] = (trained_in, resolved_dtype(config))
    return changed


def training_status(config: Config) -> tuple[str, int]:
    """``("done" | "partial" | "new", last complete checkpoint step)`` of a config's run directory."""
    run_dir = config.run_dir
    step = last_checkpoint_step(run_dir)
    if step >= config.steps:
        return "done", step
    if step == 0 and (run_dir / "final_eval.json").exists() and last_logged_step(run_dir) >= config.steps:
        return "done", step  # evaluated, then its checkpoints deleted: nothing left to train
    if step > 0 or (run_dir / "metrics.jsonl").exists():
        return "partial", step
    return "new", 0


# --- training ---------------------------------------------------------------------------

def train_cell(profile: str, cell: str, *, seed: int = 0, steps: int | None = None,
               out_dir: str | Path | None = None, force: bool = False, progress: bool = True,
               **overrides) -> Path:
    """Train one cell unless its run is already complete; returns the run directory.

    An unfinished run (a checkpoint short of ``steps``) resumes; ``force=True``
    deletes the run directory and trains from scratch.
    """
    config = cell_config(profile, cell, seed=seed, steps=steps, out_dir=out_dir, **overrides)
    run_dir = config.run_dir
    if force and run_dir.exists():
        print(f"{config.run_name}: force=True, deleting {run_dir} and training from scratch.", flush=True)
        shutil.rmtree(run_dir)
    changed = settings_changed(config)
    if changed:
        diff = ", ".join(f"{k}: {old!r} → {new!r}" for k, (old, new) in sorted(changed.items()))
        pin = (f" To resume it here, pin its dtype: dtype={changed['dtype (resolved)'][0]}."
               if "dtype (resolved)" in changed else "")
        raise ConfigError(f"{run_dir} holds a run trained with other settings ({diff}). Delete or move it, "
                          f"or pass force=True (python -m agonlib reproduce --force) to retrain from scratch.{pin}")
    status, step = training_status(config)
    if status == "done":
        print(f"{config.run_name}: already trained ({config.steps} steps) in {run_dir}; skipped "
              "(pass force=True to retrain).", flush=True)
        return run_dir
    if status == "partial":
        config = config.replace(resume=True)
        print(f"{config.run_name}: resuming from step {step} of {config.steps} in {run_dir}.", flush=True)
    else:
        print(f"{config.run_name}: training {config.steps} steps on profile {config.profile} "
              f"({describe(config)}) into {run_dir}.", flush=True)
    start = time.perf_counter()
    train(config, progress=progress)
    print(f"{config.run_name}: done in {_duration(time.perf_counter() - start)}.", flush=True)
    return run_dir


def describe(config: Config) -> str:
    """One line naming what a config trains."""
    if config.mode == "grpo":
        n = config.generations_per_problem
        return f"vanilla GRPO, one adapter, {n} generations per problem"
    return (f"{config.reward} reward, {'with' if config.exchange else 'no'} exchange, {config.roles} roles, "
            f"N={config.num_generations}, P={config.problems_per_step}")


SUMMARY_COLUMNS = {
    "step": "step", "drafter": "drafter", "drafter/accuracy": "draft acc",
    "challenger/accuracy": "challenge acc", "challenger/conversion_rate_given_wrong": "conversion|wrong",
    "drafter/len_mean": "draft len", "challenger/len_mean": "challenge len", "time/step_s": "step s",
}


def run_summary(run_dir: str | Path, last: int = 10):
    """The last ``last`` logged steps of a run, the columns a reader checks first (a DataFrame)."""
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    keep = [c for c in SUMMARY_COLUMNS if c in table.columns]
    table = table[keep].rename(columns=SUMMARY_COLUMNS).tail(last).set_index("step")
    evals = pd.DataFrame(read_jsonl(Path(run_dir) / "eval.jsonl"))
    if not evals.empty:
        cols = [c for c in evals.columns if c.endswith("/pass@1")]
        table = table.join(evals.set_index("step")[cols].rename(columns=lambda c: "eval " + c), how="left")
    return table.round(3)


# --- evaluation -------------------------------------------------------------------------

def run_dirs(profile: str, out_dir: str | Path | None = None) -> list[Path]:
    """Every run directory of a profile (those with a ``config.json``), sorted by name."""
    root = output_paths(profile, out_dir).runs
    return sorted(p for p in root.glob("*") if (p / "config.json").is_file())


def _baseline_runs(configs: dict[Path, Config]) -> set[Path]:
    """Per seed, the run that also evaluates the untrained systems: ``agon`` first, then any Agon run."""
    chosen = {}
    rank = lambda item: (item[1].run_name.split("-seed")[0] != "agon", item[1].mode != "agon",  # noqa: E731
                         item[0].name)
    for run_dir, config in sorted(configs.items(), key=rank):
        chosen.setdefault(config.seed, run_dir)
    return set(chosen.values())


def _evaluated_newest(run_dir: Path, found: dict) -> bool:
    """Whether a ``final_eval.json`` (``found``) was made on the run's newest complete checkpoint."""
    adapters = latest_adapters(run_dir)
    evaluated = (found.get("meta") or {}).get("checkpoint")
    return (Path(evaluated).name if evaluated else None) == (adapters.parent.name if adapters else None)


def evaluation_done(run_dir: Path, systems, n_problems: int) -> bool:
    """Whether ``final_eval.json`` holds every system in ``systems`` for the newest checkpoint."""
    path = run_dir / "final_eval.json"
    if not path.exists():
        return False
    found = json.loads(path.read_text())
    return _evaluated_newest(run_dir, found) and all(
        isinstance(found.get(s), dict) and found[s].get("n_problems") == n_problems for s in systems)


def evaluate_runs(profile: str, *, runs=None, systems=None, out_dir: str | Path | None = None,
                  force: bool = False, eval_problems: int | None = None, progress: bool = False,
                  jobs: int | None = None) -> dict:
    """Final evaluation (``agonlib.evaluate``) of every run of a profile; ``{run name: final_eval}``.

    ``systems=None``: each run's own systems (``A``, ``B``, both cascades; ``grpo``
    for a vanilla run), plus ``base`` and ``moa`` once per seed, on the ``agon``
    run when there is one (they do not depend on training). ``runs`` limits the
    evaluation to some run names.

    ``jobs``: runs evaluated at a time, each in its own process with an equal share
    of the cores (``None``: two on a CPU with two cores or more, one on a GPU; a
    run's own ``threads`` setting, when not 0, wins over the share). A run's
    samples depend only on its seeds, not on what runs beside it; with another
    thread count than one job gets, float reductions may round differently. One
    job evaluates in this process and reuses one loaded model. A failing run
    stops the evaluation (runs not yet started are cancelled) with its name. A run that
    another process finishes evaluating after this call planned its work is skipped when
    its turn comes.
    """
    every = run_dirs(profile, out_dir)
    dirs = [d for d in every if runs is None or d.name in runs]
    if not dirs:
        print(f"No runs to evaluate under {output_paths(profile, out_dir).runs} — run the training notebooks "
              "(01–06) first.", flush=True)
        return {}
    configs = {d: load_run_config(d) for d in dirs}
    # Chosen among every run of the profile, so that evaluating some runs never moves base and moa elsewhere.
    baselines = _baseline_runs({d: configs.get(d) or load_run_config(d) for d in every})
    results, todo = {}, []
    for run_dir, config in configs.items():
        if systems is not None:
            wanted = tuple(systems)
        else:
            own = tuple(s for s in default_systems(config) if s not in UNTRAINED_SYSTEMS)
            wanted = own + (UNTRAINED_SYSTEMS if run_dir in baselines else ())
        n = eval_problems or config.final_eval_problems or len(problems_for(config, "test"))
        path = run_dir / "final_eval.json"
        if not force and evaluation_done(run_dir, wanted, n):
            print(f"{run_dir.name}: already evaluated ({', '.join(wanted)}); skipped (force=True redoes it).",
                  flush=True)
            results[run_dir.name] = json.loads(path.read_text())
            continue
        if path.exists() and (force or not _evaluated_newest(run_dir, json.loads(path.read_text()))):
            path.unlink()  # made on an older checkpoint (or forced): start the file afresh
        todo.append((run_dir, wanted, n))
    cores = usable_cores()
    if jobs is None:
        on_gpu = any(pick_device(c.device).type != "cpu" for c in configs.values())
        jobs = 1 if on_gpu else min(2, cores)
    jobs = max(1, min(int(jobs), len(todo)))
    if jobs == 1:
        loaded = {}  # one model per base/LoRA shape: each run loads its own adapters into it
        for run_dir, wanted, n in todo:
            results[run_dir.name] = _evaluate_one(run_dir, wanted, n, progress,
                                                  _shared_policies(run_dir, configs[run_dir], loaded), force)
    else:
        results.update(_evaluate_in_processes(todo, jobs, max(1, cores // jobs), progress, force))
    return {d.name: results[d.name] for d in dirs if d.name in results}


def _evaluate_in_processes(todo: list, jobs: int, threads: int, progress: bool, force: bool = False) -> dict:
    """``todo`` (``(run_dir, systems, n)``) in ``jobs`` worker processes; the first failure cancels the rest."""
    todo = sorted(todo, key=lambda item: -len(item[1]))  # the costliest first: no worker left with a long tail
    print(f"Evaluating {len(todo)} runs, {jobs} at a time ({threads} thread each); each run's progress goes "
          "to this job's log.", flush=True)
    results = {}
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_threads, initargs=(threads,))
    try:
        futures = {pool.submit(_evaluate_one, run_dir, wanted, n, progress, None, force): run_dir
                   for run_dir, wanted, n in todo}
        for future in as_completed(futures):
            run_dir = futures[future]
            try:
                results[run_dir.name] = future.result()
            except Exception as err:
                pool.shutdown(wait=True, cancel_futures=True)
                done = ", ".join(sorted(results)) or "none"
                raise RuntimeError(f"Evaluating {run_dir.name} failed: {type(err).__name__}: {err}. Runs finished "
                                   f"before it (kept in their final_eval.json): {done}. A rerun skips them.") from err
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _worker_threads(threads: int) -> None:
    """An evaluation worker's share of the cores (``Config.threads`` auto reads ``OMP_NUM_THREADS``)."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _evaluate_one(run_dir: Path, systems: tuple, n: int, progress: bool, policies=None, force: bool = False) -> dict:
    # Checked again when the run's turn comes: another process (a second job, or a notebook run
    # by hand) may have evaluated it since this job planned its work.
    if not force and evaluation_done(run_dir, systems, n):
        print(f"{run_dir.name}: evaluated by another process meanwhile; skipped.", flush=True)
        return json.loads((run_dir / "final_eval.json").read_text())
    print(f"{run_dir.name}: evaluating {', '.join(systems)} on {n} held-out problems.", flush=True)
    start = time.perf_counter()
    result = evaluate(run_dir, systems=systems, n_problems=n, progress=progress, policies=policies)
    print(f"{run_dir.name}: evaluated in {_duration(time.perf_counter() - start)}.", flush=True)
    return result


#: Config keys that decide the loaded model and the adapters' shapes, or that generation reads from the
#: model's own config (``policies.config``) rather than from the run's.
MODEL_KEYS = ("model", "dtype", "device", "model_loader", "thinking", "tiny_hidden_size", "tiny_layers", "lora_r",
              "lora_alpha", "lora_dropout", "lora_targets", "b_init_std", "task", "max_prompt_tokens", "decode_forward")


def _shared_policies(run_dir: Path, config: Config, loaded: dict):
    """A model already loaded for an earlier run of the same shape, or ``None`` (evaluate loads one).

    Safe because ``evaluate`` loads the run's own adapters into it — so a run without a
    checkpoint (untrained adapters) always gets a fresh model.
    """
    if latest_adapters(run_dir) is None:
        return None
    key = json.dumps([getattr(config, k, None) for k in MODEL_KEYS], default=str)
    if key not in loaded:
        loaded[key] = load_policies(config)
    return loaded[key]


def evaluation_table(results: dict):
    """``{run: final_eval}`` as one DataFrame: pass@1 and final-stage length per run and system."""
    rows = [{"run": run, "system": system, "pass@1": res["pass@1"], "mean_final_len": res.get("mean_final_len"),
             "tokens_per_problem": res.get("tokens_per_problem"), "n_problems": res.get("n_problems")}
            for run, found in results.items() for system, res in found.items()
            if isinstance(res, dict) and "pass@1" in res]
    return pd.DataFrame(rows).round(3)


# --- results ----------------------------------------------------------------------------

def collect_results(profile: str, out_dir: str | Path | None = None):
    """The results table of every run of a profile, written to ``<results>/<profile>.csv`` and ``.md``."""
    paths = output_paths(profile, out_dir)
    table = collect(profile, runs_dir=paths.runs, write=False)
    paths.results.mkdir(parents=True, exist_ok=True)
    table.to_csv(paths.results / f"{profile}.csv", index=False)
    (paths.results / f"{profile}.md").write_text(report(table, paths.runs) + "\n")
    print(f"Results table: {paths.results / f'{profile}.csv'} ({len(table)} rows).", flush=True)
    return table


# --- environment and one round (00_setup) ------------------------------------------------

def environment(config: Config) -> dict:
    """What a run would use here: device, dtype, model loader, threads and versions."""
    device = pick_device(config.device)
    info = {
        "profile": config.profile,
        "model": config.model,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        "dtype": resolved_dtype(config),
        "model_loader": "unsloth" if use_unsloth(config, device) else "transformers",
        "torch threads": torch.get_num_threads(),
        "cpu cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "platform": platform.platform(),
    }
    if device.type == "cpu":
        info["cpu capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def show_environment(config: Config) -> dict:
    info = environment(config)
    for key, value in info.items():
        print(f"  {key:15s} {value}")
    return info


def text_block(title: str, text: str, width: int = 96) -> str:
    body = "\n".join(textwrap.fill(line, width, subsequent_indent="  ") if line else ""
                     for line in (text.strip() or "(empty)").splitlines())
    return f"── {title} " + "─" * max(0, width - len(title) - 4) + "\n" + body


def print_round(rnd, config: Config) -> None:
    """A played round, readably: each problem, its drafts, what the challenger read, the challenges."""
    G = rnd.group_size
    for i, (draft, challenge) in enumerate(zip(rnd.drafts, rnd.challenges or [None] * len(rnd.drafts))):
        problem = rnd.problems[i // G]
        if i % G == 0:
            print("\n" + "═" * 96 + f"\nPROBLEM {i // G + 1}: {problem['question']}\nGOLD: {problem.get('answer')}")
        print(text_block(f"draft {i + 1} by {rnd.drafter} — answer {draft.answer!r}, correct={rnd.c_draft[i]}, "
                     f"{draft.length} tokens", draft.text))
        if challenge is not None:
            print(text_block(f"summary the challenger reads (leaks gold: {rnd.leaked[i]})",
                         rnd.summaries[i] if config.exchange else "(no exchange: the rival is hidden)"))
            print(text_block(f"challenge by {rnd.challenger} — answer {challenge.answer!r}, "
                         f"correct={rnd.c_challenge[i]}, reward={rnd.r_challenge[i].total:g}", challenge.text))
    print("\n" + "═" * 96)
    for key, value in rnd.metrics().items():
        print(f"  {key:38s} {value:.3f}" if isinstance(value, float) else f"  {key:38s} {value}")


def show_round(policies, config: Config, *, problems: int = 2, generations: int = 2, progress: bool = False):
    """Play one draft → summary → challenge round on training problems and print it; returns the round."""
    config = config.replace(problems_per_step=problems, num_generations=generations)
    picked = problems_for(config, "train")[:problems]
    start = time.perf_counter()
    rnd = play_round(policies, picked, step=1, config=config, progress=progress)
    print_round(rnd, config)
    print(f"Round done in {time.perf_counter() - start:.0f} s.")
    return rnd


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
