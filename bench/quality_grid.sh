#!/usr/bin/env bash
# The quality grid of issue 51, one calibration per call: a model at its long context calibrated on one text, then the
# artifact `oscar-calib run` writes (the default) against BF16, the equal-bits peers and candidate defaults on both
# held-out domains, with the passkey, multi-key and multi-value probes on the prose filler. Usage, from the repo root,
# after `make real-model` (and `tools/real_model.py --model gemma3`) and `tools/real_model.py text --out T`:
#
#   OUT=DIR T=T bash bench/quality_grid.sh MODEL CALIB [CONTEXT] [WINDOWS] [NEEDLES]
#     MODEL   smollm2 | gemma3          (the converted directories of tools/real_model.py)
#     CALIB   prose | code | mix        (T/calib.txt, T/code_calib.txt, T/mix_calib.txt)
#     CONTEXT default 8192; WINDOWS default 12 per held-out text; NEEDLES default 32 (0: no probes)
#
# Writes OUT/art_MODEL_CALIB (the artifact, reused by later calls) and OUT/MODEL_CONTEXT_CALIB/{prose,code}/
# recipe_study_<model>.json; `python3 tools/grid_table.py LABEL=that.json ...` judges the cells. RUN_FLAGS and
# STUDY_FLAGS pass extra flags to `oscar-calib run` and tools/recipe_study.py (a dry run with small sizes);
# CANDIDATES (';'-separated `--recipe` values, empty for none) replaces the candidate defaults evaluated beside it.
set -euo pipefail
OUT=${OUT:?set OUT to a results directory}
T=${T:?set T to the folder tools/real_model.py text wrote}
MODEL=$1 CALIB=$2 CTX=${3:-8192} WINDOWS=${4:-12} NEEDLES=${5:-32}
case $MODEL in
    smollm2) M=${OSCAR_REAL_MODEL_DIR:-$HOME/.cache/oscar-calib/smollm2-135m} ;;
    gemma3) M=${OSCAR_GEMMA3_DIR:-$HOME/.cache/oscar-calib/gemma3-270m} ;;
    *) echo "MODEL: expected smollm2 or gemma3, got $MODEL" >&2; exit 2 ;;
esac
case $CALIB in prose) C=$T/calib.txt ;; code) C=$T/code_calib.txt ;; mix) C=$T/mix_calib.txt ;;
    *) echo "CALIB: expected prose, code or mix, got $CALIB" >&2; exit 2 ;; esac
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
mkdir -p "$OUT"
ART=$OUT/art_${MODEL}_${CALIB}
if [ ! -f "$ART/oscar_kv.safetensors" ]; then
    # shellcheck disable=SC2086
    python3 -m oscar_calib run --model "$M" --dataset "$C" ${RUN_FLAGS:-} --out "$ART" > "$OUT/run_${MODEL}_${CALIB}.log" 2>&1
    rm -f "$ART/oscar_stats.safetensors"  # the audit's statistics: not read here, and large
fi
PEERS="oscar per layer, global clips, centered, min-max;hadamard global clips, centered, min-max;kivi2-g128"
PROBED="default;oscar global clips, centered, min-max;oscar per layer, global clips, centered, min-max"
PROBED="$PROBED;hadamard global clips, centered, min-max"
CANDIDATES=${CANDIDATES-"per layer=granularity=layer;no hadamard keys=hadamard_key_mass=1"}
RECIPES=()
IFS=';' read -ra CANDS <<< "$CANDIDATES"
for c in "${CANDS[@]}"; do RECIPES+=(--recipe "$c"); done
# shellcheck disable=SC2086
python3 tools/recipe_study.py --model "$M" --calib "$C" --heldout "prose=$T/heldout.txt" \
    --heldout "code=$T/code_heldout.txt" --contexts "$CTX" --windows "$WINDOWS" --needles "$NEEDLES" --multikey 4 --multivalue 4 \
    --no-variants --artifact "default=$ART" ${STUDY_FLAGS:-} \
    "${RECIPES[@]}" \
    --only "default;$PEERS" --passkey-methods "$PROBED" --out "$OUT/${MODEL}_${CTX}_${CALIB}"
