#!/bin/bash
# The sampling checks on the device machine, from a carried source tree whose ../dist holds the
# wheel to test (built elsewhere for 9.0a) and, optionally, ../dist/base a baseline wheel to
# time beside it in the same run; the tvm-ffi wheel in ../../.whl. Logs under $OUT.
#   TESTS=1 BENCH="--vocab 128256" SANITIZE=1 bash benchmarks/device_sampling.sh
# TESTS: run tests/test_sampling.py; BENCH (and BENCH2): bench_sampling.py's arguments (baseline
# first where there is one and NOBASE is unset, then the wheel); SANITIZE: memcheck (and racecheck with RACECHECK=1) of sanitize_sampling.py.
set -x
export PYTHONUNBUFFERED=1
SITE=/tmp/site-sampling BASE=/tmp/site-sampling-base
rm -rf $SITE $BASE
python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE ../../.whl/*.whl ../dist/aotinfer-*.whl
if [ -z "$NOBASE" ] && ls ../dist/base/aotinfer-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $BASE ../../.whl/*.whl ../dist/base/aotinfer-*.whl
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ -n "$TESTS" ]; then
  PYTHONPATH=$SITE timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_sampling.py -q -x -p no:cacheprovider ${TEST_ARGS} 2>&1 | tee $OUT/pytest.txt | tail -8
fi
if [ -n "$BENCH" ]; then
  if [ -d $BASE ]; then
    echo "== baseline" | tee $OUT/bench.txt
    PYTHONPATH=$BASE timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_sampling.py $BENCH 2>&1 | tee -a $OUT/bench.txt
    if [ -n "$BENCH2" ]; then
      PYTHONPATH=$BASE timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_sampling.py $BENCH2 2>&1 | tee -a $OUT/bench.txt
    fi
  fi
  echo "== this branch" | tee -a $OUT/bench.txt
  PYTHONPATH=$SITE timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_sampling.py $BENCH 2>&1 | tee -a $OUT/bench.txt
  if [ -n "$BENCH2" ]; then
    PYTHONPATH=$SITE timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_sampling.py $BENCH2 2>&1 | tee -a $OUT/bench.txt
  fi
fi
if [ -n "$SANITIZE" ]; then
  for tool in memcheck ${RACECHECK:+racecheck}; do
    PYTHONPATH=$SITE timeout 200 compute-sanitizer --tool $tool python3 benchmarks/sanitize_sampling.py 2>&1 | tail -4 | tee -a $OUT/sanitize.txt
  done
fi
