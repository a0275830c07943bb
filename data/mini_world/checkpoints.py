"""Builders of small, shape-faithful target checkpoints: a DeepSeek-V3 (MLA + MoE) text config,
a plain causal-LM checkpoint (the Kimi-K2 stand-in), and the Kimi-K2.5 multimodal layout
(`Kimi_K25` config with `text_config`, text weights under `language_model.`).

transformers 5.24's `save_pretrained` of `Kimi_K25ForConditionalGeneration` does not write the
names of the released checkpoint (it writes `language_model.model.blocks.N.*`,
`vision_tower.encoder.patch_embed.*`, `model.mm_projector.pre_norm.*`); `save_kimi_k25` renames
them to the released ones (`language_model.model.layers.N.*`, `vision_tower.patch_embed.*`,
`mm_projector.pre_norm.*`), which transformers reloads and other loaders (SGLang) expect.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from data.mini_world.tokenizer import train_tokenizer  # noqa: F401  (re-exported: one import for fixtures)

# released-checkpoint name <- name transformers 5.24 writes (prefix renames, applied once each)
KIMI_K25_RELEASED_PREFIXES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ("model.mm_projector.pre_norm.", "mm_projector.pre_norm."),
)
WEIGHTS = "model.safetensors"


def deepseek_v3_config(**overrides: Any):
    """A small DeepSeek-V3 text config with Kimi-K2's structural choices: MLA attention (q/kv
    LoRA ranks, decoupled rope dims), MoE from layer 1 (`first_k_dense_replace=1`) with a shared
    expert, one routing group, no MTP layer, untied embeddings. Overrides win."""
    from transformers import DeepseekV3Config

    kw: dict[str, Any] = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_nextn_predict_layers=0, initializer_range=0.02,
    )
    kw.update(overrides)
    if kw.get("num_mtp_layers") is not None:  # the alias; keep one spelling
        kw["num_nextn_predict_layers"] = kw.pop("num_mtp_layers")
    cfg = DeepseekV3Config(**kw)
    if cfg.num_hidden_layers < 1 or cfg.num_mtp_layers != kw["num_nextn_predict_layers"]:
        raise ValueError(f"unexpected DeepSeek-V3 config: {cfg}")
    return cfg


def kimi_k25_vision_config(**overrides: Any):
    """A minimal Kimi-K2.5 vision tower config (one layer, width 16): present only so the
    checkpoint has the real layout; the text path never runs it."""
    from transformers.models.kimi_k25 import Kimi_K25VisionConfig

    kw: dict[str, Any] = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1,
                              num_attention_heads=2, num_hidden_layers=1, hidden_size=16, intermediate_size=32)
    kw.update(overrides)
    return Kimi_K25VisionConfig(**kw)


def _finish_dir(tmp: Path, out_dir: Path) -> Path:
    """Move a fully written temp dir into place (replacing an old one), so a reader never sees
    a half-written checkpoint."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def _tmp_dir_next_to(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    """`tokenizer` is a loaded tokenizer, a tokenizer directory, or None (no tokenizer files)."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, Path)):
        for f in Path(tokenizer).iterdir():
            if f.is_file():
                shutil.copy2(f, out_dir / f.name)
    else:
        tokenizer.save_pretrained(str(out_dir))


def save_causal_lm(model, tokenizer, out_dir: Path | str) -> Path:
    """Save a `DeepseekV3ForCausalLM` (weights `model.layers.N.*`, `lm_head.weight`, experts
    unfused as in the released checkpoints) plus its tokenizer, atomically. Returns `out_dir`."""
    out_dir = Path(out_dir)
    tmp = _tmp_dir_next_to(out_dir)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        _save_tokenizer(tokenizer, tmp)
        return _finish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def kimi_k25_config(text_config, vision_config=None, image_token_id=None):
    """`Kimi_K25Config` around a DeepSeek-V3 text config. `tie_word_embeddings=False` at both
    levels: the wrapper's default (True) would otherwise win and tie lm_head to the embeddings.
    `image_token_id`: the tokenizer's `<|media_pad|>` (None: K2.5's 163605, the class default)."""
    from transformers.models.kimi_k25 import Kimi_K25Config

    vision_config = vision_config or kimi_k25_vision_config()
    text = text_config.to_dict()
    text["tie_word_embeddings"] = False
    extra = {} if image_token_id is None else {"image_token_id": int(image_token_id)}
    if image_token_id is not None and not 0 <= int(image_token_id) < text_config.vocab_size:
        raise ValueError(f"image_token_id {image_token_id} is outside the text model's vocab "
                         f"({text_config.vocab_size}): the tokenizer's media tokens need embedding rows")
    cfg = Kimi_K25Config(text_config=text, vision_config=vision_config.to_dict(),
                         projection_hidden_size=vision_config.hidden_size, tie_word_embeddings=False,
                         bos_token_id=text_config.bos_token_id, eos_token_id=text_config.eos_token_id,
                         pad_token_id=text_config.pad_token_id, **extra)
    cfg.text_config.tie_word_embeddings = False
    return cfg


def build_kimi_k25(text_model, vision_config=None, seed: int = 0, image_token_id=None):
    """A `Kimi_K25ForConditionalGeneration` whose text model and lm_head are copies of
    `text_model`'s (a DeepseekV3ForCausalLM); the tiny vision tower is random from `seed`."""
    import torch
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    cfg = kimi_k25_config(text_model.config, vision_config, image_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapper = Kimi_K25ForConditionalGeneration(cfg)
    wrapper.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
    wrapper.lm_head.load_state_dict(text_model.lm_head.state_dict(), strict=True)
    wrapper.to(text_model.dtype)
    return wrapper


def released_kimi_k25_name(name: str) -> str:
    for written, released in KIMI_K25_RELEASED_PREFIXES:
        if name.startswith(written):
            return released + name[len(written):]
    return name


def save_kimi_k25(text_model, tokenizer, out_dir: Path | str, *, vision_config=None, seed: int = 0,
                  image_token_id=None) -> Path:
    """Save `text_model` (a DeepseekV3ForCausalLM) in the Kimi-K2.5 checkpoint layout with a tiny random
    vision tower / projector (`build_kimi_k25`); see `save_kimi_k25_wrapper`."""
    return save_kimi_k25_wrapper(build_kimi_k25(text_model, vision_config, seed, image_token_id), tokenizer, out_dir)


def save_kimi_k25_wrapper(wrapper, tokenizer, out_dir: Path | str) -> Path:
    """Save a `Kimi_K25ForConditionalGeneration` in the Kimi-K2.5 checkpoint layout: config
    `Kimi_K25` with `text_config`, text weights `language_model.model.layers.N.*`,
    `language_model.model.embed_tokens.weight`, `language_model.model.norm.weight`,
    `language_model.lm_head.weight`, the vision tower / projector under the released names.
    Atomic; returns `out_dir`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = _tmp_dir_next_to(out_dir)
    try:
        wrapper.save_pretrained(str(tmp), safe_serialization=True)
        shards = sorted(tmp.glob("*.safetensors"))
        tensors = {}
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                for k in f.keys():
                    tensors[released_kimi_k25_name(k)] = f.get_tensor(k)
            shard.unlink()
        (tmp / "model.safetensors.index.json").unlink(missing_ok=True)
        _check_kimi_names(tensors, wrapper.config.text_config.num_hidden_layers)
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        _save_tokenizer(tokenizer, tmp)
        return _finish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_kimi_names(tensors: dict, num_layers: int) -> None:
    """The names other loaders rely on must be there, and no transformers-only spelling left."""
    need = {"language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
            "language_model.lm_head.weight"}
    need |= {f"language_model.model.layers.{i}.input_layernorm.weight" for i in range(num_layers)}
    missing = need - set(tensors)
    stray = [k for k in tensors if ".blocks." in k and k.startswith("language_model.")
             or k.startswith("model.") or k.startswith("vision_tower.encoder.patch_embed.")]
    if missing or stray:
        raise RuntimeError(f"Kimi-K2.5 layout check failed: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(stray)[:5]} (transformers' save names changed?)")


def checkpoint_weight_names(ckpt_dir: Path | str) -> list[str]:
    """All tensor names stored in a checkpoint directory (single file or sharded)."""
    from safetensors import safe_open

    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for shard in sorted(ckpt_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            names.extend(f.keys())
    return sorted(names)


def seeing_vision_config(image_size: int, *, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                         intermediate_size: int):
    """A tiny Kimi-K2.5 vision tower that reads real images: K2.5's patch (14) and 2 x 2 merge, a position
    table as large as a `image_size`-pixel square's patch grid (the largest image it is meant for)."""
    side = max(2, image_size // 14)
    return kimi_k25_vision_config(patch_size=14, pos_emb_height=side, pos_emb_width=side, pos_emb_time=4,
                                  num_attention_heads=num_attention_heads, num_hidden_layers=num_hidden_layers,
                                  hidden_size=hidden_size, intermediate_size=intermediate_size)
