#!/usr/bin/env bash
# Installs the core and every plugin (with their test dependencies: MPI comes from
# PyPI through disco-mpi) into ./.venv, then runs ruff, lint-imports, mypy and every
# test suite: the core's (tests/) and each plugin's (plugins/<name>/tests, with that
# plugin's own pytest settings). Extra arguments go to every pytest run, e.g. -x or -k shm.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv || exit 1
plugins=()
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] && plugins+=(-e "$p")
done
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
pip_install -e '.[test,docs]' "${plugins[@]}" || exit 1
# Interop tests (DLPack, the .pt2 loader, bfloat16): a CPU build of torch, and only a
# CPU build. On PyPI, Linux x86_64 wheels of torch pull ~20 nvidia-* packages (several
# GB), so pip is first asked what it would install: a resolution with no nvidia-*
# package (a CPU wheel on disk or in a local index, aarch64 wheels) is taken; else
# PyTorch's own CPU index is tried; else torch stays absent and tests/test_interop.py
# skips, saying why.
pip_install ml_dtypes || exit 1
install_cpu_torch() {
  local spec=torch==2.13.0 report
  .venv/bin/python -c 'import torch' 2>/dev/null && return 0
  report=$(mktemp)
  if pip_install --dry-run --ignore-installed --report "$report" "$spec" 2>/dev/null &&
    ! grep -q '"name": "nvidia-' "$report"; then
    rm -f "$report"; pip_install "$spec" && return 0
  fi
  rm -f "$report"
  timeout 600 .venv/bin/python -m pip install -q --disable-pip-version-check \
    --index-url https://download.pytorch.org/whl/cpu "$spec" 2>/dev/null && return 0
  echo "no CPU build of torch is reachable from here: the torch interop tests will skip"
}
install_cpu_torch
# TVM interop (plugins/rpc/tests/test_tvm_tracker.py): the real apache-tvm, whose RPC
# server and client use our tracker in TVM mode. Its wheels exist for some platforms
# only: where it cannot be installed, that test skips and says so.
pip_install "apache-tvm[rpc]==0.27.0.post1" ||
  echo "apache-tvm could not be installed: the tests against the real TVM will skip"
# Byte-code for the tree's own modules, made once: the editable installs import them
# from here, and where PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines)
# every process would compile them anew: about 0.1 s of CPU for each worker process,
# server and script the suites start. Measured on a 2-CPU VM, the three streams below:
# 1230 s of CPU and 13.5 min without it, 750 s and 9.1 min with it.
.venv/bin/python -m compileall -q -j 0 disco_core plugins/*/disco_* >/dev/null || exit 1
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
# the documentation site: every warning (a broken reference, a docstring Sphinx
# cannot parse, a README marker gone) fails the build
rm -rf docs/_build && .venv/bin/python -m sphinx -W --keep-going -n -q -b html docs docs/_build/html || exit 1
# imports flow one way, inside the core and each plugin (.importlinter)
.venv/bin/lint-imports --no-cache || exit 1
# Types (mypy, settings in pyproject.toml): the core and every plugin package, read
# from this tree (MYPYPATH: the plugins' folders; mypy cannot follow the editable
# installs). No cache: a stale one can report errors of code that changed since.
mypy_pkgs=(-p disco_core)
mypy_path=()
for p in plugins/*/; do
  p=${p%/}
  [ -f "$p/pyproject.toml" ] && { mypy_path+=("$p"); mypy_pkgs+=(-p "disco_${p#plugins/}"); }
done
MYPYPATH=$(IFS=:; echo "${mypy_path[*]}") \
  .venv/bin/python -m mypy --cache-dir=/dev/null "${mypy_pkgs[@]}" || exit 1

# The suites run in three streams side by side (most of their time is spent waiting
# on processes, sockets and timeouts, not on the CPU; about half of two cores is busy):
# the core's suite with the short GPU plugins' suites (their tests without a GPU), the
# rpc suite, and the mpi and socket suites with the core's chaos and kit-checking tests
# ("core-chaos": the slowest of its suite); each takes 8.5 to 9 minutes here.
# DISCO_TEST_STREAMS=1 runs them one after another. Each stream's output is printed
# whole when it ends, so the logs do not interleave.
STREAMS=("core nccl rccl" "rpc" "mpi socket core-chaos")
CHAOS=(tests/chaos tests/test_kits_catch_planted_bugs.py)
run() {  # run pytest in a folder; "no tests ran" (exit 5) only counts when filtering
  (cd "$1" && "$ROOT/.venv/bin/python" -m pytest "${@:2}")
  local rc=$?
  if [ $rc -ne 0 ] && ! { [ $rc -eq 5 ] && [ $# -gt 1 ]; }; then return 1; fi
}
ROOT=$PWD
run_stream() {  # the suites named in $1 ("core": tests/ but CHAOS; else plugins/<name>/tests)
  local rc=0 name
  for name in $1; do
    case $name in
    core) run "$ROOT" "${CHAOS[@]/#/--ignore=}" "${@:2}" || rc=1 ;;
    core-chaos) run "$ROOT" "${CHAOS[@]}" "${@:2}" || rc=1 ;;
    *) [ -d "plugins/$name/tests" ] && { run "$ROOT/plugins/$name" "${@:2}" || rc=1; } ;;
    esac
  done
  return $rc
}
# every plugin with tests is in a stream
for p in plugins/*/; do
  name=$(basename "$p")
  [[ " ${STREAMS[*]} " == *" $name "* ]] || [ ! -d "$p/tests" ] ||
    { echo "plugins/$name is in no stream of scripts/test.sh"; exit 1; }
done
status=0
if [ "${DISCO_TEST_STREAMS:-3}" = 1 ]; then
  for names in "${STREAMS[@]}"; do run_stream "$names" "$@" || status=1; done
else
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
  pids=()
  for k in "${!STREAMS[@]}"; do
    run_stream "${STREAMS[$k]}" "$@" >"$logs/$k" 2>&1 &
    pids+=($!)
  done
  for k in "${!STREAMS[@]}"; do
    wait "${pids[$k]}" || status=1
    echo "=== suites: ${STREAMS[$k]}"; cat "$logs/$k"
  done
fi
[ $status -eq 0 ] && echo "all suites passed" || echo "some suite failed"
exit $status
