"""One round of the draft-and-challenge game: DESIGN.md §2 steps 1–5.

``play_round(policies, problems, step, config)`` assigns the roles, samples
``N`` drafts per problem under the drafter, grades them, summarises each draft,
samples one paired challenge per draft under the challenger (reading the
summary with exchange, the bare problem without), grades those and computes
both roles' rewards. The trainer turns a :class:`Round` into two GRPO updates;
the CLI's ``round`` command prints one.

In ``mode: grpo`` a round is drafts only (``N`` or compute-matched ``2N``) under
adapter ``A``, rewarded ``c(a)``.

Grading goes through the same graders evaluation uses (``agonlib.grading``), so training reward and reported accuracy cannot disagree.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field

from . import prompts, rewards
from .grading import grade_code, grade_math_batch
from .parsing import MASK, mask_answer
from .rollouts import GenerationStats, Rollout, SamplingParams, generate, sample_seed


def roles_for_step(step: int, roles: str = "rotate", mode: str = "agon") -> tuple[str, str | None]:
    """``(drafter, challenger)`` for 1-based ``step``: rotate gives A, B, A, B… as drafter.

    DESIGN.md's ``t`` is 0-based (``t = step − 1``): A drafts on even ``t``, so on
    odd ``step`` as logged in ``metrics.jsonl``.
    """
    if mode == "grpo":
        return "A", None
    if roles == "fixed" or step % 2 == 1:
        return "A", "B"
    return "B", "A"


def grade(rollouts: list[Rollout], problems: list[dict], config) -> list[int]:
    """0/1 correctness of each rollout against its problem (``problems`` aligned with ``rollouts``)."""
    if config.task == "code":
        return [grade_code(r.text, p["tests"], time_limit_s=config.code_time_limit_s, thinking=config.thinking)
                for r, p in zip(rollouts, problems)]
    return grade_math_batch([r.text for r in rollouts], [str(p["answer"]) for p in problems],
                            thinking=config.thinking, timeout_s=config.grade_timeout_s)


def leaks(summary: str, gold, question: str = "") -> bool:
    """Does the summary still state the gold answer?

    The rule (a text check, not math-verify): the gold occurs in the summary as a
    whole token, as masking sees it, and not merely because the question itself
    contains it. Equivalent forms (``0.5`` for ``1/2``) are not caught.
    """
    if gold is None or not summary:
        return False
    return _occurrences(summary, str(gold)) > _occurrences(question, str(gold))


def _occurrences(text: str, gold: str) -> int:
    """Whole-token occurrences of ``gold`` in ``text``."""
    return mask_answer(text, gold).count(MASK) - text.count(MASK)


@dataclass
class Round:
    step: int
    drafter: str
    challenger: str | None
    problems: list[dict]  # P problems
    drafts: list[Rollout]  # P*G drafts, problem-major: drafts[p*G + g]
    c_draft: list[int]
    r_draft: list[rewards.RewardParts]
    challenges: list[Rollout] = field(default_factory=list)  # challenges[i] answers drafts[i]
    c_challenge: list[int] = field(default_factory=list)
    r_challenge: list[rewards.RewardParts] = field(default_factory=list)
    leaked: list[bool] = field(default_factory=list)
    summary_tokens: list[int] = field(default_factory=list)
    draft_generation: GenerationStats = field(default_factory=GenerationStats)
    challenge_generation: GenerationStats = field(default_factory=GenerationStats)
    grade_seconds: float = 0.0

    @property
    def group_size(self) -> int:
        return len(self.drafts) // max(1, len(self.problems))

    def metrics(self) -> dict:
        """Per-role figures of DESIGN.md §6 (rollout side), keyed ``drafter/…`` and ``challenger/…``."""
        out = _role_metrics("drafter", self.drafts, self.c_draft, self.r_draft, self.group_size,
                            self.draft_generation)
        if self.challenges:
            out.update(_role_metrics("challenger", self.challenges, self.c_challenge, self.r_challenge,
                                     self.group_size, self.challenge_generation))
            pairs = rewards.pair_stats(self.c_draft, self.c_challenge,
                                       [d.length for d in self.drafts], [c.length for c in self.challenges])
            out.update({f"challenger/{k}": v for k, v in pairs.rates().items()})
            out["challenger/conversion_bonus_mean"] = statistics.fmean(p.conversion for p in self.r_challenge)
            out["challenger/tiebreak_bonus_mean"] = statistics.fmean(p.tiebreak for p in self.r_challenge)
            out["challenger/summary_len_mean"] = statistics.fmean(self.summary_tokens)  # tokens
            out["challenger/leak_rate"] = statistics.fmean(self.leaked) if self.leaked else 0.0
        gens = (self.draft_generation, self.challenge_generation)
        out.update({
            "time/generate_s": sum(g.seconds for g in gens),
            "time/grade_s": self.grade_seconds,
            "tokens/generated": sum(g.tokens for g in gens),
            "prompts/truncated": sum(g.prompts_truncated for g in gens),
        })
        return out


def _role_metrics(role: str, rollouts: list[Rollout], correct: list[int], parts, group: int,
                  generation: GenerationStats) -> dict:
    totals = rewards.totals(parts)
    lengths = [r.length for r in rollouts]
    groups = [totals[i : i + group] for i in range(0, len(totals), group)]
    return {
        f"{role}/reward_mean": statistics.fmean(totals),
        f"{role}/reward_std": statistics.pstdev(totals),
        f"{role}/accuracy": statistics.fmean(correct),
        f"{role}/zero_std_frac": statistics.fmean(float(max(g) == min(g)) for g in groups),
        f"{role}/len_mean": statistics.fmean(lengths),
        f"{role}/len_median": statistics.median(lengths),
        f"{role}/len_max": max(lengths),
        f"{role}/truncation_rate": statistics.fmean(r.truncated for r in rollouts),
        f"{role}/generate_s": generation.seconds,
        f"{role}/tokens": generation.tokens,
    }


def play_round(policies, problems: list[dict], step: int, config=None, *, progress: bool = True,
               backend=None, problem_offset: int = 0) -> Round:
    """Draft, grade, summarise, challenge, grade, reward (DESIGN.md §2 steps 1–5).

    ``backend`` samples the rollouts (``agonlib.backends``; default: the
    transformers path). ``problem_offset`` is the index of ``problems[0]`` in the
    step's full problem list: a data-parallel rank holding a slice of it seeds
    its completions as the one-process run does (``agonlib.distributed``).
    """
    config = config or policies.config
    if backend is not None:
        backend.begin_step(step)
    gen = backend.generate if backend is not None else functools.partial(generate, policies)
    tok, task, thinking = policies.tokenizer, config.task, config.thinking
    drafter, challenger = roles_for_step(step, config.roles, config.mode)
    G = config.generations_per_problem
    rnd_stats = (GenerationStats(), GenerationStats())  # drafts, challenges
    sampling = dict(params=SamplingParams.from_config(config), thinking=thinking, task=task,
                    max_prompt_tokens=config.max_prompt_tokens, progress=progress)

    draft_text = [prompts.render(tok, prompts.draft_prompt(p["question"], task), thinking) for p in problems]
    drafts = gen(
        [draft_text[i // G] for i in range(len(problems) * G)], drafter,
        [sample_seed(config.seed, step, problem_offset + i // G, i % G, "draft") for i in range(len(problems) * G)],
        desc=f"step {step}: drafts ({drafter})", stats=rnd_stats[0], **sampling,
    )
    paired = [problems[i // G] for i in range(len(drafts))]  # the problem of each rollout
    start = time.perf_counter()
    c_draft = grade(drafts, paired, config)
    grade_seconds = time.perf_counter() - start
    r_draft = [rewards.drafter_reward(c) for c in c_draft]
    rnd = Round(step, drafter, challenger, problems, drafts, c_draft, r_draft, draft_generation=rnd_stats[0],
                challenge_generation=rnd_stats[1], grade_seconds=grade_seconds)
    if config.mode == "grpo":
        return rnd

    if config.exchange:
        challenge_text = [
            prompts.render(tok, prompts.challenge_prompt(p["question"], d.summary, config.reward, task), thinking)
            for p, d in zip(paired, drafts)
        ]
    else:  # rival hidden: the challenger sees exactly the drafter's prompt
        challenge_text = [draft_text[i // G] for i in range(len(drafts))]
    rnd.challenges = gen(
        challenge_text, challenger,
        [sample_seed(config.seed, step, problem_offset + i // G, i % G, "challenge") for i in range(len(drafts))],
        desc=f"step {step}: challenges ({challenger})", stats=rnd_stats[1],
        **{**sampling, "params": SamplingParams.from_config(config, role="challenger")},
    )
    start = time.perf_counter()
    rnd.c_challenge = grade(rnd.challenges, paired, config)
    rnd.grade_seconds += time.perf_counter() - start
    rnd.r_challenge = rewards.challenger_group_rewards(
        config.reward, rnd.c_challenge, c_draft,
        [c.length for c in rnd.challenges], [d.length for d in drafts],
        lambda_conv=config.lambda_conv, lambda_len=config.lambda_len,
    )
    rnd.leaked = [leaks(d.summary, p.get("answer"), p["question"]) for d, p in zip(drafts, paired)]
    rnd.summary_tokens = [len(tok(d.summary, add_special_tokens=False)["input_ids"]) for d in drafts]
    return rnd
