"""What the export reads, read and checked once: the checkpoint (its config parsed into a DrafterConfig),
the target's config, the capture the drafter was trained on (its store, opened once, gives the layer ids
and the round trip's data), the inputs' fingerprints; and the served config derived from them.

`gather_sources` raises ExportError listing every inconsistency between these sources at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from eagle3.engines import aux_layers
from eagle3.formats.checkpoints import INDEX_FILE, index_problems
from eagle3.errors import StageError
from eagle3 import fingerprints as fp
from eagle3.formats.manifest import MANIFEST, ManifestError, read_json
from eagle3.drafter.model import DrafterConfig


class ExportError(StageError, RuntimeError):
    """The export cannot produce a directory that serves the trained drafter; lists every problem."""

    def __init__(self, what: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{what}:\n  - " + "\n  - ".join(self.problems))


@dataclass
class Sources:
    """Everything the export reads, resolved once: the checkpoint's config (parsed once, a DrafterConfig),
    the target's facts, the capture's store and hidden-state indices, and the config the export writes."""
    drafter: DrafterConfig        # the checkpoint's config.json, parsed
    drafter_json: dict            # the same file as written (its other served keys are carried: export/spec.py)
    target_text_cfg: dict
    target_architectures: list[str]
    hf_indices: list[int]         # h the drafter was trained on (HF output_hidden_states; eagle3/engines/aux_layers.py)
    store: Any                    # the capture split used for the round trip (a HiddenStateStore)
    context_length: int           # max_position_embeddings the export writes
    served: DrafterConfig         # the config every format writes (see `served_config`)
    fingerprints: dict            # of the inputs, for the reuse check (see `inputs_fingerprint`)

    @property
    def store_dir(self) -> Path:
        return self.store.dir

    @property
    def rope(self) -> tuple[float, Optional[dict]]:
        return self.drafter.rope_theta, self.drafter.rope_scaling

    @property
    def validate_kw(self) -> dict[str, Any]:
        """What a written directory must say (export/directory.py's check), from the served config."""
        s = self.served
        return dict(vocab_size=s.vocab_size, max_position_embeddings=s.max_position_embeddings,
                    hf_indices=list(s.aux_hf_indices), dtype=s.torch_dtype, rope=self.rope)


def served_config(drafter: DrafterConfig, text: dict, hf_indices: list[int], context: int,
                  dtype: str) -> DrafterConfig:
    """The config the export writes: the checkpoint's, with the serving-critical fields replaced from their
    sources (vocab and context from the target, h from the capture, the export dtype)."""
    return drafter.replace(vocab_size=int(text["vocab_size"]), max_position_embeddings=context,
                           aux_hf_indices=list(hf_indices), torch_dtype=dtype, unknown_keys=[], key_warnings=[])


def gather_sources(config) -> Sources:
    """Read checkpoint config, target config and capture manifest; raise ExportError listing every
    inconsistency between them (ids, widths, vocab, context length, the train manifest's capture)."""
    from eagle3.drafter.drafter_io import DrafterLoadError, read_drafter_dir
    from eagle3.formats.store import HiddenStateStore, StoreError
    from eagle3.target_model.target_io import TargetError, read_full_config, read_text_config

    problems: list[str] = []
    ckpt, cap, eval_dir = Path(config.checkpoint_dir), Path(config.capture_dir), Path(config.eval_dir)
    try:
        # strict names and shapes of the checkpoint, headers only (the weights are read later)
        # (its own config.json was written by this project: ids in a form current SGLang reads as the trained h)
        read = read_drafter_dir(ckpt)
        ckpt_cfg, drafter_json = read.config, read.config_dict
        problems = [f"checkpoint: {p}" for p in read.problems]
    except (DrafterLoadError, OSError) as e:
        raise ExportError(f"checkpoint {ckpt} cannot be exported", [str(e)]) from e
    except Exception as e:  # safetensors' own error type: a truncated or corrupt header
        raise ExportError(f"checkpoint {ckpt} cannot be exported",
                          [f"{ckpt}: a weight file is unreadable ({e}); truncated or corrupt, retrain or "
                           f"export another checkpoint"]) from e
    try:
        text = read_text_config(config.target.path, config.target.layout)
        archs = list(read_full_config(config.target.path).get("architectures") or [])
    except TargetError as e:
        raise ExportError(f"target {config.target.path} cannot be read", [str(e)]) from e
    store_dir = next((cap / s for s in ("validation", "train") if (cap / s / "manifest.json").is_file()), None)
    if store_dir is None:
        raise ExportError("no capture to take the layer ids from",
                          [f"{cap}: neither validation/ nor train/ holds a hidden-state store; run the capture "
                           f"stage (the export writes the layer ids the drafter was trained on)"])
    try:
        store = HiddenStateStore(store_dir, verify="size")
    except StoreError as e:
        raise ExportError(f"capture {store_dir} cannot be read", [str(e)]) from e
    hf, trained = store.hf_indices, ckpt_cfg.aux_hf_indices
    if aux_layers.reading_mismatch(trained, hf):  # the one drafter-vs-store agreement check, its own message here
        problems.append(f"checkpoint config's eagle_aux_hidden_state_layer_ids mean h = {trained} (current SGLang's "
                        f"reading) but the capture {store_dir} holds h = {hf}: this checkpoint was not trained on "
                        f"this capture")
    try:
        aux_layers.validate_hf_indices(hf, int(text["num_hidden_layers"]), f"capture {store_dir} hidden states")
    except aux_layers.AuxLayerError as e:
        problems.append(str(e))
    width, ht = store.target_hidden_size, ckpt_cfg.target_hidden_size
    if width != ht:
        problems.append(f"capture {store_dir} holds states of width {width}, the drafter's fc expects "
                        f"target_hidden_size={ht}")
    if width != int(text["hidden_size"]):
        problems.append(f"capture {store_dir} width {width} != target hidden_size {text['hidden_size']}: "
                        f"captured from another target")
    if ckpt_cfg.vocab_size != int(text["vocab_size"]):
        problems.append(f"checkpoint vocab_size={ckpt_cfg.vocab_size} != target vocab_size={text['vocab_size']}")
    problems += _train_manifest_problems(ckpt, cap)
    problems += _checksum_problems(ckpt)
    context = int(config.max_position_embeddings or text["max_position_embeddings"])
    if context < int(text["max_position_embeddings"]):
        problems.append(f"max_position_embeddings={context} is below the target's context length "
                        f"{text['max_position_embeddings']}: SGLang would refuse or truncate long requests")
    if problems:
        raise ExportError(f"cannot export {ckpt}", problems)
    fingerprints = inputs_fingerprint(ckpt, cap, eval_dir)
    served = served_config(ckpt_cfg, text, hf, context, config.dtype)
    return Sources(ckpt_cfg, drafter_json, text, archs, hf, store, context, served, fingerprints)


def inputs_fingerprint(ckpt: Path, capture_dir: Path, eval_dir: Path) -> dict[str, Any]:
    """sha256 of the checkpoint's two files, the capture's and the eval's manifests, the eval report (the rules
    of eagle3/fingerprints.py; None where a stage has not run)."""
    out: dict[str, Any] = {"checkpoint": {n: fp.input_file(ckpt / n) for n in ("config.json", "model.safetensors")
                                          if (ckpt / n).is_file()}}
    for role, d in (("capture", capture_dir), ("eval", eval_dir)):
        out[role] = fp.stage_dir(d) if (d / MANIFEST).is_file() else None
    report = eval_dir / "report.json"
    out["eval_report"] = fp.input_file(report) if report.is_file() else None
    return out


def _train_manifest_problems(ckpt: Path, capture_dir: Path) -> list[str]:
    """When the checkpoint sits in a train stage directory, its manifest names the capture it was trained
    on: exporting with another capture (or one re-captured since) would write the wrong layer ids."""
    manifest_path = ckpt.parent / "manifest.json"
    if not manifest_path.is_file():
        return []
    try:
        manifest = read_json(manifest_path, unreadable="unreadable train manifest")
    except ManifestError as e:
        return [str(e)]
    if manifest.get("stage") != "train":  # e.g. a drafter directory inside the mini world: no claim to check
        return []
    out = []
    for role, entry in (manifest.get("inputs") or {}).items():
        if "capture" not in role or not isinstance(entry, dict):
            continue
        if Path(entry.get("path", "")).resolve() != capture_dir.resolve():
            out.append(f"the checkpoint was trained on capture {entry.get('path')} ({manifest_path}), "
                       f"not on capture_dir={capture_dir}")
        elif (capture_dir / "manifest.json").is_file() and entry.get("fingerprint") != fp.stage_dir(capture_dir):
            out.append(f"capture {capture_dir} changed since the checkpoint was trained on it (fingerprint differs "
                       f"from {manifest_path})")
    return out


def _checksum_problems(ckpt: Path) -> list[str]:
    """A training checkpoint (`checkpoints/step-N/`, `final/`) lists its files' sha256 in `checkpoint.json`:
    a truncated or bit-flipped weight file must not be exported (it would load and serve). A drafter
    directory without the index (not written by training) has nothing to check."""
    if not (ckpt / INDEX_FILE).is_file():
        return []
    return [f"{p}; export an earlier checkpoint or retrain" for p in index_problems(ckpt)]
