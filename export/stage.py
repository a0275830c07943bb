"""The export stage: a trained drafter checkpoint -> a directory SGLang serves (and a vLLM speculators one).

The export is where the project guarantees that the served drafter is the trained one:
1. the serving-critical config fields come from their sources, not from whatever the init drafter
   shipped: layer ids from the capture the drafter was trained on, vocab and context length from the
   target, rope settings from the checkpoint (training);
2. the compatibility check against the target must pass;
3. everything is written to a temporary directory, validated *from disk* (every tensor name, shape
   and dtype, no stray name, d2t/t2d consistent, config fields), loaded back with the project's
   loader and compared logit for logit with the checkpoint on stored validation data; only then is
   it renamed into place. Any failure stops the export with every problem listed, and leaves no
   partial directory.

Layout of `out_dir`: the SGLang directory itself (`config.json`, `model.safetensors`), `speculators/`
(the vLLM speculators directory), `SERVE.md`, `manifest.json`.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3 import aux_layers, export_spec as spec
from eagle3.checkpoints import INDEX_FILE, index_problems
from eagle3.dtypes import torch_dtype
from eagle3.errors import StageError
from eagle3.image_embeddings import CONFIG_KEY as IMAGE_KEY
from eagle3.manifest import ManifestError, atomic_write_bytes, read_json, sha256_file, stale_keys, write_manifest
from eagle3.model import DrafterConfig
from export.formats import FORMATS, format_dir, formats_of, get_format
from export.directory import export_tensors, validate_format_dir, write_format_dir
from export.roundtrip import RoundTripReference, validation_batches
from eagle3.serve_launch import tensor_parallel
from export.image_convention import serve_paragraph, trained_convention
from export.serving import read_serve_choice, serve_markdown

STAGE = "export"


class ExportError(StageError, RuntimeError):
    """The export cannot produce a directory that serves the trained drafter; lists every problem."""

    def __init__(self, what: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{what}:\n  - " + "\n  - ".join(self.problems))


@dataclass
class Sources:
    """Everything the export reads, resolved once: the checkpoint's config (parsed once, a DrafterConfig),
    the target's facts, the capture's hidden-state indices."""
    drafter: DrafterConfig        # the checkpoint's config.json, parsed
    drafter_json: dict            # the same file as written (its other served keys are carried: export_spec)
    target_text_cfg: dict
    target_architectures: list[str]
    hf_indices: list[int]         # h the drafter was trained on (HF output_hidden_states; eagle3/aux_layers.py)
    store_dir: Path               # the capture split used for the round trip
    context_length: int           # max_position_embeddings the export writes

    def served(self, dtype: str) -> DrafterConfig:
        """The config the export writes: the checkpoint's, with the serving-critical fields replaced from
        their sources (vocab and context from the target, h from the capture, the export dtype)."""
        return self.drafter.replace(vocab_size=int(self.target_text_cfg["vocab_size"]),
                                    max_position_embeddings=self.context_length, aux_hf_indices=list(self.hf_indices),
                                    torch_dtype=dtype, unknown_keys=[], key_warnings=[])

    @property
    def rope(self) -> tuple[float, Optional[dict]]:
        return self.drafter.rope_theta, self.drafter.rope_scaling


def gather_sources(config) -> Sources:
    """Read checkpoint config, target config and capture manifest; raise ExportError listing every
    inconsistency between them (ids, widths, vocab, context length, the train manifest's capture)."""
    from eagle3.drafter_io import DrafterLoadError, inspect_drafter_dir, read_config_dict
    from eagle3.store import HiddenStateStore, StoreError
    from eagle3.target_io import TargetError, read_full_config, read_text_config

    problems: list[str] = []
    ckpt = Path(config.checkpoint_dir)
    try:
        # strict names and shapes of the checkpoint, headers only (the weights are read later)
        # (its own config.json was written by this project: ids in a form current SGLang reads as the trained h)
        ckpt_cfg, _, _, problems = inspect_drafter_dir(ckpt)
        problems = [f"checkpoint: {p}" for p in problems]
        drafter_json = read_config_dict(ckpt)
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
    cap = Path(config.capture_dir)
    store_dir = next((cap / s for s in ("validation", "train") if (cap / s / "manifest.json").is_file()), None)
    if store_dir is None:
        raise ExportError("no capture to take the layer ids from",
                          [f"{cap}: neither validation/ nor train/ holds a hidden-state store; run the capture "
                           f"stage (the export writes the layer ids the drafter was trained on)"])
    try:
        store = HiddenStateStore(store_dir, verify="size")
    except StoreError as e:
        raise ExportError(f"capture {store_dir} cannot be read", [str(e)]) from e
    hf = store.hf_indices
    trained = ckpt_cfg.aux_hf_indices
    if aux_layers.reading_mismatch(trained, hf):  # the one drafter-vs-store agreement check, its own message here
        problems.append(f"checkpoint config's eagle_aux_hidden_state_layer_ids mean h = {trained} (current SGLang's "
                        f"reading) but the capture {store_dir} holds h = {hf}: this checkpoint was not trained on "
                        f"this capture")
    try:
        aux_layers.validate_hf_indices(hf, int(text["num_hidden_layers"]), f"capture {store_dir} hidden states")
    except aux_layers.AuxLayerError as e:
        problems.append(str(e))
    problems += _store_width_problems(ckpt_cfg, text, store, store_dir)
    problems += _train_manifest_problems(ckpt, cap)
    problems += _checksum_problems(ckpt)
    context = int(config.max_position_embeddings or text["max_position_embeddings"])
    if context < int(text["max_position_embeddings"]):
        problems.append(f"max_position_embeddings={context} is below the target's context length "
                        f"{text['max_position_embeddings']}: SGLang would refuse or truncate long requests")
    if problems:
        raise ExportError(f"cannot export {ckpt}", problems)
    return Sources(ckpt_cfg, drafter_json, text, archs, hf, store_dir, context)


def _store_width_problems(drafter: DrafterConfig, text: dict, store, store_dir: Path) -> list[str]:
    out = []
    ht = drafter.target_hidden_size
    if store.target_hidden_size != ht:
        out.append(f"capture {store_dir} holds states of width {store.target_hidden_size}, the drafter's fc "
                   f"expects target_hidden_size={ht}")
    if store.target_hidden_size != int(text["hidden_size"]):
        out.append(f"capture {store_dir} width {store.target_hidden_size} != target hidden_size {text['hidden_size']}: "
                   f"captured from another target")
    if drafter.vocab_size != int(text["vocab_size"]):
        out.append(f"checkpoint vocab_size={drafter.vocab_size} != target vocab_size={text['vocab_size']}")
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
    inputs = manifest.get("inputs") or {}
    from eagle3.manifest import fingerprint

    out = []
    for role, entry in inputs.items():
        if "capture" not in role or not isinstance(entry, dict):
            continue
        if Path(entry.get("path", "")).resolve() != capture_dir.resolve():
            out.append(f"the checkpoint was trained on capture {entry.get('path')} ({manifest_path}), "
                       f"not on capture_dir={capture_dir}")
        elif (capture_dir / "manifest.json").is_file() and entry.get("fingerprint") != fingerprint(capture_dir):
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


def compatibility_problems(served: DrafterConfig, src: Sources) -> tuple[list[str], list[str]]:
    """(fatal, warnings) of the drafter <-> target compatibility check (drafter_io, the one `make check`
    runs) on the config the export writes, i.e. after max_position_embeddings and the layer ids were set."""
    from eagle3.drafter_io import compatibility_mismatches

    found = compatibility_mismatches(served, src.target_text_cfg, hf_indices_captured=src.hf_indices)
    fatal = [f"compatibility: {m}" for m in found if m.fatal]
    return fatal, [str(m) for m in found if not m.fatal]


def build_configs(src: Sources, served: DrafterConfig, config, speculative_tokens: int) -> dict[str, dict]:
    """Every format's config.json (all of them: SERVE.md and the manifest name each engine's ids)."""
    return {name: form.build_config(served, src.drafter_json, hf_indices=src.hf_indices,
                                    verifier_path=config.target.path, verifier_architectures=src.target_architectures,
                                    speculative_tokens=speculative_tokens) for name, form in FORMATS.items()}


def load_exported(path: Path, fmt: str, embed_tokens: Optional[torch.Tensor] = None):
    """An exported directory -> Eagle3Drafter (fp32), through the format's own loader."""
    return get_format(fmt).load(path, embed_tokens)


def _inputs_fingerprint(config) -> dict[str, Any]:
    ckpt = Path(config.checkpoint_dir)
    fp = {"checkpoint": {n: sha256_file(ckpt / n) for n in ("config.json", "model.safetensors")
                         if (ckpt / n).is_file()}}
    for role, d in (("capture", Path(config.capture_dir)), ("eval", Path(config.eval_dir))):
        fp[role] = sha256_file(d / "manifest.json") if (d / "manifest.json").is_file() else None
    report = Path(config.eval_dir) / "report.json"
    fp["eval_report"] = sha256_file(report) if report.is_file() else None
    return fp


def _reusable(config, out_dir: Path, fingerprints: dict, validate_kw: dict) -> bool:
    if stale_keys(out_dir, STAGE, {"config": config, "fingerprints": fingerprints}):
        return False
    return not any(validate_format_dir(format_dir(out_dir, f), f, **validate_kw,
                                       embed_tokens=_ships_embed(config, f)) for f in formats_of(config.format))


def _ships_embed(config, fmt: str) -> bool:
    """A format that may hold the target's embedding holds it only on request (export.speculators_embed)."""
    return bool(get_format(fmt).ships_embed and config.speculators_embed)


def run_export(config) -> Path:
    """Export `config.checkpoint_dir` to `config.out_dir` (see the module doc); returns out_dir."""
    from eagle3.drafter_io import DrafterLoadError, load_drafter_dir
    from eagle3.target_io import load_embed_tokens

    out_dir, ckpt = Path(config.out_dir), Path(config.checkpoint_dir)
    _recover_interrupted_swap(out_dir)
    src = gather_sources(config)
    choice = read_serve_choice(config.eval_dir, config.serve, config.use_eval_report)
    validate_kw = dict(vocab_size=int(src.target_text_cfg["vocab_size"]), max_position_embeddings=src.context_length,
                       hf_indices=src.hf_indices, dtype=config.dtype,
                       rope=src.rope)
    fingerprints = _inputs_fingerprint(config)
    if _reusable(config, out_dir, fingerprints, validate_kw):
        print(f"export: {out_dir} is up to date with its config and inputs (revalidated from disk); reused")
        print((out_dir / "SERVE.md").read_text())
        return out_dir

    served = src.served(config.dtype)  # the config every format writes, parsed once
    configs = build_configs(src, served, config, speculative_tokens=choice.num_steps)
    try:
        images, images_from = trained_convention(ckpt, src.drafter_json)
    except ValueError as e:
        raise ExportError(f"cannot export {ckpt}", [str(e)]) from e
    if images is not None:  # both config.json files record it (a key no engine reads: eagle3/drafter_keys.py)
        configs["sglang"][IMAGE_KEY] = images
        configs["speculators"][IMAGE_KEY] = images
    fatal, warnings = compatibility_problems(served, src)
    if fatal:
        raise ExportError(f"the drafter {ckpt} does not fit the target {config.target.path}", fatal)
    for w in warnings:
        print(f"export: warning: {w}")
    embed = load_embed_tokens(config.target.path, config.target.layout).float()
    try:
        reference = load_drafter_dir(ckpt, embed_tokens=embed, dtype=torch.float32)
    except DrafterLoadError as e:
        raise ExportError(f"checkpoint {ckpt} cannot be loaded", [str(e)]) from e
    tmp = _fresh_tmp_dir(out_dir)
    try:
        facts = _write_and_check(tmp, config, configs, reference, embed, src, validate_kw)
        sg_cmd, vllm_cmd = _serve_commands(config, out_dir, choice)
        sg_ids = configs["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        sg_versions = configs["sglang"][aux_layers.META_KEY]["sglang_versions"]
        facts.update({"checkpoint": str(ckpt),
                      "trained hidden states h (HF output_hidden_states indices)": src.hf_indices,
                      "SGLang eagle_aux_hidden_state_layer_ids": f"{sg_ids} (mean h = {src.hf_indices} in "
                                                                 f"{sg_versions})",
                      "vLLM eagle_aux_hidden_state_layer_ids": configs["speculators"]["eagle_aux_hidden_state_layer_ids"],
                      "max_position_embeddings": f"{src.context_length} (the checkpoint had "
                                                 f"{src.drafter_json.get('max_position_embeddings')})",
                      "weights dtype": config.dtype,
                      "validated from disk": "every tensor name, shape and dtype; no stray names; d2t/t2d; config fields",
                      "compatibility warnings": "; ".join(warnings) or "none",
                      "image_embeddings (trained)": f"{images} ({images_from})"})
        serve_md = serve_markdown(name=config.name, target=config.target, choice=choice, sglang_cmd=sg_cmd,
                                  vllm_cmd=vllm_cmd, facts=facts, speculators_embed=config.speculators_embed,
                                  images=serve_paragraph(images, images_from))
        atomic_write_bytes(tmp / "SERVE.md", serve_md.encode())
        inputs = {role: Path(p) for role, p in (("capture", config.capture_dir), ("eval", config.eval_dir))
                  if (Path(p) / "manifest.json").is_file()}
        write_manifest(tmp, STAGE, config, inputs=inputs, fingerprints=fingerprints, formats=formats_of(config.format),
                       serve_choice=choice.as_dict(), facts=facts, compatibility_warnings=warnings,
                       sglang_command=sg_cmd, vllm_command=vllm_cmd, hf_indices=src.hf_indices,
                       image_embeddings=images,
                       aux_ids={"sglang": configs["sglang"][aux_layers.META_KEY],
                                "vllm": configs["speculators"]["eagle_aux_hidden_state_layer_ids"]})
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(serve_md)
    return out_dir


def _write_and_check(tmp: Path, config, configs: dict, reference, embed: torch.Tensor, src: Sources,
                     validate_kw: dict) -> dict[str, Any]:
    """Write each format under tmp, validate it from disk, load it back and compare with the checkpoint."""
    weight_dtype = torch_dtype(config.dtype)
    batches = validation_batches(src.store_dir, config.verify_sequences, config.verify_tokens)
    # takes the checkpoint's full-precision logits, then rounds its weights to the export dtype in place:
    # exporting the rounded weights writes exactly what casting the originals would
    roundtrip = RoundTripReference(reference, batches, weight_dtype)
    facts: dict[str, Any] = {}
    for fmt in formats_of(config.format):
        d = format_dir(tmp, fmt)
        try:
            tensors = export_tensors(reference.export_state_dict(), fmt, weight_dtype)
            if _ships_embed(config, fmt):  # the target's, for speculators' Python API (SERVE.md says when)
                tensors[spec.EMBED] = embed.to(weight_dtype).contiguous().clone()
            write_format_dir(d, configs[fmt], tensors, fmt)
        except Exception as e:  # OSError, or safetensors' own error wrapping one (disk full, quota, EFBIG)
            raise ExportError(f"writing the {fmt} directory failed", [
                f"{d}: {e}; free space under {tmp.parent} and rerun (the previous export, if any, is untouched)"]) from e
        problems = validate_format_dir(d, fmt, **validate_kw, embed_tokens=embed if _ships_embed(config, fmt) else False)
        if problems:
            raise ExportError(f"the written {fmt} directory failed validation", problems)
        problems, stats = roundtrip.check(load_exported(d, fmt, embed))
        if problems:
            raise ExportError(f"the {fmt} export does not reproduce the checkpoint", problems)
        facts[f"{fmt} round trip"] = _describe_roundtrip(stats, src.store_dir)
    return facts


def _describe_roundtrip(stats: dict, store_dir: Path) -> str:
    if "note" in stats:
        return f"weights identical to the checkpoint's; {stats['note']}"
    return (f"weights identical to the checkpoint's rounded to the export dtype; logits on {stats['sequences']} "
            f"sequences / {stats['positions']} positions of {store_dir} (2 draft steps) equal theirs "
            f"(max rel diff {stats['max_rel_diff_vs_rounded']:.1e}); vs the unrounded checkpoint: max |diff| "
            f"{stats['max_abs_diff_vs_checkpoint']:.3g}, top-1 agreement {stats['top1_agreement_vs_checkpoint']:.1%}")


def _serve_commands(config, out_dir: Path, choice) -> tuple[Optional[list[str]], Optional[list[str]]]:
    """(SGLang's, vLLM's) launch lines of the formats written (None where a format is not)."""
    tp = tensor_parallel(config.target, config.serve.tp)
    cmds = {f: get_format(f).serve_command(config, format_dir(out_dir, f), choice, tp) for f in formats_of(config.format)}
    return cmds.get("sglang"), cmds.get("speculators")


def _recover_interrupted_swap(out_dir: Path) -> None:
    """An export killed between moving the old directory aside and moving the new one in leaves no
    out_dir but a `.old-*` one: put it back (it was complete and validated when it was written)."""
    if out_dir.exists():
        return
    olds = sorted(out_dir.parent.glob(f".{out_dir.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds:
        os.replace(olds[-1], out_dir)
        print(f"export: restored {out_dir} from {olds[-1].name} (an earlier export was interrupted)")


def _fresh_tmp_dir(out_dir: Path) -> Path:
    """A new temp directory beside out_dir (same filesystem, so the final rename is atomic); leftovers
    of a killed export are removed first."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for stale in out_dir.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    return tmp


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Replace out_dir by tmp: the old directory is moved aside, not deleted, until the new one is in."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
