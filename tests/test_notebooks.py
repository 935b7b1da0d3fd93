"""The numbered notebooks and the papermill runner (``python -m agonlib reproduce``).

* Hygiene (fast): committed notebooks hold no outputs, keep their ``parameters``
  cell of plain values, stay thin, and equal what ``notebooks/build_notebooks.py``
  writes.
* The main job on the ``smoke`` profile (slow, ~3 min): every notebook through
  papermill into a temporary output root, with ``notebooks/ci_params.yaml`` —
  never into the repository's ``figures/`` or ``experiments/``.
* Figures come only from run files: delete them and the results table, rerun
  08 and 09 alone, get byte-identical files.
"""

import ast
import sys
import time

import nbformat
import pytest

from agonlib.study import reproduce
from agonlib.config import REPO_ROOT, ConfigError
from agonlib.study.paths import OUT_DIR_ENV, output_paths
from agonlib.study.plots import LENGTH_FIGURES, RESULTS_FIGURES

NOTEBOOKS = reproduce.discover()
CI_PARAMS = REPO_ROOT / "notebooks" / "ci_params.yaml"
EXPECTED = ["00_setup", "01_baseline_grpo", "02_agon", "03_cooperation_exchange", "04_competition_no_exchange",
            "05_cooperation_no_exchange", "06_fixed_roles", "07_evaluation", "08_length_analysis", "09_results"]
REQUIRED_PARAMETERS = {"profile", "seed", "steps", "out_dir", "force"}


# --- hygiene of the committed notebooks ---------------------------------------------------

def test_the_numbered_notebooks_are_all_there():
    assert [nb.stem for nb in NOTEBOOKS] == EXPECTED


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
    assert REQUIRED_PARAMETERS <= set(params)
    assert (params["profile"], params["seed"], params["steps"], params["out_dir"], params["force"]) == \
        ("cpu", 0, None, None, False)


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


def test_committed_notebooks_equal_the_generator_output(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "notebooks"))
    try:
        import build_notebooks
    finally:
        sys.path.pop(0)
    for path in build_notebooks.build(tmp_path):
        committed = REPO_ROOT / "notebooks" / path.name
        assert committed.read_text() == path.read_text(), \
            f"{path.name} differs from notebooks/build_notebooks.py: run it and commit the result"


# --- the runner's parameters ----------------------------------------------------------------

PARAMETER_CASES = [
    # (settings, per-notebook, what 02_agon gets, what 07_evaluation gets)
    ({}, {}, {"profile": "smoke"}, {"profile": "smoke"}),  # only what is given; defaults stay in the notebook
    ({"seed": 1, "steps": 4}, {}, {"profile": "smoke", "seed": 1, "steps": 4},
     {"profile": "smoke", "seed": 1, "steps": 4}),  # declared parameters pass through
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
