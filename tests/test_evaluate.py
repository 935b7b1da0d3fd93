"""Evaluation: the pass@k estimator, what each system's stages see, the results table."""

import json
from types import SimpleNamespace

import pytest

import agonlib
from agonlib import evaluation as evaluate, prompts, results
from agonlib.parsing import split_completion
from agonlib.rollouts import Rollout

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


@pytest.fixture
def fake_policies():
    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **kw: json.dumps(messages))
    return SimpleNamespace(tokenizer=tokenizer)


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


def test_summarize_and_disagreement():
    raw = {"correct": [[1, 0, 1], [0, 0, 0]], "answers": [], "final_lens": [10, 20, 30, 40, 50, 60],
           "total_tokens": [10, 20, 30, 40, 50, 60]}
    out = evaluate.summarize(raw, pass_k=(1, 2))
    assert out["pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert out["pass@2"] == pytest.approx((1.0 + 0.0) / 2)  # 2 right of 3: any pair has one
    assert out["mean_final_len"] == 35 and out["tokens_per_problem"] == 105
    assert evaluate.disagreement(["1", "2", None], ["1", "3", None]) == pytest.approx(1 / 3)


def _fixture_run(root, name, mode, systems):
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": {"run_name": name, "seed": 3, "mode": mode}}))
    rows = [{"step": s, "time/step_s": 2.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if systems:
        final = {s: {"pass@1": p, "pass@4": p + 0.1, "mean_final_len": 50.0, "tokens_per_problem": 99.0,
                     "n_problems": 20} for s, p in systems.items()}
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
    import agonlib.trainer  # noqa: F401

    assert callable(agonlib.train) and callable(agonlib.evaluate)
    assert callable(agonlib.results.collect)
