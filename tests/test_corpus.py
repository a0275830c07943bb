"""data/corpus.py: raw record reading on small hand-made files."""
import json

import pytest

from data.corpus import CorpusFormatError, ReadStats, iter_raw_records, sharegpt_package_path

RECS = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"hi {i} \u00e9\u4e2d"}]} for i in range(5)]


def read_all(path):
    stats = ReadStats()
    return list(iter_raw_records(path, stats)), stats


def test_json_array_complete(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps(RECS, indent=2, ensure_ascii=False), encoding="utf-8")
    recs, st = read_all(p)
    assert [r.value for r in recs] == RECS
    assert [r.index for r in recs] == list(range(5))
    assert (st.format, st.read, st.malformed, st.truncated) == ("json_array", 5, 0, False)
    # line numbers point at the element's opening brace
    lines = p.read_text().splitlines()
    assert all(lines[r.line - 1].strip() == "{" for r in recs)


@pytest.mark.parametrize("cut", [10, 37, 100, -1, -3, -30])
def test_json_array_truncated_yields_whole_elements(tmp_path, cut):
    text = json.dumps(RECS, indent=2, ensure_ascii=False)
    # cut inside the 4th element (or near the very end): everything before it must survive
    start4 = text.index('"r3"')
    cut_at = start4 + cut if cut > 0 else len(text) + cut
    p = tmp_path / "t.json"
    p.write_text(text[:cut_at], encoding="utf-8")
    recs, st = read_all(p)
    expected = 3 if cut > 0 else (5 if cut == -1 else 4)  # -1 drops only the closing "]"
    assert [r.value for r in recs] == RECS[:expected]
    assert st.truncated and st.read == expected and st.malformed == 0
    # the truncation is placed where the file ends (its last character), not where the element starts
    kept = text[:cut_at].rstrip()
    end_line, end_col = kept.count("\n") + 1, len(kept) - kept.rfind("\n") - 1
    assert (st.truncated_at_line, st.truncated_at_column) == (end_line, end_col)
    assert f"truncated at line {end_line}, column {end_col}" in st.summary()
    if cut > 0:  # inside the 4th element: the detail names it and where it starts, the message is whole
        start_line = text[:start4].count("\n")  # its "{" is on the line before its "id"
        assert f"the file ends inside element 3, which starts at line {start_line}: " in st.truncation_detail
        assert not st.truncation_detail.endswith(("at", "starting at"))


def test_json_array_streams_across_chunks(tmp_path, monkeypatch):
    import data.corpus as corpus

    monkeypatch.setattr(corpus, "_CHUNK_BYTES", 7)  # every element and number spans many chunks
    recs_in = RECS + [{"n": 1234567890123, "f": 3.25, "t": True}]
    p = tmp_path / "c.json"
    p.write_text(json.dumps(recs_in, ensure_ascii=False), encoding="utf-8")
    recs, st = read_all(p)
    assert [r.value for r in recs] == recs_in and not st.truncated


def test_json_array_non_utf8_element_is_skipped_not_fatal(tmp_path):
    parts = [json.dumps(r).encode() for r in RECS[:3]]
    parts[1] = parts[1].replace(b"hi 1", b"hi \xff\xfe 1")
    p = tmp_path / "b.json"
    p.write_bytes(b"[\n" + b",\n".join(parts) + b"\n]")
    recs, st = read_all(p)
    assert [r.value for r in recs if r.error is None] == [RECS[0], RECS[2]]
    bad = [r for r in recs if r.error]
    assert len(bad) == 1 and bad[0].index == 1 and bad[0].line == 3 and "0xff" in bad[0].error
    assert (st.read, st.malformed) == (2, 1)


def test_json_array_syntax_error_keeps_earlier_records(tmp_path):
    p = tmp_path / "s.json"
    p.write_text("[" + json.dumps(RECS[0]) + ",\n" + json.dumps(RECS[1]) + "\n{oops}, " + json.dumps(RECS[2]) + "]")
    recs, st = read_all(p)
    assert recs[0].value == RECS[0] and recs[1].value == RECS[1]
    assert recs[2].error and "line 3" in recs[2].location and "expected ','" in recs[2].error
    assert (st.read, st.malformed, st.truncated) == (2, 1, False)


def test_json_array_bad_from_the_start_raises_naming_line(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[\n\n  {nope: 1}]")
    with pytest.raises(CorpusFormatError, match=r"x\.json:3"):
        read_all(p)


def test_jsonl_bad_lines_become_error_items(tmp_path):
    p = tmp_path / "d.jsonl"
    lines = [json.dumps(RECS[0]).encode(), b"{not json", b"", json.dumps(RECS[1]).encode(),
             json.dumps(RECS[2]).encode().replace(b"hi 2", b"hi \xc3\x28 2"), json.dumps(RECS[3]).encode()]
    p.write_bytes(b"\n".join(lines) + b"\n")
    recs, st = read_all(p)
    good = [(r.index, r.value) for r in recs if r.error is None]
    assert good == [(1, RECS[0]), (4, RECS[1]), (6, RECS[3])]
    bad = {r.index: r.error for r in recs if r.error}
    assert set(bad) == {2, 5}
    assert bad[2] == "malformed JSON (Expecting property name enclosed in double quotes at column 2)"
    assert "UTF-8" in bad[5] and "0xc3" in bad[5]
    assert (st.format, st.read, st.malformed) == ("jsonl", 3, 2)
    assert any(e.startswith(f"{p}:2:") for e in st.errors)


def test_json_messages_that_end_in_at_get_their_position_once(tmp_path):
    p = tmp_path / "ctl.jsonl"
    p.write_bytes(b'{"a": "x\ty"}\n' + json.dumps(RECS[0]).encode() + b"\n")
    recs, _ = read_all(p)
    assert recs[0].error == "malformed JSON (Invalid control character at column 9)"  # not "at at column"
    q = tmp_path / "ctl.json"
    q.write_text("[" + json.dumps(RECS[0]) + ',\n{"a": "x\ty"},\n' + ",\n".join(map(json.dumps, RECS)) + "]")
    recs, _ = read_all(q)
    assert recs[1].error.startswith("JSON syntax error: Invalid control character at line 2, column 9;")


def test_not_json_at_all_raises_naming_file_and_line(tmp_path):
    p = tmp_path / "n.txt"
    p.write_text("\n\nhello, this is prose\n")
    with pytest.raises(CorpusFormatError, match=r"n\.txt:3: not JSON or JSONL"):
        read_all(p)
    e = tmp_path / "empty.jsonl"
    e.write_text("  \n")
    with pytest.raises(CorpusFormatError, match="empty"):
        read_all(e)
    # starts with "{" but no line is JSON (a pretty-printed object): unusable, says where
    q = tmp_path / "pretty.json"
    q.write_text(json.dumps({"data": RECS}, indent=2))
    with pytest.raises(CorpusFormatError, match=r"pretty\.json:1"):
        read_all(q)


def test_hf_dataset_directory(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"id": r["id"], "conversations": r["conversations"]} for r in RECS])
    ds.save_to_disk(str(tmp_path / "ds"))
    recs, st = read_all(tmp_path / "ds")
    assert [r.value["id"] for r in recs] == [r["id"] for r in RECS]
    assert recs[2].value["conversations"] == RECS[2]["conversations"]
    assert (st.format, st.read) == ("hf_dataset", 5)
    datasets.DatasetDict({"train": ds.select([0, 1]), "test": ds.select([4])}).save_to_disk(str(tmp_path / "dd"))
    recs, _ = read_all(tmp_path / "dd")
    assert [(r.source.endswith("[train]") or r.source.endswith("[test]"), r.value["id"]) for r in recs] == \
        [(True, "r0"), (True, "r1"), (True, "r4")]
    (tmp_path / "plain").mkdir()
    with pytest.raises(CorpusFormatError, match="not a Hugging Face dataset"):
        read_all(tmp_path / "plain")


def test_shipped_sharegpt_is_found_and_its_head_parses():
    with sharegpt_package_path() as p:
        assert p.is_file() and p.stat().st_size > 1_000_000
        first = next(iter_raw_records(p))
    assert first.index == 0 and first.error is None and "conversations" in first.value
