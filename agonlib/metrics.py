"""What the trainer logs about a round (DESIGN.md §6): per-role figures, pair statistics, sample records.

Pure functions of a played :class:`agonlib.agon.Round`: nothing here samples,
grades or trains. ``round_metrics`` gives the rollout side of one
``metrics.jsonl`` row (the update side comes from :func:`agonlib.agon.agon_step`),
``rollout_record`` one ``rollouts.jsonl`` record.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from .parsing import MASK, mask_answer


def bit(value, name: str) -> int:
    """Check a correctness bit: 0/1, False/True or 0.0/1.0."""
    if value in (0, 1) and not isinstance(value, str):
        return int(value)
    raise ValueError(f"{name} must be a correctness bit (0 or 1), got {value!r}; grade the completion first.")


def same_length(**seqs) -> int:
    sizes = {name: len(s) for name, s in seqs.items() if s is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"Group sequences must have one length (one entry per pair), got {sizes}.")
    return next(iter(sizes.values()), 0)


def leaks(summary: str, gold, question: str = "") -> bool:
    """Does the summary still state the gold, as a whole token, more often than the question does?"""
    if gold is None or not summary:
        return False
    count = lambda text: mask_answer(text, str(gold)).count(MASK) - text.count(MASK)  # noqa: E731
    return count(summary) > count(question)


@dataclass(frozen=True)
class PairStats:
    """How a challenger fared against the drafts it was paired with.

    Counts over ``n_pairs`` pairs ``(a_i, b_i)``:

    - ``conversions``: challenger right where the drafter was wrong (``c_b=1, c_a=0``)
    - ``regressions``: challenger wrong where the drafter was right (``c_b=0, c_a=1``)
    - ``tiebreaks``: both right and the challenger strictly shorter (only
      counted when lengths are given; otherwise 0)

    Rates (floats; ``nan`` when the denominator is 0):

    - ``conversion_rate = conversions / n_pairs`` and ``regression_rate =
      regressions / n_pairs`` — over *all* pairs, so they are comparable
      across steps whatever the drafter's accuracy.
    - ``conversion_rate_given_wrong = conversions / n_drafter_wrong`` — of the
      drafts that failed, how many the challenger fixed.
    - ``regression_rate_given_right = regressions / n_drafter_right`` — of the
      drafts that succeeded, how many the challenger broke. The trainer logs
      all four; the conditional two are the ones that say whether a challenger
      checks (fixes wrong drafts, keeps right ones) whatever the drafter's accuracy.
    - ``tiebreak_rate = tiebreaks / n_both_right`` — of the pairs where both
      were right, how often the challenger was shorter.
    """

    n_pairs: int
    n_drafter_wrong: int
    n_drafter_right: int
    n_both_right: int
    conversions: int
    regressions: int
    tiebreaks: int

    #: Each rate the trainer logs: (numerator, denominator) fields; NaN over an empty denominator.
    RATES = {"conversion_rate": ("conversions", "n_pairs"), "regression_rate": ("regressions", "n_pairs"),
             "conversion_rate_given_wrong": ("conversions", "n_drafter_wrong"),
             "regression_rate_given_right": ("regressions", "n_drafter_right"),
             "tiebreak_rate": ("tiebreaks", "n_both_right")}

    def rates(self) -> dict[str, float]:
        """The rates under the metric names the trainer logs."""
        return {name: getattr(self, num) / getattr(self, den) if getattr(self, den) else float("nan")
                for name, (num, den) in self.RATES.items()}


def pair_stats(c_a: Sequence, c_b: Sequence, len_a: Sequence | None = None,
               len_b: Sequence | None = None) -> PairStats:
    """Count conversions, regressions and tiebreaks over pairs ``(a_i, b_i)``.

    Note the argument order: drafter first (``c_a``), as in the pairs.

    >>> s = pair_stats(c_a=[0, 0, 1, 1], c_b=[1, 0, 0, 1], len_a=[9, 9, 9, 9], len_b=[5, 5, 5, 5])
    >>> s.conversions, s.regressions, s.tiebreaks
    (1, 1, 1)
    >>> r = s.rates()
    >>> r["conversion_rate"], r["conversion_rate_given_wrong"], r["tiebreak_rate"]
    (0.25, 0.5, 1.0)
    """
    n = same_length(c_a=c_a, c_b=c_b, len_a=len_a, len_b=len_b)
    a = [bit(x, "c_a") for x in c_a]
    b = [bit(x, "c_b") for x in c_b]
    both = [i for i in range(n) if a[i] and b[i]]
    tiebreaks = 0
    if len_a is not None and len_b is not None:
        tiebreaks = sum(1 for i in both if len_b[i] < len_a[i])
    return PairStats(
        n_pairs=n,
        n_drafter_wrong=n - sum(a),
        n_drafter_right=sum(a),
        n_both_right=len(both),
        conversions=sum(1 for i in range(n) if b[i] and not a[i]),
        regressions=sum(1 for i in range(n) if a[i] and not b[i]),
        tiebreaks=tiebreaks,
    )


def mean_token_entropy(rollouts) -> float | None:
    """Nats per sampled token over ``rollouts`` (token-weighted), or ``None`` where the engine measured none."""
    if not rollouts or any("entropy_sum" not in r.extra for r in rollouts):
        return None
    tokens = sum(r.length for r in rollouts)
    return sum(r.extra["entropy_sum"] for r in rollouts) / tokens if tokens else float("nan")


def distinct_answers(answers: Sequence, group: int) -> float:
    """Mean over groups of ``group`` consecutive rollouts of how many distinct boxed answers each has.

    An unboxed rollout (``None``) is no answer. A group that collapsed onto one answer scores 1.

    >>> distinct_answers(["7", "7", "9", None, "3", "3", "3", "3"], group=4)
    1.5
    """
    groups = [answers[i : i + group] for i in range(0, len(answers), group)]
    return statistics.fmean(len({a for a in g if a is not None}) for g in groups) if groups else float("nan")


def role_metrics(role: str, rollouts, correct: list[int], parts, group: int,
                  generation) -> dict:
    totals = [p.total for p in parts]
    lengths = [r.length for r in rollouts]
    groups = [totals[i : i + group] for i in range(0, len(totals), group)]
    entropy = mean_token_entropy(rollouts)
    return {
        **({f"{role}/entropy": entropy} if entropy is not None else {}),
        f"{role}/distinct_answers": distinct_answers([r.answer for r in rollouts], group),
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


def round_metrics(rnd) -> dict:
    """Per-role figures of DESIGN.md §6 (rollout side), keyed ``drafter/…`` and ``challenger/…``."""
    out = role_metrics("drafter", rnd.drafts, rnd.c_draft, rnd.r_draft, rnd.group_size, rnd.draft_generation)
    if rnd.challenges:
        out.update(role_metrics("challenger", rnd.challenges, rnd.c_challenge, rnd.r_challenge, rnd.group_size,
                                rnd.challenge_generation))
        pairs = pair_stats(rnd.c_draft, rnd.c_challenge, [d.length for d in rnd.drafts],
                           [c.length for c in rnd.challenges])
        out.update({f"challenger/{k}": v for k, v in pairs.rates().items()})
        out["challenger/conversion_bonus_mean"] = statistics.fmean(p.conversion for p in rnd.r_challenge)
        out["challenger/tiebreak_bonus_mean"] = statistics.fmean(p.tiebreak for p in rnd.r_challenge)
        out["challenger/summary_len_mean"] = statistics.fmean(rnd.summary_tokens)  # tokens
        out["challenger/leak_rate"] = statistics.fmean(rnd.leaked) if rnd.leaked else 0.0
    gens = (rnd.draft_generation, rnd.challenge_generation)
    out.update({
        "time/generate_s": sum(g.seconds for g in gens),
        "time/grade_s": rnd.grade_seconds,
        "tokens/generated": sum(g.tokens for g in gens),
        "prompts/truncated": sum(g.prompts_truncated for g in gens),
    })
    return out


def rollout_record(rnd, max_problems: int = 2) -> dict:
    """Sampled drafts, summaries and challenges of the first problems of a round."""
    G = rnd.group_size
    record = {"step": rnd.step, "drafter": rnd.drafter, "challenger": rnd.challenger, "problems": []}
    for p, problem in enumerate(rnd.problems[:max_problems]):
        items = []
        for i in range(p * G, (p + 1) * G):
            item = {"draft": rnd.drafts[i].text, "draft_answer": rnd.drafts[i].answer,
                    "draft_correct": rnd.c_draft[i], "draft_len": rnd.drafts[i].length,
                    "summary": rnd.summaries[i] if rnd.summaries else rnd.drafts[i].summary}
            if rnd.challenges:
                item.update({"challenge": rnd.challenges[i].text, "challenge_answer": rnd.challenges[i].answer,
                             "challenge_correct": rnd.c_challenge[i], "challenge_len": rnd.challenges[i].length,
                             "challenge_reward": rnd.r_challenge[i].total, "leaked": rnd.leaked[i]})
            items.append(item)
        record["problems"].append({"id": problem.get("id"), "question": problem["question"],
                                   "answer": problem.get("answer"), "rollouts": items})
    return record
