#!/usr/bin/env bash
# Installs the CUDA compiler, runtime headers and CCCL of one CUDA version from NVIDIA's RHEL 8
# packages, in a manylinux_2_28 (AlmaLinux 8) container: cibuildwheel's before-all step.
#   usage: ci/install_cuda.sh CUDA_VERSION      (e.g. 12.9 or 13.0; default: $CUDA_VERSION)
set -euo pipefail
version=${1:-${CUDA_VERSION:?give the CUDA version, like 13.0}}
case "$(uname -m)" in
  x86_64) repo_arch=x86_64 ;;
  aarch64) repo_arch=sbsa ;;
  *) echo "install_cuda.sh: no CUDA packages for $(uname -m)" >&2; exit 1 ;;
esac
dashed=${version/./-}
dnf install -y dnf-plugins-core
dnf config-manager --add-repo "https://developer.download.nvidia.com/compute/cuda/repos/rhel8/${repo_arch}/cuda-rhel8.repo"
dnf install -y "cuda-nvcc-${dashed}" "cuda-cudart-devel-${dashed}" "cuda-cccl-${dashed}" "cuda-crt-${dashed}" \
  || dnf install -y "cuda-nvcc-${dashed}" "cuda-cudart-devel-${dashed}" "cuda-cccl-${dashed}"  # crt is in nvcc before 12.x
ln -sfn "/usr/local/cuda-${version}" /usr/local/cuda
/usr/local/cuda/bin/nvcc --version
