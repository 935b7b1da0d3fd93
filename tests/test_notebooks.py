"""The numbered notebooks and the papermill runner (``python -m agonlib reproduce``).

* Hygiene (fast): each notebook is a jupytext pair (``NN_name.py`` in the
  percent format, ``NN_name.ipynb``) whose two sides hold the same cells; the
  ``.ipynb`` holds no outputs, keeps its ``parameters`` cell of plain values —
  only parameters the notebook uses — and stays thin; the training notebooks
  show their run's learning curve and one sampled round.
* What 01–06 show (fast): the learning curve and the sampled round read from
  small run files written by hand.
* The main job on the ``smoke`` profile (slow, ~3 min): every notebook through
  papermill into a temporary output root, with ``notebooks/ci_params.yaml`` —
  never into the repository's ``figures/`` or ``experiments/``.
* Figures come only from run files: delete them and the results table, rerun
  08 and 09 alone, get byte-identical files.
"""

import ast
import base64
import json
import shutil
import time
from pathlib import Path

import jupytext
import nbformat
import pytest

from agonlib.config import REPO_ROOT, ConfigError
from agonlib.study import notebook, plots, reproduce
from agonlib.study.paths import OUT_DIR_ENV, output_paths
from agonlib.study.plots import LENGTH_FIGURES, RESULTS_FIGURES

NOTEBOOKS = reproduce.discover()
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
CI_PARAMS = NOTEBOOKS_DIR / "ci_params.yaml"
EXPECTED = ["00_setup", "01_baseline_grpo", "02_agon", "03_cooperation_exchange", "04_competition_no_exchange",
            "05_cooperation_no_exchange", "06_fixed_roles", "07_evaluation", "08_length_analysis", "09_results"]
TRAINING = {"profile", "seed", "steps", "out_dir", "force", "overrides"}
# Each notebook's parameters: exactly those it uses (a parameter nothing reads misleads whoever sets it).
PARAMETERS = {
    "00_setup": {"profile", "seed", "overrides", "problems", "generations"},
    "01_baseline_grpo": TRAINING | {"cells"},
    **{stem: TRAINING for stem in EXPECTED[2:7]},
    "07_evaluation": {"profile", "out_dir", "force", "systems", "eval_problems", "jobs"},
    "08_length_analysis": {"profile", "out_dir"},
    "09_results": {"profile", "out_dir"},
}
DEFAULTS = {"profile": "cpu", "seed": 0, "steps": None, "out_dir": None, "force": False, "overrides": {}}


# --- hygiene of the committed notebooks ---------------------------------------------------

def test_the_numbered_notebooks_are_all_there():
    assert [nb.stem for nb in NOTEBOOKS] == EXPECTED


def test_every_notebook_is_a_jupytext_pair():
    texts = sorted(p.stem for p in NOTEBOOKS_DIR.glob("[0-9][0-9]_*.py"))
    assert texts == EXPECTED, "each NN_name.ipynb needs its NN_name.py and back: run `make notebooks`"
    assert not (NOTEBOOKS_DIR / "build_notebooks.py").exists()  # the .py files are the source now


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_two_sides_of_a_pair_hold_the_same_cells(path):
    nb = nbformat.read(str(path), as_version=4)
    assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent", f"{path.name}: not paired"
    assert reproduce.pair_difference(path) is None, \
        f"{path.name} and {path.stem}.py differ: {reproduce.pair_difference(path)}. Run `make notebooks`."


PAIR_EDITS = [
    # (what is edited on one side, what the difference names)
    (lambda cells: cells[3].__setitem__("source", cells[3].source + "  # edited"), "cell 4: "),  # a line
    (lambda cells: cells.append(nbformat.v4.new_code_cell("x = 1")), "has 10 cells"),  # a cell added
    # the parameters tag lost
    (lambda cells: cells[1].metadata.pop("tags"), "cell 2 is tagged ['parameters'] in 02_agon.ipynb, [] in"),
    (lambda cells: cells.__setitem__(2, nbformat.v4.new_code_cell(cells[2].source)), "cell 3 is markdown in"),  # type
]


@pytest.mark.parametrize("edit, named", PAIR_EDITS)
def test_an_edit_on_one_side_is_caught_and_stops_the_runner(tmp_path, edit, named):
    for suffix in (".ipynb", ".py"):
        shutil.copy(NOTEBOOKS_DIR / f"02_agon{suffix}", tmp_path / f"02_agon{suffix}")
    ipynb = tmp_path / "02_agon.ipynb"
    assert reproduce.pair_difference(ipynb) is None
    nb = nbformat.read(str(ipynb), as_version=4)
    edit(nb.cells)
    jupytext.write(nb, tmp_path / "02_agon.py", fmt="py:percent")  # the .py edited, the .ipynb left behind
    assert named in reproduce.pair_difference(ipynb)
    with pytest.raises(ConfigError, match=r"02_agon are out of sync .*make notebooks"):
        reproduce.run("smoke", notebooks_dir=tmp_path, out_dir=tmp_path / "out", quiet=True, gate=False)
    (tmp_path / "02_agon.py").unlink()
    assert "02_agon.py (its jupytext source) is missing" == reproduce.pair_difference(ipynb)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_has_no_outputs_and_keeps_its_parameters_tag(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} holds outputs: clear them"
    assert nb.cells[0].cell_type == "markdown" and "paper" in nb.cells[0].source.lower()
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0] is nb.cells[1], f"{path.name}: the second cell must be tagged parameters"
    params = reproduce.parameters_of(path)
    assert set(params) == PARAMETERS[path.stem]
    assert {k: v for k, v in params.items() if k in DEFAULTS} == {k: DEFAULTS[k] for k in params if k in DEFAULTS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_parameter_is_used(path):
    nb = nbformat.read(str(path), as_version=4)
    read = {node.id for cell in nb.cells[2:] if cell.cell_type == "code"
            for node in ast.walk(ast.parse(cell.source)) if isinstance(node, ast.Name)}
    unused = set(reproduce.parameters_of(path)) - read
    assert not unused, f"{path.name} declares parameters it never uses: {sorted(unused)}"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem[:2] in reproduce.PARALLEL_PREFIXES],
                         ids=lambda p: p.stem)
def test_training_notebooks_show_the_curve_and_a_sampled_round(path):
    nb = nbformat.read(str(path), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "pipeline.train_cell(" in code
    assert code.index("pipeline.train_cell(") < code.index("notebook.show_learning_curve(") < \
        code.index("notebook.show_sampled_round(")
    headings = [c.source.splitlines()[0] for c in nb.cells if c.cell_type == "markdown"]
    assert headings[1:] == ["## Training", "## The learning curve", "## One sampled round", "## The last steps"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_reads_every_parameter(path):
    import papermill

    # papermill skips a parameter line it cannot parse (e.g. a second '=' in the comment)
    assert set(papermill.inspect_notebook(str(path))) == set(reproduce.parameters_of(path))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_stay_thin(path):
    """No algorithm code in notebooks: no definitions, and every import comes from agonlib (00: Colab setup)."""
    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells[2:]:
        if cell.cell_type != "code":
            continue
        tree = ast.parse(cell.source)
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda))]
        if "google.colab" in cell.source:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module.split(".")[0] == "agonlib", f"{path.name}: import from {node.module}"
            assert not isinstance(node, ast.Import), f"{path.name}: plain import in a notebook"


# --- what a training notebook shows: the curve and one sampled round ------------------------

def _run_dir(root, name, *, mode="agon", exchange=True, steps=4, evals=True, rollouts=True):
    """A run directory in the trainer's formats (config.json, metrics.jsonl, eval.jsonl, rollouts.jsonl)."""
    run = root / name
    run.mkdir(parents=True)
    config = {"profile": "synthetic", "run_name": name, "seed": 0, "mode": mode, "exchange": exchange,
              "steps": steps}
    (run / "config.json").write_text(json.dumps({"config": config}))
    metrics = [{"step": k, "drafter": "A" if k % 2 else "B", "drafter/accuracy": k / 10,
                **({} if mode == "grpo" else {"challenger/accuracy": k / 20})} for k in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    systems = ["grpo"] if mode == "grpo" else ["A", "cascade_AB"]
    if evals:
        rows = [{"step": k, "n_problems": 20, **{f"{s}/pass@1": k / 8 + i / 100 for i, s in enumerate(systems)}}
                for k in (2, 4)]
        (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if rollouts:
        records = []
        for step in (1, steps):
            items = []
            for i, (draft_ok, challenge_ok) in enumerate([(1, 1), (0, 0), (0, 1), (1, 0)]):
                item = {"draft": f"draft {i} at step {step}: 3+4 = 7 so \\boxed{{7}}", "draft_answer": "7",
                        "draft_correct": draft_ok, "draft_len": 12 + i, "summary": f"draft {i}: 3+4 = […]"}
                if mode != "grpo":
                    item.update({"challenge": f"challenge {i}: \\boxed{{8}}", "challenge_answer": "8",
                                 "challenge_correct": challenge_ok, "challenge_len": 9,
                                 "challenge_reward": 2.0 if challenge_ok and not draft_ok else float(challenge_ok),
                                 "leaked": False})
                items.append(item)
            if mode == "grpo":
                items = items[1:]  # the first correct draft is then item 3 of 3
            records.append({"step": step, "drafter": "B" if step % 2 == 0 else "A",
                            "challenger": None if mode == "grpo" else ("A" if step % 2 == 0 else "B"),
                            "problems": [{"id": 0, "question": "What is 3+4?", "answer": "7", "rollouts": items}]})
        (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


PICK_CASES = [
    # (mode, step asked, step shown, pair index shown, why)
    ("agon", None, 4, 3, "a conversion"),  # newest step; the pair where the challenger fixed a wrong draft
    ("agon", 1, 1, 3, "a conversion"),  # an earlier logged step on request
    ("grpo", None, 4, 3, "a correct draft"),  # no challenger: the first correct draft
]


@pytest.mark.parametrize("mode, step, shown, index, why", PICK_CASES)
def test_pick_round(tmp_path, mode, step, shown, index, why):
    picked = notebook.pick_round(_run_dir(tmp_path, "r", mode=mode), step)
    assert (picked["step"], picked["index"], picked["why"].split(":")[0]) == (shown, index, why)
    assert picked["question"] == "What is 3+4?" and picked["logged_steps"] == [1, 4]
    assert ("challenge" in picked) == (mode != "grpo")


def test_pick_round_without_a_match_or_a_file(tmp_path):
    run = _run_dir(tmp_path, "none-right", mode="grpo")
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for row in rows:
        for item in row["problems"][0]["rollouts"]:
            item["draft_correct"] = 0
    (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert notebook.pick_round(run)["why"] == "the first pair logged"
    assert notebook.pick_round(_run_dir(tmp_path, "unlogged", rollouts=False)) is None
    with pytest.raises(ValueError, match=r"no rollouts at step 3; logged steps: \[1, 4\]"):
        notebook.pick_round(run, step=3)


@pytest.mark.parametrize("mode, exchange, shows, hides", [
    ("agon", True, ["draft by B", "summary A read", "draft 2: 3+4 = […]", "challenge by A", "reward 2"], ["NOT"]),
    ("agon", False, ["summary, NOT shown to A", "challenge by A"], ["summary A read"]),
    ("grpo", True, ["adapter B drafts (vanilla GRPO", "draft 3 at step 4"], ["── summary", "challenge by"]),
])
def test_sampled_round_prints_draft_summary_and_challenge(tmp_path, capsys, mode, exchange, shows, hides):
    picked = notebook.show_sampled_round(_run_dir(tmp_path, "r", mode=mode, exchange=exchange))
    out = capsys.readouterr().out
    assert picked is not None and "PROBLEM: What is 3+4?" in out and "GOLD: 7" in out
    assert all(s in out for s in shows), out
    assert not any(h in out for h in hides), out


def test_learning_curve_plots_the_run_files(tmp_path):
    agon, grpo = _run_dir(tmp_path, "agon"), _run_dir(tmp_path, "grpo", mode="grpo")
    fig, data = plots.learning_curve([plots.load_run(agon)])
    assert data["eval_pass1"]["agon"]["cascade_AB"] == {"x": [2, 4], "y": [0.26, 0.51]}
    assert data["train_accuracy"]["agon"]["challenger"]["y"] == [0.05, 0.1, 0.15, 0.2]
    assert set(data["train_accuracy"]["agon"]) == {"drafter", "challenger"}
    assert plots.figure_png(fig) == plots.figure_png(plots.learning_curve([plots.load_run(agon)])[0])
    _, both = plots.learning_curve([plots.load_run(agon), plots.load_run(grpo)])  # notebook 01: runs side by side
    assert set(both["eval_pass1"]) == {"agon", "grpo"} and set(both["train_accuracy"]["grpo"]) == {"drafter"}
    lines = notebook.curve_lines(data)
    assert lines[0] == "agon: held-out pass@1 at step 2, 4: A 0.25, 0.50; cascade_AB 0.26, 0.51"
    assert lines[1] == "agon: training accuracy at step 4: drafter 0.40, challenger 0.20"


def test_learning_curve_without_evaluations_says_so(tmp_path, capsys):
    fig, data = plots.learning_curve([plots.load_run(_run_dir(tmp_path, "r", evals=False))])
    assert data["eval_pass1"] == {} and any("no periodic evaluation" in t.get_text() for t in fig.axes[0].texts)
    assert notebook.show_learning_curve(tmp_path / "missing") == {}
    assert "No run to show" in capsys.readouterr().out


# --- the runner's parameters ----------------------------------------------------------------

PARAMETER_CASES = [
    # (settings, per-notebook, what 02_agon gets, what 07_evaluation gets)
    ({}, {}, {"profile": "smoke"}, {"profile": "smoke"}),  # only what is given; defaults stay in the notebook
    ({"seed": 1, "steps": 4}, {}, {"profile": "smoke", "seed": 1, "steps": 4},
     {"profile": "smoke"}),  # parameters pass through only to the notebooks that declare them
    ({"force": True}, {}, {"profile": "smoke", "force": True},
     {"profile": "smoke", "force": True}),
    ({"lambda_len": 0.1}, {}, {"profile": "smoke", "overrides": {"lambda_len": 0.1}},
     {"profile": "smoke"}),  # other config keys go into `overrides`, where a notebook has it
    ({}, {"07": {"eval_problems": 3}}, {"profile": "smoke"},
     {"profile": "smoke", "eval_problems": 3}),  # per notebook, by number
]


@pytest.mark.parametrize("settings, per_notebook, agon, evaluation", PARAMETER_CASES)
def test_resolve_parameters(settings, per_notebook, agon, evaluation):
    chosen = reproduce.select(NOTEBOOKS, "02,07")
    params = reproduce.resolve_parameters(chosen, "smoke", settings=settings, per_notebook=per_notebook)
    assert params[chosen[0]] == agon and params[chosen[1]] == evaluation


def test_unknown_setting_names_the_nearest_key():
    with pytest.raises(ConfigError, match="Did you mean 'lambda_len'"):
        reproduce.resolve_parameters(NOTEBOOKS, "smoke", settings={"lamda_len": 0.1})


def test_params_file_gives_notebook_numbers_back_their_digits(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("profile: smoke\nsteps: 1\nnotebooks:\n  07: {eval_problems: 2}\n  00_setup: {problems: 1}\n")
    settings, per_notebook = reproduce.read_params_file(path)
    assert settings == {"profile": "smoke", "steps": 1}
    assert per_notebook == {"07": {"eval_problems": 2}, "00_setup": {"problems": 1}}


def test_training_notebooks_start_longest_first_seeds_in_order():
    stems = ["01_baseline_grpo", "02_agon", "03_cooperation_exchange", "04_competition_no_exchange",
             "05_cooperation_no_exchange", "06_fixed_roles", "10_extra"]
    tasks = [reproduce.Task(notebook=Path(f"{stem}.ipynb"), output=Path(f"{stem}{suffix}.ipynb"), log=Path("x.log"),
                            parameters={}) for suffix in ("", "-seed1") for stem in stems]
    started = [t.output.stem for t in reproduce.longest_first(tasks)]
    assert started == ["06_fixed_roles", "06_fixed_roles-seed1", "01_baseline_grpo", "01_baseline_grpo-seed1",
                       "03_cooperation_exchange", "03_cooperation_exchange-seed1", "02_agon", "02_agon-seed1",
                       "05_cooperation_no_exchange", "05_cooperation_no_exchange-seed1",
                       "04_competition_no_exchange", "04_competition_no_exchange-seed1", "10_extra", "10_extra-seed1"]
    assert sorted(reproduce.LONGEST_FIRST) == list(reproduce.PARALLEL_PREFIXES)  # every training notebook ranked


def test_only_selects_by_number_or_name_and_rejects_unknowns():
    assert [nb.stem for nb in reproduce.select(NOTEBOOKS, "08,09_results")] == ["08_length_analysis", "09_results"]
    with pytest.raises(ConfigError, match="no such notebook"):
        reproduce.select(NOTEBOOKS, "42")


def test_cli_reports_a_bad_selection():
    from agonlib.__main__ import main

    assert main(["reproduce", "--profile", "smoke", "--only", "42"]) == 2


# --- a failing notebook ---------------------------------------------------------------------

def _tiny_notebook(path, body):
    params = nbformat.v4.new_code_cell("profile = 'cpu'")
    params.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t"), params,
                                         nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(body)],
                                  metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nbformat.write(nb, str(path))


@pytest.mark.slow
def test_a_failing_notebook_is_named_with_its_cell(tmp_path):
    notebooks = tmp_path / "nbs"
    notebooks.mkdir()
    _tiny_notebook(notebooks / "00_fine.ipynb", "print(profile)")
    _tiny_notebook(notebooks / "01_broken.ipynb", "import time\ntime.sleep(2)\nraise ValueError('the broken cell')")
    _tiny_notebook(notebooks / "02_sleeper.ipynb", "import time\ntime.sleep(300)")  # beside 01: interrupted
    _tiny_notebook(notebooks / "07_never.ipynb", "print('never runs')")  # after the training batch
    start = time.perf_counter()
    with pytest.raises(reproduce.NotebookFailed) as err:
        reproduce.run("smoke", notebooks_dir=notebooks, out_dir=tmp_path / "out", jobs=2, quiet=True)
    assert time.perf_counter() - start < 120  # the sleeper was stopped, not waited for
    message = str(err.value)
    assert "01_broken.ipynb failed" in message
    assert "code cell 4" in message  # 3 code cells + papermill's injected parameters cell
    assert "raise ValueError('the broken cell')" in message and "ValueError: the broken cell" in message
    out = output_paths("smoke", tmp_path / "out").notebooks
    assert (out / "00_fine.ipynb").exists() and not (out / "07_never.ipynb").exists()


# --- the main job on the smoke profile ------------------------------------------------------

def _snapshot(paths):
    return {str(p): sorted(str(q) for q in p.rglob("*")) if p.exists() else None for p in paths}


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory):
    """Every notebook, once, on the smoke profile (CI parameters), into a temporary output root."""
    root = tmp_path_factory.mktemp("reproduce")
    guarded = [REPO_ROOT / "figures", REPO_ROOT / "experiments" / "results", REPO_ROOT / "experiments" / "runs" / "smoke"]
    before = _snapshot(guarded)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # kernels share the test machine: one thread each
        mp.delenv(OUT_DIR_ENV, raising=False)
        timings = reproduce.run(params_file=CI_PARAMS, out_dir=root, jobs=2)
    assert _snapshot(guarded) == before, "the CI run wrote into the repository"
    return root, timings


@pytest.mark.slow
def test_every_notebook_runs_on_smoke(reproduced):
    root, timings = reproduced
    paths = output_paths("smoke", root)
    assert list(timings) == EXPECTED
    for stem in EXPECTED:
        nb = nbformat.read(str(paths.notebooks / f"{stem}.ipynb"), as_version=4)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
        assert not errors, f"{stem}: {errors}"
    runs = sorted(p.name for p in paths.runs.iterdir() if (p / "config.json").exists())
    assert runs == ["agon", "comp_no_exchange", "coop_exchange", "coop_no_exchange", "fixed_roles", "grpo", "grpo_2n"]
    assert all((paths.runs / run / "final_eval.json").exists() for run in runs)
    names = {f"{n}.{ext}" for n in LENGTH_FIGURES + RESULTS_FIGURES for ext in ("png", "svg")}
    assert {p.name for p in paths.figures.iterdir()} == names
    assert (paths.results / "smoke.csv").exists() and (paths.notebooks / "timings.json").exists()
    setup = (paths.notebooks / "00_setup.ipynb").read_text()
    assert "summary the challenger reads" in setup and "backend" in setup
    for stem, challenged in (("01_baseline_grpo", False), ("02_agon", True), ("04_competition_no_exchange", True)):
        nb = nbformat.read(str(paths.notebooks / f"{stem}.ipynb"), as_version=4)
        shown = _outputs_of(nb, "notebook.show_learning_curve(")
        [png] = [o["data"]["image/png"] for o in shown if "image/png" in o.get("data", {})]
        assert base64.b64decode(png).startswith(b"\x89PNG")
        assert "held-out pass@1 at step 1" in _text(shown)
        printed = _text(_outputs_of(nb, "notebook.show_sampled_round("))
        assert "PROBLEM:" in printed and "── draft by " in printed
        assert ("── challenge by " in printed) == challenged and ("── summary" in printed) == challenged


def _outputs_of(nb, call):
    [cell] = [c for c in nb.cells if c.cell_type == "code" and call in c.source]
    return cell.outputs


def _text(outputs):
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


@pytest.mark.slow
def test_figures_come_only_from_run_files(reproduced, monkeypatch):
    """Delete the figures and the results table, rerun 08 and 09 alone: the same files, byte for byte."""
    import shutil

    root, _ = reproduced
    paths = output_paths("smoke", root)
    before = {p.name: p.read_bytes() for p in [*paths.figures.iterdir(), *paths.results.iterdir()]}
    shutil.rmtree(paths.figures)
    shutil.rmtree(paths.results)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    timings = reproduce.run("smoke", only="08,09", out_dir=root, quiet=True)
    assert list(timings) == ["08_length_analysis", "09_results"]
    after = {p.name: p.read_bytes() for p in [*paths.figures.iterdir(), *paths.results.iterdir()]}
    assert sorted(after) == sorted(before)
    assert after == before


@pytest.mark.slow
def test_rerun_skips_finished_training(reproduced, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root, _ = reproduced
    paths = output_paths("smoke", root)
    metrics = paths.runs / "agon" / "metrics.jsonl"
    before = metrics.read_bytes()
    reproduce.run(params_file=CI_PARAMS, only="02", out_dir=root, quiet=True)
    assert metrics.read_bytes() == before
    assert "already trained" in (paths.notebooks / "02_agon.ipynb").read_text()


@pytest.mark.slow
def test_seeds_run_every_training_notebook_once_per_seed(tmp_path):
    notebooks = tmp_path / "nbs"
    notebooks.mkdir()
    for name in ("00_setup", "01_train", "07_eval"):
        params = nbformat.v4.new_code_cell("profile = 'cpu'\nseed = 0")
        params.metadata["tags"] = ["parameters"]
        nb = nbformat.v4.new_notebook(cells=[params, nbformat.v4.new_code_cell("print(f'seed={seed}')")],
                                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                               "language": "python"}})
        nbformat.write(nb, str(notebooks / f"{name}.ipynb"))
    timings = reproduce.run("smoke", notebooks_dir=notebooks, out_dir=tmp_path / "out", jobs=2, quiet=True,
                            seeds=[0, 2], gate=False)
    assert sorted(timings) == ["00_setup", "01_train", "01_train-seed2", "07_eval"]
    out = output_paths("smoke", tmp_path / "out").notebooks
    assert "seed=2" in (out / "01_train-seed2.ipynb").read_text()
    assert "seed=0" in (out / "01_train.ipynb").read_text() and "seed=0" in (out / "07_eval.ipynb").read_text()
    assert reproduce._seeds_arg("3") == [0, 1, 2] and reproduce._seeds_arg("0,4") == [0, 4]
