#!/usr/bin/env bash
# One GPU session that produces every committed result file (decode kernels, calibration speed, 4K quality table,
# GPU kernel tests). Usage on the GPU machine, from the repo root: OUT=/some/dir bash bench/run_all_gpu.sh
# Each step has its own time limit, so a slow step cannot starve the others; results land in $OUT as they finish.
# All steps together take longer than one 10-minute call of the device tool: there, run the steps' commands in
# separate calls (the decode table alone can need most of one: a point takes up to 70 s with its compiles).
# A copy of the tree whose .git is stale (the device tool's) records the wrong commit: pass the real one as
# OSCAR_BENCH_COMMIT=<hash> (bench/common.commit()).
set -u
OUT=${OUT:?set OUT to a results directory}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/gpu.txt"

echo "== decode attention under CUDA graphs (the headline table) and demotion cost"
timeout "${GRAPH_S:-420}" python3 bench/bench_decode_graph.py --out "$OUT" > /tmp/graph.log 2>&1
echo "rc=$?"; tail -14 /tmp/graph.log
timeout 150 python3 bench/bench_demotion.py --out "$OUT" \
    --attention "$OUT/decode_graph_$(python3 -c 'import torch; print(torch.cuda.get_device_name(0).replace(" ", "_"))').json" \
    > /tmp/demotion.log 2>&1; echo "rc=$?"; tail -12 /tmp/demotion.log

echo "== model-level decode step (Qwen3-8B shape, one CUDA graph per step): OSCAR via PagedKVCache vs BF16"
timeout "${MODEL_S:-540}" python3 bench/bench_model_decode.py --out "$OUT" > /tmp/model.log 2>&1
echo "rc=$?"; tail -20 /tmp/model.log

# The whole-page loop's arithmetic changed on purpose at 710c306 (docs/kernels.md, "Thirty fewer instructions per
# tile"), so its bits differ from 90430f9's by rounding. Compare against a tree given in OLD_TREE (e.g. a git
# archive of 710c306) when a change claims to keep the bits.
if [ -n "${OLD_TREE:-}" ]; then
    echo "== decode outputs bit for bit against $OLD_TREE"
    timeout "${BITWISE_S:-300}" python3 bench/compare_decode_bitwise.py --out "$OUT" --old-tree "$OLD_TREE" \
        --scale-format ue5m3 > /tmp/bitwise.log 2>&1
    echo "rc=$?"; tail -22 /tmp/bitwise.log
fi

echo "== calibration benchmark"
timeout "${CALIB_S:-110}" python3 bench/bench_calibrate.py --out "$OUT" > /tmp/calib.log 2>&1; echo "rc=$?"; tail -4 /tmp/calib.log

echo "== quality table at 4K"
timeout "${EVAL_S:-170}" python3 tools/readme_eval.py --model oscar_calib/fixtures/tiny-qwen3 --context 4096 \
    --generation-steps 32 --out /tmp/ev > /tmp/ev.log 2>&1; echo "rc=$?"; cp /tmp/ev.log /tmp/ev/ 2>/dev/null
tail -16 /tmp/ev.log; tar -C /tmp -cf "$OUT/ev.tar" ev 2>/dev/null

echo "== GPU kernel tests"
timeout "${TESTS_S:-300}" python3 -m pytest -m gpu tests/test_kernels_gpu.py tests/test_decode_split_accuracy.py \
    tests/test_hf_integration.py -q -p no:cacheprovider \
    > "$OUT/gpu_tests_int2.txt" 2>&1; tail -3 "$OUT/gpu_tests_int2.txt"
