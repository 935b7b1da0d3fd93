"""Rewards of the Agon game (DESIGN.md §2 steps 2 and 5) and pairwise metrics.

Every reward here is a pure function of correctness bits and lengths: no
grading happens in this module. The trainer grades each completion once with
the same grader that evaluation uses, then passes the bits in, so training
reward and reported accuracy can never disagree.

Each reward returns a :class:`RewardParts` whose ``total`` is the scalar GRPO
sees and whose components say where it came from (logged per role):

- drafter / vanilla GRPO: ``r = c(a)``
- competitive challenger:
  ``r = c(b) + λ_conv·c(b)·(1−c(a)) + λ_len·c(b)·c(a)·[len(b) < len(a)]``
- cooperative challenger: ``r = c(b)`` (the drafter's result is ignored)

The drafter-side functions take ``(c_a)``; the challenger-side functions all
share one signature ``(c_b, c_a, len_b=None, len_a=None, *, lambda_conv=1.0,
lambda_len=0.0)`` so :func:`challenger_reward` can dispatch on the mode alone.

Worked example (a group of four pairs, λ_conv = 1, λ_len = 0.1)::

    >>> parts = challenger_group_rewards(
    ...     "competitive", c_b=[1, 1, 0, 1], c_a=[0, 1, 1, 1],
    ...     len_b=[50, 40, 10, 90], len_a=[60, 60, 60, 60], lambda_len=0.1)
    >>> [p.total for p in parts]
    [2.0, 1.1, 0.0, 1.0]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

CHALLENGER_MODES = ("competitive", "cooperative")


@dataclass(frozen=True)
class RewardParts:
    """One rollout's reward split into its terms; ``total`` is their sum.

    ``conversion`` and ``tiebreak`` are the weighted terms (already multiplied
    by ``lambda_conv`` / ``lambda_len``), so ``total = correct + conversion +
    tiebreak`` always holds.
    """

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
        """Build the parts and fill in ``total``."""
        return cls(float(correct), float(conversion), float(tiebreak), float(correct + conversion + tiebreak))

    def as_dict(self) -> dict:
        return asdict(self)


def _bit(value, name: str) -> int:
    """Check a correctness bit: 0/1, False/True or 0.0/1.0."""
    if value in (0, 1) and not isinstance(value, str):
        return int(value)
    raise ValueError(f"{name} must be a correctness bit (0 or 1), got {value!r}; grade the completion first.")


# --- drafter side ------------------------------------------------------------


def drafter_reward(c_a) -> RewardParts:
    """Drafter reward ``c(a)``: a plain GRPO update on correctness.

    >>> drafter_reward(1).total
    1.0
    """
    return RewardParts.of(_bit(c_a, "c_a"))


def grpo_reward(c_a) -> RewardParts:
    """Vanilla GRPO baseline reward ``c(a)`` (same value as the drafter's)."""
    return RewardParts.of(_bit(c_a, "c_a"))


# --- challenger side ---------------------------------------------------------


def competitive_reward(c_b, c_a, len_b=None, len_a=None, *, lambda_conv: float = 1.0,
                       lambda_len: float = 0.0) -> RewardParts:
    """Competitive challenger reward.

    ``c(b) + λ_conv·c(b)·(1−c(a)) + λ_len·c(b)·c(a)·[len(b) < len(a)]``:
    a conversion bonus for being right where the drafter was wrong, and an
    optional tiebreak for being right *and strictly shorter* when both are
    right. Lengths are only needed when the tiebreak can apply.

    >>> competitive_reward(1, 0).as_dict()
    {'correct': 1.0, 'conversion': 1.0, 'tiebreak': 0.0, 'total': 2.0}
    >>> competitive_reward(1, 1, 30, 40, lambda_len=0.1).tiebreak
    0.1
    """
    b, a = _bit(c_b, "c_b"), _bit(c_a, "c_a")
    conversion = lambda_conv * b * (1 - a)
    tiebreak = 0.0
    if lambda_len != 0 and b and a:
        if len_b is None or len_a is None:
            raise ValueError("competitive_reward needs len_b and len_a when lambda_len != 0 (the length tiebreak).")
        tiebreak = lambda_len * float(len_b < len_a)
    return RewardParts.of(b, conversion, tiebreak)


def cooperative_reward(c_b, c_a=None, len_b=None, len_a=None, *, lambda_conv: float = 1.0,
                       lambda_len: float = 0.0) -> RewardParts:
    """Cooperative challenger reward ``c(b)``; everything else is ignored.

    The signature matches :func:`competitive_reward` so the two are
    interchangeable; ``c_a``, lengths and λ values have no effect.

    >>> cooperative_reward(1, 0, lambda_conv=5.0).total
    1.0
    """
    return RewardParts.of(_bit(c_b, "c_b"))


_CHALLENGER_FNS = {"competitive": competitive_reward, "cooperative": cooperative_reward}


def _check_mode(mode: str) -> None:
    if mode not in _CHALLENGER_FNS:
        raise ValueError(f"Unknown challenger reward mode {mode!r}; use one of {', '.join(CHALLENGER_MODES)}.")


def challenger_reward(mode: str, c_b, c_a, len_b=None, len_a=None, *, lambda_conv: float = 1.0,
                      lambda_len: float = 0.0) -> RewardParts:
    """Dispatch to the challenger reward of ``mode`` (``competitive`` | ``cooperative``)."""
    _check_mode(mode)
    return _CHALLENGER_FNS[mode](c_b, c_a, len_b, len_a, lambda_conv=lambda_conv, lambda_len=lambda_len)


# --- groups ------------------------------------------------------------------


def _same_length(**seqs) -> int:
    sizes = {name: len(s) for name, s in seqs.items() if s is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"Group sequences must have one length (one entry per pair), got {sizes}.")
    return next(iter(sizes.values()), 0)


def drafter_group_rewards(c_a: Sequence) -> list[RewardParts]:
    """:func:`drafter_reward` over a group of drafts."""
    return [drafter_reward(c) for c in c_a]


def challenger_group_rewards(mode: str, c_b: Sequence, c_a: Sequence, len_b: Sequence | None = None,
                             len_a: Sequence | None = None, *, lambda_conv: float = 1.0,
                             lambda_len: float = 0.0) -> list[RewardParts]:
    """:func:`challenger_reward` over a group; entry ``i`` pairs ``b_i`` with ``a_i``."""
    _check_mode(mode)
    n = _same_length(c_b=c_b, c_a=c_a, len_b=len_b, len_a=len_a)
    lb = len_b if len_b is not None else [None] * n
    la = len_a if len_a is not None else [None] * n
    return [challenger_reward(mode, c_b[i], c_a[i], lb[i], la[i], lambda_conv=lambda_conv, lambda_len=lambda_len)
            for i in range(n)]


def totals(parts: Sequence[RewardParts]) -> list[float]:
    """The scalar rewards GRPO sees, one per rollout."""
    return [p.total for p in parts]


# --- pairwise metrics (DESIGN.md §6) ---------------------------------------------


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
      across steps whatever the drafter's accuracy; the trainer logs these.
    - ``conversion_rate_given_wrong = conversions / n_drafter_wrong`` — of the
      drafts that failed, how many the challenger fixed.
    - ``regression_rate_given_right = regressions / n_drafter_right`` — of the
      drafts that succeeded, how many the challenger broke.
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

    @staticmethod
    def _rate(num: int, den: int) -> float:
        return num / den if den else float("nan")

    @property
    def conversion_rate(self) -> float:
        return self._rate(self.conversions, self.n_pairs)

    @property
    def regression_rate(self) -> float:
        return self._rate(self.regressions, self.n_pairs)

    @property
    def conversion_rate_given_wrong(self) -> float:
        return self._rate(self.conversions, self.n_drafter_wrong)

    @property
    def regression_rate_given_right(self) -> float:
        return self._rate(self.regressions, self.n_drafter_right)

    @property
    def tiebreak_rate(self) -> float:
        return self._rate(self.tiebreaks, self.n_both_right)

    def rates(self) -> dict[str, float]:
        """The rates under the metric names the trainer logs."""
        names = ("conversion_rate", "regression_rate", "conversion_rate_given_wrong",
                 "regression_rate_given_right", "tiebreak_rate")
        return {name: getattr(self, name) for name in names}


def pair_stats(c_a: Sequence, c_b: Sequence, len_a: Sequence | None = None,
               len_b: Sequence | None = None) -> PairStats:
    """Count conversions, regressions and tiebreaks over pairs ``(a_i, b_i)``.

    Note the argument order: drafter first (``c_a``), as in the pairs.

    >>> s = pair_stats(c_a=[0, 0, 1, 1], c_b=[1, 0, 0, 1], len_a=[9, 9, 9, 9], len_b=[5, 5, 5, 5])
    >>> s.conversions, s.regressions, s.tiebreaks
    (1, 1, 1)
    >>> s.conversion_rate, s.conversion_rate_given_wrong, s.tiebreak_rate
    (0.25, 0.5, 1.0)
    """
    n = _same_length(c_a=c_a, c_b=c_b, len_a=len_a, len_b=len_b)
    a = [_bit(x, "c_a") for x in c_a]
    b = [_bit(x, "c_b") for x in c_b]
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
