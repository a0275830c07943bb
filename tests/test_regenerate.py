"""Regeneration: the multi-turn order, the resumable store, the hf backend (batched, both
target layouts), and the openai backend against a real HTTP server on 127.0.0.1 serving the
tiny K2.5-layout target, with resume and injected faults."""
import json

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from data.openai_server import FaultPlan
from data.prepare import Conversation, SkipCounter, run_prepare
from data.regenerate import (ChatClient, GenerationFailed, HFGenerator, RegenerateError, RegenStore, regenerate_batch,
                             split_reasoning)
from eagle3.config.conf import ConfigError
from eagle3.formats.manifest import read_manifest
from eagle3.target_model.target_io import load_target
from tests.fixtures.prepare import conv
from tests.fixtures.regenerate import served  # noqa: F401 (fixture)
from tests.fixtures.regenerate import CONVS, MAX_NEW, N_TURNS, regen_config, reset_server, write_corpus


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is ~10x faster than two
    threads fighting other processes for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_multi_turn_prompts_include_earlier_regenerated_turns():
    prompts = []

    def fake_generate(batch):  # a deterministic "model": answers with the length of its prompt
        prompts.extend(batch)
        return [(f"R{len(p)}", "stop") for p in batch]

    c = Conversation("x", [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "old0"},
                           {"role": "user", "content": "u1"}, {"role": "assistant", "content": "old1"}])
    single = Conversation("y", [{"role": "user", "content": "v0"}, {"role": "assistant", "content": "old"}])
    (msgs, fins), (msgs2, _) = regenerate_batch([c, single], fake_generate)
    assert [m["content"] for m in msgs] == ["u0", "R1", "u1", "R3"]
    assert fins == ["stop", "stop"] and [m["content"] for m in msgs2] == ["v0", "R1"]
    # round 2 saw the regenerated first answer, never the original
    assert prompts[2] == [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "R1"},
                          {"role": "user", "content": "u1"}]
    assert all("old" not in m["content"] for p in prompts for m in p)


def test_turns_past_max_length_are_kept_as_written_not_generated():
    prompts = []

    def fake_generate(batch):
        prompts.extend(batch)
        return [("new", "stop") for _ in batch]

    c = Conversation("x", [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "old0"},
                           {"role": "user", "content": "u1"}, {"role": "assistant", "content": "old1"},
                           {"role": "user", "content": "u2"}, {"role": "assistant", "content": "old2"}])
    # a history of more than two messages no longer fits: only the first turn is regenerated
    (msgs, fins), = regenerate_batch([c], fake_generate, fits=lambda history: len(history) <= 2)
    assert [m["content"] for m in msgs] == ["u0", "new", "u1", "old1", "u2", "old2"]
    assert fins == ["stop", "past_max_length", "past_max_length"] and len(prompts) == 1


def test_reasoning_is_split_off_and_kept_in_its_own_field():
    assert split_reasoning([5, 6, 9, 7, 8], end_think=9) == ([5, 6], [7, 8])
    assert split_reasoning([5, 9, 6, 9, 7], end_think=9) == ([5, 9, 6], [7])  # the last </think> closes it
    assert split_reasoning([5, 6], end_think=9) == (None, [5, 6])
    assert split_reasoning([5, 6], end_think=None) == (None, [5, 6])
    c = Conversation("x", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}])
    (msgs, _), = regenerate_batch([c], lambda batch: [("answer", "stop", "thinking...")])
    assert msgs[1] == {"role": "assistant", "content": "answer", "reasoning_content": "thinking..."}
    (msgs, _), = regenerate_batch([c], lambda batch: [("answer", "stop", None)])
    assert msgs[1] == {"role": "assistant", "content": "answer"}


def test_store_resumes_and_cuts_a_partial_last_line(tmp_path):
    path, settings = tmp_path / "s.jsonl", {"backend": "x", "temperature": 0.0}
    store = RegenStore(path, settings)
    store.append("a", [{"role": "assistant", "content": "1"}], ["stop"])
    store.append("b", [{"role": "assistant", "content": "2"}], ["length"])
    with open(path, "ab") as f:
        f.write(b'{"id": "c", "messages": [{"ro')  # a kill in the middle of a write
    again = RegenStore(path, settings)
    assert "a" in again and "b" in again and "c" not in again
    assert again.get("b")["finish_reasons"] == ["length"]
    again.append("c", [], [])
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()[1:]] == ["a", "b", "c"]
    with pytest.raises(RegenerateError, match="other generation settings"):
        RegenStore(path, {**settings, "temperature": 0.7})


@pytest.fixture(scope="module")
def k25_generator(tiny_k25_target):
    tok = AutoTokenizer.from_pretrained(str(tiny_k25_target))
    model, text_config = load_target(tiny_k25_target, "kimi_k25", dtype="float32")
    return HFGenerator(model, tok, max_new_tokens=MAX_NEW, max_positions=text_config["max_position_embeddings"])


def test_prepare_reports_the_picks_the_canonical_veto_refused(tmp_path, tiny_k25_target):
    corpus = write_corpus(tmp_path / "c.jsonl")
    counts = {}
    for canonical in ("false", "true"):
        cfg = regen_config(tmp_path, tiny_k25_target, corpus, "hf", "target.layout=kimi_k25",
                           "regenerate.temperature=1.0", f"regenerate.canonical_tokens={canonical}",
                           f"out_dir={tmp_path}/canonical-{canonical}")
        counts[canonical] = read_manifest(run_prepare(cfg), "prepare")["regenerate"].get("canonical_vetoed_tokens")
    # sampled from the tiny target's near-flat logits, some picks split text oddly and are refused
    assert counts["false"] is None and isinstance(counts["true"], int) and counts["true"] >= 1


def test_hf_generator_batched_equals_one_by_one(k25_generator):
    prompts = [[{"role": "user", "content": "hello there, how are you?"}], [{"role": "user", "content": "x"}],
               [{"role": "system", "content": "s"}, {"role": "user", "content": "a longer question here"}]]
    batched = k25_generator.generate(prompts)
    single = [k25_generator.generate([p])[0] for p in prompts]
    assert batched == single
    assert all(reason in ("stop", "length") for _, reason, _ in batched)


def test_hf_backend_regenerates_every_assistant_turn(tmp_path, tiny_k2_target, tiny_k25_target, k25_generator):
    corpus = write_corpus(tmp_path / "c.jsonl")
    results = {}
    for layout, target in (("causal_lm", tiny_k2_target), ("kimi_k25", tiny_k25_target)):
        cfg = regen_config(tmp_path, target, corpus, "hf", f"target.layout={layout}", "regenerate.batch_size=3",
                           f"out_dir={tmp_path}/{layout}")
        out = run_prepare(cfg)
        m = read_manifest(out, "prepare")
        assert m["regenerate"]["generated"] == len(CONVS) and m["regenerate"]["turns"] == N_TURNS
        store = [json.loads(line) for line in open(m["regenerate"]["store"])][1:]
        results[layout] = {r["id"]: r["messages"] for r in store}
    # both layouts hold the same text weights: the same greedy answers
    assert results["causal_lm"] == results["kimi_k25"]
    b = results["kimi_k25"]["b"]
    assert [m["role"] for m in b] == ["system", "user", "assistant", "user", "assistant"]
    assert b[3]["content"] == "And?"  # user turns are kept
    # the stage cuts answers at the round trip by default (regenerate.cut_at_round_trip)
    cutting = HFGenerator(k25_generator.model, k25_generator.tok, max_new_tokens=MAX_NEW,
                          max_positions=k25_generator.max_positions, cut_at_round_trip=True)
    expected_first = cutting.generate([b[:2]])[0][0]
    assert b[2]["content"] == expected_first  # turn 1 from the prompt; turn 2 from the regenerated history
    assert b[4]["content"] == cutting.generate([b[:4]])[0][0]


def test_openai_backend_against_a_real_server_with_resume(tmp_path, tiny_k25_target, served, k25_generator):
    reset_server(served)
    corpus = write_corpus(tmp_path / "c.jsonl")
    over = [f"regenerate.openai.base_url={served.url}", "regenerate.openai.concurrency=3"]
    cfg = regen_config(tmp_path, tiny_k25_target, corpus, "openai", *over)
    out = run_prepare(cfg)
    m = read_manifest(out, "prepare")
    assert m["regenerate"]["generated"] == len(CONVS) and m["counts"]["kept"] == len(CONVS)
    assert len(served.request_log) == N_TURNS
    regenerated = {r["id"]: r["messages"] for r in map(json.loads, open(m["regenerate"]["store"])) if "id" in r}
    for cid, msgs in regenerated.items():  # the server's answers are the target's greedy answers
        for k, msg in enumerate(msgs):
            if msg["role"] == "assistant":
                assert msg["content"] == k25_generator.generate([msgs[:k]])[0][0]
    train = datasets.load_from_disk(str(out / "train"))
    tok = AutoTokenizer.from_pretrained(str(tiny_k25_target))
    row = train[list(train["id"]).index("a")]
    trained = tok.decode([t for t, l in zip(row["input_ids"], row["loss_mask"]) if l])
    assert trained == regenerated["a"][1]["content"] + "<|im_end|>"

    # resume: drop the last two finished conversations as if the run had been killed
    store = m["regenerate"]["store"]
    lines = open(store).read().splitlines(keepends=True)
    open(store, "w").writelines(lines[:-2] + [lines[-2][:15]])
    lost = {json.loads(line)["id"] for line in lines[-2:]}
    reset_server(served)
    (out / "manifest.json").unlink()
    m2 = read_manifest(run_prepare(cfg), "prepare")
    assert m2["regenerate"]["resumed"] == len(CONVS) - 2 and m2["regenerate"]["generated"] == 2
    assert len(served.request_log) == sum(len(regenerated[i]) // 2 for i in lost)
    again = {r["id"]: r["messages"] for r in map(json.loads, open(store)) if "id" in r}
    assert again == regenerated  # greedy: the redone ones are the same


def test_client_retries_every_fault_kind(served):
    reset_server(served, FaultPlan(script=["500", "reset", "malformed", "truncated", "empty", "429", "503", "slow"],
                                   slow_s=0.01))
    sleeps = []
    client = ChatClient(served.url, "default", max_retries=8, backoff_s=0.001, backoff_max_s=0.002,
                        max_tokens=MAX_NEW, sleep=sleeps.append)
    text, reason, _ = client.complete([{"role": "user", "content": "hi"}])
    assert isinstance(text, str) and reason in ("stop", "length")
    assert [a for _, a in served.request_log] == ["500", "reset", "malformed", "truncated", "empty", "429", "503", "slow"]
    assert client.retries == 7 and len(sleeps) == 7
    # reset and truncated body: connection; malformed JSON and no choices: malformed
    assert client.retries_by_kind == {"5xx": 2, "connection": 2, "malformed": 2, "429": 1}
    client.close()


def test_timeouts_are_retried_and_exhausted_retries_fail_the_conversation(served):
    reset_server(served, FaultPlan(script=["hang"], hang_s=30.0))  # stop() ends the hang
    client = ChatClient(served.url, "default", timeout_s=3.0, max_retries=2, backoff_s=0.0, max_tokens=MAX_NEW)
    client.complete([{"role": "user", "content": "hi"}])
    assert [a for _, a in served.request_log] == ["hang", "ok"]
    reset_server(served, FaultPlan(script=["500"] * 3))
    with pytest.raises(GenerationFailed, match="gave up after 3 attempts; last: HTTP 500"):
        client.complete([{"role": "user", "content": "hi"}])
    client.close()
    bad = ChatClient(served.url, "default", max_retries=3, backoff_s=0.0)
    reset_server(served)
    with pytest.raises(GenerationFailed, match="HTTP 400"):  # a client error is not retried
        bad.complete([{"role": "user", "content": 5}])
    assert len(served.request_log) == 1  # one attempt: a 400 is not retried


def test_failed_conversations_are_counted_then_done_on_rerun(tmp_path, tiny_k25_target, served):
    # one conversation fails every attempt (3 x 500); the rest succeed; a rerun finishes it
    reset_server(served, FaultPlan(script=["500", "500", "500"]))
    corpus = write_corpus(tmp_path / "c.jsonl", CONVS[:1] + CONVS[2:3])
    cfg = regen_config(tmp_path, tiny_k25_target, corpus, "openai", f"regenerate.openai.base_url={served.url}",
                       "regenerate.openai.concurrency=1", "regenerate.openai.max_retries=2",
                       "regenerate.openai.backoff_s=0")
    m = read_manifest(run_prepare(cfg), "prepare")
    assert m["counts"]["skipped"]["regen_failed"] == 1 and m["counts"]["kept"] == 1
    assert m["regenerate"]["retries_by_kind"] == {"5xx": 2}  # 3 attempts = 2 retries, then it gave up
    assert "gave up after 3 attempts" in m["skip_examples"]["regen_failed"][0]
    reset_server(served)
    m2 = read_manifest(run_prepare(cfg), "prepare")
    assert m2["counts"]["skipped"]["regen_failed"] == 0 and m2["counts"]["kept"] == 2
    assert m2["regenerate"]["resumed"] == 1 and len(served.request_log) == 1


def test_unreachable_server_fails_clearly(tmp_path, tiny_k25_target):
    corpus = write_corpus(tmp_path / "c.jsonl")
    cfg = regen_config(tmp_path, tiny_k25_target, corpus, "openai", "regenerate.openai.base_url=http://127.0.0.1:9/v1",
                       "regenerate.openai.max_retries=1", "regenerate.openai.backoff_s=0")
    with pytest.raises(RegenerateError, match="cannot reach .*127.0.0.1:9"):
        run_prepare(cfg)
    assert SkipCounter().total == 0


def test_hf_prompt_too_long_fails_only_that_conversation(tmp_path, tiny_k25_target, k25_generator, monkeypatch):
    from data import regenerate

    short = HFGenerator(k25_generator.model, k25_generator.tok, max_new_tokens=MAX_NEW, max_positions=60)
    monkeypatch.setattr(regenerate.HFGenerator, "from_target", classmethod(lambda cls, *a: short))
    rows = CONVS[:1] + [conv("long", ("human", "word " * 80), ("gpt", "x"))] + CONVS[2:3]
    corpus = write_corpus(tmp_path / "c.jsonl", rows)
    cfg = regen_config(tmp_path, tiny_k25_target, corpus, "hf", "regenerate.batch_size=4")
    m = read_manifest(run_prepare(cfg), "prepare")
    assert m["counts"]["kept"] == 2 and m["counts"]["skipped"]["regen_failed"] == 1
    assert "exceeds the target's 60 positions" in m["skip_examples"]["regen_failed"][0]


def test_server_command_line_serves_and_injects_faults():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, str(repo / "data" / "openai_server.py"), "--echo", "--port", "0",
                             "--fault-script", "503,reset"], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split()[0]
        client = ChatClient(url, "default", max_retries=3, backoff_s=0.0, max_tokens=3)
        assert client.complete([{"role": "user", "content": "one two three four"}]) == ("one two three", "length", None)
        assert client.retries == 2  # the 503 and the reset were retried
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_interrupted_hf_run_keeps_finished_conversations(tmp_path, tiny_k25_target, k25_generator, monkeypatch):
    from data import regenerate

    class Dies:  # the real generator, killed (Ctrl-C) on its third batch
        calls = 0

        def generate(self, prompts):
            Dies.calls += 1
            if Dies.calls == 3:
                raise KeyboardInterrupt
            return k25_generator.generate(prompts)

    monkeypatch.setattr(regenerate.HFGenerator, "from_target", classmethod(lambda cls, *a: Dies()))
    corpus = write_corpus(tmp_path / "c.jsonl", CONVS[:1] + CONVS[2:3] + CONVS[1:2])  # single-turn ones first
    cfg = regen_config(tmp_path, tiny_k25_target, corpus, "hf", "regenerate.batch_size=1")
    with pytest.raises(KeyboardInterrupt):
        run_prepare(cfg)
    store = next((tmp_path / "stages" / "k25_mini" / "prepare" / "regenerated").glob("hf-*.jsonl"))
    assert sorted(json.loads(line)["id"] for line in list(open(store))[1:]) == ["a", "c"]  # finished ones survived
    monkeypatch.setattr(regenerate.HFGenerator, "from_target", classmethod(lambda cls, *a: k25_generator))
    m = read_manifest(run_prepare(cfg), "prepare")
    assert m["regenerate"]["resumed"] == 2 and m["regenerate"]["generated"] == 1 and m["counts"]["kept"] == 3


def test_row_sampler_draws_per_row_whatever_the_batch():
    import torch

    from data.row_sampling import PerRowSampler, nucleus_mask, row_seed

    assert row_seed(0, "a") == row_seed(0, "a") != row_seed(1, "a") != row_seed(0, "b")
    # top-p keeps the smallest most-likely set reaching p (ties aside), always the top token
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert nucleus_mask(probs.log(), 0.7).tolist() == [[True, True, False, False]]
    assert nucleus_mask(probs.log(), 0.1).tolist() == [[True, False, False, False]]
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    picks = lambda rows, seeds: [int(x.argmax()) for x in PerRowSampler(seeds, 1.0, 0.9, "cpu")(None, rows)]  # noqa
    alone = [picks(scores[i: i + 1], [10 + i])[0] for i in range(3)]
    assert picks(scores, [10, 11, 12]) == alone                          # batched = one by one
    assert picks(scores[[2, 0, 1]], [12, 10, 11]) == [alone[2], alone[0], alone[1]]  # any order
    out = PerRowSampler([1, 2, 3], 1.0, 1.0, "cpu")(None, scores)
    assert torch.isfinite(out).sum(dim=-1).tolist() == [1, 1, 1]          # one allowed token per row
    with pytest.raises(ValueError, match="temperature"):
        PerRowSampler([1], 0.0, 1.0, "cpu")


def test_row_sampler_veto_gives_way_to_the_next_candidate():
    """A refused pick is replaced by the row's next candidate: greedy, the next most likely token; sampled, the next
    under the same noise (so an allowing veto changes nothing); rows the veto allows keep their pick."""
    import torch

    from data.row_sampling import PerRowSampler

    scores = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    order = scores.argsort(dim=-1, descending=True)
    banned = {int(order[0, 0]), int(order[0, 1])}  # row 0's two best tokens (row 1 and 2 may hold them too)
    refuse = lambda ids, picks: [p not in banned for p in picks]  # noqa: E731
    greedy = PerRowSampler([0, 0, 0], 0.0, 1.0, "cpu", veto=refuse)
    picks = greedy(torch.zeros(3, 1, dtype=torch.long), scores).argmax(dim=-1).tolist()
    for r in range(3):
        assert picks[r] == next(int(t) for t in order[r] if int(t) not in banned)
    assert picks[0] == int(order[0, 2]) and greedy.vetoed >= 2
    allow = lambda ids, picks: [True] * len(picks)  # noqa: E731
    ids = torch.zeros(3, 1, dtype=torch.long)
    sampled = lambda veto: PerRowSampler([5, 6, 7], 1.0, 1.0, "cpu", veto=veto)(ids, scores).argmax(-1).tolist()  # noqa
    plain = PerRowSampler([5, 6, 7], 1.0, 1.0, "cpu")(ids, scores).argmax(-1).tolist()
    assert sampled(allow) == plain
    assert all(p not in banned for p in sampled(refuse))
    stubborn = PerRowSampler([0], 0.0, 1.0, "cpu", veto=lambda ids, picks: [False] * len(picks), max_tries=3)
    assert stubborn(torch.zeros(1, 1, dtype=torch.long), scores[:1]).argmax(-1).item() == int(order[0, 2])  # 3rd stands


def test_canonical_veto_judges_the_text_a_token_would_leave(k25_generator):
    """canonical_veto allows a token whose segment re-tokenizes to itself, or ends in one partial character; it
    refuses a split the tokenizer would not make and a text holding a replacement character before its end."""
    import torch

    from data.round_trip import canonical_veto

    tok = k25_generator.tok
    word = tok("hello there", add_special_tokens=False)["input_ids"]
    split = [tok.convert_tokens_to_ids(c) for c in "hel"]  # 'h','e','l': the tokenizer spells 'hel' otherwise
    assert tok("hel", add_special_tokens=False)["input_ids"] != split, "the tiny tokenizer has no merge in 'hel'"
    stop = k25_generator.stop_ids[0]
    veto = canonical_veto(tok, 1, k25_generator.stop_ids)
    assert veto(torch.tensor([[0] + word[:-1]] * 2), [word[-1], stop]) == [True, True]
    assert veto(torch.tensor([[0] + split[:-1]]), [split[-1]]) == [False]
    lead = tok.convert_tokens_to_ids("ä")  # byte 0xE4: the lead byte of a 3-byte character
    dangling = torch.tensor([[0] + word])
    assert veto(dangling, [lead]) == [True]  # one partial character at the end: the next token may complete it
    assert veto(torch.tensor([[0] + word + [lead]]), [word[0]]) == [False]  # ... and it did not: refused


def test_canonical_tokens_keep_the_answer_text_whole(k25_generator, monkeypatch):
    """regenerate.canonical_tokens: with a row free to try every candidate, each answer's text re-tokenizes to
    itself or ends in one partial character; without it, the same sampled prompts leave texts that do not (the
    tiny target's near-flat logits pick odd splits); and a canonical answer equals the plain one up to the first
    token the veto refused."""
    from data import row_sampling
    from data.round_trip import REPLACEMENT, canonical_veto, last_segment

    monkeypatch.setattr(row_sampling, "VETO_TRIES", 10_000)  # every candidate (real text rarely needs 2)
    tok = k25_generator.tok
    prompts = [[{"role": "user", "content": c}] for c in ("hello there, how are you?", "x", "tell me a story",
                                                          "what is 2 + 2?", "write some code")]
    longest = max(len(tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]) for p in prompts)  # as HFGenerator pads them
    answers, vetoed = {}, {}
    for canonical in (False, True):
        rec = _RecordingModel(k25_generator.model)
        gen = HFGenerator(rec, tok, max_new_tokens=24, canonical_tokens=canonical)
        gen.generate(prompts, temperature=1.0, seed=3)
        vetoed[canonical] = gen.vetoed_tokens  # what prepare's stats report as canonical_vetoed_tokens
        answers[canonical] = [r[longest:][:next((j for j, t in enumerate(r[longest:]) if t in gen.stop_ids), 24)]
                              for r in rec.rows]

    def whole(ids) -> bool:
        seg = last_segment(ids, gen.end_think)
        text = tok.decode(seg, skip_special_tokens=True)
        back = tok(text, add_special_tokens=False)["input_ids"]
        return back == seg or (text.endswith(REPLACEMENT) and REPLACEMENT not in text[:-1])

    assert all(whole(a) for a in answers[True])
    assert not all(whole(a) for a in answers[False]), "no odd split without the veto: use other prompts"
    veto = canonical_veto(tok, 0, gen.stop_ids, gen.end_think)
    refused_answers = 0
    for plain, canonical in zip(answers[False], answers[True]):
        first_refused = next((j for j in range(len(plain)) if not veto(torch.tensor([plain[:j]]), [plain[j]])[0]),
                             len(plain))
        assert canonical[:first_refused] == plain[:first_refused]
        if first_refused < min(len(plain), len(canonical)):
            assert canonical[first_refused] != plain[first_refused]
            refused_answers += 1
    assert vetoed[False] == 0 and vetoed[True] >= refused_answers >= 1  # every refusal counted, none without veto


def test_sampled_regeneration_does_not_depend_on_the_batch(k25_generator):
    prompts = [[{"role": "user", "content": "hello there, how are you?"}], [{"role": "user", "content": "x"}],
               [{"role": "system", "content": "s"}, {"role": "user", "content": "a longer question here"}]]
    first = k25_generator.generate(prompts, temperature=1.0, seed=7)
    assert k25_generator.generate(prompts[::-1], temperature=1.0, seed=7) == first[::-1]
    assert [k25_generator.generate([p], temperature=1.0, seed=7)[0] for p in prompts] == first
    other = k25_generator.generate(prompts, temperature=1.0, seed=8)
    greedy = k25_generator.generate(prompts)
    assert other != first and greedy != first  # the seed and sampling matter (a random model: near-flat logits)


def _has_repeated_ngram(ids: list[int], n: int) -> bool:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) != len(set(grams))


class _RecordingModel:
    """The target, recording the token rows its generate returns (the answer's ids, before decoding)."""

    def __init__(self, model):
        self.model, self.rows = model, None

    def parameters(self):
        return self.model.parameters()

    def generate(self, **kw):
        out = self.model.generate(**kw)
        self.rows = out.tolist()
        return out


def test_no_repeat_ngram_guard_breaks_the_loop_and_only_where_it_fires(k25_generator):
    """regenerate.no_repeat_ngram_size: the guarded row holds no n-gram twice over prompt + answer; the greedy row
    of the same prompt does, and the two agree up to the first token the guard changed, where greedy's token would
    have completed an n-gram the conversation already held."""
    n, new = 3, 40
    prompt = [{"role": "user", "content": "hello there, how are you?"}]
    rows = {}
    for guard in (0, n):
        rec = _RecordingModel(k25_generator.model)
        HFGenerator(rec, k25_generator.tok, max_new_tokens=new, no_repeat_ngram_size=guard).generate([prompt])
        rows[guard] = rec.rows[0]
    greedy, guarded = rows[0], rows[n]
    assert _has_repeated_ngram(greedy, n), "the tiny target's greedy answer no longer loops: pick a loopier prompt"
    assert not _has_repeated_ngram(guarded, n)
    first_change = next(i for i, (a, b) in enumerate(zip(greedy, guarded)) if a != b)
    assert not _has_repeated_ngram(greedy[:first_change], n)
    assert _has_repeated_ngram(greedy[:first_change + 1], n)


def test_no_repeat_ngram_guard_needs_the_hf_backend(tmp_path, tiny_k25_target):
    corpus = write_corpus(tmp_path / "c.jsonl")
    with pytest.raises(ConfigError, match="no_repeat_ngram_size=4, sampled_opening_tokens=0 and canonical_tokens=False need backend=hf"):
        regen_config(tmp_path, tiny_k25_target, corpus, "openai", "regenerate.no_repeat_ngram_size=4")
    with pytest.raises(ConfigError, match="no_repeat_ngram_size=1"):
        regen_config(tmp_path, tiny_k25_target, corpus, "hf", "regenerate.no_repeat_ngram_size=1")


def test_sampled_opening_then_the_argmax_path(tmp_path, k25_generator):
    """regenerate.sampled_opening_tokens=k: the first k answer tokens are sampled (seeded per prompt), every later
    one is the greedy continuation of what came before, as `generate(do_sample=False)` from that prefix gives it."""
    k, new = 3, 12
    tok, prompt = k25_generator.tok, [{"role": "user", "content": "hello there, how are you?"}]
    head = len(tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"])  # the prompt's tokens, as HFGenerator encodes them
    opened, greedy = _RecordingModel(k25_generator.model), _RecordingModel(k25_generator.model)
    HFGenerator(opened, tok, max_new_tokens=new, sampled_opening_tokens=k).generate([prompt], temperature=1.0, seed=3)
    plain = HFGenerator(greedy, tok, max_new_tokens=new)
    plain.generate([prompt])
    row = opened.rows[0]
    assert row[head:head + k] != greedy.rows[0][head:head + k]  # the opening is sampled, not the argmax
    with torch.no_grad():
        tail = k25_generator.model.generate(input_ids=torch.tensor([row[:head + k]]), do_sample=False,
                                            max_new_tokens=new - k, eos_token_id=plain.stop_ids,
                                            pad_token_id=plain.pad_id)[0].tolist()
    assert tail[:len(row)] == row  # ... and the rest is the argmax path from it
    corpus = write_corpus(tmp_path / "c.jsonl")
    with pytest.raises(ConfigError, match="sampled_opening_tokens=2: >= 0, and it needs temperature > 0"):
        regen_config(tmp_path, tmp_path, corpus, "hf", "regenerate.sampled_opening_tokens=2")
