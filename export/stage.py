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

from pathlib import Path

import torch

from eagle3.engines import aux_layers
from eagle3.config.dtypes import torch_dtype
from eagle3.drafter.image_embeddings import CONFIG_KEY as IMAGE_KEY
from eagle3.formats.manifest import atomic_write_bytes
from eagle3.stage_dir import StageDir
from eagle3.engines.serve_launch import tensor_parallel
from export.formats import FORMATS, formats_of
from export.image_convention import serve_paragraph, trained_convention
from export.roundtrip import RoundTripReference, describe, validation_batches
from export.serving import read_serve_choice, serve_markdown
from export.sources import ExportError, gather_sources

__all__ = ["ExportError", "run_export"]

STAGE = "export"


def run_export(config) -> Path:
    """Export `config.checkpoint_dir` to `config.out_dir` (see the module doc); returns out_dir."""
    from eagle3.drafter.drafter_io import DrafterLoadError, load_drafter_dir
    from eagle3.target_model.target_io import load_embed_tokens

    out_dir, ckpt = Path(config.out_dir), Path(config.checkpoint_dir)
    stage = StageDir(out_dir, STAGE, ExportError, whole=True)  # puts back an export an interrupted swap moved aside
    forms = formats_of(config.format)  # the ExportFormat objects (export/formats.py), resolved once
    src = gather_sources(config)       # read and checked once; src.served is the config every format writes
    choice = read_serve_choice(config.eval_dir, config.serve, config.use_eval_report)
    embed_of = {f.name: bool(f.ships_embed and config.speculators_embed) for f in forms}  # the target's, on request
    if stage.reused({"config": config, "fingerprints": src.fingerprints},
                    rule=lambda _: not any(f.problems(out_dir, src.validate_kw, embed_of[f.name]) for f in forms)):
        print(f"export: {out_dir} is up to date with its config and inputs (revalidated from disk); reused")
        print((out_dir / "SERVE.md").read_text())
        return out_dir

    configs, images, images_from = format_configs(config, src, choice, ckpt)
    warnings = compatibility_warnings(config, src, ckpt)
    embed = load_embed_tokens(config.target.path, config.target.layout).float()
    try:
        reference = load_drafter_dir(ckpt, embed_tokens=embed, dtype=torch.float32)
    except DrafterLoadError as e:
        raise ExportError(f"checkpoint {ckpt} cannot be loaded", [str(e)]) from e
    weight_dtype = torch_dtype(config.dtype)
    with stage.staging() as tmp:
        batches = validation_batches(src.store, config.verify_sequences, config.verify_tokens)
        # takes the checkpoint's full-precision logits, then rounds its weights to the export dtype in place:
        # exporting the rounded weights writes exactly what casting the originals would
        roundtrip = RoundTripReference(reference, batches, weight_dtype)
        facts = {f"{f.name} round trip": describe(f.write_checked(tmp, configs[f.name], roundtrip, embed,
                                                                  embed_of[f.name], src.validate_kw), src.store_dir)
                 for f in forms}
        tp = tensor_parallel(config.target, config.serve.tp)
        cmds = {f.name: f.serve_command(config, f.dir_in(out_dir), choice, tp) for f in forms}
        sg_cmd, vllm_cmd = cmds.get("sglang"), cmds.get("speculators")
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
        stage.publish_whole(config, tmp, inputs=inputs, fingerprints=src.fingerprints,
                            formats=[f.name for f in forms], serve_choice=choice.as_dict(), facts=facts,
                            compatibility_warnings=warnings, sglang_command=sg_cmd, vllm_command=vllm_cmd,
                            hf_indices=src.hf_indices, image_embeddings=images,
                            aux_ids={"sglang": configs["sglang"][aux_layers.META_KEY],
                                     "vllm": configs["speculators"]["eagle_aux_hidden_state_layer_ids"]})
    print(serve_md)
    return out_dir


def format_configs(config, src, choice, ckpt: Path) -> tuple[dict, object, str]:
    """Every format's config.json (all of them: SERVE.md and the manifest name each engine's ids), with the
    trained image convention recorded in both; and that convention with where it was read."""
    configs = {name: form.build_config(src.served, src.drafter_json, hf_indices=src.hf_indices,
                                       verifier_path=config.target.path,
                                       verifier_architectures=src.target_architectures,
                                       speculative_tokens=choice.num_steps) for name, form in FORMATS.items()}
    try:
        images, images_from = trained_convention(ckpt, src.drafter_json)
    except ValueError as e:
        raise ExportError(f"cannot export {ckpt}", [str(e)]) from e
    if images is not None:  # both config.json files record it (a key no engine reads: eagle3/drafter/drafter_keys.py)
        configs["sglang"][IMAGE_KEY] = images
        configs["speculators"][IMAGE_KEY] = images
    return configs, images, images_from


def compatibility_warnings(config, src, ckpt: Path) -> list[str]:
    """The drafter <-> target compatibility check (the one `make check` runs) on the config the export writes:
    a fatal mismatch stops the export, the rest are printed and returned."""
    from eagle3.drafter.drafter_io import compatibility_mismatches

    found = compatibility_mismatches(src.served, src.target_text_cfg, hf_indices_captured=src.hf_indices)
    fatal, warnings = [f"compatibility: {m}" for m in found if m.fatal], [str(m) for m in found if not m.fatal]
    if fatal:
        raise ExportError(f"the drafter {ckpt} does not fit the target {config.target.path}", fatal)
    for w in warnings:
        print(f"export: warning: {w}")
    return warnings
