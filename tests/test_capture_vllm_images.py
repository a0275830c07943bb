"""capture.backend=vllm with images, against the vLLM stand-in (tests/standins/vllm_standin.py; eagle3/engines/vllm_images.py's
protocol): image sequences go through the chat endpoint and the engine's expansion of the placeholders is checked
against prepare's; the store equals the HF backend's at every row (aux, last, argmax) and keeps no fused rows
(image_rows="none"); a refused image or a count mismatch is a counted skip naming the record, no other record
lost; the serve line carries --trust-request-chat-template, and an engine started without it stops the run."""
import json
import re
import sys
from pathlib import Path

import datasets
import pytest
import torch

from data.capture import run_capture
from data.capture_plan import CaptureError
from data.capture_setup import Dist
from data.capture_vllm_images import ImageSkip, expansion_problem, image_request
from eagle3.engines import vllm_images
from eagle3.formats.store import HiddenStateStore
from tests.fixtures.images import media_tokenizer, png_bytes, seeing_k25_target  # noqa: F401 (fixtures)
from tests.fixtures.vllm_images import image_capture_config, image_hf_store, image_prepared  # noqa: F401
from tests.standins.vllm_standin import Faults, StandinServer, fake_vllm_module
from tests.fixtures.ports import free_port  # noqa: F401 (also used by other tests)

KEYS = ("input_ids", "loss_mask", "aux", "last", "target_argmax")




def vllm_cfg(tmp_path, target, prepared, *overrides, port=None):
    return image_capture_config(tmp_path, target, prepared, f"out_dir={tmp_path / 'vllm'}", "backend=vllm",
                                f"vllm.url=http://127.0.0.1:{port or free_port()}", "vllm.timeout_s=60",
                                "vllm.lock_timeout_s=10", "vllm.concurrency=1", *overrides)


def serve_line(cfg) -> str:
    with pytest.raises(CaptureError, match="no vLLM server answers") as e:
        run_capture(cfg, Dist())
    return re.search(r"(vllm serve .*)$", str(e.value)).group(1)


def assert_rows_equal_hf(hf_dir, vllm_dir, skipped=()):
    hf, vl = HiddenStateStore(hf_dir / "train"), HiddenStateStore(vllm_dir / "train", verify="sha256")
    assert vl.ids == [i for i in hf.ids if i not in skipped] and len(vl) > 0
    assert vl.image_token_id == hf.image_token_id and vl.image_rows == "none" and hf.image_rows == "fused"
    images = 0
    for i in range(len(vl)):
        x, y = hf[hf.ids.index(vl.ids[i])], vl[i]
        for key in KEYS:  # every row, image and text
            assert torch.equal(x[key], y[key]), (vl.ids[i], key)
        assert "image_embeds" not in y and "image_embeds" in x
        images += int((y["input_ids"] == vl.image_token_id).sum())
    return images


def test_the_serve_line_asks_for_request_chat_templates_only_with_images(tmp_path, seeing_k25_target,  # noqa: F811
                                                                        image_prepared):
    line = serve_line(vllm_cfg(tmp_path, seeing_k25_target, image_prepared))
    assert vllm_images.SERVE_FLAG in line
    from tests.standins.vllm_standin import parse_serve_command
    assert parse_serve_command(line).trust_request_chat_template


def test_image_capture_through_the_server_equals_the_hf_rows(tmp_path, seeing_k25_target, image_prepared,  # noqa: F811
                                                            image_hf_store):
    cfg = vllm_cfg(tmp_path, seeing_k25_target, image_prepared)
    with StandinServer.from_command(serve_line(cfg), "kimi_k25") as server:
        out = run_capture(cfg, Dist())
    assert server.engine.image_requests == 2  # the two image conversations; the text ones as token ids
    assert assert_rows_equal_hf(image_hf_store, out) > 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["image_rows"] == "none" and m["splits"]["train"]["this_run"]["image_requests"] == 2
    assert not m["splits"]["train"]["skipped"]
    assert not [p for p in (Path(cfg.out_dir) / "vllm_hidden_states").rglob("*") if p.is_file()]


def test_image_capture_in_process_equals_the_hf_rows(tmp_path, seeing_k25_target, image_prepared,  # noqa: F811
                                                    image_hf_store, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(layout="kimi_k25"))
    out = run_capture(vllm_cfg(tmp_path, seeing_k25_target, image_prepared, "vllm.engine=inprocess"), Dist())
    assert assert_rows_equal_hf(image_hf_store, out) > 0


def test_a_mismatched_expansion_and_a_refused_image_are_counted_skips(tmp_path, seeing_k25_target,  # noqa: F811
                                                                     image_prepared, image_hf_store, capsys):
    cfg = vllm_cfg(tmp_path, seeing_k25_target, image_prepared)
    with StandinServer.from_command(serve_line(cfg), "kimi_k25", Faults(extra_pads={0: 1}, refuse_images={1})):
        out = run_capture(cfg, Dist())
    skipped = {s["id"]: s["reason"] for s in HiddenStateStore(out / "train").manifest["skipped"]}
    assert sorted(skipped.values()) == ["engine_image_mismatch", "engine_refused_image"]
    assert set(skipped) == {"img-a", "img-b"}
    assert assert_rows_equal_hf(image_hf_store, out, skipped=set(skipped)) == 0  # the text records all kept
    said = capsys.readouterr().out
    mismatch = next(i for i, r in skipped.items() if r == "engine_image_mismatch")
    line = next(ln for ln in said.splitlines() if f"skipped {mismatch!r}" in ln)
    assert re.search(r"<\|media_pad\|> runs of \[\d+\], prepare to \[\d+\]|runs of \[\d+, \d+\]", line)
    m = json.loads((out / "manifest.json").read_text())
    assert m["splits"]["train"]["skipped"] == {"engine_image_mismatch": 1, "engine_refused_image": 1}
    assert not [p for p in (Path(cfg.out_dir) / "vllm_hidden_states").rglob("*") if p.is_file()]


def test_an_engine_without_the_template_flag_stops_the_run_naming_it(tmp_path, seeing_k25_target,  # noqa: F811
                                                                    image_prepared):
    cfg = vllm_cfg(tmp_path, seeing_k25_target, image_prepared)
    line = serve_line(cfg).replace(" " + vllm_images.SERVE_FLAG, "")
    with StandinServer.from_command(line, "kimi_k25"):
        with pytest.raises(CaptureError, match=r"--trust-request-chat-template.*restart it with: vllm serve"):
            run_capture(cfg, Dist())


# ---- the request and the check, on their own ----------------------------------------------------------

def _row(image_prepared, rid):  # noqa: F811
    ds = datasets.load_from_disk(str(image_prepared / "train"))
    return next(r for r in ds if r["id"] == rid)


def test_the_request_is_prepares_ids_with_one_pad_per_image(image_prepared, seeing_k25_target):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(seeing_k25_target))
    pad = tok.convert_tokens_to_ids("<|media_pad|>")
    row = _row(image_prepared, "img-b")
    ids = torch.tensor(row["input_ids"])
    req = image_request(row, ids, pad, tok)
    assert req.text.count(vllm_images.PLACEHOLDER) == 2 and len(req.image_uris) == 2
    assert tok(req.text, add_special_tokens=False)["input_ids"] == vllm_images.collapse_runs(ids.tolist(), pad)
    assert image_request(row, ids[:3], pad, tok) is None  # cut before the first image: a text prompt
    runs = [i for i in range(1, len(ids)) if ids[i - 1] == pad and ids[i] != pad]
    assert len(image_request(row, ids[: runs[0] + 1], pad, tok).image_uris) == 1  # cut after image 1's block
    with pytest.raises(ImageSkip, match="image_prompt_unrenderable: .* 0 image placeholders"):
        image_request(row, ids[: runs[0]], pad, tok)  # its pads kept but not its <|media_end|>: no placeholder
    with pytest.raises(ImageSkip, match="image_mismatch"):
        image_request(row, ids[: runs[0] - 1], pad, tok)  # cut inside an image
    bad = {**row, "images": [b"not an image", row["images"][1]]}
    with pytest.raises(ImageSkip) as e:
        image_request(bad, ids, pad, tok)
    assert e.value.reason == "undecodable_image" and "image 0" in e.value.detail


def test_the_expansion_check_names_how_they_differ():
    P = 7
    prepared = [1, 2, P, P, P, 3, P, P, 4]
    assert expansion_problem(prepared, list(prepared), P) is None
    e = expansion_problem(prepared, [1, 2, P, P, P, P, 3, P, P, 4], P)
    assert e.reason == "engine_image_mismatch" and "runs of [4, 2], prepare to [3, 2]" in e.detail
    e = expansion_problem(prepared, [1, 5, P, P, P, 3, P, P, 4], P)
    assert e.reason == "engine_ids_mismatch" and "from position 1" in e.detail
    assert vllm_images.collapse_runs(prepared, P) == [1, 2, P, 3, P, 4]


def test_chat_replies_are_parsed_or_refused():
    reply = {"prompt_token_ids": [1, 2], "choices": [{"token_ids": [5]}],
             "kv_transfer_params": {"hidden_states_path": "/x/a.safetensors"}}
    assert vllm_images.parse_chat(reply) == ("/x/a.safetensors", 5, [1, 2])
    from eagle3.engines.vllm_protocol import VllmProtocolError
    with pytest.raises(VllmProtocolError, match="prompt_token_ids"):
        vllm_images.parse_chat({**reply, "prompt_token_ids": None})
    with pytest.raises(VllmProtocolError, match="kv_transfer_params"):
        vllm_images.parse_chat({**reply, "kv_transfer_params": None})
    body = vllm_images.chat_body("m", "t", ["data:image/png;base64,AA"])
    assert body["chat_template"] == vllm_images.PASSTHROUGH_TEMPLATE and body["add_generation_prompt"] is False
    assert body["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
