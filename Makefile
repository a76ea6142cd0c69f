# Two entry points (README): `make demo` and `make test`. Both create the venv when needed.
# On a machine with an NVIDIA GPU (nvidia-smi works; or GPU=1) the venv gets
# requirements-gpu.txt (jax with CUDA, jax-triton, triton) and `make demo` trains through the
# Triton kernels; GPU=0 forces the CPU install.
# Python 3.12 where the machine has one that runs (on PATH or under pyenv): it gets the GPU
# hosts' JAX (requirements.txt); else python3.
PYTHON ?= $(firstword $(shell for p in python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12); do $$p -c "" 2>/dev/null && echo $$p && break; done) python3)
VENV := .venv
PY := $(VENV)/bin/python
DEMO_DATA := data/listops_tiny
DEMO_RUN := runs/listops_tiny_demo
GPU ?= auto
ifeq ($(GPU),auto)
  override GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
endif
ifeq ($(GPU),1)
  REQUIREMENTS := requirements-gpu.txt
  # the tiny preset with DFSS 2:4 attention on the fused Triton kernels, in bf16
  DEMO_FLAGS := --config.attention.kind=dfss --config.attention.dfss.backend=triton \
    --config.model.dtype=bfloat16
else
  REQUIREMENTS := requirements.txt
  DEMO_FLAGS :=
endif
INSTALLED := $(VENV)/.installed-$(basename $(REQUIREMENTS))

.PHONY: demo test test-fast venv gpu-check clean

venv: $(INSTALLED)

$(INSTALLED): $(REQUIREMENTS) pyproject.toml
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(REQUIREMENTS)
	$(PY) -m pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@

# Generate a small ListOps set (short sequences), train the tiny preset (CPU: dense attention;
# GPU: DFSS on the Triton kernels), print test accuracy next to the majority-class accuracy.
demo: venv
	$(PY) -m lra_sparse.generators.listops \
	  --output_dir=$(DEMO_DATA) --num_train=5000 --num_val=500 --num_test=500 --seed=0 \
	  --min_length=20 --max_length=100
	rm -rf $(DEMO_RUN)
	$(PY) -m lra_sparse.main --config=configs/listops.py:tiny --workdir=$(DEMO_RUN) $(DEMO_FLAGS)

# Two pytest workers (pytest-xdist): the suite takes 12-18 min on 2 cores, by machine. Each
# worker allocates GPU memory as it needs it, not 75% of it up front. The 15 slowest tests are
# listed at the end (CI's log keeps them: what to trim when the suite grows).
TEST_WORKERS ?= 2
test: venv
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15

# The fast tier: everything but the tests marked slow (tests/slow_tests.txt says what is left
# out and what stays: one case of every kernel family, one short run per attention kind).
test-fast: venv
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

# On a GPU: the GPU tests (kernels against their references) and the kernel benchmarks.
gpu-check: venv
	$(PY) -m pytest -q -m gpu tests/
	$(PY) -m benchmarks.bench_dfss_kernels --shapes=16x2048
	$(PY) -m benchmarks.bench_dsa --skip_reference --shapes=16x2048

clean:
	rm -rf $(VENV) runs data/listops_tiny lra_sparse.egg-info
