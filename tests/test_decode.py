"""The fast rollout decoder (agonlib/generation/fast.py), its engine, and the sampler (agonlib.generation.draw).

The fast path must be the same model function and the same sampling as the
``transformers`` path and as plain ``model.generate``: logits equal up to float
rounding, the same tokens for the same seeds, and the same token distribution.
"""

import dataclasses

import pytest
import torch

from agonlib.generation import SamplingParams, draw, fast, generate, sample_seed
from agonlib.generation.engines import FastEngine, TransformersEngine, engine_for
from agonlib.generation.layout import left_padded
from agonlib.prompts import draft_prompt, render

QUESTIONS = ["What is 2+2?", "A shop sells 3 pens for 12 dollars. How much do 5 pens cost?", "Compute 7*8."]


def _encode(policies, texts):
    tok = policies.tokenizer
    return left_padded(tok(texts, add_special_tokens=False)["input_ids"], tok.pad_token_id, policies.device)


def _fast_vs_transformers(policies, adapter, atol):
    """Prefill then two decode steps through both paths; the logits must agree to ``atol``."""
    texts = [render(policies.tokenizer, draft_prompt(q)) for q in QUESTIONS]
    ids, mask = _encode(policies, texts)  # (3, T) left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    decoder = fast.FastDecoder(policies.model, adapter)
    cache = decoder.new_cache(len(texts), ids.shape[1] + 2)
    key_mask = torch.cat([mask, mask.new_zeros(len(texts), 2)], dim=1)
    got, width = [decoder.forward(ids, positions, key_mask, cache)], ids.shape[1]
    for step, token in enumerate(([11], [42])):
        key_mask[:, width + step] = 1
        ids = torch.cat([ids, torch.tensor([token] * len(texts))], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        got.append(decoder.forward(ids[:, -1:], positions[:, -1:], key_mask, cache))
    with policies.use(adapter), torch.no_grad():
        full = policies.model(input_ids=ids, attention_mask=key_mask, position_ids=positions).logits  # (3, T+2, V)
    for k, logits in enumerate(got):
        torch.testing.assert_close(logits, full[:, k - 3], rtol=0, atol=atol)


@pytest.mark.parametrize("adapter", ["A", "B", None])
def test_fast_logits_equal_transformers_tiny_qwen3(smoke_policies, adapter):
    # tiny-qwen3 (q_norm/k_norm, GQA): logits ~1, merged weights move them by ~3e-7
    _fast_vs_transformers(smoke_policies, adapter, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["B", None])  # B is noise-initialised: its merge changes the weights
def test_fast_logits_equal_transformers_smollm2(smol_policies, adapter):
    # SmolLM2 (Llama): logits up to ~30 through 30 layers; measured max difference 1e-4
    _fast_vs_transformers(smol_policies, adapter, atol=1e-3)


def test_fast_logits_equal_transformers_in_bf16():
    # The dtype `dtype: auto` picks on CPUs with AVX512-BF16/AMX, where the decoder prepacks bf16 weights too:
    # logits ~1; each path rounds to bf16 at different points (merged weights, fused matmuls).
    from agonlib import load_config, load_policies

    policies = load_policies(load_config("smoke", device="cpu", dtype="bfloat16"))
    assert policies.dtype == torch.bfloat16
    _fast_vs_transformers(policies, "B", atol=0.03)  # B is noise-initialised: its merged weights round too (bf16 ulp at 1: 0.008)


def test_fast_logits_follow_a_trained_adapter(smoke_policies_scratch):
    policies = smoke_policies_scratch
    with torch.no_grad():
        for p in policies.params("B"):
            p.add_(0.05 * torch.randn_like(p))
    _fast_vs_transformers(policies, "B", atol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(1.0, 1.0, 0, 10), SamplingParams(0.7, 0.9, 50, 10)])
def test_fast_and_transformers_paths_draw_the_same_tokens(smoke_policies, monkeypatch, params):
    from agonlib.prompts import challenge_prompt

    tok = smoke_policies.tokenizer
    # drafts share the system prompt; a problem's challenges share everything up to the summary
    prompts = [render(tok, draft_prompt(q)) for q in QUESTIONS] * 2
    prompts += [render(tok, challenge_prompt(q, s)) for q in QUESTIONS[:2] for s in ("Add them.", "Halve it.")]
    seeds = [sample_seed(3, 1, i, 0) for i in range(len(prompts))]
    runs = {}
    for choice in ("transformers", "fast"):
        monkeypatch.setattr(smoke_policies, "config", dataclasses.replace(smoke_policies.config, decode_forward=choice))
        runs[choice] = [r.completion_ids for r in generate(smoke_policies, prompts, "B", seeds, params, progress=False)]
    assert runs["fast"] == runs["transformers"]


def _forward(policies, monkeypatch, choice):
    monkeypatch.setattr(policies, "config", dataclasses.replace(policies.config, decode_forward=choice))


def test_decode_forward_choice(smoke_policies, monkeypatch):
    for choice, expected in (("auto", FastEngine), ("fast", FastEngine), ("transformers", TransformersEngine)):
        _forward(smoke_policies, monkeypatch, choice)
        assert isinstance(engine_for(smoke_policies, "A"), expected)
    with pytest.raises(ValueError, match="No adapter 'C'"):
        engine_for(smoke_policies, "C")
    # a model it does not know: auto falls back, fast says why it cannot
    monkeypatch.setattr(fast, "supports", lambda model: False)
    _forward(smoke_policies, monkeypatch, "auto")
    assert isinstance(engine_for(smoke_policies, "A"), TransformersEngine)
    _forward(smoke_policies, monkeypatch, "fast")
    with pytest.raises(ValueError, match="decode_forward=fast needs"):
        engine_for(smoke_policies, "A")


@pytest.mark.parametrize("rows", [[0, 2, 3], [1], [0, 1, 2, 3], [0, 0, 1, 1, 1, 3], [3, 1, 0], [2, 2]])
def test_cache_select_keeps_the_rows_it_is_given(rows):
    # Leaving rows close up in place (strictly increasing), anything else is gathered: both equal t[:, rows].
    cache = fast.KVCache(layers=2, batch=4, heads=3, length=5, head_dim=2, dtype=torch.bfloat16, device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    want_k, want_v = cache.k[:, rows].clone(), cache.v[:, rows].clone()
    cache.select(torch.tensor(rows))
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)
    cache.select(torch.tensor([len(rows) - 1]))  # and again, on what is left
    assert torch.equal(cache.k, want_k[:, -1:]) and torch.equal(cache.v, want_v[:, -1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear_agrees_with_f_linear(dtype):
    weight = (0.05 * torch.randn(96, 64)).to(dtype)
    x = torch.randn(5, 2, 64).to(dtype)
    if not fast._can_pack(weight):  # bf16 packing needs a CPU with native bf16
        assert dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        pytest.skip("this CPU has no native bf16: the decoder runs F.linear")
    got, want = fast.Linear(weight, None, pack=True)(x), torch.nn.functional.linear(x, weight)
    assert got.shape == want.shape == (5, 2, 96) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_supports_only_dense_llama_and_qwen3(smoke_policies):
    assert fast.supports(smoke_policies.model)
    assert not fast.supports(object())
    cfg = smoke_policies.model.config
    for change in ({"model_type": "gpt2"}, {"hidden_act": "gelu"}, {"use_sliding_window": True}):
        saved = {k: getattr(cfg, k, None) for k in change}
        try:
            for k, v in change.items():
                setattr(cfg, k, v)
            assert not fast.supports(smoke_policies.model), change
        finally:
            for k, v in saved.items():
                setattr(cfg, k, v)


# --- the sampler's distribution ----------------------------------------------------------------

# Chi-square critical value for 7 degrees of freedom at p = 0.001. The draws are seeded, so
# each check below is deterministic; the threshold says how unlikely a pass would be by luck
# if the distributions differed.
CHI2_7DF_P001 = 24.32
TOP_K = 8
DRAWS = 2000
CHUNK = 500  # rows per call: a (rows, 151k-vocab) float64 CDF is 600 MB at 500 rows


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _first_token_probs(policies, prompt):
    ids, mask = _encode(policies, [prompt])
    with torch.no_grad():
        logits = policies.model(input_ids=ids, attention_mask=mask).logits[0, -1]  # (V,)
    probs = logits.float().softmax(-1)
    top = probs.topk(TOP_K)
    return top.indices, top.values / top.values.sum()  # the top-k renormalised: what sampling sees


def test_draw_matches_the_exact_distribution(smoke_policies):
    prompt = render(smoke_policies.tokenizer, draft_prompt(QUESTIONS[0]))
    support, probs = _first_token_probs(smoke_policies, prompt)
    ids, mask = _encode(smoke_policies, [prompt])
    with torch.no_grad():
        logits = smoke_policies.model(input_ids=ids, attention_mask=mask).logits[0, -1]
    generators = [torch.Generator().manual_seed(sample_seed(0, 0, 0, i)) for i in range(DRAWS)]
    tokens = torch.cat([draw(logits.expand(CHUNK, -1), SamplingParams(top_k=TOP_K), generators[lo : lo + CHUNK])
                        for lo in range(0, DRAWS, CHUNK)])  # (DRAWS,)
    assert torch.isin(tokens, support).all()  # nothing outside the top-k is ever drawn
    counts = torch.stack([(tokens == t).sum() for t in support]).float()
    assert _chi2(counts, probs) < CHI2_7DF_P001


def test_plain_generate_and_the_fast_path_sample_the_same_distribution(smoke_policies, monkeypatch):
    """First tokens of agonlib's fast path and of transformers' ``generate`` against the exact top-k distribution."""
    _forward(smoke_policies, monkeypatch, "fast")
    prompt = render(smoke_policies.tokenizer, draft_prompt(QUESTIONS[0]))
    support, probs = _first_token_probs(smoke_policies, prompt)
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_new_tokens=1)
    ours = generate(smoke_policies, [prompt] * DRAWS, None, [sample_seed(1, 0, 0, i) for i in range(DRAWS)], params,
                    batch_size=CHUNK, progress=False)
    ours = torch.tensor([r.completion_ids[0] for r in ours])
    ids, mask = _encode(smoke_policies, [prompt])
    torch.manual_seed(0)
    with smoke_policies.use(None), torch.no_grad():
        plain = torch.cat([
            smoke_policies.model.generate(input_ids=ids.expand(CHUNK, -1), attention_mask=mask.expand(CHUNK, -1),
                                          do_sample=True, top_k=TOP_K, top_p=1.0, temperature=1.0,
                                          max_new_tokens=1, min_new_tokens=1, pad_token_id=0)[:, -1]
            for _ in range(DRAWS // CHUNK)])
    for tokens in (ours, plain):
        counts = torch.stack([(tokens == t).sum() for t in support]).float()
        assert counts.sum() == DRAWS  # every draw inside the top-k support
        assert _chi2(counts, probs) < CHI2_7DF_P001


# --- shared prefixes in the prefill ---------------------------------------------------------------------

def test_share_prefixes_groups_a_problems_challenges():
    from agonlib.generation import MIN_SHARED, share_prefixes

    head = list(range(100, 100 + MIN_SHARED))  # system prompt and example, shared by every prompt
    p1, p2 = head + list(range(20)), head + list(range(30, 45))  # two problems, each with its rival intro
    prompts = [p1 + [10, 11], p1 + [12], p1 + [13, 14, 15], p2 + [16], p2 + [17, 18]]
    group, lengths = share_prefixes(prompts)
    assert group == [0, 0, 0, 1, 1]
    assert lengths == [len(p1), len(p2)]  # the problem prefix, not just the common head
    # a group's prefix leaves every member one token of its own
    assert share_prefixes([p1, p1 + [9]]) == ([0, 0], [len(p1) - 1])
    # too little in common: every prompt on its own
    assert share_prefixes([[1] * 40, [1] * (MIN_SHARED - 1) + [2] * 30]) == ([0, 1], [39, 44])


def test_shared_prefix_prefill_gives_the_same_logits(smoke_policies):
    from agonlib.generation import prompt_layout
    from agonlib.prompts import challenge_prompt

    tok = smoke_policies.tokenizer
    summaries = ["First add 3 and 4.", "Multiply the price by five, then subtract.", ""]
    texts = [render(tok, challenge_prompt(q, s)) for q in QUESTIONS[:2] for s in summaries]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    (suffix_ids, suffix_mask), prefix = prompt_layout(ids, tok.pad_token_id, smoke_policies.device)
    # every challenge shares the opening and the worked challenge turns; the summary and the problem come last
    assert prefix is not None and prefix.group.tolist() == [0] * 6
    assert prefix.attention_mask.sum() > len(ids[0]) // 2
    engine, plain_engine = (FastEngine(fast.FastDecoder(smoke_policies.model, "B")) for _ in range(2))
    shared = engine.prefill(suffix_ids, suffix_mask, 4, prefix)
    plain = plain_engine.prefill(*left_padded(ids, tok.pad_token_id, smoke_policies.device), 4)
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    mask = engine.key_mask[:, : engine.filled]  # (U, T_prompt): prefix, padding, suffix
    assert mask.sum(1).tolist() == [len(x) for x in ids]  # every prompt token is seen, once
    assert engine.position.tolist() == plain_engine.position.tolist()  # the next token's rotary position
    assert engine.cache.k.shape[1] == len(ids) and engine.cache.used == engine.filled
