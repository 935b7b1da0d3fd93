"""Evaluation: the pass@k estimator, what each system's stages see, the results table."""

import json
import statistics
from types import SimpleNamespace

import pytest

import agonlib
from agonlib import evaluation as evaluate, prompts
from agonlib.study import results
from agonlib.parsing import split_completion
from agonlib.generation import Rollout

PASS_AT_K = [
    # (n, c, k, expected) — hand-computed 1 - C(n-c, k) / C(n, k)
    (5, 2, 1, 0.4),  # 1 - 3/5
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0),  # only 3 wrong samples: any 4 include a right one
    (5, 2, 5, 1.0),
    (5, 0, 3, 0.0),  # nothing right
    (5, 5, 1, 1.0),  # everything right
    (1, 1, 1, 1.0),
]


@pytest.mark.parametrize("n,c,k,expected", PASS_AT_K)
def test_pass_at_k(n, c, k, expected):
    assert evaluate.pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="pass@k"):
        evaluate.pass_at_k(3, 4, 1)


class FakeGenerate:
    """Stands in for rollouts.generate: scripted completions, every call's prompts recorded."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def __call__(self, policies, prompt_texts, adapter, seeds, **kw):
        self.calls.append({"adapter": adapter, "prompts": list(prompt_texts)})
        text = self.script(len(self.calls) - 1)
        parts = split_completion(text, thinking=kw.get("thinking", False))
        return [Rollout(p, [1], [2, 3], text, parts.think, parts.summary, parts.answer, 2, False, s)
                for p, s in zip(prompt_texts, seeds)]


class WordTokenizer:
    """A chat template that writes the messages as JSON; a token is a whitespace-separated word."""

    def apply_chat_template(self, messages, **kw):
        return json.dumps(messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}

    def decode(self, ids):
        return " ".join(ids)


@pytest.fixture
def fake_policies():
    return SimpleNamespace(tokenizer=WordTokenizer())


def _problems():
    return [{"question": "How many?", "answer": "4242"}, {"question": "How few?", "answer": "17"}]


def test_cascade_passes_exactly_the_drafters_summary(monkeypatch, fake_policies):
    config = agonlib.load_config("smoke", thinking=True)
    draft = "<think>secret scratch work</think>We add the two parts. The final answer is \\boxed{4242}."
    fake = FakeGenerate(lambda call: draft if call == 0 else "\\boxed{4242}")
    monkeypatch.setattr(evaluate, "generate", fake)
    monkeypatch.setattr(evaluate, "grade", lambda rollouts, problems, cfg: [1] * len(rollouts))
    evaluate.run_system(fake_policies, _problems(), "cascade_AB", config)
    assert [c["adapter"] for c in fake.calls] == ["A", "B"]  # A drafts, B answers
    summary = split_completion(draft, thinking=True).summary
    assert summary == "We add the two parts."
    for problem, text in zip(_problems(), fake.calls[1]["prompts"]):
        expected = prompts.challenge_prompt(problem["question"], summary, config.reward, config.task)
        assert text == json.dumps(expected)  # exactly the summary: no think text, no answer
        assert "secret" not in text and "4242" not in text


def test_cascade_with_derived_mask_reads_only_the_questions_numbers(monkeypatch, fake_policies):
    config = agonlib.load_config("smoke", summary_mask="derived")
    problems = [{"question": "Nora has 10 pens and uses 4. How many are left?", "answer": "6"}]
    draft = "She has 10 - 4 = 6 left, so 10 + 6 = 16.\n\\boxed{16}"  # wrong, through the gold
    fake = FakeGenerate(lambda call: draft if call == 0 else "\\boxed{6}")
    monkeypatch.setattr(evaluate, "generate", fake)
    monkeypatch.setattr(evaluate, "grade", lambda rollouts, problems, cfg: [1] * len(rollouts))
    evaluate.run_system(fake_policies, problems, "cascade_AB", config)
    shown = "She has 10 - 4 = […] left, so 10 + […] = […]."
    expected = prompts.challenge_prompt(problems[0]["question"], shown, config.reward, config.task)
    assert fake.calls[1]["prompts"] == [json.dumps(expected)]  # training's summary rule, in evaluation too


def test_moa_aggregator_reads_all_k_proposals(monkeypatch, fake_policies):
    config = agonlib.load_config("smoke", moa_k=3)
    fake = FakeGenerate(lambda call: f"proposal number {call} says \\boxed{{{call}}}")
    monkeypatch.setattr(evaluate, "generate", fake)
    monkeypatch.setattr(evaluate, "grade", lambda rollouts, problems, cfg: [0] * len(rollouts))
    out = evaluate.run_system(fake_policies, _problems(), "moa", config)
    assert [c["adapter"] for c in fake.calls] == [None, None, None, None]  # all base: 3 proposals + aggregator
    for text in fake.calls[3]["prompts"]:
        for k in range(3):
            assert f"proposal number {k} says" in text and f"\\\\boxed{{{k}}}" in text  # answers included
    assert out["total_tokens"] == [4 * 2, 4 * 2]  # every stage counted


class AnswerBy:
    """Fake generate whose completions box a per-adapter answer; records calls with their seeds."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, policies, prompt_texts, adapter, seeds, **kw):
        self.calls.append({"adapter": adapter, "seeds": list(seeds), "params": kw.get("params")})
        text = f"It is \\boxed{{{self.answers[adapter]}}}"
        parts = split_completion(text, thinking=False)
        return [Rollout(p, [1], [2, 3], text, parts.think, parts.summary, parts.answer, 2, False, s)
                for p, s in zip(prompt_texts, seeds)]


def _grade_by_answer(rollouts, problems, cfg):
    return [int(r.answer == p["answer"]) for r, p in zip(rollouts, problems)]


def test_cascade_grades_its_second_stage_and_reuses_the_first(monkeypatch, fake_policies):
    config = agonlib.load_config("smoke", challenger_max_new_tokens=7)
    problems = [{"question": "q1", "answer": "1"}, {"question": "q2", "answer": "1"}]
    fake = AnswerBy({"A": "0", "B": "1", None: "0"})  # A is wrong, B (second stage) right
    monkeypatch.setattr(evaluate, "generate", fake)
    monkeypatch.setattr(evaluate, "grade", _grade_by_answer)
    out = evaluate.evaluate_policies(fake_policies, problems, config, ("base", "A", "cascade_AB"), samples=1,
                                     progress=False)
    assert out["A"]["pass@1"] == 0.0 and out["cascade_AB"]["pass@1"] == 1.0  # graded on B's answer
    # one A generation serves both A and the cascade's first stage; base and A share their seeds
    adapters = [c["adapter"] for c in fake.calls]
    assert adapters[:2] == [None, "A"] and adapters.count("A") == 1
    assert fake.calls[0]["seeds"] == fake.calls[1]["seeds"]
    second = next(c for c in fake.calls if c["adapter"] == "B")
    assert second["params"].max_new_tokens == 7  # the challenger's cap
    assert out["comparisons"]["cascade_AB vs A"] == {"n": 2, "fixed": 2, "broken": 0, "p_value": 0.5}


def test_intervals_and_mcnemar():
    lo, hi = evaluate.wilson(3, 20)
    assert lo == pytest.approx(0.0524, abs=1e-3) and hi == pytest.approx(0.3604, abs=1e-3)
    assert evaluate.wilson(0, 10)[0] == 0.0 and evaluate.wilson(10, 10)[1] == 1.0
    mean, lo, hi = evaluate.mean_interval([0.2, 0.3, 0.4])
    assert mean == pytest.approx(0.3) and hi - mean == pytest.approx(4.303 * 0.1 / 3**0.5)
    many = [0.2, 0.4] * 20  # 40 seeds: t(0.975, 39) = 2.02269, not the normal 1.96
    assert evaluate.mean_interval(many)[2] - 0.3 == pytest.approx(2.02269 * statistics.stdev(many) / 40**0.5, rel=1e-5)
    assert evaluate.mcnemar_exact(7, 0) == pytest.approx(2 / 2**7)
    assert evaluate.mcnemar_exact(5, 5) == 1.0
    assert evaluate.paired([0, 1, 1, 0], [1, 1, 0, 0]) == {"n": 4, "fixed": 1, "broken": 1, "p_value": 1.0}


def test_the_samples_of_one_problem_are_not_independent_trials():
    # 3 problems x 2 identical samples: as many trials as problems, however often each was drawn
    twice = evaluate.summarize({"correct": [[1, 1], [0, 0], [1, 1]], "answers": [], "final_lens": [1] * 6,
                                "total_tokens": [1] * 6})
    once = evaluate.summarize({"correct": [[1], [0], [1]], "answers": [], "final_lens": [1] * 3,
                               "total_tokens": [1] * 3})
    assert twice["pass@1_ci"] == once["pass@1_ci"] == list(evaluate.wilson(2, 3))
    # problem 0 fixed on both samples, problem 1 broken on its second only: McNemar reads first samples
    assert evaluate.paired([0, 0, 1, 1], [1, 1, 1, 0], samples=2) == {"n": 2, "fixed": 1, "broken": 0,
                                                                      "p_value": 1.0}
    with pytest.raises(ValueError, match="2 per problem"):
        evaluate.paired([0, 1, 1], [1, 1, 0], samples=2)


def test_an_evaluation_of_another_checkpoint_is_replaced_not_merged(tmp_path, monkeypatch):
    run = tmp_path / "agon"
    run.mkdir()
    old = {"cascade_AB": {"pass@1": 0.9}, "A": {"pass@1": 0.1}, "comparisons": {"cascade_AB vs A": {"n": 9}},
           "meta": {"checkpoint": str(run / "checkpoints" / "step-000020")}}
    (run / "final_eval.json").write_text(json.dumps(old))
    config = SimpleNamespace(mode="agon", model="m", final_eval_problems=2, run_name="agon", profile="p", seed=0)
    policies = SimpleNamespace(load_adapter=lambda name, path: None)
    monkeypatch.setattr(evaluate, "load_run_config", lambda run_dir: config)
    monkeypatch.setattr(evaluate, "latest_adapters", lambda run_dir: run / "checkpoints" / "step-000030" / "adapters")
    monkeypatch.setattr(evaluate, "problems_for", lambda config, split: [{"question": "q", "answer": "1"}] * 3)
    found = {"A": {"pass@1": 0.5}, "comparisons": {}}
    monkeypatch.setattr(evaluate, "evaluate_policies", lambda *args, **kwargs: found)
    result = evaluate.evaluate(run, systems=["A"], policies=policies, progress=False)
    assert set(result) == {"A", "comparisons", "meta"} and result["comparisons"] == {}  # step 20's cascade gone
    assert result["meta"]["checkpoint"].endswith("step-000030")
    found["B"] = {"pass@1": 0.4}  # the same checkpoint again: what was there is kept beside the new system
    assert set(evaluate.evaluate(run, systems=["B"], policies=policies, progress=False)) >= {"A", "B"}


def test_summarize_and_disagreement():
    raw = {"correct": [[1, 0, 1], [0, 0, 0]], "answers": [], "final_lens": [10, 20, 30, 40, 50, 60],
           "total_tokens": [10, 20, 30, 40, 50, 60]}
    out = evaluate.summarize(raw, pass_k=(1, 2))
    assert out["pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert out["pass@2"] == pytest.approx((1.0 + 0.0) / 2)  # 2 right of 3: any pair has one
    assert out["mean_final_len"] == 35 and out["tokens_per_problem"] == 105
    assert evaluate.disagreement(["1", "2", None], ["1", "3", None]) == pytest.approx(1 / 3)


def _fixture_run(root, name, mode, systems, run_name=None, n_problems=20):
    run = root / name
    run.mkdir(parents=True)
    seed = int(name.rsplit("-seed", 1)[1]) if "-seed" in name else 0
    config = {"run_name": run_name or name, "seed": seed, "mode": mode}
    (run / "config.json").write_text(json.dumps({"config": config}))
    rows = [{"step": s, "time/step_s": 2.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if systems:
        final = {s: {"pass@1": p, "pass@4": p + 0.1, "mean_final_len": 50.0, "tokens_per_problem": 99.0,
                     "n_problems": n_problems} for s, p in systems.items()}
        final["A_B_disagreement"] = 0.25
        (run / "final_eval.json").write_text(json.dumps(final))


def test_results_collect_reads_only_run_directories(tmp_path):
    _fixture_run(tmp_path, "agon", "agon", {"A": 0.5, "cascade_AB": 0.6})
    _fixture_run(tmp_path, "grpo", "grpo", {"grpo": 0.3})
    _fixture_run(tmp_path, "unfinished", "agon", None)
    table = results.collect("fixture", runs_dir=tmp_path, write=False)
    assert list(table.columns) == results.COLUMNS
    got = {(r["run"], r["system"]): r for r in table.to_dict("records")}
    assert set(got) == {("agon", "A"), ("agon", "cascade_AB"), ("grpo", "grpo"), ("unfinished", "(not evaluated)")}
    assert got[("agon", "cascade_AB")]["pass@1"] == 0.6
    assert got[("agon", "A")]["pass@k"] == pytest.approx(0.6)
    assert got[("grpo", "grpo")]["steps"] == 3 and got[("grpo", "grpo")]["wall_time_s"] == 6.0
    assert "| agon | cascade_AB | 0.600 |" in results.to_markdown(table)


def test_public_api_functions_stay_callable():
    # DESIGN §7: agonlib.train and agonlib.evaluate are functions, also after the trainer is imported.
    from agonlib import evaluation, trainer  # the submodule imported: agonlib.train must stay the function
    from agonlib.study import results

    assert agonlib.train is trainer.train and agonlib.evaluate is evaluation.evaluate
    assert agonlib.results.collect is results.collect


def test_results_aggregate_seeds_with_intervals(tmp_path):
    _fixture_run(tmp_path, "agon", "agon", {"cascade_AB": 0.5})
    _fixture_run(tmp_path, "agon-seed1", "agon", {"cascade_AB": 0.7})
    _fixture_run(tmp_path, "grpo", "grpo", {"grpo": 0.3})
    table = results.collect("fixture", runs_dir=tmp_path, write=False)
    seeds = {(r["cell"], r["system"]): r for r in results.across_seeds(table).to_dict("records")}
    agon = seeds[("agon", "cascade_AB")]
    half = 12.706 * (0.2 / 2**0.5) / 2**0.5  # t(0.975, df=1) * sd / sqrt(n)
    assert agon["seeds"] == 2 and agon["pass@1 mean"] == pytest.approx(0.6)
    assert agon["pass@1_lo"] == pytest.approx(0.6 - half) and agon["pass@1_hi"] == pytest.approx(0.6 + half)
    assert seeds[("grpo", "grpo")]["seeds"] == 1
    assert "pass@1 across seeds" in results.report(table, tmp_path)


def test_a_seed_evaluated_twice_counts_once_across_seeds(tmp_path, caplog):
    _fixture_run(tmp_path, "agon", "agon", {"cascade_AB": 0.5})
    _fixture_run(tmp_path, "agon-rerun", "agon", {"cascade_AB": 0.9}, run_name="agon")  # seed 0 again
    _fixture_run(tmp_path, "agon-seed1", "agon", {"cascade_AB": 0.7})
    table = results.collect("fixture", runs_dir=tmp_path, write=False)
    with caplog.at_level("WARNING"):
        (agon,) = results.across_seeds(table).to_dict("records")
    assert agon["seeds"] == 2 and agon["per seed"] == "0.900 0.700"  # the later run of seed 0, then seed 1
    assert agon["pass@1 mean"] == pytest.approx(0.8)
    assert "seed(s) [0] evaluated more than once" in caplog.text


def test_seeds_evaluated_on_different_problem_counts_are_flagged(tmp_path, caplog):
    _fixture_run(tmp_path, "agon", "agon", {"cascade_AB": 0.5}, n_problems=200)
    _fixture_run(tmp_path, "agon-seed1", "agon", {"cascade_AB": 0.7}, n_problems=20)
    with caplog.at_level("WARNING"):
        (agon,) = results.across_seeds(results.collect("fixture", runs_dir=tmp_path, write=False)).to_dict("records")
    assert agon["seeds"] == 2 and "different numbers of problems ([20, 200])" in caplog.text
