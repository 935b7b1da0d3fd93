"""Figures from small synthetic run files: every figure written, data from the files, missing runs handled.

No model here: the run directories are written by hand in the trainer's and
evaluation's formats (``config.json``, ``metrics.jsonl``, ``eval.jsonl``,
``rollouts.jsonl``, ``final_eval.json``), so these tests take seconds.
"""

import json
import math

import pytest

from agonlib.study import paper, pipeline, plots
from agonlib.study.paths import output_paths

PROFILE = "synthetic"
ALL = plots.LENGTH_FIGURES + plots.RESULTS_FIGURES


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_run(root, name, *, mode="agon", seed=0, steps=4, evals=True, final=True, rollouts=True,
              checkpoint=True):
    """A run directory in the trainer's formats, with simple known values."""
    run = output_paths(PROFILE, root).run_dir(name)
    run.mkdir(parents=True)
    config = {"profile": PROFILE, "run_name": name, "seed": seed, "mode": mode, "steps": steps,
              "max_new_tokens": 64}
    (run / "config.json").write_text(json.dumps({"config": config}))
    metrics = []
    for step in range(1, steps + 1):
        row = {"step": step, "drafter": "A" if step % 2 else "B", "challenger": None if mode == "grpo" else "B",
               "drafter/accuracy": step / 10, "drafter/len_mean": 40.0 + step, "time/step_s": 1.0}
        if mode == "agon":
            row.update({"challenger/accuracy": step / 20, "challenger/len_mean": 30.0 + step,
                        "challenger/conversion_rate_given_wrong": 0.25,
                        "challenger/regression_rate_given_right": 0.5,
                        "challenger/tiebreak_rate": None if step == 1 else 0.5})  # NaN is logged as null
        metrics.append(row)
    _write_jsonl(run / "metrics.jsonl", metrics)
    system = "grpo" if mode == "grpo" else "cascade_AB"
    if evals:
        rows = []
        for step in (2, 4):
            row = {"step": step, f"{system}/pass@1": step / 8, f"{system}/mean_final_len": 20.0}
            if mode == "agon":
                row.update({"A_B_disagreement": 0.5, "A_B_weight_divergence": 0.9 - step / 100})
            rows.append(row)
        _write_jsonl(run / "eval.jsonl", rows)
    if rollouts:
        items = [{"draft_len": 10 * (i + 1), "draft_correct": i % 2, "summary": "s"} for i in range(4)]
        if mode == "agon":
            for item in items:
                item.update({"challenge_len": 25, "challenge_correct": 1})
        _write_jsonl(run / "rollouts.jsonl", [{"step": steps, "problems": [{"question": "q", "rollouts": items}]}])
    if checkpoint:
        (run / "checkpoints" / f"step-{steps:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{steps:06d}" / "COMPLETE").write_text("done\n")
    if final:
        systems = ["grpo"] if mode == "grpo" else ["A", "B", "cascade_AB", "cascade_BA", "base", "moa"]
        result = {s: {"pass@1": 0.5 if s == system else 0.25, "mean_final_len": 15.0, "tokens_per_problem": 15.0,
                      "n_problems": 4, "n_samples": 1, "final_len_distribution": [10, 15, 15, 20]}
                  for s in systems}
        result["meta"] = {"run": name, "profile": PROFILE, "seed": seed,
                          "checkpoint": str(run / "checkpoints" / f"step-{steps:06d}"),
                          "A_B_disagreement": 0.75 if mode == "agon" else None}
        (run / "final_eval.json").write_text(json.dumps(result))
    return run


def _two_runs(root):
    write_run(root, "agon")
    write_run(root, "grpo", mode="grpo")
    pipeline.collect_results(PROFILE, out_dir=root)
    return root


@pytest.fixture
def root(tmp_path):
    return _two_runs(tmp_path)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """Every figure drawn once from an Agon and a GRPO run; with the bytes of each file."""
    root = _two_runs(tmp_path_factory.mktemp("figures"))
    figures = plots.make_figures(PROFILE, out_dir=root)
    return root, figures, {p.name: p.read_bytes() for f in figures for p in f.paths}


def test_every_figure_written_as_png_and_svg(drawn):
    root, drawn, _ = drawn
    assert [f.name for f in drawn] == list(ALL)
    figure_dir = output_paths(PROFILE, root).figures
    assert sorted(p.name for p in figure_dir.iterdir()) == sorted(f"{n}.{ext}" for n in ALL for ext in ("png", "svg"))
    for fig in drawn:
        assert fig.note is None, fig.note  # every input exists
        assert all(p.stat().st_size > 1000 for p in fig.paths)
        assert f"profile {PROFILE}" in fig.data["title"] and "1 seed" in fig.data["title"]


def test_plotted_values_come_from_the_run_files(drawn):
    figs = {f.name: f.data for f in drawn[1]}
    # eval.jsonl: the headline system of each run (cascade_AB for Agon, the adapter for GRPO)
    assert figs["pass1_over_training"]["eval_pass1"] == {"agon": {"x": [2, 4], "y": [0.25, 0.5]},
                                                         "grpo": {"x": [2, 4], "y": [0.25, 0.5]}}
    # metrics.jsonl: training accuracy of the drafter, every step
    assert figs["pass1_over_training"]["train_accuracy"]["agon"]["y"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert figs["length_over_training"]["challenger"] == {"agon": {"x": [1, 2, 3, 4], "y": [31.0, 32.0, 33.0, 34.0]}}
    # a null rate (NaN in the trainer) is a gap, not a crash
    assert figs["conversion_rates"]["tiebreak_rate"]["agon"]["y"] == [None, 0.5, 0.5, 0.5]
    assert figs["ab_divergence"]["weight_divergence"]["agon"]["y"] == [0.88, 0.86]
    assert figs["ab_divergence"]["final_disagreement"]["agon"] == {"step": 4, "value": 0.75}
    # final_eval.json's per-item lengths
    assert figs["final_length_distribution"]["agon"] == {"lengths": [10, 15, 15, 20],
                                                         "source": "final eval, cascade_AB"}
    binned = figs["accuracy_vs_length"]["binned"]["agon"]
    assert sum(binned["n"]) == 8  # 4 drafts + 4 challenges
    # results table beside the paper's numbers
    rows = {r["run"]: r for r in figs["final_pass1"]["comparison"]}
    agon = rows["Agon (competition + exchange, rotating)"]
    assert (agon["paper pass@1"], agon["ours pass@1"], agon["ours B→A"]) == (0.61, 0.5, 0.25)
    assert rows["vanilla GRPO"]["ours pass@1"] == 0.5
    assert rows["untrained MoA"]["ours pass@1"] == 0.25
    assert rows["vanilla GRPO on Qwen3-4B"]["ours pass@1"] is None


def test_no_runs_at_all_still_writes_every_figure_with_a_note(tmp_path):
    drawn = plots.make_figures(PROFILE, out_dir=tmp_path)
    assert [f.name for f in drawn] == list(ALL)
    assert all(f.note for f in drawn)
    assert all(p.exists() for f in drawn for p in f.paths)
    assert "no runs yet" in drawn[0].data["title"]


def test_partial_runs_fall_back_or_say_what_is_missing(tmp_path):
    # a run stopped early: metrics only, no eval, no final evaluation, no results table
    write_run(tmp_path, "agon", evals=False, final=False, checkpoint=False)
    figs = {f.name: f for f in plots.make_figures(PROFILE, out_dir=tmp_path)}
    assert "eval.jsonl" in figs["pass1_over_training"].note
    assert "No results table" in figs["final_pass1"].note
    assert figs["ab_divergence"].note
    assert figs["length_over_training"].note is None
    # the last logged rollouts stand in for the missing final evaluation
    assert figs["final_length_distribution"].data["agon"]["source"] == "logged rollouts, step 4"
    assert figs["final_length_distribution"].data["agon"]["lengths"] == [25, 25, 25, 25]


def test_unreadable_run_is_skipped_not_fatal(root, caplog):
    bad = output_paths(PROFILE, root).run_dir("broken")
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    runs = plots.load_runs(output_paths(PROFILE, root).runs)
    assert [r.name for r in runs] == ["agon", "grpo"]
    assert "broken" in caplog.text


def test_seeds_counted_and_averaged(root):
    write_run(root, "agon-seed1", seed=1)
    table = pipeline.collect_results(PROFILE, out_dir=root)
    figs = {f.name: f for f in plots.make_figures(PROFILE, ["pass1_over_training", "final_pass1"], out_dir=root)}
    assert "2 seeds" in figs["pass1_over_training"].data["title"]
    assert "2 seeds" in figs["final_pass1"].data["title"]
    row = paper.comparison(table).set_index("run").loc["Agon (competition + exchange, rotating)"]
    assert row["per seed"] == [0.5, 0.5] and row["our runs"] == "agon, agon-seed1"


def test_several_seeds_draw_one_curve_per_cell_with_its_band(root):
    seed1 = write_run(root, "agon-seed1", seed=1)
    # seed 1 learns twice as fast
    rows = [json.loads(line) for line in (seed1 / "metrics.jsonl").read_text().splitlines()]
    _write_jsonl(seed1 / "metrics.jsonl", [{**r, "drafter/accuracy": 2 * r["drafter/accuracy"]} for r in rows])
    _write_jsonl(seed1 / "eval.jsonl", [{"step": 2, "cascade_AB/pass@1": 0.75}, {"step": 4, "cascade_AB/pass@1": 1.0}])
    fig = plots.make_figures(PROFILE, ["pass1_over_training"], out_dir=root)[0]
    train = fig.data["train_accuracy"]
    assert set(train) == {"agon", "grpo"}  # one curve per cell; a single-seed cell keeps its run's name
    assert train["agon"]["x"] == [1, 2, 3, 4]
    assert train["agon"]["y"] == pytest.approx([0.15, 0.3, 0.45, 0.6])  # mean of 0.1k and 0.2k
    assert train["agon"]["low"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert train["agon"]["high"] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert set(train["agon"]["seeds"]) == {"agon", "agon-seed1"}
    assert fig.data["eval_pass1"]["agon"]["y"] == pytest.approx([0.5, 0.75])
    assert "band min–max" in fig.data["title"] and fig.note is None
    # a seed still training: the mean covers the steps both logged, and the figure says so
    _write_jsonl(seed1 / "metrics.jsonl", [{**r, "drafter/accuracy": 2 * r["drafter/accuracy"]} for r in rows[:3]])
    fig = plots.make_figures(PROFILE, ["pass1_over_training"], out_dir=root)[0]
    assert fig.data["train_accuracy"]["agon"]["x"] == [1, 2, 3]
    assert "covers the 3 steps all its seeds logged" in fig.note


def test_periodic_curve_falls_back_to_the_system_evaluated(root):
    # the cpu profile's periodic evaluation scores adapter A only (eval_systems: [A]), not the cascade
    run_dir = output_paths(PROFILE, root).run_dir("agon")
    _write_jsonl(run_dir / "eval.jsonl", [{"step": 2, "A/pass@1": 0.75}, {"step": 4, "A/pass@1": 1.0}])
    fig = plots.make_figures(PROFILE, ["pass1_over_training"], out_dir=root)[0]
    assert fig.data["eval_pass1"]["agon"] == {"x": [2, 4], "y": [0.75, 1.0]}
    assert fig.note is None


def test_same_files_give_byte_identical_figures(drawn):
    root, _, first = drawn
    second = {p.name: p.read_bytes() for f in plots.make_figures(PROFILE, out_dir=root) for p in f.paths}
    assert first == second  # fixed SVG ids, no timestamps: figures are reproducible files


def test_unknown_figure_name_is_an_error(root):
    with pytest.raises(ValueError, match="Unknown figure"):
        plots.make_figures(PROFILE, ["pass1_over_trainin"], out_dir=root)


def test_rolling_mean_ignores_gaps():
    out = plots._rolling([1.0, float("nan"), 3.0, 5.0], 2)
    assert out[:1] == [1.0] and out[1] == 1.0 and out[2] == 3.0 and out[3] == 4.0
    assert math.isnan(plots._rolling([float("nan")], 3)[0])
