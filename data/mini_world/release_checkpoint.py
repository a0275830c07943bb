"""A small target in the Kimi-K2.5 release's own INT4 format (eagle3/formats/release_format.py): the same
layout, names and config.json as `save_kimi_k25` writes, with the routed experts of the MoE layers
quantised and packed by compressed-tensors (group 32, int4, bf16 scales) and every other weight
bf16, as in the ~600 GB release. Tests load it through `target=kimi_k25`'s real path."""
from __future__ import annotations

import json
from pathlib import Path

from data.mini_world.checkpoints import WEIGHTS, _finish_dir, _tmp_dir_next_to, save_kimi_k25
from eagle3.formats.release_format import to_release_tensors, with_release_quantization


def save_kimi_k25_release(text_model, tokenizer, out_dir: Path | str, *, vision_config=None, seed: int = 0) -> Path:
    """`text_model` (a DeepseekV3ForCausalLM) saved as the K2.5 release stores it. Atomic; returns out_dir."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = _tmp_dir_next_to(out_dir)
    try:
        save_kimi_k25(text_model, tokenizer, tmp, vision_config=vision_config, seed=seed)
        with safe_open(str(tmp / WEIGHTS), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        first_k = int(text_model.config.first_k_dense_replace)
        save_file(to_release_tensors(tensors, first_k), str(tmp / WEIGHTS), metadata={"format": "pt"})
        config = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps(with_release_quantization(config), indent=2) + "\n")
        return _finish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
