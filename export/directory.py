"""Files of an exported drafter directory, any format: write (config.json + model.safetensors) and
validate from disk against `export/spec.py`, through the format's own members (export/formats.py);
each format's module loads its directory back (export/format_sglang.py, export/format_speculators.py).

`FormatDirectory` is what every format shares, the one place for "write, validate, round trip": each
format class extends it with its own config, checks and loader.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from export import spec
from eagle3.config.dtypes import torch_dtype
from eagle3.formats.manifest import atomic_write_json
from export.roundtrip import RoundTripReference
from export.sources import ExportError

CONFIG, WEIGHTS = spec.CONFIG_FILE, spec.WEIGHTS_FILE
# Files a server would also pick up as weights (SGLang/vLLM glob the top directory).
STRAY_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class _Header:
    """Shape and dtype of one stored tensor, read from the safetensors header (no data loaded)."""

    def __init__(self, shape: list[int], dtype: torch.dtype):
        self.shape, self.dtype = tuple(shape), dtype


def export_tensors(state: Mapping[str, torch.Tensor], fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Canonical (SGLang-named) drafter tensors -> the `fmt` names, weights cast to `dtype`,
    d2t int64, t2d bool, contiguous CPU copies (safetensors refuses shared or strided storage)."""
    out = {}
    for name, t in state.items():
        t = t.detach().to("cpu")
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif t.is_floating_point():
            t = t.to(dtype)
        out[spec.to_format_name(name, fmt)] = t.contiguous().clone()
    return out


def write_format_dir(path: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                     fmt: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # one metadata key only: safetensors writes metadata from a hash map, so several keys come out in a
    # random order and the same export would not be byte-identical from one run to the next
    save_file(dict(tensors), str(path / WEIGHTS), metadata={"format": "pt"})
    atomic_write_json(path / CONFIG, dict(config))


def read_headers(weights: Path) -> dict[str, _Header]:
    with safe_open(str(weights), framework="pt") as f:
        out = {}
        for name in f.keys():
            sl = f.get_slice(name)
            dt = sl.get_dtype()
            out[name] = _Header(sl.get_shape(), _SAFETENSORS_DTYPES.get(dt, dt))
        return out


def validate_format_dir(path: Path, form, *, vocab_size: int, max_position_embeddings: int,
                        hf_indices: list[int], dtype: str,
                        rope: Optional[tuple[float, Any]], embed_tokens: bool | torch.Tensor = False) -> list[str]:
    """Everything wrong with the directory of format `form` (an ExportFormat) at `path`, read from disk: config fields, every tensor
    name / shape / dtype, d2t/t2d consistency, non-finite weights, stray weight files. `embed_tokens` (speculators
    only): the directory must also hold `embed_tokens.weight`, equal to this tensor (the target's, [V, H]) when
    one is given; False: it must not."""
    path = Path(path)
    cfg_path, w_path = path / CONFIG, path / WEIGHTS
    if not cfg_path.is_file() or not w_path.is_file():
        return [f"{path}: missing {CONFIG if not cfg_path.is_file() else WEIGHTS}"]
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        return [f"{cfg_path}: not valid JSON ({e})"]
    problems = [f"{p.name}: would be loaded as weights too" for p in path.iterdir()
                if p.is_file() and p.name != WEIGHTS and p.suffix in STRAY_WEIGHT_SUFFIXES]
    draft_v = int(cfg.get("draft_vocab_size") or 0)
    problems += form.config_problems(cfg, vocab_size=vocab_size, draft_vocab_size=draft_v,
                                     max_position_embeddings=max_position_embeddings,
                                     hf_indices=hf_indices, dtype=dtype, rope=rope)
    try:
        shape = spec.DrafterShape.from_hf_dict(form.shape_config(cfg))
    except (KeyError, TypeError, ValueError) as e:
        return [f"{cfg_path}: {e}"] + problems
    try:
        headers = read_headers(w_path)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        return problems + [f"{w_path}: unreadable safetensors file ({e})"]
    with_embed = form.ships_embed and embed_tokens is not False
    problems += spec.tensor_problems(headers, spec.expected_tensors(shape, form.name, torch_dtype(dtype), with_embed))
    try:
        with safe_open(str(w_path), framework="pt") as f:
            if with_embed and isinstance(embed_tokens, torch.Tensor) and spec.EMBED in headers:
                problems += spec.embed_problems(f.get_tensor(spec.EMBED), embed_tokens)
            if "d2t" in headers and "t2d" in headers:
                problems += spec.vocab_mapping_problems(f.get_tensor("d2t"), f.get_tensor("t2d"),
                                                        shape.draft_vocab_size, shape.vocab_size)
            problems += spec.nonfinite_problems({n: f.get_tensor(n) for n in headers
                                                 if headers[n].dtype in (torch.bfloat16, torch.float16, torch.float32)})
    except Exception as e:
        problems.append(f"{w_path}: cannot read tensor data ({e}); truncated or corrupt file")
    return [f"{form.name}: {p}" for p in problems]


class FormatDirectory:
    """The members every ExportFormat shares (export/formats.py): where its directory goes, the check of a
    written one from disk, and write + validate + round trip. A format class sets `name`, `subdir`,
    `ships_embed` and adds `build_config`, `config_problems`, `shape_config`, `load`, `serve_command`."""
    name: str
    subdir: str = ""
    ships_embed: bool = False

    def dir_in(self, out_dir: Path) -> Path:
        """Where this format's directory goes under out_dir ("" = out_dir itself)."""
        return Path(out_dir) / self.subdir if self.subdir else Path(out_dir)

    def problems(self, out_dir: Path, expected: Mapping[str, Any], embed_tokens: bool | torch.Tensor = False) -> list[str]:
        """Everything wrong with this format's directory under out_dir (validate_format_dir)."""
        return validate_format_dir(self.dir_in(out_dir), self, **expected, embed_tokens=embed_tokens)

    def write_checked(self, out_dir: Path, config: Mapping[str, Any], roundtrip: RoundTripReference,
                      embed: torch.Tensor, ship_embed: bool, expected: Mapping[str, Any]) -> dict:
        """Write this format's directory under out_dir (the export's temp directory), validate it from disk,
        load it back and compare it with the checkpoint; returns the round trip's stats. Raises ExportError
        at the first step that fails."""
        d, dtype = self.dir_in(out_dir), roundtrip.dtype
        try:
            tensors = export_tensors(roundtrip.reference.export_state_dict(), self.name, dtype)
            if ship_embed:  # the target's, for speculators' Python API (SERVE.md says when)
                tensors[spec.EMBED] = embed.to(dtype).contiguous().clone()
            write_format_dir(d, config, tensors, self.name)
        except Exception as e:  # OSError, or safetensors' own error wrapping one (disk full, quota, EFBIG)
            raise ExportError(f"writing the {self.name} directory failed", [
                f"{d}: {e}; free space under {Path(out_dir).parent} and rerun (the previous export, if any, "
                f"is untouched)"]) from e
        problems = self.problems(out_dir, expected, embed if ship_embed else False)
        if problems:
            raise ExportError(f"the written {self.name} directory failed validation", problems)
        problems, stats = roundtrip.check(self.load(d, embed))
        if problems:
            raise ExportError(f"the {self.name} export does not reproduce the checkpoint", problems)
        return stats
