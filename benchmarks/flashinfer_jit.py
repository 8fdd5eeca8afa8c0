"""FlashInfer's attention kernels as baselines for bench_prefill.py and bench_decode.py, timed in the
same process as ours.

FlashInfer compiles these kernels at their first call (JIT), and the GPU machine cannot download
FlashInfer. So they are built here, on a machine without a GPU, and the built modules are carried:

    python benchmarks/flashinfer_jit.py build DIR      # needs flashinfer-python and nvcc
    python benchmarks/bench_prefill.py --flashinfer DIR
    python benchmarks/bench_decode.py --flashinfer DIR

`build` runs FlashInfer's own JIT build for sm_90a (bf16, no soft cap, no window) and copies each
module into DIR: its Hopper single prefill ("fa3") at head_dim 64, 128 and 256, both its single
prefills ("fa2", "fa3") at DeepSeek's head dims (192 for q and k, 128 for v), and at head_dim 128
its batch decode (the CUDA-core kernel) and its batch prefill ("fa2", which its decode wrapper runs
with use_tensor_cores=True). `build DIR NAME ...` builds only the modules named. A module binds through tvm-ffi, so loading one needs neither FlashInfer
nor a compiler; the calls below pass the arguments its Python wrappers pass. What the build needs
beside nvcc: CUTLASS's utility headers include curand_kernel.h (`pip install nvidia-curand`, its
include directory on CPATH), and the modules link libcuda, whose stub a toolkit without a driver
may lack (any shared object named libcuda.so with the soname libcuda.so.1 on LIBRARY_PATH does: the
process that loads a module has the real one).
"""

import os
import shutil
import sys


def _path(directory, name):
    return os.path.join(directory, name + ".so")


def _load(directory, name):
    import tvm_ffi

    path = _path(directory, name)
    return tvm_ffi.load_module(path) if directory and os.path.exists(path) else None


def serve_prebuilt(directory):
    """Hand FlashInfer's own wrappers (``import flashinfer``: its Python package on the timing
    machine) the modules built into DIR: its JIT loads them instead of compiling (the batch
    prefill module for every prefill spec, the decode module for the rest, so the wrappers must ask
    for this build's variant: bf16, head_dim 128, no window, no soft cap)."""
    import tvm_ffi
    from flashinfer.jit.core import JitSpec

    if not getattr(JitSpec, "_prebuilt_directory", None):
        JitSpec.build_and_load = lambda spec: tvm_ffi.load_module(
            _path(directory, "prefill_fa2_d128" if "prefill" in spec.name else "decode_d128"))
        JitSpec._prebuilt_directory = directory


def build(directory, names=()):
    import torch

    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    from flashinfer.jit.attention.modules import (
        gen_batch_decode_module,
        gen_batch_mla_module,
        gen_batch_prefill_module,
        gen_single_prefill_module,
    )

    b = torch.bfloat16
    # (dtypes, head dims, pos_encoding_mode, sliding window, soft cap[, fp16 qk reduction])
    specs = {f"fa3_d{d}": lambda d=d: gen_single_prefill_module("fa3", b, b, b, d, d, 0, False, False, False) for d in (64, 128, 256)}
    for backend in ("fa2", "fa3"):
        specs[f"{backend}_d192"] = lambda backend=backend: gen_single_prefill_module(backend, b, b, b, 192, 128, 0, False, False, False)
    for backend in ("fa2", "fa3"):  # MLA's batch module: 512-dim latent, 64-dim rotary part
        specs[f"mla_{backend}"] = lambda backend=backend: gen_batch_mla_module(backend, b, b, b, torch.int32, 512, 64, False)
    specs["decode_d128"] = lambda: gen_batch_decode_module(b, b, b, torch.int32, 128, 128, 0, False, False)
    specs["prefill_fa2_d128"] = lambda: gen_batch_prefill_module("fa2", b, b, b, torch.int32, 128, 128, 0, False, False, False)
    os.makedirs(directory, exist_ok=True)
    for name, make in specs.items():
        if names and name not in names:
            continue
        spec = make()
        spec.build(verbose=False)
        shutil.copy(spec.get_library_path(), _path(directory, name))
        print(_path(directory, name))


class SinglePrefill:
    """single_prefill_with_kv_cache on FlashInfer's Hopper kernel ("fa3"), or at head_dim 192 (v's
    128) either backend: NHD q, k, v."""

    def __init__(self, directory, head_dim, backend="fa3"):
        self.module = _load(directory, f"{backend}_d{head_dim}")
        self.backend = backend
        self.scratch = None

    def available(self):
        return self.module is not None

    def __call__(self, q, k, v, out, causal):
        import torch

        if self.scratch is None:
            self.scratch = torch.empty(32 << 20, dtype=torch.uint8, device=q.device)
        # (q, k, v, tmp, out, lse, mask mode: 1 causal, layout: 0 NHD, window_left, then the
        # variant's: fa3 scale_v tensor, logits_soft_cap, sm_scale, scale_v scalar; fa2 custom
        # mask, ALiBi slopes, k and v scale factors, logits_soft_cap, sm_scale, 1 / rope_scale,
        # 1 / rope_theta)
        common = (q, k, v, self.scratch, out, None, int(causal), 0, -1)
        if self.backend == "fa3":
            self.module.run(*common, None, 0.0, q.shape[-1] ** -0.5, 1.0)
        else:
            self.module.run(*common, None, None, None, None, 0.0, q.shape[-1] ** -0.5, 1.0, 1e-4)


class BatchDecode:
    """BatchDecodeWithPagedKVCacheWrapper's plan and run, NHD, head_dim 128: its CUDA-core kernel,
    or with `tensor_cores` its prefill kernel (FlashInfer's use_tensor_cores=True)."""

    def __init__(self, directory, tensor_cores):
        self.tensor_cores = tensor_cores
        self.module = _load(directory, "prefill_fa2_d128" if tensor_cores else "decode_d128")

    def available(self):
        return self.module is not None

    def plan(self, indptr, indices, last_page_len, qo_heads, kv_heads, page_size, q_dtype):
        import torch

        device = indptr.device
        self.float_ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self.int_ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)
        self.pinned_ws = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
        self.indptr, self.indices, self.last = indptr, indices, last_page_len
        self.sm_scale = 128**-0.5
        batch = indptr.numel() - 1
        indptr_host = indptr.cpu()
        if self.tensor_cores:
            kv_lens = ((indptr_host[1:] - indptr_host[:-1] - 1) * page_size + last_page_len.cpu()).int()
            qo_indptr_host = torch.arange(batch + 1, dtype=torch.int32)
            self.qo_indptr = qo_indptr_host.to(device)
            # (..., total rows, batch, heads, page_size, cuda graph, head dims, causal, window_left,
            # fixed_split_size, disable_split_kv, num_colocated_ctas, uniform_q_len)
            self.plan_info = self.module.plan(self.float_ws, self.int_ws, self.pinned_ws, qo_indptr_host, indptr_host,
                                              kv_lens, batch, batch, qo_heads, kv_heads, page_size, False, 128, 128,
                                              False, -1, -1, False, 0, 0)  # fmt: skip
        else:
            self.plan_info = self.module.plan(self.float_ws, self.int_ws, self.pinned_ws, indptr_host, batch, qo_heads,
                                              kv_heads, page_size, False, -1, 0.0, 128, 128,
                                              torch.empty(0, dtype=q_dtype), torch.empty(0, dtype=q_dtype))  # fmt: skip

    def run(self, q, cache, out):
        k, v = cache
        # The variant's additional arguments: tensors (None), then logits_soft_cap, sm_scale and the
        # rope reciprocals FlashInfer passes for rope_scale 1 and rope_theta 1e4.
        if self.tensor_cores:
            self.module.paged_run(self.float_ws, self.int_ws, self.plan_info, q, k, v, self.qo_indptr, self.indptr,
                                  self.indices, self.last, out, None, 0, 0, -1, False, None, None, None, None, None,
                                  None, None, None, 0.0, self.sm_scale, 1.0, 1e-4, 0)  # fmt: skip
        else:
            self.module.run(self.float_ws, self.int_ws, self.plan_info, q, k, v, self.indptr, self.indices, self.last,
                            out, None, 0, -1, False, None, 0.0, self.sm_scale, 1.0, 1e-4)  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "build":
        sys.exit(__doc__)
    build(sys.argv[2], sys.argv[3:])
