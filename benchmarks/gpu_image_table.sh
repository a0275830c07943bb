#!/usr/bin/env bash
# Issue 44 part 4 on the lent GPU: the GPU demo world (text vs image tau, the 2x2 convention grid) and the image-rows
# probe on its from-K2 run. Run it twice while the machine stays warm: finished stages are reused, so the second
# call picks up where the 540 s limit cut the first. Needs .whl/ (the wheels the GPU image lacks) and
# .data_carry/sharegpt.json.xz carried; logs and reports go to $OUT.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"  # wheels, ShareGPT, $OUT, the GPU name
LIMIT=${LIMIT:-540}
timeout "$LIMIT" python3 pipeline/run_demo.py demo_size=gpu paths.root=$PWD/runs/gpu \
    +mini_world.source=$PWD/runs/sharegpt.json +eval.real_loop.num_prompts=4 2>&1 | tee -a "$OUT/demo.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ] && [ "${PROBE:-1}" = 1 ]; then
  python3 benchmarks/image_rows_probe.py --train-dir runs/gpu/stages/k25_mini/train-aqmedai_k2 --steps 500 \
      --out runs/gpu/probe --json "$OUT/probe.jsonl" 2>&1 | tee -a "$OUT/probe.log"
fi
find runs/gpu -name 'report.json' -size -4M -o -name '*.md' -size -4M | tar czf "$OUT/reports.tgz" -T - 2>/dev/null
echo "demo rc=$rc"
