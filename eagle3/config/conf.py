"""Config plumbing shared by every stage: the `repo_root` resolver, the stage schemas as Hydra's
base configs, composing a stage's primary config (for tests and the demo), and turning a DictConfig
into its typed schema; the config as a manifest records it (as_plain_dict, as_recorded) and the reuse
rule's comparison of a recorded one with today's (differing_keys).

One source of defaults: a stage's typed schema (eagle3/config/schema/<stage>.py) is stored in Hydra's
ConfigStore as `schema/<stage>`, and `conf/<stage>.yaml` names it first in its defaults list, so the
composed config starts from the dataclass defaults; the YAML adds only the config groups (paths,
target, init, demo_size, ...) and the paths that derive from them. tests/test_config_defaults.py
keeps it so.

Imports hydra/omegaconf, so only entry points and stage code use it; the core math does not.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from eagle3 import REPO_ROOT
from eagle3.errors import StageError, one_line

CONF_DIR = REPO_ROOT / "conf"
T = TypeVar("T")

if not OmegaConf.has_resolver("repo_root"):
    OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))


def stage_dir(name: str, *, _root_) -> str:
    """The one stage-path rule: `${stage_dir:capture}` = <paths.stages>/<target.name>/capture."""
    return f"{_root_.paths.stages}/{_root_.target.name}/{name}"


if not OmegaConf.has_resolver("stage_dir"):
    OmegaConf.register_new_resolver("stage_dir", stage_dir)


class ConfigError(StageError, ValueError):
    """A configuration that cannot be used, with the reason in the message (one line)."""


def check_choice(name: str, value, choices: tuple) -> None:
    """The schemas' one choice check: ConfigError "<name>=<value>: expected one of <choices>"."""
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {choices}")


SCHEMA_GROUP = "schema"  # conf/<stage>.yaml's first default: `- schema/<stage>`
_STAGE_SCHEMAS: dict[str, type] = {}


def register_stage(stage: str, schema: type) -> None:
    """Make the dataclass `schema`'s defaults the base of `conf/<stage>.yaml` (ConfigStore
    `schema/<stage>`, at the config's root). Each schema module calls it when imported; entry scripts
    import their schema before `@hydra.main` composes, and `compose` imports it by the stage's name.

    Stored as plain values ("???" where a field has no default), not as the dataclass: a typed
    composition would make Hydra refuse a bad value (`seed=abc`) before the entry script runs, with
    its own multi-line message, where `to_schema` reports it as the stage's one-line ConfigError."""
    from hydra.core.config_store import ConfigStore

    _STAGE_SCHEMAS[stage] = schema
    defaults = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
    ConfigStore.instance().store(group=SCHEMA_GROUP, name=stage, node=defaults, package="_global_")


def register_group(group: str, schema: type) -> None:
    """Make the dataclass `schema`'s defaults the base of every `conf/<group>/<choice>.yaml` (ConfigStore
    `schema/<group>`, which each such file lists first: `- /schema/<group>@_here_`), so a choice file
    writes only what differs from the schema and every field stays overridable (`target.device_map=auto`)."""
    from hydra.core.config_store import ConfigStore

    defaults = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
    ConfigStore.instance().store(group=SCHEMA_GROUP, name=group, node=defaults)


def _import_schema(stage: str) -> None:
    """Import eagle3/config/schema/<stage>.py (registering its schema), if there is one."""
    module = f"eagle3.config.schema.{stage}"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise


def stage_schema(stage: str) -> type:
    """The typed schema of a stage: registered by eagle3/config/schema/<stage>.py."""
    _import_schema(stage)
    if stage not in _STAGE_SCHEMAS:
        raise ConfigError(f"no config schema for stage {stage!r} (eagle3/config/schema/{stage}.py registers none)")
    return _STAGE_SCHEMAS[stage]


def to_schema(cfg: DictConfig | dict, schema: type[T]) -> T:
    """Validate `cfg` against the dataclass `schema` (types, unknown or missing keys) and
    return the typed, fully resolved object."""
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        obj = OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf raises many types; all mean "bad config"
        raise ConfigError(f"invalid {schema.__name__} config: {one_line(e)}{_group_hint(e)}") from e
    _validate_tree(obj)
    return obj  # type: ignore[return-value]


def _group_hint(e: Exception) -> str:
    """For an interpolation into a config group that was not chosen (`${init.name}` without
    `+init=...`), the choices the command line can add."""
    import re

    m = re.search(r"Interpolation key '(\w+)[.\w]*' not found", str(e))
    options = sorted(p.stem for p in (CONF_DIR / m.group(1)).glob("*.yaml")) if m else []
    return f" (no {m.group(1)} chosen: add +{m.group(1)}=<{'|'.join(options)}>)" if options else ""


def _validate_tree(obj: Any) -> None:
    """Call `validate()` on every dataclass in the tree, children first."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        _validate_tree(getattr(obj, f.name))
    post = getattr(obj, "validate", None)
    if callable(post):
        post()


def compose(stage: str, overrides: list[str] | None = None) -> DictConfig:
    """Compose `conf/<stage>.yaml` with overrides, as `@hydra.main` would (used by tests/demo).
    A bad override (unknown key, unparsable value, missing config group) is a ConfigError."""
    _import_schema(stage)  # its base config (schema/<stage>) must be in the ConfigStore before Hydra reads the YAML
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        if GlobalHydra.instance().is_initialized():
            # Inside a running Hydra app (the demo): its search path is this same conf/ tree.
            cfg = hydra_compose(config_name=stage, overrides=list(overrides or []))
        else:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None, job_name=stage):
                cfg = hydra_compose(config_name=stage, overrides=list(overrides or []))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        cause = f" ({one_line(e.__cause__)})" if e.__cause__ is not None else ""
        raise ConfigError(f"cannot compose conf/{stage}.yaml with overrides {list(overrides or [])}: "
                          f"{one_line(e)}{cause}") from e
    return cfg


def as_plain_dict(obj: Any) -> Any:
    """Dataclass/DictConfig -> JSON-friendly dict (for manifests)."""
    if dataclasses.is_dataclass(obj):
        return {k: as_plain_dict(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, DictConfig):
        return OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, dict):
        return {k: as_plain_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_plain_dict(v) for v in obj]
    return obj


def as_recorded(value: Any) -> Any:
    """`value` as a manifest records it (as_plain_dict, then JSON: tuples become lists, paths strings)."""
    return json.loads(json.dumps(as_plain_dict(value), default=str))


def differing_keys(expected: dict[str, Any], recorded: dict) -> list[str]:
    """The reuse rule's comparison (eagle3/formats/manifest.py stale_keys, eagle3/stage_dir.py StageDir.reused):
    the keys of `expected` (e.g. {"config": cfg, "fingerprints": {...}}) that the manifest `recorded` does not
    record as they are today, one level deep ("config.lr", "fingerprints.target"); [] when it records them all."""
    out = []
    for key, source in expected.items():
        want, have = as_recorded(source), recorded.get(key)
        if _same(source, want, have):
            continue
        if isinstance(want, dict) and isinstance(have, dict):
            out += [f"{key}.{k}" for k in sorted(set(want) | set(have), key=str)
                    if not (k in want and _same_field(source, k, want[k], have))]
        else:
            out.append(key)
    return out


def _same(source: Any, want: Any, have: Any) -> bool:
    """`want` (the recorded form of `source`) matches `have`, where a setting added to a config dataclass after
    `have` was written counts as the same when it holds its declared default: an upgrade that adds a knob
    reuses the stage directories written before it."""
    if want == have:
        return True
    if not (isinstance(want, dict) and isinstance(have, dict)) or set(have) - set(want):
        return False
    return all(_same_field(source, k, v, have) for k, v in want.items())


def _same_field(source: Any, key: str, want: Any, have: dict) -> bool:
    sub = getattr(source, key, None) if dataclasses.is_dataclass(source) else None
    if key in have:
        return _same(sub, want, have[key])
    default = _declared_default(source, key)
    return default is not dataclasses.MISSING and as_recorded(default) == want


def _declared_default(source: Any, key: str) -> Any:
    """The default a config dataclass declares for field `key` (MISSING: none, or not a dataclass field)."""
    if not dataclasses.is_dataclass(source):
        return dataclasses.MISSING
    f = next((f for f in dataclasses.fields(source) if f.name == key), None)
    if f is None:
        return dataclasses.MISSING
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING
