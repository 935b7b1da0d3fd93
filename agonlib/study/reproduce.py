"""The main job: every numbered notebook, in order, through papermill (``make reproduce``).

``python -m agonlib reproduce --profile cpu`` runs ``notebooks/00_setup.ipynb`` …
``09_results.ipynb`` headlessly. Each runs in its own papermill process and
Jupyter kernel; the executed copies (outputs included) and one log per notebook
go to ``runs/<profile>/notebooks/`` (see :mod:`agonlib.paths`), figures to
``figures/<profile>/``. Parameters reach each notebook's ``parameters`` cell:
``profile`` always, ``out_dir`` and ``force`` when given, ``--set key=value`` for
any parameter a notebook declares (``seed``, ``steps``, ``eval_problems`` …) or,
for any other config key, inside the notebooks' ``overrides`` dict. A YAML file
(``--params``) sets the same, plus per-notebook values under ``notebooks:``.

The training notebooks (01–06) are independent of each other and run ``jobs`` at
a time; each of their kernels then gets one OpenMP/MKL thread (unless
``OMP_NUM_THREADS`` is set), because two processes with two threads each on a
2-core machine run 5–8× slower than with one each (OpenMP barrier waits). They
start longest first (:data:`LONGEST_FIRST`); their timings are recorded in
notebook order. 00 runs first; 07, 08 and 09 run after the training notebooks,
one by one. The first failure stops the job: running notebooks are interrupted
(their runs resume from the last checkpoint next time) and the error names the
notebook, the cell and its executed copy. Training and evaluation skip work
already on disk (``agonlib.pipeline``), so a rerun picks up where it stopped.

Each notebook is a jupytext pair (``notebooks/jupytext.toml``): ``NN_name.py``
in the percent format and ``NN_name.ipynb``; papermill runs the ``.ipynb``. A
pair whose cells differ (one side edited, ``make notebooks`` not run) stops the
job before anything runs, naming the notebook and the first differing cell.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import jupytext
import yaml

from ..config import FIELD_NAMES, RENAMED, REPO_ROOT, ConfigError, load_config, parse_override, renamed_key_error
from ..gate import cached_gate, format_gate, gate_path
from ..models import resolved_dtype
from .paths import output_paths

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
PARALLEL_PREFIXES = ("01", "02", "03", "04", "05", "06")  # the training notebooks: independent
# The order in which the training notebooks start: longest first, by their wall times in the three-seed `cpu` run
# of 2026-12-05/06 (means of the seeds: 06 10.2 min, 01 9.9 for its two trainings, 03 9.8, 02 9.5, 05 7.7, 04 7.6).
# Two at a time in notebook order, one core sat idle while the last long notebook ran alone (experiments/LOG.md).
LONGEST_FIRST = ("06", "01", "03", "02", "05", "04")
GPU_PROFILES = ("colab", "paper")  # one GPU: training notebooks one at a time
HEARTBEAT_S = 60.0


class NotebookFailed(RuntimeError):
    """A notebook that failed; the message names it, the failing cell and the executed copy."""


@dataclass
class Task:
    notebook: Path
    output: Path
    log: Path
    parameters: dict
    env: dict = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started: float = 0.0
    seconds: float = 0.0
    status: str = "pending"  # pending | running | ok | failed | interrupted


# --- notebooks and their parameters ------------------------------------------------------

def discover(notebooks_dir: str | Path = NOTEBOOKS_DIR) -> list[Path]:
    """The numbered notebooks (``NN_name.ipynb``), in order."""
    return sorted(p for p in Path(notebooks_dir).glob("[0-9][0-9]_*.ipynb"))


def select(notebooks: list[Path], only=None) -> list[Path]:
    """Notebooks whose number or name is in ``only`` (``"08,09"``, ``["07", "09_results"]``)."""
    if not only:
        return notebooks
    wanted = [w.strip() for w in (only.split(",") if isinstance(only, str) else only) if w.strip()]
    chosen = [nb for nb in notebooks if any(nb.stem == w or nb.stem.split("_")[0] == w for w in wanted)]
    missing = [w for w in wanted if not any(nb.stem == w or nb.stem.split("_")[0] == w for nb in notebooks)]
    if missing:
        raise ConfigError(f"--only {','.join(missing)}: no such notebook; notebooks are "
                          f"{', '.join(nb.stem for nb in notebooks)}.")
    return chosen


def text_pair(notebook: Path) -> Path:
    """A notebook's jupytext source: ``NN_name.py`` beside ``NN_name.ipynb``."""
    return Path(notebook).with_suffix(".py")


def _cells(nb) -> list[tuple[str, str, tuple]]:
    """What a pair must agree on, cell by cell: type, source (trailing whitespace aside) and tags."""
    return [(c.cell_type, c.source.rstrip(), tuple(c.metadata.get("tags", []))) for c in nb.cells]


def pair_difference(notebook: Path) -> str | None:
    """Where a notebook's cells differ from those jupytext reads from its ``.py``; ``None`` when they agree.

    After an edit to ``02_agon.py`` alone, say: ``"cell 8: 02_agon.ipynb has 'sampled = …(run_dir)',
    02_agon.py has 'sampled = …(run_dir, step=10)'"``. A missing ``.py`` is a difference too.
    """
    notebook, text = Path(notebook), text_pair(notebook)
    if not text.exists():
        return f"{text.name} (its jupytext source) is missing"
    ours, theirs = _cells(jupytext.read(notebook)), _cells(jupytext.read(text))
    for k, (a, b) in enumerate(zip_longest(ours, theirs), 1):
        if a == b:
            continue
        if a is None or b is None:
            return f"{notebook.name} has {len(ours)} cells, {text.name} {len(theirs)}"
        if a[0] != b[0]:
            return f"cell {k} is {a[0]} in {notebook.name}, {b[0]} in {text.name}"
        if a[2] != b[2]:
            return f"cell {k} is tagged {list(a[2])} in {notebook.name}, {list(b[2])} in {text.name}"
        line_a, line_b = next((x, y) for x, y in zip_longest(a[1].splitlines(), b[1].splitlines()) if x != y)
        return f"cell {k}: {notebook.name} has {line_a!r}, {text.name} has {line_b!r}"
    return None


def check_pairs(notebooks: list[Path]) -> None:
    """Refuse to run a notebook whose ``.ipynb`` and ``.py`` disagree: which one is meant is not ours to guess."""
    differ = [(nb, why) for nb in notebooks if text_pair(nb).exists() and (why := pair_difference(nb))]
    if differ:
        raise ConfigError("The notebook pairs " + ", ".join(nb.stem for nb, _ in differ) + " are out of sync ("
                          + "; ".join(why for _, why in differ) + "). Run `make notebooks` (each pair takes the "
                          "cells of its newer file) and start again.")


def parameters_of(notebook: Path) -> dict:
    """The names and default values of a notebook's ``parameters`` cell (plain literals)."""
    nb = json.loads(Path(notebook).read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            values = {}
            for node in ast.parse(source).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    values[node.targets[0].id] = ast.literal_eval(node.value)
            return values
    raise ConfigError(f"{notebook} has no cell tagged 'parameters' (papermill needs one).")


def resolve_parameters(notebooks: list[Path], profile: str, *, settings: dict | None = None,
                       per_notebook: dict | None = None, out_dir=None, force: bool = False) -> dict[Path, dict]:
    """What each notebook receives: only the parameters it declares.

    ``settings`` (``--set`` and the params file): a key some notebook declares is
    passed as that parameter; any other config key goes into ``overrides``; any
    other key is an error naming the nearest valid one.
    """
    declared = {nb: parameters_of(nb) for nb in notebooks}
    known = set().union(*declared.values()) if declared else set()
    shared, overrides = {"profile": profile}, {}
    if out_dir is not None:
        shared["out_dir"] = str(Path(out_dir).expanduser().resolve())
    if force:
        shared["force"] = True
    for key, value in (settings or {}).items():
        if key in known:
            shared[key] = value
        elif key in FIELD_NAMES:
            overrides[key] = value
        elif key in RENAMED:
            raise renamed_key_error(key, "--set")
        else:
            near = difflib.get_close_matches(key, sorted(known | set(FIELD_NAMES)), n=1, cutoff=0.5)
            raise ConfigError(f"--set {key}: not a notebook parameter nor a config key."
                              + (f" Did you mean {near[0]!r}?" if near else ""))
    out = {}
    for nb, params in declared.items():
        given = {**shared}
        if overrides:
            given["overrides"] = {**(shared.get("overrides") or {}), **overrides}
        for name, extra in (per_notebook or {}).items():
            if name in (nb.stem, nb.stem.split("_")[0]):
                given.update(extra)
        out[nb] = {k: v for k, v in given.items() if k in params}
    return out


def read_params_file(path: str | Path) -> tuple[dict, dict]:
    """A YAML parameter file: top-level settings (like ``--set``) and ``notebooks: {name: {…}}``."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"Cannot read the parameter file {path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of parameters.")
    per_notebook = data.pop("notebooks", None) or {}
    # YAML reads a bare `07:` as the integer 7: give numbers back their two digits.
    per_notebook = {f"{k:02d}" if isinstance(k, int) else str(k): v or {} for k, v in per_notebook.items()}
    return data, per_notebook


# --- running ---------------------------------------------------------------------------------

def _start(task: Task, kernel: str | None, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "papermill", str(task.notebook), str(task.output),
           "-y", yaml.safe_dump(task.parameters, default_flow_style=True, width=10**6),
           "--cwd", str(cwd), "--log-output", "--no-progress-bar"]
    if kernel:
        cmd += ["-k", kernel]
    task.output.parent.mkdir(parents=True, exist_ok=True)
    task.output.unlink(missing_ok=True)  # a stale copy must not be mistaken for this run's
    log = open(task.log, "w")
    task.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **task.env},
                                    start_new_session=True)
    log.close()
    task.started = time.perf_counter()
    task.status = "running"


def _interrupt(task: Task, grace_s: float = 30.0) -> None:
    """Stop a running notebook: SIGINT first (papermill shuts its kernel down), then kill."""
    if task.process is None or task.process.poll() is not None:
        return
    os.killpg(task.process.pid, signal.SIGINT)
    try:
        task.process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(task.process.pid, signal.SIGKILL)
        task.process.wait()
    task.status = "interrupted"
    task.seconds = time.perf_counter() - task.started


def failure_report(task: Task, kernel: str | None = None) -> str:
    """Which cell failed and why, from the executed copy (or the log when there is none)."""
    lines = [f"Notebook {task.notebook.name} failed after {_clock(task.seconds)}."]
    error_cell = None
    if task.output.exists():
        try:
            nb = json.loads(task.output.read_text())
        except json.JSONDecodeError:
            nb = {"cells": []}
        code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
        for k, cell in enumerate(code_cells, 1):
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            if errors:
                error_cell = (k, cell, errors[0])
                break
    if error_cell:
        k, cell, err = error_cell
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        shown = "\n".join("    | " + line for line in source.strip().splitlines()[:8])
        lines += [f"Failing cell: code cell {k} (In [{cell.get('execution_count')}]) of the executed copy:",
                  shown, f"Error: {err.get('ename')}: {err.get('evalue')}"]
        if err.get("ename") == "ModuleNotFoundError" and "agonlib" in str(err.get("evalue")):
            lines.append(f"The kernel {kernel or '(the notebook default, python3)'} runs a Python without "
                         "agonlib: pass --kernel NAME, or run from the project's .venv.")
    else:
        tail = task.log.read_text().splitlines()[-15:] if task.log.exists() else []
        lines += ["No failing cell recorded (papermill or the kernel failed to start). Last log lines:",
                  *("    | " + line for line in tail)]
    lines += [f"Executed copy: {task.output}", f"Full log: {task.log}"]
    return "\n".join(lines)


def longest_first(tasks: list[Task]) -> list[Task]:
    """``tasks`` in the order to start them: by :data:`LONGEST_FIRST`, seeds in order within a notebook.

    Notebooks it does not name start after those it does, in their own order. On the 2-core machine this ends one
    seed's training ~2 minutes sooner than notebook order (the LOG entry of 2026-12-06); which runs beside which
    changes no result (each run is seeded and has its own thread).
    """
    def rank(task: Task) -> int:
        prefix = task.notebook.stem.split("_")[0]
        return LONGEST_FIRST.index(prefix) if prefix in LONGEST_FIRST else len(LONGEST_FIRST)

    return sorted(tasks, key=rank)  # stable: the seeds of one notebook, and unnamed notebooks, keep their order


def _run_batch(tasks: list[Task], jobs: int, kernel: str | None, cwd: Path, say) -> Task | None:
    """Run ``tasks`` ``jobs`` at a time; returns the first that failed (others are then interrupted)."""
    pending, running, failed = list(tasks), [], None
    last_beat = time.perf_counter()
    try:
        while pending or running:
            while pending and len(running) < jobs and failed is None:
                task = pending.pop(0)
                _start(task, kernel, cwd)
                threads = f", {task.env['OMP_NUM_THREADS']} thread" if "OMP_NUM_THREADS" in task.env else ""
                say(f"▶ {task.notebook.stem} started{threads} (log: {task.log})")
                running.append(task)
            time.sleep(0.5)
            for task in list(running):
                code = task.process.poll()
                if code is None or task not in running:  # still going, or interrupted just now
                    continue
                running.remove(task)
                task.seconds = time.perf_counter() - task.started
                task.status = "ok" if code == 0 else "failed"
                say(f"{'✓' if code == 0 else '✗'} {task.notebook.stem} {'done' if code == 0 else 'FAILED'} "
                    f"in {_clock(task.seconds)}")
                if code != 0 and failed is None:
                    failed = task
                    for other in running:
                        say(f"  interrupting {other.notebook.stem} (its run resumes from its last checkpoint "
                            "next time)")
                        _interrupt(other)
                    running.clear()
            if failed is not None and not running:
                break
            if running and time.perf_counter() - last_beat >= HEARTBEAT_S:
                last_beat = time.perf_counter()
                say("  … running: " + ", ".join(f"{t.notebook.stem} ({_clock(last_beat - t.started)})"
                                                for t in running))
    except KeyboardInterrupt:
        for task in running:
            _interrupt(task, grace_s=10)
        raise
    return failed


def run_gate_step(profile: str, overrides: dict, out_dir=None, say=print) -> dict:
    """The gate before any training (:mod:`agonlib.gate`): reused while its prompts and settings are unchanged.

    A failing gate does not stop the job — the main job must always run — but
    says loudly that the challenger cannot use its prompt at initialisation, so
    the Agon cells are handicapped and their results must be read that way.
    """
    paths = output_paths(profile, out_dir)
    config = load_config(profile, **overrides)
    path = gate_path(profile, paths.root / "gate" if paths.root else None, resolved_dtype(config))
    result, rerun = cached_gate(config, path, progress=False)
    say(("Gate measured now" if rerun else "Gate reused") + f" ({path}):\n" + format_gate(result))
    if not result["passed"]:
        bar = "!" * 96
        say(f"{bar}\nWARNING: the challenge prompt FAILS its gate on profile {profile!r}: "
            + " ".join(result["misses"]) + "\nThe reproduction goes on, but the Agon cells start with a "
            "challenger that cannot use the summary; read their results in that light (experiments/LOG.md).\n" + bar)
    return result


def run(profile: str | None = None, *, only=None, jobs: int | None = None, force: bool = False, settings=None,
        params_file=None, out_dir=None, notebooks_dir=None, kernel: str | None = None, quiet: bool = False,
        seeds=None, gate: bool = True) -> dict:
    """Run the numbered notebooks through papermill; returns ``{notebook stem: seconds}``.

    ``profile``: an explicit value wins over ``settings`` and the params file (default ``cpu``).
    ``seeds`` (e.g. ``[0, 1, 2]``): every training notebook runs once per seed (executed copies
    ``NN_name-seed<k>.ipynb``); evaluation and figures then cover every seed. ``gate``: run the
    gate first (:func:`run_gate_step`) when the whole job runs.

    Raises :class:`NotebookFailed` naming the notebook and cell on the first failure.
    """
    say = (lambda *_: None) if quiet else (lambda text: print(text, flush=True))
    start = time.perf_counter()
    notebooks_dir = Path(notebooks_dir) if notebooks_dir else NOTEBOOKS_DIR
    found = discover(notebooks_dir)
    if not found:
        raise ConfigError(f"No numbered notebooks (NN_name.ipynb) in {notebooks_dir}.")
    chosen = select(found, only)
    check_pairs(chosen)
    file_settings, per_notebook = read_params_file(params_file) if params_file else ({}, {})
    for name in per_notebook:  # checked against every notebook: a file may name some not selected now
        if not any(name in (nb.stem, nb.stem.split("_")[0]) for nb in found):
            raise ConfigError(f"{params_file} sets parameters for notebook {name!r}, which is not among "
                              f"{', '.join(nb.stem for nb in found)}.")
    settings = {**file_settings, **(settings or {})}  # --set wins over the file
    profile = profile or settings.pop("profile", None) or "cpu"  # an explicit argument wins over both
    settings.pop("profile", None)
    out_dir = out_dir if out_dir is not None else settings.pop("out_dir", None)
    settings.pop("out_dir", None)
    force = bool(force or settings.pop("force", False))
    settings.pop("force", None)
    params = resolve_parameters(chosen, profile, settings=settings, per_notebook=per_notebook,
                                out_dir=out_dir, force=force)
    paths = output_paths(profile, out_dir)
    if jobs is None:
        jobs = 1 if profile in GPU_PROFILES else min(2, os.cpu_count() or 1)
    jobs = max(1, int(jobs))
    seeds = [int(k) for k in seeds] if seeds else None
    say(f"Reproducing profile {profile!r}: {len(chosen)} notebook(s) from {notebooks_dir}, up to {jobs} "
        f"training notebook(s) at a time" + (f", seeds {', '.join(map(str, seeds))}" if seeds else "")
        + f".\nExecuted notebooks and logs: {paths.notebooks}")
    if gate and not only:
        overrides = {k: v for k, v in settings.items() if k in FIELD_NAMES}
        run_gate_step(profile, overrides, out_dir, say)

    def task_for(nb: Path, env: dict, seed: int | None = None) -> Task:
        name = nb.stem if not seed else f"{nb.stem}-seed{seed}"
        parameters = params[nb] if seed is None or "seed" not in parameters_of(nb) else {**params[nb], "seed": seed}
        return Task(notebook=nb, output=paths.notebooks / f"{name}.ipynb", log=paths.notebooks / f"{name}.log",
                    parameters=parameters, env=env)

    # Consecutive training notebooks form one parallel batch; the others run alone, in order.
    batches: list[list[Path]] = []
    for nb in chosen:
        parallel = nb.stem.split("_")[0] in PARALLEL_PREFIXES
        if parallel and batches and batches[-1][0].stem.split("_")[0] in PARALLEL_PREFIXES:
            batches[-1].append(nb)
        else:
            batches.append([nb])
    timings = {}
    for batch in batches:
        width = min(jobs, len(batch) * len(seeds or [0])) if batch[0].stem.split("_")[0] in PARALLEL_PREFIXES else 1
        env = {}
        if width > 1 and "OMP_NUM_THREADS" not in os.environ:
            env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        training = batch[0].stem.split("_")[0] in PARALLEL_PREFIXES
        if training and seeds:
            tasks = [task_for(nb, env, k) for k in seeds for nb in batch]
        else:
            tasks = [task_for(nb, env, seeds[0] if seeds else None) for nb in batch]
        failed = _run_batch(longest_first(tasks) if training else tasks, width, kernel, notebooks_dir, say)
        timings.update({t.output.stem: round(t.seconds, 1) for t in tasks if t.status == "ok"})
        if failed is not None:
            raise NotebookFailed(failure_report(failed, kernel))
    total = time.perf_counter() - start
    record = {"profile": profile, "notebooks": timings, "total_s": round(total, 1), "jobs": jobs,
              "cpus": os.cpu_count(), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    paths.notebooks.mkdir(parents=True, exist_ok=True)
    (paths.notebooks / "timings.json").write_text(json.dumps(record, indent=2) + "\n")
    figures = sorted(paths.figures.glob("*.png")) if paths.figures.exists() else []
    say(f"\nDone: {len(timings)} notebook(s) in {_clock(total)} (wall time).")
    say(f"Figures: {paths.figures} ({len(figures)} PNG + SVG)" if figures else
        f"Figures: none written (they go to {paths.figures} when 08/09 run).")
    say(f"Results table: {paths.results / (profile + '.csv')}")
    say(f"Executed notebooks: {paths.notebooks}")
    return timings


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _seeds_arg(text) -> list[int] | None:
    """``"0,1,2"`` → ``[0, 1, 2]``; a bare count ``"3"`` means seeds ``0 … 2``."""
    if not text:
        return None
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: give a count (3) or a comma-separated list (0,1,2).") from None
    return list(range(values[0])) if len(values) == 1 and "," not in str(text) else values


def main(args) -> int:
    """The ``reproduce`` subcommand (arguments parsed in ``agonlib.__main__``)."""
    settings = dict(parse_override(item) for item in args.overrides)
    try:
        run(args.profile, only=args.only, jobs=args.jobs, force=args.force, settings=settings,
            params_file=args.params, out_dir=args.out_dir, notebooks_dir=args.notebooks_dir, kernel=args.kernel,
            seeds=_seeds_arg(args.seeds), gate=not args.skip_gate)
    except NotebookFailed as err:
        print(f"\nREPRODUCTION FAILED\n{err}", file=sys.stderr, flush=True)
        return 1
    return 0
