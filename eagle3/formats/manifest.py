"""Stage manifests: every stage directory holds a `manifest.json` naming its config, the
fingerprints of its inputs, library versions and counts. Writes are atomic (temp + rename),
so a reader never sees a half-written file."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from eagle3.errors import StageError

MANIFEST = "manifest.json"


class ManifestError(StageError, RuntimeError):
    """A stage directory whose manifest is missing, unreadable, or of the wrong kind."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str]:
    """Versions of the libraries that shape the artifacts (absent ones are skipped)."""
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "accelerate", "datasets", "safetensors", "tokenizers"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception:
            pass
    from eagle3 import __version__

    out["eagle3"] = __version__
    return out


def fingerprint(stage_dir: Path) -> str:
    """Content fingerprint of a finished stage directory: the sha256 of its manifest."""
    path = Path(stage_dir) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{stage_dir}: no {MANIFEST} (has the previous stage finished?)")
    return sha256_file(path)


def write_manifest(stage_dir: Path, stage: str, config: Any, inputs: dict[str, Path] | None = None,
                   **fields: Any) -> dict:
    """Write `<stage_dir>/manifest.json`. `inputs` maps a role to an input stage directory,
    recorded with its fingerprint so a later run can tell whether its inputs changed; the inputs'
    world fingerprint (eagle3/world.py) is carried into this manifest unless `fields` names one."""
    from eagle3.config.conf import as_plain_dict
    from eagle3.world import WORLD_KEY, world_of_inputs

    if WORLD_KEY not in fields:  # the world of the inputs, carried forward (eagle3/world.py)
        world = world_of_inputs((read_manifest(p) for p in (inputs or {}).values()), f"{stage} stage")
        if world is not None:
            fields = {**fields, WORLD_KEY: world}
    recorded_inputs = {role: {"path": str(p), "fingerprint": fingerprint(p)} for role, p in (inputs or {}).items()}
    manifest = {
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": as_plain_dict(config),
        "inputs": recorded_inputs,
        "versions": versions(),
        **as_plain_dict(fields),
    }
    atomic_write_json(Path(stage_dir) / MANIFEST, manifest)
    return manifest


def read_json(path: Path, error: type[Exception] = ManifestError, *, missing: str | None = None,
              unreadable: str = "not valid JSON ({e})") -> dict:
    """The one "read a JSON object or raise": `path`'s object, or `error` naming the file and the cause
    (`missing`: the message for an absent file; `unreadable`: the cause of a bad one, `{e}` the parser's)."""
    path = Path(path)
    if not path.is_file():
        raise error(missing or f"{path}: missing")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path}: {unreadable.format(e=e)}") from e
    if not isinstance(obj, dict):
        raise error(f"{path}: a JSON object expected, found {type(obj).__name__}")
    return obj


def read_manifest(stage_dir: Path, stage: str | None = None) -> dict:
    path = Path(stage_dir) / MANIFEST
    manifest = read_json(path, missing=f"{stage_dir}: no {MANIFEST}; run the {stage or 'previous'} stage first",
                         unreadable="not valid JSON ({e}); the stage directory is corrupt, rerun that stage")
    if stage is not None and manifest.get("stage") != stage:
        raise ManifestError(f"{path}: is a {manifest.get('stage')!r} manifest, expected {stage!r}")
    return manifest


def stale_keys(stage_dir: Path, stage: str, expected: dict[str, Any]) -> list[str]:
    """The stage skeleton's reuse check, written once: [] when `stage_dir` holds a finished `stage`
    manifest that records exactly `expected` (e.g. {"config": cfg, "fingerprints": {...}}), else what
    differs: "no manifest" or the differing keys, one level deep ("config.lr", "fingerprints.target";
    eagle3/config/conf.py differing_keys). Each stage adds its own completeness conditions (files it
    needs) and redoes its work when the list is not empty."""
    from eagle3.config.conf import differing_keys

    try:
        recorded = read_manifest(stage_dir, stage)
    except ManifestError:
        return ["no finished manifest"]
    return differing_keys(expected, recorded)
