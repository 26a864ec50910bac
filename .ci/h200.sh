#!/usr/bin/env bash
# The GPU run: the test suite with the CUDA backends enabled, then `convcov bench --grad` on
# the CUDA workloads. Everything it prints is also written under $OUT.
#   bash .ci/h200.sh [extra pytest arguments, e.g. -k "cupy or numba_cuda"]
# Needs: a CUDA GPU, torch, cupy, numba and numba-cuda installed, and wheels in .whl/ that
# are installed first into /tmp/site (a numpy 2.4.x wheel: numba-cuda 0.30.4 fails to compile
# under numpy 2.5, which lacks numpy.row_stack).
# On a fresh machine the tests spend minutes compiling (NVRTC each cupy kernel a test
# launches, Numba each kernel variant). Where one command may run 10 minutes, run the
# tests alone (SKIP_BENCH=1 TEST_TIMEOUT=560) and the bench in a second command.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm --format=csv
python3 -c "import numpy, torch, cupy, numba, numba_cuda; print('numpy', numpy.__version__, 'torch', torch.__version__, 'cupy', cupy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__)"
python3 -m convcov.cli info
# The property test first (a run stopped by TEST_TIMEOUT has checked every backend), then
# the rest in what is left of TEST_TIMEOUT.
export CONVCOV_HYPOTHESIS_PROFILE=${PROFILE:-gpu}
T0=$SECONDS
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -x -rs \
    tests/test_properties.py "$@" 2>&1 | tee "$OUT/pytest.log"
LEFT=$(( ${TEST_TIMEOUT:-300} - (SECONDS - T0) ))
timeout $(( LEFT > 1 ? LEFT : 1 )) python3 -m pytest -q -p no:cacheprovider -x -rs \
    --ignore=tests/test_properties.py "$@" 2>&1 | tee -a "$OUT/pytest.log"
[ -n "${SKIP_BENCH:-}" ] || timeout ${BENCH_TIMEOUT:-400} python3 -m convcov.cli bench --grad \
    --device cuda --json "$OUT/bench-h200.json" 2>&1 | tee "$OUT/bench.log"
