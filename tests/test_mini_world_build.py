"""A reduced mini world built end to end through `run_mini_world` (tiny sizes, seconds), its
artifacts loadable, the held-out corpora disjoint from training, and a rerun reused."""
import json

import pytest
import torch

from data.corpus import iter_raw_records
from data.mini_world import scenes
from data.mini_world import vision as eyes
from data.mini_world.build import format_report, run_mini_world
from eagle3.config.conf import compose, to_schema
from eagle3.formats.manifest import read_manifest
from eagle3.config.schema.mini_world import MiniVisionConf, MiniWorldConfig

TINY = [
    "split.max_records=400", "split.eval_conversations=8", "split.corpus_conversations_k2=12",
    "split.corpus_conversations_k25=10", "tokenizer.vocab_size=400", "tokenizer.max_chars=200000",
    "tokenizer.max_chars_per_conversation=1500", "max_tokens_per_conversation=96", "max_eval_tokens=400",
    "model.hidden_size=32", "model.intermediate_size=64", "model.moe_intermediate_size=16",
    "model.n_routed_experts=4", "model.q_lora_rank=16", "model.kv_lora_rank=8", "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.num_attention_heads=2",
    "k2_train.steps=6", "k2_train.batch_size=4", "k2_train.seq_len=64", "k2_train.warmup_steps=2",
    "k25_train.steps=4", "k25_train.batch_size=4", "k25_train.seq_len=64", "k25_train.warmup_steps=1",
    "vision.train.steps=4", "vision.train.batch_size=4", "vision.pool_examples=16", "vision.text_batch_size=2",
    "vision.train.seq_len=64", "vision.hidden_size=16", "vision.intermediate_size=32",
    "num_threads=1",  # tiny ops: one thread is fastest, and tests run next to other jobs
]


def tiny_config(root, *extra):
    return to_schema(compose("mini_world", [f"paths.root={root}", *TINY, *extra]), MiniWorldConfig)


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("mw")
    cfg = tiny_config(root)
    out = run_mini_world(cfg)
    return cfg, out


def test_tiny_world_artifacts_load(tiny_world):
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    cfg, out = tiny_world
    assert out == __import__("pathlib").Path(cfg.out_dir)
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    # 400 trained ids + K2.5's four media tokens after them (one tokenizer for both targets, as K2 / K2.5)
    assert len(tok) == 404 and "<|im_assistant|>" in tok.chat_template
    assert tok.convert_tokens_to_ids("<|media_pad|>") == 402
    k2 = DeepseekV3ForCausalLM.from_pretrained(str(out / "k2-mini"))
    assert k2.config.num_hidden_layers == 8 and k2.config.vocab_size == 404 and k2.config.num_mtp_layers == 0
    assert "vision_config" not in json.loads((out / "k2-mini" / "config.json").read_text())  # K2 reads text only
    k25 = Kimi_K25ForConditionalGeneration.from_pretrained(str(out / "k25-mini"))
    kcfg = json.loads((out / "k25-mini" / "config.json").read_text())
    assert kcfg["model_type"] == "kimi_k25" and kcfg["tie_word_embeddings"] is False
    assert kcfg["image_token_id"] == 402 and kcfg["text_config"]["vocab_size"] == 404
    assert kcfg["vision_config"]["patch_size"] == 14 and kcfg["vision_config"]["pos_emb_height"] == 56 // 14
    # k25-mini was trained further: same shapes, different weights, different logits
    ids = tok.apply_chat_template([{"role": "user", "content": "def f(x): return x"}], add_generation_prompt=True,
                                  tokenize=False)
    x = torch.tensor([tok(ids, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        a, b = k2(input_ids=x).logits, k25(input_ids=x).logits
    assert a.shape == b.shape and not torch.allclose(a, b)
    gen = json.loads((out / "k2-mini" / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]


def test_tiny_world_report_and_training_happened(tiny_world):
    cfg, out = tiny_world
    r = json.loads((out / "report.json").read_text())
    assert r["source"]["read"] == 400 and r["tokenizer"]["vocab_size"] == 404
    assert r["tokenizer"]["media_token_ids"]["<|media_pad|>"] == 402
    for name in ("k2-mini", "k25-mini"):
        t = r["models"][name]["train"]
        assert t["steps"] in (6, 4) and t["final_loss"] < t["first_loss"]  # it learned something
        assert r["models"][name]["params"]["total"] > r["models"][name]["params"]["active_per_token"]
        for dist in ("k2_mini", "k25_mini"):
            p = r["perplexity"][name][dist]
            assert 1 < p["ppl"] < 400 * 2 and 0 < p["tokens"] <= 400
    seeing = r["models"]["k25-mini"]["train"]["vision"]
    assert seeing["steps"] == 4 and seeing["image_examples"] == 16
    assert seeing["torch_threads"] == 1  # the joint vision step's count is recorded (TINY pins num_threads=1)
    assert r["vision"]["held_out_answers"]["scenes"] == 12 and r["vision"]["corpus_image_conversations"] == 3
    by_kind = r["vision"]["held_out_answers"]["by_kind"]
    assert set(by_kind) == set(scenes.QUESTIONS) and all(0 <= v <= 1 for v in by_kind.values())
    assert "exactly right, by question: caption" in format_report(r)
    for side, model in (("k2_mini", "k2-mini"), ("k25_mini", "k25-mini")):  # issue 44's figures of the source
        f = r["traffic"][side]
        assert 0 < f["distinct"] <= f["loss_tokens"] and 0 < f["top5_share"] <= 1 and 0 <= f["repeat_4gram_share"] < 1
        assert f["ppl"] == r["perplexity"][model][side]["ppl"]
    assert "held-out source traffic, k2_mini:" in format_report(r)
    assert 0 < r["token_shift"]["total_variation"] < 1
    assert set(r["times_s"]) >= {"tokenizer", "k2-mini", "k25-mini", "perplexity", "total"}
    m = read_manifest(out, "mini_world")
    assert m["build_key"]["source_fingerprint"] and m["counts"] == r["parts"]


def test_tiny_world_corpora_are_held_out(tiny_world):
    cfg, out = tiny_world
    corpora = {}
    rows = {}
    for name, n in (("k2_mini", 12), ("k25_mini", 13)):
        rows[name] = [json.loads(l) for l in (out / "corpus" / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows[name]) == n
        corpora[name] = {r["id"] for r in rows[name]}
    assert all(set(r) == {"id", "conversations"} and r["conversations"][0]["from"] for r in rows["k2_mini"])
    # the K2.5 corpus: every 4th record an image conversation (OpenAI parts, the image as a PNG data URI)
    images = [r for r in rows["k25_mini"] if "messages" in r]
    assert [i for i, r in enumerate(rows["k25_mini"]) if "messages" in r] == [3, 7, 11] and len(images) == 3
    first = images[0]["messages"][0]["content"]
    assert first[0]["image_url"]["url"].startswith("data:image/png;base64,") and first[1]["type"] == "text"
    assert not corpora["k2_mini"] & corpora["k25_mini"]
    # every corpus record is a real source record, verbatim
    from data.corpus import sharegpt_package_path

    with sharegpt_package_path() as p:
        src = {}
        for rec in iter_raw_records(p):
            if rec.index >= 400:
                break
            src[rec.value["id"]] = rec.value
    row = json.loads((out / "corpus" / "k25_mini.jsonl").read_text().splitlines()[0])
    assert [t["value"] for t in row["conversations"]] == \
        [t["value"] for t in src[row["id"]]["conversations"] if t["value"].strip()]


def test_rerun_is_reused_and_changed_config_rebuilds(tiny_world, capsys):
    cfg, out = tiny_world
    before = (out / "manifest.json").stat().st_mtime_ns
    k2_before = (out / "k2-mini" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    run_mini_world(cfg)
    assert "up to date" in capsys.readouterr().out
    assert (out / "manifest.json").stat().st_mtime_ns == before
    # a change that only affects k25-mini retrains only k25-mini (tokenizer and k2-mini reused)
    cfg2 = tiny_config(out.parent, "k25_train.steps=3")
    run_mini_world(cfg2)
    log = capsys.readouterr().out
    assert "tokenizer: reused" in log and "k2-mini: reused" in log and "k25-mini: loss" in log
    assert (out / "k2-mini" / "model.safetensors").stat().st_mtime_ns == k2_before
    assert json.loads((out / "report.json").read_text())["models"]["k25-mini"]["train"]["steps"] == 3


def test_too_little_data_fails_clearly_and_leaves_no_manifest(tmp_path, tiny_corpus_jsonl):
    from data.mini_world.build import MiniWorldError

    cfg = tiny_config(tmp_path, f"source={tiny_corpus_jsonl}", "split.max_records=null",
                      "split.corpus_conversations_k25=50")
    with pytest.raises(MiniWorldError, match=r"no k2 training conversations left in .*tiny\.jsonl"):
        run_mini_world(cfg)
    assert not (tmp_path / "mini_world" / "manifest.json").exists()


def test_seeing_k25_mini_is_captured_as_its_hf_multimodal_forward(tiny_world):
    """The world's own k25-mini, through prepare (its corpus's image conversations) and capture: stored aux at
    image and text rows = transformers' Kimi_K25ForConditionalGeneration forward with the pixels (fp32, 1e-5),
    stored fused rows = its hidden_states[0] at the image rows."""
    import datasets

    from data.capture import run_capture
    from data.capture_setup import Dist
    from data.prepare import run_prepare
    from eagle3.target_model import target_io
    from eagle3.config.schema.capture import CaptureConfig
    from eagle3.config.schema.prepare import PrepareConfig
    from eagle3.formats.store import HiddenStateStore
    from eagle3.target_model.target_images import pixel_inputs

    cfg, out = tiny_world
    root = out.parent
    base = [f"paths.root={root}", "target=k25_mini"]
    prep = run_prepare(to_schema(compose("prepare", base + ["max_length=160", "validation_fraction=0.0",
                                                            f"out_dir={root / 'prep-sees'}"]), PrepareConfig))
    cap = run_capture(to_schema(compose("capture", base + [
        f"in_dir={prep}", f"out_dir={root / 'cap-sees'}", "dtype=float32", "progress=false", "aux_hf_indices=[2,4,7]",
        "splits=[train]"]), CaptureConfig), Dist())
    store = HiddenStateStore(cap / "train")
    rows = {r["id"]: r for r in datasets.load_from_disk(str(prep / "train"))}
    model, text_cfg = target_io.load_target(out / "k25-mini", "kimi_k25", dtype="float32")
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    H, pad = text_cfg["hidden_size"], model.config.image_token_id
    seen = 0
    for i in range(len(store)):
        rec = store[i]
        row = rows[rec["id"]]
        if not row["images"]:
            continue
        seen += 1
        pv, thw = pixel_inputs(row["images"], row["image_grid_thw"])
        with torch.no_grad():
            hs = model(input_ids=rec["input_ids"][None], pixel_values=pv, image_grid_thw=thw,
                       output_hidden_states=True).hidden_states
        for j, h in enumerate([2, 4, 7]):
            torch.testing.assert_close(rec["aux"][:, j * H:(j + 1) * H], hs[h][0], rtol=1e-5, atol=1e-5)
        is_image = rec["input_ids"] == pad
        assert int(is_image.sum()) == 4 * len(row["images"])  # 56-pixel scenes: 4 <|media_pad|> rows each
        torch.testing.assert_close(rec["image_embeds"], hs[0][0][is_image], rtol=1e-5, atol=1e-5)
    assert seen == 3


def test_seeing_recipe_benchmark_trains_a_fresh_tower_and_scores_every_kind(tiny_world, tmp_path):
    """benchmarks/seeing_recipe.py through its real path on the tiny world: a fresh tower, a frozen-LM phase then
    joint steps, one result line per run with every question kind scored; text blocks from the world's corpus
    (their loss reported unweighted); --kinds restricts the training questions; an unknown kind is refused naming
    the known ones. --freeze-tower leaves every tower weight as drawn; --linear-probe reads colour / count / shape off
    the projector rows before and after (the same rows before, with or without the freeze)."""
    from transformers import AutoTokenizer

    from tests.fixtures.benchmarks import load_benchmark

    bench = load_benchmark("seeing_recipe")
    _, out = tiny_world
    args = ["--world", str(out), "--steps", "2", "--freeze-lm", "1", "--batch", "2", "--pool", "6", "--scenes", "2",
            "--tower-hidden", "16", "--tower-intermediate", "32", "--json", str(tmp_path / "r.jsonl")]
    got = bench.main([*args, "--tag", "a", "--tower-lr-scale", "1"])  # the world's own scale is 0 (a frozen tower)
    assert set(got["by_kind"]) == set(scenes.QUESTIONS) and all(0 <= v <= 1 for v in got["by_kind"].values())
    assert 0 < got["final_image_loss"] and got["first_image_loss"] > 0 and got["caption_distinct"] >= 1
    with_text = bench.main([*args, "--tag", "b", "--kinds", "colour", "--text-blocks", "1", "--text-weight", "0.5"])
    assert with_text["args"]["weight_decay"] == MiniVisionConf().train.weight_decay  # the world's own
    assert with_text["first_text_loss"] > 1 and with_text["final_text_loss"] > 1  # the corpus text blocks trained too
    assert got["tower_moved"] > 0  # the tower trained at --tower-lr-scale 1
    assert with_text["args"]["tower_lr_scale"] == MiniVisionConf().tower_lr_scale and with_text["tower_moved"] == 0
    frozen = bench.main([*args, "--tag", "c", "--freeze-tower", "--linear-probe", "16"])
    assert frozen["tower_moved"] == 0  # not one tower weight touched (the projector and the LM train)
    probe = frozen["linear_probe"]
    assert set(probe) == {"before", "after"} and all(set(p) == {"colour", "count", "shape"} for p in probe.values())
    assert all(0 <= v <= 1 for p in probe.values() for v in p.values())
    assert probe["before"] == bench.main([*args, "--tag", "d", "--linear-probe", "16"])["linear_probe"]["before"]
    phased = bench.main([*args, "--freeze-lm", "0", "--tag", "e", "--freeze-tower-first", "1", "--tower-lr-scale", "0.5"])
    assert phased["tower_moved"] > 0  # the tower waits one step, then trains
    unprobed = bench.main([*args, "--tag", "f", "--freeze-tower"])  # without the probe's calming before the snapshot
    assert unprobed["tower_moved"] == 0
    with pytest.raises(SystemExit, match="choose one"):
        bench.main([*args, "--freeze-tower-first", "1"])
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [x["tag"] for x in lines] == ["a", "b", "c", "d", "e", "f"]
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    a = bench.parse_args([*args, "--kinds", "colour"])
    for ex in bench.training_pool(tok, a):
        answer = tok.decode([i for i, lab in zip(ex.ids, ex.labels) if lab != eyes.IGNORE])
        assert answer.startswith(("They are", "It is")), answer  # colour answers only
    with pytest.raises(SystemExit, match="unknown question kinds"):
        bench.training_pool(tok, bench.parse_args([*args, "--kinds", "weather"]))
