// Bindings of the RoPE kernel (include/aotinfer/rope.cuh): queries and keys rotated at positions
// given by pos_ids or by indptr/offsets, with frequencies computed (plain or Llama 3.1) or read from
// a cos/sin cache. Outputs first; an output may be its input itself (in place).
#include <cmath>

#include "aotinfer/rope.cuh"
#include "tvm_ffi_utils.h"

namespace {

// Heads [nnz, heads, dims] with the last dimension contiguous, from dim `from` on.
template <typename T>
aotinfer::RopeTensor<T> HeadsOf(const TensorView& x, int64_t from = 0) {
  return {aotinfer::data_ptr<std::remove_const_t<T>>(x) + from, x.stride(0), x.stride(1)};
}

// Plain RoPE's side: the head's dims past rotary_dim are its rest.
template <typename T, typename OutT>
aotinfer::RopeSide<T, OutT> SideOf(const TensorView& in, const TensorView& out, int64_t rotary_dim) {
  aotinfer::RopeSide<T, OutT> side;
  side.rot = HeadsOf<const T>(in);
  side.rest = HeadsOf<const T>(in, rotary_dim);
  side.rot_out = HeadsOf<OutT>(out);
  side.rest_out = HeadsOf<OutT>(out, rotary_dim);
  side.heads = int(in.size(1));
  return side;
}

void CheckHeads(const TensorView& x, const char* name) {
  aotinfer::CheckDim(3, x, name);
  if (x.size(2) > 1 && x.stride(2) != 1) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of " << name << " to be contiguous, got stride "
                              << x.stride(2);
  }
}

// An output beside its input: same shape and dtype, last dimension contiguous; either the input
// itself (in place) or, as the caller promises, not overlapping it.
void CheckOutput(const TensorView& out, const char* out_name, const TensorView& in, const char* in_name) {
  aotinfer::CheckSameShape(out, in, out_name, in_name);
  aotinfer::CheckSameDtype(out, in, out_name, in_name);
  CheckHeads(out, out_name);
  if (aotinfer::data_ptr<char>(out) == aotinfer::data_ptr<char>(in) &&
      (out.stride(0) != in.stride(0) || out.stride(1) != in.stride(1))) {
    AOTINFER_THROW(ValueError) << "Expected " << out_name << " to be " << in_name
                              << " itself (same strides) or not to overlap it";
  }
}

struct Frequencies {
  const float* cos_sin_cache = nullptr;
  double rope_scale = 1, rope_theta = 1e4;
  bool llama31 = false;
  double low_freq_factor = 1, high_freq_factor = 4, old_context_len = 8192;
};

void CheckFrequencies(const Frequencies& f) {
  if (f.cos_sin_cache != nullptr) return;
  if (!(f.rope_scale > 0 && std::isfinite(f.rope_scale))) {
    AOTINFER_THROW(ValueError) << "Expected rope_scale to be positive and finite, got " << f.rope_scale;
  }
  if (!(f.rope_theta > 0 && std::isfinite(f.rope_theta))) {
    AOTINFER_THROW(ValueError) << "Expected rope_theta to be positive and finite, got " << f.rope_theta;
  }
  if (!f.llama31) return;
  if (!(f.low_freq_factor > 0 && f.high_freq_factor > f.low_freq_factor && std::isfinite(f.high_freq_factor))) {
    AOTINFER_THROW(ValueError) << "Expected 0 < low_freq_factor < high_freq_factor, got low_freq_factor "
                              << f.low_freq_factor << " and high_freq_factor " << f.high_freq_factor;
  }
  if (!(f.old_context_len > 0 && std::isfinite(f.old_context_len))) {
    AOTINFER_THROW(ValueError) << "Expected old_context_len to be positive, got " << f.old_context_len;
  }
}

// Validates, then launches: q_rope/k_rope = RoPE(q/k). pos_ids, or indptr and offsets.
void Run(const TensorView& q_rope, const TensorView& k_rope, const TensorView& q, const TensorView& k,
         const TensorView* pos_ids, const TensorView* indptr, const TensorView* offsets,
         const TensorView* cos_sin_cache, int64_t rotary_dim, bool interleave, Frequencies f, int64_t enable_pdl,
         const char* op) {
  // 1. Validate: inputs, indices, scalars, outputs, devices.
  CheckHeads(q, "q");
  CheckHeads(k, "k");
  if (aotinfer::DtypeKey(q.dtype()) != aotinfer::DtypeKey(kDLFloat, 16) &&
      aotinfer::DtypeKey(q.dtype()) != aotinfer::DtypeKey(kDLBfloat, 16)) {
    AOTINFER_THROW(TypeError) << "Expected q to have dtype float16 or bfloat16, got " << q.dtype();
  }
  CHECK_SAME_DTYPE(k, q);
  if (k.size(0) != q.size(0) || k.size(2) != q.size(2)) {
    AOTINFER_THROW(ValueError) << "Expected k to have shape [" << q.size(0) << ", num_kv_heads, " << q.size(2)
                              << "] (q's tokens and head_dim), got " << aotinfer::ShapeString(k.shape());
  }
  const int64_t nnz = q.size(0), head_dim = q.size(2);
  aotinfer::Ids ids_pos, ids_indptr, ids_offsets;
  int64_t batch_size = 0;
  if (pos_ids != nullptr) {
    ids_pos = aotinfer::CheckIds(*pos_ids, "pos_ids", nnz, "q's tokens");
  } else {
    ids_indptr = aotinfer::CheckIds(*indptr, "indptr", -1, "batch_size + 1");
    batch_size = indptr->size(0) - 1;
    if (batch_size < 1 && nnz > 0) {
      AOTINFER_THROW(ValueError) << "Expected indptr to have at least 2 elements for " << nnz << " tokens, got "
                                << aotinfer::ShapeString(indptr->shape());
    }
    ids_offsets = aotinfer::CheckIds(*offsets, "offsets", std::max<int64_t>(batch_size, 0), "batch_size, from indptr");
    if (offsets->dtype() != indptr->dtype()) {
      AOTINFER_THROW(TypeError) << "Expected offsets and indptr to have the same dtype, got " << offsets->dtype()
                               << " and " << indptr->dtype();
    }
  }
  const char* rotary_name = "rotary_dim";
  if (cos_sin_cache != nullptr) {
    aotinfer::CheckDim(2, *cos_sin_cache, "cos_sin_cache");
    if (!(cos_sin_cache->dtype().code == kDLFloat && cos_sin_cache->dtype().bits == 32)) {
      AOTINFER_THROW(TypeError) << "Expected cos_sin_cache to have dtype float32, got " << cos_sin_cache->dtype();
    }
    aotinfer::CheckContiguous(*cos_sin_cache, "cos_sin_cache");
    rotary_dim = cos_sin_cache->size(1);
    rotary_name = "the rotary dim (cos_sin_cache.shape[1])";
    f.cos_sin_cache = aotinfer::data_ptr<const float>(*cos_sin_cache);
  }
  if (rotary_dim < 2 || rotary_dim > head_dim || rotary_dim % 2 != 0) {
    AOTINFER_THROW(ValueError) << "Expected " << rotary_name << " to be even and in [2, " << head_dim
                              << "] (head_dim), got " << rotary_dim;
  }
  CheckFrequencies(f);
  aotinfer::CheckEnablePdl(enable_pdl);
  CheckOutput(q_rope, "q_rope", q, "q");
  CheckOutput(k_rope, "k_rope", k, "k");
  // Interleaved pairs are read as one 4-byte access.
  for (const auto& [x, name] : {std::pair<const TensorView&, const char*>{q, "q"}, {k, "k"}, {q_rope, "q_rope"},
                                {k_rope, "k_rope"}}) {
    if (interleave && x.numel() > 0 &&
        (head_dim % 2 != 0 || x.stride(0) % 2 != 0 || x.stride(1) % 2 != 0 ||
         reinterpret_cast<uintptr_t>(aotinfer::data_ptr<char>(x)) % 4 != 0)) {
      AOTINFER_THROW(ValueError) << "Expected " << name
                                << " to have an even head_dim, even strides and a 4-byte aligned start with"
                                   " interleave=True, got shape "
                                << aotinfer::ShapeString(x.shape()) << " and strides " << aotinfer::ShapeString(x.strides());
    }
  }
  if (pos_ids != nullptr) {
    if (cos_sin_cache != nullptr) {
      aotinfer::CheckOnOneGpu({{q, "q"}, {k, "k"}, {*pos_ids, "pos_ids"}, {*cos_sin_cache, "cos_sin_cache"},
                               {q_rope, "q_rope"}, {k_rope, "k_rope"}});
    } else {
      aotinfer::CheckOnOneGpu({{q, "q"}, {k, "k"}, {*pos_ids, "pos_ids"}, {q_rope, "q_rope"}, {k_rope, "k_rope"}});
    }
  } else {
    aotinfer::CheckOnOneGpu({{q, "q"}, {k, "k"}, {*indptr, "indptr"}, {*offsets, "offsets"}, {q_rope, "q_rope"},
                             {k_rope, "k_rope"}});
  }
  if (nnz == 0 || q.size(1) + k.size(1) == 0) return;
  if (q.size(1) + k.size(1) > INT_MAX / 64 || head_dim > 1 << 16) {
    AOTINFER_THROW(ValueError) << "Expected fewer heads and head_dim, got q " << aotinfer::ShapeString(q.shape())
                              << " and k " << aotinfer::ShapeString(k.shape());
  }
  if (aotinfer::IsStandIn(q)) return;

  // 2. Guard the device; 3. get the stream; 4. dispatch and launch.
  const int device = q.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(q.device());
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16(q.dtype(), T, [&] {
    aotinfer::RopeParams<T, T> p;
    const bool copy_rest = rotary_dim < head_dim && (aotinfer::data_ptr<char>(q_rope) != aotinfer::data_ptr<char>(q) ||
                                                     aotinfer::data_ptr<char>(k_rope) != aotinfer::data_ptr<char>(k));
    p.q = SideOf<T, T>(q, q_rope, rotary_dim);
    p.k = SideOf<T, T>(k, k_rope, rotary_dim);
    p.nnz = nnz;
    p.rotary_dim = int(rotary_dim);
    p.rest_dim = copy_rest ? int(head_dim - rotary_dim) : 0;
    p.pos_ids = ids_pos;
    p.indptr = ids_indptr;
    p.offsets = ids_offsets;
    p.batch_size = batch_size;
    p.cos_sin_cache = f.cos_sin_cache;
    p.rope_theta = float(f.rope_theta);
    p.rcp_scale = float(1.0 / f.rope_scale);
    if (f.llama31) {
      // s = clamp(old_context_len / wavelength - low) / (high - low)), wavelength = 2 pi / inv_freq.
      p.smooth_a = float(f.old_context_len / (2 * M_PI * (f.high_freq_factor - f.low_freq_factor)));
      p.smooth_b = float(-f.low_freq_factor / (f.high_freq_factor - f.low_freq_factor));
    }
    CHECK_LAUNCH(aotinfer::Rope(p, interleave, stream, pdl), op);
    return true;
  });
}

}  // namespace

// q_rope/k_rope = RoPE(q/k) at offsets[r] + i for token indptr[r] + i of request r.
void apply_rope(TensorView q_rope, TensorView k_rope, TensorView q, TensorView k, TensorView indptr,
                TensorView offsets, int64_t rotary_dim, bool interleave, double rope_scale, double rope_theta,
                int64_t enable_pdl) {
  Frequencies f;
  f.rope_scale = rope_scale;
  f.rope_theta = rope_theta;
  Run(q_rope, k_rope, q, k, nullptr, &indptr, &offsets, nullptr, rotary_dim, interleave, f, enable_pdl,
      "apply_rope");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(apply_rope, apply_rope);

void apply_llama31_rope(TensorView q_rope, TensorView k_rope, TensorView q, TensorView k, TensorView indptr,
                        TensorView offsets, int64_t rotary_dim, bool interleave, double rope_scale,
                        double rope_theta, double low_freq_factor, double high_freq_factor, double old_context_len,
                        int64_t enable_pdl) {
  Frequencies f{nullptr, rope_scale, rope_theta, true, low_freq_factor, high_freq_factor, old_context_len};
  Run(q_rope, k_rope, q, k, nullptr, &indptr, &offsets, nullptr, rotary_dim, interleave, f, enable_pdl,
      "apply_llama31_rope");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(apply_llama31_rope, apply_llama31_rope);

// q_rope/k_rope = RoPE(q/k) at pos_ids[token].
void apply_rope_pos_ids(TensorView q_rope, TensorView k_rope, TensorView q, TensorView k, TensorView pos_ids,
                        int64_t rotary_dim, bool interleave, double rope_scale, double rope_theta,
                        int64_t enable_pdl) {
  Frequencies f;
  f.rope_scale = rope_scale;
  f.rope_theta = rope_theta;
  Run(q_rope, k_rope, q, k, &pos_ids, nullptr, nullptr, nullptr, rotary_dim, interleave, f, enable_pdl,
      "apply_rope_pos_ids");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(apply_rope_pos_ids, apply_rope_pos_ids);

void apply_llama31_rope_pos_ids(TensorView q_rope, TensorView k_rope, TensorView q, TensorView k,
                                TensorView pos_ids, int64_t rotary_dim, bool interleave, double rope_scale,
                                double rope_theta, double low_freq_factor, double high_freq_factor,
                                double old_context_len, int64_t enable_pdl) {
  Frequencies f{nullptr, rope_scale, rope_theta, true, low_freq_factor, high_freq_factor, old_context_len};
  Run(q_rope, k_rope, q, k, &pos_ids, nullptr, nullptr, nullptr, rotary_dim, interleave, f, enable_pdl,
      "apply_llama31_rope_pos_ids");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(apply_llama31_rope_pos_ids, apply_llama31_rope_pos_ids);

// q_rope/k_rope = RoPE(q/k) at pos_ids[token] with cos/sin of cos_sin_cache[pos] (the rotary dim
// is the cache's second dimension).
void apply_rope_pos_ids_cos_sin_cache(TensorView q_rope, TensorView k_rope, TensorView q, TensorView k,
                                      TensorView cos_sin_cache, TensorView pos_ids, bool interleave,
                                      int64_t enable_pdl) {
  Run(q_rope, k_rope, q, k, &pos_ids, nullptr, nullptr, &cos_sin_cache, 0, interleave, Frequencies{}, enable_pdl,
      "apply_rope_with_cos_sin_cache");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(apply_rope_pos_ids_cos_sin_cache, apply_rope_pos_ids_cos_sin_cache);

// The quantizing form (rope_quantize_fp8): q_rope_out = fp8(RoPE(q_rope_in) * quant_scale_q),
// q_nope_out = fp8(q_nope_in * quant_scale_q), k likewise with quant_scale_kv; cos/sin from
// cos_sin_cache at pos_ids. FP8 saturates to its largest finite value.
void rope_quantize(TensorView q_rope_out, TensorView k_rope_out, TensorView q_nope_out, TensorView k_nope_out,
                   TensorView q_rope_in, TensorView k_rope_in, TensorView q_nope_in, TensorView k_nope_in,
                   TensorView cos_sin_cache, TensorView pos_ids, double quant_scale_q, double quant_scale_kv,
                   bool interleave, int64_t enable_pdl) {
  // 1. Validate: inputs, positions, cache, scalars, outputs, devices.
  CheckHeads(q_rope_in, "q_rope_in");
  if (aotinfer::DtypeKey(q_rope_in.dtype()) != aotinfer::DtypeKey(kDLFloat, 16) &&
      aotinfer::DtypeKey(q_rope_in.dtype()) != aotinfer::DtypeKey(kDLBfloat, 16)) {
    AOTINFER_THROW(TypeError) << "Expected q_rope_in to have dtype float16 or bfloat16, got " << q_rope_in.dtype();
  }
  const int64_t nnz = q_rope_in.size(0), rope_dim = q_rope_in.size(2);
  const TensorView* inputs[] = {&k_rope_in, &q_nope_in, &k_nope_in};
  const char* input_names[] = {"k_rope_in", "q_nope_in", "k_nope_in"};
  for (int i = 0; i < 3; ++i) {
    CheckHeads(*inputs[i], input_names[i]);
    aotinfer::CheckSameDtype(*inputs[i], q_rope_in, input_names[i], "q_rope_in");
    if (inputs[i]->size(0) != nnz) {
      AOTINFER_THROW(ValueError) << "Expected " << input_names[i] << " to have " << nnz
                                << " tokens (q_rope_in's), got shape " << aotinfer::ShapeString(inputs[i]->shape());
    }
  }
  if (k_rope_in.size(2) != rope_dim) {
    AOTINFER_THROW(ValueError) << "Expected k_rope_in to have rope dim " << rope_dim << " (q_rope_in's), got shape "
                              << aotinfer::ShapeString(k_rope_in.shape());
  }
  if (q_nope_in.size(1) != q_rope_in.size(1) || k_nope_in.size(1) != k_rope_in.size(1) ||
      k_nope_in.size(2) != q_nope_in.size(2)) {
    AOTINFER_THROW(ValueError) << "Expected q_nope_in and k_nope_in to have q_rope_in's and k_rope_in's heads and one "
                                  "no_rope_dim, got shapes "
                              << aotinfer::ShapeString(q_nope_in.shape()) << " and "
                              << aotinfer::ShapeString(k_nope_in.shape());
  }
  const aotinfer::Ids ids = aotinfer::CheckIds(pos_ids, "pos_ids", nnz, "q_rope_in's tokens");
  aotinfer::CheckDim(2, cos_sin_cache, "cos_sin_cache");
  if (!(cos_sin_cache.dtype().code == kDLFloat && cos_sin_cache.dtype().bits == 32)) {
    AOTINFER_THROW(TypeError) << "Expected cos_sin_cache to have dtype float32, got " << cos_sin_cache.dtype();
  }
  aotinfer::CheckContiguous(cos_sin_cache, "cos_sin_cache");
  if (cos_sin_cache.size(1) != rope_dim || rope_dim < 2 || rope_dim % 2 != 0) {
    AOTINFER_THROW(ValueError) << "Expected cos_sin_cache to have shape [max_position, " << rope_dim
                              << "] (q_rope_in's rope dim, even), got " << aotinfer::ShapeString(cos_sin_cache.shape());
  }
  for (const auto& [value, name] : {std::pair<double, const char*>{quant_scale_q, "quant_scale_q"},
                                    {quant_scale_kv, "quant_scale_kv"}}) {
    if (!std::isfinite(value)) AOTINFER_THROW(ValueError) << "Expected " << name << " to be finite, got " << value;
  }
  aotinfer::CheckEnablePdl(enable_pdl);
  const TensorView* outputs[] = {&q_rope_out, &k_rope_out, &q_nope_out, &k_nope_out};
  const TensorView* sources[] = {&q_rope_in, &k_rope_in, &q_nope_in, &k_nope_in};
  const char* output_names[] = {"q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"};
  const char* source_names[] = {"q_rope_in", "k_rope_in", "q_nope_in", "k_nope_in"};
  for (int i = 0; i < 4; ++i) {
    aotinfer::CheckSameShape(*outputs[i], *sources[i], output_names[i], source_names[i]);
    CheckHeads(*outputs[i], output_names[i]);
    const uint32_t key = aotinfer::DtypeKey(outputs[i]->dtype());
    if (key != aotinfer::DtypeKey(kDLFloat8_e4m3fn, 8) && key != aotinfer::DtypeKey(kDLFloat8_e5m2, 8)) {
      AOTINFER_THROW(TypeError) << "Expected " << output_names[i]
                               << " to have dtype float8_e4m3fn or float8_e5m2, got " << outputs[i]->dtype();
    }
    if (i > 0) aotinfer::CheckSameDtype(*outputs[i], q_rope_out, output_names[i], "q_rope_out");
  }
  if (q_rope_in.size(1) + k_rope_in.size(1) > INT_MAX / 64 || rope_dim > 1 << 16 || q_nope_in.size(2) > 1 << 16) {
    AOTINFER_THROW(ValueError) << "Expected fewer heads and dims, got q_rope_in "
                              << aotinfer::ShapeString(q_rope_in.shape()) << " and q_nope_in "
                              << aotinfer::ShapeString(q_nope_in.shape());
  }

  // The layout (which needs the types), the devices; 2. guard the device; 3. get the stream;
  // 4. launch.
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16(q_rope_in.dtype(), T, [&] {
    return DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP8(q_rope_out.dtype(), OutT, [&] {
      auto side = [&](const TensorView& rot, const TensorView& rest, const TensorView& rot_out,
                      const TensorView& rest_out, double scale) {
        aotinfer::RopeSide<T, OutT> s;
        s.rot = HeadsOf<const T>(rot);
        s.rest = HeadsOf<const T>(rest);
        s.rot_out = HeadsOf<OutT>(rot_out);
        s.rest_out = HeadsOf<OutT>(rest_out);
        s.heads = int(rot.size(1));
        s.scale = float(scale);
        return s;
      };
      aotinfer::RopeParams<T, OutT> p;
      p.q = side(q_rope_in, q_nope_in, q_rope_out, q_nope_out, quant_scale_q);
      p.k = side(k_rope_in, k_nope_in, k_rope_out, k_nope_out, quant_scale_kv);
      p.nnz = nnz;
      p.rotary_dim = int(rope_dim);
      p.rest_dim = int(q_nope_in.size(2));
      p.pos_ids = ids;
      p.cos_sin_cache = aotinfer::data_ptr<const float>(cos_sin_cache);
      if (!aotinfer::RopeLayoutSupported(p, interleave, aotinfer::kVec16<T>)) {
        AOTINFER_THROW(ValueError) << "Expected the rope dim " << rope_dim << " to be a multiple of "
                                  << (interleave ? 8 : 16) << ", no_rope_dim " << p.rest_dim
                                  << " one of 8, and every head of the inputs 16-byte aligned and of the outputs"
                                     " 8-byte aligned (strides multiples of 8)";
      }
      aotinfer::CheckOnOneGpu({{q_rope_in, "q_rope_in"}, {k_rope_in, "k_rope_in"}, {q_nope_in, "q_nope_in"},
                               {k_nope_in, "k_nope_in"}, {cos_sin_cache, "cos_sin_cache"}, {pos_ids, "pos_ids"},
                               {q_rope_out, "q_rope_out"}, {k_rope_out, "k_rope_out"}, {q_nope_out, "q_nope_out"},
                               {k_nope_out, "k_nope_out"}});
      if (nnz == 0 || aotinfer::IsStandIn(q_rope_in)) return true;
      const int device = q_rope_in.device().device_id;
      aotinfer::DeviceGuard guard(device);
      cudaStream_t stream = aotinfer::get_stream(q_rope_in.device());
      const bool pdl = aotinfer::UsePdl(enable_pdl, device);
      CHECK_LAUNCH(aotinfer::Rope(p, interleave, stream, pdl), "rope_quantize_fp8");
      return true;
    });
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_quantize, rope_quantize);
