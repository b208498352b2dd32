#!/usr/bin/env bash
# One GPU session that produces every committed result file (decode kernels, calibration speed, 4K quality table,
# GPU kernel tests). Usage on the GPU machine, from the repo root: OUT=/some/dir bash bench/run_all_gpu.sh
# Each step has its own time limit, so a slow step cannot starve the others; results land in $OUT as they finish.
set -u
OUT=${OUT:?set OUT to a results directory}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/gpu.txt"

echo "== decode attention benchmark"
timeout "${DECODE_S:-210}" python3 bench/bench_decode.py --out "$OUT" --quick --budget-s "${DECODE_BUDGET_S:-110}" \
    > /tmp/bench_cmp.log 2>&1; echo "rc=$?" >> /tmp/bench_cmp.log; tail -40 /tmp/bench_cmp.log; cp /tmp/bench_cmp.log "$OUT/"

echo "== calibration benchmark"
timeout "${CALIB_S:-110}" python3 bench/bench_calibrate.py --out "$OUT" > /tmp/calib.log 2>&1; echo "rc=$?"; tail -4 /tmp/calib.log

echo "== quality table at 4K"
timeout "${EVAL_S:-170}" python3 tools/readme_eval.py --model oscar_calib/fixtures/tiny-qwen3 --context 4096 \
    --generation-steps 32 --out /tmp/ev > /tmp/ev.log 2>&1; echo "rc=$?"; cp /tmp/ev.log /tmp/ev/ 2>/dev/null
tail -16 /tmp/ev.log; tar -C /tmp -cf "$OUT/ev.tar" ev 2>/dev/null

echo "== GPU kernel tests"
timeout "${TESTS_S:-90}" python3 -m pytest tests/test_kernels_gpu.py -q -x -p no:cacheprovider -k "int2 or full_decode" \
    > "$OUT/gpu_tests_int2.txt" 2>&1; tail -3 "$OUT/gpu_tests_int2.txt"
