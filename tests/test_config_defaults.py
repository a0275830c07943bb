"""One source of config defaults: each stage's typed schema (eagle3/config/schema/<stage>.py) is the base of
its primary config, conf/<stage>.yaml adds only config groups and the paths derived from them, and
every choice list a config validates against is defined once (eagle3/config/choices.py)."""
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle3 import REPO_ROOT
from eagle3.config import choices
from eagle3.config.conf import CONF_DIR, SCHEMA_GROUP, ConfigError, as_plain_dict, compose, stage_schema, to_schema

STAGES = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
CONVERTED = STAGES  # every stage: its schema is the one home of its defaults
# Overrides a stage cannot compose without: train's out_dir names the init.
REQUIRED = {"train": ["+init=scratch"]}
# Keys a default-chosen preset group sets on purpose (the demo's size, demo_size: cpu).
PRESET_KEYS = {"demo": {"overrides"},
               # the study: the demo size's overrides, and its own sizes (conf/study_size/<demo_size>.yaml)
               "study": {"overrides", "curve", "forgetting_max_sequences", "real_check", "knob_grid"},
               "learning_ab": {"overrides"}}  # the demo size's overrides


def defaults_of(schema) -> dict:
    """{field: default} for the fields of a dataclass that have a default (nested dataclasses as the
    default instance their field builds, so a parent's per-field default wins over the class's)."""
    out = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def mismatches(typed, defaults: dict, where: str = "") -> list[str]:
    found = []
    for name, default in defaults.items():
        value = getattr(typed, name)
        if dataclasses.is_dataclass(default) and dataclasses.is_dataclass(value):
            found += mismatches(value, {f.name: getattr(default, f.name) for f in dataclasses.fields(default)},
                                f"{where}{name}.")
        elif as_plain_dict(value) != as_plain_dict(default):
            found.append(f"{where}{name}: composed {as_plain_dict(value)!r}, schema default {as_plain_dict(default)!r}")
    return found


def test_every_primary_config_has_a_registered_schema():
    for stage in CONVERTED:
        assert dataclasses.is_dataclass(stage_schema(stage)), stage
    with pytest.raises(ConfigError, match="no config schema for stage 'nonesuch'"):
        stage_schema("nonesuch")


def test_the_comparison_sees_a_changed_default():
    """The check below can fail: a value set on top of the schema (as a YAML value would) shows up,
    nested ones included."""
    schema = stage_schema("train")
    typed = to_schema(compose("train", ["+init=scratch", "optim.lr=1e-3", "ttt_length=5"]), schema)
    found = mismatches(typed, {k: v for k, v in defaults_of(schema).items() if k != "init"})
    assert [m.split(":")[0] for m in found] == ["ttt_length", "optim.lr"]


@pytest.mark.parametrize("stage", CONVERTED)
def test_composed_with_no_overrides_equals_the_schema_defaults(stage):
    schema = stage_schema(stage)
    typed = to_schema(compose(stage, REQUIRED.get(stage, [])), schema)
    defaults = {k: v for k, v in defaults_of(schema).items()
                if k not in PRESET_KEYS.get(stage, set()) and not (k == "init" and stage in REQUIRED)}
    assert defaults, f"{stage}: a schema with no defaults tests nothing"
    assert mismatches(typed, defaults) == []


@pytest.mark.parametrize("stage", CONVERTED)
def test_primary_yaml_holds_only_groups_and_derived_paths(stage):
    """A value written in conf/<stage>.yaml would be a second home for a default: only the schema
    (first in the defaults list), the groups, and values interpolated from them (paths) belong there."""
    raw = OmegaConf.load(CONF_DIR / f"{stage}.yaml")
    entries = list(raw.defaults)
    assert entries[0] == f"{SCHEMA_GROUP}/{stage}", f"conf/{stage}.yaml must start from its schema"
    assert "_self_" in entries
    for key in raw:
        if key == "defaults":
            continue
        value = OmegaConf.to_container(raw, resolve=False)[key]
        assert isinstance(value, str) and "${" in value, \
            f"conf/{stage}.yaml sets {key}={value!r}: put the default in eagle3/config/schema/{stage}.py"


GROUP_SCHEMAS = {"init": "InitConf", "target": "TargetConf"}  # conf/<group>/*.yaml -> eagle3/config/schema/common.py


def group_repeats(group: str) -> list[str]:
    """Keys a group file (conf/<group>/<choice>.yaml) sets to its schema's own default: a second home."""
    from eagle3.config.schema import common

    defaults = defaults_of(getattr(common, GROUP_SCHEMAS[group]))
    found = []
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if raw.get("defaults", [None])[0] != f"/{SCHEMA_GROUP}/{group}@_here_":
            found.append(f"conf/{group}/{path.name}: does not start from its schema (- /{SCHEMA_GROUP}/{group}@_here_)")
        found += [f"conf/{group}/{path.name}: {k}={v!r} is the schema's default" for k, v in raw.items()
                  if k in defaults and as_plain_dict(defaults[k]) == v]
    return found


@pytest.mark.parametrize("group", sorted(GROUP_SCHEMAS))
def test_group_files_set_only_what_differs_from_the_schema(group):
    assert sorted((CONF_DIR / group).glob("*.yaml")), group
    assert group_repeats(group) == []


def test_group_repeat_check_sees_a_repeated_default(tmp_path, monkeypatch):
    """The check above can fail: a group file that writes a default again is named."""
    (tmp_path / "init").mkdir()
    (tmp_path / "init" / "x.yaml").write_text("name: x\nnew_row_init: target_lm_head\n")
    (tmp_path / "init" / "y.yaml").write_text("defaults:\n  - /schema/init@_here_\n  - _self_\nname: y\n")
    monkeypatch.setattr(sys.modules[__name__], "CONF_DIR", tmp_path)
    assert group_repeats("init") == ["conf/init/x.yaml: does not start from its schema (- /schema/init@_here_)",
                                     "conf/init/x.yaml: new_row_init='target_lm_head' is the schema's default"]


@pytest.mark.parametrize("stage,group,choice", [(s, g, c) for s, g in (("train", "init"), ("capture", "target"))
                                                for c in sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml"))])
def test_a_group_choice_composes_to_its_file_over_the_schema(stage, group, choice, tmp_path):
    """Each group file, chosen, gives the schema's defaults except where the file says otherwise."""
    from eagle3.config.schema import common

    overrides = [f"paths.root={tmp_path}", "+init=scratch" if group != "init" else f"+init={choice}"]
    if group == "target":
        overrides.append(f"target={choice}")
    typed = getattr(to_schema(compose(stage, overrides), stage_schema(stage)), group)
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{choice}.yaml"), resolve=False)
    defaults = {k: v for k, v in defaults_of(getattr(common, GROUP_SCHEMAS[group])).items() if k not in raw}
    assert group != "init" or defaults, f"conf/init/{choice}.yaml repeats every default"
    assert mismatches(typed, defaults) == []
    plain = {k: v for k, v in raw.items() if k != "defaults" and "${" not in str(v)}
    assert {k: as_plain_dict(getattr(typed, k)) for k in plain} == plain


def test_base_group_sets_no_stage_value():
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "base" / "stage.yaml"), resolve=False)
    assert set(raw) == {"hydra"}


def test_decided_defaults():
    """The values that had drifted between YAML and schema, as decided (the run the code used)."""
    prepare = defaults_of(stage_schema("prepare"))
    assert prepare["max_length"] == 512
    knobs = [(k.num_steps, k.topk, k.num_draft_tokens) for k in defaults_of(stage_schema("eval"))["knobs"]]
    assert knobs == [(2, 1, 3), (3, 1, 4), (3, 2, 6)]
    world = defaults_of(stage_schema("mini_world"))
    assert [(t.steps, t.lr, t.warmup_steps) for t in (world["k2_train"], world["k25_train"])] == \
        [(300, 3e-3, 20), (150, 1.5e-3, 10)]


def test_an_unknown_key_added_with_plus_is_an_error(tmp_path):
    """Hydra's `+key=` adds any key: to_schema must refuse it rather than drop it."""
    cfg = compose("train", ["+init=scratch", f"paths.root={tmp_path}", "+optim.lrr=1e-3"])
    with pytest.raises(ConfigError, match="lrr"):
        to_schema(cfg, stage_schema("train"))


def test_a_misspelt_override_fails_at_compose(tmp_path):
    with pytest.raises(ConfigError, match="lrr"):
        compose("train", ["+init=scratch", f"paths.root={tmp_path}", "optim.lrr=1e-3"])


def test_a_bad_value_is_the_schemas_error_not_hydras(tmp_path):
    """The schema's defaults compose as plain values, so a value of the wrong type reaches to_schema
    (one-line ConfigError, the entry scripts' `<stage> failed:` line) instead of failing inside Hydra."""
    cfg = compose("train", ["+init=scratch", f"paths.root={tmp_path}", "optim.lr=fast"])
    with pytest.raises(ConfigError, match="optim.lr"):
        to_schema(cfg, stage_schema("train"))


def test_schemas_import_without_torch():
    """The schemas are read where torch is not needed (and the GPU image's core imports choices)."""
    code = ("import sys, importlib\n"
            f"for s in {CONVERTED!r}: importlib.import_module('eagle3.config.schema.' + s)\n"
            "import eagle3.config.choices\n"
            "assert 'torch' not in sys.modules, 'a schema imports torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def _string_tuples(path: Path):
    """Tuples/lists/sets of >= 2 string literals used as a choice list: compared with `in`, assigned,
    or given as argparse `choices=`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            cands = [c for op, c in zip(node.ops, node.comparators) if isinstance(op, (ast.In, ast.NotIn))]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            cands = [node.value]
        elif isinstance(node, ast.keyword) and node.arg == "choices":
            cands = [node.value]
        else:
            continue
        for c in cands:
            if (isinstance(c, (ast.Tuple, ast.List, ast.Set)) and len(c.elts) >= 2
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in c.elts)):
                yield frozenset(e.value for e in c.elts), c.lineno


def test_each_choice_list_is_defined_once():
    lists = {frozenset(v): name for name, v in vars(choices).items()
             if isinstance(v, tuple) and len(v) >= 2 and all(isinstance(x, str) for x in v)}
    assert len(lists) >= 10
    choices_file = Path(choices.__file__).resolve()
    copies = []
    for folder in ("eagle3", "data", "train", "eval"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            if path.resolve() == choices_file:
                continue
            copies += [f"{path.relative_to(REPO_ROOT)}:{line} repeats choices.{lists[values]}"
                       for values, line in _string_tuples(path) if values in lists]
    assert copies == []
