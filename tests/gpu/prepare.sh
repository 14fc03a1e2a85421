#!/usr/bin/env bash
# Prepare the GPU checks for the device machine (one H200, Python 3.12, torch and triton
# installed, no registry, no pyzmq/gguf/textual): ridge as a wheel, pyzmq's and jinja2's go
# into .whl/ (ignored by git, carried by the device tool). Then, in one device call:
#   carry: [".whl"], timeout_s: 540, command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit;
#   python3 tests/gpu/check.py 2>&1 | tee $OUT/check.log; python3 tests/gpu/serve_check.py 2>&1 | tee $OUT/serve.log
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir .whl
PY=${PY:-.venv/bin/python}
$PY -m pip wheel -q --no-deps -w .whl .
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "pyzmq==$($PY -c 'import zmq; print(zmq.__version__)')" jinja2 markupsafe
ls -la .whl
