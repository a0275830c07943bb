"""The study's statistics (pipeline/study_stats.py) on hand-checked numbers and printed t tables."""
import math

import pytest

from pipeline import study_stats as st


def test_mean_std_and_t_quantiles_match_the_tables():
    assert st.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert st.mean_std([5.0]) == (5.0, 0.0)
    # Student t two-sided 95% points from the printed tables
    for df, q in ((1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (1000, 1.962)):
        assert st.t_quantile(0.975, df) == pytest.approx(q, abs=2e-3)
    assert st.t_cdf(0.0, 3) == 0.5 and st.t_cdf(-2.0, 3) == pytest.approx(1 - st.t_cdf(2.0, 3))


def test_welch_interval_by_hand():
    a, b = [3.0, 4.0, 5.0], [1.0, 2.0, 3.0]  # diff 2, both std 1, se = sqrt(2/3), df = 4
    ci = st.welch_interval(a, b, 0.95)
    half = 2.776 * math.sqrt(2 / 3)
    assert ci["diff"] == 2.0 and ci["df"] == pytest.approx(4.0)
    assert ci["low"] == pytest.approx(2 - half, abs=2e-3) and ci["high"] == pytest.approx(2 + half, abs=2e-3)
    point = st.welch_interval([1.0, 1.0], [0.5, 0.5])
    assert point["low"] == point["high"] == 0.5
    assert math.isnan(st.welch_interval([1.0], [0.0, 1.0])["low"])


def test_tokens_to_reach_and_saving():
    curve = [(0, 1.0), (100, 1.4), (200, 1.8)]
    assert st.tokens_to_reach(curve, 1.6) == pytest.approx(150.0)
    assert st.tokens_to_reach(curve, 0.9) == 0.0
    assert st.tokens_to_reach(curve, 1.9) is None
    slow = [[(0, 1.0), (400, 1.6)]]
    sav = st.token_saving([curve, [(0, 1.7), (200, 1.9)], [(0, 1.0), (200, 1.5)]], slow)
    assert sav["ratios"] == [pytest.approx(400 / 150)] and sav["at_start"] == 1 and sav["not_reached"] == 1
    assert sav["pairs"] == 3


def test_world_spread_separates_seed_and_world_variation():
    sp = st.world_spread({0: [1.0, 2.0], 1: [3.0, 5.0]})
    # world means 1.5 and 4.0; pooled within-world SS = 0.5 + 2.0 over 2 degrees of freedom
    assert sp["mean"] == pytest.approx(2.75) and sp["seed_std"] == pytest.approx(math.sqrt(1.25))
    assert sp["world_std"] == pytest.approx(math.sqrt(2 * 1.25 ** 2)) and (sp["worlds"], sp["runs"]) == (2, 4)
    one = st.world_spread({0: [1.0, 3.0]})
    assert one["world_std"] != one["world_std"] and one["seed_std"] == pytest.approx(math.sqrt(2))


def test_world_difference_uses_worlds_as_units_and_one_world_falls_back_to_welch():
    a, b = {0: [2.0, 2.2], 1: [3.0, 3.1], 2: [1.0, 1.0]}, {0: [1.0, 1.2], 1: [2.5, 2.5], 2: [0.8, 0.8]}
    d = st.world_difference(a, b, 0.95)
    diffs = [1.0, 0.55, 0.2]  # per world: mean(a_w) - mean(b_w)
    m = sum(diffs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in diffs) / 2)
    half = st.t_quantile(0.975, 2) * sd / math.sqrt(3)
    assert d["level"] == "worlds" and d["worlds"] == 3 and d["df"] == 2.0
    assert d["diff"] == pytest.approx(m) and d["low"] == pytest.approx(m - half) and d["high"] == pytest.approx(m + half)
    assert d["per_world"] == {"0": pytest.approx(1.0), "1": pytest.approx(0.55), "2": pytest.approx(0.2)}
    one = st.world_difference({0: [3.0, 4.0, 5.0]}, {0: [1.0, 2.0, 3.0]}, 0.95)
    assert one["level"] == "seeds (one world)" and one == {**st.welch_interval([3.0, 4.0, 5.0], [1.0, 2.0, 3.0]),
                                                           "level": "seeds (one world)", "worlds": 1,
                                                           "per_world": {"0": 2.0}}


def test_token_saving_pairs_counts_only_the_pairs_given():
    fast_a, fast_b = [(0, 1.0), (100, 2.0), (200, 2.2)], [(0, 1.0), (100, 1.5), (200, 2.0)]
    slow_a, slow_b = [(0, 1.0), (200, 2.0)], [(0, 1.0), (200, 1.5)]
    within = st.token_saving_pairs([(fast_a, slow_a), (fast_b, slow_b)])  # pairs inside one world each
    # fast_a reaches 2.0 at 100 tokens: 200 / 100; fast_b reaches 1.5 at 100 tokens: 200 / 100
    assert within["pairs"] == 2 and within["ratios"] == [2.0, 2.0]
    cross = st.token_saving([fast_a, fast_b], [slow_a, slow_b])
    # across worlds too: fast_a reaches 1.5 at 50 (200 / 50), fast_b reaches 2.0 only at 200 (200 / 200)
    assert cross["pairs"] == 4 and sorted(cross["ratios"]) == [1.0, 2.0, 2.0, 4.0]
