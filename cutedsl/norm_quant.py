"""Row norms with an FP8 output, written in CuTeDSL: RMSNorm, residual add + RMSNorm, LayerNorm,
each scaled by ``1 / scale``, clamped to the FP8 format's finite range and rounded to it.

This file is compiled when the wheel is built (cmake/cutedsl.py): every variant of VARIANTS for
each arch of the module, into a cubin that csrc/norm_quant.cu launches through the CUDA runtime.
Nothing here is imported at run time, so a server needs neither the DSL nor a compile.

One CTA normalizes one row. Pass 1 reads the row in VEC-element accesses (16 bytes of 16-bit
input for VEC 8), VECS_PER_THREAD of them a thread issued before any is used, and sums what the
statistic needs (the fused add sums the float32 sum input + residual, which the norm uses, while
the residual gets it rounded); a block reduction follows (LayerNorm reduces two sums at once, of
x - c and (x - c)^2 with c the row's first element, so its variance is not the difference of two
large sums). Pass 2 reads the weights and writes FP8. Between the passes the row waits in
registers where one group of accesses covers it (hidden up to MAX_THREADS * VECS_PER_THREAD
accesses: 16384 16-bit elements), else in shared memory as float32, which takes any hidden size up
to the shared memory of a block: the "staging" axis of the variants. Registers keep the row's
bytes off shared memory and let every load of a thread be in flight at once (bf16 4096 x 4096:
0.75 of a same-size copy staged, against the C++ norms' 0.96 with the row in registers). With the
row in registers the weights are read after the reduction, from L1 (every row of an SM reads the
same ones), or, where the grid fits on the SMs at once and latency rules, right after the row:
"registers_weights_first", whose weights' load overlaps the row's (LayerNorm's float32 gamma
and beta cost 112 registers a thread then, which only a grid of one block an SM affords).

Every tensor argument is a cute.Tensor whose rows and hidden size are ``cute.sym_int()`` and whose
row stride is dynamic: the kernel's parameters are those tensors' descriptors (pointer, dynamic
shape, dynamic stride), which cmake/cutedsl.py writes out as C structs and checks against the
parameter sizes the compiled kernel declares. FP8 tensors are passed as Uint8 views.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8

#: Compile-time constants, each an axis of the variant table in this order (cmake/cutedsl.py
#: compiles the product; csrc/norm_quant.cu indexes it with the same axes).
VARIANTS = {
    "kind": ("rmsnorm", "fused_add_rmsnorm", "layernorm"),
    "input": ("float16", "bfloat16"),
    "out": ("float8_e4m3fn", "float8_e5m2"),
    "vec": (8, 1),  # elements per access: 8 (16-byte rows, pointers and strides), else 1
    # where the row waits between the passes (and, in registers, when the weights are read)
    "staging": ("registers", "registers_weights_first", "shared"),
}

DTYPES = {
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
    "float32": cutlass.Float32,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
}


#: Block size: one thread per VECS_PER_THREAD accesses of a row, in whole warps, at most
#: MAX_THREADS. csrc/norm_quant.cu computes the same from the generated header's copies.
VECS_PER_THREAD = 4
MAX_THREADS = 512  # at most 64 registers a thread for 1024; and WARP_SLOTS / 2 warps for LayerNorm
#: Shared memory: WARP_SLOTS floats for the block reduction, then the row as float32.
WARP_SLOTS = 32
#: The constants above, which cmake/cutedsl.py writes into the generated header for the launcher.
LAUNCH_CONSTANTS = ("VECS_PER_THREAD", "MAX_THREADS", "WARP_SLOTS")

#: The kernel's arguments, in order, as cmake/cutedsl.py describes them to C++: a tensor of
#: rank 2 (rows, hidden) with a dynamic row stride, a tensor of rank 1 (hidden), a float32
#: tensor of shape (1,), or a scalar.
PARAMS = (
    ("out", "rows"),
    ("input", "rows"),
    ("residual", "rows"),
    ("weight", "vector"),
    ("bias", "vector"),
    ("scale", "scalar_tensor"),
    ("scale_value", "float"),
    ("scale_on_device", "int"),
    ("eps", "float"),
    ("trigger_early", "int"),
)


def weight_dtype(kind: str, input: str) -> str:
    """RMSNorm's weight has the input's dtype; LayerNorm's gamma and beta are float32."""
    return "float32" if kind == "layernorm" else input


def block_threads(hidden: int, vec: int) -> int:
    accesses = -(-hidden // vec)
    warps = -(-accesses // (VECS_PER_THREAD * 32))
    return min(max(warps, 1) * 32, MAX_THREADS)


def in_registers(hidden: int, vec: int) -> bool:
    """Whether one group of accesses covers the row (the "registers" staging)."""
    return -(-hidden // vec) <= MAX_THREADS * VECS_PER_THREAD


def smem_bytes(hidden: int, staging: str) -> int:
    return (WARP_SLOTS + (hidden if staging == "shared" else 0)) * 4


class NormQuantKernel:
    """out[r] = fp8(clamp(norm(x[r]) * weight (+ bias) / scale)), x = input (+ residual).

    Grid:  (rows, 1, 1)
    Block: (block_threads(hidden, vec), 1, 1), dynamic shared memory smem_bytes(hidden, staging);
    staging "registers*" only where in_registers(hidden, vec).
    """

    def __init__(self, kind: str, input: str, out: str, vec: int, staging: str):
        self.kind = kind
        self.vec = vec
        self.staged = staging == "shared"
        self.weights_first = staging == "registers_weights_first"
        self.in_dtype = DTYPES[input]
        self.out_dtype = DTYPES[out]

    @cute.jit
    def __call__(
        self,
        mOut: cute.Tensor,
        mInput: cute.Tensor,
        mResidual: cute.Tensor,
        mWeight: cute.Tensor,
        mBias: cute.Tensor,
        mScale: cute.Tensor,
        scale_value: Float32,
        scale_on_device: Int32,
        eps: Float32,
        trigger_early: Int32,
        stream,
    ):
        """JIT entry point (the in-process path): launches as csrc/norm_quant.cu does."""
        hidden = mInput.shape[1]
        accesses = (hidden + self.vec - 1) // self.vec
        warps = (accesses + VECS_PER_THREAD * 32 - 1) // (VECS_PER_THREAD * 32)
        threads = cutlass.min(cutlass.max(warps, 1) * 32, MAX_THREADS)
        self.kernel(
            mOut, mInput, mResidual, mWeight, mBias, mScale, scale_value, scale_on_device, eps, trigger_early
        ).launch(
            grid=[mInput.shape[0], 1, 1],
            block=[threads, 1, 1],
            smem=(WARP_SLOTS + (hidden if cutlass.const_expr(self.staged) else 0)) * 4,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mOut: cute.Tensor,
        mInput: cute.Tensor,
        mResidual: cute.Tensor,
        mWeight: cute.Tensor,
        mBias: cute.Tensor,
        mScale: cute.Tensor,
        scale_value: Float32,
        scale_on_device: Int32,
        eps: Float32,
        trigger_early: Int32,
    ):
        tid = Int32(cute.arch.thread_idx()[0])
        row = cute.arch.block_idx()[0]
        threads = Int32(cute.arch.block_dim()[0])
        hidden = mInput.shape[1]

        smem = cute.arch.get_dyn_smem(Float32, 16)
        sWarp = cute.make_tensor(smem, cute.make_layout(WARP_SLOTS))  # (WARP_SLOTS)
        gInput = cute.zipped_divide(mInput[row, None], (self.vec,))  # (VEC, accesses)
        gResidual = cute.zipped_divide(mResidual[row, None], (self.vec,))
        gWeight = cute.zipped_divide(mWeight, (self.vec,))
        gBias = cute.zipped_divide(mBias, (self.vec,))
        gOut = cute.zipped_divide(cute.recast_tensor(mOut[row, None], self.out_dtype), (self.vec,))
        accesses = Int32(cute.size(gInput, mode=[1]))

        # Reads only from here on: with programmatic dependent launch, what the previous kernel
        # wrote is visible after this wait. The next kernel may launch right after it where the
        # grid fits on the SMs at once (trigger_early, the launcher's choice), else at the end.
        cute.arch.griddepcontrol_wait()
        if trigger_early != 0:
            cute.arch.griddepcontrol_launch_dependents()
        # The scale's load is in flight while the row is read.
        scale = scale_value
        if scale_on_device != 0:
            scale = mScale[0]
        shift = Float32(0.0)
        if cutlass.const_expr(self.kind == "layernorm"):
            shift = mInput[row, 0].to(Float32)

        if cutlass.const_expr(self.staged):
            sRow = cute.zipped_divide(cute.make_tensor(smem + WARP_SLOTS, cute.make_layout(hidden)), (self.vec,))
            self.staged_passes(gInput, gResidual, gWeight, gBias, gOut, sRow, sWarp, accesses, hidden, shift, scale,
                               eps, tid, threads)
        else:
            self.register_passes(gInput, gResidual, gWeight, gBias, gOut, sWarp, accesses, hidden, shift, scale,
                                 eps, tid, threads)
        if trigger_early == 0:
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def register_passes(self, gInput, gResidual, gWeight, gBias, gOut, sWarp, accesses, hidden, shift, scale, eps,
                        tid, threads):
        """Both passes over a row that one group of accesses covers: thread tid holds accesses
        tid, tid + threads, ... in registers from pass 1 to pass 2. Pass 1 uses every load whether
        or not its access exists (a missing one counts zero), so none waits behind a branch."""
        xs = self.load_group(gInput, tid, threads, accesses, self.in_dtype)
        if cutlass.const_expr(self.kind == "fused_add_rmsnorm"):
            rs = self.load_group(gResidual, tid, threads, accesses, self.in_dtype)
        if cutlass.const_expr(self.weights_first):
            ws = self.load_group(gWeight, tid, threads, accesses, gWeight.element_type)
            if cutlass.const_expr(self.kind == "layernorm"):
                bs = self.load_group(gBias, tid, threads, accesses, gBias.element_type)
        total = Float32(0.0)
        squares = Float32(0.0)
        sums = []  # the fused add's float32 sums, kept for pass 2
        for k in cutlass.range_constexpr(VECS_PER_THREAD):
            present = Float32(cutlass.min(cutlass.max(accesses - (tid + k * threads), 0), 1))  # 1 or 0
            x = xs[k].load().to(Float32)
            if cutlass.const_expr(self.kind == "fused_add_rmsnorm"):
                x = x + rs[k].load().to(Float32)
                summed = cute.make_rmem_tensor_like(xs[k], Float32)
                summed.store(x)
                sums.append(summed)
            access_total, access_squares = self.access_sums(x, shift)
            total = total + access_total * present
            squares = squares + access_squares * present
        if cutlass.const_expr(self.kind == "fused_add_rmsnorm"):
            for k in cutlass.range_constexpr(VECS_PER_THREAD):
                j = tid + k * threads
                if j < accesses:
                    gResidual[(None, j)].store(sums[k].load().to(self.in_dtype))

        mean, rstd = self.statistics(total, squares, sWarp, hidden, shift, eps, tid, threads)
        inv_scale = Float32(1.0) / scale
        # Otherwise the weights after the reduction: every row of an SM reads the same ones, from L1.
        # LayerNorm's float32 gamma and beta are then read an access at a time (all at once: 112
        # registers a thread).
        if cutlass.const_expr(not self.weights_first and self.kind != "layernorm"):
            ws = self.load_group(gWeight, tid, threads, accesses, gWeight.element_type)
        for k in cutlass.range_constexpr(VECS_PER_THREAD):
            j = tid + k * threads
            if j < accesses:
                if cutlass.const_expr(self.kind == "fused_add_rmsnorm"):
                    x = sums[k].load()
                else:
                    x = xs[k].load().to(Float32)
                if cutlass.const_expr(self.kind != "layernorm"):
                    self.store_quantized(gOut, j, x, ws[k], None, mean, rstd, inv_scale)
                elif cutlass.const_expr(self.weights_first):
                    self.store_quantized(gOut, j, x, ws[k], bs[k], mean, rstd, inv_scale)
                else:
                    self.store_quantized(gOut, j, x, gWeight[(None, j)], gBias[(None, j)], mean, rstd, inv_scale)

    @cute.jit
    def staged_passes(self, gInput, gResidual, gWeight, gBias, gOut, sRow, sWarp, accesses, hidden, shift, scale, eps,
                      tid, threads):
        """Both passes over a row of any length: pass 1 stages it in shared memory as float32 (the
        fused add's float32 sum), group by group; pass 2 reads it back."""
        total = Float32(0.0)
        squares = Float32(0.0)
        step = threads * VECS_PER_THREAD
        for base in cutlass.range(tid, accesses, step):
            xs = self.load_group(gInput, base, threads, accesses, self.in_dtype)
            if cutlass.const_expr(self.kind == "fused_add_rmsnorm"):
                rs = self.load_group(gResidual, base, threads, accesses, self.in_dtype)
            for k in cutlass.range_constexpr(VECS_PER_THREAD):
                j = base + k * threads
                if j < accesses:
                    x = xs[k].load().to(Float32)
                    if cutlass.const_expr(self.kind == "fused_add_rmsnorm"):
                        x = x + rs[k].load().to(Float32)
                        gResidual[(None, j)].store(x.to(self.in_dtype))
                    sRow[(None, j)].store(x)
                    access_total, access_squares = self.access_sums(x, shift)
                    total = total + access_total
                    squares = squares + access_squares

        mean, rstd = self.statistics(total, squares, sWarp, hidden, shift, eps, tid, threads)
        inv_scale = Float32(1.0) / scale
        for base in cutlass.range(tid, accesses, step):
            xs = self.load_group(sRow, base, threads, accesses, Float32)
            ws = self.load_group(gWeight, base, threads, accesses, gWeight.element_type)
            if cutlass.const_expr(self.kind == "layernorm"):
                bs = self.load_group(gBias, base, threads, accesses, gBias.element_type)
            for k in cutlass.range_constexpr(VECS_PER_THREAD):
                j = base + k * threads
                if j < accesses:
                    self.store_quantized(gOut, j, xs[k].load(), ws[k],
                                         bs[k] if cutlass.const_expr(self.kind == "layernorm") else None,
                                         mean, rstd, inv_scale)

    @cute.jit
    def access_sums(self, x, shift: Float32):
        """One access's share of the statistic: the sums of x - shift and (x - shift)^2 for
        LayerNorm, (0, sum of x^2) for RMSNorm."""
        total = Float32(0.0)
        squares = Float32(0.0)
        for i in cutlass.range_constexpr(self.vec):
            if cutlass.const_expr(self.kind == "layernorm"):
                total = total + (x[i] - shift)
                squares = squares + (x[i] - shift) * (x[i] - shift)
            else:
                squares = squares + x[i] * x[i]
        return total, squares

    @cute.jit
    def statistics(self, total: Float32, squares: Float32, sWarp: cute.Tensor, hidden, shift: Float32, eps: Float32,
                   tid: Int32, threads: Int32):
        """(mean, 1 / std) of the row from the thread's sums: of x^2, or for LayerNorm of x - shift
        and its square."""
        mean = Float32(0.0)
        if cutlass.const_expr(self.kind == "layernorm"):
            total, squares = self.block_sum2(total, squares, sWarp, tid, threads)
            shifted_mean = total / Float32(hidden)
            mean = shift + shifted_mean
            variance = squares / Float32(hidden) - shifted_mean * shifted_mean
            squares = cutlass.max(variance, Float32(0.0)) * Float32(hidden)
        else:
            squares = self.block_sum(squares, sWarp, tid, threads)
        return mean, cute.math.rsqrt(squares / Float32(hidden) + eps)

    @cute.jit
    def store_quantized(self, gOut: cute.Tensor, j: Int32, x, w, b, mean: Float32, rstd: Float32, inv_scale: Float32):
        """Access j of the output: x normalized, weighted (and shifted), scaled, clamped to the FP8
        format's finite range and rounded to it (rstd * inv_scale is one product a thread)."""
        if cutlass.const_expr(self.kind == "layernorm"):
            y = (x - mean) * (rstd * inv_scale) * w.load().to(Float32) + b.load().to(Float32) * inv_scale
        else:
            y = x * (rstd * inv_scale) * w.load().to(Float32)
        # The conversion saturates (cvt.rn.satfinite): values past the format's largest finite one,
        # infinities included, become it, which is the clamp; NaN stays NaN.
        gOut[(None, j)].store(y.to(self.out_dtype))

    @cute.jit
    def load_group(self, gRow: cute.Tensor, base: Int32, threads: Int32, accesses: Int32, dtype):
        """Registers holding accesses base, base + threads, ... (VECS_PER_THREAD of them) of a
        (VEC, accesses) view. Past the end the last access is read again (callers skip those):
        loads without branches, so all of them are in flight before the first is used."""
        group = []
        for k in cutlass.range_constexpr(VECS_PER_THREAD):
            fragment = cute.make_rmem_tensor_like(gRow[(None, 0)], dtype)
            fragment.store(gRow[(None, cutlass.min(base + k * threads, accesses - 1))].load())
            group.append(fragment)
        return group

    @cute.jit
    def block_sum2(self, a: Float32, b: Float32, sWarp: cute.Tensor, tid: Int32, threads: Int32):
        """The sums of ``a`` and of ``b`` over the block (at most WARP_SLOTS / 2 warps), in every thread."""
        a = cute.arch.warp_reduction_sum(a)
        b = cute.arch.warp_reduction_sum(b)
        if tid % 32 == 0:
            sWarp[tid // 32] = a
            sWarp[WARP_SLOTS // 2 + tid // 32] = b
        cute.arch.barrier()
        a = Float32(0.0)
        b = Float32(0.0)
        if tid % 32 < threads // 32:
            a = sWarp[tid % 32]
            b = sWarp[WARP_SLOTS // 2 + tid % 32]
        return cute.arch.warp_reduction_sum(a), cute.arch.warp_reduction_sum(b)

    @cute.jit
    def block_sum(self, value: Float32, sWarp: cute.Tensor, tid: Int32, threads: Int32) -> Float32:
        """The sum of ``value`` over the block, in every thread."""
        value = cute.arch.warp_reduction_sum(value)
        if tid % 32 == 0:
            sWarp[tid // 32] = value
        cute.arch.barrier()
        value = Float32(0.0)
        if tid % 32 < threads // 32:
            value = sWarp[tid % 32]
        return cute.arch.warp_reduction_sum(value)


def fake_arguments(kind: str, input: str, out: str, vec: int):
    """Descriptions of the kernel's arguments for cute.compile: dynamic rows, hidden size (a
    multiple of vec) and row strides; pointers aligned to vec elements."""
    rows = cute.sym_int()
    hidden = cute.sym_int(divisibility=vec)
    in_type, w_type = DTYPES[input], DTYPES[weight_dtype(kind, input)]

    def rows_of(dtype):
        return cute.runtime.make_fake_tensor(
            dtype, (rows, hidden), stride=(cute.sym_int64(divisibility=vec), 1), assumed_align=vec * dtype.width // 8
        )

    def vector_of(dtype):
        return cute.runtime.make_fake_tensor(dtype, (hidden,), stride=(1,), assumed_align=vec * dtype.width // 8)

    return (
        rows_of(Uint8),  # out: FP8 as bytes
        rows_of(in_type),  # input
        rows_of(in_type),  # residual (read by the fused add only)
        vector_of(w_type),  # weight, LayerNorm's gamma
        vector_of(w_type),  # bias: LayerNorm's beta (read by LayerNorm only)
        cute.runtime.make_fake_tensor(Float32, (1,), stride=(1,), assumed_align=4),  # scale
        Float32(1.0),  # scale_value
        Int32(0),  # scale_on_device
        Float32(1e-6),  # eps
        Int32(0),  # trigger_early
    )


@functools.cache
def compile_variant(kind: str, input: str, out: str, vec: int, staging: str, options: str = ""):
    """The compiled kernel of one variant, cached on every compile-time constant (and the
    compile options, which carry the target arch)."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        NormQuantKernel(kind, input, out, vec, staging),
        *fake_arguments(kind, input, out, vec),
        stream,
        options=options,
    )
