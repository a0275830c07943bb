"""The prepare stage: role mapping, the template-derived loss mask (checked against an
independent header-token scan), truncation, the split, every bad-input reason with its count,
the three input formats, reuse of a finished run, and the records of issue 20 (text that is not
encodable Unicode, assistant turns before the first user turn, ambiguous records, huge records)."""
import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from data.corpus import CorpusFormatError
from data.prepare import (SKIP_REASONS, Conversation, PrepareError, Skip, TemplateEncoder, conversation_from_record,
                          is_validation, run_prepare)
from eagle3.formats.manifest import read_manifest
from tests.fixtures.prepare import GOOD, conv, prepare_config, write_jsonl


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer))


def reference_mask(tok, ids):
    """Independent reference for the Kimi-shaped template: a position is trained iff it lies
    after an `<|im_assistant|>` header's `<|im_middle|>` and up to and including its `<|im_end|>`."""
    a, mid, end = (tok.convert_tokens_to_ids(t) for t in ("<|im_assistant|>", "<|im_middle|>", "<|im_end|>"))
    mask, state = [], "out"  # out -> header (after <|im_assistant|>) -> body (after its <|im_middle|>)
    for t in ids:
        if state == "body":
            mask.append(1)
            if t == end:
                state = "out"
            continue
        mask.append(0)
        if t == a:
            state = "header"
        elif t == mid and state == "header":
            state = "body"
    return mask


def test_roles_are_mapped_and_trailing_turns_dropped():
    rec = {"id": 7, "conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
        {"from": "user", "value": "c"}, {"from": "chatgpt", "value": "d"}, {"from": "Bing", "value": "e"},
        {"from": "bard", "value": "f"}, {"from": "assistant", "value": "g"}, {"from": "human", "value": "tail"}]}
    c, leading, trailing = conversation_from_record(rec, "fallback")
    assert c.id == "7" and (leading, trailing) == (0, 1)
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user"] + ["assistant"] * 4
    assert [m["content"] for m in c.messages] == list("Sabcdefg")
    # OpenAI-style records and text-part lists are accepted; a missing id falls back
    c2, _, _ = conversation_from_record({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                                {"type": "text", "text": "y"}]},
                                                   {"role": "assistant", "content": "z"}]}, "f.jsonl:3")
    assert c2.id == "f.jsonl:3" and c2.messages[0]["content"] == "xy"


@pytest.mark.parametrize("record, reason", [
    ([1, 2], "not_a_conversation"),
    ({"id": "x"}, "not_a_conversation"),
    ({"conversations": "hi"}, "not_a_conversation"),
    ({"conversations": []}, "empty_conversation"),
    ({"conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": ""}]}, "empty_conversation"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "no_assistant_turn"),
    ({"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "x"}]}, "unknown_role"),
    ({"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "x"}]}, "non_string_content"),
    ({"conversations": [{"from": "human", "value": {"a": 1}}, {"from": "gpt", "value": "x"}]}, "non_string_content"),
    ({"conversations": [{"from": "human", "value": "a\ud800"}, {"from": "gpt", "value": "x"}]}, "unencodable_text"),
    ({"id": "\udfff", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "x"}]},
     "unencodable_text"),
    ({"conversations": [{"from": "human", "value": "a"}], "messages": [{"role": "user", "content": "b"}]},
     "ambiguous_record"),
    ({"messages": [{"role": "user", "content": "a", "value": "b"}, {"role": "assistant", "content": "x"}]},
     "ambiguous_record"),
    ({"conversations": [{"from": "system", "value": "S"}, {"from": "gpt", "value": "x"}]}, "no_assistant_turn"),
])
def test_bad_records_raise_their_reason(record, reason):
    with pytest.raises(Skip) as e:
        conversation_from_record(record, "f")
    assert e.value.reason == reason


def test_loss_mask_covers_exactly_the_assistant_spans(tok, tiny_corpus_jsonl):
    enc = TemplateEncoder(tok, max_length=100000)
    n_checked = 0
    for line in open(tiny_corpus_jsonl):
        try:
            c, _, _ = conversation_from_record(json.loads(line), "f")
        except Skip:
            continue
        e = enc.encode(c)
        ids = e.input_ids.tolist()
        assert e.loss_mask.tolist() == reference_mask(tok, ids)
        # the trained tokens decode to exactly the assistant contents, each closed by <|im_end|>
        spans = np.split(np.asarray(ids), np.flatnonzero(np.diff(e.loss_mask.astype(int)) != 0) + 1)
        masks = np.split(e.loss_mask, np.flatnonzero(np.diff(e.loss_mask.astype(int)) != 0) + 1)
        trained = [tok.decode(s.tolist()) for s, m in zip(spans, masks) if m[0] == 1]
        assert trained == [m["content"] + "<|im_end|>" for m in c.messages if m["role"] == "assistant"]
        # prompt_len: the tokens before the first assistant reply (the first trained position)
        assert e.prompt_len == int(np.argmax(e.loss_mask))
        assert e.input_ids.dtype == np.int32 and e.loss_mask.dtype == np.uint8
        n_checked += 1
    assert n_checked >= 30


K25_LIKE_TEMPLATE = (  # the shape of Kimi-K2.5's: a <think> prefill, history with an empty think block
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|><think></think>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>{%- endif -%}")

UNSTABLE_TEMPLATE = (  # renders the final assistant turn differently from earlier ones
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ m['content'] }}{% if loop.last %} (final){% endif %}"
    "<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def test_k25_shaped_template_trains_after_the_prefill(tok):
    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    t.chat_template = K25_LIKE_TEMPLATE
    c = Conversation("c", [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
                           {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}])
    e = TemplateEncoder(t, 1000).encode(c)
    ids = e.input_ids.tolist()
    think, end_think = t.convert_tokens_to_ids("<think>"), t.convert_tokens_to_ids("</think>")
    trained = [i for i, m in zip(ids, e.loss_mask) if m]
    # the header and the <think> prefill are prompt; </think>, the content and <|im_end|> are trained
    assert think not in trained and trained.count(end_think) == 2
    assert t.decode(trained) == "</think>hi there<|im_end|></think>sure<|im_end|>"


def test_template_that_is_not_prefix_stable_is_skipped(tok):
    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    t.chat_template = UNSTABLE_TEMPLATE
    c = Conversation("c", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])
    with pytest.raises(Skip) as e:
        TemplateEncoder(t, 1000).encode(c)
    assert e.value.reason == "template_not_prefix_stable"
    single = Conversation("s", c.messages[:2])  # one turn: nothing renders differently
    assert TemplateEncoder(t, 1000).encode(single).loss_mask.sum() > 0


def merging_template(head: str) -> str:
    """The generation prompt ends mid-word (`head`), so the answer's first characters merge
    with it into one token in the full rendering."""
    return ("{%- for m in messages -%}"
            "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
            "{%- else -%}<|im_assistant|>assistant<|im_middle|>" + head + "{{ m['content'] }}<|im_end|>{%- endif -%}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>" + head + "{%- endif -%}")


def test_token_merging_across_the_turn_boundary_is_detected(tok):
    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    # a learned merge: a lowercase word that is one token, cut after its first letter
    word = next(w for w, _ in sorted(t.get_vocab().items(), key=lambda kv: kv[1])
                if len(w) >= 3 and w.isascii() and w.isalpha() and w.islower())
    assert len(t(word, add_special_tokens=False)["input_ids"]) == 1
    t.chat_template = merging_template(word[0])
    c = Conversation("c", [{"role": "user", "content": "a"}, {"role": "assistant", "content": word[1:]}])
    with pytest.raises(Skip, match="not a token prefix") as e:
        TemplateEncoder(t, 1000).encode(c)
    assert e.value.reason == "template_not_prefix_stable"


def test_truncation_and_overlong_policies(tok):
    c = Conversation("c", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}])
    full = TemplateEncoder(tok, 100000).encode(c)
    cut = TemplateEncoder(tok, full.prompt_len + 5).encode(c)
    assert cut.truncated and len(cut.input_ids) == full.prompt_len + 5
    assert cut.input_ids.tolist() == full.input_ids[: full.prompt_len + 5].tolist()
    assert int(cut.loss_mask.sum()) == 5
    for max_len, policy in ((full.prompt_len, "truncate"), (full.prompt_len + 5, "skip")):
        with pytest.raises(Skip) as e:
            TemplateEncoder(tok, max_len, policy).encode(c)
        assert e.value.reason == "too_long"


def test_split_is_by_id_hash_and_deterministic():
    ids = [f"conv-{i}" for i in range(4000)]
    val = {i for i in ids if is_validation(i, 0.1, "s")}
    assert 300 < len(val) < 500
    assert val == {i for i in reversed(ids) if is_validation(i, 0.1, "s")}
    assert val != {i for i in ids if is_validation(i, 0.1, "other-salt")}
    assert not any(is_validation(i, 0.0, "s") for i in ids)


def bad_input_rows():
    """Each bad kind once or more, interleaved with the good records; expected counts."""
    rows = [GOOD[0], "{not json", GOOD[1], conv("e1"), GOOD[2], conv("n1", ("human", "only a question")),
            GOOD[3], conv("u1", ("human", "q"), ("wizard", "a")), GOOD[4],
            {"id": "s1", "conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "a"}]},
            GOOD[5], conv("g0", ("human", "dup"), ("gpt", "dup")), GOOD[6],
            conv("long", ("human", "x " * 2000), ("gpt", "y")), GOOD[7], '{"id": "broken", "conversations": [',
            ["not", "an", "object"], GOOD[8], conv("e2", ("human", ""), ("gpt", "   ")), *GOOD[9:]]
    expected = {"malformed": 2, "not_a_conversation": 1, "empty_conversation": 2, "no_assistant_turn": 1,
                "unknown_role": 1, "non_string_content": 1, "duplicate_id": 1, "too_long": 1}
    return rows, expected


def load_split(out, name):
    return datasets.load_from_disk(str(out / name))


def test_every_bad_input_reason_is_counted_and_good_records_kept(tmp_path, tiny_tokenizer, capsys):
    rows, expected = bad_input_rows()
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = run_prepare(prepare_config(tmp_path, tiny_tokenizer, src, "validation_fraction=0.25"))
    m = read_manifest(out, "prepare")
    counts = m["counts"]
    assert counts["records_read"] == len(rows)
    assert counts["skipped"] == {r: expected.get(r, 0) for r in SKIP_REASONS}
    assert counts["kept"] == len(GOOD) == counts["records_read"] - sum(expected.values())
    train, val = load_split(out, "train"), load_split(out, "validation")
    assert sorted(list(train["id"]) + list(val["id"])) == sorted(g["id"] for g in GOOD)
    assert len(val) == sum(is_validation(g["id"], 0.25, "eagle3-split") for g in GOOD) > 0
    assert m["skip_examples"]["malformed"][0].startswith(f"{src}:2")  # file:line of the bad line
    # the dataset's schema is the contract
    assert train.features["input_ids"].feature.dtype == "int32"
    assert train.features["loss_mask"].feature.dtype == "uint8"
    assert train.features["prompt_len"].dtype == "int32" and train.features["id"].dtype == "string"
    row = train[0]
    assert row["loss_mask"][row["prompt_len"]] == 1 and not any(row["loss_mask"][: row["prompt_len"]])
    assert counts["loss_tokens"] == sum(sum(r) for r in list(train["loss_mask"]) + list(val["loss_mask"]))
    printed = capsys.readouterr().out
    for reason, n in expected.items():
        assert f"skipped {reason}" in printed and f" {n}" in printed


def test_an_empty_validation_split_is_a_loadable_empty_dataset(tmp_path, tiny_tokenizer):
    out = run_prepare(prepare_config(tmp_path, tiny_tokenizer, write_jsonl(tmp_path / "c.jsonl", GOOD[:3]),
                                     "validation_fraction=0.0"))
    val = load_split(out, "validation")
    assert len(val) == 0 and val.features == load_split(out, "train").features
    assert read_manifest(out, "prepare")["splits"]["validation"]["conversations"] == 0


def test_same_records_as_jsonl_json_array_and_hf_dataset(tmp_path, tiny_tokenizer):
    jsonl = write_jsonl(tmp_path / "c.jsonl", GOOD)
    array = tmp_path / "c.json"
    array.write_text(json.dumps(GOOD, indent=1))
    hf_dir = tmp_path / "c_hf"
    datasets.Dataset.from_list(GOOD).save_to_disk(str(hf_dir))
    results = []
    for i, src in enumerate((jsonl, array, hf_dir)):
        out = run_prepare(prepare_config(tmp_path, tiny_tokenizer, src, f"out_dir={tmp_path}/out{i}"))
        t = load_split(out, "train")
        results.append((list(t["id"]), list(t["input_ids"]), list(t["loss_mask"])))
    assert results[0] == results[1] == results[2]


def test_truncated_json_array_keeps_complete_records(tmp_path, tiny_tokenizer):
    text = json.dumps(GOOD, indent=1)
    cut = tmp_path / "cut.json"
    kept = text[: text.index('"g11"') + 3]
    cut.write_text(kept)  # the last record is cut in the middle
    m = read_manifest(run_prepare(prepare_config(tmp_path, tiny_tokenizer, cut)), "prepare")
    assert m["counts"]["kept"] == 11 and m["reader"]["truncated"]
    # where the file ends (its last line and column), and which element it cut, from which line
    r = m["reader"]
    assert (r["truncated_at_line"], r["truncated_at_column"]) == (kept.count("\n") + 1, len(kept.splitlines()[-1]))
    start = text[: text.index('"g11"')].count("\n")  # the element's "{" is on the line before its id
    assert r["truncation_detail"] == (f"the file ends inside element 11, which starts at line {start}: Unterminated "
                                      f"string starting at line {kept.count(chr(10)) + 1}, column "
                                      f"{len(kept.splitlines()[-1]) - 2}")


def test_unparseable_input_fails_naming_file_and_line(tmp_path, tiny_tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n\nthis is not json at all\n")
    with pytest.raises(CorpusFormatError, match=r"bad\.jsonl:3"):
        run_prepare(prepare_config(tmp_path, tiny_tokenizer, bad))
    allbad = write_jsonl(tmp_path / "allbad.jsonl", ["{oops", "{nope"])
    with pytest.raises(CorpusFormatError, match=r"allbad\.jsonl:1"):
        run_prepare(prepare_config(tmp_path, tiny_tokenizer, allbad))
    useless = write_jsonl(tmp_path / "useless.jsonl", [conv("a", ("human", "q"))])
    with pytest.raises(PrepareError, match="no_assistant_turn"):
        run_prepare(prepare_config(tmp_path, tiny_tokenizer, useless))
    with pytest.raises(PrepareError, match="does not exist"):
        run_prepare(prepare_config(tmp_path, tiny_tokenizer, tmp_path / "missing.jsonl"))


def test_finished_run_is_reused_and_redone_when_inputs_change(tmp_path, tiny_tokenizer, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", GOOD)
    cfg = prepare_config(tmp_path, tiny_tokenizer, src)
    out = run_prepare(cfg)
    first = (out / "manifest.json").read_text()
    run_prepare(cfg)
    assert "reusing" in capsys.readouterr().out
    assert (out / "manifest.json").read_text() == first
    write_jsonl(src, GOOD[:6])  # the input changed: redone
    run_prepare(cfg)
    assert read_manifest(out, "prepare")["counts"]["kept"] == 6
    assert not list(out.glob(".*.tmp-*"))  # the staging directory (eagle3/stage_dir.py) is gone
    shutil.rmtree(out / "validation")  # an incomplete directory is not reused
    run_prepare(cfg)
    assert (out / "validation").is_dir()


# ------------------------------------------------------------------ issue 20: records that must not fail a batch,
# leading assistant turns, ambiguous records, huge records

BAD_RECORDS = Path(__file__).parent / "data" / "bad_chat_records.jsonl"


def trained_text(tok, row) -> str:
    return tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])


def test_leading_assistant_turns_never_carry_loss_and_a_system_prompt_stays():
    rec = conv("s", ("system", "S"), ("gpt", "early"), ("gpt", "earlier"), ("human", "q"), ("gpt", "a"), ("human", "t"))
    c, leading, trailing = conversation_from_record(rec, "f")
    assert [(m["role"], m["content"]) for m in c.messages] == [("system", "S"), ("user", "q"), ("assistant", "a")]
    assert (leading, trailing) == (2, 1)
    c, leading, _ = conversation_from_record(conv("n", ("gpt", "x"), ("human", "q"), ("gpt", "a")), "f")
    assert [m["role"] for m in c.messages] == ["user", "assistant"] and leading == 1
    # both keys set but one of them null (a dataset holding both columns) is not ambiguous
    c, _, _ = conversation_from_record({"conversations": None, "messages": [
        {"role": "user", "content": "q", "from": None}, {"role": "assistant", "content": "a"}]}, "f")
    assert [m["content"] for m in c.messages] == ["q", "a"]


def test_bad_records_file_is_counted_reported_and_the_rest_kept(tmp_path, tiny_tokenizer, tok, capsys):
    out = run_prepare(prepare_config(tmp_path, tiny_tokenizer, BAD_RECORDS, "validation_fraction=0.0"))
    m = read_manifest(out, "prepare")
    counts = m["counts"]
    expected = {"unencodable_text": 2, "ambiguous_record": 2, "malformed": 1}
    assert counts["records_read"] == 10 and counts["skipped"] == {r: expected.get(r, 0) for r in SKIP_REASONS}
    train = load_split(out, "train")
    assert sorted(train["id"]) == sorted(["good-1", "good-2", "system-then-assistant", "assistant-first",
                                          "other-key-null"])
    assert (counts["leading_assistant_turns_dropped"], counts["trailing_messages_dropped"]) == (2, 1)
    # the skipped records are named by file and line, with what is wrong
    ex = m["skip_examples"]
    assert ex["unencodable_text"][0] == f"{BAD_RECORDS}:2: message 0 is not encodable Unicode (lone surrogate " \
                                        "U+D800 at character 7)"
    assert ex["unencodable_text"][1].startswith(f"{BAD_RECORDS}:3: the id is not encodable")
    assert ex["ambiguous_record"] == [f"{BAD_RECORDS}:6: the record has both 'conversations' and 'messages', with "
                                      "different values",
                                      f"{BAD_RECORDS}:7: message 0 has both 'from' and 'role', with different values"]
    tab_column = BAD_RECORDS.read_text().splitlines()[8].index("\t") + 1
    assert ex["malformed"] == [f"{BAD_RECORDS}:9: malformed JSON (Invalid control character at column {tab_column})"]
    # the system prompt is context; the assistant turn before the first user turn is gone, not trained
    rows = {r["id"]: r for r in train}
    row = rows["system-then-assistant"]
    assert "You are terse." in tok.decode(row["input_ids"]) and "LEADING" not in tok.decode(row["input_ids"])
    assert trained_text(tok, row) == "Blue.<|im_end|>"
    assert trained_text(tok, rows["assistant-first"]) == "Then it ended.<|im_end|>"
    printed = capsys.readouterr().out
    assert f"skipped unencodable_text             2  (first: {BAD_RECORDS}:2: message 0" in printed
    assert "dropped from kept conversations: 2 assistant turns before the first user turn, 1 messages after the " \
           "last assistant turn" in printed


def test_a_text_the_tokenizer_rejects_fails_only_its_conversation(tok):
    """A conversation the records check cannot see (built in code, as regeneration builds them) whose
    text the tokenizer rejects: the chunk is retokenized one by one and only that one is skipped."""
    good = [Conversation(f"g{i}", [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}])
            for i in range(3)]
    bad = Conversation("bad", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x\ud800"}])
    enc = TemplateEncoder(tok, 256)
    out = enc.encode_many([good[0], bad, good[1], good[2]])
    assert isinstance(out[1], Skip) and out[1].reason == "tokenizer_error"
    alone = enc.encode_many(good)
    assert [o.input_ids.tolist() for o in (out[0], out[2], out[3])] == [a.input_ids.tolist() for a in alone]


class RecordingTokenizer:
    """The real tokenizer, recording the longest text it is asked to tokenize."""

    def __init__(self, tok):
        self._tok, self.longest = tok, 0

    def __call__(self, texts, **kw):
        self.longest = max([self.longest] + [len(t) for t in ([texts] if isinstance(texts, str) else texts)])
        return self._tok(texts, **kw)

    def __len__(self):
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_a_huge_record_is_cut_before_it_is_tokenized(tmp_path, tiny_tokenizer, tok, monkeypatch):
    import data.prepare as prepare
    from data.template_encoder import MARGIN_TOKENS

    seen = RecordingTokenizer(tok)
    monkeypatch.setattr(prepare, "load_tokenizer", lambda target: seen)
    huge = "word " * 1_000_000  # 5 MB: about 2M tokens if tokenized whole
    src = write_jsonl(tmp_path / "huge.jsonl", [GOOD[0], conv("huge-answer", ("human", "q"), ("gpt", huge)),
                                               conv("huge-prompt", ("human", huge), ("gpt", "a")), GOOD[1]])
    out = run_prepare(prepare_config(tmp_path, tiny_tokenizer, src, "validation_fraction=0.0"))  # max_length 256
    bound = TemplateEncoder(tok, 256).char_budget(0)
    assert bound <= (256 + MARGIN_TOKENS) * 8 and 0 < seen.longest <= bound
    m = read_manifest(out, "prepare")
    assert m["counts"]["skipped"]["too_long"] == 1 and "huge.jsonl:3" in m["skip_examples"]["too_long"][0]
    row = {r["id"]: r for r in load_split(out, "train")}["huge-answer"]
    assert len(row["input_ids"]) == 256 and m["counts"]["truncated"] == 1
    assert trained_text(tok, row) == tok.decode(tok(huge[:5000], add_special_tokens=False)["input_ids"][
        : 256 - row["prompt_len"]])
    seen.longest = 0
    with pytest.raises(Skip, match=r"more than \d+ tokens > max_length 256"):
        TemplateEncoder(seen, 256, "skip").encode(Conversation("h", [{"role": "user", "content": "q"},
                                                                      {"role": "assistant", "content": huge}]))
    assert seen.longest <= bound


def long_conversations(tiny_corpus_jsonl) -> dict:
    texts = [t["value"] for line in open(tiny_corpus_jsonl) for t in json.loads(line)["conversations"]
             if isinstance(t.get("value"), str)]
    prose = " ".join(texts)[:40_000]
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": texts[i % len(texts)][:300]} for i in range(400)]
    return {
        "long_answer": [{"role": "user", "content": "q"}, {"role": "assistant", "content": prose}],
        "long_prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": prose[:3000]},
                        {"role": "assistant", "content": prose[3000:]}],
        "prompt_past_max_length": [{"role": "user", "content": prose}, {"role": "assistant", "content": "a"}],
        "many_turns": many[:-1] if many[-1]["role"] == "user" else many,
        "unicode": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "中文测试，éèê 🙂 " * 3000}],
        "no_spaces": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 30_000}],
    }


@pytest.fixture(scope="module")
def whole_encodings(tok, tiny_corpus_jsonl) -> dict:
    """Each long conversation encoded whole (a budget far above its rendering: never cut)."""
    out = {}
    for name, msgs in long_conversations(tiny_corpus_jsonl).items():
        c = Conversation(name, msgs)
        out[name] = (c, TemplateEncoder(tok, 10 ** 7).encode(c))
    return out


@pytest.mark.parametrize("guess", [8, 1])  # 1: every cut is too short at first, so the budget doubles
@pytest.mark.parametrize("max_length", [64, 300])
def test_cut_rendering_encodes_exactly_like_the_whole(tok, whole_encodings, monkeypatch, guess, max_length):
    import data.template_encoder as te

    monkeypatch.setattr(te, "CHARS_PER_TOKEN_GUESS", guess)
    for name, (c, whole) in whole_encodings.items():
        assert not whole.truncated and len(whole.input_ids) > max_length + te.MARGIN_TOKENS, name
        enc = TemplateEncoder(tok, max_length)
        assert enc.char_budget(0) < len(tok.apply_chat_template(c.messages, tokenize=False)), name  # it is cut
        try:
            cut = enc.encode(c)
        except Skip as s:
            assert s.reason == "too_long" and not whole.loss_mask[:max_length].any(), name
            continue
        assert cut.truncated and cut.input_ids.tolist() == whole.input_ids[:max_length].tolist(), name
        assert cut.loss_mask.tolist() == whole.loss_mask[:max_length].tolist(), name
        assert cut.prompt_len == whole.prompt_len, name


def test_prompt_fits_agrees_with_counting_every_token(tok, tiny_corpus_jsonl):
    enc = TemplateEncoder(tok, 200)
    prose = long_conversations(tiny_corpus_jsonl)["long_answer"][1]["content"]
    for n_chars in (10, 200, 500, 700, 900, 1200, 5000, 40_000):
        history = [{"role": "user", "content": prose[:n_chars]}]
        rendered = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        exact = len(tok(rendered, add_special_tokens=False)["input_ids"])
        assert enc.prompt_fits(history) == (exact < 200), n_chars
