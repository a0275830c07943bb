"""The toy training world of tests/fixtures/train_world.py is what the train tests assume."""
import torch

from eagle3.target_model.target_io import load_lm_head_rows
from eagle3.drafter.vocab_map import t2d_from_ids
from tests.fixtures.train_world import write_world


def test_toy_world_is_consistent(tmp_path, tiny_k25_target):
    """The toy's stored target argmax is the teacher's top token and mostly inside the draft vocab."""
    from eagle3.ttt.loss import loss_positions
    from eagle3.formats.store import HiddenStateStore

    world = write_world(tmp_path, tiny_k25_target, n_train=4, n_val=2)
    store = HiddenStateStore(world["capture"] / "train")
    head = load_lm_head_rows(tiny_k25_target, "kimi_k25").float()
    item = store[0]
    full = item["last"].float() @ head.t()
    assert torch.equal(full.argmax(-1), item["target_argmax"])
    t2d = t2d_from_ids(world["vocab_ids"], head.shape[0])
    valid = loss_positions(item["loss_mask"][None], item["target_argmax"][None], t2d)
    assert valid.float().mean() > 0.5
    # the next token is what the target predicts (a learnable successor rule)
    assert (item["target_argmax"][:-1] == item["input_ids"][1:]).float().mean() > 0.9
