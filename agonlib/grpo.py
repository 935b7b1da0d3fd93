"""The GRPO loss, group advantages and one clipped, accumulated update (DESIGN.md §2, "GRPO loss").

Pure tensor logic: no model loading, no generation. The trainer calls `group_advantages` on each role's
rewards, `batch_logprobs` (adapters disabled) for the KL reference, then `grpo_update` once per role
per step with that role's adapter active. The reference is TRL 1.15 `GRPOTrainer._compute_loss`;
`tests/test_grpo.py` calls TRL's own code on the same batch and checks the loss, the gradient and the
logged KL and clip fractions agree to 1e-6.

Where this module departs from DESIGN.md §2, or from TRL, and what we follow:

1. KL importance correction (TRL differs from DESIGN's formula; we follow TRL). TRL 1.15 defaults to
   `use_bias_correction_kl=True`: the per-token k3 term `exp(ref-logp) - (ref-logp) - 1` is multiplied by
   the (differentiable) ratio `rho = exp(logp - old_logp)`. On-policy `rho == 1` in value, so the loss and
   the logged KL are unchanged, but the KL *gradient* changes (it becomes the unbiased reverse-KL
   gradient). `kl_ratio_correction=True` (default) matches TRL; `False` gives DESIGN's literal formula.
   Only matters when `beta > 0`.
2. bnpo under gradient accumulation (TRL differs from "one big batch"; we follow one big batch). TRL
   divides bnpo by the active tokens of each *micro-batch* and averages the micro-batches, so its
   gradient depends on how the batch is split. `grpo_update` divides by the active tokens of the whole
   role batch, so bnpo and dapo coincide here. Without accumulation (one micro-batch) they equal TRL's.
3. dapo normaliser (matches TRL, stated precisely). TRL divides each micro-batch's summed token loss by
   `num_items_in_batch / num_processes * gradient_accumulation_steps / steps_per_generation`, where
   `num_items_in_batch` counts the active completion tokens of the whole generation batch over all
   processes. With accumulation steps == steps_per_generation (TRL's default), DDP's gradient mean and
   the accumulated sum give `sum over every token / every active token` — what we compute (one process,
   one optimizer step per role batch).
4. grpo / dr_grpo under accumulation (matches TRL when micro-batches are equal). TRL divides each
   micro-batch loss by the number of accumulation steps; we divide by the whole batch's sequence count
   instead, which is exact also for a shorter last micro-batch.
5. dr_grpo constant: TRL uses the config's `max_completion_length` (the generation cap), not the padded
   width; pass `max_completion_length=max_new_tokens`. When omitted we fall back to the padded width.
6. Advantages (match TRL): group mean always; std unbiased (Bessel), per group (`"group"`) or over the
   whole role batch (`"batch"`, mean still per group); `eps=1e-4` added to the std; NaN rewards are left
   out of mean and std and get advantage 0.
7. Log-probs (match TRL up to float rounding): logits divided by the sampling temperature in float32,
   top-p/top-k ignored, as TRL does. We pass position ids built from the attention mask, like
   `generate` does for left-padded prompts; TRL passes none. For RoPE models this changes nothing
   but rounding (attention depends only on position differences); for absolute-position models ours
   is the correct one.
8. Defaults and logging: `loss_type="grpo"` as in `agonlib.config.Config` (TRL's default is "dapo").
   We log TRL's token-mean clip fractions (low/high/region), not its per-sequence low_min/high_max.
9. Shared prompt tokens run once (``agonlib.shared_prefix``, ``build_batch(share_prefix=True)``): rows that
   begin alike attend to one forward of their common tokens, whose backward runs once with their summed
   gradient. Same loss and gradient as one row at a time up to float rounding (tests/test_shared_prefix.py).
10. Not reproduced (all off by default in TRL): sequence-level importance sampling, two-sided `delta`
   clipping, entropy masking and bonus, off-policy sequence masking, and the cispo/sapo/luspo/vespo losses.
11. TRL's vLLM importance-sampling correction (`vllm_importance_sampling_correction`, mode `sequence_mask`,
   upper bound 3) is available (:func:`importance_weights`; the config keys of the same names) but **off by
   default**, where TRL 1.15 turns it on. Where vLLM generates, it weights each sequence's surrogate by
   exp(Σ train − vLLM log-prob of its tokens) and drops sequences above the bound. TRL reads vLLM's
   `processed_logprobs`, which with top-k/top-p are renormalised over the kept tokens while the training
   log-probs are not: each token's log-ratio is then the log of its kept mass, and a sequence's weight
   the product — about e^-40 for a 4,000-token trace keeping 0.99 a token — so under the colab/paper
   sampling (top_k 20, top_p 0.95, long thinking traces) long sequences would all but stop training. Our
   standalone engine returns `raw_logprobs`; turned on, the weights compare training and engine in the
   engine's own definition (temperature 1 for raw, the sampling temperature for processed, as
   `agonlib.generation.backends.logprob_mismatch` does): equal to TRL's where the engine returns
   processed log-probs, a pure numerical-mismatch ratio where it returns raw ones. Off, every sequence
   trains at weight 1 and the gap is logged (`<role>/logprob_mismatch_*`). Only vLLM rollouts carry
   log-probs: with transformers or the fast decoder the setting changes nothing, as in TRL.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence
from dataclasses import dataclass

import torch

from . import lean
from .shared_prefix import PrefixRun, share_prefixes

log = logging.getLogger(__name__)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
_LOGSOFTMAX_CHUNK = 1 << 24  # float32 elements per log-softmax chunk (64 MiB): the float32 working set


# --------------------------------------------------------------------------- log-probs


def _blocks(b: int, Tc: int, V: int):
    """(rows, positions) slices covering (b, Tc), each at most `_LOGSOFTMAX_CHUNK` elements of width V."""
    per = max(1, _LOGSOFTMAX_CHUNK // V)  # positions per chunk
    rows, cols = max(1, per // Tc), min(Tc, per)  # whole rows when they fit, else part of one row
    for r in range(0, b, rows):
        for c in range(0, Tc, cols):
            yield slice(r, r + rows), slice(c, min(c + cols, Tc))  # explicit stop: it offsets into logits


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T) at `ids`, in float32; logits (b, >Tc, V) in the model dtype, ids (b, Tc).

    Position Tc-1-j of `ids` is predicted by logits position -2-j (the last one predicts nothing).
    Forward and backward upcast one chunk of positions at a time (`_blocks`); the backward rebuilds
    the softmax from the saved (b, Tc) logsumexp and writes the gradient straight into one tensor
    of the logits' dtype. So no float32 (b, Tc, V) copy, nor its exp or gradient, ever exists: at
    colab's 4,097 x 151,936 one is 2.3 GiB, and the checkpointed autograd version peaked near 9 GiB.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        b, Tc = ids.shape
        start = logits.size(1) - Tc - 1  # 0 when the model kept exactly Tc + 1 positions
        out = torch.empty(b, Tc, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for r, c in _blocks(b, Tc, logits.size(-1)):
            z = logits[r, start + c.start : start + c.stop].float() / temperature  # one float32 chunk
            lse[r, c] = torch.logsumexp(z, dim=-1)
            out[r, c] = z.gather(-1, ids[r, c, None]).squeeze(-1) - lse[r, c]
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.start = temperature, start
        return out  # (b, Tc)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, ids, lse = ctx.saved_tensors
        T, start = ctx.temperature, ctx.start
        grad = torch.zeros_like(logits)  # positions that predict no completion token get no gradient
        for r, c in _blocks(*ids.shape, logits.size(-1)):
            g = grad_out[r, c, None].float() / T  # d/dlogits of log softmax(logits / T) = (onehot - p) / T
            p = logits[r, start + c.start : start + c.stop].float() / T  # a new float32 chunk: safe in place
            p.sub_(lse[r, c, None]).exp_().mul_(-g)
            p.scatter_add_(-1, ids[r, c, None], g)
            grad[r, start + c.start : start + c.stop] = p  # cast back to the logits' dtype
        return grad, None, None


def completion_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask_or_prompt_len: torch.Tensor | int,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    prefix: PrefixRun | None = None,
) -> torch.Tensor:
    """Per-token log-probs of the completion tokens under the model as it is (adapter switching is the caller's).

    `input_ids`/`attention_mask` are (B, T): a left-padded prompt followed by a right-padded completion.
    The completion is the last Tc columns, where Tc is the width of the (B, Tc) completion mask, or
    `T - prompt_len` when an int is given. Returns float32 (B, Tc), zero where the attention mask is zero.
    Differentiable when called with grad enabled; call under `torch.no_grad()` for old/reference log-probs.

    With ``prefix`` (:class:`~agonlib.shared_prefix.PrefixRun`), every row continues that one run of prompt tokens: the rows
    hold only what follows it, attend to its keys and values, and are positioned after it.
    """
    if isinstance(completion_mask_or_prompt_len, torch.Tensor):
        width = completion_mask_or_prompt_len.size(1)
    else:
        width = input_ids.size(1) - int(completion_mask_or_prompt_len)
    if not 0 <= width < input_ids.size(1):
        raise ValueError(f"completion width {width} must leave at least one prompt column of {input_ids.size(1)}.")
    B = input_ids.size(0)
    if width == 0:
        return torch.zeros(B, 0, device=input_ids.device)
    # Same positions as `generate` gives a left-padded prompt: count real tokens, pads get 0.
    before = 0 if prefix is None else prefix.length  # tokens of the shared prefix ahead of every row
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0) + before  # (B, T)
    step = micro_batch_size or B
    chunks = []
    for s in range(0, B, step):
        sl = slice(s, s + step)
        # Padding every row of this micro-batch has is skipped: the left columns before its first real token
        # and the right columns after its longest completion. They change nothing.
        first = min(int(attention_mask[sl].any(0).long().argmax()), input_ids.size(1) - width - 1)
        used = max(1, int(attention_mask[sl, -width:].sum(1).max()))  # completion columns this micro-batch fills
        stop = input_ids.size(1) - (width - used)
        mask, extra = attention_mask[sl, first:stop], {}
        if prefix is not None:
            mask = torch.cat([mask.new_ones(mask.size(0), before), mask], dim=1)  # (b, L + stop - first)
            extra = {"past_key_values": prefix.cache(mask.size(0)), "use_cache": True}
        # logits_to_keep: only the last used+1 positions go through the LM head; the last one predicts nothing.
        logits = model(
            input_ids=input_ids[sl, first:stop],
            attention_mask=mask,
            position_ids=position_ids[sl, first:stop],
            logits_to_keep=used + 1,
            **extra,
        ).logits  # (b, used+1, V), model dtype
        logp = _TokenLogprobs.apply(logits, input_ids[sl, stop - used : stop], temperature)  # (b, used)
        chunks.append(torch.nn.functional.pad(logp, (0, width - used)))  # (b, Tc)
    logp = torch.cat(chunks)  # (B, Tc)
    return torch.where(attention_mask[:, -width:].bool(), logp, 0.0)


# --------------------------------------------------------------------------- advantages


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased std ignoring NaNs; NaN where fewer than two values are present."""
    keep = ~torch.isnan(x)
    n = keep.sum() if dim is None else keep.sum(dim, keepdim=True)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim=dim, keepdim=True)
    sq = torch.where(keep, (x - mean) ** 2, torch.zeros_like(x))
    ss = sq.sum() if dim is None else sq.sum(dim, keepdim=True)
    var = torch.where(n > 1, ss / (n - 1).clamp(min=1), torch.full_like(ss, float("nan")))
    return var.sqrt()


def group_advantages(
    rewards, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """A_i = (r_i - mean_group) / (std + eps), flat (P*N,); groups are consecutive runs of `num_generations`.

    `rewards` is (P*N,) or (P, N). `scale_rewards`: "group" (unbiased std of the group), "batch" (unbiased
    std of all P*N rewards; the mean stays per group), "none" (no division). A group whose rewards are all
    equal gets advantage 0; a NaN reward (unscorable) is left out of its group's statistics and gets 0.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}.")
    r = torch.as_tensor(rewards)
    r = (r if r.is_floating_point() else r.float()).reshape(-1)  # (P*N,)
    if num_generations < 1 or r.numel() % num_generations:
        raise ValueError(f"{r.numel()} rewards do not split into groups of num_generations={num_generations}.")
    grouped = r.view(-1, num_generations)  # (P, N)
    adv = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).reshape(-1)  # (P*N,)
    # A lone value has std 0 (not NaN) so that its advantage is 0 / eps = 0.
    if scale_rewards == "group":
        std = _nanstd(grouped, dim=1).expand_as(grouped).reshape(-1) if num_generations > 1 else 0.0  # (P*N,)
        adv = adv / (std + eps)
    elif scale_rewards == "batch":
        adv = adv / ((_nanstd(r) if r.numel() > 1 else 0.0) + eps)
    return torch.nan_to_num(adv, nan=0.0)


# --------------------------------------------------------------------------- loss


@dataclass
class LossStats:
    """Token-weighted means over the active completion tokens of one `grpo_loss` call (TRL's logged names)."""

    kl: float | None  # mean per-token KL to the reference; None without ref_logp
    clip_low: float  # clip_ratio/low_mean: ratio < 1-eps on a negative advantage
    clip_high: float  # clip_ratio/high_mean: ratio > 1+eps_high on a positive advantage
    clip_region: float  # clip_ratio/region_mean: either
    num_tokens: int  # active tokens the means are over


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    num_sequences: int | None = None,
    kl_ratio_correction: bool = True,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped GRPO surrogate (+ beta * k3 KL), aggregated by `loss_type`. Tensors are (B, Tc); advantages (B,).

    `old_logp=None` means on-policy: the ratio is exp(logp - logp.detach()), as in TRL. For a slice of a
    larger batch pass the whole batch's `num_sequences` (grpo, dr_grpo) and `num_items_in_batch` (active
    tokens; bnpo, dapo): the slices' losses then sum to the whole batch's loss. `is_weights` ((B, 1) or
    (B, Tc), from :func:`importance_weights`) multiply the surrogate, not the KL term, as TRL does.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp: log-probs under the base model (adapters disabled).")
    mask = completion_mask.to(logp.dtype)  # (B, Tc)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1)
    old = logp.detach() if old_logp is None else old_logp
    eps_low, eps_high = epsilon, (epsilon if epsilon_high is None else epsilon_high)

    ratio = torch.exp(logp - old)  # (B, Tc)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, Tc)
    if is_weights is not None:  # vLLM's rollouts: TRL's importance-sampling correction (item 11)
        per_token = per_token * is_weights
    kl = None
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # (B, Tc), k3 estimator, >= 0
        if kl_ratio_correction:
            kl = kl * ratio
        if beta != 0.0:
            per_token = per_token + beta * kl

    n_seq = logp.size(0) if num_sequences is None else num_sequences
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n_seq
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (n_seq * (max_completion_length or logp.size(1)))
    else:  # bnpo, dapo: sum over tokens / active tokens of the (whole) batch
        n_items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).to(mask)
        loss = masked.sum() / n_items.clamp(min=1.0)

    with torch.no_grad():
        n_tok = mask.sum()
        tok_mean = lambda x: ((x.to(mask.dtype) * mask).sum() / n_tok.clamp(min=1.0)).item()  # noqa: E731
        low = (ratio < 1 - eps_low) & (adv < 0)
        high = (ratio > 1 + eps_high) & (adv > 0)
        stats = LossStats(
            kl=None if kl is None else tok_mean(kl),
            clip_low=tok_mean(low),
            clip_high=tok_mean(high),
            clip_region=tok_mean(low | high),
            num_tokens=int(n_tok.item()),
        )
    return loss, stats


def importance_weights(train_logp: torch.Tensor, sampling_logp: torch.Tensor, completion_mask: torch.Tensor,
                       mode: str = "sequence_mask", clip_min: float | None = None,
                       clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's vLLM importance-sampling weights: how much likelier the trained policy finds each sampled
    sequence (or token) than the engine that sampled it did. Tensors are (B, Tc).

    The log-ratio is ``train − sampling`` over the completion's tokens (a token the engine gave no
    log-prob for counts 0). ``sequence_*`` modes sum it over the sequence, giving (B, 1); ``token_*``
    keep (B, Tc). ``*_truncate`` clamps the ratio to [clip_min, clip_max]; ``*_mask`` sets it to 0
    outside. ``train_logp`` is the policy's log-prob at sampling time, in the definition of
    ``sampling_logp`` (TRL: both at the sampling temperature).

    >>> train, vllm = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]), torch.tensor([[-1.5, -1.0], [-2.0, -2.0]])
    >>> importance_weights(train, vllm, torch.ones(2, 2)).squeeze(1)  # e^0.5 kept, e^2 > 3 masked
    tensor([1.6487, 0.0000])
    """
    if mode not in ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate"):
        raise ValueError(f"unknown importance-sampling mode {mode!r}.")
    diff = torch.nan_to_num((train_logp.float() - sampling_logp.float()) * completion_mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


# --------------------------------------------------------------------------- update


@dataclass
class GRPOBatch:
    """One role's rollouts for one step, as the trainer hands them to `grpo_update`."""

    input_ids: torch.Tensor  # (B, T): left-padded prompt, then right-padded completion (last Tc columns)
    attention_mask: torch.Tensor  # (B, T)
    completion_mask: torch.Tensor  # (B, Tc): tokens that count in the loss
    advantages: torch.Tensor  # (B,)
    ref_logp: torch.Tensor | None = None  # (B, Tc) under the base (adapters disabled); needed when beta > 0
    old_logp: torch.Tensor | None = None  # (B, Tc) at sampling time; computed by grpo_update if needed
    # The generator's own log-probs of the sampled tokens (vLLM; NaN where it gave none), and the weights
    # update_role makes of them (generation.backends.engine_importance_weights): (B, 1) or (B, Tc).
    sampling_logp: torch.Tensor | None = None  # (B, Tc)
    is_weights: torch.Tensor | None = None
    # Denominators of the whole role batch when this batch holds only part of it (the trainer drops
    # sequences whose advantage is 0: with beta = 0 they add exactly 0 to the loss and the gradient).
    num_sequences: int | None = None  # grpo, dr_grpo; None = B
    num_items: int | None = None  # active completion tokens (bnpo, dapo); None = completion_mask.sum()
    # Shared-prefix layout (build_batch(share_prefix=True)): the rows of group g (contiguous) all begin with
    # prefixes[g], and input_ids holds only what follows it. None: input_ids holds the whole prompts.
    prefixes: list[torch.Tensor] | None = None  # (L_g,) token ids each
    group_sizes: list[int] | None = None  # rows of each group, in order; sums to B

    def groups(self):
        """``(prefix ids or None, rows)`` for each run of rows that shares a prefix (one run without one)."""
        if self.prefixes is None:
            yield None, slice(0, self.input_ids.size(0))
            return
        start = 0
        for ids, n in zip(self.prefixes, self.group_sizes):
            yield ids, slice(start, start + n)
            start += n

    def __post_init__(self):
        B, T = self.input_ids.shape
        Tc = self.completion_mask.size(1)
        if self.attention_mask.shape != (B, T) or self.completion_mask.size(0) != B or Tc >= T:
            raise ValueError(
                f"GRPOBatch shapes disagree: input_ids {tuple(self.input_ids.shape)}, attention_mask "
                f"{tuple(self.attention_mask.shape)}, completion_mask {tuple(self.completion_mask.shape)}; "
                "the completion must be the last Tc < T columns of input_ids."
            )
        if self.advantages.shape != (B,):
            raise ValueError(f"advantages must be ({B},), one per sequence; got {tuple(self.advantages.shape)}.")
        for name in ("ref_logp", "old_logp", "sampling_logp"):
            t = getattr(self, name)
            if t is not None and t.shape != (B, Tc):
                raise ValueError(f"{name} must be ({B}, {Tc}) like completion_mask; got {tuple(t.shape)}.")
        if self.is_weights is not None and self.is_weights.shape not in ((B, 1), (B, Tc)):
            raise ValueError(f"is_weights must be ({B}, 1) or ({B}, {Tc}); got {tuple(self.is_weights.shape)}.")
        if (self.prefixes is None) != (self.group_sizes is None) or (
                self.prefixes is not None and (len(self.prefixes) != len(self.group_sizes) or sum(self.group_sizes) != B)):
            raise ValueError(f"prefixes and group_sizes must come together, one prefix per group, groups summing to {B} rows.")


def build_batch(rollouts, advantages: torch.Tensor, pad_id: int, device, share_prefix: bool = False) -> GRPOBatch:
    """One role's rollouts as a :class:`GRPOBatch`: left-padded prompts, then right-padded completions.

    ``share_prefix``: consecutive rollouts whose prompts begin alike (``generation.layout.share_prefixes``: the
    drafts of one problem, or every row's system prompt and worked example) form a group whose common
    prompt tokens become the group's prefix, run once in training; the rows keep only the rest. The rows
    are reordered for it (by prompt, then by length within a group), the advantages with them.
    """
    if share_prefix:  # rows with like prompts side by side, so that the tokens they share can run once
        order = sorted(range(len(rollouts)), key=lambda i: rollouts[i].prompt_ids)
        rollouts, advantages = [rollouts[i] for i in order], advantages[order]
    prompts = [list(r.prompt_ids) for r in rollouts]
    group, shared = share_prefixes(prompts) if share_prefix else ([0] * len(prompts), [0])
    shared = [n if group.count(g) > 1 else 0 for g, n in enumerate(shared)]  # a row alone keeps its whole prompt
    if share_prefix:  # then, within a group, rows by length: a micro-batch of similar rows pads less
        order = sorted(range(len(rollouts)), key=lambda i: (group[i], len(prompts[i]) + len(rollouts[i].completion_ids)))
        rollouts, prompts, group = [rollouts[i] for i in order], [prompts[i] for i in order], [group[i] for i in order]
        advantages = advantages[order]
    cut = [shared[g] for g in group]  # prompt tokens of each row that its group's prefix holds
    Tp = max(len(p) - c for p, c in zip(prompts, cut))
    Tc = max(len(r.completion_ids) for r in rollouts)
    B = len(rollouts)
    input_ids = torch.full((B, Tp + Tc), pad_id, dtype=torch.long)
    attention = torch.zeros((B, Tp + Tc), dtype=torch.long)
    for i, (r, p, c0) in enumerate(zip(rollouts, prompts, cut)):
        p, c = p[c0:], len(r.completion_ids)
        input_ids[i, Tp - len(p) : Tp] = torch.tensor(p)
        input_ids[i, Tp : Tp + c] = torch.tensor(r.completion_ids)
        attention[i, Tp - len(p) : Tp + c] = 1
    sampling = None
    if any("gen_logprobs" in r.extra for r in rollouts):  # the generator's log-probs, row by row (vLLM)
        sampling = torch.full((B, Tc), math.nan)
        for i, r in enumerate(rollouts):
            values = r.extra.get("gen_logprobs", [])[:Tc]
            sampling[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
        sampling = sampling.to(device)
    prefixes = sizes = None
    if share_prefix:
        sizes = [group.count(g) for g in range(len(shared))]
        prefixes = [torch.tensor(prompts[group.index(g)][:n], dtype=torch.long, device=device)
                    for g, n in enumerate(shared)]
    # (B, Tp+Tc), (B, Tp+Tc), (B, Tc), (B,)
    return GRPOBatch(input_ids.to(device), attention.to(device), attention[:, Tp:].to(device), advantages.to(device),
                     sampling_logp=sampling, prefixes=prefixes, group_sizes=sizes)


def batch_logprobs(model, batch: GRPOBatch, temperature: float, rows: int | None = None) -> torch.Tensor:
    """:func:`completion_logprobs` of a whole batch, whatever its layout: (B, Tc); ``rows`` per forward."""
    out = []
    for ids, sl in batch.groups():
        prefix = None if ids is None or not ids.numel() else PrefixRun(model, ids)
        out.append(completion_logprobs(model, batch.input_ids[sl], batch.attention_mask[sl],
                                       batch.completion_mask[sl], temperature, rows, prefix=prefix))
    return torch.cat(out)


@dataclass
class UpdateConfig:
    """GRPO update settings; field names match `agonlib.config.Config` where they overlap."""

    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None = epsilon
    max_completion_length: int | None = None  # dr_grpo constant; pass max_new_tokens
    temperature: float = 1.0  # the sampling temperature
    num_iterations: int = 1  # optimizer steps on the same rollouts (mu)
    micro_batch_size: int | None = None  # sequences per forward/backward; None = the whole batch
    micro_batch_tokens: int | None = None  # padded tokens (rows x length) per forward/backward; None = no cap
    max_grad_norm: float | None = 1.0  # None = no clipping (the norm is still measured)
    kl_ratio_correction: bool = True  # TRL's use_bias_correction_kl
    share_prefix: bool = True  # read by agon.update_role: prompt tokens rows share run once (build_batch)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}.")
        if self.beta < 0 or self.epsilon <= 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError("beta must be >= 0, epsilon > 0 and epsilon_high (if set) >= 0.")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the sampling temperature), got {self.temperature}.")
        if self.num_iterations < 1 or any(v is not None and v < 1 for v in (self.micro_batch_size, self.micro_batch_tokens)):
            raise ValueError("num_iterations, micro_batch_size and micro_batch_tokens must be >= 1 (None: no cap).")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (no clipping), got {self.max_grad_norm}.")

    def rows_per_micro_batch(self, batch: int, length: int) -> int:
        """Sequences per forward/backward for a ``(batch, length)`` padded batch: both caps, at least one row."""
        rows = self.micro_batch_size or batch
        if self.micro_batch_tokens is not None:
            rows = min(rows, self.micro_batch_tokens // length)
        return max(1, rows)


@dataclass
class UpdateStats:
    """What one `grpo_update` did. Loss/KL/clip/grad_norm are means over the optimizer steps taken (NaN if none)."""

    loss: float
    kl: float | None
    clip_low: float
    clip_high: float
    clip_region: float
    grad_norm: float  # before clipping
    num_steps: int  # optimizer steps taken
    num_skipped: int  # steps skipped for a non-finite loss or gradient norm


def grpo_update(
    model, batch: GRPOBatch, params: Sequence[torch.nn.Parameter], optimizer, cfg: UpdateConfig, sync=None,
    scaler: torch.amp.GradScaler | None = None,
) -> UpdateStats:
    """`cfg.num_iterations` optimizer steps on one role's batch, each over all its micro-batches.

    The active adapter of `model` is the one trained; `params` are its parameters (the optimizer's).
    Micro-batches are scaled so each step's gradient equals the one-big-batch gradient for every loss
    type. A step whose loss or gradient norm is not finite is skipped: gradients dropped, no optimizer
    step, counted in `num_skipped` and logged. Old log-probs, when `num_iterations > 1` and the batch
    carries none, are the first step's own log-probs (on-policy, the ratio is 1 there), kept for the
    later steps: no separate forward pass.

    A batch in the shared-prefix layout (``build_batch(share_prefix=True)``) runs each group's prefix
    forward once per step, its micro-batches attend to it, and its backward runs once after theirs
    (:class:`PrefixRun`); micro-batches never span two groups.

    ``sync(params, finite) -> finite`` (data parallelism, ``agonlib.distributed``) runs once per
    optimizer step after the last backward pass, on every rank: it sums the gradients over ranks and
    says whether every rank's loss was finite, so the norm, the clipping and the skip decision are
    the same everywhere.

    ``scaler`` (a ``torch.amp.GradScaler``, for a model that runs in fp16): each micro-batch loss is
    scaled before its backward pass, so that small gradients survive the fp16 layers instead of
    flushing to zero; the gradients are unscaled before the norm is measured and clipped. A step
    with a non-finite norm is skipped as above, and the scaler, told of the overflow by its own
    ``unscale_``, lowers its scale; ``scaler.step`` runs only on the steps taken. The logged loss
    and norm are unscaled. ``None`` (fp32, bf16): no scaling.
    """
    if cfg.beta != 0.0 and batch.ref_logp is None:
        raise ValueError("beta > 0 needs batch.ref_logp: batch_logprobs with the adapters disabled.")
    params = list(params)
    B, Tc = batch.completion_mask.shape
    step = cfg.rows_per_micro_batch(B, batch.input_ids.size(1))
    n_items = batch.completion_mask.sum() if batch.num_items is None else batch.num_items  # active tokens
    n_seqs = B if batch.num_sequences is None else batch.num_sequences
    # Old log-probs (num_iterations > 1) are the first iteration's own log-probs, kept: no extra pass.
    old_logp = batch.old_logp
    capture = old_logp is None and cfg.num_iterations > 1  # until a step has been taken (a skipped one changes nothing)
    if capture:
        old_logp = torch.zeros(B, Tc, device=batch.completion_mask.device)

    taken: list[tuple[float, float, LossStats]] = []
    skipped = 0
    for it in range(cfg.num_iterations):
        _drop_grads(params, optimizer)
        total, parts, finite = 0.0, [], True
        for ids, rows in batch.groups():
            prefix = None if ids is None or not ids.numel() else PrefixRun(model, ids)  # once per group
            for start in range(rows.start, rows.stop, step):
                sl = slice(start, min(start + step, rows.stop))
                logp = completion_logprobs(model, batch.input_ids[sl], batch.attention_mask[sl],
                                           batch.completion_mask[sl], cfg.temperature, prefix=prefix)  # (b, Tc)
                if capture:
                    old_logp[sl] = logp.detach()
                old = None if old_logp is None or capture else old_logp[sl]  # None: on-policy
                ref = None if batch.ref_logp is None else batch.ref_logp[sl]
                loss, st = grpo_loss(
                    logp, old, ref, batch.advantages[sl],
                    batch.completion_mask[sl], beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                    loss_type=cfg.loss_type, max_completion_length=cfg.max_completion_length,
                    num_items_in_batch=n_items, num_sequences=n_seqs, kl_ratio_correction=cfg.kl_ratio_correction,
                    is_weights=None if batch.is_weights is None else batch.is_weights[sl],
                )
                if not torch.isfinite(loss):
                    finite = False
                    del logp, loss  # this micro-batch's graph, and (below) the prefix's: nothing flows back
                    break
                lean.release_free_memory(loss.device)  # the forward's freed temporaries: not under the backward's peak
                (loss if scaler is None else scaler.scale(loss)).backward()
                total += loss.item()
                parts.append(st)
            if finite and prefix is not None:
                prefix.backward()  # every row's gradient through the shared prompt tokens, in one pass
            prefix = None
            if not finite:
                break
        if sync is not None:
            finite = sync(params, finite)
        grads = [p.grad for p in params if p.grad is not None]
        # Only gradients of a finite loss are unscaled (the scaler needs some to record an overflow check).
        scaled = scaler is not None and finite and bool(grads)
        if scaled:  # true gradients for the norm and the clipping; records any overflow
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        if not finite or not torch.isfinite(norm):
            _drop_grads(params, optimizer)
            skipped += 1
            log.warning("grpo_update: skipped step (iteration %d): loss %s, grad norm %s%s", it,
                        "non-finite" if not finite else f"{total:.4g}", f"{norm.item():.4g}",
                        "" if scaler is None else f" (fp16 loss scale {scaler.get_scale():g})")
            if scaled:
                scaler.update()  # an overflow: the scale backs off (and unscale_ wants one update per step)
            continue
        if cfg.max_grad_norm is not None and grads:
            torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, norm)
        if scaled:
            scaler.step(optimizer)  # the norm is finite, so the scaler found no overflow and steps
            scaler.update()
        else:
            optimizer.step()
        taken.append((total, norm.item(), _merge(parts)))
        capture = False

    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    kls = [s.kl for _, _, s in taken if s.kl is not None]
    return UpdateStats(
        loss=mean([t[0] for t in taken]),
        kl=mean(kls) if kls else None,
        clip_low=mean([s.clip_low for _, _, s in taken]),
        clip_high=mean([s.clip_high for _, _, s in taken]),
        clip_region=mean([s.clip_region for _, _, s in taken]),
        grad_norm=mean([t[1] for t in taken]),
        num_steps=len(taken),
        num_skipped=skipped,
    )


def _merge(parts: list[LossStats]) -> LossStats:
    """Token-weighted merge of micro-batch stats into the whole batch's."""
    n = sum(p.num_tokens for p in parts)
    w = lambda f: sum(getattr(p, f) * p.num_tokens for p in parts) / max(n, 1)  # noqa: E731
    has_kl = parts and parts[0].kl is not None
    return LossStats(w("kl") if has_kl else None, w("clip_low"), w("clip_high"), w("clip_region"), n)


def _drop_grads(params: list[torch.nn.Parameter], optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    for p in params:  # also those the optimizer does not hold
        p.grad = None
