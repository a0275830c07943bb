"""Entry point of the capture stage: `python data/run_capture.py [overrides]` (`make capture-hidden`).

Runs the target over the prepared dataset and writes per split a hidden-state store.
  +init=aqmedai_k2        take the aux states from that drafter's eagle_config ids, read by
                          init.aux_id_rule (sglang = current SGLang | sglang_legacy | vllm)
  aux_hf_indices=[2,30,58] or name the HF hidden-state indices h directly (null: SGLang's default)
  accelerate launch --num_processes N data/run_capture.py ...   one slice per process, merged by rank 0
  stream.enabled=true stream.max_gb=200   online: validation offline, then the train split into a capped
                          spool that `train/run.py data.source=stream` reads while this runs (data/stream_capture.py)
"""

import hydra

from data.capture import run_capture
from data.stream_capture import run_stream_capture
from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.capture import CaptureConfig


@hydra.main(config_path="../conf", config_name="capture", version_base=None)
def main(cfg) -> None:
    with stage_errors("capture"):
        cfg = to_schema(cfg, CaptureConfig)
        (run_stream_capture if cfg.stream.enabled else run_capture)(cfg)


if __name__ == "__main__":
    run_main("capture", main)
