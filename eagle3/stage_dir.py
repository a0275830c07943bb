"""The stage skeleton, written once: every `run_<stage>` reads its inputs, decides reuse, works, publishes.

  inputs   `StageDir.input(dir, stage)`: an input stage's manifest, finished and of the right kind, else the
           stage's own error (a StageError: one line, exit 1);
  reuse    `StageDir.reused(expected, needs=..., inputs=..., rule=...)`: the recorded manifest when `out` holds a
           finished run recording exactly `expected` (eagle3/config/conf.py differing_keys), the files it needs,
           its inputs' fingerprints, and passing the stage's own rule (passed in: it stays in the stage);
  work     in place (`begin()` first: the old manifest goes, so a crash never leaves one vouching for other data)
           or in `staging()` (a directory on out's filesystem, removed if the work fails);
  publish  `publish(...)`: each staged member renamed into `out` (the old one moved aside, not deleted, until
           the new one is in), then the manifest written: the one commit record. `publish_whole(...)`
           replaces `out` itself (export: the old directory stays valid, and served, until the new one is in).

An interrupted swap (a `.NAME.old-*` beside a missing NAME) is put back when the StageDir is made.
Torch-free; imports no stage folder.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from eagle3.config.conf import differing_keys
from eagle3.errors import StageError
from eagle3.formats.manifest import MANIFEST, ManifestError, read_manifest, write_manifest


class StageDir:
    """One stage's output directory `out`; `error`: the stage's own error class (a StageError)."""

    def __init__(self, out: Path, stage: str, error: type[StageError] = ManifestError, *, whole: bool = False):
        self.out, self.stage, self.error, self.whole = Path(out), stage, error, whole
        self._recover()

    # ---- inputs --------------------------------------------------------------------------------
    def input(self, path: Path, stage: Optional[str] = None) -> dict:
        """The manifest of input stage directory `path` (of `stage` when given), or the stage's error."""
        try:
            return read_manifest(Path(path), stage)
        except ManifestError as e:
            raise self.error(str(e)) from e

    # ---- reuse ---------------------------------------------------------------------------------
    def reused(self, expected: dict[str, Any], *, needs: Iterable[str] = (), inputs: Optional[dict[str, str]] = None,
               rule: Optional[Callable[[dict], bool]] = None) -> Optional[dict]:
        """The recorded manifest when `out` holds a finished run to reuse, else None: it records exactly
        `expected` (top-level keys, e.g. {"config": cfg, "fingerprints": {...}}), holds every path of `needs`,
        records `inputs` (role -> fingerprint) for its input stage directories, and `rule(manifest)` holds."""
        try:
            manifest = read_manifest(self.out, self.stage)
        except ManifestError:  # none, or not a finished manifest of this stage
            return None
        if differing_keys(expected, manifest) or not all((self.out / n).exists() for n in needs):
            return None
        if inputs is not None:
            recorded = {role: entry.get("fingerprint") for role, entry in (manifest.get("inputs") or {}).items()
                        if isinstance(entry, dict)}
            if recorded != inputs:
                return None
        return manifest if rule is None or rule(manifest) else None

    # ---- work ----------------------------------------------------------------------------------
    def begin(self) -> None:
        """Before work that changes `out` in place: its manifest goes first."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / MANIFEST).unlink(missing_ok=True)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh staging directory on out's filesystem (inside it; beside it for a whole-directory publish),
        so each publish rename is atomic; removed when the block fails, and by publish when it succeeds."""
        parent, name = self._parent_and_name()
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.glob(f".{name}.tmp-*"):  # a killed run's
            shutil.rmtree(stale, ignore_errors=True)
        tmp = parent / f".{name}.tmp-{os.getpid()}-{time.time_ns()}"
        tmp.mkdir()
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left once published

    # ---- publish -------------------------------------------------------------------------------
    def publish(self, config: Any, *, staged: Optional[Path] = None, members: Iterable[str] = (),
                inputs: Optional[dict[str, Path]] = None, **fields: Any) -> dict:
        """Rename each of `members` from `staged` into `out` (the old manifest goes first), then write the
        manifest (`inputs`: role -> input stage dir, recorded with its fingerprint; `fields`: the rest)."""
        assert not self.whole, "a whole-directory StageDir publishes with publish_whole"
        members = list(members)
        self.out.mkdir(parents=True, exist_ok=True)
        if members:
            (self.out / MANIFEST).unlink(missing_ok=True)
        for name in members:
            _swap(Path(staged) / name, self.out / name)
        return write_manifest(self.out, self.stage, config, inputs, **fields)

    def publish_whole(self, config: Any, staged: Path, *, inputs: Optional[dict[str, Path]] = None,
                      **fields: Any) -> dict:
        """Write the manifest into `staged`, then rename `staged` into place as `out`."""
        assert self.whole, "publish_whole is for a StageDir(..., whole=True)"
        manifest = write_manifest(staged, self.stage, config, inputs, **fields)
        _swap(Path(staged), self.out)
        return manifest

    # ---- the parts -----------------------------------------------------------------------------
    def _parent_and_name(self) -> tuple[Path, str]:
        """Where staged and set-aside copies live: beside out (whole) or inside it (members)."""
        return (self.out.parent, self.out.name) if self.whole else (self.out, self.stage)

    def _recover(self) -> None:
        """A swap killed between moving the old copy aside and moving the new one in leaves `.NAME.old-*`
        and no NAME: put it back (it was complete when it was published); other leftovers go."""
        parent = self.out.parent if self.whole else self.out
        if not parent.is_dir():
            return
        pattern = f".{self.out.name}.old-*" if self.whole else ".*.old-*"
        for old in sorted(parent.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True):
            target = parent / old.name[1:].rsplit(".old-", 1)[0]
            if not target.exists():
                os.replace(old, target)
                print(f"[{self.stage}] restored {target} from {old.name} (an earlier run was interrupted)")
            else:
                _remove(old)


def _swap(new: Path, dst: Path) -> None:
    """Replace dst by new: the old dst is moved aside, not deleted, until the new one is in."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        _remove(old)
        os.replace(dst, old)
    os.replace(new, dst)
    if old is not None:
        _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
