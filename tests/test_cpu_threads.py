"""Thread counts on a small shared CPU (eagle3/cpu_threads.py): the small-op rule the mini world's joint vision
step uses, and the block that sets torch's count and puts it back."""
import pytest
import torch

from data.mini_world.vision import vision_threads
from eagle3.cpu_threads import WAIT_POLICY, small_op_threads, torch_threads


def test_small_op_threads_is_one_only_when_idle_threads_sleep(monkeypatch):
    monkeypatch.setenv(WAIT_POLICY, "passive")
    assert small_op_threads(4) == 1
    monkeypatch.setenv(WAIT_POLICY, "ACTIVE")
    assert small_op_threads(4) == 4
    monkeypatch.delenv(WAIT_POLICY)
    assert small_op_threads(3) == 3


def test_torch_threads_sets_the_count_inside_and_restores_it_after_an_error():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"):
        with torch_threads(other):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def test_vision_threads_a_pinned_count_wins_else_the_cpu_small_op_rule(monkeypatch):
    monkeypatch.setenv(WAIT_POLICY, "PASSIVE")
    cpu = torch.device("cpu")
    assert vision_threads(3, cpu) == 3                     # the config pins it
    assert vision_threads(0, cpu) == 1                     # auto, idle threads sleep: one thread
    assert vision_threads(0, torch.device("cuda")) == torch.get_num_threads()  # on a GPU the count is left alone
    monkeypatch.setenv(WAIT_POLICY, "ACTIVE")
    assert vision_threads(0, cpu) == torch.get_num_threads()
