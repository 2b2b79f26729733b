#!/usr/bin/env bash
# One device-machine call: any of the steps below, in order. Wheels are carried in .whl (no network there).
# Usage (on the GPU machine): bash scripts/gpu_session.sh STEP... with STEP one of
#   tests    pytest -m gpu (without fla's kernels: `fla` runs those, ~100 s of autotuning; tests/serving/test_app.py
#            needs httpx2/openai, which the GPU image lacks)
#   types    each tensor type's decode matvec and picked-expert launch beside Q4_K's (scripts/type_rates.py)
#   quick    the matvec, fused-kernel, decode-attention and decode GPU tests alone (~2 min)
#   model    generate the qwen3-30b-a3b Q4_K_M model (skipped when a warm machine still has it) + routing
#   pp512 pp2048 long profile decode decodediag prefetch cachediag cpuexp alloc   issue-3/4/10 benches on it
#   trees    tg128 resident on the slice (or $TREE_MODEL) for each worktree in $TREES and this tree (side by side,
#            $ROUNDS rounds, 3, the order turning each round)
#   settings tg128 resident on $TREE_MODEL ($MODEL) under each of $SETTINGS (';'-separated lists of kernel
#            tuning fields for with_settings.py, e.g. 'warps=2 unrolled=0', '-' for the defaults), each its own process, $ROUNDS rounds, order turning;
#            a process's first use of a setting compiles its kernels (one block a tile: ~40 s a fused projection)
#   ncu      Nsight Compute on one layer's decode matvec launches of the 8-layer slice (occupancy, registers,
#            DRAM rate, issue rate): $OUT/ncu.txt
#   shapes   each quantized decode kernel of the 8-layer slice alone, per tile setting (matvec_shapes.py)
#   small    an 8-layer slice of the benchmark model ($SMALL_PRESET to slice another preset): decode_diag.py (tile settings, kernel table) + cpuexp
#   loadtest the server load test (issue 13) with the benchmark model (batched, then each sequence alone),
#            serving wheels from .whl/serve
#   compare  issues 32/33: $COMPARE models (preset:recipe:streamed:budget) generated, moestream and llama-bench
#            pp2048 + tg128 resident and streamed, each deleted after
#   context  issue 36: pp16384 and pp32768 at -ncmoe auto --vram-budget 12GiB, tg128 at -d 8192,32768 (-ncmoe 0,26)
#   ctxllama llama-bench's same rows on the same file (-lm none for the prompts; needs lbuild)
#   lbuild llamacpp   build llama.cpp's llama-bench (background) / wait and run tg128 at -ncmoe 0,26 on each
#            benchmark model generated so far (qwen3-30b, and qwen3.6-35b after decode35 or qwen35)
#   model35  generate the qwen3.6-35b-a3b model alone
#   routing  issue 34: qwen3-30b-a3b made with --routing trained; info --routing on the shipped English text, then
#            tg128 teacher-forced over that text at -ncmoe 26 spread 12 GiB: auto, and gather (prefetch x cache) as json
#            for each --cache-policy
#   qwen35 routing35   the issue-5 headline table (generates the qwen3.6-35b-a3b model first), its routing
#   decode35 tg128 of that model: resident, and -ncmoe 26 spread 12 GiB: auto, gather (prefetch x cache), upload, cpu
#   autopair auto against gather + prefetch 8 + cache auto (what auto picks), alternating processes ($AUTO_MODEL)
#   speed    issue 31's before/after: the tree $BEFORE (a worktree inside this one, carried) and this one, alternating
#            processes, $ROUNDS rounds (2): tg128 -ncmoe 0, then pp2048 + tg128 at -ncmoe 26 spread 12 GiB (auto), on
#            $SPEED_MODEL ($MODEL, generated first; $Q35 with SPEED_PRESET=qwen3.6-35b-a3b)
#   kvtypes  issue 36: the KV-type GPU tests, then tg128 at depths 0..32768 for bf16, f16, q8_0 and q4_0 caches on
#            the benchmark model (scripts/depth_sweep.py), resident and at -ncmoe 26 spread 12 GiB
# At most 8 files come back from $OUT: keep appending to the ones below.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
MS="python3 -m moestream.cli"
MODEL=/tmp/qwen3-30b-a3b-Q4_K_M.gguf
Q35=/tmp/qwen3.6-35b-a3b-Q4_K_M.gguf
SMALL_PRESET=${SMALL_PRESET:-qwen3-30b-a3b}  # small: which preset to slice
SMALL=/tmp/$SMALL_PRESET-8layers-Q4_K_M.gguf
quiet() { grep --line-buffered -v -e '%|' -e $'\r'; }  # drop progress bars
make_small() { [[ -f $SMALL ]] || $MS make-model $SMALL --preset $SMALL_PRESET --layers 8 --quant Q4_K_M 2>&1 | quiet | tail -1; }
make_model() {  # make_model PATH PRESET [make-model flags]
  [[ -f $1 ]] && { echo "reusing $1"; return; }
  /usr/bin/time -f "make-model: %e s, max RSS %M KB" $MS make-model "$1" --preset "$2" --quant Q4_K_M "${@:3}" 2>&1 \
    | quiet | tail -3
}
TRAINED=/tmp/qwen3-30b-a3b-trained-Q4_K_M.gguf
TEXT=moestream/tools/data/english.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %H %cd' 2>/dev/null; date -u; } | tee -a "$OUT/gpu.txt"
wait_build() {  # lbuild's end; false where this machine never ran lbuild (a fresh machine)
  [[ -f /tmp/lcpp.log ]] || { echo "no llama.cpp build here: run lbuild first"; return 1; }
  until grep -q "build rc" /tmp/lcpp.log; do sleep 5; done; grep -q "build rc 0" /tmp/lcpp.log; }
B="$MS bench -m $MODEL -ncmoe 26 -r 3"
for step in "$@"; do
  echo "== $step $(date -u +%T)" | tee -a "$OUT/gpu.txt"
  case $step in
    tests) python3 -m pytest -m gpu -q -p no:cacheprovider tests --deselect tests/ops/test_delta_rule_gpu.py \
             --ignore tests/serving/test_app.py 2>&1 \
             | tee -a "$OUT/gpu_tests.txt" | tail -25 ;;
    types) python3 scripts/type_rates.py 2>&1 | tee -a "$OUT/bench.txt" ;;  # issue 32: each type's decode kernels
    kvtypes) python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_kv_quant.py \
               tests/kernels/test_decode_attention.py tests/runtime/test_kv_types_gpu.py 2>&1 \
               | tee -a "$OUT/gpu_tests.txt" | tail -4
             make_model $MODEL qwen3-30b-a3b
             for placed in "-ncmoe 0" "-ncmoe 26 --streamed-layers spread --vram-budget 12GiB"; do
               python3 scripts/depth_sweep.py -m $MODEL $placed -ub 2048 -d 0,4096,8192,16384,32768 -n 128 \
                 -ctk bf16,f16,q8_0,q4_0 -ctv same 2>&1 | quiet | sed "s|^|$placed |" | tee -a "$OUT/bench.txt"
             done ;;
    quick) python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_matvec.py tests/kernels/test_dots.py \
             tests/kernels/test_moe_matvec.py tests/kernels/test_fused.py tests/kernels/test_deltanet_step.py \
             tests/kernels/test_decode_attention.py tests/runtime/test_step_gpu.py 2>&1 | tee -a "$OUT/gpu_tests.txt" | tail -8 ;;
    fla) python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/ops/test_delta_rule_gpu.py 2>&1 \
           | tee -a "$OUT/gpu_tests.txt" | tail -25 ;;  # ~100 s: fla autotunes its kernels on first use
    model) { make_model $MODEL qwen3-30b-a3b; $MS info $MODEL --routing --tokens 2048 2>&1 | quiet | tail -60; } \
             | tee -a "$OUT/model.txt" | tail -8 ;;
    routing) { make_model $TRAINED qwen3-30b-a3b --routing trained
               $MS info $TRAINED --routing --text $TEXT 2>&1 | quiet | tail -60
               R="$MS bench -m $TRAINED -ncmoe 26 -r 3 -p 0 -n 128 --streamed-layers spread --vram-budget 12GiB --no-floors"
               $R --text $TEXT 2>&1 | quiet
               for cp in static lru lfu; do
                 $R --text $TEXT --small-batch gather --prefetch 8,12 --expert-cache 0,auto --cache-policy $cp -o json 2>&1 \
                   | quiet
               done; } \
               | tee -a "$OUT/model.txt" | tail -40 ;;
    pp512) $B -p 512 -ub 512 --stream serial,pinned,overlap,layer-major --streamed-layers first,spread \
             --vram-budget 12GiB 2>&1 | quiet | tee -a "$OUT/bench.txt" ;;
    pp2048) $MS probe -m $MODEL -p 2048 -ub 2048 -ncmoe 26 2>&1 | tee -a "$OUT/gpu.txt"
            $B -p 2048 -ub 2048 --stream serial,pinned,overlap,layer-major --streamed-layers first,spread \
              --vram-budget 12GiB 2>&1 | quiet | tee -a "$OUT/bench.txt" ;;
    long) $B -p 8192,16384 -ub 2048 --stream overlap,layer-major --streamed-layers first,spread -r 2 2>&1 \
            | quiet | tee -a "$OUT/bench.txt" ;;
    profile) $MS profile -m $MODEL -p 2048 -ub 2048 -ncmoe 26 --vram-budget 12GiB --streamed-layers spread \
               --stream serial,overlap,layer-major --trace "$OUT/trace_pp2048.json" --plot "$OUT/timeline_pp2048.png" \
               2>&1 | quiet | tee -a "$OUT/profile.txt" ;;
    decode) $MS bench -m $MODEL -ncmoe 0 -r 3 -p 0 -n 128 --no-floors 2>&1 | quiet | tee -a "$OUT/bench.txt"
            for sb in ${SMALL_BATCH:-auto gather upload cpu}; do  # auto: the defaults; gather: prefetch x cache
              pf=(); [[ $sb == gather ]] && pf=(--prefetch "${PREFETCH:-0,8}" --expert-cache "${CACHE:-0,auto}")
              t0=$SECONDS
              $MS bench -m $MODEL -ncmoe 26 -r 3 -p 0 -n 128 --streamed-layers spread --small-batch $sb ${pf[@]+"${pf[@]}"} \
                --vram-budget 12GiB --no-floors 2>&1 | quiet | tee -a "$OUT/bench.txt"
              echo "small-batch $sb: $((SECONDS - t0)) s in all (load included)" | tee -a "$OUT/bench.txt"
            done ;;
    small) # an 8-layer slice of the benchmark preset (~20 s to write): per-layer decode A/B, kernel table, CPU matvec
           make_small
           python3 scripts/decode_diag.py $SMALL 2>&1 | tee -a "$OUT/diag.txt"
           for n in ${CPU_THREADS:-16 8 4 2 1}; do  # does the C kernel scale? (16 cores gave what 2 did)
             python3 scripts/cpu_experts.py $SMALL --layer 1 --threads $n 2>&1 | tee -a "$OUT/diag.txt"
           done
           OMP_WAIT_POLICY=passive python3 scripts/cpu_experts.py $SMALL --layer 1 --threads 16 2>&1 \
             | tee -a "$OUT/diag.txt" ;;
    trees) # side by side with other trees (git worktrees inside this one, carried): tg128 resident on the 8-layer
           # slice, each tree of $TREES and this one, $ROUNDS rounds (3), each round starting one tree later (the
           # tree run last in every round once measured 8% under the tree before it)
           [[ -n ${TREE_MODEL:-} ]] || make_small  # TREE_MODEL=$MODEL (after `model`): the whole model instead
           reps=3; [[ -n ${TREE_MODEL:-} ]] || reps=10  # a slice's tg128 is 0.13 s: its rounds differed 5-15%
           all=(${TREES:-} .)
           for round in $(seq ${ROUNDS:-3}); do
             for i in "${!all[@]}"; do
               tree=${all[$(( (i + round - 1) % ${#all[@]} ))]}
               (cd "$tree" && PYTHONPATH=/tmp/site:$PWD $MS bench -m ${TREE_MODEL:-$SMALL} -ncmoe 0 -r $reps -p 0 -n 128 --no-floors 2>&1 \
                 | grep "| *tg128" | sed "s|^|$tree round $round |" | tee -a "$OUT/bench.txt")
             done
           done ;;
    settings) IFS=';' read -ra sets <<< "${SETTINGS:--}"
              for round in $(seq ${ROUNDS:-2}); do
                for i in "${!sets[@]}"; do
                  set_=${sets[$(( (i + round - 1) % ${#sets[@]} ))]}; [[ $set_ == - ]] && set_=""
                  t0=$SECONDS
                  python3 scripts/with_settings.py $set_ -- bench -m ${TREE_MODEL:-$MODEL} -ncmoe 0 -r 3 -p 0 -n 128 \
                    --no-floors > /tmp/settings.log 2>&1
                  { grep "| *tg128" /tmp/settings.log || tail -3 /tmp/settings.log; } \
                    | sed "s|^|[${set_:-defaults}] round $round, $((SECONDS - t0)) s |" | tee -a "$OUT/bench.txt"
                done
              done ;;
    ncu) make_small
         NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
         $NCU --clock-control none --kernel-name-base function --kernel-name regex:"${NCU_KERNELS:-_gate_up|_matvec}" \
           --launch-skip 10 --launch-count 5 --section SpeedOfLight --section Occupancy --section LaunchStats \
           --section WarpStateStats --section SchedulerStats python3 scripts/ncu_decode.py $SMALL 2 > "$OUT/ncu.txt" 2>&1
         grep -E "^  _|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Warp Per" "$OUT/ncu.txt" ;;
    shapes) make_small
            python3 scripts/matvec_shapes.py $SMALL 2>&1 | tee -a "$OUT/diag.txt" ;;  # each decode kernel alone
    prefetch) python3 scripts/prefetch_diag.py $MODEL 2>&1 | tee -a "$OUT/diag.txt" ;;  # issue 10: side-stream gathers
    cachediag) python3 scripts/cache_diag.py $MODEL 2>&1 | tee -a "$OUT/diag.txt" ;;  # issue 10: the expert cache
    decodediag) python3 scripts/decode_diag.py $MODEL 2>&1 | tee -a "$OUT/diag.txt"
                python3 scripts/decode_diag.py $MODEL stream 2>&1 | tee -a "$OUT/diag.txt" ;;
    cpuexp) for n in ${CPU_THREADS:-8 16}; do for layer in 1; do  # the compiled CPU matvec on this host's cores
              python3 scripts/cpu_experts.py $MODEL --layer $layer --threads $n 2>&1 | tee -a "$OUT/diag.txt"
            done; done ;;
    lbuild) # llama.cpp's llama-bench from the llama-cpp-python sdist, packed into .lcpp/llama.tgz (models/docs
            # left out); built in its own session (setsid) so that it outlives this call and overlaps the next
            # steps; `llamacpp` and `compare` wait for its "build rc" line
            mkdir -p /tmp/lcpp && tar xzf .lcpp/llama.tgz -C /tmp/lcpp && setsid bash -c 'cd /tmp/lcpp \
              && cmake -S . -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
                   -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >/tmp/lcpp.log 2>&1 \
              && nice cmake --build build --target llama-bench -j 16 >>/tmp/lcpp.log 2>&1; echo "build rc $?" >>/tmp/lcpp.log' \
              </dev/null >/dev/null 2>&1 & ;;
    llamacpp) wait_build; tail -3 /tmp/lcpp.log | tee -a "$OUT/gpu.txt"
              for m in $MODEL $Q35; do  # each benchmark model this machine has generated (decode35 makes Q35)
                [[ -f $m ]] && /tmp/lcpp/build/bin/llama-bench -m $m -ngl 99 -fa 1 -p 0 -n 128 -r 3 -ncmoe 0,26 2>&1 \
                  | grep -v '^ggml\|^load' | tee -a "$OUT/bench.txt"
              done ;;
    context) make_model $MODEL qwen3-30b-a3b | tee -a "$OUT/model.txt"  # issue 36: long prompts, decode at depth
             for p in 16384 32768; do
               $MS bench -m $MODEL -p $p -ub 2048 -ncmoe auto --vram-budget 12GiB -r 3 --no-floors 2>&1 | quiet \
                 | tee -a "$OUT/bench.txt"
             done
             $MS bench -m $MODEL -p 0 -n 128 -d 8192,32768 -ncmoe 0,26 -r 3 --no-floors 2>&1 | quiet | tee -a "$OUT/bench.txt" ;;
    ctxllama) wait_build; tail -1 /tmp/lcpp.log | tee -a "$OUT/gpu.txt"  # context's rows by llama-bench, same file
              /tmp/lcpp/build/bin/llama-bench -m $MODEL -ngl 99 -fa 1 -p 16384,32768 -n 0 -ub 2048 -r 3 -ncmoe 26 -lm none \
                2>&1 | grep -v '^ggml\|^load' | tee -a "$OUT/bench.txt"
              /tmp/lcpp/build/bin/llama-bench -m $MODEL -ngl 99 -fa 1 -p 0 -n 128 -d 8192,32768 -r 3 -ncmoe 0,26 2>&1 \
                | grep -v '^ggml\|^load' | tee -a "$OUT/bench.txt" ;;
    compare) # issues 32/33: each $COMPARE entry preset:recipe:streamed:budget (e.g. gpt-oss-20b:MXFP4_MOE:24:8GiB) is
             # generated, run by moestream (resident, then -ncmoe streamed within the budget) and by llama-bench
             # (-lm none: llama.cpp's pinned copy; built by lbuild), then deleted to leave the disk for the next
             LLAMA=1; wait_build || LLAMA=0; tail -1 /tmp/lcpp.log | tee -a "$OUT/gpu.txt"
             for c in ${COMPARE:-}; do
               IFS=: read -r preset recipe n budget <<< "$c"; m=/tmp/$preset-$recipe.gguf
               /usr/bin/time -f "make-model $preset $recipe: %e s" $MS make-model $m --preset $preset --quant $recipe 2>&1 \
                 | quiet | tail -2 | tee -a "$OUT/bench.txt"
               $MS bench -m $m -p 2048 -n 128 -ub 2048 -r 3 -ncmoe 0 --no-floors 2>&1 | quiet | tee -a "$OUT/bench.txt"
               $MS bench -m $m -p 2048 -n 128 -ub 2048 -r 3 -ncmoe $n --vram-budget $budget --no-floors 2>&1 | quiet \
                 | tee -a "$OUT/bench.txt"
               (( LLAMA )) && /tmp/lcpp/build/bin/llama-bench -m $m -ngl 99 -fa 1 -p 2048 -n 128 -ub 2048 -r 3 -ncmoe 0,$n -lm none 2>&1 \
                 | grep -v '^ggml\|^load' | tee -a "$OUT/bench.txt"
               rm -f $m
             done ;;
    loadtest) # issue 13 on the GPU: the server under 16 streaming clients for 60 s with the benchmark model. The
              # image lacks the serving packages: carry their wheels in .whl/serve, fetched here with
              # pip download --only-binary=:all: --python-version 3.12 --implementation cp --platform
              # manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl/serve fastapi uvicorn openai
              python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/serve/*.whl || exit 1
              python3 scripts/load_test.py -m $MODEL --device cuda -ncmoe 26 --streamed-layers spread --vram-budget 12GiB \
                --max-seqs 4 --baseline --seconds "${LOAD_SECONDS:-60}" 2>&1 | quiet \
                | tee -a "$OUT/bench.txt" | tail -16 ;;  # ~4.5 min at 60 s: three runs, each after a warm-up
    alloc) for conf in "" "expandable_segments:True"; do  # A/B of the allocator under the 12 GiB cap
             echo "PYTORCH_CUDA_ALLOC_CONF=$conf" | tee -a "$OUT/bench.txt"
             PYTORCH_CUDA_ALLOC_CONF=$conf $B -p 2048 -ub 2048 --stream overlap --streamed-layers spread \
               --vram-budget 12GiB --no-floors 2>&1 | quiet | tee -a "$OUT/bench.txt"
           done ;;
    qwen35) make_model $Q35 qwen3.6-35b-a3b | tee -a "$OUT/model35.txt"
            $MS bench -m $Q35 -ncmoe 26 -r 2 -p 2048 -ub 2048 --stream serial,pinned,overlap,layer-major \
              --streamed-layers first,spread --vram-budget 12GiB 2>&1 | quiet | tee -a "$OUT/bench35.txt" ;;
    decode35) make_model $Q35 qwen3.6-35b-a3b | tee -a "$OUT/model35.txt"  # issue 10's second model
              $MS bench -m $Q35 -ncmoe 0 -r 3 -p 0 -n 128 --no-floors 2>&1 | quiet | tee -a "$OUT/bench35.txt"
              for sb in ${SMALL_BATCH:-auto gather upload cpu}; do
                pf=(); [[ $sb == gather ]] && pf=(--prefetch "${PREFETCH:-0,8}" --expert-cache "${CACHE:-0,auto}")
                $MS bench -m $Q35 -ncmoe 26 -r 3 -p 0 -n 128 --streamed-layers spread --small-batch $sb \
                  ${pf[@]+"${pf[@]}"} --vram-budget 12GiB --no-floors 2>&1 | quiet | tee -a "$OUT/bench35.txt"
              done ;;
    autopair) # auto against the forced row it picks, each its own process, alternating ($ROUNDS rounds, 2), on
              # $AUTO_MODEL ($MODEL; $Q35 after decode35): one process each measured 0.947x on qwen3.6
              for round in $(seq ${ROUNDS:-2}); do
                for sb in auto gather; do
                  pf=(); [[ $sb == gather ]] && pf=(--prefetch 8 --expert-cache auto)
                  $MS bench -m ${AUTO_MODEL:-$MODEL} -ncmoe 26 -r 3 -p 0 -n 128 --streamed-layers spread \
                    --small-batch $sb ${pf[@]+"${pf[@]}"} --vram-budget 12GiB --no-floors 2>&1 | quiet \
                    | grep -e "| *tg128" -e "small batches:" | sed "s|^|$sb round $round |" | tee -a "$OUT/bench.txt"
                done
              done ;;
    model35) make_model $Q35 qwen3.6-35b-a3b | tee -a "$OUT/model35.txt" ;;  # for TREE_MODEL=$Q35 settings
    routing35) $MS info $Q35 --routing --tokens 2048 2>&1 | quiet | tail -45 | tee -a "$OUT/model35.txt" | tail -3 ;;
    speed) m=${SPEED_MODEL:-$MODEL}; make_model $m ${SPEED_PRESET:-qwen3-30b-a3b} | tee -a "$OUT/model.txt"
           trees=(${BEFORE:-wt-before} .)
           for round in $(seq ${ROUNDS:-2}); do
             for i in 0 1; do
               tree=${trees[$(( (i + round - 1) % 2 ))]}
               for args in "-ncmoe 0 -p 0 -n 128" \
                           "-ncmoe 26 --streamed-layers spread --vram-budget 12GiB -p 2048 -ub 2048 -n 128"; do
                 t0=$SECONDS
                 (cd "$tree" && PYTHONPATH=/tmp/site:$PWD $MS bench -m $m $args -r 3 --no-floors > /tmp/speed.log 2>&1)
                 { grep -e "| *pp2048" -e "| *tg128" /tmp/speed.log || tail -3 /tmp/speed.log; } \
                   | sed "s|^|$(basename $m) $tree round $round, $((SECONDS - t0)) s |" | tee -a "$OUT/bench.txt"
               done
             done
           done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "== done $(date -u +%T)" | tee -a "$OUT/gpu.txt"
