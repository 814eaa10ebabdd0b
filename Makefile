# The two set-up commands: `make run` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch with the torchvision built for it (transformers' Kimi-K2.5 image processor, which the image tests compare
# against, runs on torchvision); the pins are only applied when the venv lacks either.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: run test install install-test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/dayzero serve

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
