"""The image_embeddings convention an exported drafter was trained with (eagle3/drafter/image_embeddings.py), found once
for the export: the config.json key, SERVE.md's paragraph and the manifest read what `trained_convention` says.

Where it is read, first found wins: the checkpoint's config.json (`eagle3_image_embeddings`, which the train
stage writes into every drafter directory), then the train manifest's config beside the checkpoint (`auto`
resolved); a drafter from elsewhere records none.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from eagle3.config.resolve import image_embeddings as resolve
from eagle3.drafter.image_embeddings import CONFIG_KEY, check_convention, serving_mismatch
from eagle3.engines.serve_launch import ENGINE_DEFAULT
from eagle3.formats.manifest import ManifestError, read_json


def trained_convention(ckpt: Path, drafter_json: Mapping[str, Any]) -> tuple[Optional[str], str]:
    """(convention or None, where it was read). A value that is no convention is a ValueError naming the file."""
    if CONFIG_KEY in drafter_json:
        where = f"{ckpt / 'config.json'} {CONFIG_KEY}"
        try:
            return check_convention(drafter_json[CONFIG_KEY]), where
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    manifest_path = ckpt.parent / "manifest.json"
    try:
        manifest = read_json(manifest_path) if manifest_path.is_file() else {}
    except ManifestError:
        manifest = {}  # the export's train-manifest check reports an unreadable one
    choice = (manifest.get("config") or {}).get("image_embeddings") if manifest.get("stage") == "train" else None
    if choice is None:
        return None, "not recorded (a drafter not written by this project's train stage)"
    try:
        return resolve(choice), f"{manifest_path} config image_embeddings={choice}"
    except ValueError as e:
        raise ValueError(f"{manifest_path}: {e}") from e


def serve_paragraph(convention: Optional[str], where: str) -> list[str]:
    """SERVE.md's lines on image traffic: what the drafter was trained to read at image rows, what each engine
    feeds, and a warning for the engine that feeds the other rows."""
    feeds = ", ".join(f"{engine} feeds {conv}" for engine, conv in ENGINE_DEFAULT.items())
    if convention is None:
        return [f"Image rows: the drafter's training convention is {where}; {feeds} "
                "(eagle3/drafter/image_embeddings.py)."]
    lines = [f"Image rows: trained with image_embeddings=**{convention}** ({where}); {feeds} "
             f"(eagle3/drafter/image_embeddings.py). config.json and speculators/config.json record it as `{CONFIG_KEY}`, "
             "a key no engine reads (speculators 0.9.0 keeps extra config keys; vLLM 0.34.0 reads named keys only)."]
    lines += [f"- **warning**: {w}" for w in (serving_mismatch(convention, e) for e in ENGINE_DEFAULT) if w]
    return lines
