"""The plateau study's parts (DESIGN.md §9): fork start, the cascade's controls, the monitoring, dtype-safe
resume, and number words in the mask and the leak check."""

import hashlib
import json
from types import SimpleNamespace

import pytest
import torch

import agonlib
from agonlib import agon, evaluation, metrics, prompts
from agonlib.generation import Rollout, SamplingParams
from agonlib.generation.sampling import token_entropy
from agonlib.models import load_policies
from agonlib.parsing import MASK, mask_answer, mask_derived_numbers, number_word_value, split_completion
from agonlib.runs import CheckpointError, fork_start, read_jsonl
from agonlib.study import pipeline
from agonlib.trainer import Trainer, train
from test_evaluate import WordTokenizer  # the word-per-token stand-in of the cascade tests


def _hash_grade(rollouts, problems, config):
    return [hashlib.sha1(r.text.encode()).digest()[0] % 2 for r in rollouts]


@pytest.fixture
def hashed_grader(monkeypatch):
    monkeypatch.setattr(agon, "grade", _hash_grade)


def _cfg(tmp_path, name="run", **kw):
    base = dict(steps=2, out_dir=str(tmp_path / name), max_new_tokens=6, num_generations=4, problems_per_step=2,
                checkpoint_every=1, log_rollouts_every=1, eval_every=0, device="cpu", dtype="float32")
    return agonlib.load_config("smoke", **{**base, **kw})


def _adapter(policies, name):
    return {n: p.detach().clone() for n, p in policies.model.named_parameters() if f".{name}." in n and "lora_" in n}


def _as(weights, name, other):
    return {n.replace(f".{name}.", f".{other}."): w for n, w in weights.items()}


# --- fork start ---------------------------------------------------------------------------------

def test_a_fork_starts_both_adapters_from_the_trunks_a_and_b_apart_by_its_init_noise(hashed_grader, tmp_path):
    trunk_dir = train(_cfg(tmp_path, "trunk", mode="grpo", steps=2), policies=load_policies(_cfg(tmp_path, "t")),
                      progress=False)
    trunk = load_policies(_cfg(tmp_path, "t"))
    trunk.load_adapter("A", trunk_dir / "checkpoints" / "step-000002" / "adapters")
    trunk_a = _adapter(trunk, "A")
    fresh = load_policies(_cfg(tmp_path, "f"))
    noise = {n: p.detach().clone() for n, p in fresh.model.named_parameters() if ".B." in n and "lora_" in n}
    assert not all(torch.equal(trunk_a[n], w) for n, w in _adapter(fresh, "A").items())  # the trunk trained

    policies = load_policies(_cfg(tmp_path, "f"))
    trainer = Trainer(_cfg(tmp_path, "fork", init_from=str(trunk_dir), steps=1), policies=policies, progress=False)
    fork = fork_start(policies, trainer.config.init_from, trainer.adapters, trainer.config)
    a, b = _adapter(policies, "A"), _adapter(policies, "B")
    assert all(torch.equal(a[n], w) for n, w in trunk_a.items())  # A is the trunk's adapter, bit for bit
    for n, w in _as(trunk_a, "A", "B").items():  # B is the trunk's adapter plus B's own init noise
        assert torch.equal(b[n], w + noise[n]) and not torch.equal(b[n], w)
    assert fork["step"] == 2 and fork["source"].endswith("step-000002")
    assert all(not opt.state for opt in trainer.optimizers.values())  # fresh optimizers


def test_a_fork_run_records_its_source_and_a_grpo_branch_continues_the_trunk(hashed_grader, tmp_path):
    trunk_dir = train(_cfg(tmp_path, "trunk", mode="grpo", steps=1), policies=load_policies(_cfg(tmp_path, "t")),
                      progress=False)
    branch = train(_cfg(tmp_path, "grpo", mode="grpo", init_from=str(trunk_dir), steps=1),
                   policies=load_policies(_cfg(tmp_path, "g")), progress=False)
    info = json.loads((branch / "config.json").read_text())
    assert info["config"]["init_from"] == str(trunk_dir) and info["fork"]["step"] == 1
    assert info["fork"]["adapter_A_sha256"] and info["model"]["dtype"] == "torch.float32"
    # A resumed fork keeps the source it recorded and its own weights (the trunk is not loaded again).
    more = train(_cfg(tmp_path, "grpo", mode="grpo", init_from=str(trunk_dir), steps=2, resume=True),
                 policies=load_policies(_cfg(tmp_path, "g")), progress=False)
    assert json.loads((more / "config.json").read_text())["fork"] == info["fork"]
    assert [row["from_step"] for row in read_jsonl(more / "segments.jsonl")] == [0, 1]


def test_a_fork_from_nothing_says_what_to_do(tmp_path):
    trainer = Trainer(_cfg(tmp_path, "fork", init_from=str(tmp_path / "missing")),
                      policies=load_policies(_cfg(tmp_path, "f")), progress=False)
    with pytest.raises(CheckpointError, match="train the trunk first"):
        fork_start(trainer.policies, trainer.config.init_from, trainer.adapters, trainer.config)


# --- dtype-safe resume ------------------------------------------------------------------------------

def test_a_checkpoint_is_never_resumed_under_another_dtype(hashed_grader, tmp_path):
    run_dir = train(_cfg(tmp_path, steps=1), policies=load_policies(_cfg(tmp_path)), progress=False)
    state_file = run_dir / "checkpoints" / "step-000001" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["dtype"] == "torch.float32" and state["device"] == "cpu"
    state["dtype"] = "torch.bfloat16"  # as if trained on a CPU where auto resolves to bf16
    torch.save(state, state_file)
    trainer = Trainer(_cfg(tmp_path, steps=2, resume=True), policies=load_policies(_cfg(tmp_path)), progress=False)
    with pytest.raises(CheckpointError, match=r"trained in bfloat16.*resolves to float32.*--set dtype=bfloat16"):
        trainer.resume()


def test_the_pipeline_sees_a_resolved_dtype_change(hashed_grader, tmp_path):
    config = _cfg(tmp_path, steps=1)
    run_dir = train(config, policies=load_policies(config), progress=False)
    assert pipeline.settings_changed(config) == {}
    info = json.loads((run_dir / "config.json").read_text())
    info["model"]["dtype"] = "torch.bfloat16"
    (run_dir / "config.json").write_text(json.dumps(info))
    assert pipeline.settings_changed(config) == {"dtype (resolved)": ("bfloat16", "float32")}


def test_every_segment_records_its_machine(hashed_grader, tmp_path):
    run_dir = train(_cfg(tmp_path, steps=1), policies=load_policies(_cfg(tmp_path)), progress=False)
    (segment,) = read_jsonl(run_dir / "segments.jsonl")
    assert segment["from_step"] == 0 and segment["dtype"] == "float32"
    assert segment["machine"]["cpu_capability"] and "started" in segment


# --- monitoring -------------------------------------------------------------------------------------

def test_token_entropy_is_the_sampled_distributions():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, -1e9, -1e9, -1e9]])
    got = token_entropy(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(got, torch.tensor([torch.log(torch.tensor(4.0)).item(), 0.0], dtype=torch.float64))
    # top-k 2 keeps the two equal best of four tokens: log 2
    two_best = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    assert token_entropy(two_best, SamplingParams(top_k=2)).item() == pytest.approx(0.6931, abs=1e-4)
    assert token_entropy(logits, SamplingParams(temperature=0.0)).tolist() == [0.0, 0.0]  # greedy


def test_measuring_entropy_leaves_the_draws_alone(smoke_policies):
    from agonlib.generation import generate

    prompts_ = ["a b c", "d e"] * 2
    seeds = [1, 2, 3, 4]
    plain = generate(smoke_policies, prompts_, "B", seeds, SamplingParams(max_new_tokens=5), progress=False)
    measured = generate(smoke_policies, prompts_, "B", seeds, SamplingParams(max_new_tokens=5), progress=False,
                        entropy=True)
    assert [r.completion_ids for r in plain] == [r.completion_ids for r in measured]
    assert all(r.extra["entropy_sum"] > 0 for r in measured) and all("entropy_sum" not in r.extra for r in plain)
    # a random model over 151k tokens: close to uniform, so close to log(V) nats a token
    per_token = metrics.mean_token_entropy(measured)
    assert 0.9 * torch.log(torch.tensor(151_000.0)).item() < per_token < 12.0


@pytest.mark.parametrize("answers,group,expected", [
    (["7", "7", "7", "7"], 4, 1.0),  # collapsed onto one answer
    (["7", "8", "9", "10"], 4, 4.0),  # every sample its own answer
    ([None, None, "3", "3"], 2, 0.5),  # an unboxed group has no answer
    (["1", "2", "1", "1"], 2, 1.5),  # two groups: 2 and 1
])
def test_distinct_answers_per_group(answers, group, expected):
    assert metrics.distinct_answers(answers, group) == expected


def _rollout(text, length=3, **extra):
    parts = split_completion(text, thinking=False)
    return Rollout("p", [1], [2] * length, text, "", parts.summary, parts.answer, length, False, 0, extra)


def test_the_round_logs_entropy_and_the_conditional_rates():
    # drafts right, right, wrong, wrong; challenges wrong, right, right, wrong
    drafts = [_rollout("\\boxed{1}", entropy_sum=3.0), _rollout("\\boxed{1}", entropy_sum=3.0),
              _rollout("\\boxed{2}", entropy_sum=6.0), _rollout("\\boxed{3}", entropy_sum=0.0)]
    challenges = [_rollout("\\boxed{4}", 2, entropy_sum=1.0)] * 4
    rnd = agon.Round(1, "A", "B", [{"question": "q", "answer": "1"}], drafts, [1, 1, 0, 0],
                     agon.drafter_group_rewards([1, 1, 0, 0]), challenges, [0, 1, 1, 0],
                     agon.challenger_group_rewards("competitive", [0, 1, 1, 0], [1, 1, 0, 0]),
                     summaries=[""] * 4, leaked=[False] * 4, summary_tokens=[0] * 4)
    row = rnd.metrics()
    assert row["drafter/entropy"] == pytest.approx(12.0 / 12)  # nats per token: 12 over 12 tokens
    assert row["challenger/entropy"] == pytest.approx(4.0 / 8)
    assert row["drafter/distinct_answers"] == 3.0
    assert row["challenger/conversion_rate_given_wrong"] == 0.5  # of two wrong drafts, one fixed
    assert row["challenger/regression_rate_given_right"] == 0.5  # of two right drafts, one broken
    assert row["challenger/conversion_rate"] == 0.25  # over all four pairs


# --- the cascade's controls ------------------------------------------------------------------------

class Scripted:
    """Stands in for ``generate``: records each call's adapter and prompts, answers with a fixed text."""

    def __init__(self, text):
        self.text, self.calls = text, []

    def __call__(self, policies, prompt_texts, adapter, seeds, **kw):
        self.calls.append({"adapter": adapter, "prompts": list(prompt_texts), "seeds": list(seeds)})
        return [_rollout(self.text) for _ in prompt_texts]


PROBLEMS = [{"question": "Ann has 3 pens and buys 4. How many?", "answer": "7"}]
DRAFT = "She adds 3 and 4 to get 7 pens in all.\n\\boxed{7}"


@pytest.mark.parametrize("system,adapters", [
    ("cascade_GG", ["A", "A"]),  # a GRPO run's adapter drafts and challenges its own summary
    ("cascade_base", [None, None]),  # the untrained base in both stages
    ("placebo_AB", ["A", "B"]),  # A then B, B reading the placebo
    ("cascade_AB", ["A", "B"]),
])
def test_each_control_is_two_stages_of_its_adapters(monkeypatch, system, adapters):
    fake = Scripted(DRAFT)
    monkeypatch.setattr(evaluation, "generate", fake)
    monkeypatch.setattr(evaluation, "grade", lambda rollouts, problems, cfg: [1] * len(rollouts))
    config = agonlib.load_config("cpu")
    evaluation.run_system(SimpleNamespace(tokenizer=WordTokenizer()), PROBLEMS, system, config)
    assert [c["adapter"] for c in fake.calls] == adapters
    shown = prompts.challenge_summary(split_completion(DRAFT, thinking=False).summary, PROBLEMS[0]["question"],
                                      config)
    assert shown == "She adds 3 and 4 to get […] pens in all."
    if system.startswith("placebo"):
        shown = prompts.placebo_summary(shown)
        assert len(shown.split()) == 11 and "3" not in shown  # as long, and nothing of the draft
    expected = prompts.challenge_prompt(PROBLEMS[0]["question"], shown, config.reward, config.task)
    assert fake.calls[1]["prompts"] == [json.dumps(expected)]


def test_the_controls_pair_with_every_other_system(monkeypatch):
    """One seed per (problem, stage), whatever the system: the controls' stages draw what A→B's draw."""
    fake = Scripted(DRAFT)
    monkeypatch.setattr(evaluation, "generate", fake)
    monkeypatch.setattr(evaluation, "grade", lambda rollouts, problems, cfg: [1] * len(rollouts))
    config = agonlib.load_config("cpu")
    seeds = {}
    for system in ("cascade_AB", "cascade_GG", "cascade_base", "placebo_AB"):
        fake.calls.clear()
        evaluation.run_system(SimpleNamespace(tokenizer=WordTokenizer()), PROBLEMS, system, config)
        seeds[system] = [c["seeds"] for c in fake.calls]
    assert len({json.dumps(s) for s in seeds.values()}) == 1


def test_the_controls_are_systems_a_config_and_the_comparisons_know():
    config = agonlib.load_config("cpu", eval_systems=["A", "cascade_GG", "cascade_base", "placebo_AB"])
    assert set(config.eval_systems) <= set(evaluation.SYSTEMS)
    pairs = {f"{a} vs {b}" for a, b in evaluation.COMPARISONS}
    assert {"cascade_GG vs grpo", "cascade_base vs base", "cascade_AB vs placebo_AB"} <= pairs


# --- number words -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,answer,masked", [
    ("There are seven marbles", "7", f"There are {MASK} marbles"),  # the logged leak
    ("Seven marbles are left", "7", f"{MASK} marbles are left"),  # capitalised
    ("twenty-one in all, twenty one again", "21", f"{MASK} in all, {MASK} again"),  # hyphen or space
    ("twenty-one is not one", "1", f"twenty-one is not {MASK}"),  # a part of a larger number stays
    ("seventeen, not seven", "7", f"seventeen, not {MASK}"),  # the longer word is its own number
    ("someone is done", "1", "someone is done"),  # inside a word: no number
    ("one hundred and five", "105", MASK),
    ("seven and a half", "7.5", "seven and a half"),  # only whole-number answers are matched in words
])
def test_number_words_are_masked_as_the_answer(text, answer, masked):
    assert mask_answer(text, answer) == masked


@pytest.mark.parametrize("summary,question,capped,masked", [
    # a word the question does not state is masked like its digits
    ("Ten minus three leaves seven.", "Ana has 10 pens and loses 3.", False, f"Ten minus three leaves {MASK}."),
    # stated counts digits and words together: the question says 4 once
    ("4 and four", "Bo has 4 cups and 2 more.", True, f"4 and {MASK}"),
    # a question in words: its numbers are stated all the same
    ("She had 5, then 7.", "Cy has five pens and buys two.", False, f"She had 5, then {MASK}."),
])
def test_number_words_in_the_derived_masks(summary, question, capped, masked):
    assert mask_derived_numbers(summary, question, capped=capped) == masked


@pytest.mark.parametrize("summary,gold,question,leaked", [
    ("There are seven marbles", "7", "Tom has 3 marbles and gets 4.", True),
    ("There are Seven marbles", "7", "Tom has 3 marbles and gets 4.", True),
    ("twenty-one in all", "21", "Sue has 20 and finds 1.", True),
    ("seven, as stated", "7", "Sue has seven and loses 0.", False),  # the question states it as often
])
def test_the_leak_check_counts_number_words(summary, gold, question, leaked):
    assert metrics.leaks(summary, gold, question) is leaked


def test_number_word_values():
    assert [number_word_value(w) for w in ("zero", "Nineteen", "forty-two", "ninety nine", "two hundred")] == [
        0, 19, 42, 99, 200]
    assert number_word_value("seventy-eleven") is None and number_word_value("none") is None
