"""Rewards and pairwise metrics: table tests with hand-computed values."""

import math

import pytest

from agonlib.agon import (
    RewardParts,
    challenger_group_rewards,
    challenger_reward,
    competitive_reward,
    cooperative_reward,
    drafter_group_rewards,
    drafter_reward,
    grpo_reward,
    totals,
)
from agonlib.metrics import pair_stats

# (c_b, c_a, len_b, len_a, lambda_conv, lambda_len, (correct, conversion, tiebreak, total))
COMPETITIVE_CASES = [
    (1, 0, 10, 10, 1.0, 0.0, (1, 1, 0, 2)),  # conversion: challenger right where the drafter failed
    (1, 1, 10, 20, 1.0, 0.0, (1, 0, 0, 1)),  # both right, tiebreak off by default
    (1, 1, 10, 20, 1.0, 0.1, (1, 0, 0.1, 1.1)),  # both right, challenger strictly shorter: tiebreak
    (1, 1, 20, 20, 1.0, 0.1, (1, 0, 0, 1)),  # equal length: no tiebreak (strictly shorter only)
    (1, 1, 30, 20, 1.0, 0.1, (1, 0, 0, 1)),  # challenger longer: no tiebreak
    (0, 1, 5, 20, 1.0, 0.1, (0, 0, 0, 0)),  # challenger wrong: nothing, however short
    (0, 0, 5, 20, 1.0, 0.1, (0, 0, 0, 0)),  # both wrong: nothing
    (1, 0, 5, 20, 1.0, 0.1, (1, 1, 0, 2)),  # drafter wrong: conversion, and no tiebreak even if shorter
    (1, 0, 10, 10, 0.5, 0.0, (1, 0.5, 0, 1.5)),  # lambda_conv scales the bonus
    (1, 0, 10, 10, 0.0, 0.0, (1, 0, 0, 1)),  # lambda_conv = 0 turns the bonus off
    (1, 1, 1, 2, 1.0, 0.25, (1, 0, 0.25, 1.25)),  # lambda_len scales the tiebreak
    (True, False, None, None, 1.0, 0.0, (1, 1, 0, 2)),  # bools as bits; lengths unused when lambda_len = 0
    (1.0, 0.0, None, None, 2.0, 0.0, (1, 2, 0, 3)),  # float bits
]


@pytest.mark.parametrize("c_b, c_a, len_b, len_a, lconv, llen, expected", COMPETITIVE_CASES)
def test_competitive_reward(c_b, c_a, len_b, len_a, lconv, llen, expected):
    parts = competitive_reward(c_b, c_a, len_b, len_a, lambda_conv=lconv, lambda_len=llen)
    assert (parts.correct, parts.conversion, parts.tiebreak, parts.total) == pytest.approx(expected)
    assert parts == challenger_reward("competitive", c_b, c_a, len_b, len_a, lambda_conv=lconv, lambda_len=llen)


# (c_b, c_a, len_b, len_a): cooperative reward is c(b), whatever the drafter did
COOPERATIVE_CASES = [
    (1, 0, 10, 20),  # drafter wrong: no conversion bonus
    (1, 1, 10, 20),  # both right and shorter: no tiebreak
    (0, 1, 10, 20),  # challenger wrong
    (0, 0, None, None),  # both wrong, no lengths
]


@pytest.mark.parametrize("c_b, c_a, len_b, len_a", COOPERATIVE_CASES)
def test_cooperative_reward_ignores_drafter(c_b, c_a, len_b, len_a):
    parts = cooperative_reward(c_b, c_a, len_b, len_a, lambda_conv=3.0, lambda_len=0.5)
    assert parts == RewardParts(correct=c_b, conversion=0.0, tiebreak=0.0, total=c_b)
    assert parts == challenger_reward("cooperative", c_b, c_a, len_b, len_a, lambda_conv=3.0, lambda_len=0.5)


@pytest.mark.parametrize("fn", [drafter_reward, grpo_reward])
@pytest.mark.parametrize("c_a", [0, 1])
def test_drafter_and_grpo_reward_is_correctness(fn, c_a):
    assert fn(c_a) == RewardParts(correct=c_a, conversion=0.0, tiebreak=0.0, total=c_a)


def test_group_rewards_hand_computed():
    # pairs: conversion | both right, shorter | challenger wrong | both right, longer | both wrong
    c_b, c_a = [1, 1, 0, 1, 0], [0, 1, 1, 1, 0]
    len_b, len_a = [50, 40, 10, 90, 5], [60, 60, 60, 60, 60]
    comp = challenger_group_rewards("competitive", c_b, c_a, len_b, len_a, lambda_conv=1.0, lambda_len=0.1)
    assert totals(comp) == pytest.approx([2.0, 1.1, 0.0, 1.0, 0.0])
    assert [p.conversion for p in comp] == [1.0, 0, 0, 0, 0]
    assert [p.tiebreak for p in comp] == pytest.approx([0, 0.1, 0, 0, 0])
    coop = challenger_group_rewards("cooperative", c_b, c_a, len_b, len_a, lambda_len=0.1)
    assert totals(coop) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert totals(drafter_group_rewards(c_a)) == [0.0, 1.0, 1.0, 1.0, 0.0]
    # lengths may be omitted when the tiebreak is off
    assert totals(challenger_group_rewards("competitive", c_b, c_a)) == [2.0, 1.0, 0.0, 1.0, 0.0]


def test_total_is_sum_of_parts():
    with pytest.raises(ValueError, match="total"):
        RewardParts(correct=1.0, conversion=1.0, tiebreak=0.0, total=1.0)


# (call, error message fragment)
ERROR_CASES = [
    (lambda: challenger_reward("competetive", 1, 0), "competitive, cooperative"),  # typo in the mode
    (lambda: challenger_group_rewards("rival", [1], [0]), "Unknown challenger reward mode"),  # unknown mode
    (lambda: competitive_reward(0.5, 1), "correctness bit"),  # not a bit
    (lambda: drafter_reward(2), "correctness bit"),  # not a bit
    (lambda: competitive_reward(1, 1, lambda_len=0.1), "len_b and len_a"),  # tiebreak on without lengths
    (lambda: challenger_group_rewards("competitive", [1, 0], [1]), "one length"),  # ragged group
    (lambda: pair_stats([1, 0], [1]), "one length"),  # ragged pairs
]


@pytest.mark.parametrize("call, message", ERROR_CASES)
def test_errors_are_clear(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_pair_stats_hand_computed():
    # pairs (a, b): (0,1) conversion, (0,1) conversion, (0,0), (1,0) regression, (1,1) shorter, (1,1) longer
    c_a = [0, 0, 0, 1, 1, 1]
    c_b = [1, 1, 0, 0, 1, 1]
    len_a = [10, 10, 10, 10, 10, 10]
    len_b = [5, 50, 5, 5, 5, 50]
    s = pair_stats(c_a, c_b, len_a, len_b)
    assert (s.n_pairs, s.n_drafter_wrong, s.n_drafter_right, s.n_both_right) == (6, 3, 3, 2)
    assert (s.conversions, s.regressions, s.tiebreaks) == (2, 1, 1)
    rates = s.rates()
    assert rates["conversion_rate"] == pytest.approx(2 / 6)  # over all pairs
    assert rates["conversion_rate_given_wrong"] == pytest.approx(2 / 3)  # over drafter-wrong pairs
    assert rates["regression_rate"] == pytest.approx(1 / 6)
    assert rates["regression_rate_given_right"] == pytest.approx(1 / 3)
    assert rates["tiebreak_rate"] == pytest.approx(1 / 2)  # over both-right pairs
    assert set(s.rates()) == {"conversion_rate", "regression_rate", "conversion_rate_given_wrong",
                              "regression_rate_given_right", "tiebreak_rate"}


def test_pair_stats_empty_denominators_are_nan():
    s = pair_stats([1, 1], [1, 1])  # drafter never wrong, no lengths given
    assert s.rates()["conversion_rate"] == 0.0 and s.tiebreaks == 0
    assert math.isnan(s.rates()["conversion_rate_given_wrong"])
    assert math.isnan(pair_stats([], []).rates()["conversion_rate"])
