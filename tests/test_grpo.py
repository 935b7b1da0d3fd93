"""GRPO loss, advantages and update (agonlib/grpo.py).

The loss is checked against TRL 1.15 itself: `GRPOTrainer._compute_loss` is called unbound on a small
stand-in object that carries only the attributes it reads, with its log-prob function replaced by one
that returns our fixed log-probs. Nothing of TRL's formula is re-typed here.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from agonlib import grpo
from agonlib.grpo import (
    GRPOBatch,
    UpdateConfig,
    completion_logprobs,
    group_advantages,
    grpo_loss,
    grpo_update,
)

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


# --------------------------------------------------------------------------- TRL parity


def _random_batch(seed=0, B=6, Tc=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, Tc, generator=g) * 3  # (B, Tc)
    old = logp + 0.4 * torch.randn(B, Tc, generator=g)  # ratios spread well past 1 +- 0.28: clipping happens
    ref = logp + 0.5 * torch.randn(B, Tc, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([7, 3, 0, 5, 1, 6][:B])  # ragged, one empty completion
    mask = (torch.arange(Tc)[None] < lengths[:, None]).long()  # (B, Tc)
    return logp, old, ref, adv, mask


def _trl_loss(logp, old, ref, adv, mask, *, loss_type, beta, epsilon, epsilon_high, max_completion_length,
              kl_ratio_correction, is_ratio=None):
    """TRL's `_compute_loss` on one process, one accumulation step; returns (loss, logp.grad, metrics)."""
    from trl import GRPOTrainer

    B, Tc = mask.shape
    logp = logp.clone().requires_grad_(True)
    accelerator = SimpleNamespace(
        num_processes=1,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        reduce=lambda t, reduction="sum": t,
    )
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    stand_in = SimpleNamespace(
        # The forward pass is replaced: TRL gets our log-probs (and zero entropies) back.
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,  # as GRPOTrainer.__init__ sets it
        use_vllm=is_ratio is not None,  # with vLLM, TRL weights the surrogate by its importance ratio
        vllm_importance_sampling_correction=is_ratio is not None,
        max_completion_length=max_completion_length,
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(use_bias_correction_kl=kl_ratio_correction, delta=None, steps_per_generation=1),
        accelerator=accelerator,
        _metrics=metrics,
    )
    inputs = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones(B, Tc, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        # dapo divides by the active tokens of the whole generation batch (gathered over processes); one
        # process and steps_per_generation == accumulation steps == 1 make that this batch's token count.
        "num_items_in_batch": mask.sum(),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if beta != 0.0:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.detach(), logp.grad, {k: v[-1] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("off_policy", [False, True])  # old log-probs given, or None (TRL: logp.detach())
@pytest.mark.parametrize(
    "beta,kl_ratio_correction",
    [
        (0.0, True),  # no KL term
        (0.04, True),  # KL times the ratio (TRL's default use_bias_correction_kl=True)
        (0.04, False),  # DESIGN.md's plain k3 KL
    ],
)
def test_loss_matches_trl(loss_type, beta, kl_ratio_correction, epsilon_high, off_policy):
    logp, old, ref, adv, mask = _random_batch()
    old = old if off_policy else None
    kw = dict(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high, max_completion_length=10)
    trl_loss, trl_grad, trl_metrics = _trl_loss(logp, old, ref, adv, mask, kl_ratio_correction=kl_ratio_correction,
                                                **kw)

    ours_logp = logp.clone().requires_grad_(True)
    loss, stats = grpo_loss(ours_logp, old, ref if beta else None, adv, mask, kl_ratio_correction=kl_ratio_correction,
                            **kw)
    loss.backward()

    assert torch.allclose(loss, trl_loss, rtol=0, atol=1e-6), (loss.item(), trl_loss.item())
    assert torch.allclose(ours_logp.grad, trl_grad, rtol=0, atol=1e-6)
    assert stats.clip_low == pytest.approx(trl_metrics["clip_ratio/low_mean"], abs=1e-6)
    assert stats.clip_high == pytest.approx(trl_metrics["clip_ratio/high_mean"], abs=1e-6)
    assert stats.clip_region == pytest.approx(trl_metrics["clip_ratio/region_mean"], abs=1e-6)
    if beta:
        assert stats.kl == pytest.approx(trl_metrics["kl"], abs=1e-6)
    if off_policy:
        assert stats.clip_region > 0  # the case exercises clipping


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("per", ["sequence", "token"])
@pytest.mark.parametrize("beta", [0.0, 0.04])  # TRL weights the surrogate, not the KL term
def test_loss_with_importance_weights_matches_trl(loss_type, per, beta):
    logp, old, ref, adv, mask = _random_batch(seed=3)
    g = torch.Generator().manual_seed(4)
    weights = torch.rand(logp.size(0), 1 if per == "sequence" else logp.size(1), generator=g) * 2
    weights[1] = 0.0  # a masked sequence (or a row of masked tokens)
    kw = dict(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28, max_completion_length=10,
              kl_ratio_correction=True)
    trl_loss, trl_grad, _ = _trl_loss(logp, old, ref, adv, mask, is_ratio=weights, **kw)
    ours_logp = logp.clone().requires_grad_(True)
    loss, _ = grpo_loss(ours_logp, old, ref if beta else None, adv, mask, is_weights=weights, **kw)
    loss.backward()
    assert torch.allclose(loss, trl_loss, rtol=0, atol=1e-6), (loss.item(), trl_loss.item())
    assert torch.allclose(ours_logp.grad, trl_grad, rtol=0, atol=1e-6)
    unweighted, _ = grpo_loss(logp, old, ref if beta else None, adv, mask, **kw)
    assert not torch.allclose(loss, unweighted)  # the weights did something


def test_importance_weights_in_trls_four_modes():
    # two sequences of three tokens, the last of the second padding; the engine gave no log-prob for
    # the first sequence's middle token (NaN: counts 0)
    train = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -5.0]])
    engine = torch.tensor([[-1.5, math.nan, -1.2], [-2.0, -1.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # log-ratios per token: [0.5, 0, 0.2] and [1.0, 0.5, (padding)]; per sequence 0.7 and 1.5
    seq = torch.tensor([[math.exp(0.7)], [math.exp(1.5)]])  # 2.01 and 4.48
    tok = torch.tensor([[math.exp(0.5), 1.0, math.exp(0.2)], [math.exp(1.0), math.exp(0.5), 1.0]])
    weights = lambda mode, **kw: grpo.importance_weights(train, engine, mask, mode, **kw)  # noqa: E731
    assert torch.allclose(weights("sequence_mask"), torch.tensor([[math.exp(0.7)], [0.0]]))  # 4.48 > 3
    assert torch.allclose(weights("sequence_truncate"), torch.tensor([[math.exp(0.7)], [3.0]]))
    assert torch.allclose(weights("token_mask"), tok.masked_fill(tok > 3, 0.0))  # e^1 = 2.72 stays
    assert torch.allclose(weights("token_truncate", clip_min=1.5), tok.clamp(min=1.5, max=3.0))
    assert torch.allclose(weights("sequence_mask", clip_min=2.1, clip_max=None), torch.tensor([[0.0], [seq[1, 0]]]))
    assert torch.allclose(weights("sequence_truncate", clip_max=None), seq)
    with pytest.raises(ValueError, match="importance-sampling mode"):
        weights("sequence")


def test_build_batch_keeps_each_rows_engine_logprobs_through_the_reordering():
    from agonlib.generation import Rollout

    prompts = [[1, 2, 3, 9], [1, 2, 3, 8, 8], [1, 2, 3, 9]]  # reordered: by prompt, then by length
    rows = [Rollout(prompt="", prompt_ids=p, completion_ids=list(range(10 + i, 10 + i + n)), text="", think="",
                    summary="", answer=None, length=n, truncated=False, seed=0,
                    extra={"gen_logprobs": [-float(i + 1)] * n})
            for i, (p, n) in enumerate(zip(prompts, (3, 2, 1)))]
    batch = grpo.build_batch(rows, torch.tensor([0.5, -0.5, 1.0]), 0, "cpu", share_prefix=True)
    assert batch.sampling_logp.shape == (3, 3)
    for ids, lp, m in zip(batch.input_ids[:, -3:].tolist(), batch.sampling_logp.tolist(),
                          batch.completion_mask.tolist()):
        i = ids[0] - 10  # completions start at 10 + the row's index
        assert [v for v, k in zip(lp, m) if k] == [-float(i + 1)] * sum(m)
        assert all(math.isnan(v) for v, k in zip(lp, m) if not k)
    plain = [Rollout(**{**vars(r), "extra": {}}) for r in rows]
    assert grpo.build_batch(plain, torch.zeros(3), 0, "cpu").sampling_logp is None  # no engine log-probs


def test_slices_sum_to_the_whole_batch_loss():
    # Passing the whole batch's num_sequences / num_items_in_batch makes slice losses add up exactly.
    logp, old, ref, adv, mask = _random_batch()
    for loss_type in LOSS_TYPES:
        kw = dict(beta=0.04, loss_type=loss_type, max_completion_length=10)
        whole, _ = grpo_loss(logp, old, ref, adv, mask, **kw)
        parts = sum(
            grpo_loss(logp[sl], old[sl], ref[sl], adv[sl], mask[sl], num_sequences=6, num_items_in_batch=mask.sum(),
                      **kw)[0]
            for sl in (slice(0, 4), slice(4, 6))
        )
        assert torch.allclose(parts, whole, atol=1e-6), loss_type


# --------------------------------------------------------------------------- advantages

S4 = 0.5  # unbiased std of (1, 0, 0, 0)
S2 = math.sqrt(0.5)  # unbiased std of (1, 0)
S8 = math.sqrt(15 / 56)  # unbiased std of (1, 0, 0, 0, 1, 1, 1, 1)

ADVANTAGE_CASES = [
    # all correct: nothing to learn
    ([[1, 1, 1, 1]], "group", [0, 0, 0, 0]),
    # all wrong
    ([[0, 0, 0, 0]], "group", [0, 0, 0, 0]),
    # one right of four: mean 0.25, unbiased std 0.5
    ([[1, 0, 0, 0]], "group", [0.75 / (S4 + 1e-4)] + [-0.25 / (S4 + 1e-4)] * 3),
    # two groups are normalised separately
    ([[1, 0], [0, 0]], "group", [0.5 / (S2 + 1e-4), -0.5 / (S2 + 1e-4), 0, 0]),
    # no scaling: centred only
    ([[1, 0, 0, 0], [1, 1, 1, 1]], "none", [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]),
    # batch scaling: group mean, std of all eight rewards
    ([[1, 0, 0, 0], [1, 1, 1, 1]], "batch", [x / (S8 + 1e-4) for x in (0.75, -0.25, -0.25, -0.25)] + [0] * 4),
    # one generation per problem: no signal, not NaN
    ([[1], [0]], "group", [0, 0]),
    # an unscorable (NaN) reward is left out of the group and gets 0
    ([[1, 0, float("nan")]], "group", [0.5 / (S2 + 1e-4), -0.5 / (S2 + 1e-4), 0]),
    # graded rewards (challenger: correct + conversion bonus)
    ([[2, 1, 0, 1]], "group", [1 / (math.sqrt(2 / 3) + 1e-4), 0, -1 / (math.sqrt(2 / 3) + 1e-4), 0]),
]


@pytest.mark.parametrize("rewards,scale,expected", ADVANTAGE_CASES)
def test_group_advantages_table(rewards, scale, expected):
    n = len(rewards[0])
    flat = torch.tensor([x for row in rewards for x in row], dtype=torch.float32)
    for given in (flat, flat.view(-1, n)):  # (P*N,) and (P, N) give the same
        adv = group_advantages(given, n, scale)
        assert adv.shape == (flat.numel(),)
        assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float32), atol=1e-5), adv


def test_group_std_is_trls_nanstd():
    # TRL's advantage code is inline in a generation method; its std helper is the reachable part.
    from trl.trainer.utils import nanstd

    r = torch.rand(5, 4, generator=torch.Generator().manual_seed(1))
    r[2, 1] = float("nan")
    centred = r - torch.nanmean(r, dim=1, keepdim=True)
    expected = torch.nan_to_num(centred / (nanstd(r, dim=1, keepdim=True) + 1e-4), nan=0.0).view(-1)
    assert torch.allclose(group_advantages(r, 4, "group"), expected, atol=1e-6)
    expected_batch = torch.nan_to_num(centred / (nanstd(r) + 1e-4), nan=0.0).view(-1)
    assert torch.allclose(group_advantages(r, 4, "batch"), expected_batch, atol=1e-6)


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(4), 4, "std")


# --------------------------------------------------------------------------- update


class TinyLM(torch.nn.Module):
    """Embedding + linear head with the call convention of a transformers causal LM (mock model)."""

    def __init__(self, vocab=11, hidden=5, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        logits = self.head(torch.tanh(self.emb(input_ids)))  # (B, T, V)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])


def _update_batch(seed=0, B=6, P=3, Tc=5, vocab=11):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])
    cmask = (torch.arange(Tc)[None] < lengths[:, None]).long()  # (B, Tc)
    pmask = torch.ones(B, P, dtype=torch.long)
    pmask[1, 0] = pmask[3, :2] = 0  # left padding
    ids = torch.randint(1, vocab, (B, P + Tc), generator=g) * torch.cat([pmask, cmask], 1)
    adv = torch.randn(B, generator=g)
    ref = -torch.rand(B, Tc, generator=g) * 3
    return GRPOBatch(ids, torch.cat([pmask, cmask], 1), cmask, adv, ref_logp=ref)


def _run(batch, cfg, seed=0, lr=0.5):
    model = TinyLM(seed=seed)
    params = list(model.parameters())
    stats = grpo_update(model, batch, params, torch.optim.SGD(params, lr=lr), cfg)
    return model, stats


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_give_the_full_batch_update(loss_type):
    batch = _update_batch()
    for extra in (dict(num_iterations=1), dict(num_iterations=2, beta=0.1)):  # on-policy; off-policy with KL
        cfg = dict(loss_type=loss_type, max_grad_norm=None, max_completion_length=8, **extra)
        full, s_full = _run(batch, UpdateConfig(micro_batch_size=None, **cfg))
        micro, s_micro = _run(batch, UpdateConfig(micro_batch_size=4, **cfg))  # 4 + 2: uneven on purpose
        for a, b in zip(full.parameters(), micro.parameters()):
            assert torch.allclose(a.grad, b.grad, atol=1e-6)
            assert torch.allclose(a, b, atol=1e-6)
        assert s_micro.loss == pytest.approx(s_full.loss, abs=1e-6)
        assert s_micro.grad_norm == pytest.approx(s_full.grad_norm, rel=1e-5)
        assert s_micro.num_steps == extra["num_iterations"] and s_micro.num_skipped == 0
        if extra["num_iterations"] == 2:
            assert s_micro.kl == pytest.approx(s_full.kl, abs=1e-6)


def test_token_capped_micro_batches_give_the_full_batch_update():
    batch = _update_batch()  # (6, 8): 48 padded tokens
    assert UpdateConfig(micro_batch_tokens=20).rows_per_micro_batch(6, 8) == 2
    assert UpdateConfig(micro_batch_size=4, micro_batch_tokens=1000).rows_per_micro_batch(6, 8) == 4
    assert UpdateConfig(micro_batch_tokens=3).rows_per_micro_batch(6, 8) == 1  # never zero rows
    full, s_full = _run(batch, UpdateConfig(max_grad_norm=None))
    model, rows = TinyLM(), []
    model.register_forward_hook(lambda module, args, kwargs, out: rows.append(kwargs["input_ids"].size(0)),
                                with_kwargs=True)
    params = list(model.parameters())
    s_capped = grpo_update(model, batch, params, torch.optim.SGD(params, lr=0.5),
                           UpdateConfig(max_grad_norm=None, micro_batch_tokens=20))
    assert rows == [2, 2, 2]
    for a, b in zip(full.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert s_capped.loss == pytest.approx(s_full.loss, abs=1e-6)


def test_update_moves_params_and_clips():
    batch = _update_batch()
    before = [p.detach().clone() for p in TinyLM().parameters()]
    model, stats = _run(batch, UpdateConfig(max_grad_norm=1e-3), lr=1.0)
    total = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert stats.grad_norm > 1e-3 and total.item() == pytest.approx(1e-3, rel=1e-3)  # clipped to max_grad_norm


def test_non_finite_loss_skips_the_update():
    batch = _update_batch()
    batch.advantages[2] = float("nan")
    before = [p.detach().clone() for p in TinyLM().parameters()]
    model, stats = _run(batch, UpdateConfig(micro_batch_size=2, num_iterations=2))
    assert stats.num_skipped == 2 and stats.num_steps == 0 and math.isnan(stats.loss)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_grad_norm_skips_the_update():
    batch = _update_batch()
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    model.head.bias.register_hook(lambda g: g + float("inf"))
    params = list(model.parameters())
    stats = grpo_update(model, batch, params, torch.optim.SGD(params, lr=0.5), UpdateConfig())
    assert stats.num_skipped == 1 and stats.num_steps == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_config_and_batch_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="loss_type"):
        UpdateConfig(loss_type="ppo")
    b = _update_batch()
    with pytest.raises(ValueError, match="advantages"):
        GRPOBatch(b.input_ids, b.attention_mask, b.completion_mask, b.advantages[:3])
    with pytest.raises(ValueError, match="ref_logp"):
        _run(GRPOBatch(b.input_ids, b.attention_mask, b.completion_mask, b.advantages), UpdateConfig(beta=0.1))


# --------------------------------------------------------------------------- log-probs on a tiny real model


def _tiny_model(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = tf.Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0)
        return tf.Qwen3ForCausalLM(cfg).eval()
    cfg = tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32, pad_token_id=0)
    return tf.GPT2LMHeadModel(cfg).eval()


# RoPE only sees position differences; GPT-2's absolute positions make wrong position ids show.
@pytest.mark.parametrize("kind", ["qwen3", "gpt2"])
def test_completion_logprobs_matches_naive_gather_with_left_padding(kind):
    model = _tiny_model(kind)
    head = model.get_output_embeddings().weight
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    completions = [[20, 21, 22], [23, 24, 25, 26, 27], [28]]
    P, Tc = max(map(len, prompts)), max(map(len, completions))
    rows, masks = [], []
    for p, c in zip(prompts, completions):  # left-pad the prompt, right-pad the completion
        rows.append([0] * (P - len(p)) + p + c + [0] * (Tc - len(c)))
        masks.append([0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (Tc - len(c)))
    ids, attn = torch.tensor(rows), torch.tensor(masks)
    temperature = 0.7

    with torch.no_grad():
        got = completion_logprobs(model, ids, attn, P, temperature=temperature)  # (B, Tc)
        got_mb = completion_logprobs(model, ids, attn, attn[:, P:], temperature=temperature, micro_batch_size=2)
        # one row per micro-batch: each skips its own columns of left padding
        got_one = completion_logprobs(model, ids, attn, P, temperature=temperature, micro_batch_size=1)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            # Naive: the sequence alone, unpadded, full (T, V) log-softmax, then gather.
            seq = torch.tensor([p + c])
            lsm = torch.log_softmax(model(seq).logits[0].float() / temperature, dim=-1)  # (T, V)
            want = lsm[len(p) - 1 : -1].gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            assert torch.allclose(got[i, : len(c)], want, atol=1e-5), (i, got[i], want)
            assert torch.all(got[i, len(c) :] == 0)  # completion padding
    assert got.shape == (3, Tc) and torch.allclose(got, got_mb, atol=1e-6) and torch.allclose(got, got_one, atol=1e-5)

    # With grad: the position-chunked log-softmax gives the plain autograd gradient.
    model.zero_grad()
    completion_logprobs(model, ids, attn, P, temperature=temperature).sum().backward()
    g_ours = head.grad.clone()
    model.zero_grad()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1]  # (B, Tc, V)
    naive = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[:, P:, None]).squeeze(-1)
    (naive * attn[:, P:]).sum().backward()
    assert torch.allclose(g_ours, head.grad, atol=1e-5)


class _LargestNewTensors(TorchDispatchMode):
    """The bytes of the largest storage any op allocates (views and in-place results are not new), per dtype."""

    def __init__(self):
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.untyped_storage().nbytes())
        return out


class HalfLM(torch.nn.Module):
    """A frozen fp16 embedding and LM head around one float32 trainable vector, as LoRA over an fp16 base."""

    def __init__(self, vocab=512, hidden=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, hidden).half().requires_grad_(False)
        self.head = torch.nn.Linear(hidden, vocab, bias=False).half().requires_grad_(False)
        self.scale = torch.nn.Parameter(torch.ones(hidden))  # float32, like PEFT's adapter weights

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        h = self.emb(input_ids[:, -logits_to_keep:]) * self.scale.to(self.emb.weight.dtype)  # kept positions only
        return SimpleNamespace(logits=self.head(h))  # (B, logits_to_keep, V), fp16


@pytest.mark.parametrize("Tc", [48, 96])
def test_logprob_backward_float32_memory_follows_the_chunk_not_tc_times_vocab(monkeypatch, Tc):
    # colab: one (4097, 151936) float32 copy is 2.3 GiB, and the backward kept several. Here a chunk is
    # 16 positions: no float32 tensor may outgrow one chunk, whatever Tc, and nothing of any dtype may
    # outgrow the fp16 logits (their gradient is the one logits-sized buffer the backward needs).
    V, B, P = 512, 2, 4
    monkeypatch.setattr(grpo, "_LOGSOFTMAX_CHUNK", 16 * V)
    model = HalfLM(V)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, P + Tc), generator=g)
    attn = torch.ones_like(ids)
    with _LargestNewTensors() as seen:
        logp = completion_logprobs(model, ids, attn, P, temperature=0.7)  # (B, Tc)
        logp.sum().backward()
    assert model.scale.grad is not None and torch.isfinite(model.scale.grad).all()
    chunk_bytes = 16 * V * 4
    assert seen.largest[torch.float32] <= chunk_bytes, (seen.largest, chunk_bytes)
    assert seen.largest[torch.float16] <= B * (Tc + 1) * V * 2
    assert max(seen.largest.values()) <= B * (Tc + 1) * V * 2


def test_logprobs_when_the_model_ignores_logits_to_keep():
    # Some Unsloth forwards read only `num_logits_to_keep` and return logits at every position:
    # the completion's log-probs must still come from the last Tc + 1 of them.
    batch = _update_batch()
    model = TinyLM()
    keeps = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    everything = lambda **kw: model(**{**kw, "logits_to_keep": 0})  # noqa: E731 — logits[:, -0:]: all positions
    assert torch.allclose(completion_logprobs(everything, batch.input_ids, batch.attention_mask,
                                              batch.completion_mask), keeps, atol=1e-6)


def _tiny_advantage_batch(V=512, B=2, P=3, Tc=8, adv=1e-7):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, P + Tc), generator=g)
    return GRPOBatch(ids, torch.ones_like(ids), torch.ones(B, Tc, dtype=torch.long), torch.tensor([adv, -adv]))


def _scaled_update(model, batch, scaler, lr=1.0):
    opt = torch.optim.SGD([model.scale], lr=lr)
    return grpo_update(model, batch, [model.scale], opt, UpdateConfig(max_grad_norm=None), scaler=scaler)


def test_grad_scaler_rescues_fp16_gradients_that_underflow():
    # Advantages of 1e-7 give d loss / d logits ~ 1e-8, below fp16's smallest subnormal (6e-8): unscaled,
    # the fp16 layers flush the gradient to zero and the step learns nothing. Scaled by 2^16 it survives,
    # and once unscaled it is the fp32 model's gradient.
    batch = _tiny_advantage_batch()
    reference = HalfLM().float()
    _scaled_update(reference, batch, None)
    want = reference.scale.grad
    assert want.abs().max() > 0

    plain = HalfLM()
    stats = _scaled_update(plain, batch, None)
    assert stats.grad_norm == 0.0 and torch.all(plain.scale.grad == 0)  # what fp16 without scaling does

    rescued = HalfLM()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    stats = _scaled_update(rescued, batch, scaler, lr=1e6)  # a step of ~1e-2 on weights of 1
    assert stats.num_steps == 1 and stats.num_skipped == 0
    assert torch.allclose(rescued.scale.grad, want, rtol=0.05, atol=0.05 * want.abs().max().item())
    assert stats.grad_norm == pytest.approx(want.norm().item(), rel=0.05)  # logged unscaled
    assert torch.allclose(rescued.scale.detach(), 1 - 1e6 * rescued.scale.grad)  # SGD stepped on the unscaled grad
    assert scaler.get_scale() == 2.0**16  # no overflow, no back-off


def test_grad_scaler_overflow_skips_the_step_and_backs_off():
    batch = _tiny_advantage_batch(adv=1.0)
    model = HalfLM()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    hook = model.scale.register_hook(lambda grad: grad + float("inf"))  # an fp16 overflow, as the scaler sees it
    stats = _scaled_update(model, batch, scaler)
    assert stats.num_skipped == 1 and stats.num_steps == 0
    assert torch.equal(model.scale.detach(), torch.ones_like(model.scale)) and model.scale.grad is None
    assert scaler.get_scale() == 2.0**15  # the scaler's own back-off, once
    hook.remove()
    stats = _scaled_update(model, batch, scaler)  # the next update steps normally with the lowered scale
    assert stats.num_steps == 1 and stats.num_skipped == 0 and scaler.get_scale() == 2.0**15


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_logprobs_and_gradients_equal_the_plain_float32_computation(monkeypatch, dtype):
    # Chunks of 3 positions over (3, 7): uneven, and crossing no row boundary.
    B, Tc, V, T = 3, 7, 50, 0.7
    monkeypatch.setattr(grpo, "_LOGSOFTMAX_CHUNK", 3 * V)
    g = torch.Generator().manual_seed(1)
    leaf = (3 * torch.randn(B, Tc + 1, V, generator=g)).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (B, 2 + Tc), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # completion padding: zero log-prob, zero gradient
    model = lambda **kw: SimpleNamespace(logits=leaf[:, -kw["logits_to_keep"]:])  # noqa: E731
    weights = torch.randn(B, Tc, generator=g)
    ours = completion_logprobs(model, ids, mask, 2, temperature=T)
    (ours * weights).sum().backward()
    got_grad, leaf.grad = leaf.grad, None
    plain = torch.log_softmax(leaf[:, :-1].float() / T, -1).gather(-1, ids[:, 2:, None]).squeeze(-1)
    plain = torch.where(mask[:, 2:].bool(), plain, 0.0)
    (plain * weights).sum().backward()
    assert torch.allclose(ours, plain, atol=1e-6)
    assert got_grad.dtype == dtype and torch.allclose(got_grad.float(), leaf.grad.float(), atol=1e-6, rtol=1e-3)
    assert torch.all(got_grad[:, -1] == 0) and torch.all(got_grad[1, -3:-1] == 0)


def test_token_logprobs_equal_trls_selective_log_softmax():
    """TRL's `selective_log_softmax` is the well-kept reference; ours computes the same values and gradients
    without its full-size float32 copy of the logits (divided by the temperature) and their gradient."""
    from trl.trainer.utils import selective_log_softmax

    g = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(3, 9, 64, generator=g)).requires_grad_(True)
    ids = torch.randint(0, 64, (3, 8), generator=g)
    weights = torch.randn(3, 8, generator=g)
    ours = grpo._TokenLogprobs.apply(logits, ids, 0.7)  # positions 0..7 of the logits predict ids
    (ours * weights).sum().backward()
    ours_grad, logits.grad = logits.grad, None
    trl = selective_log_softmax(logits[:, :-1], ids, temperature=0.7)
    (trl * weights).sum().backward()
    assert torch.allclose(ours, trl, atol=1e-5)
    assert torch.allclose(ours_grad, logits.grad, atol=1e-6)


def test_micro_batches_skip_the_padding_every_row_has(monkeypatch):
    """Left columns before a micro-batch's first token and right columns after its longest completion are
    not run; the log-probs are the same as with them."""
    calls = []
    B, Tc, V = 4, 6, 40
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V, V, generator=g)

    def model(input_ids, attention_mask, position_ids, logits_to_keep):  # a bigram model: padding-free
        calls.append(input_ids.shape)
        return SimpleNamespace(logits=table[input_ids][:, -logits_to_keep:])

    ids = torch.randint(1, V, (B, 5 + Tc), generator=g)
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0  # rows 0-1: a shorter prompt (left padding)
    mask[:2, -4:] = 0  # and a completion 2 tokens long (right padding)
    full = completion_logprobs(model, ids, mask, Tc, micro_batch_size=B)
    split = completion_logprobs(model, ids, mask, Tc, micro_batch_size=2)
    assert calls == [(4, 11), (2, 4), (2, 11)]  # rows 0-1: columns 3..6 only
    assert torch.allclose(full, split) and torch.all(split[:2, 2:] == 0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dropping_zero_advantage_sequences_keeps_the_update(loss_type):
    # The trainer leaves out sequences whose advantage is 0 (beta = 0) and passes the whole
    # batch's denominators: the update must equal the one on the full batch.
    full = _update_batch()
    full.ref_logp = None
    full.advantages = torch.tensor([1.0, 0.0, -0.5, 0.0, 2.0, 0.0])
    keep = [0, 2, 4]
    part = GRPOBatch(full.input_ids[keep], full.attention_mask[keep], full.completion_mask[keep],
                     full.advantages[keep], num_sequences=6, num_items=int(full.completion_mask.sum()))
    cfg = UpdateConfig(loss_type=loss_type, max_grad_norm=None, max_completion_length=8, micro_batch_size=2)
    a, s_a = _run(full, cfg)
    b, s_b = _run(part, cfg)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7) and torch.allclose(p, q, atol=1e-7)
    assert s_b.loss == pytest.approx(s_a.loss, abs=1e-7)


def _engine_rollouts(policies, offsets):
    """Four sampled rollouts whose 'engine' log-probs are the training ones (temperature 1) plus ``offsets``."""
    from agonlib.generation import SamplingParams, generate

    rollouts = generate(policies, ["Add 2 and 3."] * 4, "A", [0, 1, 2, 3], SamplingParams(max_new_tokens=6),
                        progress=False)
    batch = grpo.build_batch(rollouts, torch.zeros(4), policies.tokenizer.pad_token_id, "cpu")
    with torch.no_grad(), policies.use("A"):
        train = grpo.batch_logprobs(policies.model, batch, 1.0)
    for r, lp, m, off in zip(rollouts, train, batch.completion_mask, offsets):
        r.extra.update(gen_logprobs=(lp[m.bool()] + off).tolist(), logprobs_mode="raw_logprobs")
    return rollouts


@pytest.mark.parametrize("correction", [False, True])
def test_update_role_weights_vllm_rollouts_only_when_asked(smoke_policies_scratch, correction):
    # Two groups of two. The engine found the first group's rows far less likely than training does (a
    # ratio of e^(tokens) > 3: masked when the correction is on) and scored the second group's alike (1).
    from agonlib.agon import RewardParts, update_role
    from agonlib.distributed import SingleProcess

    policies = smoke_policies_scratch
    config = policies.config.replace(vllm_importance_sampling_correction=correction, temperature=1.0)
    rollouts = _engine_rollouts(policies, offsets=[-1.0, -1.0, 0.0, 0.0])
    assert all(len(r.completion_ids) >= 2 for r in rollouts[:2])  # e^2 > 3: both masked
    cfg = UpdateConfig(max_grad_norm=None, share_prefix=False)
    start = [p.detach().clone() for p in policies.params("A")]

    def moved(rewards, cfg_config):
        for p, b in zip(policies.params("A"), start):
            p.data.copy_(b)
        parts = [RewardParts(correct=c, total=c) for c in rewards]
        stats = update_role(policies, "A", rollouts, parts, 2, torch.optim.SGD(policies.params("A"), lr=1.0), cfg,
                            cfg_config, SingleProcess())
        return stats, [p.detach() - b for p, b in zip(policies.params("A"), start)]

    stats, update = moved((1.0, 0.0, 1.0, 0.0), config)
    assert any(u.abs().max() > 0 for u in update)
    if not correction:
        assert "is_weight_mean" not in stats
        return
    assert stats["is_zeroed_frac"] == 0.5 and stats["is_weight_mean"] == pytest.approx(0.5, abs=1e-4)
    # The same update as when the first group has nothing to learn (equal rewards: advantage 0, row left out)
    # and the second group trains at weight 1, over the same 4 sequences.
    _, expected = moved((1.0, 1.0, 1.0, 0.0), config.replace(vllm_importance_sampling_correction=False))
    assert all(torch.allclose(u, e, atol=1e-6) for u, e in zip(update, expected))
    _, unweighted = moved((1.0, 0.0, 1.0, 0.0), config.replace(vllm_importance_sampling_correction=False))
    assert not all(torch.allclose(u, e, atol=1e-6) for u, e in zip(unweighted, expected))
