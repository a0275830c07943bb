"""The go / no-go cost model (eagle3/replay/cost_model.py) against the account's figures (eagle3/engines/serve_costs.py)."""
import pytest

from eagle3.engines.serve_costs import ACCOUNT_8GPU_PCIE, Latencies
from eagle3.replay.cost_model import accept_length_from_acceptance, accept_length_iid, fit_verify_latency, measured_latencies, predict


def test_account_drafter_is_predicted_slower():
    # 74.7% validation accuracy ~ accept length 2.0 at 2/1/3; observed 60 tok/s vs 82 without speculation
    p = predict(2.0, ACCOUNT_8GPU_PCIE, num_steps=2, num_draft_tokens=3)
    assert p.baseline_tok_s == pytest.approx(82.0)
    assert p.spec_tok_s == pytest.approx(2.0 / 0.030)  # 66.7 tok/s
    assert not p.wins and p.speedup < 1 and "SLOWER" in p.verdict
    # to win, a cycle of 30 ms must emit more than 30 / 12.2 tokens
    assert p.break_even_accept_length == pytest.approx(30.0 * 82.0 / 1000.0)  # 2.46
    assert predict(2.5, ACCOUNT_8GPU_PCIE, 2, 3).wins
    # the observed 60 tok/s corresponds to 1.8 tokens per 30 ms cycle: the prediction brackets it
    assert predict(1.8, ACCOUNT_8GPU_PCIE, 2, 3).spec_tok_s == pytest.approx(60.0)


def test_accept_length_formulas():
    assert accept_length_from_acceptance([]) == 1.0
    assert accept_length_from_acceptance([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.4)
    assert accept_length_iid(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert accept_length_iid(1.0, 3) == 4.0
    with pytest.raises(ValueError):
        accept_length_from_acceptance([1.2])


def test_draft_costs_and_verify_slope_enter_the_cycle():
    lat = Latencies(baseline_token_ms=10.0, verify_ms=12.0, verify_ms_per_token=1.0, draft_step_ms=2.0,
                    draft_extend_ms=1.0)
    assert lat.cycle_ms(3, 4) == 12 + 4 + 3 * 2 + 1
    p = predict(3.0, lat, 3, 4)
    assert p.speedup == pytest.approx(3.0 * 10 / 23) and p.wins
    assert p.break_even_accept_length == pytest.approx(2.3)


def test_fit_and_bad_input():
    a, b = fit_verify_latency([2, 3, 4], [10.0, 12.0, 14.0])
    assert (a, b) == pytest.approx((6.0, 2.0))
    lat = measured_latencies(5.0, {3: 7.0, 4: 7.0}, draft_step_ms=1.0)
    assert lat.verify(3) == pytest.approx(7.0) and lat.verify_ms_per_token == 0.0
    with pytest.raises(ValueError, match="baseline_token_ms"):
        Latencies(baseline_token_ms=0, verify_ms=1)
    with pytest.raises(ValueError, match="accept length"):
        predict(0.5, ACCOUNT_8GPU_PCIE, 2, 3)


def test_the_study_prices_with_the_named_assumed_split_and_reports_the_flat_cycle_beside():
    from eagle3.config.conf import compose, to_schema
    from eagle3.engines.serve_costs import FLAT_OF, PRESETS
    from eagle3.config.schema.study import StudyConfig
    from eval.report import latencies_from_config

    lat = latencies_from_config(to_schema(compose("study", []), StudyConfig).cost)
    assert (lat.verify_ms, lat.verify_ms_per_token, lat.draft_step_ms) == (23.5, 1.5, 1.0)
    assert lat.source == "preset account_8gpu_pcie_split" and "ASSUMED" in PRESETS["account_8gpu_pcie_split"].source
    # the split keeps the account's one measured point: 30 ms for the 2/1/3 cycle
    assert lat.cycle_ms(2, 3) == pytest.approx(PRESETS[FLAT_OF["account_8gpu_pcie_split"]].cycle_ms(2, 3)) == 30.0
