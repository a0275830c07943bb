"""The traffic figures of issue 44 (data/mini_world/traffic.py) on sequences whose answers are known by hand."""
import pytest

from data.mini_world import traffic


def test_a_loop_repeats_and_language_does_not():
    loop = [[7, 8, 9, 10] * 5]  # 20 tokens: the first 3 end no 4-gram, the next 4 end new ones, the 13 after repeat
    assert traffic.repeat_ngram_share(loop) == 13 / 20
    assert traffic.distinct_tokens(loop) == 4
    assert traffic.top_k_share(loop, 5) == 1.0
    varied = [list(range(20)), list(range(20))]  # a 4-gram repeated only across sequences does not count
    assert traffic.repeat_ngram_share(varied) == 0.0
    assert traffic.top_k_share(varied, 5) == 10 / 40


def test_figures_of_one_side():
    seqs = [[1, 1, 1, 1, 1, 2], [3]]
    f = traffic.traffic_figures(seqs)
    assert f == {"loss_tokens": 7, "distinct": 3, "top5_share": 1.0, "repeat_4gram_share": round(1 / 7, 4)}  # only the 5th 1 repeats
    assert traffic.traffic_figures(seqs, top=1)["top1_share"] == round(5 / 7, 4)
    assert "3 distinct of 7 loss tokens" in traffic.format_figures("k2", f)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one non-empty"):
        traffic.traffic_figures([[], []])
    with pytest.raises(ValueError, match="k=0"):
        traffic.top_k_share([[1]], 0)
    with pytest.raises(ValueError, match="n=0"):
        traffic.repeat_ngram_share([[1]], 0)


def test_loss_tokens_are_the_masked_ones_and_mismatched_rows_are_refused():
    assert traffic.loss_token_sequences([[5, 6, 7, 8]], [[0, 1, 0, 1]]) == [[6, 8]]
    with pytest.raises(ValueError, match="loss_mask of 3"):
        traffic.loss_token_sequences([[5, 6, 7, 8]], [[0, 1, 0]])
    with pytest.raises(ValueError, match="1 input_ids rows but 0"):
        traffic.loss_token_sequences([[5]], [])
