"""Every primary config composes with every target and init choice, and validates against
its typed schema."""
from pathlib import Path

import pytest

from eagle3.config.conf import CONF_DIR, ConfigError, compose, stage_schema, to_schema
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf

STAGES = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
# Stages with no target or init (the mini world, and the demo and study that pick them themselves).
TARGETLESS = {"mini_world", "demo", "study", "learning_ab"}
TARGETED = [s for s in STAGES if s not in TARGETLESS]
TARGETS = sorted(p.stem for p in (CONF_DIR / "target").glob("*.yaml"))
INITS = sorted(p.stem for p in (CONF_DIR / "init").glob("*.yaml"))
CPU_K2_DRAFTER_STEPS = 160  # conf/demo_size/cpu.yaml (measured: BENCHMARKS.md, "The CPU world's traffic")


def test_config_tree_has_required_choices():
    assert {"k2_mini", "k25_mini", "kimi_k25"} <= set(TARGETS)
    assert {"aqmedai_k2", "scratch"} <= set(INITS)
    assert {"mini_world", "prepare", "capture", "vocab", "train", "eval", "export"} <= set(STAGES)


@pytest.mark.parametrize("stage", TARGETED)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("init", INITS)
def test_every_stage_target_init_composes(stage, target, init, tmp_path):
    cfg = compose(stage, [f"+init={init}", f"paths.root={tmp_path}", f"target={target}"])
    paths = to_schema(cfg.paths, PathsConf)
    assert Path(paths.root) == tmp_path
    for value in (paths.mini_world, paths.stages):
        assert Path(value).is_relative_to(tmp_path)
    assert to_schema(cfg.target, TargetConf).name == target
    assert to_schema(cfg.init, InitConf).name == init
    typed = to_schema(cfg, stage_schema(stage))
    assert typed is not None


def test_the_k2_drafter_step_budget_per_demo_size(tmp_path):
    """The cpu demo trains the K2 drafter longer than the K2.5 drafters (BENCHMARKS.md, "The CPU world's
    traffic"); the ci and gpu sizes keep one budget for every drafter, as before the key existed."""
    typed = {size: to_schema(compose("demo", [f"paths.root={tmp_path}", f"demo_size={size}"]), stage_schema("demo"))
             for size in ("cpu", "ci", "gpu")}
    assert {s: (t.train_steps, t.k2_drafter_steps) for s, t in typed.items()} == \
        {"cpu": (40, CPU_K2_DRAFTER_STEPS), "ci": (8, 8), "gpu": (500, 500)}
    for stage in ("demo", "study", "learning_ab"):
        with pytest.raises(ConfigError, match="k2_drafter_steps=0"):
            to_schema(compose(stage, [f"paths.root={tmp_path}", "k2_drafter_steps=0"]), stage_schema(stage))


def test_mini_world_config_composes(tmp_path):
    cfg = compose("mini_world", [f"paths.root={tmp_path}"])
    typed = to_schema(cfg, stage_schema("mini_world"))
    assert Path(typed.out_dir) == tmp_path / "mini_world"


@pytest.mark.parametrize("size", sorted(p.stem for p in (CONF_DIR / "demo_size").glob("*.yaml")))
def test_demo_config_composes_for_every_size(size, tmp_path):
    cfg = compose("demo", [f"paths.root={tmp_path}", f"demo_size={size}"])
    typed = to_schema(cfg, stage_schema("demo"))
    assert typed.train_steps > 0 and Path(typed.out_dir).is_relative_to(tmp_path)
    # every per-stage override of the preset must compose into that stage's typed config
    for stage in ("prepare", "capture", "vocab", "train", "eval", "export"):
        extra = ["+init=scratch"] if stage in ("train", "export", "eval") else []
        stage_cfg = compose(stage, [f"paths.root={tmp_path}"] + extra + list(getattr(typed.overrides, stage)))
        to_schema(stage_cfg, stage_schema(stage))
    k25 = compose("prepare", [f"paths.root={tmp_path}"] + list(typed.overrides.prepare) + list(typed.overrides.prepare_k25))
    to_schema(k25, stage_schema("prepare"))
    mw = compose("mini_world", [f"paths.root={tmp_path}"] + list(typed.overrides.mini_world))
    to_schema(mw, stage_schema("mini_world"))


def test_default_root_is_the_checkout_not_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EAGLE3_ROOT", raising=False)
    cfg = compose("prepare")
    from eagle3 import REPO_ROOT

    assert Path(cfg.paths.root) == REPO_ROOT / "runs"
    assert cfg.target.name == "k25_mini"  # the embedded default


def test_bad_target_layout_is_rejected(tmp_path):
    cfg = compose("prepare", [f"paths.root={tmp_path}", "target.layout=onnx"])
    with pytest.raises(ConfigError, match="target.layout"):
        to_schema(cfg.target, TargetConf)


def test_unknown_key_is_rejected(tmp_path):
    cfg = compose("prepare", [f"paths.root={tmp_path}", "+target.pathh=/x"])
    with pytest.raises(ConfigError, match="pathh"):
        to_schema(cfg.target, TargetConf)
