#!/usr/bin/env bash
# GPU checks of an installed aotinfer: info, the GPU tests, a memcheck pass over scale's
# misaligned paths, and every op's benchmark. Logs go to LOG_DIR; the tables are printed last.
#   usage: ci/gpu_check.sh [LOG_DIR]     (run from the repository root)
set -uo pipefail
log=${1:-gpu-logs}
mkdir -p "$log"
status=0
run() {  # run NAME CMD...: output to $log/NAME.txt, remember failures
  local name=$1; shift
  echo "== $name: $*"
  "$@" >"$log/$name.txt" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then status=1; echo "   FAILED (exit $rc)"; fi
  tail -n 3 "$log/$name.txt"
}
export PYTHONUNBUFFERED=1
run nvidia-smi nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
run info python -m aotinfer info
run verify python -m aotinfer verify
run pytest-gpu python -m pytest tests -m gpu -v -rs
run pytest-all python -m pytest tests -q
if command -v compute-sanitizer >/dev/null; then
  run memcheck compute-sanitizer --tool memcheck --error-exitcode 9 \
    python -m pytest tests/test_scale.py -m gpu -q -k "misaligned or out_and_in_place or empty"
fi
# One benchmark a module, and the first import's cost (bench_import).
benches=(scale import norm activation norm_quant decode prefill sampling rope)
for b in "${benches[@]}"; do
  run "bench-$b" python "benchmarks/bench_$b.py"
done
echo "== tables"
for b in "${benches[@]}"; do cat "$log/bench-$b.txt"; done
exit $status
