"""The mini world's pure parts: record -> conversation, the topic split, packing, the lr
schedule and perplexity (against a naive per-token reference)."""
import math

import pytest
import torch

from data.corpus import RawRecord
from data.mini_world.lm import lr_at, pack_blocks, perplexity, resolve_device, train_lm, unigram_perplexity
from data.mini_world.split import CODE, PROSE, classify, conversation_of, split_conversations
from eagle3.config.conf import ConfigError, compose, to_schema
from eagle3.config.schema.mini_world import MiniWorldConfig


def rec(i, turns, rid=None):
    return RawRecord("mem", i, value={"id": rid or f"c{i}_0", "conversations": turns})


def conv(user, bot, rid):
    return [{"from": "human", "value": user}, {"from": "gpt", "value": bot}]


def test_conversation_of_reasons():
    ok, why = conversation_of(rec(0, conv("hi", "hello", "a")))
    assert ok and why == "" and ok.group == "c0" and ok.messages()[1] == {"role": "assistant", "content": "hello"}
    assert conversation_of(RawRecord("mem", 1, error="bad"))[1] == "malformed"
    assert conversation_of(RawRecord("mem", 2, value=[1, 2]))[1] == "no_conversations"
    assert conversation_of(rec(3, [{"from": "human", "value": 5}]))[1] == "bad_turn"
    assert conversation_of(rec(4, [{"from": "alien", "value": "x"}]))[1] == "unknown_role"
    assert conversation_of(rec(5, [{"from": "human", "value": "only a question"}]))[1] == "no_user_or_assistant_turn"
    # empty turns are dropped; messages(max_chars) cuts the tail
    c, _ = conversation_of(rec(6, [{"from": "system", "value": "S"}, {"from": "human", "value": "abcdef"},
                                   {"from": "gpt", "value": "   "}, {"from": "bard", "value": "xyz"}]))
    assert [t["from"] for t in c.turns] == ["system", "human", "bard"]
    assert c.messages(max_chars=4) == [{"role": "system", "content": "S"}, {"role": "user", "content": "abc"}]


def test_classify_code_vs_prose():
    code, _ = conversation_of(rec(0, conv("fix this", "```python\nprint(1)\n```", "a")))
    hits, _ = conversation_of(rec(1, conv("def f(x): return x", "import os; class A: pass", "b")))
    prose, _ = conversation_of(rec(2, conv("Write a poem about rain", "Rain falls softly on the hills.", "c")))
    assert classify(code, 3) == CODE and classify(hits, 3) == CODE and classify(prose, 3) == PROSE
    assert classify(hits, 10) == PROSE  # the threshold is honoured


def test_split_quotas_groups_and_determinism():
    records = []
    for g in range(60):
        for part in range(2):  # two parts of each ShareGPT conversation share the root id
            body = "```x```" if g % 3 == 0 else "plain words"
            records.append(rec(len(records), conv(f"q{g}", body, None), rid=f"g{g}_{part}"))
    records.append(rec(999, conv("q", "a", None), rid="g1_0"))  # duplicate id
    quotas = {(PROSE, "eval"): 4, (CODE, "eval"): 2, (PROSE, "corpus"): 6, (CODE, "corpus"): 4}
    kw = dict(seed=7, code_min_hits=3, max_non_ascii_fraction=0.5, quotas=quotas)
    a = split_conversations(records, **kw)
    b = split_conversations(records, **kw)
    assert a.counts() == b.counts() and all(
        [c.id for c in a.parts[k]] == [c.id for c in b.parts[k]] for k in a.parts)
    for (kind, role), n in quotas.items():
        assert len(a.parts[(kind, role)]) == n
        assert all(c.kind == kind for c in a.parts[(kind, role)])
    groups = {role: {c.group for k in (PROSE, CODE) for c in a.parts[(k, role)]} for role in ("eval", "corpus", "train")}
    assert not groups["train"] & (groups["eval"] | groups["corpus"]) and not groups["eval"] & groups["corpus"]
    assert a.skipped["duplicate_id"] == 1
    total = sum(len(v) for v in a.parts.values()) + a.skipped["held_out_overflow"]
    assert total == 120
    c = split_conversations(records, **{**kw, "seed": 8})
    assert [x.id for x in c.parts[(PROSE, "eval")]] != [x.id for x in a.parts[(PROSE, "eval")]]


def test_pack_blocks_and_lr_schedule():
    blocks = pack_blocks([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4)
    assert blocks.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    with pytest.raises(ValueError, match="not enough"):
        pack_blocks([[1]], 4)
    kw = dict(steps=10, lr=1.0, warmup=2, min_ratio=0.1)
    assert lr_at(0, **kw) == 0.5 and lr_at(1, **kw) == 1.0 and lr_at(2, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.1)
    assert all(lr_at(i, **kw) >= lr_at(i + 1, **kw) for i in range(2, 9))


class _FixedLM(torch.nn.Module):
    """Logits depend only on the current token: logits[t] = table[x_t]."""
    def __init__(self, V):
        super().__init__()
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids, attention_mask=None):
        return type("O", (), {"logits": self.table[input_ids]})()


def test_perplexity_matches_naive_reference():
    V = 7
    m = _FixedLM(V)
    seqs = [[1, 2, 3, 4], [5, 6], [0, 1, 2, 3, 4, 5, 6], [3]]
    got = perplexity(m, seqs, max_tokens=8, batch_size=2)
    # naive: every next-token prediction of each sequence, in order, until 8 targets
    nll, n = 0.0, 0
    for s in seqs:
        for a, b in zip(s, s[1:]):
            if n == 8:
                break
            nll -= torch.log_softmax(m.table[a], -1)[b].item()
            n += 1
    assert got["tokens"] == 8 and got["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    uni = unigram_perplexity([[0, 0, 1]], [[5, 0, 1]], 3, max_tokens=10)
    # add-one counts: 0 -> 3, 1 -> 2, 2 -> 1 (of 6); targets 0 and 1
    assert uni == pytest.approx(math.exp(-(math.log(3 / 6) + math.log(2 / 6)) / 2))


def test_device_choice_is_checked(monkeypatch, tmp_path):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        resolve_device("cuda")
    cfg = compose("mini_world", [f"paths.root={tmp_path}", "device=tpu"])
    with pytest.raises(ConfigError, match="device='tpu'"):
        to_schema(cfg, MiniWorldConfig)


def test_train_lm_on_a_device_learns_and_returns_the_model_on_cpu():
    class Bigram(torch.nn.Module):
        def __init__(self, V):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(V, V))

        def forward(self, input_ids, labels):
            logits = self.table[input_ids[:, :-1]]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            return type("O", (), {"loss": loss})()

    blocks = torch.tensor([[0, 1, 2, 3] * 4] * 8)
    cfg = type("C", (), dict(steps=30, batch_size=4, lr=0.3, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.0,
                             grad_clip=1.0))
    model = Bigram(4)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stats = train_lm(model, blocks, cfg, seed=0, desc="bigram", device=dev)
    assert stats["final_loss"] < 0.5 * stats["first_loss"]
    assert model.table.device.type == "cpu" and stats["tokens"] == 30 * 4 * 16
