"""The capture stage end to end on the tiny targets (conftest): layer semantics on the Kimi-K2.5
layout and a plain causal LM, batching invariance, multi-process merge, reuse, mismatch refusal,
and the bad-input errors that must come before the model loads."""
import json
import shutil

import pytest
import torch

import data.capture as capture_mod
from data.capture import plan_split, run_capture
from data.capture_plan import CaptureError
from data.capture_setup import Dist
from data.capture_plan import make_batches
from eagle3.target_model import target_io
from eagle3.config.conf import ConfigError, compose, to_schema
from eagle3.config.schema.capture import CaptureConfig
from eagle3.formats.store import HiddenStateStore
from numeric_checks import assert_argmax_up_to_ties
from tests.fixtures.capture import LAYOUT, capture_config, load_split, prepared, targets  # noqa: F401 (fixtures)


@pytest.mark.parametrize("which", ["k25", "k2"])
def test_stored_states_are_hf_hidden_states_h(tmp_path, targets, prepared, which):
    cfg = capture_config(tmp_path, targets, prepared, which, overrides=["aux_hf_indices=[2,4,7]", "limit=6"])
    out = run_capture(cfg, Dist())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hf_indices"] == [2, 4, 7] and "aux_layer_ids" not in manifest
    assert manifest["aux_layers"]["source"] == "config" and manifest["aux_layers"]["rule"] is None
    store = HiddenStateStore(out / "train", verify="sha256")
    assert len(store) == 6 and store.hf_indices == [2, 4, 7] and store.hidden_size == 64
    assert store.manifest["aux_provenance"]["source"] == "config"
    ds = load_split(prepared, "train")
    by_id = {ds[i]["id"]: ds[i] for i in range(6)}
    model, _ = target_io.load_target(targets[which], LAYOUT[which], dtype="float32")
    H = store.hidden_size
    for k in range(len(store)):
        rec = store[k]
        row = by_id[rec["id"]]
        ids = torch.tensor(row["input_ids"])
        assert torch.equal(rec["input_ids"], ids)
        assert torch.equal(rec["loss_mask"], torch.tensor(row["loss_mask"]).bool())
        with torch.no_grad():  # the reference: HF's own hidden states, one unpadded sequence
            ref = model(input_ids=ids[None], output_hidden_states=True)
        hs = ref.hidden_states
        for j, h in enumerate([2, 4, 7]):
            torch.testing.assert_close(rec["aux"][:, j * H:(j + 1) * H], hs[h][0], rtol=1e-5, atol=1e-5)
        # `last` is what lm_head consumes: it reproduces the model's logits
        logits = target_io.lm_head(model)(rec["last"])
        torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=1e-4)
        assert_argmax_up_to_ties(rec["target_argmax"], ref.logits[0], tol=2e-4)  # (logits agree to 1e-4)


def test_bf16_default_and_sglang_default_ids(tmp_path, targets, prepared):
    cfg = capture_config(tmp_path, targets, prepared, overrides=["dtype=bfloat16", "limit=3",
                                                                 "splits=[validation]"])
    out = run_capture(cfg, Dist())
    manifest = json.loads((out / "manifest.json").read_text())
    # 8 layers: SGLang's default HF indices [2, L//2, L-3] = [2, 4, 5]
    assert manifest["hf_indices"] == [2, 4, 5]
    assert manifest["aux_layers"]["source"] == "sglang_default"
    assert manifest["bytes_per_token"] == 4 * 64 * 2 + 9
    store = HiddenStateStore(out / "validation")
    assert store.dtype == "bfloat16" and store[0]["aux"].dtype == torch.bfloat16
    assert store[0]["aux"].shape[1] == 3 * 64


@pytest.mark.parametrize("listed, rule, want", [
    ([2, 4, 5], "sglang", [2, 4, 5]),          # first id not 1: current SGLang reads ids as h
    ([2, 4, 5], "sglang_legacy", [3, 5, 6]),   # SGLang before PR #25454: id + 1
    ([2, 4, 5], "vllm", [2, 4, 5]),
    ([1, 3, 4], "sglang", [2, 4, 5]),          # first id 1: id + 1 in every SGLang version
    ([1, 3, 4], "sglang_legacy", [2, 4, 5]),
])
def test_init_drafter_ids_read_by_the_rule(tmp_path, targets, prepared, listed, rule, want, capsys):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": listed}}))
    cfg = capture_config(tmp_path, targets, prepared, overrides=["+init=aqmedai_k2", f"init.drafter_path={drafter}",
                                                                 f"init.aux_id_rule={rule}", "limit=2",
                                                                 "splits=[validation]"])
    out = run_capture(cfg, Dist())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hf_indices"] == want == HiddenStateStore(out / "validation").hf_indices
    prov = manifest["aux_layers"]
    assert prov["source"].startswith("init_drafter:") and prov["rule"] == rule and prov["listed_ids"] == listed
    printed = capsys.readouterr().out
    assert f"h = {want}" in printed
    # the rules disagree only when the first id is not 1: then every reading is printed
    assert ("read differently" in printed) == (listed[0] != 1)


def test_configured_h_conflicting_with_the_init_drafter_is_refused(tmp_path, targets, prepared, monkeypatch):
    monkeypatch.setattr(target_io, "load_target", _no_load)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    cfg = capture_config(tmp_path, targets, prepared, overrides=["+init=aqmedai_k2", f"init.drafter_path={drafter}",
                                                                 "aux_hf_indices=[3,4,5]"])
    with pytest.raises(CaptureError, match=r"conflicts with the init drafter.*h = \[2, 4, 5\]"):
        run_capture(cfg, Dist())


def test_padding_and_batching_do_not_change_values(tmp_path, targets, prepared):
    alone = run_capture(capture_config(tmp_path, targets, prepared, out="alone",
                                       overrides=["max_tokens_per_batch=1", "limit=10"]), Dist())
    batched = run_capture(capture_config(tmp_path, targets, prepared, out="batched",
                                         overrides=["max_tokens_per_batch=1000", "limit=10"]), Dist())
    a, b = HiddenStateStore(alone / "train"), HiddenStateStore(batched / "train")
    assert a.ids == b.ids and a.lengths == b.lengths and len(set(a.lengths)) > 1  # really padded
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["target_argmax"], y["target_argmax"])
        torch.testing.assert_close(x["aux"], y["aux"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x["last"], y["last"], rtol=1e-5, atol=1e-5)


def test_multi_process_parts_read_like_one_process(tmp_path, targets, prepared):
    one = run_capture(capture_config(tmp_path, targets, prepared, out="one"), Dist())
    cfg = capture_config(tmp_path, targets, prepared, out="multi")
    run_capture(cfg, Dist(rank=1, world=2))  # rank 1 first: no merge (rank 0 merges)
    assert not (tmp_path / "multi" / "train" / "manifest.json").exists()
    run_capture(cfg, Dist(rank=0, world=2))
    assert (tmp_path / "multi" / "train" / "part-1" / "manifest.json").is_file()
    for split in ("train", "validation"):
        a, b = HiddenStateStore(one / split, verify="sha256"), HiddenStateStore(tmp_path / "multi" / split,
                                                                               verify="sha256")
        assert a.ids == b.ids and a.lengths == b.lengths and a.num_tokens == b.num_tokens > 0
        for i in range(len(a)):
            x, y = a[i], b[i]
            for key in ("input_ids", "loss_mask", "aux", "last", "target_argmax"):
                assert torch.equal(x[key], y[key]), (split, i, key)
    m1 = json.loads((one / "manifest.json").read_text())["splits"]["train"]
    m2 = json.loads((tmp_path / "multi" / "manifest.json").read_text())["splits"]["train"]
    assert (m1["sequences"], m1["tokens"], m1["loss_tokens"]) == (m2["sequences"], m2["tokens"], m2["loss_tokens"])


def test_rerun_reuses_and_other_settings_refuse_to_mix(tmp_path, targets, prepared, monkeypatch):
    cfg = capture_config(tmp_path, targets, prepared, overrides=["limit=4"])
    run_capture(cfg, Dist())
    monkeypatch.setattr(target_io, "load_target", lambda *a, **k: pytest.fail("reused run must not load"))
    run_capture(cfg, Dist())
    monkeypatch.undo()
    other = capture_config(tmp_path, targets, prepared, overrides=["limit=4", "aux_hf_indices=[2,3,4]"])
    with pytest.raises(CaptureError, match="refusing to mix.*hf_indices"):
        run_capture(other, Dist())
    other_target = capture_config(tmp_path, targets, prepared, which="k2", overrides=["limit=4"])
    with pytest.raises(CaptureError, match="refusing to mix.*meta"):
        run_capture(other_target, Dist())
    forced = capture_config(tmp_path, targets, prepared, overrides=["limit=4", "aux_hf_indices=[2,3,4]",
                                                                    "overwrite=true"])
    run_capture(forced, Dist())
    assert HiddenStateStore(tmp_path / "capture" / "train").hf_indices == [2, 3, 4]


def _no_load(*a, **k):
    raise AssertionError("the model must not be loaded for bad input")


def test_out_of_range_indices_error_before_loading(tmp_path, targets, prepared, monkeypatch):
    monkeypatch.setattr(target_io, "load_target", _no_load)
    cfg = capture_config(tmp_path, targets, prepared, overrides=["aux_hf_indices=[2,30,58]"])
    with pytest.raises(CaptureError, match=r"\[30, 58\] outside 1\.\.7"):
        run_capture(cfg, Dist())
    assert not (tmp_path / "capture").exists()


@pytest.mark.parametrize("override, message", [
    ("aux_hf_indices=[2,4]", "2 given, an EAGLE-3 drafter reads exactly 3"),
    ("aux_hf_indices=[1,2,4,5]", "4 given"),
    ("aux_hf_indices=[2,2,4]", r"\[2\] repeated"),
    ("aux_hf_indices=[4,2,6]", "not ascending"),
    ("aux_hf_indices=2", "expected a list of 3 integers"),
    ("aux_hf_indices=[7.5,2,4]", "7.5 is not an integer"),
    ("aux_hf_indices=[0,2,4]", r"\[0\] outside 1\.\.L-1"),
    ("aux_hf_indices=[1,2,4]", r"h\[0\] = 1 .* cannot be served by current SGLang"),
    ("aux_layer_ids=[2,30,58]", "Could not override 'aux_layer_ids'"),  # ids are engine-dependent: gone
])
def test_unusable_index_lists_are_refused_in_one_line(tmp_path, targets, prepared, override, message):
    with pytest.raises(ConfigError, match=message) as e:
        capture_config(tmp_path, targets, prepared, overrides=[override])
    assert "\n" not in str(e.value)


def test_missing_target_and_missing_dataset_are_clear(tmp_path, targets, prepared, monkeypatch):
    monkeypatch.setattr(target_io, "load_target", _no_load)
    cfg = capture_config(tmp_path, targets, prepared, overrides=[f"target.path={tmp_path / 'nope'}"])
    with pytest.raises(CaptureError, match="nope: no config.json"):
        run_capture(cfg, Dist())
    cfg = capture_config(tmp_path, targets, prepared, overrides=[f"in_dir={tmp_path / 'noprep'}"])
    with pytest.raises(CaptureError, match="noprep: no manifest.json"):
        run_capture(cfg, Dist())


def test_dataset_from_another_tokenizer_is_refused(tmp_path, targets, prepared, monkeypatch):
    monkeypatch.setattr(target_io, "load_target", _no_load)
    other = tmp_path / "prep"
    shutil.copytree(prepared, other)
    m = json.loads((other / "manifest.json").read_text())
    m["fingerprints"]["tokenizer"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(m))
    cfg = capture_config(tmp_path, targets, prepared, overrides=[f"in_dir={other}"])
    with pytest.raises(CaptureError, match="prepared with another tokenizer"):
        run_capture(cfg, Dist())


def test_overlong_sequences_truncated_or_skipped_and_counted(tmp_path, targets, prepared):
    ds = load_split(prepared, "train")
    lengths = [len(r) for r in ds["input_ids"]]
    cut = sorted(lengths)[len(lengths) // 2]
    n_long = sum(T > cut for T in lengths)
    assert 0 < n_long < len(lengths)
    out = run_capture(capture_config(tmp_path, targets, prepared, out="trunc", overrides=[f"max_seq_len={cut}"]),
                      Dist())
    store = HiddenStateStore(out / "train")
    assert len(store) == len(lengths) and max(store.lengths) == cut
    assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["truncated"] == n_long
    out = run_capture(capture_config(tmp_path, targets, prepared, out="skip",
                                     overrides=[f"max_seq_len={cut}", "on_overlong=skip"]), Dist())
    assert len(HiddenStateStore(out / "train")) == len(lengths) - n_long
    assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["skipped"] == {"overlong": n_long}


def test_non_finite_sequence_is_skipped_and_counted_by_id(tmp_path, targets, prepared):
    """A target whose embedding row for one token is NaN: exactly the sequences holding that
    token are skipped (with their ids); the others are stored."""
    from safetensors.torch import load_file, save_file

    ds = load_split(prepared, "train")
    rows = ds["input_ids"]
    counts = torch.bincount(torch.tensor([t for r in rows for t in set(r)]), minlength=512)
    rare = int(torch.nonzero((counts >= 1) & (counts <= 3))[0])
    bad_ids = {ds[i]["id"] for i, r in enumerate(rows) if rare in r}
    poisoned = tmp_path / "poisoned"
    shutil.copytree(targets["k25"], poisoned)
    sd = load_file(poisoned / "model.safetensors")
    sd["language_model.model.embed_tokens.weight"][rare] = float("nan")
    save_file(sd, poisoned / "model.safetensors", metadata={"format": "pt"})
    cfg = capture_config(tmp_path, {**targets, "k25": poisoned}, prepared, overrides=["max_tokens_per_batch=1"])
    out = run_capture(cfg, Dist())
    split = json.loads((out / "manifest.json").read_text())["splits"]["train"]
    assert split["skipped"] == {"non_finite": len(bad_ids)}
    assert set(split["skipped_ids"]["non_finite"]) == bad_ids
    store = HiddenStateStore(out / "train")
    assert len(store) == len(rows) - len(bad_ids) and not bad_ids & set(store.ids)


def test_batches_respect_the_token_budget():
    from data.capture_plan import Seq

    seqs = [Seq(i, f"s{i}", T, i) for i, T in enumerate([9, 7, 7, 4, 3, 3, 1])]
    batches = make_batches(seqs, 14)
    assert [[s.length for s in b] for b in batches] == [[9], [7, 7], [4, 3, 3], [1]]
    assert all(len(b) * b[0].length <= 14 for b in batches)
    assert [s.length for b in make_batches(seqs, 5) for s in b] == [9, 7, 7, 4, 3, 3, 1]


def test_plan_sorts_longest_first_with_stable_ties(prepared):
    ds = load_split(prepared, "train")
    seqs, counts = plan_split(ds, limit=8, max_len=10_000, on_overlong="truncate")
    assert len(seqs) == 8 and counts["truncated"] == 0
    keys = [(-s.length, s.index) for s in seqs]
    assert keys == sorted(keys) and [s.order for s in seqs] == list(range(8))
    assert capture_mod.plan_split(ds, limit=0, max_len=10, on_overlong="skip")[0] == []


def _store_files(split_dir):
    return {p.name: p.read_bytes() for p in sorted(split_dir.iterdir()) if p.is_file()}


@pytest.mark.slow
def test_killed_capture_resumes_to_an_identical_store(tmp_path, targets, prepared):
    """SIGKILL a real `data/run_capture.py` process after its first shard is committed, rerun it,
    and compare with an uninterrupted run: every shard and the store manifests byte-identical."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from eagle3 import REPO_ROOT

    def overrides(out):
        return [f"paths.root={tmp_path}", f"target.path={targets['k25']}", f"target.tokenizer={targets['k25']}",
                f"in_dir={prepared}", f"out_dir={tmp_path / out}", "max_tokens_per_batch=96", "shard_tokens=200",
                "progress=false", "splits=[train]"]

    def cmd(out):
        return [sys.executable, str(REPO_ROOT / "data" / "run_capture.py"), *overrides(out)]

    # The uninterrupted reference runs in this process (one thread, like the subprocesses).
    run_capture(to_schema(compose("capture", overrides("ref")), CaptureConfig), Dist())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    from hooked_stage import hooked_command  # slowed by the capture.after_batch hook, so the kill lands mid-work

    proc = subprocess.Popen(hooked_command("sleep_after_batch=0.2", "data/run_capture.py", overrides("crash")), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    manifest = tmp_path / "crash" / "train" / "manifest.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(manifest.read_text())["shards"]:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, f"capture ended before it could be killed: {proc.stderr.read()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed = json.loads(manifest.read_text())
    assert not killed["complete"] and 0 < len(killed["shards"]) < len(
        json.loads((tmp_path / "ref" / "train" / "manifest.json").read_text())["shards"])

    again = subprocess.run(cmd("crash"), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    a, b = _store_files(tmp_path / "ref" / "train"), _store_files(tmp_path / "crash" / "train")
    assert len(a) > 3 and sorted(a) == sorted(b) and a == b
    resumed = json.loads((tmp_path / "crash" / "manifest.json").read_text())["splits"]["train"]["this_run"]
    assert resumed["batches_run"] < resumed["batches"]  # it really resumed, not redid everything


@pytest.mark.slow
def test_torchrun_two_processes_read_like_one(tmp_path, targets, prepared):
    """A real 2-process launch (torchrun, gloo on CPU; `accelerate launch --multi_gpu` on GPUs sets
    the same environment): each process writes its part, rank 0 merges, and the merged store reads
    exactly like a one-process capture."""
    import os
    import subprocess
    import sys

    from eagle3 import REPO_ROOT
    from tests.fixtures.ports import free_port

    common = [f"paths.root={tmp_path}", f"target.path={targets['k25']}", f"target.tokenizer={targets['k25']}",
              f"in_dir={prepared}", "max_tokens_per_batch=96", "shard_tokens=200", "progress=false",
              "splits=[validation]"]
    run_capture(to_schema(compose("capture", [*common, f"out_dir={tmp_path / 'one'}"]), CaptureConfig), Dist())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), str(REPO_ROOT / "data" / "run_capture.py"), *common,
                f"out_dir={tmp_path / 'two'}"]
    res = subprocess.run(torchrun, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["world_size"] == 2
    assert (tmp_path / "two" / "validation" / "part-1" / "manifest.json").is_file()
    a, b = HiddenStateStore(tmp_path / "one" / "validation"), HiddenStateStore(tmp_path / "two" / "validation")
    assert a.ids == b.ids and len(a) > 1
    for i in range(len(a)):
        for key in ("input_ids", "loss_mask", "aux", "last", "target_argmax"):
            assert torch.equal(a[i][key], b[i][key]), (i, key)


def test_changing_the_number_of_processes_refuses_to_mix(tmp_path, targets, prepared):
    one = capture_config(tmp_path, targets, prepared, out="one", overrides=["limit=4", "splits=[validation]"])
    run_capture(one, Dist())
    with pytest.raises(CaptureError, match="captured with 1 process.*this run has 2"):
        run_capture(one, Dist(rank=0, world=2))
    two = capture_config(tmp_path, targets, prepared, out="two", overrides=["limit=4", "splits=[validation]"])
    run_capture(two, Dist(rank=1, world=2))
    run_capture(two, Dist(rank=0, world=2))
    with pytest.raises(CaptureError, match="refusing to mix.*world_size"):
        run_capture(two, Dist())


@pytest.fixture(scope="module")
def target_61(tmp_path_factory, tiny_tokenizer):
    """A tiny Kimi-K2.5-layout target with Kimi's 61 decoder layers (hidden 16), same tokenizer."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from data.mini_world.checkpoints import deepseek_v3_config, save_kimi_k25

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    cfg = deepseek_v3_config(vocab_size=len(tok), hidden_size=16, num_hidden_layers=61, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = DeepseekV3ForCausalLM(cfg).eval()
    return save_kimi_k25(model, tiny_tokenizer, tmp_path_factory.mktemp("t61") / "k25-61")


@pytest.mark.parametrize("listed", [[2, 30, 58], [1, 29, 57]])
def test_kimi_ids_capture_h_2_30_58_and_export_as_1_29_57(tmp_path, target_61, prepared, listed):
    """Issue 23's case on a 61-layer target: an init drafter listing [2, 30, 58] (lightseekorg's form) or
    [1, 29, 57] yields a store with Kimi's h = [2, 30, 58] under the default rule; a drafter trained on it
    exports ids [1, 29, 57], which every engine rule reads back as the trained h."""
    from eagle3.engines import aux_layers
    from eagle3.drafter.drafter_io import save_drafter_dir
    from eagle3.drafter.initial import build_training_drafter
    from export.stage import run_export

    from tests.faults.fault_helpers import export_config

    init = tmp_path / "init"
    init.mkdir()
    (init / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": listed}}))
    cfg = compose("capture", [f"paths.root={tmp_path}", f"target.path={target_61}", f"target.tokenizer={target_61}",
                              "target.layout=kimi_k25", f"in_dir={prepared}", f"out_dir={tmp_path / 'capture'}",
                              "dtype=float32", "progress=false", "limit=3", "+init=aqmedai_k2",
                              f"init.drafter_path={init}"])
    out = run_capture(to_schema(cfg, CaptureConfig), Dist())
    store = HiddenStateStore(out / "validation")
    assert store.hf_indices == [2, 30, 58]
    # the stored states are HF output_hidden_states[2], [30], [58] (outputs of decoder layers 1, 29, 57)
    model, _ = target_io.load_target(target_61, "kimi_k25", dtype="float32")
    rec = store[0]
    with torch.no_grad():
        hs = model(input_ids=rec["input_ids"][None], output_hidden_states=True).hidden_states
    for j, h in enumerate([2, 30, 58]):
        torch.testing.assert_close(rec["aux"][:, j * 16:(j + 1) * 16], hs[h][0], rtol=1e-5, atol=1e-5)

    new_ids = torch.arange(0, 512, 8)
    drafter, _ = build_training_drafter("scratch", None, target_61, "kimi_k25", new_ids, store.hf_indices)
    ckpt = save_drafter_dir(drafter, tmp_path / "ckpt" / "final", dtype=torch.float32)
    world = {"target": target_61, "capture": out}
    exported = run_export(export_config(world, ckpt, tmp_path / "export", "format=both", "target=k25_mini",
                                        f"target.path={target_61}", "use_eval_report=false"))
    sg = json.loads((exported / "config.json").read_text())
    ids = sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [1, 29, 57]
    assert all(aux_layers.hf_indices_from_ids(ids, r) == [2, 30, 58] for r in ("sglang", "sglang_legacy"))
    sp = json.loads((exported / "speculators" / "config.json").read_text())
    assert aux_layers.hf_indices_from_ids(sp["eagle_aux_hidden_state_layer_ids"], "vllm") == [2, 30, 58]
    assert "[1, 29, 57] (mean h = [2, 30, 58] in every version)" in (exported / "SERVE.md").read_text()


def test_states_no_sglang_id_list_means_in_every_version_export_with_the_version_requirement(
        tmp_path, target_61, prepared):
    """h = [3, 31, 59] (the old reading of ids [2, 30, 58]): no id list means it in both SGLang rules, so the
    export writes the current rule's ids and says which SGLang reads them so, in the config and SERVE.md."""
    from eagle3.engines import aux_layers
    from eagle3.drafter.drafter_io import save_drafter_dir
    from eagle3.drafter.initial import build_training_drafter
    from export.stage import run_export

    from tests.faults.fault_helpers import export_config

    cfg = compose("capture", [f"paths.root={tmp_path}", f"target.path={target_61}", f"target.tokenizer={target_61}",
                              "target.layout=kimi_k25", f"in_dir={prepared}", f"out_dir={tmp_path / 'capture'}",
                              "dtype=float32", "progress=false", "limit=3", "aux_hf_indices=[3,31,59]"])
    out = run_capture(to_schema(cfg, CaptureConfig), Dist())
    drafter, _ = build_training_drafter("scratch", None, target_61, "kimi_k25", torch.arange(0, 512, 8), [3, 31, 59])
    ckpt = save_drafter_dir(drafter, tmp_path / "ckpt" / "final", dtype=torch.float32)
    exported = run_export(export_config({"target": target_61, "capture": out}, ckpt, tmp_path / "export",
                                        "format=sglang", f"target.path={target_61}", "use_eval_report=false"))
    sg = json.loads((exported / "config.json").read_text())
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]
    assert aux_layers.hf_indices_from_ids([3, 31, 59], "sglang") == [3, 31, 59]
    assert sg[aux_layers.META_KEY]["sglang_versions"] == aux_layers.SGLANG_RULE_CHANGE
    assert f"mean h = [3, 31, 59] in {aux_layers.SGLANG_RULE_CHANGE}" in (exported / "SERVE.md").read_text()


def test_the_backend_table_is_the_config_choice_list():
    """capture.backend's choices (eagle3/config/choices.py, read by the schema) and the table the stage reads agree."""
    from data.capture_backends import BACKENDS, backend_for
    from eagle3.config.choices import CAPTURE_BACKENDS

    assert tuple(BACKENDS) == CAPTURE_BACKENDS
    assert backend_for("hf").name == "hf" and backend_for("vllm").name == "vllm"
    with pytest.raises(ValueError, match="capture backend 'onnx'"):
        backend_for("onnx")
