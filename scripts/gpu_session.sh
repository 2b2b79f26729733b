#!/usr/bin/env bash
# One device-machine session: GPU tests, a generated Qwen3-30B-A3B-shaped Q4_K_M model, routing, benches.
# Usage (on the GPU machine, wheels carried in .whl): bash scripts/gpu_session.sh [tests|model|bench|all|qwen35]
# At most 8 files come back from $OUT: keep appending to the ones below.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
MS="python3 -m moestream.cli"
MODEL=/tmp/qwen3-30b-a3b-Q4_K_M.gguf
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %H %cd' | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
fi
if [[ $what == model || $what == bench || $what == all ]]; then
  /usr/bin/time -f "make-model: %e s, max RSS %M KB" $MS make-model $MODEL --preset qwen3-30b-a3b --quant Q4_K_M \
    2>&1 | grep -v '\r' | tail -3 | tee "$OUT/model.txt"
  $MS info $MODEL --routing --tokens 2048 2>&1 | grep -v '%|' | tee -a "$OUT/model.txt" | tail -60
fi
if [[ $what == bench || $what == all ]]; then
  $MS probe -m $MODEL -p 2048 -ub 2048 -ncmoe 26 2>&1 | tee -a "$OUT/gpu.txt"
  B="$MS bench -m $MODEL -ncmoe 26 -r 3"
  $B -p 512 -ub 512 --stream serial,pinned,overlap,layer-major --streamed-layers first,spread \
    --vram-budget 12GiB 2>&1 | grep -v '%|' | tee -a "$OUT/bench.txt"
  $B -p 2048 -n 64 -ub 2048 --stream serial,pinned,overlap,layer-major --streamed-layers first,spread \
    --vram-budget 12GiB 2>&1 | grep -v '%|' | tee -a "$OUT/bench.txt"
  $B -p 8192,16384 -ub 2048 --stream overlap,layer-major -r 2 2>&1 | grep -v '%|' | tee -a "$OUT/bench.txt"
  $MS profile -m $MODEL -p 2048 -ub 2048 -ncmoe 26 --vram-budget 12GiB --stream serial,overlap,layer-major \
    --trace "$OUT/trace_pp2048.json" --plot "$OUT/timeline_pp2048.png" 2>&1 \
    | grep -v '%|' | tee "$OUT/profile.txt"
fi
if [[ $what == qwen35 ]]; then  # the headline configuration of issue 5: Qwen3.6-35B-A3B shapes, 12 GiB card
  Q35=/tmp/qwen3.6-35b-a3b-Q4_K_M.gguf
  /usr/bin/time -f "make-model: %e s" $MS make-model $Q35 --preset qwen3.6-35b-a3b --quant Q4_K_M 2>&1 \
    | grep -v '\r' | tail -2 | tee "$OUT/model35.txt"
  $MS info $Q35 --routing --tokens 2048 2>&1 | grep -v '%|' | tee -a "$OUT/model35.txt" | tail -45
  $MS bench -m $Q35 -ncmoe 26 -r 3 -p 2048 -ub 2048 --stream serial,pinned,overlap,layer-major \
    --streamed-layers first,spread --vram-budget 12GiB 2>&1 | grep -v '%|' | tee "$OUT/bench35.txt"
fi

