# Two entry points: `make demo` (set up, then run the main job) and `make test` (set up, then test).
PYTHON ?= python3
VENV ?= .venv
DYNAMO_VENV ?= .venv-dynamo
PIP := $(VENV)/bin/pip --disable-pip-version-check -q

.PHONY: demo test setup dynamo-setup bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -e '.[test]'
	touch $@

# Dynamo's runtime pins its own pydantic, so its indexer lives in a separate environment.
$(DYNAMO_VENV)/.installed:
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip --disable-pip-version-check -q install 'ai-dynamo-runtime==1.6.1'
	touch $@

setup: $(VENV)/.installed
dynamo-setup: $(DYNAMO_VENV)/.installed

demo: setup
	$(VENV)/bin/kvcr demo

test: setup dynamo-setup
	KVCR_DYNAMO_PYTHON=$(abspath $(DYNAMO_VENV))/bin/python $(VENV)/bin/pytest -q $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python bench/dram_pool.py

clean:
	rm -rf $(VENV) $(DYNAMO_VENV) build *.egg-info
