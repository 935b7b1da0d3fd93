"""The paper's orderings judged from run files (agonlib.study.verdict): intervals decide, pairing by seed.

Run directories are written by hand in the evaluation's format (``final_eval.json``
with per-item correctness and final-stage lengths), so every expected figure
can be worked out on paper.
"""

import json
import shutil
import statistics
from pathlib import Path

import pytest

from agonlib import load_config
from agonlib.__main__ import main
from agonlib.study import results, verdict
from agonlib.study.verdict import Ordering, ReportError

COMMITTED = Path(__file__).resolve().parent.parent / "experiments" / "results"

N = 100  # held-out items per run


def _correct(right: int, n: int = N, offset: int = 0) -> list[int]:
    """``right`` ones among ``n`` items, starting at item ``offset`` (wrapping)."""
    return [1 if (i - offset) % n < right else 0 for i in range(n)]


def write_eval(root, cell, seed, systems: dict, *, mode="agon", exchange=True, leak=None, logged=()):
    """A run directory with a final_eval.json: ``systems`` maps a system to (correct list, final lengths)."""
    run = root / (cell if seed == 0 else f"{cell}-seed{seed}")
    run.mkdir(parents=True)
    config = {"run_name": run.name, "seed": seed, "mode": mode, "exchange": exchange}
    (run / "config.json").write_text(json.dumps({"config": config}))
    result = {s: {"pass@1": sum(c) / len(c), "correct": c, "final_len_distribution": lens,
                  "mean_final_len": sum(lens) / len(lens), "n_problems": len(c)}
              for s, (c, lens) in systems.items()}
    result["meta"] = {"run": run.name, "seed": seed}
    (run / "final_eval.json").write_text(json.dumps(result))
    if leak is not None:
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": k + 1, "challenger/leak_rate": v}) + "\n"
                                                   for k, v in enumerate(leak)))
    # logged sample rounds: one problem per (question, gold, [(draft_correct, leaked) per pair])
    problems = [{"question": q, "answer": gold, "rollouts": [{"draft_correct": c, "leaked": leaked, "summary": "s"}
                                                           for c, leaked in pairs]} for q, gold, pairs in logged]
    (run / "rollouts.jsonl").write_text(json.dumps({"step": 1, "problems": problems}) + "\n")
    return run


def _lens(value: float) -> list[float]:
    return [value] * N


AGON_ABOVE_GRPO = Ordering("Agon above GRPO-2N", ("agon", "cascade_AB"), ("grpo_2n", "grpo"))


@pytest.mark.parametrize("agon_right, grpo_right, verdict_word", [
    # every seed 30 points apart: the interval lies far above zero
    ((60, 62, 58), (30, 31, 29), "holds"),
    # differences +0.05, -0.02, +0.03 (the module's worked example): mean +0.02, interval [-0.07, +0.11]
    ((35, 28, 33), (30, 30, 30), "not separated"),
    # the paper's order turned round on every seed (by 30, 32 and 29 points: seeds that agree exactly would
    # give an interval without width)
    ((10, 12, 11), (40, 44, 40), "reversed"),
])
def test_verdict_comes_from_the_interval_across_seeds(tmp_path, agon_right, grpo_right, verdict_word):
    for seed, (a, g) in enumerate(zip(agon_right, grpo_right)):
        write_eval(tmp_path, "agon", seed, {"cascade_AB": (_correct(a), _lens(30))})
        write_eval(tmp_path, "grpo_2n", seed, {"grpo": (_correct(g), _lens(40))}, mode="grpo")
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert row["seeds"] == 3 and row["problems"] == 3 * N and row["interval"] == "t over 3 seeds"
    assert row["difference"] == pytest.approx(sum(a - g for a, g in zip(agon_right, grpo_right)) / 3 / N)
    assert row["verdict"] == verdict_word


def test_worked_example_interval(tmp_path):
    for seed, a in enumerate((35, 28, 33)):
        write_eval(tmp_path, "agon", seed, {"cascade_AB": (_correct(a), _lens(30))})
        write_eval(tmp_path, "grpo_2n", seed, {"grpo": (_correct(30), _lens(40))}, mode="grpo")
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert row["per seed"] == "+0.050 -0.020 +0.030"
    assert (round(row["low"], 3), round(row["high"], 3)) == (-0.07, 0.11)


def test_pooled_transitions_and_mcnemar_count_items_where_only_one_is_right(tmp_path):
    # One seed. Agon right on items 0-19, GRPO on items 10-24: Agon alone on 0-9, GRPO alone on 20-24.
    write_eval(tmp_path, "agon", 0, {"cascade_AB": (_correct(20), _lens(30))})
    write_eval(tmp_path, "grpo_2n", 0, {"grpo": (_correct(15, offset=10), _lens(40))}, mode="grpo")
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert (row["first only"], row["second only"]) == (10, 5)
    assert row["McNemar p"] == pytest.approx(2 * 4944 / 2**15)  # two-sided exact binomial, 5 of 15 at 1/2
    # one seed: the paired item interval of +0.05 (sd of the item differences ~0.39) straddles zero
    assert row["low"] < 0 < row["high"] and row["verdict"] == "not separated (1 seed)"


def test_one_seed_with_a_large_gap_holds_on_the_item_interval(tmp_path):
    write_eval(tmp_path, "agon", 0, {"cascade_AB": (_correct(60), _lens(30))})
    write_eval(tmp_path, "grpo_2n", 0, {"grpo": (_correct(20), _lens(40))}, mode="grpo")
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert row["seeds"] == 1 and row["low"] > 0 and row["verdict"] == "holds (1 seed)"
    assert row["interval"] == "problems, 1 seed"
    diffs = [1.0] * 40 + [0.0] * 60  # Agon alone right on items 20-59
    half = 1.984217 * statistics.stdev(diffs) / N**0.5  # t(0.975, 99) over the items, not the normal 1.96
    assert (row["low"], row["high"]) == pytest.approx((0.4 - half, 0.4 + half), rel=1e-6)
    assert (row["first only"], row["second only"]) == (40, 0)


def test_length_ordering_expects_the_first_to_be_shorter(tmp_path):
    for seed in range(3):
        write_eval(tmp_path, "agon", seed, {"cascade_AB": (_correct(30), _lens(20 + seed))})
        write_eval(tmp_path, "grpo_2n", seed, {"grpo": (_correct(30), _lens(45 - seed))}, mode="grpo")
    shorter = Ordering("shorter", ("agon", "cascade_AB"), ("grpo_2n", "grpo"), "final_len", "lower")
    row = verdict.ordering_row(shorter, verdict.load_evaluations(tmp_path))
    assert row["per seed"] == "-25.0 -23.0 -21.0"
    assert row["verdict"] == "holds"
    assert "first only" not in row  # no McNemar for lengths
    longer = Ordering("longer", ("agon", "cascade_AB"), ("grpo_2n", "grpo"), "final_len", "higher")
    assert verdict.ordering_row(longer, verdict.load_evaluations(tmp_path))["verdict"] == "reversed"


def test_seeds_pair_only_with_their_own_seed_and_the_same_items(tmp_path):
    write_eval(tmp_path, "agon", 0, {"cascade_AB": (_correct(50), _lens(30))})
    write_eval(tmp_path, "agon", 1, {"cascade_AB": (_correct(50), _lens(30))})
    write_eval(tmp_path, "grpo_2n", 1, {"grpo": (_correct(20), _lens(40))}, mode="grpo")  # seed 0 missing
    write_eval(tmp_path, "agon", 2, {"cascade_AB": (_correct(50), _lens(30))})
    write_eval(tmp_path, "grpo_2n", 2, {"grpo": (_correct(10, n=50), [40.0] * 50)}, mode="grpo")  # other items
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert row["seeds"] == 1 and row["per seed"] == "+0.300"


def test_an_ordering_with_a_missing_cell_is_not_evaluated(tmp_path):
    write_eval(tmp_path, "agon", 0, {"cascade_AB": (_correct(50), _lens(30))})
    table = verdict.orderings(tmp_path)
    assert list(table["claim"]) == [o.claim for o in verdict.ORDERINGS]
    assert set(table["verdict"]) == {"not evaluated"}
    assert table["first only"].isna().all()  # no counts where nothing was compared


def test_samples_of_one_problem_count_once(tmp_path):
    # 50 problems x 2 samples: the first system is right on both samples of problems 0-24 and on the first
    # sample of 25-49; the second never. Per-problem differences 1.0 and 0.5, McNemar on first samples: 50 / 0.
    first = [1, 1] * 25 + [1, 0] * 25
    write_eval(tmp_path, "agon", 0, {"cascade_AB": (first, [30.0] * 100)})
    write_eval(tmp_path, "grpo_2n", 0, {"grpo": ([0] * 100, [40.0] * 100)}, mode="grpo")
    for run, system in (("agon", "cascade_AB"), ("grpo_2n", "grpo")):
        path = tmp_path / run / "final_eval.json"
        result = json.loads(path.read_text())
        result[system].update({"n_problems": 50, "n_samples": 2})
        path.write_text(json.dumps(result))
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert row["problems"] == 50 and row["difference"] == pytest.approx(0.75)
    assert (row["first only"], row["second only"]) == (50, 0)
    assert row["verdict"] == "holds (1 seed)"


def test_an_interval_without_width_separates_nothing(tmp_path):
    # three seeds with exactly the same difference: a t-interval of width zero is not evidence
    for seed in range(3):
        write_eval(tmp_path, "agon", seed, {"cascade_AB": (_correct(60), _lens(30))})
        write_eval(tmp_path, "grpo_2n", seed, {"grpo": (_correct(30), _lens(40))}, mode="grpo")
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert row["low"] == row["high"] == pytest.approx(0.3)
    assert row["verdict"] == "not separated"


def test_differences_equal_but_for_float_rounding_have_no_width(tmp_path):
    # 0.3 - 0.2, 0.2 - 0.1 and 0.4 - 0.3 print as +0.100 three times but differ in the last bits
    for seed, (a, g) in enumerate(((30, 20), (20, 10), (40, 30))):
        write_eval(tmp_path, "agon", seed, {"cascade_AB": (_correct(a), _lens(30))})
        write_eval(tmp_path, "grpo_2n", seed, {"grpo": (_correct(g), _lens(40))}, mode="grpo")
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert row["per seed"] == "+0.100 +0.100 +0.100" and 0 < row["high"] - row["low"] < 1e-12
    assert row["McNemar p"] < 1e-8 and row["verdict"] == "not separated"


def test_mcnemar_must_agree_on_the_side_the_interval_puts_ahead(tmp_path):
    # 100 problems x 2 samples. Agon is right on the second sample of 60 problems (pass@1 0.30), GRPO-2N on
    # the first sample of 20, 22, 18 (0.10, 0.11, 0.09): the interval puts Agon ahead, but on each problem's
    # first sample, which McNemar reads, only GRPO-2N is ever right.
    for seed, g in enumerate((20, 22, 18)):
        write_eval(tmp_path, "agon", seed, {"cascade_AB": ([0, 1] * 60 + [0, 0] * 40, [30.0] * 200)})
        write_eval(tmp_path, "grpo_2n", seed, {"grpo": ([1, 0] * g + [0, 0] * (100 - g), [40.0] * 200)},
                   mode="grpo")
        for run, system in (("agon", "cascade_AB"), ("grpo_2n", "grpo")):
            path = tmp_path / (run if seed == 0 else f"{run}-seed{seed}") / "final_eval.json"
            result = json.loads(path.read_text())
            result[system].update({"n_problems": 100, "n_samples": 2})
            path.write_text(json.dumps(result))
    row = verdict.ordering_row(AGON_ABOVE_GRPO, verdict.load_evaluations(tmp_path))
    assert row["low"] > 0 and (row["first only"], row["second only"]) == (0, 60) and row["McNemar p"] < 1e-8
    assert row["verdict"] == "not separated"


def test_leak_rates_cover_exchange_cells_only(tmp_path):
    logged = [("Ada has 5 pens. She finds 2 more.", "7", [(1, False), (0, True), (0, False)]),
              ("Bo has 2 pens. He loses 1.", "1", [(0, True), (1, False)]),  # the gold 1 is in the question
              ("Cy has 12 pens. He loses 1.", "11", [(0, True)])]  # 1 is in "11"'s question, 11 is not
    write_eval(tmp_path, "agon", 0, {}, leak=[0.0, 0.01, 0.005], logged=logged)
    write_eval(tmp_path, "agon", 1, {}, leak=[0.0, 0.0, 0.0])
    write_eval(tmp_path, "fixed_roles", 0, {}, leak=[0.0, 0.0])
    write_eval(tmp_path, "comp_no_exchange", 0, {}, exchange=False, leak=[0.5])  # no summary shown: not a leak
    write_eval(tmp_path, "grpo", 0, {}, mode="grpo")
    table = verdict.leak_rates(tmp_path).set_index("cell")
    assert list(table.index) == ["agon", "fixed_roles"]
    assert table.loc["agon", "per seed (mean over steps)"] == "0.005 0.000"
    assert table.loc["agon", "leak rate (mean of seeds)"] == pytest.approx(0.0025)
    assert table.loc["agon", "worst step"] == pytest.approx(0.01)
    assert table.loc["agon", "every seed ≤ 0.01"] and table.loc["fixed_roles", "every seed ≤ 0.01"]
    assert table.loc["agon", "logged: right drafts leaking"] == "0 / 2"  # masking failures
    assert table.loc["agon", "logged: wrong drafts leaking"] == "3 / 4"  # the gold as a step of wrong reasoning
    assert table.loc["agon", "of which the gold is in the question"] == 1  # whole numbers only: not 11's "1"
    write_eval(tmp_path, "coop_exchange", 0, {}, leak=[0.03, 0.01])
    assert not verdict.leak_rates(tmp_path).set_index("cell").loc["coop_exchange", "every seed ≤ 0.01"]


def _five_seeds(root, seeds):
    """Agon's cascade and adapter A and GRPO-2N, seed by seed, each seed with its own gaps."""
    for seed in seeds:
        write_eval(root, "agon", seed, {"cascade_AB": (_correct(40 + 3 * seed, offset=seed), _lens(30 - seed)),
                                        "A": (_correct(35 + seed), _lens(33))})
        write_eval(root, "grpo_2n", seed, {"grpo": (_correct(45 - seed, offset=2 * seed), _lens(36 + seed % 2))},
                   mode="grpo")


def _report(runs_dir, path):
    """A results report of ``runs_dir`` as reproduce writes it: ``path.csv`` and ``path.md``."""
    table = results.collect("test", runs_dir, write=False)
    table.to_csv(path.with_suffix(".csv"), index=False)
    path.with_suffix(".md").write_text(results.report(table, runs_dir) + "\n")
    return path.with_suffix(".csv")


def test_combining_reports_of_split_seeds_equals_judging_every_run_together(tmp_path):
    _five_seeds(tmp_path / "first", (0, 1, 2))
    _five_seeds(tmp_path / "second", (3, 4))
    _five_seeds(tmp_path / "all", range(5))
    reports = [_report(tmp_path / "first", tmp_path / "a"), _report(tmp_path / "second", tmp_path / "b")]
    combined, together = verdict.combine(reports), verdict.orderings(tmp_path / "all")
    assert list(combined["verdict"]) == list(together["verdict"])
    judged = together["verdict"] != "not evaluated"
    assert judged.sum() == 4  # cascade vs GRPO-2N, A→B vs A, A vs GRPO-2N, final length vs GRPO-2N
    assert set(together.loc[judged, "seeds"]) == {5}
    for column in ("per seed", "seeds", "problems", "first only", "second only", "interval"):
        assert list(combined[column]) == list(together[column]), column
    for column in ("difference", "low", "high", "McNemar p"):
        assert combined.loc[judged, column].astype(float).tolist() == pytest.approx(
            together.loc[judged, column].astype(float).tolist(), nan_ok=True), column


def test_each_committed_report_combines_to_its_own_orderings_table():
    # A report's CSV alone gives the per-seed differences its Markdown was written with from the run directories.
    for name in ("cpu", "cpu-fp32", "cpu-bf16", "cpu-bf16-seeds3-4", "cpu-bf16-seeds5-6"):
        table = results.to_markdown(verdict.combine([COMMITTED / f"{name}.csv"]))
        assert table in (COMMITTED / f"{name}.md").read_text(), name


@pytest.mark.parametrize("combined, reports", [
    ("cpu-bf16-5seeds", ("cpu-bf16", "cpu-bf16-seeds3-4")),
    ("cpu-bf16-7seeds", ("cpu-bf16", "cpu-bf16-seeds3-4", "cpu-bf16-seeds5-6")),
])
def test_the_committed_multi_seed_tables_regenerate(combined, reports):
    reports = [COMMITTED / f"{name}.csv" for name in reports]
    committed = (COMMITTED / f"{combined}.md").read_text()
    assert results.to_markdown(verdict.combine(reports)) in committed
    assert results.to_markdown(results.across_reports(reports)) in committed


def test_a_variant_against_its_base_report():
    # the committed results (the cpu profile's summary_mask: stated) against the same seeds trained with the
    # answer mask alone (experiments/LOG.md, 2026-12-07)
    systems, ordered = verdict.against(COMMITTED / "cpu.csv", COMMITTED / "cpu-bf16.csv")
    row = systems.set_index(["cell", "system"])
    # a single adapter that never read a summary cannot be moved by the mask: the cells without exchange were
    # retrained for cpu.csv and equal their answer-mask runs, as do fixed roles' A (it only drafts) and the base
    unmoved = [("grpo", "grpo"), ("grpo_2n", "grpo"), ("fixed_roles", "A"), ("agon", "base"),
               *((cell, adapter) for cell in ("comp_no_exchange", "coop_no_exchange") for adapter in "AB")]
    assert [row.loc[key, "per seed"] for key in unmoved] == ["+0.000 +0.000 +0.000"] * len(unmoved)
    # ... while their cascades moved: the second stage reads the masked summary at evaluation too
    assert row.loc[("comp_no_exchange", "cascade_AB"), "per seed"] == "+0.080 -0.025 +0.005"
    assert row.loc[("agon", "cascade_AB"), "per seed"] == "+0.000 -0.070 +0.070"
    assert row.loc[("fixed_roles", "B"), "high"] < 0
    claim = ordered.set_index("claim").loc["Agon above GRPO-2N (compute-matched)"]
    # the same mean as the base over these seeds, but the variant's seeds spread more: not separated
    assert claim["difference"] == pytest.approx(claim["base difference"]) == pytest.approx(-0.1033, abs=1e-4)
    assert claim["low"] < 0 < claim["high"] and claim["base high"] < 0


def test_the_committed_results_are_the_cpu_profiles_and_leak_nothing():
    """The committed results are the main job's: trained with the cpu profile's mask, no training summary of
    any exchange cell stating the gold (issue 15's leak goal, ≤ 1% in every seed)."""
    assert load_config("cpu").summary_mask == "stated"
    header, *rows = verdict.read_report_table(COMMITTED / "cpu.md", "## Training leak rate")
    table = {row[0]: dict(zip(header, row)) for row in rows}
    assert set(table) == {"agon", "coop_exchange", "fixed_roles"}
    for cell, row in table.items():
        assert row["seeds"] == "3" and row["every seed ≤ 0.01"] == "True", cell
        assert row["worst step"] == "0.000", cell


def test_verdict_out_also_writes_each_systems_mean_over_all_seeds(tmp_path):
    _five_seeds(tmp_path / "first", (0, 1))
    _five_seeds(tmp_path / "second", (2, 3, 4))
    _five_seeds(tmp_path / "every", range(5))
    reports = [str(_report(tmp_path / "first", tmp_path / "a")), str(_report(tmp_path / "second", tmp_path / "b"))]
    assert main(["verdict", *reports, "--out", str(tmp_path / "all.md")]) == 0
    means = results.across_reports(reports)
    together = results.across_seeds(results.collect("test", tmp_path / "every", write=False))
    assert list(means["seeds"]) == [5, 5, 5]  # agon A, agon cascade_AB, grpo_2n grpo
    for column in ("cell", "system", "per seed"):
        assert list(means[column]) == list(together[column]), column
    for column in ("pass@1 mean", "pass@1_lo", "pass@1_hi"):
        assert means[column].tolist() == pytest.approx(together[column].tolist()), column
    assert results.to_markdown(means) in (tmp_path / "all.md").read_text()


def test_a_seed_counted_twice_or_a_csv_beside_another_report_is_refused(tmp_path, capsys):
    _five_seeds(tmp_path / "first", (0, 1))
    _five_seeds(tmp_path / "again", (1, 2))
    first, again = _report(tmp_path / "first", tmp_path / "a"), _report(tmp_path / "again", tmp_path / "b")
    with pytest.raises(ReportError, match=r"repeats seed\(s\) \[1\]"):
        verdict.combine([first, again])
    assert main(["verdict", str(first), str(again)]) == 2
    assert "each seed may be counted once" in capsys.readouterr().err
    shutil.copy(tmp_path / "a.md", tmp_path / "b.md")  # b.csv now sits beside a.md
    with pytest.raises(ReportError, match="they are not one report"):
        verdict.combine([again])


def test_an_ordering_with_one_seed_in_all_is_left_to_its_report(tmp_path):
    _five_seeds(tmp_path / "first", (0, 1))
    write_eval(tmp_path / "second", "agon", 2, {"cascade_AB": (_correct(50), _lens(30))})
    write_eval(tmp_path / "second", "grpo", 2, {"grpo": (_correct(40), _lens(30))}, mode="grpo")
    table = verdict.combine([_report(tmp_path / "first", tmp_path / "a"), _report(tmp_path / "second", tmp_path / "b")])
    rows = table.set_index("claim")
    assert rows.loc["Agon above GRPO (N)", "verdict"] == "one seed: judged in its own report"
    assert rows.loc["Agon above GRPO-2N (compute-matched)", "seeds"] == 2


def test_verdict_command_writes_the_table_with_the_command(tmp_path):
    _five_seeds(tmp_path / "first", (0, 1, 2))
    _five_seeds(tmp_path / "second", (3, 4))
    reports = [str(_report(tmp_path / "first", tmp_path / "a")), str(_report(tmp_path / "second", tmp_path / "b"))]
    out = tmp_path / "five.md"
    assert main(["verdict", *reports, "--out", str(out)]) == 0
    text = out.read_text()
    assert f"python -m agonlib verdict {reports[0]} {reports[1]} --out {out}" in text
    assert results.to_markdown(verdict.combine(reports)) in text
