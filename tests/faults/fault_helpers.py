"""Helpers of the fault suite: stage configs for the fault pipeline, copying, and file damage."""
from __future__ import annotations

import contextlib
import resource
import shutil
import signal
from pathlib import Path


def train_config(world: dict, out_dir: Path, **extra):
    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.train import TrainConfig
    from tests.fixtures.train_world import overrides

    base = dict(max_steps=4, epochs="null", checkpoint_every=2, keep_checkpoints=0)
    base.update(extra)
    return to_schema(compose("train", overrides(world, out_dir, "scratch", **base)), TrainConfig)


def export_config(world: dict, checkpoint: Path, out_dir: Path, *overrides: str):
    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.export import ExportConfig

    cfg = compose("export", [f"paths.root={Path(out_dir).parent / 'root'}", f"target.path={world['target']}",
                             f"checkpoint_dir={checkpoint}", f"capture_dir={world['capture']}",
                             f"eval_dir={Path(out_dir).parent / 'no-eval'}", f"out_dir={out_dir}",
                             "verify_sequences=2", "verify_tokens=32", *overrides])
    return to_schema(cfg, ExportConfig)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def flip_byte(path: Path, offset_from_end: int = 11, mask: int = 0x01) -> None:
    """Flip bits of one byte near the end of a file (inside the last tensor's data: same size,
    header intact, so only a checksum can tell)."""
    data = bytearray(Path(path).read_bytes())
    data[-offset_from_end] ^= mask
    Path(path).write_bytes(bytes(data))


def flip_in_tensor(path: Path, name: str, mask: int = 0x01) -> None:
    """Flip the lowest mantissa bit of the middle element of tensor `name` in a safetensors file: the
    file stays well-formed and finite, only its content changed (what a checksum must catch)."""
    import json

    data = bytearray(Path(path).read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    start, end = json.loads(bytes(data[8:8 + header_len]))[name]["data_offsets"]
    data[8 + header_len + (start + end) // 2 // 2 * 2] ^= mask
    Path(path).write_bytes(bytes(data))


def truncate(path: Path, keep_fraction: float = 0.5) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: int(len(data) * keep_fraction)])


@contextlib.contextmanager
def file_size_limit(max_bytes: int):
    """Writes past `max_bytes` in any one file fail with EFBIG from the kernel (RLIMIT_FSIZE), as on a
    full disk: a real partial write, no privileges or mounts needed. SIGXFSZ is ignored so the write
    returns the error instead of killing the process; both are restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
