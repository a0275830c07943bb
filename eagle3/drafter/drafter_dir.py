"""A drafter directory read once, headers only: `DrafterDir` (SGLang / AQ-MedAI / SpecForge layout).

A drafter directory is `config.json` (a `LlamaForCausalLMEagle3` config) plus `model.safetensors`
or a sharded `model.safetensors.index.json`; other files (SpecForge's `training_state.pt`,
README, ...) are ignored. `read_drafter_dir` opens config.json and the weight headers once and keeps
what every later step needs (the config as written and as parsed, where each tensor lies and its
shape, the strict-name problems), so that the check against a target and the load (drafter_io.py)
take this object instead of opening the directory again.

Strict names, because SGLang silently skips names it does not know: missing, unexpected or
mis-shaped tensors are `problems`. Tolerated: a shipped `embed_tokens.weight`, a `model.` prefix on
every name, a missing `t2d`, and no `d2t`/`t2d` at all when the draft vocab is the full target vocab.

Imports only torch + safetensors.
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from eagle3.engines import aux_layers
from eagle3.drafter.drafter_keys import ConfigRefused
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.errors import StageError
from eagle3.formats.manifest import read_json

log = logging.getLogger(__name__)
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
EMBED = "embed_tokens.weight"


class DrafterLoadError(StageError, RuntimeError):
    """A drafter directory that cannot be loaded; the message lists every problem."""


class DrafterConfigRefused(DrafterLoadError):
    """A readable config.json whose content this project cannot read: `findings` (drafter_values.Finding) name each
    cause, what the engines do and its fix (the directory itself is fine)."""

    def __init__(self, message: str, findings: list):
        super().__init__(message)
        self.findings = list(findings)


@dataclass(frozen=True)
class DrafterDir:
    """What one read of a drafter directory found (no weights loaded: `tensor` reads one on demand)."""
    path: Path
    config_dict: dict                           # config.json as written
    config: DrafterConfig                       # parsed; its aux ids read as h by `id_rule`
    id_rule: str
    listed_ids: Optional[list[int]]             # eagle_config.eagle_aux_hidden_state_layer_ids as listed
    shapes: dict[str, tuple[int, ...]]          # canonical tensor name -> shape (from the headers)
    where: dict[str, tuple[str, Path]]          # canonical tensor name -> (stored name, file)
    problems: list[str]                         # strict-name failures: missing, unexpected, mis-shaped

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor by its canonical name, read from its file now (a corrupt one: DrafterLoadError)."""
        stored, file = self.where[name]
        with _open_weights(file) as f:
            try:
                return f.get_tensor(stored)
            except Exception as e:
                raise DrafterLoadError(f"{file}: tensor {stored!r} unreadable ({e}); the file is truncated or "
                                       f"corrupt: re-export or re-download the drafter") from e


def read_drafter_dir(drafter_dir: str | Path, id_rule: str = aux_layers.DEFAULT_RULE,
                     report_aux: bool = True) -> DrafterDir:
    """Read config.json and the weight headers of a drafter directory, once. A config whose aux ids the
    SGLang versions read differently is reported on the console with every reading (report_aux False: the
    caller says it its own way, e.g. `make check`). Raises DrafterConfigRefused / DrafterLoadError."""
    drafter_dir = Path(drafter_dir)
    d = read_config_dict(drafter_dir)
    listed, cfg = _parse_config(d, drafter_dir / CONFIG, id_rule)
    _report_config(drafter_dir, cfg, listed, id_rule, report_aux)
    want = expected_shapes(cfg)
    where = _canonical_names(_weight_files(drafter_dir), want)
    shapes = {}
    for name, (stored, file) in where.items():
        with _open_weights(file) as f:
            shapes[name] = tuple(f.get_slice(stored).get_shape())
    return DrafterDir(drafter_dir, d, cfg, id_rule, listed, shapes, where, strict_problems(cfg, shapes, want))


def read_config_dict(drafter_dir: str | Path) -> dict:
    """The drafter's `config.json` as a dict (a clear error for a missing or unreadable file)."""
    return read_json(Path(drafter_dir) / CONFIG, DrafterLoadError, unreadable="{e}",
                     missing=f"drafter {drafter_dir}: no {CONFIG} (not a drafter directory?)")


def _parse_config(d: dict, where: Path, id_rule: str) -> tuple[Optional[list[int]], DrafterConfig]:
    """(listed aux ids, DrafterConfig) of a config.json dict; a refusal keeps its findings. The parse comes
    first: it refuses an eagle_config that is no mapping before its ids are read."""
    try:
        cfg = DrafterConfig.from_hf_dict(d, id_rule=id_rule)
        return aux_layers.listed_aux_ids(d), cfg
    except ConfigRefused as e:
        raise DrafterConfigRefused(f"{where}: {e}", e.findings) from e
    except (ValueError, TypeError) as e:
        raise DrafterLoadError(f"{where}: {e}") from e


def _report_config(drafter_dir: Path, cfg: DrafterConfig, listed, id_rule: str, report_aux: bool) -> None:
    """The console lines a read owes: the ids' readings where SGLang versions differ, keys no engine reads,
    and values read here that would break the directory served as is."""
    note = aux_layers.disagreement_note(listed, id_rule, f"drafter {drafter_dir}") if report_aux else None
    if note:
        log.warning(note)
    if cfg.unknown_keys:  # eagle3/drafter/drafter_keys.py lists every key an engine reads; these are none of them
        log.warning("drafter %s: config keys no known engine reads, ignored and not written back: %s",
                    drafter_dir, cfg.unknown_keys)
    for finding in cfg.key_warnings:
        log.warning("drafter %s: %s", drafter_dir, finding)


@contextmanager
def _open_weights(file: Path):
    """safe_open, with a truncated / corrupt file reported as a DrafterLoadError naming it."""
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) here
        raise DrafterLoadError(f"{file}: unreadable safetensors file ({e}); it is truncated or corrupt: "
                               f"re-export or re-download the drafter") from e
    with handle as f:
        yield f


def _weight_files(drafter_dir: Path) -> dict[str, Path]:
    """Tensor name (as stored) -> file holding it."""
    index = drafter_dir / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: drafter_dir / f for name, f in weight_map.items()}
        absent = sorted({str(p) for p in files.values() if not p.is_file()})
        if absent:
            raise DrafterLoadError(f"{index}: names shards that do not exist: {absent}")
        return files
    single = drafter_dir / WEIGHTS
    if single.is_file():
        with _open_weights(single) as f:
            return {name: single for name in f.keys()}
    others = sorted(p.name for p in drafter_dir.glob("*.bin")) + sorted(p.name for p in drafter_dir.glob("*.pt"))
    hint = f" (found {others}: convert to safetensors)" if others else ""
    raise DrafterLoadError(f"drafter {drafter_dir}: no {WEIGHTS} or {INDEX}{hint}")


def _canonical_names(files: dict[str, Path], want: dict) -> dict[str, tuple[str, Path]]:
    """{canonical name: (stored name, file)}. Some exporters prefix every name with `model.`; that form is
    accepted when it is consistent."""
    prefixed = bool(files) and all(n.startswith("model.") for n in files) and not any(n in want for n in files)
    return {(stored[len("model."):] if prefixed else stored): (stored, file) for stored, file in files.items()}


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as the model defines them (embed_tokens excluded)."""
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    return {k: tuple(v.shape) for k, v in model.export_state_dict().items()}


def strict_problems(cfg: DrafterConfig, shapes: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]
                    ) -> list[str]:
    """The strict-name failures of the stored tensors against the config's `want` (expected_shapes): missing,
    unexpected, mis-shaped."""
    problems = []
    optional = {"t2d"} | ({"d2t"} if "d2t" not in shapes and cfg.draft_vocab_size == cfg.vocab_size else set())
    missing = [n for n in want if n not in shapes and n not in optional]
    unexpected = [n for n in shapes if n not in want and n != EMBED]
    misshaped = [f"{n}: {list(shapes[n])} in the checkpoint, {list(want[n])} from config.json" for n in want
                 if n in shapes and shapes[n] != want[n]]
    if EMBED in shapes and shapes[EMBED] != (cfg.vocab_size, cfg.hidden_size):
        misshaped.append(f"{EMBED}: {list(shapes[EMBED])}, expected {[cfg.vocab_size, cfg.hidden_size]}")
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors (SGLang would silently ignore them): {unexpected}")
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped))
    return problems
