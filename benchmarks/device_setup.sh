# Sourced by the benchmarks/*.sh scripts run on the lent GPU machine: the wheels its image lacks (.whl/, carried)
# on PYTHONPATH, ShareGPT unpacked from .data_carry/sharegpt.json.xz, $OUT made, and the GPU's name recorded.
OUT=${OUT:-runs/gpu-out}; mkdir -p "$OUT" runs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
[ -f runs/sharegpt.json ] || xz -dc .data_carry/sharegpt.json.xz > runs/sharegpt.json
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/gpu.txt"
