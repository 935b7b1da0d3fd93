"""Shared-prefix training (issue 14, item 1) is exact: the same log-probs and adapter gradients as one row at a time.

Rows built like a real step's: one role's prompts share a system prompt and worked example, the drafts of
one problem their whole prompt; completions of different lengths, left padding, micro-batches inside a
group. fp32; the shared and the unshared computation agree to 1e-5 relative on the tiny Qwen3 and on
SmolLM2-135M (slow).
"""

from __future__ import annotations

import pytest
import torch

from agonlib.generation import Rollout
from agonlib.grpo import GRPOBatch, UpdateConfig, batch_logprobs, build_batch, grpo_update
from agonlib.shared_prefix import PrefixRun, shares_prefix_exactly


def _rollouts(vocab: int, seed: int = 0) -> list[Rollout]:
    """Two problems x 3 drafts (same prompt), two challenges (own middle) over one opening, one row alone."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(5, vocab - 5, (n,), generator=g).tolist()
    opening = ids(40)  # system prompt + worked example
    prompts = [opening + ids(12)] * 3 + [opening + ids(9)] * 3 + [opening + ids(20) + ids(7), opening + ids(15)]
    prompts.append(ids(25))  # shares nothing: its whole prompt stays in its row
    return [Rollout(prompt="", prompt_ids=p, completion_ids=ids(n), text="", think="", summary="", answer=None,
                    length=n, truncated=False, seed=0)
            for p, n in zip(prompts, (6, 9, 0, 8, 8, 5, 7, 4, 6))]  # one empty completion


def _grads(policies, batch: GRPOBatch, cfg: UpdateConfig) -> list[torch.Tensor]:
    params = policies.params("A")
    opt = torch.optim.SGD(params, lr=0.0)  # the step changes nothing: we read the gradients it left
    with policies.use("A"):
        policies.model.train()
        grpo_update(policies.model, batch, params, opt, cfg)
        policies.model.eval()
    return [p.grad.detach().clone() for p in params]


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return bool((a - b).norm() <= rel * max(b.norm(), 1e-12))


def _check(policies, micro_batch_size, num_iterations=1, beta=0.0):
    model = policies.model
    gen = torch.Generator().manual_seed(0)  # the same adapter whichever tests ran before
    with torch.no_grad():  # non-zero B so that the adapter changes what the prompt tokens compute
        for p in policies.params("A"):
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    rollouts = _rollouts(policies.tokenizer.vocab_size)
    adv = torch.linspace(-1.5, 1.2, len(rollouts))
    pad = policies.tokenizer.pad_token_id
    shared = build_batch(rollouts, adv, pad, "cpu", share_prefix=True)
    order = [adv.tolist().index(a) for a in shared.advantages.tolist()]  # its rows, reordered within groups
    plain = build_batch([rollouts[i] for i in order], adv[order], pad, "cpu")
    assert shared.prefixes is not None and len(shared.prefixes) < len(rollouts)  # something is shared
    assert shared.input_ids.size(1) < plain.input_ids.size(1)  # and the rows got shorter
    assert shares_prefix_exactly(model)

    with torch.no_grad(), policies.use("A"):
        lp_plain = batch_logprobs(model, plain, 0.8)
        lp_shared = batch_logprobs(model, shared, 0.8, rows=2)
    assert lp_plain.shape == lp_shared.shape
    assert torch.allclose(lp_shared, lp_plain, atol=1e-5, rtol=1e-5)

    if beta:  # the reference pass (adapters off) through each layout
        with torch.no_grad(), policies.use(None):
            plain.ref_logp, shared.ref_logp = batch_logprobs(model, plain, 0.8), batch_logprobs(model, shared, 0.8)
        assert torch.allclose(shared.ref_logp, plain.ref_logp, atol=1e-5, rtol=1e-5)
    cfg = UpdateConfig(temperature=0.8, max_grad_norm=None, micro_batch_size=micro_batch_size, beta=beta,
                       num_iterations=num_iterations)
    g_plain = _grads(policies, plain, cfg)
    g_shared = _grads(policies, shared, cfg)
    assert any(g.abs().sum() > 0 for g in g_plain)
    # The adapter gradient as a whole within 1e-5 (the bound), and no tensor of it far off. Tensor by
    # tensor, the smallest gradients carry float32 rounding at ~1e-5 of their norm: SmolLM2's 420 tensors
    # measured up to 1.14e-5 apart on a 2-core AVX-512 Xeon (the whole: 3.7-4.5e-6, five seeds), under 1e-5 on
    # an AVX2 EPYC.
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    assert _close(flat(g_shared), flat(g_plain)), (flat(g_shared) - flat(g_plain)).norm() / flat(g_plain).norm()
    for a, b in zip(g_shared, g_plain):
        assert _close(a, b, rel=3e-5), (a - b).norm() / b.norm()


@pytest.mark.parametrize("micro_batch_size, num_iterations, beta", [(None, 1, 0.0), (2, 1, 0.0), (3, 2, 0.1)])
def test_shared_prefix_gives_the_unshared_logprobs_and_gradients(smoke_policies_scratch, micro_batch_size,
                                                                  num_iterations, beta):
    _check(smoke_policies_scratch, micro_batch_size, num_iterations, beta)


@pytest.mark.slow
def test_shared_prefix_gradients_on_smollm2(smol_policies_scratch):
    _check(smol_policies_scratch, 3)


def test_a_gradient_through_the_prefix_is_not_lost(smoke_policies_scratch):
    """Without the prefix's own backward pass the gradients differ: the test above can fail."""
    policies = smoke_policies_scratch
    rollouts = _rollouts(policies.tokenizer.vocab_size, seed=1)
    adv = torch.linspace(-1.0, 1.0, len(rollouts))
    batch = build_batch(rollouts, adv, policies.tokenizer.pad_token_id, "cpu", share_prefix=True)
    cfg = UpdateConfig(max_grad_norm=None)
    full = _grads(policies, batch, cfg)

    original = PrefixRun.backward
    PrefixRun.backward = lambda self: None
    try:
        cut = _grads(policies, batch, cfg)
    finally:
        PrefixRun.backward = original
    assert any(not _close(a, b, 1e-3) for a, b in zip(cut, full))


class _KeptGraphPrefix(PrefixRun):
    """The prefix as it ran before: the first forward's graph kept until :meth:`backward`."""

    def __init__(self, model, ids):
        super().__init__(model, ids)
        self._outputs = self._run()  # with the graph
        self._leaves = [t.detach().float().requires_grad_(t.requires_grad) for t in self._outputs]

    def backward(self):
        pairs = [(o, leaf.grad.to(o.dtype)) for o, leaf in zip(self._outputs, self._leaves) if leaf.grad is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_prefix_run_again_for_its_backward_gives_the_kept_graph_s_gradient(dtype, monkeypatch):
    # The prefix's activations are not held while its rows run: bit for bit the gradient a kept graph gives.
    from agonlib import load_config, load_policies

    policies = load_policies(load_config("smoke", device="cpu", dtype=dtype))
    with torch.no_grad():
        for p in policies.params("A"):
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    batch = build_batch(_rollouts(policies.tokenizer.vocab_size), torch.linspace(-1.5, 1.2, 9),
                        policies.tokenizer.pad_token_id, "cpu", share_prefix=True)
    cfg = UpdateConfig(max_grad_norm=None, micro_batch_size=2)
    again = _grads(policies, batch, cfg)
    monkeypatch.setattr("agonlib.grpo.PrefixRun", _KeptGraphPrefix)
    kept = _grads(policies, batch, cfg)
    assert any(g.abs().sum() > 0 for g in kept)
    for a, b in zip(again, kept):
        assert torch.equal(a, b), (a - b).norm() / b.norm()


def test_the_prefix_s_backward_runs_under_its_own_adapter(smoke_policies_scratch):
    policies = smoke_policies_scratch
    ids = torch.tensor([5, 6, 7, 8])
    with policies.use("A"):
        prefix = PrefixRun(policies.model, ids)
        sum(leaf.sum() for leaf in prefix._leaves).backward()
    with policies.use("B"), pytest.raises(RuntimeError, match="under adapter 'B'; its forward ran under 'A'"):
        prefix.backward()


def test_rows_are_grouped_by_their_shared_prompt(smoke_policies):
    rollouts = _rollouts(smoke_policies.tokenizer.vocab_size)
    batch = build_batch(rollouts, torch.ones(len(rollouts)), 0, "cpu", share_prefix=True)
    assert sum(batch.group_sizes) == len(rollouts)
    rebuilt = []  # each row = its group's prefix + what the batch keeps; rows reordered within their group only
    for ids, rows in batch.groups():
        rebuilt += [ids.tolist() + batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
                    for i in range(rows.start, rows.stop)]
    assert sorted(rebuilt) == sorted(r.prompt_ids + r.completion_ids for r in rollouts)
    lengths = [len(x) for x in rebuilt]
    for _, rows in batch.groups():  # shortest first within a group
        assert lengths[rows] == sorted(lengths[rows])
    with pytest.raises(ValueError, match="prefixes and group_sizes"):
        GRPOBatch(batch.input_ids, batch.attention_mask, batch.completion_mask, batch.advantages,
                  prefixes=batch.prefixes, group_sizes=None)


def test_dropout_turns_sharing_off(smoke_policies):
    assert shares_prefix_exactly(smoke_policies.model)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    assert not shares_prefix_exactly(model)


def test_a_row_that_shares_nothing_keeps_its_whole_prompt():
    rows = [Rollout(prompt="", prompt_ids=list(range(s, s + 30)), completion_ids=[7, 8], text="", think="",
                    summary="", answer=None, length=2, truncated=False, seed=0) for s in (100, 300)]
    batch = build_batch(rows, torch.tensor([1.0, -1.0]), 0, "cpu", share_prefix=True)
    assert [p.numel() for p in batch.prefixes] == [0, 0]  # no forward of its own for a prefix nobody shares
    assert batch.input_ids.size(1) == 32 and batch.attention_mask.sum() == 64
