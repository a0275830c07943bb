"""Co-location (issue 43, train/colocation.py): the producer's share of a card plus the trainer's estimated need
is checked before the first step, and refused naming both numbers when they cannot fit."""
import json

import pytest

from eagle3.config.conf import ConfigError
from tests.fixtures.train_world import config_for, world  # noqa: F401 (fixture)
from train import colocation
from train.colocation import GIB, colocation_problem, trainer_need_bytes
from train.stage import run_train

KIMI = dict(trainable_params=int(1.19e9), hidden_size=7168)
H200 = 140 * GIB


def test_the_estimate_meets_the_measured_points_at_kimi_dimensions():
    assert trainer_need_bytes(**KIMI, tokens_per_batch=8192) / GIB == pytest.approx(44.4, abs=0.05)
    assert trainer_need_bytes(**KIMI, tokens_per_batch=32768) / GIB == pytest.approx(83.3, abs=0.05)
    small = trainer_need_bytes(trainable_params=10_000_000, hidden_size=512, tokens_per_batch=8192)
    assert small < trainer_need_bytes(**KIMI, tokens_per_batch=8192) / 10  # a smaller drafter needs less


def test_a_producer_share_that_leaves_too_little_is_refused_naming_both_numbers():
    need = trainer_need_bytes(**KIMI, tokens_per_batch=8192)
    problem = colocation_problem(H200, 0.9, need)  # vLLM's default --gpu-memory-utilization
    assert "126.0 GiB" in problem and "44.4 GiB" in problem and "--gpu-memory-utilization 0.65" in problem
    assert colocation_problem(H200, 0.6, need) is None
    assert "does not fit beside any producer" in colocation_problem(40 * GIB, 0.1, need)


def test_the_trainer_refuses_before_its_first_step_and_records_what_it_checked(world, tmp_path,  # noqa: F811
                                                                              monkeypatch):
    monkeypatch.setattr(colocation, "card_bytes", lambda device: GIB)  # a 1 GiB card, as the CPU run's device
    cfg = config_for(world, tmp_path / "refused", max_steps=2, epochs="null", **{"data.producer_gpu_fraction": 0.99})
    with pytest.raises(ConfigError, match=r"producer holds 1\.0 GiB .* trainer needs ~0\.\d GiB"):
        run_train(cfg)
    assert not (tmp_path / "refused" / "final").exists()
    out = run_train(config_for(world, tmp_path / "fits", max_steps=2, epochs="null",
                               **{"data.producer_gpu_fraction": 0.5}))
    got = json.loads((out / "manifest.json").read_text())["colocation"]
    assert got["card_gib"] == 1.0 and got["producer_gib"] == 0.5 and 0 < got["trainer_need_gib_estimate"] < 0.47


def test_a_share_outside_0_1_is_a_config_error(world, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="between 0 and 1"):
        config_for(world, tmp_path, **{"data.producer_gpu_fraction": 1.5})
