"""The lean training forward (issue 14, peak memory) is exact: the same log-probs and adapter gradients,
bit for bit, as ``transformers``' own MLP, with fewer activations kept for the backward pass.

The batch is the shared-prefix test's (prompts sharing an opening, left padding, micro-batches). fp32, on
the tiny Qwen3 and on SmolLM2-135M (slow). In bf16 the adapters run under autocast: not bit for bit, so
that test bounds the gradient's difference from PEFT's fp32-adapter path and checks the memory it saves.
"""

from __future__ import annotations

import contextlib
import platform

import pytest
import torch
import transformers
from test_shared_prefix import _grads, _rollouts

from agonlib import lean
from agonlib.grpo import UpdateConfig, batch_logprobs, build_batch
from agonlib.lean import _SwiGLU


@contextlib.contextmanager
def _transformers_forward(model, mlps_only: bool = False):
    """``model`` with ``transformers``' MLP, attention and norm forwards (or MLPs only), as before :func:`lean.install`."""
    inner = model.get_base_model()
    mlps = [m for m in model.modules() if "forward" in vars(m) and hasattr(m, "gate_proj")]
    norms = [m for m in lean._norms(inner) if "forward" in vars(m)]
    assert mlps and inner.config._attn_implementation == lean.LEAN_SDPA
    for m in mlps if mlps_only else mlps + norms:
        del m.forward  # the class's forward again
    if not mlps_only:
        inner.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        assert lean.install(model)


def _saved_bytes(fn, vocab: int) -> int:
    """Bytes of the distinct activations the decoder layers keep during ``fn()`` (no parameters, no logits)."""
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.shape[-1:] != (vocab,):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def _batch(policies):
    """Adapter A moved off zero, and the shared-prefix test's batch with its update settings."""
    with torch.no_grad():  # non-zero B: the adapter changes what every layer computes
        for p in policies.params("A"):
            p.add_(0.02 * torch.randn_like(p))
    rollouts = _rollouts(policies.tokenizer.vocab_size)
    batch = build_batch(rollouts, torch.linspace(-1.5, 1.2, len(rollouts)), policies.tokenizer.pad_token_id, "cpu",
                        share_prefix=True)
    return batch, UpdateConfig(temperature=0.8, max_grad_norm=None, micro_batch_size=3)


def _check(policies):
    model = policies.model
    assert lean.installed(model)
    batch, cfg = _batch(policies)

    def run():
        with torch.no_grad(), policies.use("A"):
            logp = batch_logprobs(model, batch, 0.8, rows=3)
        with policies.use("A"):
            saved = _saved_bytes(lambda: batch_logprobs(model, batch, 0.8, rows=3), model.config.vocab_size)
        return logp, _grads(policies, batch, cfg), saved

    lean_logp, lean_grads, lean_saved = run()
    with _transformers_forward(model):
        assert not lean.installed(model)
        logp, grads, saved = run()
    with _transformers_forward(model, mlps_only=True):
        _, _, mlp_saved = run()
    assert torch.equal(lean_logp, logp)
    assert any(g.abs().sum() > 0 for g in grads)
    for a, b in zip(lean_grads, grads):  # bit for bit: a run trained with it is the run trained without it
        assert torch.equal(a, b), (a - b).norm() / b.norm()
    # The point of it: one (tokens, intermediate) tensor fewer per layer kept for the backward pass, silu(gate),
    cfg = model.get_base_model().config
    per_token = cfg.num_hidden_layers * cfg.intermediate_size * 4  # bytes, fp32
    assert mlp_saved > lean_saved, (mlp_saved, lean_saved)
    if policies.dtype == torch.float32:  # (in bf16 autocast keeps other copies beside it)
        assert (mlp_saved - lean_saved) % per_token == 0, (mlp_saved, lean_saved, per_token)
    # and attention keeping its inputs instead of the repeated keys and values, the bf16 norms their bf16 input
    # (the unit tests below count both).
    assert saved > mlp_saved, (saved, mlp_saved)


def test_lean_forward_equals_transformers_and_keeps_less(smoke_policies_scratch):
    _check(smoke_policies_scratch)


@pytest.mark.slow
def test_lean_forward_on_smollm2(smol_policies_scratch):
    _check(smol_policies_scratch)


def test_lean_forward_in_bf16_equals_transformers():
    # bf16 (dtype: auto on CPUs with AVX512-BF16/AMX): the norms keep their bf16 input too, still bit for bit.
    from agonlib import load_config, load_policies

    _check(load_policies(load_config("smoke", device="cpu", dtype="bfloat16")))


def test_swiglu_gradient_is_exact():
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(3, 5, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(_SwiGLU.apply, (gate, up))
    assert torch.equal(_SwiGLU.apply(gate, up), torch.nn.functional.silu(gate) * up)


def _saved_storages(fn) -> tuple[torch.Tensor, int]:
    """``fn()``'s result and the bytes of the distinct storages autograd keeps for its backward pass."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_sdpa_is_transformers_sdpa_keeping_its_inputs_only(dtype):
    # 2 rows, 6 query heads sharing 2 key/value heads, 5 new tokens after 4 cached ones, left padding in row 0.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q = torch.randn(2, 6, 5, 8, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen).to(dtype) for _ in range(2))
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool).tril(diagonal=4)
    mask[0, :, :, :2] = False
    grad = torch.randn(2, 5, 6, 8, generator=gen).to(dtype)

    def run(attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, saved = _saved_storages(lambda: attention(module, *leaves, mask, scaling=0.3, dropout=0.0)[0])
        out.backward(grad)
        return out, [t.grad for t in leaves], saved

    out, grads, saved = run(sdpa_attention_forward)
    lean_out, lean_grads, lean_saved = run(lean._lean_sdpa)
    assert torch.equal(lean_out, out)
    for a, b in zip(lean_grads, grads):
        assert torch.equal(a, b)
    q_bytes, kv_bytes = q.nbytes, k.nbytes + v.nbytes
    assert lean_saved == q_bytes + kv_bytes + mask.nbytes  # its inputs, nothing more
    assert saved >= q_bytes + 3 * kv_bytes  # SDPA keeps the keys and values repeated per query head


def test_lean_norm_keeps_its_bf16_input_and_differentiates_alike():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16).to(torch.bfloat16).requires_grad_(False)
    norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grad = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def run(forward):
        leaf = x.clone().requires_grad_()
        out, saved = _saved_storages(lambda: forward(leaf))
        out.backward(grad)
        return out, leaf.grad, saved

    out, dx, saved = run(norm)
    lean_out, lean_dx, lean_saved = run(lambda t: lean._norm_forward(norm, t))
    assert torch.equal(lean_out, out) and torch.equal(lean_dx, dx)
    assert lean_saved == x.numel() * 2  # the bf16 input
    assert saved >= x.numel() * 4  # its float32 upcast


def test_install_leaves_a_model_it_does_not_know_alone(smoke_policies):
    assert lean.installed(smoke_policies.model)  # load_policies installed it on this CPU model
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    plain.config = type("Config", (), {"hidden_act": "silu"})()
    assert not lean.install(plain) and not lean.installed(plain)  # no SwiGLU MLP: nothing to replace
    gelu = torch.nn.Linear(2, 2)
    gelu.config = type("Config", (), {"hidden_act": "gelu"})()
    assert not lean.install(gelu)


def test_release_free_memory_only_on_the_cpu():
    assert lean.release_free_memory("cuda") is False  # another device's memory is not the C heap's
    assert lean.release_free_memory("cpu") is (platform.libc_ver()[0] == "glibc")  # False only off glibc


@contextlib.contextmanager
def _fp32_adapters(model):
    """``model`` with PEFT's own adapter path: each LoRA layer casts its bf16 input to fp32, no autocast."""
    inner = model.get_base_model()
    del inner.forward
    for m in lean._lora_layers(inner):
        m.cast_input_dtype_enabled = True
    try:
        yield
    finally:
        assert lean.install(model) and lean.bf16_adapters(model)


def test_bf16_adapters_keep_less_and_train_alike():
    # dtype: auto picks bf16 on CPUs with AVX512-BF16/AMX; there the adapters run in bf16 under autocast.
    from agonlib import load_config, load_policies

    policies = load_policies(load_config("smoke", device="cpu", dtype="bfloat16"))
    model = policies.model
    assert lean.bf16_adapters(model) and all(p.dtype == torch.float32 for p in policies.params("A"))  # masters
    batch, cfg = _batch(policies)

    head = model.get_base_model().get_output_embeddings()
    seen = []  # whether the LM head's input could be multiplied as one (rows, hidden) block
    probe = head.register_forward_hook(lambda m, args, out: seen.append(_foldable(args[0])))

    def run():
        with policies.use("A"):
            saved = _saved_bytes(lambda: batch_logprobs(model, batch, 0.8, rows=3), model.config.vocab_size)
        return saved, _grads(policies, batch, cfg)

    saved, grads = run()
    probe.remove()
    # transformers slices hidden[:, -k:] for the head (logits_to_keep): as a strided view, matmul would copy the
    # head's weight once per row. The hook hands it one block; without it the head sees the strided views.
    assert seen and all(seen)
    with _plain_head(head):
        seen.clear()
        probe = head.register_forward_hook(lambda m, args, out: seen.append(_foldable(args[0])))
        with torch.no_grad(), policies.use("A"):
            batch_logprobs(model, batch, 0.8, rows=3)
        probe.remove()
        assert seen and not all(seen)
    with _fp32_adapters(model):
        assert not lean.bf16_adapters(model)
        fp32_saved, fp32_grads = run()
    assert saved < 0.8 * fp32_saved, (saved, fp32_saved)  # the fp32 input copies are gone (0.73 measured)
    assert all(g.dtype == torch.float32 for g in grads)  # gradients reach the fp32 masters
    flat, fp32_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in fp32_grads])
    assert fp32_flat.norm() > 0
    # The same gradient up to bf16 rounding of A and B (measured ~1e-2 relative).
    assert (flat - fp32_flat).norm() <= 0.05 * fp32_flat.norm(), (flat - fp32_flat).norm() / fp32_flat.norm()
    # generate (PeftModel.generate reaches the base model's forward) runs under the same autocast
    ids = policies.tokenizer(["2+2="], return_tensors="pt")
    with policies.use("A"), torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=policies.tokenizer.pad_token_id)
    assert out.shape == (1, ids["input_ids"].shape[1] + 3)


def test_fp32_models_keep_peft_s_adapter_path_and_head(smoke_policies):
    assert not lean.bf16_adapters(smoke_policies.model)  # fp32: nothing to cast, nothing changed
    head = smoke_policies.model.get_base_model().get_output_embeddings()
    assert getattr(head, "_agon_contiguous_input", None) is None  # it would round differently: left alone


def _foldable(x: torch.Tensor) -> bool:
    """Whether matmul can treat ``x`` (..., H) as one (rows, H) matrix without a copy: its strides, size-1 dims too."""
    return all(x.stride(i) == x.stride(i + 1) * x.size(i + 1) for i in range(x.dim() - 1))


@contextlib.contextmanager
def _plain_head(head):
    handle = head._agon_contiguous_input
    handle.remove()
    head._agon_contiguous_input = None
    try:
        yield
    finally:
        head._agon_contiguous_input = head.register_forward_pre_hook(lean._contiguous_input)


def test_decoder_layers_release_free_pages_only_while_activations_are_kept(smoke_policies, monkeypatch):
    calls = []
    monkeypatch.setattr(lean, "release_free_memory", lambda device="cpu": calls.append(device) or True)
    model = smoke_policies.model
    ids = torch.tensor([[1, 2, 3, 4]])
    layers = model.get_base_model().config.num_hidden_layers
    with torch.no_grad():
        model(input_ids=ids)
    assert calls == []  # rollouts and no-grad log-probs keep nothing: no trimming
    model(input_ids=ids)
    # after every RELEASE_EVERY-th decoder layer and the last
    assert len(calls) == len({i for i in range(layers) if (i + 1) % lean.RELEASE_EVERY == 0} | {layers - 1})


def test_release_every_fourth_decoder_layer_and_the_last(monkeypatch):
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=17,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = transformers.Qwen3ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    calls = []
    monkeypatch.setattr(lean, "release_free_memory", lambda device="cpu": calls.append(device) or True)
    lean.install(model)
    hooked = [i for i, layer in enumerate(model.model.layers) if getattr(layer, "_agon_release", None) is not None]
    assert hooked == [3, 7, 11, 15, 16]
    model(input_ids=torch.tensor([[1, 2, 3]]))
    assert len(calls) == 5
