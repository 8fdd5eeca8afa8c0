"""FlashInfer's Hopper prefill kernel (its "fa3" backend) as a baseline for bench_prefill.py, timed in
the same process as ours.

FlashInfer compiles that kernel at its first call (JIT), and the GPU machine cannot download it. So
it is built here, on a machine without a GPU, and the built modules are carried there:

    python benchmarks/flashinfer_fa3.py build DIR      # needs flashinfer-python, nvcc, ~3 min a head_dim
    python benchmarks/bench_prefill.py --flashinfer-fa3 DIR

`build` runs FlashInfer's own JIT build of its single-prefill module (bf16, no soft cap, no window)
for sm_90a at head_dim 64, 128 and 256, and copies each module to DIR/fa3_d{head_dim}.so. A module
binds through tvm-ffi, so loading it needs neither FlashInfer nor a compiler. What the build needs
beside nvcc: CUTLASS's utility headers include curand_kernel.h (`pip install nvidia-curand`, its
include directory on CPATH), and the module links libcuda, whose stub a toolkit without a driver may
lack (any shared object named libcuda.so with the soname libcuda.so.1 on LIBRARY_PATH: the process
that loads the module has the real one).
"""

import os
import shutil
import sys

MODULE_NAME = "fa3_d{}.so"
HEAD_DIMS = (64, 128, 256)


def build(directory):
    import torch
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    from flashinfer.jit.attention.modules import gen_single_prefill_module

    os.makedirs(directory, exist_ok=True)
    for head_dim in HEAD_DIMS:
        # (backend, q, kv, out dtypes, head dims, pos_encoding_mode, sliding window, soft cap, fp16 qk reduction)
        spec = gen_single_prefill_module("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, head_dim, head_dim, 0,
                                         False, False, False)  # fmt: skip
        spec.build(verbose=False)
        shutil.copy(spec.get_library_path(), os.path.join(directory, MODULE_NAME.format(head_dim)))
        print(f"head_dim {head_dim}: {os.path.join(directory, MODULE_NAME.format(head_dim))}")


class SinglePrefill:
    """FlashInfer's single_prefill_with_kv_cache on its Hopper kernel, from a built module: NHD q, k, v."""

    def __init__(self, directory, head_dim):
        import tvm_ffi

        path = os.path.join(directory, MODULE_NAME.format(head_dim))
        self.module = tvm_ffi.load_module(path) if os.path.exists(path) else None
        self.scratch = None

    def available(self):
        return self.module is not None

    def __call__(self, q, k, v, out, causal):
        import torch

        if self.scratch is None:
            self.scratch = torch.empty(32 << 20, dtype=torch.uint8, device=q.device)
        sm_scale = q.shape[-1] ** -0.5
        # (q, k, v, tmp, out, lse, mask mode: 1 causal, layout: 0 NHD, window_left, then the variant's
        # scale_v tensor, logits_soft_cap, sm_scale, scale_v scalar)
        self.module.run(q, k, v, self.scratch, out, None, int(causal), 0, -1, None, 0.0, sm_scale, 1.0)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        sys.exit(__doc__)
    build(sys.argv[2])
