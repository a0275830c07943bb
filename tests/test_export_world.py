"""A tiny world for the export tests: a trained-looking drafter checkpoint (random weights, fp32),
the capture it was "trained" on (a hidden-state store), both for the `tiny_k25_target` fixture.
Imported by tests/test_export*.py; its own tests check the world is consistent."""
import json
from pathlib import Path

import torch

from eagle3.manifest import write_manifest
from eagle3.model import DrafterConfig, Eagle3Drafter
from eagle3.store import HiddenStateStore, HiddenStateWriter
from eagle3.target_io import read_text_config
from eagle3.vocab_map import d2t_from_ids, t2d_from_ids

# h the tiny drafters read, and the SGLang ids that mean h in every SGLang version (h - 1: first id 1)
AUX_IDS, HF_INDICES = [1, 3, 5], [2, 4, 6]
DRAFTER = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               vocab_size=512, draft_vocab_size=40, target_hidden_size=64, aux_hf_indices=HF_INDICES,
               max_position_embeddings=128, rope_theta=10000.0, torch_dtype="float32")


def tiny_drafter(seed: int = 0, **over) -> Eagle3Drafter:
    """Random weights (norms perturbed so they matter), a random sorted draft vocab."""
    g = torch.Generator().manual_seed(seed)
    cfg = DrafterConfig(**{**DRAFTER, **over})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name != "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ids = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size]).values
    model.set_vocab_mapping(d2t_from_ids(ids), t2d_from_ids(ids, cfg.vocab_size))
    return model


def write_store(store_dir: Path, num_sequences: int = 3, seed: int = 0, hidden: int = 64,
                hf_indices=HF_INDICES) -> Path:
    g = torch.Generator().manual_seed(seed)
    w = HiddenStateWriter(store_dir, hidden_size=hidden, target_hidden_size=hidden, hf_indices=list(hf_indices),
                          dtype="float32", shard_tokens=64)
    for i in range(num_sequences):
        T = 20 + 7 * i
        w.add(f"seq-{i}", torch.randint(0, 512, (T,), generator=g), torch.ones(T, dtype=torch.bool),
              torch.randn(T, len(hf_indices) * hidden, generator=g), torch.randn(T, hidden, generator=g),
              torch.randint(0, 512, (T,), generator=g))
    w.finish()
    return store_dir


def build_world(root: Path, target: Path) -> dict:
    """root/stages/k25_mini/{train-aqmedai_k2/final, capture/validation} for `target` (kimi_k25 layout)."""
    from eagle3.drafter_io import save_drafter_dir

    stages = Path(root) / "stages" / "k25_mini"
    text = read_text_config(target, "kimi_k25")
    model = tiny_drafter(bos_token_id=text.get("bos_token_id"), eos_token_id=text.get("eos_token_id"))
    ckpt = save_drafter_dir(model, stages / "train-aqmedai_k2" / "final", dtype="float32")
    capture = stages / "capture"
    store = write_store(capture / "validation")
    write_manifest(capture, "capture", {"note": "export test world"})
    return {"root": Path(root), "target": Path(target), "checkpoint": ckpt, "capture": capture, "store": store}


def test_world_is_consistent(tmp_path, tiny_k25_target):
    w = build_world(tmp_path, tiny_k25_target)
    store = HiddenStateStore(w["store"])
    cfg = json.loads((w["checkpoint"] / "config.json").read_text())
    assert store.hf_indices == HF_INDICES and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert store.target_hidden_size == cfg["target_hidden_size"] == read_text_config(tiny_k25_target, "kimi_k25")["hidden_size"]
    assert cfg["max_position_embeddings"] == 128 < read_text_config(tiny_k25_target, "kimi_k25")["max_position_embeddings"]
