"""`make check`: is a drafter directory usable with a target, before a 10-minute server start or a
training run? `python train/run_check.py [drafter_dir=/path] [target=kimi_k25]`.

Reads only config files, safetensors headers and the small d2t/t2d tensors. Prints every
mismatch with what to change (ERROR = the drafter cannot be used as is; WARNING = fixed by
init/export or harmless), then exits non-zero on any ERROR (or any WARNING with
fail_on_warnings=true)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402

from eagle3 import target_io  # noqa: E402
from eagle3.conf import to_schema  # noqa: E402
from eagle3.drafter_io import Mismatch, check_drafter_dir  # noqa: E402
from eagle3.errors import stage_errors  # noqa: E402
from eagle3.manifest import MANIFEST, read_manifest  # noqa: E402
from eagle3.schema.check import CheckConfig  # noqa: E402


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


def captured_aux_ids(capture_dir: str | None) -> tuple[list[int] | None, str]:
    """The aux layer ids of a finished capture stage, or None when there is none yet."""
    if not capture_dir or not (Path(capture_dir) / MANIFEST).is_file():
        return None, "no finished capture: aux ids not compared with captured ones"
    ids = read_manifest(Path(capture_dir), "capture").get("aux_layer_ids")
    return ([int(i) for i in ids] if ids is not None else None), f"capture {capture_dir}: aux_layer_ids {ids}"


def run_check(config: CheckConfig) -> CheckResult:
    t = config.target
    text = target_io.read_text_config(t.path, t.layout)  # a missing/odd target raises TargetError
    captured, capture_note = captured_aux_ids(config.capture_dir)
    cfg, mismatches = check_drafter_dir(config.drafter_dir, text, captured)
    info = [f"target: {t.layout}, {text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
            f"vocab {text['vocab_size']}, context {text['max_position_embeddings']}", capture_note]
    if cfg is not None:
        info.append(f"drafter: hidden {cfg.hidden_size}, draft vocab {cfg.draft_vocab_size}, aux ids "
                    f"{cfg.aux_layer_ids}, rope_theta {cfg.rope_theta}, rope_scaling {cfg.rope_scaling}, "
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
    main()
