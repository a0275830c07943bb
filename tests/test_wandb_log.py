"""eval/wandb_log.log_run: one run per measurement with its metrics and plots; disabled does nothing;
a failing wandb costs nothing but a warning (a stand-in `wandb` module records the calls)."""
import sys
from types import SimpleNamespace

from eval.wandb_log import log_run


class FakeWandb:
    def __init__(self, fail: bool = False):
        self.fail, self.calls = fail, []

    def init(self, **kw):
        if self.fail:
            raise RuntimeError("no network")
        self.calls.append(("init", kw))
        return SimpleNamespace(log=lambda d: self.calls.append(("log", d)), finish=lambda: self.calls.append(("finish",)))

    def Image(self, path):
        return ("image", path)


def cfg(mode):
    return SimpleNamespace(wandb=SimpleNamespace(mode=mode, project="p", entity=None, name=None, group="g", tags=["t"]))


def test_log_run_logs_metrics_and_plots_once(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert log_run(cfg("offline"), "eval-x", {"eval/acc_step0": 0.5}, {"curve": "c.png"}, tmp_path) == "offline"
    (_, init), (_, logged), finish = fake.calls
    assert init["name"] == "eval-x" and init["group"] == "g" and init["dir"] == str(tmp_path)
    assert logged == {"eval/acc_step0": 0.5, "plots/curve": ("image", str(tmp_path / "c.png"))} and finish == ("finish",)
    assert log_run(cfg("disabled"), "eval-x", {}, {}, tmp_path) is None and len(fake.calls) == 3


def test_log_run_failure_is_a_warning_not_an_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail=True))
    assert log_run(cfg("offline"), "bench-serve-x", {"a": 1.0}, {}, tmp_path) == "failed: no network"
    assert "wandb logging failed" in caplog.text
