"""eagle3.engines.aux_layers: the engines' rules turning a drafter config's aux layer ids into Hugging Face
hidden-state indices h, their inverse for export, SGLang's default, and the checks."""
import pytest

from eagle3.engines import aux_layers as al

L = 61  # Kimi-K2 / K2.5


@pytest.mark.parametrize("ids, rule, want", [
    # ids [1, 29, 57]: a first id 1 means id + 1 in every SGLang version -> Kimi's h [2, 30, 58]
    ([1, 29, 57], "sglang", [2, 30, 58]),
    ([1, 29, 57], "sglang_legacy", [2, 30, 58]),
    ([1, 29, 57], "vllm", [1, 29, 57]),
    # ids [2, 30, 58] (lightseekorg's K2.5 drafter): current SGLang h = id, older SGLang id + 1
    ([2, 30, 58], "sglang", [2, 30, 58]),
    ([2, 30, 58], "sglang_legacy", [3, 31, 59]),
    ([2, 30, 58], "vllm", [2, 30, 58]),
    # the first id decides for the whole list
    ([1, 2, 3], "sglang", [2, 3, 4]),
    ([3, 1, 2], "sglang", [3, 1, 2]),
])
def test_rules_table(ids, rule, want):
    assert al.hf_indices_from_ids(ids, rule) == want


def test_no_ids_means_sglang_default():
    assert al.sglang_default_hf_indices(L) == [2, 30, 58]
    choice = al.choose_hf_indices(None, None, None, L)
    assert choice.hf_indices == [2, 30, 58] and choice.source == "sglang_default" and choice.rule is None


@pytest.mark.parametrize("h", [[2, 30, 58], [3, 31, 59], [5, 7, 9], [2, 3, 4], [10, 20, 60]])
@pytest.mark.parametrize("rule", al.RULES)
def test_export_ids_read_back_as_h_under_their_rule(h, rule):
    assert al.hf_indices_from_ids(al.ids_for_rule(h, rule), rule) == h


def test_sglang_export_form_is_portable_where_one_exists():
    ids, portable = al.sglang_export_ids([2, 30, 58])
    assert ids == [1, 29, 57] and portable
    assert al.hf_indices_from_ids(ids, "sglang") == al.hf_indices_from_ids(ids, "sglang_legacy") == [2, 30, 58]
    ids, portable = al.sglang_export_ids([3, 31, 59])   # no list means h in both versions
    assert ids == [3, 31, 59] and not portable
    entries = al.sglang_config_entries([3, 31, 59])
    assert entries[al.META_KEY]["sglang_versions"] == al.SGLANG_RULE_CHANGE
    assert al.sglang_config_entries([2, 30, 58])[al.META_KEY]["sglang_versions"] == "every version"
    with pytest.raises(al.AuxLayerError, match="start at 1"):
        al.sglang_export_ids([1, 30, 58])


def test_readings_and_the_disagreement_note():
    assert al.disagreement_note([1, 29, 57], "sglang", "d") is None
    assert al.disagreement_note(None, "sglang", "d") is None  # a config listing no ids: nothing to disagree on
    note = al.disagreement_note([2, 30, 58], "sglang", "d")
    assert "current SGLang (PR #25454+) h = [2, 30, 58]" in note and "before it h = [3, 31, 59]" in note
    assert "using rule 'sglang': h = [2, 30, 58]" in note


def test_choose_reads_the_init_drafter_by_the_rule_and_refuses_a_conflict():
    c = al.choose_hf_indices([2, 30, 58], "/k25-drafter", None, L)
    assert c.hf_indices == [2, 30, 58] and c.rule == "sglang" and c.source == "init_drafter:/k25-drafter"
    assert c.provenance()["readings"]["sglang_legacy"] == [3, 31, 59]
    assert al.choose_hf_indices([2, 30, 58], "/d", None, L, "sglang_legacy").hf_indices == [3, 31, 59]
    assert al.choose_hf_indices([2, 30, 58], "/d", [2, 30, 58], L).hf_indices == [2, 30, 58]
    with pytest.raises(al.AuxLayerError, match="conflicts with the init drafter"):
        al.choose_hf_indices([2, 30, 58], "/d", [3, 31, 59], L)
    assert al.choose_hf_indices(None, None, [3, 31, 59], L).source == "config"
    with pytest.raises(al.AuxLayerError, match=r"\[30, 58\] outside 1\.\.7"):
        al.choose_hf_indices([2, 30, 58], "/d", None, 8)  # K2.5's layers on an 8-layer target


@pytest.mark.parametrize("h, needle", [
    ([2, 30], "2 given"), ([2, 30, 58, 60], "4 given"), ([2, 2, 30], "[2] repeated"),
    ([0, 2, 3], "[0] outside 1..60"), ([2, 30, 61], "[61] outside 1..60"), ([1, 30, 58], "h[0] = 1"),
    (2, "expected a list of 3 integers"), ([7.5, 2, 4], "7.5 is not an integer"), ("2,30,58", "expected a list"),
    ([True, 2, 3], "True is not an integer"), ([30, 2, 58], "not ascending"),
])
def test_unusable_indices_are_refused(h, needle):
    with pytest.raises(al.AuxLayerError) as e:
        al.validate_hf_indices(h, L)
    assert needle in str(e.value)


def test_unknown_rule_is_refused():
    with pytest.raises(al.AuxLayerError, match="expected one of"):
        al.hf_indices_from_ids([1, 2, 3], "sglang_v2")
