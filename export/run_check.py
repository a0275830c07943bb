"""`make check`: is a drafter directory usable with a target, before a 10-minute server start or a
training run? `python export/run_check.py [drafter_dir=/path] [target=kimi_k25]`.

Reads only config files, safetensors headers and the small d2t/t2d tensors. Prints every
mismatch with what to change (ERROR = the drafter cannot be used as is; WARNING = fixed by
init/export or harmless), then exits non-zero on any ERROR (or any WARNING with
fail_on_warnings=true)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra

from eagle3.engines import aux_layers
from eagle3.target_model import target_io
from eagle3.config.conf import to_schema
from eagle3.drafter.drafter_io import Mismatch, check_drafter_dir, listed_aux_ids
from eagle3.errors import run_main, stage_errors
from eagle3.formats.manifest import MANIFEST, read_manifest
from eagle3.config.schema.check import CheckConfig


@dataclass
class CheckResult:
    drafter_dir: str
    target: str
    mismatches: list[Mismatch]
    info: list[str] = field(default_factory=list)

    @property
    def fatal(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.fatal]

    @property
    def warnings(self) -> list[Mismatch]:
        return [m for m in self.mismatches if not m.fatal]

    def ok(self, fail_on_warnings: bool = False) -> bool:
        return not self.fatal and not (fail_on_warnings and self.warnings)

    def lines(self) -> list[str]:
        head = [f"drafter {self.drafter_dir}", f"target  {self.target}"] + [f"  {i}" for i in self.info]
        verdict = (f"FAIL: {len(self.fatal)} error(s), {len(self.warnings)} warning(s)" if self.fatal
                   else f"OK: compatible ({len(self.warnings)} warning(s))")
        return head + [str(m) for m in self.mismatches] + [verdict]


def captured_hf_indices(capture_dir: str | None) -> tuple[list[int] | None, str]:
    """The hidden-state indices h of a finished capture stage, or None when there is none yet."""
    if not capture_dir or not (Path(capture_dir) / MANIFEST).is_file():
        return None, "no finished capture: the drafter's h not compared with captured ones"
    h = read_manifest(Path(capture_dir), "capture").get("hf_indices")
    return ([int(i) for i in h] if h is not None else None), f"capture {capture_dir}: hidden states h = {h}"


def aux_layer_lines(config: dict, num_layers: int, rule: str) -> tuple[list[str], list[Mismatch]]:
    """What a capture for this drafter takes, under `rule`, and a warning when SGLang's versions read its
    ids differently (a config listing ids whose first is not 1)."""
    ids = listed_aux_ids(config)
    if ids is None:
        h = aux_layers.sglang_default_hf_indices(num_layers)
        return [f"aux layers: no ids listed; capture and SGLang take the default h = {h}"], []
    r = aux_layers.readings(ids)
    lines = [f"aux layers: config lists ids {ids}; capture takes h = {r[rule]} (rule {rule!r}); readings: "
             + ", ".join(f"{k} h = {v}" for k, v in r.items())]
    note = aux_layers.disagreement_note(ids, rule, "drafter config")
    warn = [Mismatch("eagle_aux_hidden_state_layer_ids", note, "export rewrites the ids in the form every SGLang "
                     "version reads alike where one exists; serve with SGLang >= PR #25454 otherwise", fatal=False)
            ] if note else []
    return lines, warn


def run_check(config: CheckConfig) -> CheckResult:
    t = config.target
    text = target_io.read_text_config(t.path, t.layout)  # a missing/odd target raises TargetError
    captured, capture_note = captured_hf_indices(config.capture_dir)
    # the ids' readings are reported once, by aux_layer_lines below (not also as read_drafter_dir's log warning)
    read, mismatches = check_drafter_dir(config.drafter_dir, text, captured, id_rule=config.aux_id_rule,
                                         report_aux=False)
    info = [f"target: {t.layout}, {text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
            f"vocab {text['vocab_size']}, context {text['max_position_embeddings']}", capture_note]
    if read is not None:
        cfg = read.config
        lines, warn = aux_layer_lines(read.config_dict, int(text["num_hidden_layers"]), config.aux_id_rule)
        info += lines
        mismatches = mismatches + warn
        info.append(f"drafter: hidden {cfg.hidden_size}, draft vocab {cfg.draft_vocab_size}, aux h "
                    f"{cfg.aux_hf_indices}, rope_theta {cfg.rope_theta}, rope_scaling {cfg.rope_scaling}, "
                    f"max_position {cfg.max_position_embeddings}")
    return CheckResult(str(config.drafter_dir), f"{t.name} ({t.path})", mismatches, info)


@hydra.main(config_path="../conf", config_name="check", version_base=None)
def main(cfg) -> None:
    with stage_errors("check"):
        config = to_schema(cfg, CheckConfig)
        result = run_check(config)
    print("\n".join(result.lines()))
    if not result.ok(config.fail_on_warnings):
        sys.exit(1)


if __name__ == "__main__":
    run_main("check", main)
