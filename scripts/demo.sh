#!/usr/bin/env bash
# Installs the core alone (embedded defaults: no MPI, no GPU) and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# compat: a plain path entry for the editable install, which type checkers follow
# (setuptools' default import hook is invisible to mypy)
.venv/bin/python -m pip install -q --disable-pip-version-check -e . \
  --config-settings editable_mode=compat
# byte-code for the tree's modules, which the editable install imports from here: made
# once, not by every worker process where PYTHONDONTWRITEBYTECODE is set
.venv/bin/python -m compileall -q disco_core >/dev/null
exec .venv/bin/disco demo "$@"
