"""Drafter directories on disk (SGLang / AQ-MedAI / SpecForge layout): one read (`DrafterDir`), the check
against a target, the load of that read into an Eagle3Drafter, and the save.

A drafter directory is `config.json` (a `LlamaForCausalLMEagle3` config) plus `model.safetensors`
or a sharded `model.safetensors.index.json` (eagle3/formats/weight_files.py); other files (SpecForge's
`training_state.pt`, README, ...) are ignored. `read_drafter_dir` opens config.json and the weight headers
once and keeps what every later step needs (the config as written and as parsed, where each tensor lies and
its shape, the strict-name problems; the small d2t / t2d and their one check on first use), so that the check
against a target and the load take this object instead of opening the directory again
(`load_checked_drafter` does all three in one pass).

Strict names, because SGLang silently skips names it does not know: missing, unexpected or
mis-shaped tensors are `problems`, and a load of such a directory raises one error listing each. Tolerated: a
shipped `embed_tokens.weight` (it gives way to the target's embeddings when given), a `model.` prefix on
every name, a missing `t2d` (rebuilt from `d2t`), and no `d2t`/`t2d` at all when the draft vocab is the full
target vocab.

Imports only torch + safetensors.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.engines import aux_layers
from eagle3.engines.aux_layers import listed_aux_ids  # noqa: F401  (re-exported: readers of a drafter's ids)
from eagle3.drafter import vocab_map
from eagle3.drafter.drafter_keys import ConfigRefused
from eagle3.errors import StageError
from eagle3.config.dtypes import TORCH_FLOAT_DTYPES, torch_dtype  # noqa: F401  (torch_dtype: re-exported)
from eagle3.formats.manifest import atomic_write_bytes, read_json
from eagle3.formats.weight_files import INDEX, WEIGHTS, indexed_files
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter, expected_shapes

log = logging.getLogger(__name__)
CONFIG = "config.json"
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
class StoredMapping:
    """A drafter's d2t / t2d as a load installs them, read once, with what was filled in and their one check."""
    d2t: torch.Tensor                           # int64 [draft_vocab_size]; absent (full vocab): the identity
    t2d: torch.Tensor                           # bool [vocab_size]; absent: rebuilt from d2t
    notes: dict[str, str]                       # the load report's line for each tensor filled in
    problems: list[str]                         # vocab_map.mapping_problems of the pair (config sizes)
    order: list[str]                            # vocab_map.order_problems of d2t (a warning)


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

    @cached_property
    def mapping(self) -> StoredMapping:
        """The vocab mapping, read and checked once (for the check against a target and the load alike). Read
        only where the strict names hold d2t at its shape, or hold none for a full-vocab drafter."""
        cfg, notes = self.config, {}
        if "d2t" in self.where:
            d2t = self.tensor("d2t").to(torch.int64)
        else:  # full-vocab drafter (checked optional by strict_problems)
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
            notes["d2t"] = "absent: full target vocab, identity mapping"
        if "t2d" in self.where:
            t2d = self.tensor("t2d").to(torch.bool)
        else:
            ids = vocab_map.ids_from_d2t(d2t)  # out of range: an empty mask, which the check reports
            in_range = int(ids.min()) >= 0 and int(ids.max()) < cfg.vocab_size
            t2d = vocab_map.t2d_from_ids(ids if in_range else ids[:0], cfg.vocab_size)
            notes["t2d"] = "absent: rebuilt from d2t"
        return StoredMapping(d2t, t2d, notes, vocab_map.mapping_problems(d2t, t2d, cfg.draft_vocab_size, cfg.vocab_size),
                             vocab_map.order_problems(d2t))


def read_drafter_dir(drafter_dir: str | Path, id_rule: str = aux_layers.DEFAULT_RULE,
                     report_aux: bool = True) -> DrafterDir:
    """Read config.json and the weight headers of a drafter directory, once. A config whose aux ids the
    SGLang versions read differently is reported on the console with every reading (report_aux False: the
    caller says it its own way, e.g. `make check`). Raises DrafterConfigRefused / DrafterLoadError.
    The parse comes before the ids are listed: it refuses an eagle_config that is no mapping first."""
    drafter_dir = Path(drafter_dir)
    d = read_config_dict(drafter_dir)
    try:
        cfg = DrafterConfig.from_hf_dict(d, id_rule=id_rule)
        listed = aux_layers.listed_aux_ids(d)
    except ConfigRefused as e:  # a refusal keeps its findings
        raise DrafterConfigRefused(f"{drafter_dir / CONFIG}: {e}", e.findings) from e
    except (ValueError, TypeError) as e:
        raise DrafterLoadError(f"{drafter_dir / CONFIG}: {e}") from e
    note = aux_layers.disagreement_note(listed, id_rule, f"drafter {drafter_dir}") if report_aux else None
    want = expected_shapes(cfg)
    shards = indexed_files(drafter_dir)
    _report_config(drafter_dir, cfg, note)
    where = _canonical_names(_weight_files(drafter_dir, shards), want)
    shapes = {}
    for name, (stored, file) in where.items():
        with _open_weights(file) as f:
            shapes[name] = tuple(f.get_slice(stored).get_shape())
    return DrafterDir(drafter_dir, d, cfg, id_rule, listed, shapes, where, strict_problems(cfg, shapes, want))


def read_named_tensors(drafter_dir: str | Path, names: Sequence[str]) -> dict[str, tuple[torch.Tensor, Path]]:
    """{canonical name: (tensor, the file holding it)} of those `names` the drafter directory stores, found by
    the same rules as a load (the index or the single file, a consistent `model.` prefix), without reading its
    config. A name not stored is absent; an unreadable or missing weight file is a DrafterLoadError."""
    drafter_dir = Path(drafter_dir)
    where = _canonical_names(_weight_files(drafter_dir, indexed_files(drafter_dir)), {})
    out = {}
    for name in names:
        if name in where:
            stored, file = where[name]
            with _open_weights(file) as f:
                out[name] = (f.get_tensor(stored), file)
    return out


def read_config_dict(drafter_dir: str | Path) -> dict:
    """The drafter's `config.json` as a dict (a clear error for a missing or unreadable file)."""
    return read_json(Path(drafter_dir) / CONFIG, DrafterLoadError, unreadable="{e}",
                     missing=f"drafter {drafter_dir}: no {CONFIG} (not a drafter directory?)")


def _report_config(drafter_dir: Path, cfg: DrafterConfig, aux_note: Optional[str]) -> None:
    """The console lines a read owes: the ids' readings where SGLang versions differ (`aux_note`), keys no
    engine reads, and values read here that would break the directory served as is."""
    if aux_note:
        log.warning(aux_note)
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


def _weight_files(drafter_dir: Path, files: Optional[dict[str, Path]]) -> dict[str, Path]:
    """Tensor name (as stored) -> file holding it, by the one rule (eagle3/formats/weight_files.py): the index's
    `files` (indexed_files), else the single file's names."""
    if files is not None:
        absent = sorted({str(p) for p in files.values() if not p.is_file()})
        if absent:
            raise DrafterLoadError(f"{drafter_dir / INDEX}: names shards that do not exist: {absent}")
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


# ---------------------------------------------------------------- load and save

def load_drafter_dir(drafter_dir: str | Path, embed_tokens: Optional[torch.Tensor] = None,
                     device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                     id_rule: str = aux_layers.DEFAULT_RULE) -> Eagle3Drafter:
    """Read and load a drafter directory (load_drafter). `id_rule`: how config.json's aux layer ids become
    hidden-state indices (aux_layers.RULES)."""
    return load_drafter(read_drafter_dir(drafter_dir, id_rule), embed_tokens, device, dtype)


def load_drafter(read: DrafterDir, embed_tokens: Optional[torch.Tensor] = None,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> Eagle3Drafter:
    """An Eagle3Drafter from a read directory (weights cast to `dtype`, default the config's torch_dtype).
    `embed_tokens` [V, H] are the target's embeddings; without them a shipped embedding is used, else the
    embedding stays randomly initialised (reported). The model adopts `embed_tokens` without a copy when
    device and dtype already match (4.7 GB for K2.5 in fp32). The load report is on `model.load_report`."""
    drafter_dir, cfg, where = read.path, read.config, read.where
    if read.problems:
        raise DrafterLoadError(f"drafter {drafter_dir} does not match its config.json:\n  - "
                               + "\n  - ".join(read.problems))
    dt = torch_dtype(dtype) or torch_dtype(cfg.torch_dtype if cfg.torch_dtype in TORCH_FLOAT_DTYPES else "float32")
    report: dict[str, Any] = {"dir": str(drafter_dir), "dtype": str(dt).replace("torch.", ""),
                              "aux_hf_indices": cfg.aux_hf_indices, "aux_id_rule": read.id_rule,
                              "ignored_files": sorted(p.name for p in drafter_dir.iterdir()
                                                      if p.name not in (CONFIG, WEIGHTS, INDEX)
                                                      and not p.name.endswith(".safetensors"))}
    if cfg.unknown_keys:
        report["unknown_config_keys"] = list(cfg.unknown_keys)  # ignored, never written back (drafter_keys)
    mapping = read.mapping  # read and checked once (DrafterDir.mapping), as the target check saw it
    if mapping.problems:
        raise DrafterLoadError(f"drafter {drafter_dir}: bad vocab mapping: " + "; ".join(mapping.problems))
    report.update(mapping.notes)
    tensors = {name: read.tensor(name) for name in where if name not in (EMBED, "d2t", "t2d")}
    tensors.update(d2t=mapping.d2t, t2d=mapping.t2d)
    if embed_tokens is not None:
        if tuple(embed_tokens.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise DrafterLoadError(f"target embeddings {list(embed_tokens.shape)} do not fit drafter {drafter_dir} "
                                   f"(vocab_size x hidden_size = {[cfg.vocab_size, cfg.hidden_size]})")
        report["embed_tokens"] = "target" + (" (the checkpoint's own embed_tokens.weight was ignored)"
                                             if EMBED in where else "")
    elif EMBED in where:
        embed_tokens = read.tensor(EMBED)
        report["embed_tokens"] = "from the checkpoint (no target embeddings given)"
    else:
        report["embed_tokens"] = "NOT LOADED: random init; pass the target's embeddings"
        log.warning("drafter %s: no embeddings given or shipped; embed_tokens is random", drafter_dir)
    # Build on meta and adopt the loaded tensors (assign=True): the weights are allocated once.
    state = {k: (v.to(device=device, dtype=dt) if v.is_floating_point() else v.to(device)) for k, v in tensors.items()}
    if embed_tokens is None:
        embed_tokens = torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dt).normal_(
            0.0, cfg.initializer_range)
    state[EMBED] = embed_tokens.to(device=device, dtype=dt)
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.embed_tokens.weight.requires_grad_(False)
    model.load_report = report
    return model


def save_drafter_dir(model: Eagle3Drafter, out_dir: str | Path, dtype: str | torch.dtype | None = None,
                     config_overrides: Optional[dict] = None) -> Path:
    """Write `config.json` + `model.safetensors` (no embeddings), each atomically (temp + rename;
    weights first, so a directory with a config always has its weights). Other files in `out_dir`
    (e.g. training_state.pt) are left alone."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dt = torch_dtype(dtype) or next(model.fc.parameters()).dtype
    tensors = {k: (v.detach().to(dt) if v.is_floating_point() else v.detach()).cpu().contiguous()
               for k, v in model.export_state_dict().items()}
    cfg = model.config.replace(torch_dtype=str(dt).replace("torch.", ""))
    hf = cfg.to_hf_dict()
    hf.update(config_overrides or {})
    fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, out_dir / WEIGHTS)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stale_index = out_dir / INDEX  # a previous sharded save would shadow the new single file
    if stale_index.exists():
        stale_index.unlink()
    atomic_write_bytes(out_dir / CONFIG, (json.dumps(hf, indent=2) + "\n").encode())
    return out_dir


# ---------------------------------------------------------------- compatibility with a target

class CompatibilityError(StageError, ValueError):
    """A drafter that cannot serve / be trained on this target; the message lists every problem."""


@dataclass(frozen=True)
class Mismatch:
    """One problem found by the compatibility check, with what to change."""
    key: str
    problem: str
    fix: str
    fatal: bool = True

    def __str__(self) -> str:
        return f"{'ERROR' if self.fatal else 'WARNING'} {self.key}: {self.problem}. Fix: {self.fix}"


def compatibility_mismatches(drafter_cfg: DrafterConfig, target_text_config: dict,
                             hf_indices_captured: Optional[list[int]] = None,
                             listed_ids: Optional[list[int]] = None, id_rule: Optional[str] = None) -> list[Mismatch]:
    """Every way the drafter's config does not fit the target (text config dict: hidden_size, num_hidden_layers,
    vocab_size, max_position_embeddings, ...), and optionally the captured hidden-state indices (a d2t/t2d pair has
    its own check: mapping_mismatches). `listed_ids` / `id_rule`: the config's aux ids and the rule that read them
    (for the reading's own advice)."""
    c, t = drafter_cfg, target_text_config
    out: list[Mismatch] = []
    H, L, V = int(t["hidden_size"]), int(t["num_hidden_layers"]), int(t["vocab_size"])
    if c.hidden_size != H:
        out.append(Mismatch("hidden_size", f"drafter {c.hidden_size} != target {H} (the drafter reads the "
                            f"target's [V, {H}] embeddings)", "use a drafter built for this target (init=scratch)"))
    if c.target_hidden_size != H:
        out.append(Mismatch("target_hidden_size", f"fc input width 3 x {c.target_hidden_size} = {3 * c.target_hidden_size}"
                            f" != 3 x target hidden {H} = {3 * H}", "use a drafter built for this target's width"))
    if c.vocab_size != V:
        out.append(Mismatch("vocab_size", f"drafter {c.vocab_size} != target {V}",
                            "the drafter comes from another tokenizer; use one for this target"))
    h = c.aux_hf_indices
    if h is None:
        h = aux_layers.sglang_default_hf_indices(L)
        out.append(Mismatch("eagle_config", f"no eagle_aux_hidden_state_layer_ids: SGLang falls back to hidden-state "
                            f"indices h = {h}", "write eagle_config.eagle_aux_hidden_state_layer_ids explicitly "
                            "(export does)", fatal=False))
    try:
        if c.aux_hf_indices is not None:  # (SGLang's own default is checked where a capture takes it)
            aux_layers.validate_hf_indices(h, L, "drafter aux hidden-state indices")
    except aux_layers.AuxLayerError as e:
        styled = aux_layers.sglang_style_ids_note(listed_ids, id_rule) if listed_ids is not None else None
        out.append(Mismatch("eagle_aux_hidden_state_layer_ids", *styled) if styled else
                   Mismatch("aux_hf_indices", str(e), f"use 3 distinct ascending indices in 2..{L - 1} (SGLang's "
                            f"default for {L} layers: h = {aux_layers.sglang_default_hf_indices(L)})"))
    differ = hf_indices_captured is not None and aux_layers.reading_mismatch(h, hf_indices_captured)
    if differ:
        out.append(Mismatch("aux_hf_indices", differ, "recapture with the drafter's layers, or check "
                            "init.aux_id_rule (how its config's ids are read)"))
    tmax = int(t.get("max_position_embeddings") or 0)
    if c.max_position_embeddings < tmax:
        out.append(Mismatch("max_position_embeddings", f"drafter {c.max_position_embeddings} < target context {tmax}: "
                            f"SGLang 0.5.14 and vLLM 0.34.0 size the draft's rope cos/sin cache from it (rotary_embedding"
                            f"/base.py:170 / :97), so this directory served as is breaks past {c.max_position_embeddings} "
                            f"tokens of context (below that the rope is the same)",
                            f"nothing for init, train or export (they write {tmax}); to serve this directory as is, set "
                            f"max_position_embeddings: {tmax}", fatal=False))
    if not c.rope_theta > 0:
        out.append(Mismatch("rope_theta", f"{c.rope_theta} is not positive", "restore the drafter's rope_theta"))
    for key in ("bos_token_id", "eos_token_id"):
        mine, theirs = getattr(c, key), t.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            out.append(Mismatch(key, f"drafter {mine} != target {theirs}", f"set {key} to {theirs}", fatal=False))
    return out


def mapping_mismatches(problems: list[str], order: list[str]) -> list[Mismatch]:
    """A d2t/t2d pair's `vocab_map.mapping_problems` (fatal) and `order_problems` (a warning), as mismatches."""
    out = [Mismatch("d2t/t2d", p, "rebuild the mapping with the vocab stage (and remap lm_head)") for p in problems]
    for p in order:
        out.append(Mismatch("d2t", p + " (loaders using t2d read logits in id order)",
                            "rebuild the mapping with the vocab stage", fatal=False))
    return out


def check_compatibility(drafter_cfg: DrafterConfig, target_text_config: dict,
                        hf_indices_captured: Optional[list[int]] = None) -> list[str]:
    """Mismatches as readable lines ('ERROR ...' stops a run, 'WARNING ...' does not)."""
    return [str(m) for m in compatibility_mismatches(drafter_cfg, target_text_config, hf_indices_captured)]


def raise_on_fatal(mismatches: list[Mismatch], what: str) -> list[Mismatch]:
    """Raise CompatibilityError listing every fatal mismatch (warnings included for context);
    return the warnings otherwise."""
    fatal = [m for m in mismatches if m.fatal]
    if fatal:
        raise CompatibilityError(f"{what}:\n  - " + "\n  - ".join(str(m) for m in mismatches))
    return mismatches


def assert_compatible(drafter_cfg: DrafterConfig, target_text_config: dict,
                      hf_indices_captured: Optional[list[int]] = None) -> list[Mismatch]:
    return raise_on_fatal(compatibility_mismatches(drafter_cfg, target_text_config, hf_indices_captured),
                          "drafter is not compatible with the target")


def check_drafter_dir(drafter_dir: str | Path, target_text_config: dict,
                      hf_indices_captured: Optional[list[int]] = None, id_rule: str = aux_layers.DEFAULT_RULE,
                      report_aux: bool = True) -> tuple[Optional[DrafterDir], list[Mismatch]]:
    """(the directory as read, every mismatch): the full check of a drafter directory (config, weight
    names/shapes, mapping) against a target, reading only headers and the small d2t/t2d tensors. A directory
    that cannot be read is its mismatches with None. `id_rule` reads the config's aux layer ids
    (aux_layers.RULES); report_aux: see read_drafter_dir. Load the returned read with load_drafter:
    the directory is not opened again."""
    try:
        read = read_drafter_dir(drafter_dir, id_rule, report_aux)
    except DrafterConfigRefused as e:  # the directory is fine; each config value names its own cause and fix
        return None, [Mismatch(f.key, f.problem, f.fix) for f in e.findings]
    except DrafterLoadError as e:
        return None, [Mismatch("config", str(e), "point at a drafter directory (config.json + model.safetensors)")]
    cfg = read.config
    out = [Mismatch(f.key, f.problem, f.fix, fatal=False) for f in cfg.key_warnings]
    out += [Mismatch("weights", p, "re-export the drafter with SGLang names and the config's shapes")
            for p in read.problems]
    stored = None  # a missing d2t of a reduced-vocab drafter is already a "missing tensors" problem
    if "d2t" in read.where and read.shapes["d2t"] == (cfg.draft_vocab_size,):
        if "t2d" in read.where:
            stored = read.mapping  # read and checked once: the load takes the same (DrafterDir.mapping)
        else:
            out.append(Mismatch("t2d", "absent (SGLang ignores it; other loaders need it)", "write t2d (export does)",
                                fatal=False))
    out += compatibility_mismatches(cfg, target_text_config, hf_indices_captured, listed_ids=read.listed_ids,
                                    id_rule=id_rule)
    return read, out + ([] if stored is None else mapping_mismatches(stored.problems, stored.order))


@dataclass(frozen=True)
class CheckedDrafter:
    """A drafter directory read once, checked against a target and loaded (`load_checked_drafter`)."""
    read: DrafterDir
    model: Eagle3Drafter
    warnings: list[Mismatch]          # the check's mismatches, none fatal

    config = property(lambda self: self.read.config)
    target_ids = property(lambda self: vocab_map.ids_from_d2t(self.read.mapping.d2t))  # of its draft ids, in order


def load_checked_drafter(drafter_dir: str | Path, target_text_config: dict, hf_indices_captured: Optional[list[int]],
                         what: str, id_rule: str = aux_layers.DEFAULT_RULE,
                         embed_tokens: Optional[torch.Tensor] = None,
                         dtype: str | torch.dtype | None = None) -> CheckedDrafter:
    """A drafter directory against a target, in one pass: read (headers and the mapping), checked
    (check_drafter_dir: CompatibilityError headed `what` on anything fatal) before anything big is loaded,
    then loaded (load_drafter) from that same read."""
    read, mismatches = check_drafter_dir(drafter_dir, target_text_config, hf_indices_captured, id_rule=id_rule)
    raise_on_fatal(mismatches, what)
    return CheckedDrafter(read, load_drafter(read, embed_tokens=embed_tokens, dtype=dtype), mismatches)


__all__ = ["DrafterLoadError", "DrafterConfigRefused", "DrafterDir", "read_drafter_dir", "load_drafter",
           "load_drafter_dir", "save_drafter_dir", "read_config_dict", "listed_aux_ids", "expected_shapes",
           "check_compatibility", "compatibility_mismatches", "assert_compatible", "check_drafter_dir",
           "raise_on_fatal", "CompatibilityError", "Mismatch", "mapping_mismatches", "CheckedDrafter",
           "load_checked_drafter"]
