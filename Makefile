# The two commands of README.md: `make demo` (the main job on the tiny preset) and `make test`.
# Both create .venv on first use. torch is installed as the CPU wheel 2.13.0 only where the venv has no
# torch (pyproject.toml leaves torch unpinned for users, which on a bare pip pulls the CUDA build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/mla-deploy: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: demo test
demo: $(BIN)/mla-deploy
	$(BIN)/mla-deploy inspect --preset tiny

test: $(BIN)/mla-deploy
	$(BIN)/python -m pytest -q
