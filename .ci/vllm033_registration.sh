#!/usr/bin/env bash
# Opt-in lane (not called by .ci/run): the registration tests against vLLM 0.33's plugin surface. 0.33 is a CUDA
# wheel (336 MB, no CPU kernels); its Python package imports on CPU next to the engine lane's torch 2.13.0, which is
# all the registration needs. Run after .ci/vllm_lane.sh (reuses its venv and needs OSCAR_VLLM_ARTIFACT or
# calibrates); output committed as tests/vllm/vllm033_registration.log.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${OSCAR_VLLM_VENV:-${TMPDIR:-/tmp}/oscar-calib-vllm-lane}"
site="${TMPDIR:-/tmp}/oscar-calib-vllm033"
[ -d "$site/vllm" ] || "$venv/bin/python" -m pip install --quiet --no-deps --target "$site" "vllm==0.33.0"
{
    PYTHONPATH="$site" "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>/dev/null
    PYTHONPATH="$site" HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -v -rs tests/vllm/test_registration.py \
        -p no:cacheprovider -W ignore 2>&1 | grep -v -e "WARNING" -e "Failed to import from vllm._C"
} | tee tests/vllm/vllm033_registration.log
