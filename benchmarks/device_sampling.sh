#!/bin/bash
# Build for 9.0a, run the sampling tests (and those that cover every op), memcheck a small case,
# then the benchmark; logs under $OUT. Used from the device machine: bash benchmarks/device_sampling.sh [bench args]
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --target /tmp/site ../.whl/apache_tvm_ffi-*.whl 2>&1 | tail -2
( time AOTINFER_CUDA_ARCH_LIST=9.0a CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-deps \
   --no-build-isolation --upgrade --target /tmp/site . -Cbuild-dir=/tmp/build ) > $OUT/build.txt 2>&1
tail -5 $OUT/build.txt
cd /tmp && timeout ${TEST_TIMEOUT:-300} python3 -m pytest $OLDPWD/tests/test_sampling.py -q -x -p no:cacheprovider ${TEST_ARGS} 2>&1 | tee $OUT/pytest.txt | tail -25
cd $OLDPWD
if [ -n "$BENCH" ]; then timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_sampling.py $BENCH 2>&1 | tee $OUT/bench.txt; fi
if [ -n "$SANITIZE" ]; then
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool python3 benchmarks/sanitize_sampling.py 2>&1 | tail -4 | tee -a $OUT/sanitize.txt
  done
fi
