# The two commands of README.md: `make demo` (the main job on the tiny preset) and `make test`.
# Both create .venv on first use. torch is installed as the CPU wheel 2.13.0 only where the venv has no
# torch (pyproject.toml leaves torch unpinned for users, which on a bare pip pulls the CUDA build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,genai,serve,ray]'
	touch $@

.PHONY: demo test
demo: $(STAMP)
	$(BIN)/mla-deploy inspect --preset tiny
	$(BIN)/mla-deploy export --preset tiny --out build/tiny --overwrite
	$(BIN)/mla-deploy run build/tiny --prompt-ids 1,2,3,4 --prompt-ids 9,8 --max-new-tokens 32
	$(BIN)/mla-deploy validate build/tiny

# the tests run in TEST_WORKERS processes (pytest-xdist), one thread each, a test file per process at a time (its
# module fixtures are built once); TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile
