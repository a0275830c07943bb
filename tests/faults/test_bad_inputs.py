"""Bad inputs at every stage, through the stages' real entry functions: malformed corpus records,
mismatched drafter / target / store combinations, out-of-range aux ids, inconsistent d2t/t2d,
non-finite states and weights. Each must give a clear error naming the problem, or a counted skip."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fault_helpers import copy_tree, export_config, train_config


def write_store(d: Path, *, hidden: int, hf_indices, n: int = 2, nan_in: str | None = None, check_finite: bool = True,
                seed: int = 0) -> Path:
    """A complete hidden-state store; `nan_in="aux"` puts a NaN in the first sequence's aux states, and
    check_finite=False writes it past the writer's own check (as a GPU capture that checks elsewhere may)."""
    from eagle3.formats.store import HiddenStateWriter

    g = torch.Generator().manual_seed(seed)
    w = HiddenStateWriter(d, hidden_size=hidden, target_hidden_size=hidden, hf_indices=list(hf_indices),
                          dtype="float32", shard_tokens=64)
    for i in range(n):
        T = 16
        aux = torch.randn(T, len(hf_indices) * hidden, generator=g)
        if nan_in == "aux" and i == 0:
            aux[3, 0] = float("nan")
        w.add(f"v{i}", torch.randint(0, 512, (T,), generator=g), torch.ones(T, dtype=torch.bool), aux,
              torch.randn(T, hidden, generator=g), torch.randint(0, 512, (T,), generator=g),
              check_finite=check_finite)
    w.finish()
    return d


def capture_with(pipeline, tmp_path, **store_kw) -> Path:
    """A copy of the pipeline's capture whose validation store is replaced."""
    import shutil

    cap = copy_tree(pipeline["capture"], tmp_path / "capture")
    shutil.rmtree(cap / "validation")
    write_store(cap / "validation", **store_kw)
    return cap


def lone_checkpoint(pipeline, tmp_path) -> Path:
    """The final drafter outside its train directory (no train manifest tying it to the original capture)."""
    return copy_tree(pipeline["final"], tmp_path / "lone" / "final")


# ------------------------------------------------------------------ prepare: a corpus of malformed records

def test_corpus_of_malformed_records_is_counted_and_the_good_ones_kept(tmp_path, tiny_tokenizer):
    from data.prepare import run_prepare
    from eagle3.formats.manifest import read_manifest
    from tests.fixtures.prepare import GOOD, conv, prepare_config

    src = tmp_path / "bad.jsonl"
    with open(src, "wb") as f:
        def line(obj):
            f.write((obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n")
        line(GOOD[0])
        f.write(b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}, '
                b'{"from": "gpt", "value": "ok"}]}\n')                           # not UTF-8
        line(GOOD[1])
        line(conv("huge", ("human", "word " * 400_000), ("gpt", "y")))          # a 2 MB record
        line(GOOD[2])
        line({"id": "nulls", "conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "a"}]})
        line({"id": "dict", "conversations": {"from": "human", "value": "q"}})
        line("42")
        line({"id": "nul", "conversations": [{"from": "human", "value": "a\u0000b"}, {"from": "gpt", "value": "c"}]})
        f.write(b'{"id": "lone", "conversations": [{"from": "human", "value": "x\\udbff"}, '
                b'{"from": "gpt", "value": "ok"}]}\n')                     # valid JSON, not encodable (issue 20)
        line({"id": "both", **conv("both", ("human", "a"), ("gpt", "b")),
              "messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]})
        line(GOOD[3])
    out = run_prepare(prepare_config(tmp_path, tiny_tokenizer, src, "validation_fraction=0.0"))
    m = read_manifest(out, "prepare")
    counts = m["counts"]
    assert counts["records_read"] == 12
    skipped = sum(counts["skipped"].values())
    assert counts["kept"] + skipped == 12 and counts["kept"] >= 4          # nothing silently lost
    assert counts["skipped"].get("too_long", 0) >= 1                      # the huge one, counted
    assert counts["skipped"]["unencodable_text"] == 1 and counts["skipped"]["ambiguous_record"] == 1
    import datasets
    ids = set(datasets.load_from_disk(str(out / "train"))["id"])
    # (validation_fraction 0: nothing held out) the good ones, plus the NUL-character one: valid text
    assert ids == {g["id"] for g in GOOD[:4]} | {"nul"}
    print("skipped:", {k: v for k, v in counts["skipped"].items() if v})


def test_an_empty_validation_split_is_readable_or_refused_clearly(tmp_path, tiny_tokenizer):
    import datasets
    from data.prepare import run_prepare
    from tests.fixtures.prepare import GOOD, prepare_config, write_jsonl

    out = run_prepare(prepare_config(tmp_path, tiny_tokenizer, write_jsonl(tmp_path / "c.jsonl", GOOD[:3]),
                                     "validation_fraction=0.0"))
    assert len(datasets.load_from_disk(str(out / "validation"))) == 0


# ------------------------------------------------------------------ export: mismatched combinations

def test_export_refuses_a_capture_from_another_target(pipeline, tmp_path):
    from export.stage import ExportError, run_export

    world = {**pipeline, "capture": capture_with(pipeline, tmp_path, hidden=32, hf_indices=pipeline["hf_indices"])}
    with pytest.raises(ExportError, match=r"width 32 != target hidden_size 64: captured from another target"):
        run_export(export_config(world, lone_checkpoint(pipeline, tmp_path), tmp_path / "e"))


def reindex(drafter_dir):
    """Re-write final/checkpoint.json after editing a file: a checkpoint a trainer wrote this way
    (so the checksums hold and the export's own validation is what must catch the problem)."""
    from eagle3.formats.checkpoints import INDEX_FILE, write_file_index

    write_file_index(drafter_dir, json.loads((drafter_dir / INDEX_FILE).read_text())["step"])


def test_export_refuses_out_of_range_aux_ids(pipeline, tmp_path):
    from export.stage import ExportError, run_export

    world = {**pipeline, "capture": capture_with(pipeline, tmp_path, hidden=64, hf_indices=[2, 4, 99])}
    with pytest.raises(ExportError, match=r"(?s)holds h = \[2, 4, 99\]"):
        run_export(export_config(world, lone_checkpoint(pipeline, tmp_path), tmp_path / "e"))
    # a checkpoint that never recorded its ids: the compatibility check still names the bad id
    ckpt = copy_tree(pipeline["final"], tmp_path / "lone2" / "final")
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["eagle_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    reindex(ckpt)
    with pytest.raises(ExportError, match=r"(?s)\[99\] outside 1\.\.7"):
        run_export(export_config(world, ckpt, tmp_path / "e"))


def test_export_refuses_a_drafter_for_another_vocab(pipeline, tmp_path):
    from eagle3.drafter.drafter_io import load_drafter_dir, save_drafter_dir
    from eagle3.drafter.model import Eagle3Drafter
    from export.stage import ExportError, run_export

    m = load_drafter_dir(pipeline["final"])
    cfg = m.config.replace(vocab_size=600)
    other = Eagle3Drafter(cfg)
    ids = torch.arange(cfg.draft_vocab_size)
    t2d = torch.zeros(600, dtype=torch.bool)
    t2d[ids] = True
    other.set_vocab_mapping(torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), t2d)
    d = save_drafter_dir(other, tmp_path / "other", dtype="float32")
    with pytest.raises(ExportError, match=r"vocab_size=600 != target vocab_size=512"):
        run_export(export_config(pipeline, d, tmp_path / "e"))


def test_export_refuses_non_finite_weights(pipeline, tmp_path):
    from export.stage import ExportError, run_export

    ckpt = copy_tree(pipeline["final"], tmp_path / "final")
    t = load_file(str(ckpt / "model.safetensors"))
    t["midlayer.mlp.up_proj.weight"][0, 0] = float("inf")
    save_file(t, str(ckpt / "model.safetensors"))
    reindex(ckpt)
    with pytest.raises(ExportError, match=r"midlayer.mlp.up_proj.weight' has 1 non-finite"):
        run_export(export_config(pipeline, ckpt, tmp_path / "e"))


def test_export_does_not_vouch_on_non_finite_validation_states(pipeline, tmp_path):
    from export.stage import ExportError, run_export

    world = {**pipeline, "capture": capture_with(pipeline, tmp_path, hidden=64, hf_indices=pipeline["hf_indices"], nan_in="aux",
                                           check_finite=False)}
    with pytest.raises(ExportError, match=r"sequence 'v0': the checkpoint itself gives non-finite logits"):
        run_export(export_config(world, lone_checkpoint(pipeline, tmp_path), tmp_path / "e"))


# ------------------------------------------------------------------ train and eval: inconsistent mappings, mismatches

def test_training_refuses_an_inconsistent_vocab_mapping(pipeline, tmp_path):
    from train.stage import run_train

    vocab = copy_tree(pipeline["vocab"], tmp_path / "vocab")
    t = load_file(str(vocab / "vocab.safetensors"))
    t2d = t["t2d"].clone()
    t2d[int(t2d.nonzero()[0])] = False
    t2d[int((~t2d).nonzero()[0])] = True
    t["t2d"] = t2d
    save_file(t, str(vocab / "vocab.safetensors"))
    # RELIABILITY.md F7 (fixed): the file's own mapping is checked and blamed
    with pytest.raises(Exception, match=r"vocab.safetensors: its d2t/t2d mapping is inconsistent"):
        run_train(train_config({**pipeline, "vocab": vocab}, tmp_path / "t"))
    assert not (tmp_path / "t" / "checkpoints").exists() or not list((tmp_path / "t" / "checkpoints").iterdir())


def test_eval_refuses_a_drafter_reading_other_layers_and_an_empty_split(pipeline, tmp_path):
    from eagle3.drafter.drafter_io import load_drafter_dir
    from eagle3.formats.store import HiddenStateStore, HiddenStateWriter
    from eagle3.replay.evaluate import EvalInputError, evaluate_drafter

    model = load_drafter_dir(pipeline["final"], dtype=torch.float32)
    store = HiddenStateStore(write_store(tmp_path / "other_ids", hidden=64, hf_indices=[1, 3, 6]))
    with pytest.raises(EvalInputError, match=r"drafter reads hidden states h = \[2, 4, 5\], the store holds h = \[1, 3, 6\]"):
        evaluate_drafter(model, store, progress=False)
    w = HiddenStateWriter(tmp_path / "empty", hidden_size=64, target_hidden_size=64, hf_indices=[2, 4, 5],
                          dtype="float32")
    w.finish()
    with pytest.raises(EvalInputError, match="holds no sequences"):
        evaluate_drafter(model, HiddenStateStore(tmp_path / "empty"), progress=False)


def test_store_writer_refuses_non_finite_states_naming_the_sequence(tmp_path):
    from eagle3.formats.store import NonFiniteHiddenStateError

    with pytest.raises(NonFiniteHiddenStateError, match=r"sequence 'v0': non-finite values in 'aux'"):
        write_store(tmp_path / "s", hidden=8, hf_indices=[2, 3, 4], nan_in="aux")


# ------------------------------------------------------------------ regeneration: a reply that cannot be stored

def test_a_server_reply_that_is_not_encodable_fails_only_its_conversation(tmp_path, tiny_tokenizer):
    """An OpenAI-compatible server whose JSON reply spells a lone surrogate ("\\ud800" is valid JSON) for
    one prompt: that conversation is `regen_failed` (named), the others are regenerated and kept."""
    from data.openai_server import ChatServer, echo_generate
    from data.prepare import run_prepare
    from eagle3.formats.manifest import read_manifest
    from tests.fixtures.prepare import GOOD, conv, prepare_config, write_jsonl

    def generate(messages, *args):
        text, reason = echo_generate(messages, *args)
        return ("broken \ud800 reply" if "POISON" in messages[-1]["content"] else text), reason

    rows = [GOOD[0], conv("poison", ("human", "POISON please"), ("gpt", "old")), GOOD[1]]
    with ChatServer(generate) as server:
        cfg = prepare_config(tmp_path, tiny_tokenizer, write_jsonl(tmp_path / "c.jsonl", rows), "validation_fraction=0.0",
                             "regenerate.backend=openai", f"regenerate.openai.base_url={server.url}",
                             "regenerate.openai.max_retries=0")
        m = read_manifest(run_prepare(cfg), "prepare")
    assert m["counts"]["kept"] == 2 and m["counts"]["skipped"]["regen_failed"] == 1
    assert m["skip_examples"]["regen_failed"][0].startswith(f"{tmp_path / 'c.jsonl'}:2: unencodable_text: the reply")
    assert "lone surrogate U+D800" in m["skip_examples"]["regen_failed"][0]


# ------------------------------------------------------------------ entry scripts: a mismatched drafter in one line

def test_eval_entry_script_names_a_mismatched_drafter_in_one_line(pipeline, tmp_path):
    """`eval/run.py` with a drafter reading other layers than the capture: exit status 1 and one line
    (eagle3/errors.py), not a traceback (issue 20: train, eval and demo caught nothing of their own)."""
    import os
    import subprocess
    import sys

    from eagle3 import REPO_ROOT

    cap = capture_with(pipeline, tmp_path, hidden=64, hf_indices=[1, 3, 6])
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "eval" / "run.py"), f"paths.root={tmp_path / 'root'}",
                           f"target.path={pipeline['target']}", f"drafter_dir={pipeline['final']}", f"capture_dir={cap}",
                           f"out_dir={tmp_path / 'eval'}", "real_loop.enabled=false", "progress=false"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("eval failed: drafter and validation store do not fit:") and "[1, 3, 6]" in last
