VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow lint bench bench-gpu clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install -e '.[dev,sweep]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/runner

test: $(STAMP)  # one test process per core (pytest-xdist); a single file: .venv/bin/python -m pytest FILE
	$(PY) -m pytest -n auto

test-slow: $(STAMP)  # the checks `make test` leaves out for time (tests/conftest.py's quick_first, @pytest.mark.slow)
	$(PY) -m pytest -n auto -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check runner tests benchmarks
	$(VENV)/bin/ruff format --check runner tests benchmarks

bench: $(STAMP)
	$(PY) -m benchmarks $(B)

bench-gpu: $(STAMP)  # CUDA: the paper presets beside their baselines (one line without CUDA); ARGS=--smoke: any device
	$(PY) -m benchmarks.bench_gpu $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun wandb .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
