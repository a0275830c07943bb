"""The vLLM speculators export format (`Eagle3Speculator`): `<out_dir>/speculators/`, the decoder layer named
`layers.0.*`, its config the speculators equivalent of the SGLang one (vLLM's ids = h), optionally holding the
target's embedding. One `ExportFormat` (export/formats.py)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from safetensors import safe_open

from eagle3.drafter import drafter_keys
from export import spec
from export.directory import FormatDirectory
from eagle3.engines.serve_launch import vllm_command

log = logging.getLogger(__name__)
SUBDIR = "speculators"


class Speculators(FormatDirectory):
    name = "speculators"
    subdir = SUBDIR
    ships_embed = True  # on request (export.speculators_embed), for speculators' Python API

    def build_config(self, served, source: Mapping[str, Any], *, hf_indices: Sequence[int], verifier_path: str,
                     verifier_architectures: Sequence[str], speculative_tokens: int) -> dict:
        return spec.speculators_config(spec.served_sglang_config(served, source), hf_indices=hf_indices,
                                       verifier_path=verifier_path, verifier_architectures=verifier_architectures,
                                       speculative_tokens=speculative_tokens)

    def config_problems(self, cfg: Mapping[str, Any], **expected: Any) -> list[str]:
        return spec.speculators_config_problems(cfg, **expected)

    def shape_config(self, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
        # (raises on ids no SGLang config can express)
        return spec.sglang_from_speculators(cfg) if isinstance(cfg.get("transformer_layer_config"), dict) else cfg

    def load(self, path: Path, embed_tokens: Optional[torch.Tensor] = None):
        return load_speculators_dir(path, embed_tokens=embed_tokens).float()

    def serve_command(self, config, fmt_dir: Path, choice, tp: Optional[int]) -> list[str]:
        return vllm_command(config.target, fmt_dir, choice, tp)


def load_speculators_dir(path: Path, embed_tokens: Optional[torch.Tensor] = None):
    """A speculators directory -> Eagle3Drafter (names mapped back, strict: every tensor must match; a shipped
    `embed_tokens.weight` is used, and must equal `embed_tokens` when both are there). Config keys no engine
    reads are reported (console, `model.load_report`)."""
    from eagle3.drafter.model import DrafterConfig, Eagle3Drafter

    path = Path(path)
    cfg = json.loads((path / spec.CONFIG_FILE).read_text())
    dcfg = DrafterConfig.from_hf_dict(spec.sglang_from_speculators(cfg))
    unknown = drafter_keys.check_config(cfg, "speculators").unknown
    if unknown:
        log.warning("speculators drafter %s: config keys no known engine reads, ignored: %s", path, unknown)
    with safe_open(str(path / spec.WEIGHTS_FILE), framework="pt") as f:
        state = {n: f.get_tensor(n) for n in f.keys()}
    # names and shapes must match exactly; dtypes are whatever the export used (all load as fp32)
    expected = spec.expected_tensors(spec.DrafterShape.from_hf_dict(dcfg.to_hf_dict()), "speculators",
                                     embed=spec.EMBED in state)
    expected = {n: spec.TensorSpec(s.shape, state[n].dtype if n in state else s.dtype) for n, s in expected.items()}
    problems = spec.tensor_problems(state, expected)
    if spec.EMBED in state and embed_tokens is not None:
        problems += spec.embed_problems(state[spec.EMBED], embed_tokens)
    if problems:
        raise ValueError(f"{path}: not a loadable speculators drafter: " + "; ".join(problems))
    shipped = state.pop(spec.EMBED, None)
    model = Eagle3Drafter(dcfg)
    missing, unexpected = model.load_state_dict({spec.from_format_name(n, "speculators"): t for n, t in state.items()},
                                                strict=False)
    if set(missing) != {spec.EMBED} or unexpected:
        raise ValueError(f"{path}: weights do not fit the drafter (missing {missing}, unexpected {unexpected})")
    embed = embed_tokens if embed_tokens is not None else shipped
    if embed is not None:
        model.set_embeddings(embed.to(model.embed_tokens.weight.dtype))
    model.load_report = {"dir": str(path), "embed_tokens": "target" if embed_tokens is not None else
                         "from the directory" if shipped is not None else "NOT LOADED: random init",
                         **({"unknown_config_keys": unknown} if unknown else {})}
    return model
