"""The vocab stage end to end on a tiny prepared dataset: the mapping against a naive count,
the file contract, the comparison with an init drafter's d2t, the fill rule, and reuse."""
import json
from collections import Counter

import datasets
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from data.prepare import run_prepare
from data.vocab import VocabStageError, run_vocab
from eagle3.config.conf import compose, to_schema
from eagle3.formats.manifest import read_manifest
from eagle3.config.schema.prepare import PrepareConfig
from eagle3.config.schema.vocab import VocabConfig
from eagle3.drafter.vocab_map import ids_from_d2t, validate_mapping

V = 512  # the tiny target's vocab


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_k25_target, tiny_corpus_jsonl):
    root = tmp_path_factory.mktemp("vocab_world")
    cfg = compose("prepare", [f"paths.root={root}", f"target.path={tiny_k25_target}",
                              f"target.tokenizer={tiny_k25_target}", f"input={tiny_corpus_jsonl}", "max_length=512"])
    return root, run_prepare(to_schema(cfg, PrepareConfig))


def vocab_config(root, target, *overrides) -> VocabConfig:
    cfg = compose("vocab", [f"paths.root={root}", f"target.path={target}", f"target.tokenizer={target}", *overrides])
    return to_schema(cfg, VocabConfig)


def naive_counts(prep_dir):
    train = datasets.load_from_disk(str(prep_dir / "train"))
    c = Counter()
    for ids, mask in zip(train["input_ids"], train["loss_mask"]):
        c.update(i for i, m in zip(ids, mask) if m)
    return c


def test_run_vocab_writes_the_mapping_and_report(prepared, tiny_k25_target, tmp_path):
    root, prep = prepared
    ref = naive_counts(prep)
    n = 64
    # an "old" drafter vocab: the 64 lowest ids that occur (t2d absent, as in some releases)
    old_ids = torch.tensor(sorted(ref)[:n])
    drafter = tmp_path / "old-drafter"
    drafter.mkdir()
    save_file({"d2t": old_ids - torch.arange(n), "lm_head.weight": torch.zeros(n, 4)}, str(drafter / "model.safetensors"))
    out = run_vocab(vocab_config(root, tiny_k25_target, f"draft_vocab_size={n}", "+init=aqmedai_k2",
                                 f"init.drafter_path={drafter}"))

    tensors = load_file(str(out / "vocab.safetensors"))
    d2t, t2d, counts = tensors["d2t"], tensors["t2d"], tensors["counts"]
    assert d2t.dtype == torch.int64 and d2t.shape == (n,) and t2d.dtype == torch.bool and t2d.shape == (V,)
    assert counts.dtype == torch.int64 and counts.tolist() == [ref.get(i, 0) for i in range(V)]
    ids = validate_mapping(d2t, t2d, V)
    expected = sorted(sorted(range(V), key=lambda i: (-ref.get(i, 0), i))[:n])
    assert ids.tolist() == expected

    assert read_manifest(out, "vocab")["counts"]["draft_vocab_size"] == n
    report = json.loads((out / "report.json").read_text())
    total = sum(ref.values())
    assert report["loss_tokens"] == total == read_manifest(prep, "prepare")["splits"]["train"]["loss_tokens"]
    assert report["coverage"] == pytest.approx(sum(ref[i] for i in expected) / total)
    c = report["init_comparison"]
    new_set, old_set = set(expected), set(old_ids.tolist())
    assert (c["in_both"], c["only_new"], c["only_old"]) == (len(new_set & old_set), len(new_set - old_set),
                                                            len(old_set - new_set))
    assert c["d2t_entries_differing"] == sum(a != b for a, b in zip(expected, old_ids.tolist()))
    assert c["has_t2d"] is False
    missing = sorted((i for i in ref if i not in old_set), key=lambda i: (-ref[i], i))
    tok = AutoTokenizer.from_pretrained(str(tiny_k25_target))
    assert [m["id"] for m in c["top_missing_from_old"]] == missing[:50]
    assert c["top_missing_from_old"][0]["token"] == tok.decode([missing[0]])
    assert c["old_coverage"] == pytest.approx(sum(ref[i] for i in old_set) / total)


def test_fewer_distinct_tokens_than_n_is_filled_and_reported(prepared, tiny_k25_target):
    root, prep = prepared
    ref = naive_counts(prep)
    seen = len(ref)
    n = min(V, seen + 20)
    out = run_vocab(vocab_config(root, tiny_k25_target, f"draft_vocab_size={n}", f"out_dir={root}/vocab-big"))
    report = json.loads((out / "report.json").read_text())
    d2t = load_file(str(out / "vocab.safetensors"))["d2t"]
    assert d2t.numel() == n and report["filled_with_unseen"] == n - seen and report["coverage"] == 1.0
    assert report["init_comparison"] is None
    unseen = [i for i in ids_from_d2t(d2t).tolist() if i not in ref]
    all_unseen = [i for i in range(V) if i not in ref]
    assert unseen == all_unseen[: n - seen]  # the lowest unseen ids


def test_reuse_missing_init_and_bad_inputs(prepared, tiny_k25_target, tmp_path, capsys):
    root, prep = prepared
    cfg = vocab_config(root, tiny_k25_target, "draft_vocab_size=32", f"out_dir={tmp_path}/v", "+init=aqmedai_k2",
                       f"init.drafter_path={tmp_path}/no-such-drafter")
    out = run_vocab(cfg)
    assert "not found" in capsys.readouterr().out
    first = (out / "manifest.json").read_text()
    run_vocab(cfg)
    assert "reusing" in capsys.readouterr().out and (out / "manifest.json").read_text() == first
    with pytest.raises(VocabStageError, match="no manifest.json"):
        run_vocab(vocab_config(root, tiny_k25_target, f"in_dir={tmp_path}/nothing"))
    with pytest.raises(VocabStageError, match="exceeds the target vocab size"):
        run_vocab(vocab_config(root, tiny_k25_target, f"draft_vocab_size={V + 1}"))
    with pytest.raises(VocabStageError, match="outside the target vocab"):
        run_vocab(vocab_config(root, tiny_k25_target, "target_vocab_size=100", "draft_vocab_size=32",
                               f"out_dir={tmp_path}/v2"))
    bad = tmp_path / "bad-drafter"
    bad.mkdir()
    save_file({"d2t": torch.tensor([5, 3, 0])}, str(bad / "model.safetensors"))  # ids 5, 4, 2: not sorted
    with pytest.raises(VocabStageError, match="inconsistent d2t"):
        run_vocab(vocab_config(root, tiny_k25_target, f"out_dir={tmp_path}/v3", "draft_vocab_size=32", "+init=aqmedai_k2",
                               f"init.drafter_path={bad}"))


@pytest.mark.slow
def test_entry_scripts_run_prepare_then_vocab(tmp_path, tiny_k25_target, tiny_corpus_jsonl):
    """`data/run_prepare.py` then `data/run_vocab.py` run as scripts (as `make prepare` / `make
    vocab` do: Hydra composition, from another working directory, outputs under paths.root).
    Both run in one interpreter (runpy, as `__main__`) to pay the torch/transformers import once."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    common = [f"paths.root={tmp_path}", f"target.path={tiny_k25_target}", f"target.tokenizer={tiny_k25_target}"]
    runs = [(str(repo / "data" / "run_prepare.py"), [*common, f"input={tiny_corpus_jsonl}", "max_records=12"]),
            (str(repo / "data" / "run_vocab.py"), [*common, "draft_vocab_size=40"])]
    driver = ("import runpy, sys\n"
              f"for script, args in {runs!r}:\n"
              "    sys.argv = [script, *args]\n"
              "    runpy.run_path(script, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, cwd=str(tmp_path), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "records read 12" in p.stdout and "draft vocab 40 of 512" in p.stdout
    out = tmp_path / "stages" / "k25_mini"
    assert (out / "prepare" / "manifest.json").is_file() and (out / "vocab" / "vocab.safetensors").is_file()


def test_the_init_mapping_is_read_from_any_shard_as_a_load_reads_it(tmp_path):
    """d2t and t2d in two shards of an indexed drafter, names prefixed `model.` (as some exporters write them):
    both found, by the rules a drafter load follows (eagle3/drafter/drafter_io.py read_named_tensors)."""
    from data.vocab import read_init_mapping

    ids = torch.tensor([0, 2, 3, 7])
    d2t, t2d = ids - torch.arange(4), torch.zeros(10, dtype=torch.bool)
    t2d[ids] = True
    save_file({"model.d2t": d2t, "model.fc.weight": torch.zeros(2, 2)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"model.t2d": t2d}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"model.d2t": "model-00001-of-00002.safetensors",
                                            "model.fc.weight": "model-00001-of-00002.safetensors",
                                            "model.t2d": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got, note = read_init_mapping(tmp_path, 10)
    assert got.tolist() == ids.tolist() and note["has_t2d"] is True
    t2d[1] = True  # t2d now disagrees with d2t: the shard holding it was read
    save_file({"model.t2d": t2d}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(VocabStageError, match="inconsistent d2t"):
        read_init_mapping(tmp_path, 10)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(VocabStageError, match="names shards that do not exist"):
        read_init_mapping(tmp_path, 10)
