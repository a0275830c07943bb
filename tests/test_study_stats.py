"""The study's statistics (eval/study_stats.py) on hand-checked numbers and printed t tables."""
import math

import pytest

from eval import study_stats as st


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
