# `make test` and `make demo` work from a fresh clone: they create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_INSTALL ?= "torch==2.13.0"

.PHONY: test test-fast test-tpu-aot demo demo-async venv venv-tpu lint format clean device-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so transformers does not pick its own. From PyPI itself Linux torch is
	# the CUDA build (it works, several GB more); the CPU build comes from a local wheelhouse or
	# TORCH_INSTALL='"torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu'.
	$(PY) -m pip install $(TORCH_INSTALL)
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -q -p no:cacheprovider tests

# Everything but the tests marked slow (subprocess and multi-process runs, benchmarks, HF parity,
# the heaviest compiles): the quick lane while iterating. `make test` still runs them all.
test-fast: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -q -p no:cacheprovider -m "not slow" tests

# The kernels compiled ahead of time for TPU v5e / v5p / v6e topologies on this CPU host: Mosaic,
# not interpret mode (tests/kernels/test_tpu_aot.py). libtpu (~700 MB, the version the installed
# jax wants) goes into its own .venv-tpu, so .venv never tries to start a TPU backend.
# SPARSERL_REQUIRE_TPU_AOT turns the tests' skip (no libtpu) into a failure.
TPU_VENV := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed

# The same jax as .venv (built first): one version of jax in both venvs.
$(TPU_STAMP): pyproject.toml $(STAMP)
	test -x $(TPU_VENV)/bin/python || $(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -e ".[tpu]" "pytest>=8" "pytest-xdist>=3.5" \
		"jax[tpu]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	touch $(TPU_STAMP)

venv-tpu: $(TPU_STAMP)

test-tpu-aot: $(TPU_STAMP)
	SPARSERL_REQUIRE_TPU_AOT=1 TPU_WORKER_HOSTNAMES=localhost \
		$(TPU_VENV)/bin/python -m pytest -n 2 --dist worksteal -q -p no:cacheprovider \
		tests/kernels/test_tpu_aot.py tests/test_tpu_programs.py tests/test_bench_memory.py

demo: $(STAMP)
	rm -rf runs/demo
	$(PY) -m sparserl_jax train configs/demo.yaml

# The demo through the decoupled jobs: a trainer and 2 samplers as local subprocesses.
demo-async: $(STAMP)
	rm -rf runs/demo-async
	$(PY) -m sparserl_jax launch configs/demo.yaml --samplers 2 run_dir=runs/demo-async

# The tunix side-by-side (`tools/bench_rollout.py --peer tunix`, `tools/bench_memory.py`):
# google-tunix pins older transformers/tokenizers than the test extra wants, so it gets its own
# venv, .venv-bench; with libtpu (the tpu extra) for the ahead-of-time TPU compiles.
.PHONY: bench-venv
bench-venv:
	test -x .venv-bench/bin/python || $(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install "torch==2.13.0"
	.venv-bench/bin/python -m pip install -e ".[bench,tpu]"

# The accelerator check (tools/device_check.py): run on the GPU/TPU machine itself, with its own
# Python (jax with CUDA or libtpu, flax, optax, orbax, tensorstore, ml_dtypes installed; no
# .venv, no network). Wheels it lacks (zstandard, for PULSESync format 3) are installed from
# wheels/ when that folder is there (README, "Running on a GPU or TPU").
DEVICE_PYTHON ?= python3
DEVICE_CHECK_OUT ?= runs/device-check
device-check:
	@if [ -d wheels ]; then $(DEVICE_PYTHON) -c "import zstandard" 2>/dev/null || \
		$(DEVICE_PYTHON) -m pip install -q --no-index --find-links wheels zstandard; fi
	PYTHONPATH=. $(DEVICE_PYTHON) tools/device_check.py --out $(DEVICE_CHECK_OUT)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(TPU_VENV) .pytest_cache .jax_cache build *.egg-info
