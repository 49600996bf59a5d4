#!/usr/bin/env bash
# The checks that need a GPU: disco-nccl's and disco-rpc's GPU tests (with the CPU and
# binding tests of disco-nccl beside them), then the NCCL benchmark. For a machine with
# CuPy, NCCL, pytest and pytest-timeout already installed and no network, as a lent
# GPU machine is: the core and the two plugins are installed offline, without their
# dependencies, into a folder of their own; WHEELS=DIR adds wheels (cryptography and
# what it needs, when missing there). Logs go to LOGS=DIR (default: a new temporary one).
#
#     bash scripts/gpu_check.sh            # PYTHON=python3 WHEELS= LOGS=
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v "${PYTHON:-python3}") || { echo "no Python: ${PYTHON:-python3}"; exit 1; }
PY=$(realpath -s "$PY")
LOGS=${LOGS:-$(mktemp -d)}
SITE=${SITE:-$(mktemp -d)}
mkdir -p "$LOGS"
echo "logs: $LOGS"
{
  date -u
  nvidia-smi 2>&1 | head -15
  "$PY" -V
  "$PY" -m pip list 2>/dev/null | grep -iE '^(cupy|numpy|pluggy|threadpoolctl|nvidia-nccl|torch|pytest|pytest-timeout|hypothesis|cryptography) '
  "$PY" -c 'import cupy; from cupy.cuda import nccl; print("cupy", cupy.__version__, "nccl", nccl.get_version(), "gpus", cupy.cuda.runtime.getDeviceCount())'
} 2>&1 | tee "$LOGS/env.txt"
pip_target() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$@"; }
if [ -n "${WHEELS:-}" ]; then
  pip_target "$WHEELS"/*.whl || exit 1
fi
pip_target --no-build-isolation . ./plugins/nccl ./plugins/rpc || exit 1
export PYTHONPATH="$SITE"
rc=0
(cd plugins/nccl && timeout 300 "$PY" -m pytest -v -rs tests/test_nccl_gpu.py tests/test_nccl_cpu.py) 2>&1 |
  tee "$LOGS/nccl_tests.txt" || rc=1
(cd plugins/rpc && timeout 150 "$PY" -m pytest -v -rs tests/test_rpc_gpu.py) 2>&1 |
  tee "$LOGS/rpc_gpu_tests.txt" || rc=1
timeout 150 "$PY" plugins/nccl/bench_nccl.py --workers 1 --sizes 1,16,64,256 2>&1 |
  tee "$LOGS/bench_nccl.txt" || rc=1
echo "gpu_check: rc=$rc"
exit $rc
