#!/usr/bin/env bash
# Installs the core alone (embedded defaults: no MPI, no GPU) and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/disco demo "$@"
