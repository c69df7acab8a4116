# Two commands for a fresh machine:  make demo   |   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-gpu clean

$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch from the pinned wheel (an unpinned torch would pull several GB of CUDA wheels)
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m service.demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-gpu:
	python3 -m pytest -q -p no:cacheprovider -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info
