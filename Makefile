# Two entry points (README): `make demo` and `make test`. Both create the venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_DATA := data/listops_tiny
DEMO_RUN := runs/listops_tiny_demo

.PHONY: demo test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# Generate a small ListOps set (short sequences), train the tiny preset on CPU, print test
# accuracy next to the majority-class accuracy.
demo: venv
	$(PY) -m lra_sparse.generators.listops \
	  --output_dir=$(DEMO_DATA) --num_train=5000 --num_val=500 --num_test=500 --seed=0 \
	  --min_length=20 --max_length=100
	rm -rf $(DEMO_RUN)
	$(PY) -m lra_sparse.main --config=configs/listops.py:tiny --workdir=$(DEMO_RUN)

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs data/listops_tiny lra_sparse.egg-info
