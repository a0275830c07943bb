"""The prepare stage: role mapping, the template-derived loss mask (checked against an
independent header-token scan), truncation, the split, every bad-input reason with its count,
the three input formats, and reuse of a finished run."""
import json
import shutil

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from data.corpus import CorpusFormatError
from data.prepare import (SKIP_REASONS, Conversation, PrepareError, Skip, TemplateEncoder, conversation_from_record,
                          is_validation, run_prepare)
from eagle3.conf import compose, to_schema
from eagle3.manifest import read_manifest
from eagle3.schema.prepare import PrepareConfig


def prepare_config(tmp_path, tokenizer_dir, input_path, *overrides) -> PrepareConfig:
    cfg = compose("prepare", [f"paths.root={tmp_path}", f"target.tokenizer={tokenizer_dir}", f"input={input_path}",
                              "max_length=256", *overrides])
    return to_schema(cfg, PrepareConfig)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def conv(cid, *turns):
    return {"id": cid, "conversations": [{"from": r, "value": v} for r, v in turns]}


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
    c, trailing = conversation_from_record(rec, "fallback")
    assert c.id == "7" and trailing == 1
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user"] + ["assistant"] * 4
    assert [m["content"] for m in c.messages] == list("Sabcdefg")
    # OpenAI-style records and text-part lists are accepted; a missing id falls back
    c2, _ = conversation_from_record({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
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
            c, _ = conversation_from_record(json.loads(line), "f")
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


GOOD = [conv(f"g{i}", ("human", f"question {i}?"), ("gpt", f"answer number {i}."), ("human", "thanks"),
             ("gpt", "you are welcome")) for i in range(12)]


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
    cut.write_text(text[: text.index('"g11"') + 3])  # the last record is cut in the middle
    m = read_manifest(run_prepare(prepare_config(tmp_path, tiny_tokenizer, cut)), "prepare")
    assert m["counts"]["kept"] == 11 and m["reader"]["truncated"]


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
    assert not list(out.glob(".tmp-*"))
    shutil.rmtree(out / "validation")  # an incomplete directory is not reused
    run_prepare(cfg)
    assert (out / "validation").is_dir()
