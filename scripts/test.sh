#!/usr/bin/env bash
# Installs the core and every plugin (with their test dependencies: MPI comes from
# PyPI through disco-mpi) into ./.venv, then runs every test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
plugins=()
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] && plugins+=(-e "$p")
done
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' "${plugins[@]}"
# Interop tests (DLPack, the .pt2 loader, bfloat16): the CPU build of torch, pinned
# so that pip never pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 ml_dtypes
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
