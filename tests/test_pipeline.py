"""The notebook steps: output folders, run names, skipping finished training and evaluation."""

import json
import shutil

import pytest

import agonlib
from agonlib.study import pipeline
from agonlib.config import RUNS_DIR
from agonlib.study.paths import FIGURES_DIR, OUT_DIR_ENV, RESULTS_DIR, output_paths


def test_output_paths_default_to_the_repo(monkeypatch):
    monkeypatch.delenv(OUT_DIR_ENV, raising=False)
    paths = output_paths("cpu")
    assert (paths.runs, paths.figures, paths.results) == (RUNS_DIR / "cpu", FIGURES_DIR / "cpu", RESULTS_DIR)
    assert paths.notebooks == RUNS_DIR / "cpu" / "notebooks"


def test_output_root_from_argument_or_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(OUT_DIR_ENV, str(tmp_path / "env"))
    assert output_paths("smoke").figures == tmp_path / "env" / "figures" / "smoke"
    # an explicit root wins over the environment
    paths = output_paths("smoke", tmp_path / "arg")
    assert (paths.runs, paths.results) == (tmp_path / "arg" / "runs" / "smoke", tmp_path / "arg" / "results")


RUN_NAME_CASES = [
    # (cell, seed, run name)
    ("agon", 0, "agon"),  # seed 0 keeps the cell's name (the runs already recorded)
    ("agon", 1, "agon-seed1"),
    ("grpo_2n", 3, "grpo_2n-seed3"),
]


@pytest.mark.parametrize("cell, seed, name", RUN_NAME_CASES)
def test_run_names(cell, seed, name):
    assert pipeline.run_name_for(cell, seed) == name
    assert agonlib.paper.cell_of(name) == cell


def test_cell_config_places_the_run_under_the_output_root(monkeypatch, tmp_path):
    monkeypatch.delenv(OUT_DIR_ENV, raising=False)
    config = pipeline.cell_config("smoke", "fixed_roles", seed=2, steps=3, out_dir=tmp_path, lambda_len=0.1)
    assert config.run_dir == tmp_path / "runs" / "smoke" / "fixed_roles-seed2"
    assert (config.roles, config.steps, config.seed, config.lambda_len) == ("fixed", 3, 2, 0.1)
    default = pipeline.cell_config("smoke", "agon")
    assert default.out_dir is None and default.run_dir == RUNS_DIR / "smoke" / "agon"


def test_baseline_run_is_agon_per_seed(tmp_path):
    configs = {tmp_path / name: pipeline.cell_config("smoke", cell, seed=seed)
               for name, cell, seed in [("agon", "agon", 0), ("grpo", "grpo", 0), ("coop_exchange", "coop_exchange", 0),
                                        ("grpo-seed1", "grpo", 1), ("fixed_roles-seed1", "fixed_roles", 1)]}
    assert pipeline._baseline_runs(configs) == {tmp_path / "agon", tmp_path / "fixed_roles-seed1"}


def _final_eval(run_dir, step, systems, n=4):
    ckpt = run_dir / "checkpoints" / f"step-{step:06d}"
    result = {s: {"pass@1": 0.5, "n_problems": n} for s in systems}
    result["meta"] = {"checkpoint": str(ckpt)}
    (run_dir / "final_eval.json").write_text(json.dumps(result))


def _checkpoint(run_dir, step):
    path = run_dir / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text("done\n")


EVALUATION_CASES = [
    # (checkpoints, evaluated at, systems in the file, n_problems in the file, done?)
    ([4], 4, ("A", "B"), 4, True),  # everything there, on the newest checkpoint
    ([4, 8], 4, ("A", "B"), 4, False),  # training went on: the evaluation is stale
    ([4], 4, ("A",), 4, False),  # a system missing
    ([4], 4, ("A", "B"), 2, False),  # evaluated on fewer problems
    ([4], None, (), 4, False),  # never evaluated
]


@pytest.mark.parametrize("ckpts, evaluated, systems, n, done", EVALUATION_CASES)
def test_evaluation_done(tmp_path, ckpts, evaluated, systems, n, done):
    for step in ckpts:
        _checkpoint(tmp_path, step)
    if evaluated is not None:
        _final_eval(tmp_path, evaluated, systems, n)
    assert pipeline.evaluation_done(tmp_path, ("A", "B"), 4) is done


def test_train_cell_skips_resumes_and_forces(tmp_path, capsys):
    """Real smoke training (seconds): new → skipped → resumed to more steps → forced from scratch."""
    kw = dict(out_dir=tmp_path, max_new_tokens=4, progress=False)
    run_dir = pipeline.train_cell("smoke", "agon", steps=1, **kw)
    metrics = run_dir / "metrics.jsonl"
    assert len(metrics.read_text().splitlines()) == 1 and "training 1 steps" in capsys.readouterr().out
    before = metrics.read_bytes()

    pipeline.train_cell("smoke", "agon", steps=1, **kw)
    assert "already trained" in capsys.readouterr().out and metrics.read_bytes() == before

    pipeline.train_cell("smoke", "agon", steps=2, **kw)
    assert "resuming from step 1" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]

    # other settings than the recorded run's: never skipped or resumed silently
    with pytest.raises(agonlib.ConfigError, match=r"other settings \(max_new_tokens: 4 → 5\).*force=True"):
        pipeline.train_cell("smoke", "agon", steps=2, **{**kw, "max_new_tokens": 5})

    pipeline.train_cell("smoke", "agon", steps=1, force=True, **kw)
    assert "deleting" in capsys.readouterr().out
    assert len(metrics.read_text().splitlines()) == 1

    results = pipeline.evaluate_runs("smoke", out_dir=tmp_path, progress=False)
    assert set(results["agon"]) >= {"A", "B", "cascade_AB", "cascade_BA", "base", "moa"}
    capsys.readouterr()
    pipeline.evaluate_runs("smoke", out_dir=tmp_path, progress=False)
    assert "already evaluated" in capsys.readouterr().out
    table = pipeline.collect_results("smoke", out_dir=tmp_path)
    assert (tmp_path / "results" / "smoke.csv").exists() and set(table["run"]) == {"agon"}


STATUS_CASES = [
    # (complete checkpoints, last logged step, final_eval.json?, status for steps=8)
    ([], 0, False, ("new", 0)),  # nothing yet
    ([], 3, False, ("partial", 0)),  # killed before its first checkpoint: starts again
    ([4], 6, False, ("partial", 4)),  # resumes from step 4
    ([4, 8], 8, False, ("done", 8)),  # the final checkpoint is complete
    ([], 8, True, ("done", 0)),  # evaluated, then its checkpoints deleted
    ([4], 10, True, ("partial", 4)),  # an evaluation of an unfinished run does not finish it
]


@pytest.mark.parametrize("ckpts, logged, evaluated, status", STATUS_CASES)
def test_training_status(tmp_path, ckpts, logged, evaluated, status):
    config = pipeline.cell_config("smoke", "agon", steps=8, out_dir=tmp_path)
    run = config.run_dir
    run.mkdir(parents=True)
    for step in ckpts:
        _checkpoint(run, step)
    if logged:
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, logged + 1)))
    if evaluated:
        (run / "final_eval.json").write_text("{}")
    assert pipeline.training_status(config) == status


def test_evaluation_in_two_processes_equals_one(tmp_path, capsys, monkeypatch):
    """jobs=2 (a process per run) gives the very results of jobs=1 (one process, one shared model)."""
    kw = dict(out_dir=tmp_path / "one", max_new_tokens=4, progress=False)
    pipeline.train_cell("smoke", "agon", steps=1, **kw)
    pipeline.train_cell("smoke", "grpo", steps=1, **kw)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    one = pipeline.evaluate_runs("smoke", out_dir=tmp_path / "one", eval_problems=3, jobs=1)
    capsys.readouterr()
    two = pipeline.evaluate_runs("smoke", out_dir=tmp_path / "two", eval_problems=3, jobs=2)
    assert "2 runs, 2 at a time" in capsys.readouterr().out
    assert list(two) == list(one) == ["agon", "grpo"]
    for run in one:
        for system in one[run]:
            if system != "meta":
                assert two[run][system] == one[run][system], (run, system)
        assert set(one[run]) >= ({"grpo"} if run == "grpo" else {"A", "cascade_AB", "base", "moa"})

    # a run that cannot be evaluated stops the job with its name; the other run's result is kept on disk
    for adapter in (tmp_path / "two" / "runs" / "smoke" / "grpo").rglob("adapter_model.safetensors"):
        adapter.write_bytes(b"not a safetensors file")
    (tmp_path / "two" / "runs" / "smoke" / "agon" / "final_eval.json").unlink()
    with pytest.raises(RuntimeError, match=r"Evaluating grpo failed"):
        pipeline.evaluate_runs("smoke", out_dir=tmp_path / "two", eval_problems=3, jobs=2, force=True)
    assert (tmp_path / "two" / "runs" / "smoke" / "agon" / "final_eval.json").exists()

    # evaluating one run alone does not move the untrained systems (base, moa) onto it: they stay with agon
    (tmp_path / "one" / "runs" / "smoke" / "grpo" / "final_eval.json").unlink()
    only = pipeline.evaluate_runs("smoke", out_dir=tmp_path / "one", runs=["grpo"], eval_problems=3)
    assert list(only) == ["grpo"] and "moa" not in only["grpo"] and "base" not in only["grpo"]

    # a run evaluated by another process after this job planned its work is not evaluated again
    def no_second_evaluation(*args, **kwargs):
        raise AssertionError("evaluated twice")
    monkeypatch.setattr(pipeline, "evaluate", no_second_evaluation)
    grpo_dir = tmp_path / "one" / "runs" / "smoke" / "grpo"
    assert pipeline._evaluate_one(grpo_dir, ("grpo",), 3, False) == only["grpo"]
    assert "evaluated by another process meanwhile" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="evaluated twice"):
        pipeline._evaluate_one(grpo_dir, ("grpo",), 3, False, force=True)
