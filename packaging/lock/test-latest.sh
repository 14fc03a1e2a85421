#!/usr/bin/env bash
# `make test-latest`: the suite on the newest release of everything requirements.lock pins,
# in a throwaway environment (.venv-latest), so that the next breaking release is found by
# the project and not by a user. Prints what differs from the lock before the tests run.
# torch stays on its CPU build: the newest one the CPU wheels at hand offer (TORCH_SRC).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
VENV=.venv-latest
OUT=$VENV/latest.lock
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --require-hashes --no-deps -r <(awk '/^uv==/{f=1} f&&/# via/{exit} f' requirements.lock)
# The newest CPU torch among the wheels at hand; the lock's when none is newer.
torch_pin=$(grep -o '^torch==[^ ]*+cpu' requirements.lock)
newest=$(ls /opt/wheels/torch-*+cpu-cp311-*.whl 2>/dev/null | sed 's/.*torch-\([^-]*\)-.*/\1/' | sort -V | tail -1 || true)
[ -n "$newest" ] && torch_pin="torch==$newest"
# shellcheck disable=SC2086
"$VENV/bin/uv" pip compile -q pyproject.toml packaging/lock/build.in --extra test --extra lock --upgrade \
    --generate-hashes --python-version "${LOCK_PYTHON:-3.11}" --python-platform "${LOCK_PLATFORM:-x86_64-manylinux_2_28}" \
    ${TORCH_SRC:-} --override <(echo "$torch_pin") --no-header -o "$OUT"
echo "== packages whose newest release differs from requirements.lock =="
changes=$(diff <(grep -o '^[a-z0-9_.-]*==[^ ]*' requirements.lock | sort) \
               <(grep -o '^[a-z0-9_.-]*==[^ ]*' "$OUT" | sort) | sed -n 's/^< /  lock:   /p; s/^> /  newest: /p' | sort -k2 || true)
echo "${changes:-  none: the lock pins the newest release of every package}"
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q --require-hashes --no-deps ${TORCH_SRC:-} -r "$OUT"
"$VENV/bin/pip" check
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
"$VENV/bin/pip" install -q --require-hashes --no-deps -r packaging/model.lock
"$VENV/bin/python" -P -m pytest -q -n auto --dist loadfile tests
