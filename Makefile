# Everything a fresh clone needs: `make test` and `make serve` do all set-up themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TINY := models/tiny/config.json
SMALL := models/small/config.json

.PHONY: install models test serve lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(TINY): $(STAMP)
	$(PY) -m engine.model.tiny_model --size tiny --out models/tiny

$(SMALL): $(STAMP)
	$(PY) -m engine.model.tiny_model --size small --out models/small

models: $(TINY)

test: install models
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q --durations=25

# `serve run deploy.yaml` (local Ray, tiny model on CPU); prints curl and openai examples.
serve: install models
	$(PY) -m serve_app.deploy.launch deploy.yaml

lint: install
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports --no-cache

bench: install $(SMALL)
	$(PY) -m loadtests.bench_engine --model small

clean:
	rm -rf $(VENV) models .pytest_cache .hypothesis .ruff_cache .import_linter_cache
