"""What a training notebook (01–06) shows of the run it trained, inline: the learning curve and one sampled round.

Both read only the run directory (STYLE.md item 9), so they show the same thing
whether the run was trained a minute ago or skipped as already done::

    from agonlib.study import notebook
    notebook.show_learning_curve(run_dir)   # held-out pass@1 (eval.jsonl), per-role training accuracy (metrics.jsonl)
    notebook.show_sampled_round(run_dir)    # one logged draft → masked summary → challenge (rollouts.jsonl)

The round is picked, not drawn at random, so an executed notebook is the same on
every rerun: the newest logged step, and in it the first pair where the
challenger fixed a wrong draft (vanilla GRPO: the first correct draft), else the
first pair logged.
"""

from __future__ import annotations

from pathlib import Path

from ..runs import read_jsonl, recorded_config
from .pipeline import text_block
from .plots import figure_png, learning_curve, load_run

#: Which logged pair a notebook shows, in order of preference: (why it was picked, test on a logged item).
PICKS = (
    ("a conversion: the challenger fixed a wrong draft",
     lambda item: "challenge_correct" in item and item["challenge_correct"] and not item["draft_correct"]),
    ("a correct draft", lambda item: "challenge" not in item and item["draft_correct"]),
    ("the first pair logged", lambda item: True),
)


def _run_dirs(run_dirs) -> list[Path]:
    return [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(d) for d in run_dirs]


# --- the learning curve ---------------------------------------------------------------------

def curve_lines(data: dict) -> list[str]:
    """The numbers of a learning curve (``plots.learning_curve``'s data) as text, one line per run and panel."""
    lines = []
    for run, systems in data["eval_pass1"].items():
        steps = next(iter(systems.values()))["x"]
        values = "; ".join(f"{system} " + ", ".join("–" if y is None else f"{y:.2f}" for y in series["y"])
                           for system, series in systems.items())
        lines.append(f"{run}: held-out pass@1 at step {', '.join(map(str, steps))}: {values}")
    for run, roles in data["train_accuracy"].items():
        last = {role: series["smoothed"][-1] for role, series in roles.items() if series["x"]}
        step = max(series["x"][-1] for series in roles.values() if series["x"])
        trail = f" (trailing mean over {data['window']} steps)" if data["window"] > 1 else ""
        values = ", ".join(f"{role} {'–' if y is None else f'{y:.2f}'}" for role, y in last.items())
        lines.append(f"{run}: training accuracy at step {step}{trail}: {values}")
    return lines


def show_learning_curve(run_dirs) -> dict:
    """Draw the learning curve of one run (or a few, one figure) inline, with its numbers printed; returns them."""
    runs = [run for run in (load_run(d) for d in _run_dirs(run_dirs)) if run is not None]
    if not runs:
        print(f"No run to show in {', '.join(map(str, _run_dirs(run_dirs)))}: train it first (the cell above).")
        return {}
    fig, data = learning_curve(runs)
    for line in curve_lines(data) or ["Nothing logged yet: no training step, no periodic evaluation."]:
        print(line)
    from IPython.display import Image, display

    display(Image(data=figure_png(fig)))
    return data


# --- one sampled round ----------------------------------------------------------------------

def pick_round(run_dir, step: int | None = None) -> dict | None:
    """One logged pair of ``rollouts.jsonl``; ``None`` when the run logged none.

    From the newest logged step (or ``step``): the first pair that passes the
    first test of :data:`PICKS` any pair passes. Returns the logged item (``draft``,
    ``draft_answer``, ``draft_correct``, ``draft_len``, ``summary``; with a
    challenger also ``challenge``, ``challenge_answer``, ``challenge_correct``,
    ``challenge_len``, ``challenge_reward``, ``leaked``) with ``step``,
    ``drafter``, ``challenger``, ``question``, ``gold``, ``index`` (1-based),
    ``of`` (pairs logged at that step), ``why`` and ``logged_steps`` added.
    """
    records = read_jsonl(Path(run_dir) / "rollouts.jsonl")
    logged = [record.get("step") for record in records]
    if step is not None:
        records = [record for record in records if record.get("step") == step]
        if not records:
            raise ValueError(f"{run_dir} logged no rollouts at step {step}; logged steps: {logged or 'none'}.")
    if not records:
        return None
    record = records[-1]
    pairs = [(problem, item) for problem in record.get("problems", []) for item in problem.get("rollouts", [])]
    if not pairs:
        return None
    for why, wanted in PICKS:
        found = [k for k, (_, item) in enumerate(pairs) if wanted(item)]
        if found:
            problem, item = pairs[found[0]]
            return {**item, "step": record.get("step"), "drafter": record.get("drafter"),
                    "challenger": record.get("challenger"), "question": problem.get("question"),
                    "gold": problem.get("answer"), "index": found[0] + 1, "of": len(pairs), "why": why,
                    "logged_steps": logged}
    return None  # unreachable: the last pick takes any pair


def _verdict(correct) -> str:
    return "right" if correct else "wrong"


def _number(value) -> str:
    return "–" if value is None else f"{value:g}"


def round_text(picked: dict, config: dict | None = None) -> str:
    """A picked round (:func:`pick_round`) as text: the problem, the draft, the summary read, the challenge."""
    config = config or {}
    drafter, challenger = picked["drafter"], picked["challenger"]
    steps = picked["logged_steps"]
    shown = ", ".join(map(str, steps[-6:])) + (", …" if len(steps) > 6 else "")
    roles = f"{drafter} drafts, {challenger} challenges" if "challenge" in picked else \
        f"adapter {drafter} drafts (vanilla GRPO: no challenger, no summary)"
    parts = [f"Step {picked['step']} (logged steps: {shown}); {roles}.",
             f"Pair {picked['index']} of {picked['of']} logged at that step: {picked['why']}.",
             "", f"PROBLEM: {picked['question']}", f"GOLD: {picked['gold']}", "",
             text_block(f"draft by {drafter}: answer {picked.get('draft_answer')!r}, "
                        f"{_verdict(picked['draft_correct'])}, {picked.get('draft_len')} tokens", picked["draft"])]
    if "challenge" in picked:
        if config.get("exchange", True):
            title = (f"summary {challenger} read: the draft without its answer, which is masked as […] "
                     f"(leaks gold: {bool(picked.get('leaked'))})")
        else:
            title = f"summary, NOT shown to {challenger} (no exchange: the challenger solved the problem alone)"
        reward = _number(picked.get("challenge_reward"))
        parts += ["", text_block(title, picked.get("summary") or ""), "",
                  text_block(f"challenge by {challenger}: answer {picked.get('challenge_answer')!r}, "
                             f"{_verdict(picked['challenge_correct'])}, reward {reward}, "
                             f"{picked.get('challenge_len')} tokens", picked["challenge"])]
    return "\n".join(parts)


def show_sampled_round(run_dir, step: int | None = None) -> dict | None:
    """Print one logged round of a run (:func:`pick_round`, :func:`round_text`); returns the picked pair."""
    picked = pick_round(run_dir, step)
    if picked is None:
        print(f"{Path(run_dir).name}: no rollouts logged in {Path(run_dir) / 'rollouts.jsonl'} (the trainer "
              "writes them at step 1 and every log_rollouts_every steps).")
        return None
    print(f"{Path(run_dir).name}: " + round_text(picked, recorded_config(run_dir)))
    return picked
