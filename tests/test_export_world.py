"""The export tests' world (tests/fixtures/export_world.py) is consistent."""
import json

from eagle3.formats.store import HiddenStateStore
from eagle3.target_model.target_io import read_text_config
from tests.fixtures.export_world import AUX_IDS, HF_INDICES, build_world


def test_world_is_consistent(tmp_path, tiny_k25_target):
    w = build_world(tmp_path, tiny_k25_target)
    store = HiddenStateStore(w["store"])
    cfg = json.loads((w["checkpoint"] / "config.json").read_text())
    assert store.hf_indices == HF_INDICES and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert store.target_hidden_size == cfg["target_hidden_size"] == read_text_config(tiny_k25_target, "kimi_k25")["hidden_size"]
    assert cfg["max_position_embeddings"] == 128 < read_text_config(tiny_k25_target, "kimi_k25")["max_position_embeddings"]
