"""Every config `auto`, resolved once: one function per concern, called right after a stage reads its
config; the stage records what they chose in its manifest (`resolved`), so a reader finds what a run did
there. `data.order` is its schema's own (TrainDataConf.resolved_order). What an image-row convention means is
eagle3/drafter/image_embeddings.py's; which one each engine feeds, eagle3/engines/serve_launch.py's.

Standard library at import; torch only inside `device` (is CUDA there?).
"""
from __future__ import annotations

from eagle3.config.choices import IMAGE_EMBEDDINGS
from eagle3.engines.serve_launch import EXPORT_ENGINE, default_for_engine

__all__ = ["compile_fast_path", "device", "image_embeddings", "loader_workers", "precision", "train_choices", "unroll"]

GPU_LOADER_WORKERS = 4  # reader processes ahead of a GPU; the CPU path reads in the training process


def device(choice: str = "auto", *, force_cpu: bool = False) -> str:
    """auto | cpu | cuda -> cpu | cuda: auto (or force_cpu unset) takes CUDA when it is there."""
    if force_cpu:
        return "cpu"
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def precision(choice: str, device_type: str) -> str:
    """accelerate's mixed_precision: auto = bf16 autocast on GPU, fp32 ("no") on CPU."""
    return ("bf16" if device_type == "cuda" else "no") if choice == "auto" else choice


def unroll(choice: str, device_type: str) -> str:
    """The TTT unroll: auto = fast on GPU (flash kernels), reference elsewhere."""
    return ("fast" if device_type == "cuda" else "reference") if choice == "auto" else choice


def compile_fast_path(choice, device_type: str) -> bool:
    """compile=auto: on GPU only (Inductor's CPU compile takes minutes and the CPU path is small)."""
    choice = str(choice).lower()
    return device_type == "cuda" if choice == "auto" else choice == "true"


def loader_workers(n: int, device_type: str) -> int:
    """data.num_workers=-1: GPU_LOADER_WORKERS on GPU, 0 (read in this process) on CPU."""
    return n if n >= 0 else (GPU_LOADER_WORKERS if device_type == "cuda" else 0)


def image_embeddings(choice: str, engine: str = EXPORT_ENGINE) -> str:
    """A config's `image_embeddings` (auto | fused | placeholder) -> the convention (auto: `engine`'s)."""
    if choice not in IMAGE_EMBEDDINGS:
        raise ValueError(f"image_embeddings={choice!r}: expected one of {IMAGE_EMBEDDINGS}")
    return default_for_engine(engine) if choice == "auto" else choice


def train_choices(config) -> dict:
    """Every auto of a train config (eagle3.config.schema.train.TrainConfig), resolved: what the run uses and
    its manifest records under `resolved` (data.order: its schema's resolved_order). The device is the type
    accelerate will pick (cpu=true forces CPU)."""
    dev = device("auto", force_cpu=config.cpu)
    return {"device": dev, "precision": precision(config.precision, dev), "unroll": unroll(config.unroll, dev),
            "compile": compile_fast_path(config.compile, dev),
            "image_embeddings": image_embeddings(config.image_embeddings),
            "loader_workers": loader_workers(config.data.num_workers, dev)}
