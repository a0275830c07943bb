"""`run_mini_world(config)`: build the embedded default world deterministically from the seed.

Stages (each timed; the finished ones are reused on a rerun, so a killed build resumes):
  read + split   ShareGPT records -> K2 (prose) / K2.5 (code) x eval / corpus / train
  tokenizer      byte-level BPE on both training parts, Kimi-style specials + chat template
  k2-mini        DeepSeek-V3 (MLA + MoE) trained from scratch on the K2 part     (causal-LM layout)
  k25-mini       k2-mini trained further on the K2.5 part, then given a tiny vision tower + projector
                 trained jointly with it on synthetic scenes (data/mini_world/vision.py)  (Kimi-K2.5 layout)
  corpus         held-out conversations -> corpus/<target>.jsonl (prepare's default input); the K2.5
                 corpus holds held-out image conversations too (every vision.corpus_every-th record)
  report         parameter counts, held-out perplexity of both models on both distributions
A rerun whose manifest matches the build key (config minus paths, plus the source's fingerprint)
does nothing.
"""
from __future__ import annotations

import hashlib
import json
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from eagle3.config.conf import as_plain_dict
from eagle3.cpu_threads import auto_threads
from eagle3.errors import StageError
from eagle3.formats.manifest import atomic_write_bytes, atomic_write_json, read_manifest, write_manifest
from eagle3.media_tokens import media_token_ids
from eagle3.config.schema.mini_world import MiniWorldConfig
from eagle3.fingerprints import target_weights
from eagle3.world import deterministic_algorithms, deterministic_ops_note

from data.corpus import ReadStats, iter_raw_records, sharegpt_package_path
from data.mini_world import checkpoints as ck
from data.mini_world.lm import encode_until, pack_blocks, perplexity, resolve_device, train_lm, unigram_perplexity
from data.mini_world.split import CODE, PROSE, split_conversations
from data.mini_world import traffic
from data.mini_world import vision as eyes
from data.mini_world.tokenizer import IM_END, add_media_tokens_to, special_token_ids

STAGE = "mini_world"
# Bump when the code changes what is built from the same config (e.g. the chat template), so an
# old world is rebuilt rather than reused. 2: no default system turn in the chat template. 3: the media
# tokens in the tokenizer, k25-mini sees (vision tower trained), image conversations in the K2.5 corpus.
BUILD_VERSION = 3
TARGET_NAMES = {PROSE: "k2_mini", CODE: "k25_mini"}  # = conf/target/*.yaml names: corpus/<name>.jsonl
MODEL_DIRS = {PROSE: "k2-mini", CODE: "k25-mini"}


def _log(msg: str) -> None:
    print(f"[mini-world] {msg}", flush=True)


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_key(cfg: MiniWorldConfig, source_fp: str) -> dict:
    """What the artifacts depend on: everything but where they go and how fast they are made."""
    c = as_plain_dict(cfg)
    for k in ("paths", "out_dir", "force", "init", "num_threads", "device"):
        c.pop(k, None)
    return {"config": c, "source_fingerprint": source_fp, "build_version": BUILD_VERSION}


def _stage_keys(key: dict) -> dict:
    c = key["config"]
    data = {"src": key["source_fingerprint"], "seed": c["seed"], "split": c["split"], "source": c["source"],
            "version": key["build_version"]}
    tok = {**data, "tokenizer": c["tokenizer"]}
    k2 = {**tok, "model": c["model"], "train": c["k2_train"], "max_tok": c["max_tokens_per_conversation"]}
    k25 = {**k2, "train2": c["k25_train"], "vision": c["vision"]}
    return {"tokenizer": _key(tok), "k2-mini": _key(k2), "k25-mini": _key(k25)}


class _Stages:
    """Per-stage stamps (`.stages.json`): a stage whose output exists and whose stamp matches
    its key is reused, so a build killed after k2-mini does not train it again."""

    def __init__(self, out: Path, keys: dict, fresh: bool):
        self.out, self.keys, self.path = out, keys, out / ".stages.json"
        self.stamps = json.loads(self.path.read_text()) if self.path.is_file() and not fresh else {}
        self.times: dict[str, float] = {}

    def done(self, name: str) -> bool:
        marker = "tokenizer.json" if name == "tokenizer" else "config.json"
        return self.stamps.get(name) == self.keys[name] and (self.out / name / marker).is_file()

    def mark(self, name: str) -> None:
        self.stamps[name] = self.keys[name]
        atomic_write_json(self.path, self.stamps)


def _is_reusable(out: Path, key: dict) -> bool:
    try:
        manifest = read_manifest(out, STAGE)
    except Exception:
        return False
    needed = ["tokenizer/tokenizer.json", "k2-mini/config.json", "k25-mini/config.json", "report.json",
              f"corpus/{TARGET_NAMES[PROSE]}.jsonl", f"corpus/{TARGET_NAMES[CODE]}.jsonl"]
    return manifest.get("build_key") == key and all((out / p).is_file() for p in needed)


def _source_path(cfg: MiniWorldConfig, stack: ExitStack) -> Path:
    return Path(cfg.source) if cfg.source else stack.enter_context(sharegpt_package_path())


def _read_records(path: Path, max_records):
    stats = ReadStats()
    recs = []
    for rec in iter_raw_records(path, stats):
        recs.append(rec)
        if max_records is not None and len(recs) >= max_records:
            break
    return recs, stats


def _text_model(cfg: MiniWorldConfig, tok, seed: int):
    from transformers import DeepseekV3ForCausalLM

    m = cfg.model
    tcfg = ck.deepseek_v3_config(
        vocab_size=len(tok), hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_attention_heads,
        intermediate_size=m.intermediate_size, moe_intermediate_size=m.moe_intermediate_size,
        n_routed_experts=m.n_routed_experts, num_experts_per_tok=m.num_experts_per_tok,
        n_shared_experts=m.n_shared_experts, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        max_position_embeddings=m.max_position_embeddings, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids(IM_END), pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tcfg)
    # generation stops at the end of the assistant turn (as Kimi's generation_config does)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(IM_END), tok.eos_token_id]
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def _param_counts(model) -> dict:
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    inactive = moe_layers * (c.n_routed_experts - c.num_experts_per_tok) * per_expert
    return {"total": total, "active_per_token": total - inactive,
            "embedding": c.vocab_size * c.hidden_size, "lm_head": c.vocab_size * c.hidden_size}


def _write_jsonl(path: Path, records: list[dict]) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    atomic_write_bytes(path, data.encode("utf-8"))


def _token_shift(a_seqs, b_seqs, vocab: int, top: int) -> dict:
    """How differently the two training parts use the vocabulary: total-variation distance of
    their token frequencies and the overlap of their top-`top` tokens."""
    def freq(seqs):
        c = torch.zeros(vocab, dtype=torch.float64)
        for s in seqs:
            c += torch.bincount(torch.tensor(s, dtype=torch.long), minlength=vocab).double()
        return c / c.sum()
    pa, pb = freq(a_seqs), freq(b_seqs)
    top = min(top, vocab)
    ta, tb = set(pa.topk(top).indices.tolist()), set(pb.topk(top).indices.tolist())
    return {"total_variation": round(0.5 * (pa - pb).abs().sum().item(), 4), "top_n": top,
            "top_n_overlap": round(len(ta & tb) / top, 4)}


def source_fingerprint(path: Path, edge: int = 4 << 20) -> str:
    """sha256 of the source's size, first and last 4 MB (a directory: of its file list and
    sizes). Cheap on the 125 MB ShareGPT file and changes whenever the file is replaced."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(edge))
            if size > edge:
                fh.seek(max(edge, size - edge))
                h.update(fh.read(edge))
    return h.hexdigest()


class MiniWorldError(StageError, RuntimeError):
    """The mini world cannot be built from this source and these settings (the message says why)."""


def run_mini_world(cfg: MiniWorldConfig) -> Path:
    out = Path(cfg.out_dir)
    t_all = time.perf_counter()
    threads = cfg.num_threads or auto_threads()
    torch.set_num_threads(threads)
    with ExitStack() as stack:
        src = _source_path(cfg, stack)
        key = build_key(cfg, source_fingerprint(src))
        if not cfg.force and _is_reusable(out, key):
            _log(f"{out} is up to date (manifest matches the config and source); nothing to do")
            return out
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").unlink(missing_ok=True)  # no manifest <=> the world is incomplete
        stages = _Stages(out, _stage_keys(key), fresh=cfg.force)
        _log(f"building {out} with {threads} torch thread(s)")
        t = time.perf_counter()
        stats, split = _read_and_split(cfg, src)
        stages.times["read_split"] = time.perf_counter() - t
    parts = split.parts

    tok = _tokenizer_stage(cfg, out, stages, parts)
    t = time.perf_counter()
    enc = _encode_parts(cfg, tok, parts)
    stages.times["encode"] = time.perf_counter() - t

    nondeterministic: list[str] = []
    with deterministic_algorithms(nondeterministic):  # same seed, same weights (eagle3/world.py)
        k2 = _model_stage(cfg, out, stages, tok, "k2-mini", enc[PROSE]["train"], cfg.k2_train, base=None)
        k25 = _model_stage(cfg, out, stages, tok, "k25-mini", enc[CODE]["train"], cfg.k25_train, base=k2)
    weights = {name: target_weights(out / name) for name in MODEL_DIRS.values()}

    t = time.perf_counter()
    _write_jsonl(out / "corpus" / f"{TARGET_NAMES[PROSE]}.jsonl", [c.sharegpt() for c in parts[(PROSE, "corpus")]])
    k25_text = [c.sharegpt() for c in parts[(CODE, "corpus")]]
    v = cfg.vision
    k25_images = eyes.corpus_records(len(k25_text) // (v.corpus_every - 1), seed=cfg.seed + 20, size=v.image_size,
                                     max_turns=v.max_turns)  # held out: another seed than the training pool's
    _write_jsonl(out / "corpus" / f"{TARGET_NAMES[CODE]}.jsonl", eyes.interleave(k25_text, k25_images, v.corpus_every))
    stages.times["corpus"] = time.perf_counter() - t
    t = time.perf_counter()
    seeing = eyes.seeing_check(cfg, out / "k25-mini", tok)
    stages.times["seeing_check"] = time.perf_counter() - t

    t = time.perf_counter()
    device = resolve_device(cfg.device)
    ppl = {name: {TARGET_NAMES[k]: perplexity(model, enc[k]["eval"], max_tokens=cfg.max_eval_tokens, device=device)
                  for k in (PROSE, CODE)} for name, model in (("k2-mini", k2), ("k25-mini", k25))}
    train_all = enc[PROSE]["train"] + enc[CODE]["train"]
    unigram = {TARGET_NAMES[k]: unigram_perplexity(train_all, enc[k]["eval"], len(tok), max_tokens=cfg.max_eval_tokens)
               for k in (PROSE, CODE)}
    stages.times["perplexity"] = time.perf_counter() - t
    stages.times["total"] = time.perf_counter() - t_all

    report = {
        "source": stats.as_dict(), "skipped": dict(split.skipped), "parts": split.counts(),
        "tokenizer": {"vocab_size": len(tok), "special_token_ids": special_token_ids(tok),
                      "media_token_ids": media_token_ids(tok)},
        "token_shift": _token_shift(enc[PROSE]["train"], enc[CODE]["train"], len(tok), top=len(tok) // 8),
        "models": {n: {"params": _param_counts(m), "layers": m.config.num_hidden_layers,
                       "hidden_size": m.config.hidden_size,
                       "train": json.loads((out / n / "train_stats.json").read_text())}
                   for n, m in (("k2-mini", k2), ("k25-mini", k25))},
        "vision": {"image_size": cfg.vision.image_size, "corpus_image_conversations": len(k25_images),
                   "vision_params": seeing.pop("vision_params"), "held_out_answers": seeing},
        # the source's held-out conversations per side, scored by that side's own model: what its traffic would
        # look like if the target wrote like its data (issue 44); the demo measures the regenerated traffic
        "traffic": {TARGET_NAMES[k]: {**traffic.traffic_figures(enc[k]["eval"]), "ppl": ppl[n][TARGET_NAMES[k]]["ppl"]}
                    for k, n in ((PROSE, "k2-mini"), (CODE, "k25-mini"))},
        "perplexity": ppl, "unigram_perplexity": unigram, "torch_threads": threads, "device": str(device),
        "times_s": {k: round(v, 1) for k, v in stages.times.items()},
        "weights": weights, "determinism": {"ops": nondeterministic, "note": deterministic_ops_note(nondeterministic)},
    }
    atomic_write_json(out / "report.json", report)
    write_manifest(out, STAGE, cfg, build_key=key, source=str(src), source_read=stats.as_dict(),
                   counts=split.counts(), torch_threads=threads, weights=weights,
                   determinism=report["determinism"],
                   artifacts=["tokenizer", "k2-mini", "k25-mini", "corpus", "report.json"])
    print(format_report(report), flush=True)
    return out


def _read_and_split(cfg: MiniWorldConfig, src: Path):
    records, stats = _read_records(src, cfg.split.max_records)
    _log(stats.summary())
    s = cfg.split
    quotas = {(PROSE, "eval"): s.eval_conversations, (CODE, "eval"): s.eval_conversations,
              (PROSE, "corpus"): s.corpus_conversations_k2, (CODE, "corpus"): s.corpus_conversations_k25}
    split = split_conversations(records, seed=cfg.seed, code_min_hits=s.code_min_hits,
                                max_non_ascii_fraction=s.max_non_ascii_fraction, quotas=quotas)
    _log(f"split: {split.counts()}; skipped {dict(split.skipped)}")
    for kind in (PROSE, CODE):
        if not split.parts[(kind, "train")]:
            raise MiniWorldError(f"no {kind} training conversations left in {src} after the held-out quotas; "
                                 f"lower split.eval_conversations / split.corpus_conversations_* or read more records")
    return stats, split


def _encode_parts(cfg: MiniWorldConfig, tok, parts) -> dict:
    """Token ids per distribution: a seeded shuffle of the training part, encoded only as far as
    the training steps need, and the eval part."""
    enc = {}
    common = dict(max_tokens=cfg.max_tokens_per_conversation, max_chars=8 * cfg.max_tokens_per_conversation)
    for kind, train_cfg in ((PROSE, cfg.k2_train), (CODE, cfg.k25_train)):
        convs = parts[(kind, "train")]
        order = torch.randperm(len(convs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        need = (train_cfg.steps * train_cfg.batch_size + 1) * train_cfg.seq_len
        enc[kind] = {"train": encode_until(tok, [convs[i] for i in order], need, **common),
                     "eval": encode_until(tok, parts[(kind, "eval")], cfg.max_eval_tokens + 1, **common)}
    return enc


def _tokenizer_stage(cfg, out: Path, stages: _Stages, parts):
    from transformers import AutoTokenizer

    t = time.perf_counter()
    if stages.done("tokenizer"):
        _log("tokenizer: reused")
    else:
        texts, total = [], 0
        per = cfg.tokenizer.max_chars_per_conversation
        # interleave the two training parts so a char cap keeps both represented
        for pair in zip(parts[(PROSE, "train")], parts[(CODE, "train")]):
            for conv in pair:
                text = "\n".join(t["value"] for t in conv.turns)[:per]
                texts.append(text)
                total += len(text)
            if total >= cfg.tokenizer.max_chars:
                break
        _log(f"tokenizer: training byte-level BPE ({cfg.tokenizer.vocab_size} ids) on {len(texts):,} "
             f"conversations, {total / 1e6:.1f}M chars")
        ck.train_tokenizer(texts, cfg.tokenizer.vocab_size, out / "tokenizer", min_frequency=cfg.tokenizer.min_frequency)
        add_media_tokens_to(out / "tokenizer")  # K2.5's image block tokens, 4 ids after the trained vocabulary
        stages.mark("tokenizer")
    stages.times["tokenizer"] = time.perf_counter() - t
    return AutoTokenizer.from_pretrained(str(out / "tokenizer"))


def _model_stage(cfg, out: Path, stages: _Stages, tok, name: str, train_seqs, train_cfg, base):
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    t = time.perf_counter()
    if stages.done(name):
        _log(f"{name}: reused")
        if name == "k2-mini":
            model = DeepseekV3ForCausalLM.from_pretrained(str(out / name))
        else:  # the text model out of the Kimi-K2.5 wrapper, as a plain causal LM for scoring
            wrapper = Kimi_K25ForConditionalGeneration.from_pretrained(str(out / name))
            model = _text_model(cfg, tok, cfg.seed)
            model.model.load_state_dict(wrapper.model.language_model.state_dict())
            model.lm_head.load_state_dict(wrapper.lm_head.state_dict())
        stages.times[name] = time.perf_counter() - t
        return model.eval()
    seed = cfg.seed + (1 if base is None else 2)
    if base is None:
        model = _text_model(cfg, tok, cfg.seed)
    else:  # continue from k2-mini's weights (a copy: k2-mini itself stays as it is)
        model = _text_model(cfg, tok, cfg.seed)
        model.load_state_dict(base.state_dict())
    blocks = pack_blocks(train_seqs, train_cfg.seq_len)
    need = train_cfg.steps * train_cfg.batch_size
    _log(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; {len(blocks):,} blocks of "
         f"{train_cfg.seq_len} tokens, {need:,} used ({need / len(blocks):.2f} passes)")
    device = resolve_device(cfg.device)
    stats = train_lm(model, blocks, train_cfg, seed=seed, desc=f"{name} ({device.type})", device=device)
    stats["blocks_available"] = len(blocks)
    if name == "k2-mini":
        ck.save_causal_lm(model, out / "tokenizer", out / name)
    else:  # k25-mini sees: its vision tower + projector trained jointly with the LM, then saved as Kimi-K2.5
        stats["vision"] = eyes.train_and_save(cfg, out / name, tok, model, train_seqs, device)
    atomic_write_json(out / name / "train_stats.json", stats)
    stages.mark(name)
    stages.times[name] = time.perf_counter() - t
    _log(f"{name}: loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f} in {stages.times[name]:.0f}s")
    return model


def format_report(r: dict) -> str:
    names = list(r["perplexity"])
    dists = list(r["unigram_perplexity"])
    lines = ["", "mini world", f"  source: {r['source']['read']:,} records read"
             + (f" (file truncated at line {r['source']['truncated_at_line']})" if r["source"]["truncated"] else ""),
             f"  parts: {r['parts']}",
             f"  tokenizer vocab: {r['tokenizer']['vocab_size']:,}; token shift k2 vs k25: "
             f"TV {r['token_shift']['total_variation']}, top-{r['token_shift']['top_n']} overlap "
             f"{r['token_shift']['top_n_overlap']}"]
    for n in names:
        p = r["models"][n]["params"]
        lines.append(f"  {n}: {p['total'] / 1e6:.2f}M params ({p['active_per_token'] / 1e6:.2f}M active), "
                     f"{r['models'][n]['train']['tokens']:,} training tokens")
    lines.append("  held-out perplexity   " + "".join(f"{d:>12}" for d in dists))
    for n in names:
        lines.append(f"  {n:<21} " + "".join(f"{r['perplexity'][n][d]['ppl']:>12.2f}" for d in dists))
    lines.append(f"  {'unigram baseline':<21} " + "".join(f"{r['unigram_perplexity'][d]:>12.2f}" for d in dists))
    for side, f in r.get("traffic", {}).items():  # (worlds built before issue 44 have none)
        lines.append("  held-out source traffic, " + traffic.format_figures(side, f))
    if "vision" in r:
        h = r["vision"]["held_out_answers"]
        lines.append(f"  k25-mini sees {r['vision']['image_size']}px images ({r['vision']['vision_params'] / 1e6:.3f}M "
                     f"vision params); captions of {h['scenes']} held-out scenes: {h['exact']} exact, {h['distinct']} "
                     f"distinct; {r['vision']['corpus_image_conversations']} image conversations in the K2.5 corpus")
        if "by_kind" in h:  # worlds built before the per-question check have the caption figures only
            lines.append("  k25-mini's held-out answers exactly right, by question: "
                         + ", ".join(f"{k} {v:.0%}" for k, v in h["by_kind"].items()))
    lines.append("  weights: " + ", ".join(f"{n} {fp}" for n, fp in r.get("weights", {}).items())
                 + f"; {r.get('determinism', {}).get('note', '')}")
    lines.append("  times (s): " + ", ".join(f"{k} {v}" for k, v in r["times_s"].items()))
    return "\n".join(lines)
