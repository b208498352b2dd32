#!/usr/bin/env bash
# The quality grid of issue 51, one cell per call: a model at its long context, a calibration text, a held-out
# domain; the default artifact (`oscar-calib run` itself) against BF16 and the equal-bits peers, with the passkey and
# multi-key probes. Usage, from the repo root, after `make real-model` and `tools/real_model.py text --out T`:
#
#   OUT=DIR T=T bash bench/quality_grid.sh MODEL CALIB HELDOUT [WINDOWS] [NEEDLES] [CONTEXT]
#     MODEL   smollm2 | gemma3          (the converted directories of tools/real_model.py)
#     CALIB   prose | code | mix        (T/calib.txt, T/code_calib.txt, T/mix_calib.txt)
#     HELDOUT prose | code              (T/heldout.txt, T/code_heldout.txt)
#
# The artifact of (MODEL, CALIB) is calibrated once and reused by both held-out domains. Each cell writes
# OUT/MODEL_CTX_CALIB_HELDOUT/recipe_study_<model>.json; `python3 tools/grid_table.py LABEL=that.json ...` judges
# the cells. On a GPU a cell at 8K with 12 windows and 32 needles takes a few minutes (the capture for the peers'
# means and the probes dominate); on the 2-core CPU it does not fit a session (docs/recipe.md, "The grid").
set -euo pipefail
OUT=${OUT:?set OUT to a results directory}
T=${T:?set T to the folder tools/real_model.py text wrote}
MODEL=$1 CALIB=$2 HELDOUT=$3 WINDOWS=${4:-12} NEEDLES=${5:-32}
case $MODEL in
    smollm2) M=${OSCAR_REAL_MODEL_DIR:-$HOME/.cache/oscar-calib/smollm2-135m}; CTX=${6:-8192} ;;
    gemma3) M=${OSCAR_GEMMA3_DIR:-$HOME/.cache/oscar-calib/gemma3-270m}; CTX=${6:-8192} ;;
    *) echo "MODEL: expected smollm2 or gemma3, got $MODEL" >&2; exit 2 ;;
esac
case $CALIB in prose) C=$T/calib.txt ;; code) C=$T/code_calib.txt ;; mix) C=$T/mix_calib.txt ;;
    *) echo "CALIB: expected prose, code or mix, got $CALIB" >&2; exit 2 ;; esac
case $HELDOUT in prose) H=$T/heldout.txt ;; code) H=$T/code_heldout.txt ;;
    *) echo "HELDOUT: expected prose or code, got $HELDOUT" >&2; exit 2 ;; esac
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
mkdir -p "$OUT"
ART=$OUT/art_${MODEL}_${CALIB}
if [ ! -f "$ART/oscar_kv.safetensors" ]; then
    python3 -m oscar_calib run --model "$M" --dataset "$C" --out "$ART" 2>&1 | tee "$OUT/run_${MODEL}_${CALIB}.log"
fi
CELL=$OUT/${MODEL}_${CTX}_${CALIB}_${HELDOUT}
python3 tools/recipe_study.py --model "$M" --calib "$C" --heldout "$H" --contexts "$CTX" --windows "$WINDOWS" \
    --needles "$NEEDLES" --multikey 4 --no-variants --artifact "default=$ART" \
    --only "default;oscar per layer, global clips, centered, min-max;hadamard global clips, centered, min-max;kivi2-g128" \
    --passkey-methods "default;oscar global clips, centered, min-max;oscar per layer, global clips, centered, min-max;hadamard global clips, centered, min-max" \
    --out "$CELL" 2>&1 | tee "$CELL.log"
