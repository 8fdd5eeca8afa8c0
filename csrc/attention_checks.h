// Argument checks that the attention bindings (csrc/decode.cu, csrc/prefill.cu) share: the
// dtypes, tables and 16-byte rows their kernels read (each names the argument as the Python op
// does), the launch parameters both fill alike, and the capture guard of the wrappers' runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "aotinfer/attention.cuh"
#include "tvm_ffi_utils.h"

namespace aotinfer {

// A wrapper's run whose grid and tables a later plan replaces (one made without use_cuda_graph)
// passes `captured`, the address of a byte on the host that the wrapper owns; others pass 0 (an
// address, not a tensor: converting a tensor argument costs every run more). Where the launch is
// captured into a CUDA graph the binding sets the byte, and the wrapper's next plan refuses to run:
// the graph's replays would run the captured grid over that plan's tables
// (docs/design/overlay.md#capture-guard).
inline void RecordCapture(int64_t captured, cudaStream_t stream) {
  if (captured == 0) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    // The legacy stream asked while another thread captures: that capture is refused its launch.
    (void)cudaGetLastError();
    return;
  }
  if (status != cudaStreamCaptureStatusNone) *reinterpret_cast<uint8_t*>(captured) = 1;
}

// head_dim values with a kernel.
inline bool SupportedHeadDim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// The prefill kernels' other pair of head dims: DeepSeek's (MLA's prefill, before absorption) 192
// for q and k, 128 for v and the output.
constexpr int64_t kDeepSeekHeadDimQk = 192, kDeepSeekHeadDimVo = 128;

inline void CheckDtypeFp16(const TensorView& x, const char* name) {
  const uint32_t key = DtypeKey(x.dtype());
  if (key != DtypeKey(kDLFloat, 16) && key != DtypeKey(kDLBfloat, 16)) {
    AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype float16 or bfloat16, got " << x.dtype();
  }
}

inline void CheckDtype(const TensorView& x, DLDataType dtype, const char* name, const char* what) {
  if (x.dtype() != dtype) AOTINFER_THROW(TypeError) << "Expected " << name << " to be " << what << ", got " << x.dtype();
}

// A table of int32 rows [n, width] (width 0: 1-D), contiguous.
inline void CheckIndexTable(const TensorView& x, int64_t width, const char* name) {
  CheckDtype(x, DLDataType{kDLInt, 32, 1}, name, "int32");
  if (x.ndim() != (width ? 2 : 1) || (width && x.size(1) != width)) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [n" << (width ? ", " + std::to_string(width) : "")
                              << "], got " << ShapeString(x.shape());
  }
  CheckContiguous(x, name);
}

// Page ids index `cache`'s pages: a kernel reads an id beyond them as the last page (PageInCache),
// so there must be one when any id is given.
inline void CheckPagesForIndices(const TensorView& cache, const char* name, const TensorView& indices) {
  if (cache.size(0) == 0 && indices.numel() > 0) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have pages for the " << indices.numel()
                              << " page ids of indices, got shape " << ShapeString(cache.shape());
  }
}

// 16-byte rows of `elements` elements: where cp.async and vector stores can take them.
inline void CheckRows16(const TensorView& x, int64_t elements_per_16_bytes, const char* name, int outer_dims) {
  bool aligned = reinterpret_cast<uintptr_t>(data_ptr<char>(x)) % 16 == 0;
  for (int i = 0; i < outer_dims; ++i) aligned = aligned && (x.size(i) <= 1 || x.stride(i) % elements_per_16_bytes == 0);
  if (!aligned) {
    AOTINFER_THROW(ValueError) << "Expected the rows of " << name << " to start on 16-byte boundaries, got strides "
                              << ShapeString(x.strides());
  }
}

inline void CheckLastDimContiguous(const TensorView& x, const char* name) {
  if (x.size(-1) > 1 && x.stride(-1) != 1) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of " << name << " to be contiguous, got strides "
                              << ShapeString(x.strides());
  }
}

// An empty tensor (not requested) or a contiguous float32 tensor of `shape`.
inline bool CheckOptionalFloat(const TensorView& x, std::initializer_list<int64_t> shape, const char* name) {
  if (x.numel() == 0) return false;
  CheckDtype(x, DLDataType{kDLFloat, 32, 1}, name, "float32");
  bool same = size_t(x.ndim()) == shape.size();
  int i = 0;
  for (int64_t s : shape) same = same && x.size(i++) == s;
  if (!same) {
    std::string expected = "[";
    for (int64_t s : shape) expected += (expected.size() > 1 ? ", " : "") + std::to_string(s);
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape " << expected << "] or no elements, got "
                              << ShapeString(x.shape());
  }
  CheckContiguous(x, name);
  return true;
}

// q: [rows, num_qo_heads, head_dim], float16 or bfloat16, a head_dim with a kernel (or, where
// `deepseek_dims`, 192), 16-byte rows.
inline void CheckQuery(const TensorView& q, bool deepseek_dims = false) {
  CheckDim(3, q, "q");
  CheckDtypeFp16(q, "q");
  CheckLastDimContiguous(q, "q");
  if (!SupportedHeadDim(q.size(2)) && !(deepseek_dims && q.size(2) == kDeepSeekHeadDimQk)) {
    AOTINFER_THROW(ValueError) << "Expected head_dim 64, 128" << (deepseek_dims ? ", 256 or 192" : " or 256") << ", got "
                              << q.size(2) << " (q of shape " << ShapeString(q.shape()) << ")";
  }
  CheckRows16(q, 8, "q", 2);
}

inline void CheckKvLayout(int64_t kv_layout) {
  if (kv_layout != 0 && kv_layout != 1) {
    AOTINFER_THROW(ValueError) << "Expected kv_layout 0 (NHD) or 1 (HND), got " << kv_layout;
  }
}

inline void CheckHeads(int64_t num_qo_heads, int64_t num_kv_heads) {
  if (num_kv_heads == 0 || num_qo_heads % num_kv_heads != 0) {
    AOTINFER_THROW(ValueError) << "Expected num_qo_heads (" << num_qo_heads << ") to be a multiple of num_kv_heads ("
                              << num_kv_heads << ")";
  }
}

// sinks (float32 [num_qo_heads], or empty) and the scalar options; whether sinks were given.
inline bool CheckAttentionOptions(const TensorView& sinks, int64_t num_qo_heads, double sm_scale,
                                  double logits_soft_cap, int64_t window_left) {
  const bool has_sinks = CheckOptionalFloat(sinks, {num_qo_heads}, "sinks");
  if (!(sm_scale > 0.0) || !(logits_soft_cap >= 0.0) || window_left < -1) {
    AOTINFER_THROW(ValueError) << "Expected sm_scale > 0, logits_soft_cap >= 0 and window_left >= -1, got " << sm_scale
                              << ", " << logits_soft_cap << " and " << window_left;
  }
  return has_sinks;
}

// RoPE inside the kernel (pos_encoding_mode 1, FlashInfer's ROPE_LLAMA; 0: none) with its
// rope_scale and rope_theta, into p; whether the launch takes RoPE's kernels (16-bit caches of one
// head dim).
inline bool SetRope(AttentionParams& p, int64_t pos_encoding_mode, double rope_scale, double rope_theta, bool fp8,
                    int64_t head_dim, int64_t head_dim_vo) {
  if (pos_encoding_mode != 0 && pos_encoding_mode != 1) {
    AOTINFER_THROW(ValueError) << "Expected pos_encoding_mode 0 (NONE) or 1 (ROPE_LLAMA), got " << pos_encoding_mode;
  }
  p.rope_rcp_scale = 1.f;
  p.rope_log2_rcp_theta = 0.f;
  if (pos_encoding_mode == 0) return false;
  if (!(rope_scale > 0.0) || !(rope_theta > 0.0) || !std::isfinite(rope_scale) || !std::isfinite(rope_theta)) {
    AOTINFER_THROW(ValueError) << "Expected rope_scale and rope_theta to be positive and finite, got " << rope_scale
                              << " and " << rope_theta;
  }
  if (fp8) AOTINFER_THROW(NotImplementedError) << "pos_encoding_mode ROPE_LLAMA with an fp8 KV cache is not implemented";
  if (head_dim != head_dim_vo) {
    AOTINFER_THROW(NotImplementedError) << "pos_encoding_mode ROPE_LLAMA with head_dim_qk " << head_dim
                                        << " and head_dim_vo " << head_dim_vo << " is not implemented";
  }
  p.rope_rcp_scale = float(1.0 / rope_scale);
  p.rope_log2_rcp_theta = float(-std::log2(rope_theta));
  return true;
}

// Which of the optional outputs a launch writes.
struct AttentionOutputs {
  bool lse, partials;
};

// out like q but for its head_dim, head_dim_vo (v's); lse float32 [rows, num_qo_heads] or empty;
// partial_out [slots, num_qo_heads, head_dim_vo] and partial_lse [slots, num_qo_heads], float32,
// both given or both empty.
inline AttentionOutputs CheckAttentionOutputs(const TensorView& out, const TensorView& lse,
                                              const TensorView& partial_out, const TensorView& partial_lse,
                                              const TensorView& q, int64_t head_dim_vo) {
  const int64_t rows = q.size(0), num_qo_heads = q.size(1), head_dim = head_dim_vo;
  if (out.ndim() != 3 || out.size(0) != rows || out.size(1) != num_qo_heads || out.size(2) != head_dim) {
    AOTINFER_THROW(ValueError) << "Expected out to have shape [" << rows << ", " << num_qo_heads << ", " << head_dim
                              << "] (q's rows and heads, v's head_dim), got " << ShapeString(out.shape());
  }
  CheckSameDtype(out, q, "out", "q");
  CheckLastDimContiguous(out, "out");
  CheckRows16(out, 8, "out", 2);
  AttentionOutputs given{};
  given.lse = CheckOptionalFloat(lse, {rows, num_qo_heads}, "lse");
  const int64_t slots = partial_lse.numel() ? partial_lse.size(0) : 0;
  given.partials = CheckOptionalFloat(partial_lse, {slots, num_qo_heads}, "partial_lse");
  if (given.partials != CheckOptionalFloat(partial_out, {slots, num_qo_heads, head_dim}, "partial_out")) {
    AOTINFER_THROW(ValueError) << "Expected partial_out and partial_lse both empty or both given";
  }
  return given;
}

// The optional tensors that were given, on q's device.
inline void CheckOptionalDevices(const TensorView& sinks, bool has_sinks, const TensorView& lse,
                                 const TensorView& partial_out, const TensorView& partial_lse, AttentionOutputs given,
                                 const TensorView& q) {
  if (has_sinks) CheckSameDevice(sinks, q, "sinks", "q");
  if (given.lse) CheckSameDevice(lse, q, "lse", "q");
  if (given.partials) {
    CheckSameDevice(partial_out, q, "partial_out", "q");
    CheckSameDevice(partial_lse, q, "partial_lse", "q");
  }
}

// The AttentionParams fields that both bindings fill alike, from tensors already checked. k and v:
// the head on head_axis and the slot of a page on slot_axis, or slot_axis -1 for ragged KV
// ([tokens, heads, head_dim]: no page table, the token stride in stride_page). lse, the partials
// and sinks are empty when not given (`given`, has_sinks).
inline void SetAttentionParams(AttentionParams& p, const TensorView& out, const TensorView& lse,
                               const TensorView& partial_out, const TensorView& partial_lse, AttentionOutputs given,
                               const TensorView& q, const TensorView& k, const TensorView& v, int head_axis,
                               int slot_axis, const TensorView& indices, const TensorView& sinks, bool has_sinks,
                               int64_t batch, int64_t page_size, double sm_scale, double logits_soft_cap,
                               int64_t window_left) {
  const bool paged = slot_axis >= 0;
  p.out = data_ptr<char>(out);
  p.out_stride_n = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.lse = given.lse ? data_ptr<float>(lse) : nullptr;
  p.partial_out = given.partials ? data_ptr<float>(partial_out) : nullptr;
  p.partial_lse = given.partials ? data_ptr<float>(partial_lse) : nullptr;
  p.q = data_ptr<char>(q);
  p.q_stride_n = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k = data_ptr<char>(k);
  p.v = data_ptr<char>(v);
  p.k_stride_page = k.stride(0);
  p.k_stride_slot = paged ? k.stride(slot_axis) : 0;
  p.k_stride_head = k.stride(head_axis);
  p.v_stride_page = v.stride(0);
  p.v_stride_slot = paged ? v.stride(slot_axis) : 0;
  p.v_stride_head = v.stride(head_axis);
  p.indices = paged ? data_ptr<int32_t>(indices) : nullptr;
  p.last_page = uint32_t(std::clamp<int64_t>(k.size(0) - 1, 0, INT32_MAX));
  p.sinks = has_sinks ? data_ptr<float>(sinks) : nullptr;
  p.batch = int(batch);
  p.num_qo_heads = int(q.size(1));
  p.num_kv_heads = int(k.size(head_axis));
  p.group = p.num_qo_heads / p.num_kv_heads;
  p.page_size = PageDivisor(uint32_t(page_size));
  p.scale_log2 = float(sm_scale * 1.4426950408889634);
  p.soft_cap = float(logits_soft_cap);
  p.window_left = int(window_left);
}

}  // namespace aotinfer
