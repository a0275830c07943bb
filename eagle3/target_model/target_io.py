"""The target model: its text config, single tensors straight from its safetensors checkpoint,
loading it (plain causal LM or the Kimi-K2.5 multimodal wrapper, text path only), and forward
hooks that capture the aux hidden states EAGLE-3 needs.

Aux states are named by h, the Hugging Face `output_hidden_states` index (eagle3/engines/aux_layers.py:
h = i + 1 is the OUTPUT of decoder layer i = the residual stream SGLang and vLLM capture entering
loop index h). The hooks here sit on the decoder layers' outputs (layer h - 1 for h) and on the
final norm (the post-norm state lm_head consumes), so all 62 states of Kimi-K2.5 are never kept alive.

Imports only torch, safetensors and transformers (runs on the GPU machine).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.formats import release_format
from eagle3.formats.weight_files import INDEX, WEIGHTS, indexed_files
from eagle3.config.choices import TARGET_LAYOUTS as LAYOUTS
from eagle3.config.dtypes import torch_dtype
from eagle3.errors import StageError

REQUIRED_TEXT_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings")

# Checkpoint names for the tensors other stages read without loading the model, per layout
# (the layout's own names first; the other layout's as a fallback for re-saved checkpoints).
EMBED_NAMES = {
    "kimi_k25": ["language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                 "model.embed_tokens.weight"],
    "causal_lm": ["model.embed_tokens.weight", "language_model.model.embed_tokens.weight"],
}
LM_HEAD_NAMES = {
    "kimi_k25": ["language_model.lm_head.weight", "lm_head.weight"],
    "causal_lm": ["lm_head.weight", "language_model.lm_head.weight"],
}
FINAL_NORM_NAMES = {  # the text model's final RMSNorm (what turns the last layer's output into lm_head's input)
    "kimi_k25": ["language_model.model.norm.weight", "model.language_model.norm.weight", "model.norm.weight"],
    "causal_lm": ["model.norm.weight", "language_model.model.norm.weight"],
}
# Module paths (attribute chains) of the text decoder stack: HF-native Kimi_K25ForConditionalGeneration,
# Kimi's remote-code wrapper (language_model is a full causal LM), plain causal LMs.
TEXT_MODEL_PATHS = ("model.language_model", "language_model.model", "model")
LM_HEAD_PATHS = ("lm_head", "language_model.lm_head")
# Parameter names of the text path inside the Kimi wrapper (HF-native and remote code); the rest is the
# vision tower, which capture never runs.
TEXT_PARAM_PREFIXES = ("model.language_model.", "language_model.", "lm_head.")


class TargetError(StageError, RuntimeError):
    """A target directory / checkpoint / model that cannot be used, with the reason."""


def tokenizer_from(path, trust_remote_code: bool = False, name: str = "tokenizer"):
    """The tokenizer at `path`: a directory, or a Hub id already in the local HF cache. Nothing is downloaded at
    run time, so a wrong path fails at once (the Hub client would retry for ~45 s first). TargetError names
    `name=path` and the cause."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:
        raise TargetError(f"cannot load the tokenizer from {name}={path} (a directory, or a Hub id already in the "
                          f"local cache: nothing is downloaded at run time): {e}") from e


def load_tokenizer(target):
    """The target's tokenizer (`target`: a TargetConf), or TargetError naming target.tokenizer and the cause."""
    return tokenizer_from(target.tokenizer, target.trust_remote_code, "target.tokenizer")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise TargetError(f"target layout {layout!r}: expected one of {LAYOUTS}")


def read_full_config(target_path: str | Path) -> dict:
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise TargetError(f"target {target_path}: no config.json (missing or not a model directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TargetError(f"{path}: unreadable ({e})") from e


def read_text_config(target_path: str | Path, layout: str) -> dict:
    """The text model's config as a dict (for kimi_k25: `text_config` of the Kimi_K25 config).
    Has at least hidden_size, num_hidden_layers, vocab_size, max_position_embeddings; rope settings
    are whatever the checkpoint states (`rope_parameters` / `rope_theta` / `rope_scaling`)."""
    _check_layout(layout)
    return _text_config(read_full_config(target_path), target_path, layout)


def _text_config(cfg: dict, target_path: str | Path, layout: str) -> dict:
    if layout == "kimi_k25":
        if "text_config" not in cfg:
            raise TargetError(f"{target_path}/config.json: layout kimi_k25 needs a `text_config` "
                              f"(model_type={cfg.get('model_type')!r}); is this a plain causal LM (layout causal_lm)?")
        text = dict(cfg["text_config"])
    else:
        if "text_config" in cfg:
            raise TargetError(f"{target_path}/config.json has a `text_config` (a multimodal wrapper, "
                              f"model_type={cfg.get('model_type')!r}); use layout kimi_k25")
        text = dict(cfg)
    missing = [k for k in REQUIRED_TEXT_KEYS if k not in text]
    if missing:
        raise TargetError(f"{target_path}/config.json: text config lacks {missing}")
    return text


@dataclass(frozen=True)
class TargetParts:
    """What a drafter built for a target takes from it (read_target_parts)."""
    text: dict                    # the text model's config (read_text_config)
    embed_tokens: torch.Tensor    # [V, H], the drafter's frozen embedding
    lm_head_rows: torch.Tensor    # [N, H], the lm_head rows of the draft vocab


def read_target_parts(target_path: str | Path, layout: str, rows: torch.Tensor) -> TargetParts:
    """The text config, the embeddings and the lm_head `rows` of a target, in one pass over its config.json
    and weight files (ids out of the head's range: TargetError)."""
    _check_layout(layout)
    full = read_full_config(target_path)
    text = _text_config(full, target_path, layout)
    files = _weight_files(Path(target_path))
    embed = _read_tensor(*_find_tensor(target_path, EMBED_NAMES[layout], files))
    return TargetParts(text, embed, _lm_head_rows(target_path, layout, full, files, rows))


def _weight_files(target_path: Path) -> dict[str, Path]:
    """Tensor name -> shard file, by the one rule (eagle3/formats/weight_files.py): the index, else a single file."""
    files = indexed_files(target_path)
    if files is not None:
        return files
    single = target_path / WEIGHTS
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise TargetError(f"target {target_path}: no {INDEX} or {WEIGHTS}")


def _find_tensor(target_path: str | Path, names: list[str], files: dict[str, Path] | None = None) -> tuple[str, Path]:
    """(stored name, file) of the first of `names` the checkpoint has (`files`: its weight files, when listed)."""
    files = _weight_files(Path(target_path)) if files is None else files
    for name in names:
        if name in files:
            if not files[name].is_file():
                raise TargetError(f"{files[name]}: shard named in the index for {name!r} is missing")
            return name, files[name]
    quantized = [n for n in files if any(n.startswith(c.rsplit(".", 1)[0] + ".") for c in names)]
    hint = f"; found only {quantized[:4]} (quantized? these tensors must be stored unquantized)" if quantized else ""
    raise TargetError(f"target {target_path}: none of {names} in the checkpoint{hint}")


def _read_tensor(name: str, file: Path) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name)


def load_checkpoint_tensor(target_path: str | Path, names: list[str]) -> torch.Tensor:
    """Read ONE tensor, the first of `names` the checkpoint has, without loading the model."""
    return _read_tensor(*_find_tensor(target_path, names))


def load_embed_tokens(target_path: str | Path, layout: str) -> torch.Tensor:
    """The target's input embedding [V, H] (the drafter's frozen embedding)."""
    _check_layout(layout)
    return load_checkpoint_tensor(target_path, EMBED_NAMES[layout])


def load_final_norm(target_path: str | Path, layout: str) -> torch.Tensor:
    """The weight [H] of the text model's final norm (an engine that returns the last layer's output
    un-normed needs it to make the post-norm state lm_head reads)."""
    _check_layout(layout)
    return load_checkpoint_tensor(target_path, FINAL_NORM_NAMES[layout])


def load_lm_head_rows(target_path: str | Path, layout: str, rows: torch.Tensor | None = None,
                      block_rows: int = 8192) -> torch.Tensor:
    """Rows of the target's lm_head [N, H] (all rows when `rows` is None), read block by block
    so that only the wanted rows are ever materialised (the full K2.5 head is 2.3 GB)."""
    _check_layout(layout)
    return _lm_head_rows(target_path, layout, None, _weight_files(Path(target_path)), rows, block_rows)


def _lm_head_rows(target_path: str | Path, layout: str, full: dict | None, files: dict[str, Path],
                  rows: torch.Tensor | None, block_rows: int = 8192) -> torch.Tensor:
    """The rows from the listed `files`; `full`: the config.json, when read (else read if the head is absent)."""
    try:
        name, file = _find_tensor(target_path, LM_HEAD_NAMES[layout], files)
    except TargetError:
        # a tied head is the embedding; Kimi_K25Config's top-level tie_word_embeddings wins over text_config's
        # (docs/design.md "Sources")
        full = read_full_config(target_path) if full is None else full
        if not bool(full.get("tie_word_embeddings", layout == "kimi_k25")):
            raise
        name, file = _find_tensor(target_path, EMBED_NAMES[layout], files)
    with safe_open(str(file), framework="pt") as f:
        sl = f.get_slice(name)
        V = sl.get_shape()[0]
        if rows is None:
            return f.get_tensor(name)
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= V):
            raise TargetError(f"lm_head rows out of range [0, {V}): min {int(rows.min())}, max {int(rows.max())}")
        out = None
        for start in range(0, V, block_rows):
            sel = ((rows >= start) & (rows < start + block_rows)).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            block = sl[start:start + block_rows]
            if out is None:
                out = torch.empty(rows.numel(), block.shape[1], dtype=block.dtype)
            out[sel] = block[rows[sel] - start]
        if out is None:
            H = sl.get_shape()[1]
            out = torch.empty(0, H, dtype=sl[0:1].dtype)
        return out


def _get_path(model: torch.nn.Module, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embed_tokens, layers, norm) inside a causal LM or a Kimi wrapper."""
    for path in TEXT_MODEL_PATHS:
        m = _get_path(model, path)
        if m is not None and hasattr(m, "layers") and hasattr(m, "norm"):
            return m
    raise TargetError(f"{type(model).__name__}: no text decoder found at any of {TEXT_MODEL_PATHS}")


def _text_config_of(model: torch.nn.Module):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The num_hidden_layers decoder layers (any MTP layers appended after them excluded)."""
    layers = text_model(model).layers
    return list(layers)[: _text_config_of(model).num_hidden_layers]


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    return text_model(model).norm


def lm_head(model: torch.nn.Module) -> torch.nn.Module:
    for path in LM_HEAD_PATHS:
        m = _get_path(model, path)
        if m is not None:
            return m
    raise TargetError(f"{type(model).__name__}: no lm_head at any of {LM_HEAD_PATHS}")


def input_device(model: torch.nn.Module) -> torch.device:
    """Where inputs go: the embedding's device (with device_map the model spans several GPUs)."""
    return text_model(model).embed_tokens.weight.device


def load_target(path: str | Path, layout: str, dtype: str = "bfloat16", device_map: str | dict | None = None,
                trust_remote_code: bool = False):
    """(model in eval mode, text_config dict). kimi_k25: HF-native Kimi_K25ForConditionalGeneration
    (the checkpoint's own remote code only where transformers lacks it). With device_map (e.g.
    "auto" over 8 GPUs) the model spans devices: feed inputs to `input_device(model)`."""
    import transformers

    _check_layout(layout)
    text_config = read_text_config(path, layout)  # also: clear error for a missing target
    full = read_full_config(path)
    try:  # INT4 release format: names must match what config.json says, before 600 GB are read
        release_format.check_checkpoint(full, text_config, _weight_files(Path(path)), str(path))
    except release_format.ReleaseFormatError as e:
        raise TargetError(str(e)) from e
    kwargs = dict(dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code, output_loading_info=True)
    if device_map is not None:
        kwargs["device_map"] = device_map
    if layout == "kimi_k25" and hasattr(transformers, "Kimi_K25ForConditionalGeneration"):
        cls = transformers.Kimi_K25ForConditionalGeneration  # native class (tested); remote code only as fallback
    elif layout == "kimi_k25":
        if not (trust_remote_code and "auto_map" in full):
            raise TargetError(f"transformers {transformers.__version__} has no Kimi_K25 class and {path} offers no "
                              f"remote code (auto_map) or trust_remote_code is off")
        auto_map = full["auto_map"]
        cls = transformers.AutoModelForCausalLM if "AutoModelForCausalLM" in auto_map else transformers.AutoModel
    else:
        cls = transformers.AutoModelForCausalLM
    try:
        model, info = cls.from_pretrained(str(path), **kwargs)
    except Exception as e:
        raise TargetError(f"cannot load target {path} (layout {layout}) with {cls.__name__}: {e}") from e
    missing = [k for k in info.get("missing_keys", ()) if layout != "kimi_k25" or k.startswith(TEXT_PARAM_PREFIXES)]
    if missing:  # transformers would leave them randomly initialised
        raise TargetError(f"target {path}: {len(missing)} text-model weights not in the checkpoint (e.g. "
                          f"{sorted(missing)[:3]}); a checkpoint of another architecture or a damaged one")
    model.eval()
    decoder_layers(model), final_norm(model), lm_head(model)  # fail now if the structure is unexpected
    if release_format.is_packed_int4(release_format.quantization_config_of(full)):
        _experts_to_dtype(model, torch_dtype(dtype))
    return model, text_config


def _experts_to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """transformers dequantises INT4 routed experts into their scales' dtype (bf16) whatever dtype was
    asked for; the rest of the model is in `dtype` (and the router in float32, as transformers keeps it)."""
    for layer in decoder_layers(model):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        for p in experts.parameters() if experts is not None else ():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class AuxHiddenCapture:
    """Forward hooks that keep, per forward call, HF output_hidden_states[h] for each h of `hf_indices`
    (the output of decoder layer h - 1) and the final norm's output (the post-norm state lm_head reads).

        with AuxHiddenCapture(model, [2, 30, 58]) as cap:   # Kimi's h: outputs of layers 1, 29, 57
            text_model(model)(input_ids=..., attention_mask=...)
            cap.aux   # list of [B, T, H], in the order of hf_indices (each on its layer's device)
            cap.last  # [B, T, H]
    """

    def __init__(self, model: torch.nn.Module, hf_indices: list[int]):
        layers = decoder_layers(model)
        bad = [h for h in hf_indices if not 1 <= h <= len(layers)]
        if bad:
            raise TargetError(f"hidden-state indices {bad} are not decoder-layer outputs of this model "
                              f"(h in 1..{len(layers)}; h = 0 is the embeddings)")
        self.model, self.ids = model, [h - 1 for h in hf_indices]  # decoder layer whose output is h
        self._layers, self._norm = layers, final_norm(model)
        self._handles: list = []
        self._by_layer: dict[int, torch.Tensor] = {}
        self.last: torch.Tensor | None = None

    def _layer_hook(self, i: int):
        def hook(module, args, output):
            self._by_layer[i] = _first_tensor(output).detach()
        return hook

    def _norm_hook(self, module, args, output):
        self.last = _first_tensor(output).detach()

    def __enter__(self) -> "AuxHiddenCapture":
        for i in sorted(set(self.ids)):
            self._handles.append(self._layers[i].register_forward_hook(self._layer_hook(i)))
        self._handles.append(self._norm.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def aux(self) -> list[torch.Tensor]:
        missing = [i for i in self.ids if i not in self._by_layer]
        if missing:
            raise TargetError(f"no captured output for decoder layers {missing}: run a forward pass inside the context")
        return [self._by_layer[i] for i in self.ids]

    def aux_concat(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[B, T, len(ids)*H] on `device` (default: the post-norm state's device)."""
        device = device if device is not None else (self.last.device if self.last is not None else None)
        return torch.cat([a.to(device) for a in self.aux], dim=-1)

    def clear(self) -> None:
        self._by_layer.clear()
        self.last = None


@torch.no_grad()
def argmax_from_last(model: torch.nn.Module, last: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    """Target argmax [..] from the post-norm state [.., H] through lm_head, a chunk of tokens at a
    time so the full [tokens, V] logits never exist at once."""
    head = lm_head(model)
    flat = last.reshape(-1, last.shape[-1]).to(head.weight.device)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for s in range(0, flat.shape[0], chunk_tokens):
        out[s:s + chunk_tokens] = head(flat[s:s + chunk_tokens]).argmax(-1)
    return out.reshape(last.shape[:-1])
