"""Capture with images (HF backend) on a tiny Kimi-K2.5-layout target with a vision tower and projector: the
stored aux / last at image and text rows are the HF multimodal forward's (transformers'
Kimi_K25ForConditionalGeneration with pixel_values + image_grid_thw), and the stored fused rows are its
hidden_states[0] at the image rows (the projector's output)."""
import datasets
import pytest
import torch

from data.capture import run_capture
from data.capture_setup import Dist
from data.prepare import run_prepare
from eagle3.target_model import images as img_rule
from eagle3.target_model import target_io
from eagle3.config.conf import compose, to_schema
from eagle3.config.schema.capture import CaptureConfig
from eagle3.formats.store import HiddenStateStore, HiddenStateWriter, StoreError
from eagle3.target_model.target_images import pixel_inputs
from tests.fixtures.images import media_tokenizer, png_bytes, seeing_k25_target  # noqa: F401 (fixtures)
from tests.fixtures.prepare import GOOD, prepare_config, write_jsonl


def image_corpus(path):
    uri = lambda w, h, seed: img_rule.data_uri(png_bytes(w, h, seed=seed))  # noqa: E731
    part = lambda u: {"type": "image_url", "image_url": {"url": u}}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    rows = [
        {"id": "one", "messages": [{"role": "user", "content": [part(uri(30, 50, 1)), text("what is it?")]},
                                   {"role": "assistant", "content": "a picture of noise."}]},
        {"id": "two", "messages": [{"role": "user", "content": [part(uri(60, 20, 2)), part(uri(28, 28, 3)),
                                                                text("and these?")]},
                                   {"role": "assistant", "content": "two more."},
                                   {"role": "user", "content": [part(uri(56, 56, 4)), text("last one")]},
                                   {"role": "assistant", "content": "done."}]},
        *GOOD[:3],
    ]
    return write_jsonl(path, rows)


@pytest.fixture(scope="module")
def captured(tmp_path_factory, seeing_k25_target):
    root = tmp_path_factory.mktemp("cap_images")
    prep = run_prepare(prepare_config(root, seeing_k25_target, image_corpus(root / "img.jsonl"),
                                      f"target.path={seeing_k25_target}", "target.layout=kimi_k25",
                                      "validation_fraction=0.0"))
    cfg = compose("capture", [f"paths.root={root}", f"target.path={seeing_k25_target}",
                              f"target.tokenizer={seeing_k25_target}", "target.layout=kimi_k25", f"in_dir={prep}",
                              f"out_dir={root / 'capture'}", "dtype=float32", "progress=false",
                              "max_tokens_per_batch=256", "shard_tokens=100", "aux_hf_indices=[2,4,7]",
                              "splits=[train]"])
    return prep, run_capture(to_schema(cfg, CaptureConfig), Dist())


def test_stored_states_equal_the_hf_multimodal_forward(captured, seeing_k25_target):
    prep, out = captured
    store = HiddenStateStore(out / "train")
    ds = {r["id"]: r for r in datasets.load_from_disk(str(prep / "train"))}
    model, text_cfg = target_io.load_target(seeing_k25_target, "kimi_k25", dtype="float32")
    pad = model.config.image_token_id
    assert store.image_token_id == pad and len(store) == 5
    H = text_cfg["hidden_size"]
    seen_images = 0
    for i in range(len(store)):
        rec = store[i]
        row = ds[rec["id"]]
        ids = rec["input_ids"]
        is_image = ids == pad
        kwargs = {}
        if row["images"]:
            kwargs["pixel_values"], kwargs["image_grid_thw"] = pixel_inputs(row["images"], row["image_grid_thw"])
        with torch.no_grad():
            ref = model(input_ids=ids[None], output_hidden_states=True, **kwargs)
        hs = ref.hidden_states
        for j, h in enumerate([2, 4, 7]):  # image and text rows alike
            torch.testing.assert_close(rec["aux"][:, j * H:(j + 1) * H], hs[h][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(target_io.lm_head(model)(rec["last"]), ref.logits[0], rtol=1e-4, atol=1e-4)
        # the fused rows: hidden_states[0] at the image rows, only those
        assert rec["image_embeds"].shape == (int(is_image.sum()), H)
        torch.testing.assert_close(rec["image_embeds"], hs[0][0][is_image], rtol=1e-5, atol=1e-5)
        if row["images"]:
            seen_images += len(row["images"])
            # they are the projector's output, not the embedding of the placeholder id
            emb = target_io.text_model(model).embed_tokens.weight[pad]
            assert (rec["image_embeds"] - emb).abs().amax() > 1e-3
            # and the images matter: without pixels (placeholders embedded as id 0) the states differ
            with torch.no_grad():
                blind = model(input_ids=ids.masked_fill(is_image, 0)[None], output_hidden_states=True).hidden_states
            assert (blind[2][0] - hs[2][0]).abs().amax() > 1e-4
        assert not rec["loss_mask"][is_image].any()
    assert seen_images == 4


def test_store_refuses_image_rows_that_do_not_match(tmp_path):
    w = HiddenStateWriter(tmp_path / "s", hidden_size=4, target_hidden_size=4, hf_indices=[1, 2, 3], dtype="float32",
                          image_token_id=9)
    ids = torch.tensor([1, 9, 9, 2])
    args = (torch.zeros(4, dtype=torch.bool), torch.zeros(4, 12), torch.zeros(4, 4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(StoreError, match=r"2 image rows .* got \(1, 4\)"):
        w.add("a", ids, *args, image_embeds=torch.zeros(1, 4))
    w.add("a", ids, *args, image_embeds=torch.arange(8.0).view(2, 4))
    w.add("b", torch.tensor([1, 2, 3, 4]), *args)  # a text sequence in an image store: no rows
    w.finish()
    s = HiddenStateStore(tmp_path / "s")
    assert s[0]["image_embeds"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and s[1]["image_embeds"].shape == (0, 4)
    text = HiddenStateWriter(tmp_path / "t", hidden_size=4, target_hidden_size=4, hf_indices=[1, 2, 3],
                             dtype="float32")
    with pytest.raises(StoreError, match="without image_token_id"):
        text.add("a", ids, *args, image_embeds=torch.zeros(2, 4))
