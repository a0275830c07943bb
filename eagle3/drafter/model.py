"""The EAGLE-3 drafter: numerically SGLang's `LlamaForCausalLMEagle3` (one decoder layer).

One draft step (docs/design.md "Drafter forward"), H = hidden_size:
    e      = embed_tokens(input_ids)                       [B,T,H]   target's, frozen
    x      = cat(input_layernorm(e), hidden_norm(hidden))  [B,T,2H]
    h1     = hidden + o_proj(attn(q/k/v_proj(x)))          residual = the *un-normalised* hidden
    out    = h1 + mlp(post_attention_layernorm(h1))        [B,T,H]   pre-norm: next step's hidden
    logits = lm_head(norm(out))                            [B,T,draft_V]
At step 0 `hidden` is fc(aux) with aux the 3 captured target states [B,T,3*target_H].
SGLang's fused `post_attention_layernorm(x, residual)` / `norm(x, residual)` compute exactly these
sums (residual + x, then RMSNorm), returning the pre-norm sum as the next residual.

Parameter names are the SGLang checkpoint names, so `export_state_dict()` (state_dict minus the
frozen `embed_tokens.weight`) is the exported checkpoint. `d2t` (int64 [draft_V]) holds offsets
(target_id = draft_id + d2t[draft_id]); `t2d` (bool [V]) marks target ids in the draft vocab.

Positions: the caller passes them. In the TTT unroll, step k at position t uses t + k
(`eagle3.drafter.attention.ttt_position_ids`), as SpecForge's llama3_eagle does (`position_ids + len(cache)`).
This is what SGLang does at inference: its draft extend runs the pair (h_t, x_{t+1}) at position t,
and the k-th draft token of a chain rooted at t sits at t + k (tests/test_model.py checks the TTT
unroll against a KVCache chain step by step).

The module knows nothing of files, accelerate or wandb (drafter_io.py does the files).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.engines import aux_layers
from eagle3.drafter import drafter_keys
from eagle3.drafter import drafter_values
from eagle3.drafter import vocab_map
from eagle3.drafter.attention import KVCache, TTTCache

ARCHITECTURE = drafter_values.LLAMA_CLASS
ROPE_TYPES = drafter_values.ROPE_TYPES  # the rope variants rope_inv_freq implements
# rope base of a config that states none: what SGLang's llama layer reads (`getattr(config, "rope_theta", 10000)`)
# and transformers' LlamaConfig fills in (`default_theta = 10_000.0`), so training and serving agree
DEFAULT_ROPE_THETA = 10000.0


def check_aux_width(aux: torch.Tensor, fc: nn.Linear) -> None:
    """The captured states' width must be fc's input (len(aux layers) x target_hidden_size)."""
    if aux.shape[-1] != fc.in_features:
        raise ValueError(f"aux width {aux.shape[-1]} != fc input {fc.in_features} (3 x target_hidden_size)")


@dataclass
class DrafterShape:
    """The sizes that fix every tensor's shape, as `config_sizes` reads them from a config.json. Judges
    nothing else (the export checks a written directory against it and lists its other faults);
    DrafterConfig is this plus everything the forward needs."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "DrafterShape":
        return DrafterShape(**config_sizes(d))


@dataclass
class DrafterConfig(DrafterShape):
    """The drafter's `config.json` (SGLang / SpecForge / AQ-MedAI layout) as a dataclass: its shape
    (DrafterShape's eight sizes) and the rest of what the forward and the engines read."""
    # h of the 3 target states fc reads (HF output_hidden_states indices; eagle3/engines/aux_layers.py). config.json
    # lists ids instead (eagle_config.eagle_aux_hidden_state_layer_ids), read/written by an engine's rule.
    aux_hf_indices: Optional[list[int]] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Any] = None  # int or list of ints, as HF allows
    pad_token_id: Optional[int] = None
    torch_dtype: str = "bfloat16"
    initializer_range: float = 0.02
    # keys of the source config no engine is known to read (drafter_keys): reported by the loader, never written
    unknown_keys: list = field(default_factory=list, compare=False)
    # config values read here but that would break the directory served as is (drafter_values.Finding): reported
    key_warnings: list = field(default_factory=list, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rope")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act={self.hidden_act!r}: only 'silu' (SwiGLU) is supported")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}")
        rope_type = rope_type_of(self.rope_scaling)
        if rope_type not in ROPE_TYPES:
            problems.append(f"rope_scaling type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
        if problems:
            raise ValueError("invalid drafter config: " + "; ".join(problems))

    @classmethod
    def from_hf_dict(cls, d: dict, id_rule: str = aux_layers.DEFAULT_RULE) -> "DrafterConfig":
        """Parse a drafter `config.json` dict; raise ValueError naming what cannot be served. Its aux
        layer ids become hidden-state indices by `id_rule` (the serving engine's reading, aux_layers.RULES)."""
        sizes = config_sizes(d)
        theta, scaling = rope_settings(d)
        # every switch an engine reads must mean this model's forward (layers, biases, norms, ...): drafter_keys
        keys = drafter_keys.check_config(d, "sglang")
        keys.raise_if_refused()
        ids = aux_layers.listed_aux_ids(d)
        return cls(
            **sizes,
            aux_hf_indices=None if ids is None else aux_layers.hf_indices_from_ids(ids, id_rule),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling, max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            hidden_act=d.get("hidden_act", "silu"), bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"), pad_token_id=d.get("pad_token_id"),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            initializer_range=float(d.get("initializer_range", 0.02)),
            unknown_keys=keys.unknown, key_warnings=keys.warned,
        )

    def to_hf_dict(self) -> dict:
        """The SGLang-loadable `config.json` dict (fields only: unknown source keys are never carried)."""
        out = {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_act": self.hidden_act, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "torch_dtype": self.torch_dtype,
            "initializer_range": self.initializer_range, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False,
        }
        if self.aux_hf_indices is not None:  # ids that mean these h in every SGLang version where one list can
            out.update(aux_layers.sglang_config_entries(self.aux_hf_indices))
        return out

    def replace(self, **changes) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)


_REQUIRED_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def config_sizes(d: Mapping[str, Any]) -> dict[str, int]:
    """The sizes in a drafter `config.json` that fix every tensor's shape (DrafterConfig's first eight fields),
    with the engines' readings of absent keys (drafter_keys' table): num_key_value_heads = heads, head_dim =
    hidden / heads, draft_vocab_size = vocab_size (the full target vocab, as SGLang reads it), target_hidden_size
    = hidden_size. The one parse of these keys: DrafterShape.from_hf_dict and DrafterConfig.from_hf_dict use it.
    ValueError naming the required keys that are absent (or null)."""
    missing = [k for k in _REQUIRED_SIZES if d.get(k) is None]
    if missing:
        raise ValueError(f"drafter config lacks {missing}")
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    return {
        "hidden_size": hidden, "intermediate_size": int(d["intermediate_size"]),
        "num_attention_heads": heads, "num_key_value_heads": int(d.get("num_key_value_heads") or heads),
        "head_dim": int(d.get("head_dim") or hidden // heads), "vocab_size": int(d["vocab_size"]),
        "draft_vocab_size": int(d.get("draft_vocab_size") or d["vocab_size"]),
        "target_hidden_size": int(d.get("target_hidden_size") or hidden),
    }


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as the model defines them (embed_tokens excluded)."""
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    return {k: tuple(v.shape) for k, v in model.export_state_dict().items()}


def rope_settings(d: Mapping[str, Any], default_theta: Optional[float] = DEFAULT_ROPE_THETA
                  ) -> tuple[Optional[float], Optional[dict]]:
    """(rope_theta, rope_scaling) of a config in transformers-4 keys or transformers-5 `rope_parameters`: the
    one parser of a config's rope (drafter configs, the target's text config, exported configs).

    A config stating no theta in either form (or null) reads as `default_theta`: 10000, as SGLang's llama
    layer and transformers' LlamaConfig read it (training on such a drafter therefore used 10000, and so does
    its export). default_theta=None returns None instead, for the export check that an exported config states
    its rope explicitly (export/spec.py). A default rope_parameters type means no scaling."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta")
    if theta is None:
        theta = default_theta
    scaling = d.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return (None if theta is None else float(theta)), scaling


def rope_type_of(rope_scaling: Optional[dict]) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


def rope_inv_freq(cfg: DrafterConfig, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32) for the config's rope (default, linear, llama3),
    with the same formulas as transformers' / SGLang's rope implementations."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    kind, rs = rope_type_of(cfg.rope_scaling), cfg.rope_scaling or {}
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor, low, high = float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)  # long wavelengths: scaled
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B,T,d] for positions [B,T] (fp32 angles, then cast to `dtype`)."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [B,T,d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in (at least) fp32, cast back, scale by weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DrafterAttention(nn.Module):
    """Self-attention whose q/k/v read the 2H-wide [embeds_normed, hidden_normed] input."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, hkv, d, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(2 * H, h * d, bias=False)
        self.k_proj = nn.Linear(2 * H, hkv * d, bias=False)
        self.v_proj = nn.Linear(2 * H, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [B,h,T,d]
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [B,hkv,T,d]
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(rope_inv_freq(c, x.device), position_ids, q.dtype)
        cos, sin = cos[:, None], sin[:, None]  # [B,1,T,d]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = cache.attend(q, k, v)  # [B,h,T,d]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """SGLang's `midlayer` (the EAGLE-3 LlamaDecoderLayer)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, embeds, hidden, position_ids, cache) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B,T,2H]
        h1 = hidden + self.self_attn(x, position_ids, cache)
        return h1 + self.mlp(self.post_attention_layernorm(h1))


class Eagle3Drafter(nn.Module):
    """The drafter. Build on `device="meta"` (via torch.device context) for shape checks."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen, never exported
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DrafterLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Default mapping: draft id i <-> target id i (offsets 0); set_vocab_mapping replaces it.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Llama's init: linear weights ~ N(0, initializer_range), norms = 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, self.config.initializer_range)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    # --- the step API (training unroll and inference) -------------------------------------
    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B,T,3*target_H] (the captured states, concatenated) -> step-0 hidden [B,T,H]."""
        check_aux_width(aux, self.fc)
        return self.fc(aux.to(self.fc.weight.dtype))

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
             cache: Optional[TTTCache | KVCache] = None, embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One draft step. input_ids [B,T], hidden [B,T,H], position_ids [B,T] (at TTT step k: the
        step-0 positions + k, see ttt.ttt_position_ids) -> pre-norm output [B,T,H] (the next step's
        hidden). cache=None: plain causal attention over these T positions only. embeds [B,T,H]: the
        input embeddings to use instead of embed_tokens(input_ids) (image rows under image_embeddings=fused,
        eagle3/drafter/image_embeddings.py)."""
        if cache is None:
            cache = KVCache()
        embeds = (self.embed_tokens(input_ids) if embeds is None else embeds).to(hidden.dtype)
        return self.midlayer(embeds, hidden, position_ids, cache)

    forward = step  # so wrappers that hook `forward` (DDP, accelerate) see the draft step

    def logits(self, prenorm_hidden: torch.Tensor) -> torch.Tensor:
        """[B,T,H] -> draft-vocab logits [B,T,draft_V]."""
        return self.lm_head(self.norm(prenorm_hidden))

    def draft_ids_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    # --- weights ----------------------------------------------------------------------------
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint SGLang loads: every tensor but the frozen target embeddings."""
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @torch.no_grad()
    def set_embeddings(self, weight: torch.Tensor) -> None:
        """Copy the target's input embeddings [V, H] in (kept frozen)."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embeddings {tuple(weight.shape)} != drafter's "
                             f"{tuple(self.embed_tokens.weight.shape)} (vocab_size x hidden_size)")
        self.embed_tokens.weight.copy_(weight)

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install d2t offsets [draft_V] and the t2d mask [V], after checking they agree."""
        problems = vocab_map.mapping_problems(d2t, t2d, self.config.draft_vocab_size, self.config.vocab_size)
        if problems:
            raise ValueError("bad vocab mapping: " + "; ".join(problems))
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

