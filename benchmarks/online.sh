#!/usr/bin/env bash
# Issue 43's learning A/B and throughput bench on a mini world: SIZE=gpu (default; the lent GPU, in calls on one
# warm machine: finished stages are reused between calls) or SIZE=cpu (this machine, the CPU demo's world).
#   PHASE=world  the mini world and its K2.5 prepare / capture / vocab (pipeline/demo.build_experiment)
#   PHASE=ab     the learning A/B: offline K epochs against windows of W sequences each trained K times (what a
#                stream trains), K chosen so that both arms see about BUDGET steps (the size's train_steps)
#   PHASE=bench  benchmarks/bench_stream.py at that world's size: producer alone, trainer alone, both together
#   PHASE=quick  one call: the world's shapes with its targets and the K2 drafter trained a few steps only
#                (throughput does not depend on the weights), then PHASE=bench once for each of REUSE (a list,
#                default 8): more reuse makes the trainer the slower side, and its start-up a smaller share
# SIZE=gpu needs .whl/ (the wheels the GPU image lacks) and .data_carry/sharegpt.json.xz carried; logs go to $OUT.
set -uo pipefail
SIZE=${SIZE:-gpu}
if [ "$SIZE" = gpu ]; then
  source "$(dirname "$0")/device_setup.sh"  # wheels, ShareGPT, $OUT, the GPU name
  PY=${PY:-python3}; SRC=("+mini_world.source=$PWD/runs/sharegpt.json"); DEV=(target.device_map=cuda)
  W=${W:-128}; BUDGET=${BUDGET:-500}
else
  OUT=${OUT:-runs/online-$SIZE}; mkdir -p "$OUT"; PY=${PY:-.venv/bin/python}; SRC=(); DEV=()
  W=${W:-64}; BUDGET=${BUDGET:-40}
fi
ROOT=$PWD/runs/online-world-$SIZE
WORLD=(demo_size=$SIZE "paths.root=$ROOT" "${SRC[@]}" wandb.mode=disabled)
LIMIT=${LIMIT:-540}

# K (epochs = passes per window) and the step budget both arms finish within, from the world's own store
plan() {
  $PY - "$W" "$BUDGET" "${WORLD[@]}" <<'EOF'
import json, sys
from eagle3.config.conf import compose, to_schema
from eagle3.config.schema.learning_ab import LearningABConfig
from eagle3.config.schema.train import TrainConfig
from train.inputs import open_inputs
from train.spool_source import make_stream
from train.trainer import stream_items, total_steps
W, budget = int(sys.argv[1]), int(sys.argv[2])
ab = to_schema(compose("learning_ab", sys.argv[3:]), LearningABConfig)
base = [f"paths.root={ab.paths.root}", "target=k25_mini", "+init=scratch", *ab.overrides.train, "max_steps=1000000"]
def steps(extra):
    cfg = to_schema(compose("train", base + extra), TrainConfig)
    inputs = open_inputs(cfg)
    return total_steps(cfg, make_stream(cfg, stream_items(cfg, inputs), 0, 1))[0]
per_epoch = steps(["epochs=1"])
k = max(1, budget // per_epoch)
windows = steps(["data.order=windows", f"data.window_sequences={W}", f"data.reuse={k}"])
t = max(k * per_epoch, windows)
print(json.dumps({"per_epoch": per_epoch, "k": k, "epochs_steps": k * per_epoch, "windows_steps": windows,
                  "train_steps": t + (-t) % 4}))
EOF
}

# the mini world and the K2.5 side up to training; CUT=1: every training cut to a few steps (the cut keys
# replace the size's own), for PHASE=quick
build_world() {
  CUT=${CUT:-0} timeout "$LIMIT" $PY - "${WORLD[@]}" "$@" <<'EOF' 2>&1 | tee -a "$OUT/world.log"
import os, sys
from eagle3.config.conf import compose, to_schema
from eagle3.config.schema.learning_ab import LearningABConfig
from pipeline.demo import build_experiment, stage_log
cfg = to_schema(compose("learning_ab", sys.argv[1:]), LearningABConfig)
if os.environ["CUT"] == "1":
    cut = {"k2_train.steps": 30, "k25_train.steps": 30, "vision.train.steps": 10}
    cfg.overrides.mini_world = [o for o in cfg.overrides.mini_world if o.split("=")[0] not in cut] + [
        f"{k}={v}" for k, v in cut.items()]
build_experiment(cfg, stage_log(cfg, "learning-ab"), cfg.world_seed)
EOF
}

bench() {
  timeout "$LIMIT" $PY benchmarks/bench_stream.py --work /tmp/bench_stream-r$1 --json "$OUT/bench_stream-reuse$1.json" \
      --cap-fraction "${CAP:-0.25}" --window "$W" --reuse "$1" --chunk "${CHUNK:-32}" --warm-trainer \
      --capture "paths.root=$ROOT" target=k25_mini +init=aqmedai_k2 "${DEV[@]}" \
      --train "paths.root=$ROOT" target=k25_mini +init=scratch max_steps=1000000 epochs=null optim.lr=5e-4 \
          optim.warmup_steps=50 checkpoint_every=1000000 val_every=0 wandb.mode=disabled \
      2>&1 | tee -a "$OUT/bench.log"
  mkdir -p "$OUT/reuse$1" && cp /tmp/bench_stream-r$1/*.log "$OUT/reuse$1/" 2>/dev/null
}

case "${PHASE:-world}" in
quick)
  T0=$(date +%s); CUT=1 build_world train_steps=20 || exit 1; LIMIT=$((LIMIT - $(date +%s) + T0)); T0=$(date +%s); echo "bench limit ${LIMIT}s"
  for r in ${REUSE:-8}; do bench "$r"; LIMIT=$((LIMIT - $(date +%s) + T0)); T0=$(date +%s); done ;;
world)
  build_world || exit 1
  plan | tee "$OUT/plan.json" ;;
ab)
  plan > "$OUT/plan.json" || exit 1; cat "$OUT/plan.json"
  K=$(python3 -c "import json;print(json.load(open('$OUT/plan.json'))['k'])")
  T=$(python3 -c "import json;print(json.load(open('$OUT/plan.json'))['train_steps'])")
  timeout "$LIMIT" $PY pipeline/run_learning_ab.py "${WORLD[@]}" 'seeds=[0,1,2]' curve.max_sequences=32 \
      "train_steps=$T" "out_dir=$ROOT/learning_ab_online" "stage_dir=$ROOT/stages/k25_mini/learning_ab_online" \
      "arms=[{name:epochs,train:['epochs=$K']},{name:windows,train:['data.order=windows','data.window_sequences=$W','data.reuse=$K']}]" \
      2>&1 | tee -a "$OUT/ab.log"
  tar czf "$OUT/ab_report.tgz" -C "$ROOT" learning_ab_online 2>/dev/null ;;
bench)
  bench "${REUSE:-$(plan | python3 -c "import json,sys;print(json.load(sys.stdin)['k'])")}" ;;
esac
