"""Regenerated answers are kept only as far as their text re-tokenizes to the generated tokens
(data/round_trip.py): on a hand-built tokenizer where two single newlines re-encode as one
double-newline token, and end to end on the tiny K2.5 target, whose cut answers must be exactly its
greedy tokens."""
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from data.regenerate import ROUND_TRIP, HFGenerator
from data.round_trip import last_segment, round_trip_len, round_trip_stop, survives_round_trip
from eagle3.target_model.target_io import load_target

A, B, AB, NL, NL2, E1, E2, END = 0, 1, 2, 3, 4, 5, 6, 7  # E1 E2: the two bytes of "é"


@pytest.fixture(scope="module")
def tok():
    """Byte-level BPE: 'a' 'b' merge to 'ab', '\\n' '\\n' (byte-level 'Ċ') merge to '\\n\\n';
    'é' is two byte tokens that never merge."""
    vocab = {"a": A, "b": B, "ab": AB, "Ċ": NL, "ĊĊ": NL2, "Ã": E1, "©": E2}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("Ċ", "Ċ")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, clean_up_tokenization_spaces=False)
    fast.add_special_tokens({"eos_token": "<end>"})
    assert fast.convert_tokens_to_ids("<end>") == END
    return fast


def test_round_trip_len_is_the_longest_prefix_that_encodes_back(tok):
    assert tok("ab\n\n", add_special_tokens=False)["input_ids"] == [AB, NL2]
    assert round_trip_len(tok, [AB, NL2]) == 2                 # canonical: kept whole
    assert round_trip_len(tok, [AB, NL, NL]) == 2              # "\n" "\n" comes back as "\n\n": cut after one
    assert round_trip_len(tok, [A, B]) == 1                    # "a" "b" comes back as "ab"
    assert round_trip_len(tok, [B, A, B, NL]) == 2             # "bab": "b" "ab" is the encoding, not "b" "a" "b"
    assert round_trip_len(tok, [A, END]) == 1                  # a special token vanishes from the decoded text
    assert round_trip_len(tok, []) == 0


def test_survives_round_trip_per_row_and_undecided_partial_characters(tok):
    assert tok("é", add_special_tokens=False)["input_ids"] == [E1, E2]
    assert survives_round_trip(tok, [[AB], [A, B], []]) == [True, False, True]
    # half of a multi-byte character decodes to U+FFFD: not judged until the next token completes it
    assert survives_round_trip(tok, [[AB, E1], [AB, E1, E2]]) == [None, True]
    # a half character before the end can never be completed: out, as the canonical veto judges it
    assert survives_round_trip(tok, [[E1, AB, E1], [E1, AB]]) == [False, False]


def test_last_segment_checks_only_the_part_after_the_separator():
    assert last_segment([1, 2, 9, 3, 4], 9) == [3, 4]
    assert last_segment([1, 2, 3], 9) == [1, 2, 3]
    assert last_segment([1, 9], 9) == [] and last_segment([1, 2], None) == [1, 2]


def test_stopping_criterion_marks_only_rows_that_left_the_round_trip(tok):
    stop = round_trip_stop(tok, prompt_len=1, stop_ids=[END])
    rows = torch.tensor([[A, AB, NL2], [A, NL, NL], [A, A, END], [A, B, END]])
    # row 0 canonical; row 1 "\\n" "\\n" no longer survives; row 2 "a" then a stop token: fine;
    # row 3 ends at the stop token, the ids before it ("b") still survive
    assert stop(rows, None).tolist() == [False, True, False, False]


@pytest.fixture(scope="module")
def tiny_generators(tiny_k25_target):
    torch.set_num_threads(1)
    tk = AutoTokenizer.from_pretrained(str(tiny_k25_target))
    model, text_config = load_target(tiny_k25_target, "kimi_k25", dtype="float32")
    kw = dict(max_new_tokens=12, max_positions=text_config["max_position_embeddings"])
    return HFGenerator(model, tk, cut_at_round_trip=True, **kw), HFGenerator(model, tk, **kw)


PROMPTS = [[{"role": "user", "content": c}] for c in
           ("hello there, how are you?", "x", "Count to three", "What is a cat?", "tell me a story", "ok")]


def greedy_mismatches(gen, prompt, answer) -> int:
    """Positions of the answer (re-tokenized as prepare will) that are not the target's argmax."""
    tk = gen.tok
    pre = tk.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    n0 = len(tk(pre, add_special_tokens=False)["input_ids"])
    ids = tk(pre + answer, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        argmax = gen.model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
    return int((torch.tensor(ids[n0:]) != argmax[n0 - 1: len(ids) - 1]).sum())


def test_cut_answers_are_exactly_the_targets_greedy_tokens(tiny_generators):
    cutting, plain = tiny_generators
    cut = cutting.generate(PROMPTS)
    assert cut == [cutting.generate([p])[0] for p in PROMPTS]  # batching does not change the cut
    assert all(greedy_mismatches(cutting, p, text) == 0 for p, (text, _, _) in zip(PROMPTS, cut))
    reasons = [r for _, r, _ in cut]
    assert set(reasons) <= {"stop", "length", ROUND_TRIP}
    # the tiny random model does produce non-canonical tokens: without the cut they reach the data
    # (so this test can fail), and the cut answers are prefixes of the uncut ones
    uncut = plain.generate(PROMPTS)
    assert ROUND_TRIP in reasons
    assert sum(greedy_mismatches(plain, p, text) for p, (text, _, _) in zip(PROMPTS, uncut)) > 0
    assert all(u.startswith(c) for (c, _, _), (u, _, why) in zip(cut, uncut) if why is None)  # (no </think> split)
