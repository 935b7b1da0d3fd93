"""Agon — the paper's method in one file: the round, the rewards, the per-role update (DESIGN.md §2).

Read with ``grpo.py`` (the loss) and you have the whole method. Where each step lives:

1. Roles ............ :func:`roles_for_step` — ``rotate``: A drafts on odd (1-based) steps; ``fixed``: A always.
2. Draft ............ :func:`play_round` — ``N`` drafts per problem under the drafter, rewarded ``c(a)``.
3. Summarise ........ ``Rollout.summary`` (:func:`agonlib.parsing.split_completion`): final text without
                      boxes or final-answer sentences, the answer masked (a fallback for unboxed drafts).
4. Challenge ........ :func:`play_round` — one paired challenge per draft: the challenge prompt with the
                      summary (exchange), or the drafter's own prompt (rival hidden); its own token cap.
5. Rewards .......... :func:`competitive_reward`, :func:`cooperative_reward`, :func:`drafter_reward`.
6. Advantages ....... :func:`agonlib.grpo.group_advantages`, per problem and per role (:func:`update_role`).
7. Update ........... :func:`update_role` per role, each adapter with its own optimizer; :func:`agon_step`.
In ``mode: grpo`` a round is drafts only (``N`` or compute-matched ``2N``) under adapter ``A``.

Departures from DESIGN.md §2, all deliberate:

1. A role whose advantages are all zero (every group all-right or all-wrong) with ``beta = 0`` has a
   loss of exactly zero: its forward/backward pass is skipped, but the optimizer still steps
   (``num_iterations`` times) with zero gradients, so AdamW's moments evolve exactly as in TRL.
   Its clip fraction is logged as 0.
2. With ``beta = 0``, sequences whose advantage is exactly zero add exactly zero to every loss type's
   value and gradient, so they are left out of the forward/backward pass; the loss keeps the whole
   batch's denominators (sequences and tokens), so the update equals TRL's on the full batch. The
   logged clip fraction is over the kept tokens only, so it reads higher than TRL's.
3. KL to the base is computed (and logged) only when ``beta > 0``.
4. Generation stops at the first complete answer box (``stop_at_answer``, DESIGN.md §2 step 4; with thinking,
   at the first complete box after ``</think>``); the challenger has its own token cap
   (``challenger_max_new_tokens``), and with ``loss_type: dr_grpo`` its loss divides by that cap.
5. ``summary_mask: derived`` / ``stated`` (``stated``: the cpu profile's) also mask numbers the question does not state.

Grading goes through the graders evaluation uses: reward and accuracy cannot disagree.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import torch

from . import metrics, prompts
from .generation import GenerationStats, Rollout, SamplingParams, generate, sample_seed
from .generation.backends import engine_importance_weights, logprob_mismatch
from .grading import grade_code, grade_math_batch
from .grpo import batch_logprobs, build_batch, group_advantages, grpo_update
from .metrics import bit, leaks, same_length
from .shared_prefix import shares_prefix_exactly

CHALLENGER_MODES = ("competitive", "cooperative")


# --- 1. roles ------------------------------------------------------------------------------------

def roles_for_step(step: int, roles: str = "rotate", mode: str = "agon") -> tuple[str, str | None]:
    """``(drafter, challenger)`` for 1-based ``step`` (DESIGN's ``t = step − 1``: A drafts on even ``t``)."""
    if mode == "grpo":
        return "A", None
    if roles == "fixed" or step % 2 == 1:
        return "A", "B"
    return "B", "A"


# --- 5. rewards ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RewardParts:
    """One rollout's reward split into its (already weighted) terms; ``total`` is their sum."""

    correct: float
    conversion: float = 0.0
    tiebreak: float = 0.0
    total: float = 0.0

    def __post_init__(self) -> None:
        expected = self.correct + self.conversion + self.tiebreak
        if not math.isclose(self.total, expected, abs_tol=1e-12):
            raise ValueError(f"RewardParts.total ({self.total}) must equal correct + conversion + tiebreak ({expected}).")

    @classmethod
    def of(cls, correct: float, conversion: float = 0.0, tiebreak: float = 0.0) -> RewardParts:
        return cls(float(correct), float(conversion), float(tiebreak), float(correct + conversion + tiebreak))

    def as_dict(self) -> dict:
        return asdict(self)


def drafter_reward(c_a) -> RewardParts:
    """``r^D = c(a)``: a plain GRPO update on correctness (also vanilla GRPO's reward)."""
    return RewardParts.of(bit(c_a, "c_a"))


grpo_reward = drafter_reward


def competitive_reward(c_b, c_a, len_b=None, len_a=None, *, lambda_conv: float = 1.0,
                       lambda_len: float = 0.0) -> RewardParts:
    """``c(b) + λ_conv·c(b)·(1−c(a)) + λ_len·c(b)·c(a)·[len(b) < len(a)]``.

    >>> competitive_reward(1, 0).as_dict()
    {'correct': 1.0, 'conversion': 1.0, 'tiebreak': 0.0, 'total': 2.0}
    >>> competitive_reward(1, 1, 30, 40, lambda_len=0.1).tiebreak
    0.1
    """
    b, a = bit(c_b, "c_b"), bit(c_a, "c_a")
    tiebreak = 0.0
    if lambda_len != 0 and b and a:
        if len_b is None or len_a is None:
            raise ValueError("competitive_reward needs len_b and len_a when lambda_len != 0 (the length tiebreak).")
        tiebreak = lambda_len * float(len_b < len_a)
    return RewardParts.of(b, lambda_conv * b * (1 - a), tiebreak)


def cooperative_reward(c_b, c_a=None, len_b=None, len_a=None, *, lambda_conv: float = 1.0,
                       lambda_len: float = 0.0) -> RewardParts:
    """``c(b)``: the competitive bonus removed (same signature, the other arguments ignored)."""
    return RewardParts.of(bit(c_b, "c_b"))


def challenger_reward(mode: str, c_b, c_a, len_b=None, len_a=None, *, lambda_conv: float = 1.0,
                      lambda_len: float = 0.0) -> RewardParts:
    """The challenger reward of ``mode`` (``competitive`` | ``cooperative``)."""
    if mode not in CHALLENGER_MODES:
        raise ValueError(f"Unknown challenger reward mode {mode!r}; use one of {', '.join(CHALLENGER_MODES)}.")
    fn = competitive_reward if mode == "competitive" else cooperative_reward
    return fn(c_b, c_a, len_b, len_a, lambda_conv=lambda_conv, lambda_len=lambda_len)


def drafter_group_rewards(c_a: Sequence) -> list[RewardParts]:
    return [drafter_reward(c) for c in c_a]

def challenger_group_rewards(mode: str, c_b: Sequence, c_a: Sequence, len_b: Sequence | None = None,
                             len_a: Sequence | None = None, *, lambda_conv: float = 1.0,
                             lambda_len: float = 0.0) -> list[RewardParts]:
    """:func:`challenger_reward` over a group; entry ``i`` pairs ``b_i`` with ``a_i``."""
    n = same_length(c_b=c_b, c_a=c_a, len_b=len_b, len_a=len_a)
    lb, la = len_b or [None] * n, len_a or [None] * n
    return [challenger_reward(mode, c_b[i], c_a[i], lb[i], la[i], lambda_conv=lambda_conv, lambda_len=lambda_len)
            for i in range(n)]


def totals(parts: Sequence[RewardParts]) -> list[float]:
    """The scalar rewards GRPO sees, one per rollout."""
    return [p.total for p in parts]


# --- 2–4. the round --------------------------------------------------------------------------------

def grade(rollouts: list[Rollout], problems: list[dict], config) -> list[int]:
    """0/1 correctness of each rollout against its problem (``problems`` aligned with ``rollouts``)."""
    if config.task == "code":
        return [grade_code(r.text, p["tests"], time_limit_s=config.code_time_limit_s, thinking=config.thinking)
                for r, p in zip(rollouts, problems)]
    return grade_math_batch([r.text for r in rollouts], [str(p["answer"]) for p in problems],
                            thinking=config.thinking, timeout_s=config.grade_timeout_s)


@dataclass
class Round:
    step: int
    drafter: str
    challenger: str | None
    problems: list[dict]  # P problems
    drafts: list[Rollout]  # P*G drafts, problem-major: drafts[p*G + g]
    c_draft: list[int]
    r_draft: list[RewardParts]
    challenges: list[Rollout] = field(default_factory=list)  # challenges[i] answers drafts[i]
    c_challenge: list[int] = field(default_factory=list)
    r_challenge: list[RewardParts] = field(default_factory=list)
    summaries: list[str] = field(default_factory=list)  # what each challenger read (prompts.challenge_summary)
    leaked: list[bool] = field(default_factory=list)
    summary_tokens: list[int] = field(default_factory=list)
    draft_generation: GenerationStats = field(default_factory=GenerationStats)
    challenge_generation: GenerationStats = field(default_factory=GenerationStats)
    grade_seconds: float = 0.0

    @property
    def group_size(self) -> int:
        return len(self.drafts) // max(1, len(self.problems))

    def metrics(self) -> dict:
        return metrics.round_metrics(self)


def play_round(policies, problems: list[dict], step: int, config=None, *, progress: bool = True,
               backend=None, problem_offset: int = 0) -> Round:
    """Draft, grade, summarise, challenge, grade, reward (steps 1–5).

    ``backend`` samples (``agonlib.backends``; default the transformers path). ``problem_offset``: the
    index of ``problems[0]`` in the step's whole list, so a data-parallel rank seeds as one process does.
    """
    config = config or policies.config
    if backend is not None:
        backend.begin_step(step)
    gen = backend.generate if backend is not None else functools.partial(generate, policies)
    tok, task, thinking = policies.tokenizer, config.task, config.thinking
    drafter, challenger = roles_for_step(step, config.roles, config.mode)
    G = config.generations_per_problem
    stats = (GenerationStats(), GenerationStats())  # drafts, challenges
    sampling = dict(thinking=thinking, task=task, max_prompt_tokens=config.max_prompt_tokens, progress=progress,
                    entropy=True)  # the monitoring's token entropy (the same draws either way)
    seeds = lambda role: [sample_seed(config.seed, step, problem_offset + i // G, i % G, role)  # noqa: E731
                          for i in range(len(problems) * G)]

    draft_text = [prompts.render(tok, prompts.draft_prompt(p["question"], task), thinking) for p in problems]
    drafts = gen([draft_text[i // G] for i in range(len(problems) * G)], drafter, seeds("draft"),
                 params=SamplingParams.from_config(config), desc=f"step {step}: drafts ({drafter})",
                 stats=stats[0], **sampling)
    paired = [problems[i // G] for i in range(len(drafts))]  # the problem of each rollout
    start = time.perf_counter()
    c_draft = grade(drafts, paired, config)
    rnd = Round(step, drafter, challenger, problems, drafts, c_draft, drafter_group_rewards(c_draft),
                draft_generation=stats[0], challenge_generation=stats[1], grade_seconds=time.perf_counter() - start)
    if config.mode == "grpo":
        return rnd

    rnd.summaries = [prompts.challenge_summary(d.summary, p["question"], config) for d, p in zip(drafts, paired)]
    if config.exchange:  # the summaries as shown: a prompt over the budget drops the start of its summary
        challenge_text, rnd.summaries = prompts.challenge_texts(tok, [p["question"] for p in paired], rnd.summaries,
                                                                config.reward, task, thinking, config.max_prompt_tokens)
    else:  # rival hidden: the challenger sees exactly the drafter's prompt
        challenge_text = [draft_text[i // G] for i in range(len(drafts))]
    rnd.challenges = gen(challenge_text, challenger, seeds("challenge"),
                         params=SamplingParams.from_config(config, role="challenger"),
                         desc=f"step {step}: challenges ({challenger})", stats=stats[1], **sampling)
    start = time.perf_counter()
    rnd.c_challenge = grade(rnd.challenges, paired, config)
    rnd.grade_seconds += time.perf_counter() - start
    rnd.r_challenge = challenger_group_rewards(
        config.reward, rnd.c_challenge, c_draft, [c.length for c in rnd.challenges], [d.length for d in drafts],
        lambda_conv=config.lambda_conv, lambda_len=config.lambda_len)
    rnd.leaked = [leaks(s, p.get("answer"), p["question"]) for s, p in zip(rnd.summaries, paired)]
    rnd.summary_tokens = [len(tok(s, add_special_tokens=False)["input_ids"]) for s in rnd.summaries]
    return rnd


# --- 6–7. advantages and the per-role update --------------------------------------------------------

def update_role(policies, adapter: str, rollouts, parts, group: int, optimizer, update_cfg, config, dp,
                scaler=None) -> dict:
    """One GRPO update of ``adapter`` on its role's rollouts: group advantages, then ``grpo_update``."""
    adv = group_advantages(torch.tensor(totals(parts), dtype=torch.float32), group, config.scale_rewards)  # (B,)
    learns = dp.any(bool(adv.abs().gt(0).any()))  # every rank takes the same branch: collectives pair up
    if config.beta == 0 and not learns:
        for _ in range(config.num_iterations):  # departure 1: zero loss, the moments still step
            for p in policies.params(adapter):
                p.grad = torch.zeros_like(p)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "skipped_zero_adv": 1}
    keep = [i for i in range(len(rollouts)) if adv[i] != 0 or config.beta > 0]  # departure 2
    keep = keep or [0]  # data parallel, nothing to learn on this rank: a zero-advantage row adds exactly 0
    keep.sort(key=lambda i: len(rollouts[i].prompt_ids))  # micro-batches of similar lengths pad less
    batch = build_batch([rollouts[i] for i in keep], adv[keep], policies.tokenizer.pad_token_id, policies.device,
                        share_prefix=update_cfg.share_prefix and shares_prefix_exactly(policies.model))
    # The whole step's denominators (summed over data-parallel ranks).
    batch.num_sequences, batch.num_items = dp.sum_ints(len(rollouts), sum(r.length for r in rollouts))
    if config.beta > 0:
        with torch.no_grad(), policies.use(None):
            batch.ref_logp = batch_logprobs(policies.model, batch, config.temperature,
                                            update_cfg.rows_per_micro_batch(*batch.input_ids.shape))
    weighted = engine_importance_weights(policies, adapter, batch, rollouts, config, update_cfg)  # grpo.py, 11
    with policies.use(adapter):
        policies.model.train()
        stats = grpo_update(policies.model, batch, policies.params(adapter), optimizer, update_cfg,
                            sync=dp.sync_grads, scaler=scaler)
        policies.model.eval()
    out = {"loss": stats.loss, "grad_norm": stats.grad_norm, "clip_frac": stats.clip_region,
           "skipped_zero_adv": 0, "skipped_nonfinite": stats.num_skipped, **weighted}
    if stats.kl is not None:
        out["kl"] = stats.kl
    return out


def agon_step(policies, problems: list[dict], step: int, config, *, optimizers: dict, update_cfg, dp,
              backend=None, scalers: dict | None = None, problem_offset: int = 0) -> tuple[dict, Round]:
    """One training step: play the round, then update both roles' adapters. Returns the metrics row."""
    rnd = play_round(policies, problems, step, config, progress=False, backend=backend,
                     problem_offset=problem_offset)
    row = {"step": step, "drafter": rnd.drafter, "challenger": rnd.challenger, **rnd.metrics()}
    roles = [("drafter", rnd.drafter, rnd.drafts, rnd.r_draft)]
    if rnd.challenger is not None:
        roles.append(("challenger", rnd.challenger, rnd.challenges, rnd.r_challenge))
    for role, adapter, rollouts, _ in roles:  # generation-vs-training log-probs ({} on the transformers path)
        mismatch = logprob_mismatch(policies, adapter, rollouts, config.temperature, config.micro_batch_size)
        row.update({f"{role}/{k}": v for k, v in mismatch.items()})
    start = time.perf_counter()
    for role, adapter, rollouts, parts in roles:  # dr_grpo divides by the role's own generation cap
        cap = config.challenger_tokens if role == "challenger" else config.max_new_tokens
        stats = update_role(policies, adapter, rollouts, parts, rnd.group_size, optimizers[adapter],
                            replace(update_cfg, max_completion_length=cap), config, dp, (scalers or {}).get(adapter))
        row.update({f"{role}/{k}": v for k, v in stats.items()})
    row["time/train_s"] = time.perf_counter() - start
    return dp.reduce_metrics(row), rnd
