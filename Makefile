# The two commands of README.md: `make demo` (the main job on the tiny preset) and `make test`.
# Both create .venv on first use. torch is installed as the CPU wheel 2.13.0 only where the venv has no torch
# (pyproject.toml leaves torch unpinned for users, which on a bare pip pulls the CUDA build). The demo installs the
# package alone; the tests add their extras (test, genai, serve, ray).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(VENV)/.installed-base: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base
	$(BIN)/pip install -q -e '.[test,genai,serve,ray]'
	touch $@

.PHONY: demo test
demo: $(VENV)/.installed-base
	$(BIN)/mla-deploy inspect --preset tiny
	$(BIN)/mla-deploy export --preset tiny --out build/tiny --overwrite
	$(BIN)/mla-deploy run build/tiny --prompt-ids 1,2,3,4 --prompt-ids 9,8 --max-new-tokens 32
	$(BIN)/mla-deploy validate build/tiny

# the tests run in TEST_WORKERS processes (pytest-xdist), one thread each, a test file per process at a time (its
# module fixtures are built once); TEST_WORKERS=0 runs them in this process. Everything they and the libraries they
# drive write to the temporary folder (pytest's tmp_path, the shared exports, ONNX Runtime's files) goes into one
# folder of the run's own, removed when it ends, whatever its outcome
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	@tmp=$$(mktemp -d -t mla-deploy-make-test.XXXXXX); \
	TMPDIR=$$tmp OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile; \
	status=$$?; rm -rf $$tmp; exit $$status
