"""The game round and the trainer on the tiny smoke model (CPU, seconds per step).

The tiny random model never answers a problem, so these tests replace the
grader with a deterministic hash of the completion text: the rewards then vary
within groups and every code path of the update runs.
"""

import hashlib
import json

import pytest
import torch

import agonlib
from agonlib import agon, prompts
from agonlib.runs import CheckpointError, complete_checkpoints
from agonlib.grpo import build_batch
from agonlib.trainer import Trainer, problems_at, train


def _hash_grade(rollouts, problems, config):
    return [hashlib.sha1(r.text.encode()).digest()[0] % 2 for r in rollouts]


@pytest.fixture
def hashed_grader(monkeypatch):
    monkeypatch.setattr(agon, "grade", _hash_grade)


@pytest.fixture(scope="module")
def _tiny():
    from agonlib.models import load_policies

    return load_policies(agonlib.load_config("smoke"))


@pytest.fixture
def tiny(_tiny):
    """The tiny smoke model, its adapters restored after each test that trains them."""
    state = {k: v.clone() for k, v in _tiny.model.state_dict().items()}
    yield _tiny
    _tiny.model.load_state_dict(state)


def _cfg(tmp_path, **kw):
    base = dict(steps=2, out_dir=str(tmp_path / "run"), max_new_tokens=6, num_generations=4,
                problems_per_step=2, checkpoint_every=1, log_rollouts_every=1)
    return agonlib.load_config("smoke", **{**base, **kw})


def _snapshot(policies):
    return {n: p.detach().clone() for n, p in policies.model.named_parameters()}


def _changed(before, policies):
    return {n for n, p in policies.model.named_parameters() if not torch.equal(before[n], p)}


ROLE_CASES = [
    # (step, roles, mode, expected (drafter, challenger))
    (1, "rotate", "agon", ("A", "B")),  # odd steps: A drafts
    (2, "rotate", "agon", ("B", "A")),  # even steps: B drafts
    (3, "rotate", "agon", ("A", "B")),
    (4, "rotate", "agon", ("B", "A")),
    (1, "fixed", "agon", ("A", "B")),  # fixed: A always drafts
    (2, "fixed", "agon", ("A", "B")),
    (2, "rotate", "grpo", ("A", None)),  # vanilla GRPO: one adapter, no challenger
]


@pytest.mark.parametrize("step,roles,mode,expected", ROLE_CASES)
def test_role_schedule(step, roles, mode, expected):
    assert agon.roles_for_step(step, roles, mode) == expected


def test_problems_at_is_a_seeded_epoch_shuffle():
    train_set = [{"id": i} for i in range(5)]
    first_epoch = [p["id"] for s in (1, 2, 3) for p in problems_at(train_set, s, 2, seed=3)][:5]
    assert sorted(first_epoch) == list(range(5))  # an epoch visits every problem once
    assert problems_at(train_set, 7, 2, seed=3) == problems_at(train_set, 7, 2, seed=3)
    assert [p["id"] for p in problems_at(train_set, 1, 5, seed=3)] != [p["id"] for p in problems_at(train_set, 1, 5, seed=4)]


def test_exchange_false_hides_the_summary(tiny, hashed_grader, tmp_path):
    cfg = _cfg(tmp_path, exchange=False)
    problems = agonlib.data.load_problems("synthetic", "train", n=2, levels=(1,))
    rnd = agon.play_round(tiny, problems, 1, cfg, progress=False)
    for draft, challenge in zip(rnd.drafts, rnd.challenges):
        assert challenge.prompt_ids == draft.prompt_ids  # the challenger's prompt is the drafter's


def test_exchange_true_shows_exactly_the_summary(tiny, hashed_grader, tmp_path):
    cfg = _cfg(tmp_path, exchange=True)
    problems = agonlib.data.load_problems("synthetic", "train", n=2, levels=(1,))
    rnd = agon.play_round(tiny, problems, 1, cfg, progress=False)
    G = rnd.group_size
    for i, (draft, challenge) in enumerate(zip(rnd.drafts, rnd.challenges)):
        expected = prompts.render(tiny.tokenizer,
                                  prompts.challenge_prompt(problems[i // G]["question"], draft.summary,
                                                           cfg.reward, cfg.task), cfg.thinking)
        assert challenge.prompt == expected
        assert draft.summary.strip() in challenge.prompt or not draft.summary.strip()


def test_competitive_rewards_follow_the_grades(tiny, hashed_grader, tmp_path):
    cfg = _cfg(tmp_path, lambda_conv=1.0)
    problems = agonlib.data.load_problems("synthetic", "train", n=2, levels=(1,))
    rnd = agon.play_round(tiny, problems, 1, cfg, progress=False)
    for c_a, c_b, r in zip(rnd.c_draft, rnd.c_challenge, rnd.r_challenge):
        assert r.total == c_b + c_b * (1 - c_a)


def test_build_batch_layout():
    from agonlib.generation import Rollout

    rs = [Rollout("", [5, 6, 7], [8, 9], "", "", "", None, 2, False, 0),
          Rollout("", [5], [8, 9, 10], "", "", "", None, 3, True, 0)]
    b = build_batch(rs, torch.tensor([1.0, -1.0]), pad_id=0, device="cpu")
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 8, 9, 10]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_agon_step_trains_both_adapters_and_never_the_base(tiny, hashed_grader, tmp_path):
    trainer = Trainer(_cfg(tmp_path, steps=1), policies=tiny, progress=False)
    before = _snapshot(tiny)
    row, _ = trainer.train_step(1)
    changed = _changed(before, tiny)
    assert any(".A." in n for n in changed) and any(".B." in n for n in changed)
    assert all("lora_" in n for n in changed)  # the base is bit-identical
    assert row["drafter"] == "A" and row["challenger"] == "B"


def test_dr_grpo_divides_each_role_by_its_own_token_cap(tiny, hashed_grader, tmp_path, monkeypatch):
    # dr_grpo's constant is the generation cap (TRL's max_completion_length): the challenger's is its own.
    caps = []
    real_update = agon.grpo_update
    monkeypatch.setattr(agon, "grpo_update", lambda model, batch, params, opt, cfg, **kw: caps.append(
        cfg.max_completion_length) or real_update(model, batch, params, opt, cfg, **kw))
    config = _cfg(tmp_path, steps=1, loss_type="dr_grpo", max_new_tokens=6, challenger_max_new_tokens=9)
    Trainer(config, policies=tiny, progress=False).train_step(1)
    assert caps == [6, 9]  # drafter, then challenger


def test_grpo_mode_trains_only_adapter_a(tiny, hashed_grader, tmp_path):
    trainer = Trainer(_cfg(tmp_path, steps=1, mode="grpo"), policies=tiny, progress=False)
    before = _snapshot(tiny)
    row, rnd = trainer.train_step(1)
    changed = _changed(before, tiny)
    assert changed and all(".A." in n for n in changed)
    assert rnd.challenges == [] and row["challenger"] is None


def _metric_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.startswith("time/") or k.endswith("_s"))} for r in rows]  # timings vary


def test_resume_replays_the_uninterrupted_run(tiny, hashed_grader, tmp_path):
    # One run of 4 steps, and one killed after step 2 then resumed: identical metrics.
    from agonlib.models import load_policies

    straight = train(_cfg(tmp_path / "a", steps=4, checkpoint_every=2), policies=tiny, progress=False)
    fresh = load_policies(_cfg(tmp_path / "b"))
    resumed_dir = train(_cfg(tmp_path / "b", steps=2, checkpoint_every=2), policies=fresh, progress=False)
    again = load_policies(_cfg(tmp_path / "b"))  # a new process would start from a fresh model
    train(_cfg(tmp_path / "b", steps=4, checkpoint_every=2, resume=True), policies=again, progress=False)
    assert _metric_rows(resumed_dir) == _metric_rows(straight)


def test_partial_and_corrupt_checkpoints(tiny, hashed_grader, tmp_path):
    cfg = _cfg(tmp_path, steps=2, checkpoint_every=1)
    run_dir = train(cfg, policies=tiny, progress=False)
    ckpts = run_dir / "checkpoints"
    # A partial checkpoint (killed mid-write: no COMPLETE marker) is ignored.
    (ckpts / "step-000003.tmp").mkdir()
    trainer = Trainer(cfg.replace(resume=True, steps=2), policies=tiny, progress=False)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000001", "step-000002"]
    # A corrupt complete checkpoint: a clear error that names it and the older one.
    (ckpts / "step-000002" / "trainer_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="step-000002.*step-000001"):
        trainer.resume()
    # The previous checkpoint still loads.
    trainer.load_checkpoint(ckpts / "step-000001")
    assert trainer.step == 1


def test_refuses_to_overwrite_a_run(tiny, hashed_grader, tmp_path):
    cfg = _cfg(tmp_path, steps=1)
    train(cfg, policies=tiny, progress=False)
    with pytest.raises(FileExistsError, match="resume"):
        train(cfg, policies=tiny, progress=False)


def test_code_task_round_runs_on_handwritten_problems(tiny, tmp_path):
    # task: code — the same loop, graded by the sandboxed code grader (real, not hashed:
    # the tiny model writes no program, so every reward is 0 and nothing crashes).
    cfg = _cfg(tmp_path, task="code", dataset="code_handwritten", num_generations=2, steps=1)
    trainer = Trainer(cfg, policies=tiny, progress=False)
    row, rnd = trainer.train_step(1)
    assert rnd.c_draft == [0] * len(rnd.drafts) and rnd.c_challenge == [0] * len(rnd.challenges)
    assert "```python" in prompts.CODE_SYSTEM and rnd.problems[0]["tests"]
    assert row["drafter/skipped_zero_adv"] == 1 and row["challenger/skipped_zero_adv"] == 1


def test_code_summary_drops_the_final_program():
    text = "Read n, print its double.\n```python\nn = int(input())\nprint(2 * n)\n```"
    think, summary, answer = agonlib.split_completion(text, thinking=False, task="code")
    assert summary == "Read n, print its double." and "print(2 * n)" in answer


def _drafts_only_grader():
    """Drafts get varied 0/1 grades, challenges all 0: only the drafter's adapter has a gradient."""
    calls = []

    def grade(rollouts, problems, config):
        calls.append(len(rollouts))
        if len(calls) % 2:  # play_round grades the drafts first, then the challenges
            return [hashlib.sha1(r.text.encode()).digest()[0] % 2 for r in rollouts]
        return [0] * len(rollouts)
    return grade


@pytest.mark.parametrize("roles,drafters,b_changes_at_step_2", [
    # rotate: B drafts at step 2 and learns from its drafts (it had no optimizer moments before)
    ("rotate", ["A", "B"], True),
    # fixed: A drafts again; B, a challenger with all-zero advantages, stays exactly as it was
    ("fixed", ["A", "A"], False),
])
def test_trainer_rotates_roles(tiny, monkeypatch, tmp_path, roles, drafters, b_changes_at_step_2):
    monkeypatch.setattr(agon, "grade", _drafts_only_grader())
    trainer = Trainer(_cfg(tmp_path, steps=2, roles=roles), policies=tiny, progress=False)
    before = _snapshot(tiny)
    row1, _ = trainer.train_step(1)
    changed1 = _changed(before, tiny)
    assert any(".A." in n for n in changed1) and not any(".B." in n for n in changed1)  # A drafted and learned
    assert row1["challenger/skipped_zero_adv"] == 1
    middle = _snapshot(tiny)
    row2, rnd2 = trainer.train_step(2)
    assert [row1["drafter"], row2["drafter"]] == drafters and rnd2.drafter == drafters[1]
    changed2 = _changed(middle, tiny)
    assert any(".B." in n for n in changed2) == b_changes_at_step_2


class BoxedBackend:
    """Scripted generation: drafts state and box an answer, challenges box another; prompts recorded."""

    def __init__(self, draft_text, challenge_text):
        self.texts, self.calls = [draft_text, challenge_text], []

    def begin_step(self, step):
        pass

    def generate(self, prompt_texts, adapter, seeds, params=None, thinking=False, task="math", **kw):
        from agonlib.parsing import split_completion
        from agonlib.generation import Rollout

        text = self.texts[len(self.calls) % 2]
        self.calls.append({"adapter": adapter, "prompts": list(prompt_texts), "cap": params.max_new_tokens})
        parts = split_completion(text, thinking=thinking, task=task)
        n = len(text.split())  # a stand-in token count
        return [Rollout(p, [1], list(range(n)), text, parts.think, parts.summary, parts.answer, n, False, s)
                for p, s in zip(prompt_texts, seeds)]


def test_game_masks_boxed_drafts_and_pays_the_length_tiebreak(tiny, monkeypatch, tmp_path):
    cfg = _cfg(tmp_path, lambda_len=0.1, challenger_max_new_tokens=9)
    problems = [{"id": 0, "question": "Ann has 4 apples and gets 5 more. How many?", "answer": "9"}]
    draft = "Ann has 4 apples and gets 5, so 4 + 5 = 9 apples. She has 9 apples.\n\\boxed{9}"
    backend = BoxedBackend(draft, "9 apples \\boxed{9}")
    monkeypatch.setattr(agon, "grade", lambda rollouts, probs, config: [int(r.answer == "9") for r in rollouts])
    rnd = agon.play_round(tiny, problems, 1, cfg, progress=False, backend=backend)
    challenge_prompts = backend.calls[1]["prompts"]
    assert backend.calls[1]["cap"] == 9 and backend.calls[0]["cap"] == cfg.max_new_tokens  # per-role caps
    for text in challenge_prompts:
        turn = text.rsplit("A rival tried this problem.", 1)[1]  # this problem's turn, after the worked ones
        assert "4 + 5 = […] apples. She has […] apples." in turn  # the summary, answer masked
        assert "= 9" not in turn and "\\boxed{9}" not in turn and " 9 " not in turn
    assert rnd.leaked == [False] * len(rnd.drafts)
    # both right, the challenge (3 "tokens") shorter than the draft: correct + tiebreak
    assert [r.total for r in rnd.r_challenge] == [pytest.approx(1.1)] * len(rnd.drafts)
    assert rnd.metrics()["challenger/tiebreak_rate"] == 1.0


# A wrong draft that reached the gold on the way: what each summary mask lets the challenger read, and
# whether that still states the gold (``rnd.leaked``, the text check), one mask per entry.
MASKED_GAMES = [
    ("Nora has 10 pens and uses 4. How many are left?", "6",
     "She has 10 - 4 = 6 pens left. So she has 10 + 6 = 16 pens.\n\\boxed{16}",
     {"answer": ("She has 10 - 4 = 6 pens left. So she has 10 + 6 = […] pens.", True),
      "derived": ("She has 10 - 4 = […] pens left. So she has 10 + […] = […] pens.", False)}),
    # the gold is a number of the question: only ``stated`` hides the result that equals it
    ("Mia has 2 eggs and uses 1. How many are left?", "1",
     "She has 2 - 1 = 1 egg left. Then 1 + 2 = 3 eggs.\n\\boxed{3}",
     {"derived": ("She has 2 - 1 = 1 egg left. Then 1 + 2 = […] eggs.", True),
      "stated": ("She has 2 - 1 = […] egg left. Then […] + […] = […] eggs.", False)}),
]


@pytest.mark.parametrize("question,gold,draft,expected", MASKED_GAMES)
def test_game_with_a_number_mask_hides_the_gold_a_wrong_draft_reached(tiny, monkeypatch, tmp_path,
                                                                       question, gold, draft, expected):
    problems = [{"id": 0, "question": question, "answer": gold}]
    monkeypatch.setattr(agon, "grade", lambda rollouts, probs, config: [int(r.answer == gold) for r in rollouts])
    for mask, (summary, leaked) in expected.items():
        backend = BoxedBackend(draft, f"\\boxed{{{gold}}}")
        rnd = agon.play_round(tiny, problems, 1, _cfg(tmp_path, summary_mask=mask), progress=False, backend=backend)
        turns = [t.rsplit("A rival tried this problem.", 1)[1] for t in backend.calls[1]["prompts"]]
        assert all(rnd.summaries[i] in turn for i, turn in enumerate(turns))  # the challenger read the summary
        assert (rnd.summaries[0], rnd.leaked) == (summary, [leaked] * 4), mask


def test_game_fits_a_long_summary_into_the_challenge_budget(tiny, monkeypatch, tmp_path):
    problems = [{"id": 0, "question": "Ann has 4 apples and gets 5 more. How many?", "answer": "9"}]
    steps = " ".join(f"Then {k} + {k} = {2 * k}." for k in range(1, 60))
    draft = f"Ann has 4 apples. {steps} So 4 + 5 = 9.\n\\boxed{{9}}"
    monkeypatch.setattr(agon, "grade", lambda rollouts, probs, config: [int(r.answer == "9") for r in rollouts])
    cfg = _cfg(tmp_path)
    empty = len(tiny.tokenizer(prompts.render(tiny.tokenizer, prompts.challenge_prompt(problems[0]["question"], "",
                                                                                       cfg.reward, cfg.task)),
                               add_special_tokens=False)["input_ids"])
    cfg = cfg.replace(max_prompt_tokens=empty + 40)
    backend = BoxedBackend(draft, "\\boxed{9}")
    rnd = agon.play_round(tiny, problems, 1, cfg, progress=False, backend=backend)
    for text, summary in zip(backend.calls[1]["prompts"], rnd.summaries):
        assert len(tiny.tokenizer(text, add_special_tokens=False)["input_ids"]) <= cfg.max_prompt_tokens
        assert prompts.MATH_SYSTEM in text and summary in text  # the opening kept; the summary as logged
        assert summary.startswith(prompts.OMITTED) and summary.endswith("So 4 + 5 = […].")


@pytest.mark.parametrize("eval_every,systems,expected", [
    # one cheap system on a small slice, plus the weight divergence (no generation needed)
    (2, ["A"], {"A/pass@1", "A_B_weight_divergence"}),
    # off: no eval.jsonl at all
    (0, ["A"], None),
])
def test_periodic_evaluation_is_configurable(tiny, hashed_grader, tmp_path, eval_every, systems, expected):
    cfg = _cfg(tmp_path, steps=2, eval_every=eval_every, eval_systems=systems, eval_problems=1)
    run_dir = train(cfg, policies=tiny, progress=False)
    path = run_dir / "eval.jsonl"
    if expected is None:
        assert not path.exists()
        return
    [row] = [json.loads(line) for line in path.read_text().splitlines()]
    assert expected <= set(row) and not any(k.startswith(("B/", "cascade")) for k in row)
