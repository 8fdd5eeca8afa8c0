// Rotary position embedding (RoPE) of queries and keys, out of place or in place: one kernel for
// every frequency rule (theta^(-2j/rotary_dim) scaled plainly or by Llama 3.1's smoothing, or a
// precomputed cos/sin cache) and both layouts (NeoX's halves, GPT-J's interleaved pairs).
//
// The same kernel quantizes (rope_quantize_fp8): the output type is a template parameter, each
// side's values are multiplied by its scale before the one rounding, and the dims that do not
// rotate come from a tensor of their own (q_nope, k_nope) instead of the rest of each head.
//
// Memory-bound: each token's q and k heads are read and written once, in 16-byte vectors. A block
// takes one or a few tokens with all their heads, so a token's cos/sin pairs are computed once
// (rotary_dim / 2 sincosf in float32, accurate where a fast __sincosf drifts at large positions)
// into shared memory and shared by its heads. Each thread loads its first vector before the table is
// built, so that the position lookup and the sincosf overlap the first loads. The frequency rule
// is a runtime choice: it is read only while the table is filled, and a template parameter would
// only double the instantiations. Rows are strided (q and k are often slices of a fused qkv).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "aotinfer/ids.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

// Heads [nnz, heads, dims], the last dimension contiguous. Strides in elements.
template <typename T>
struct RopeTensor {
  T* data = nullptr;
  int64_t stride_n = 0;
  int64_t stride_h = 0;
};

// One side (q or k): its rotary dims, and the dims that do not rotate (rest_dim of them, from
// `rest` into `rest_out`; for plain RoPE the head's dims past rotary_dim, for rope_quantize its nope
// tensor), each multiplied by `scale` (1 but for quantizing) before its one rounding.
template <typename T, typename OutT>
struct RopeSide {
  RopeTensor<const T> rot, rest;
  RopeTensor<OutT> rot_out, rest_out;  // rot_out may be rot itself (in place), rest_out rest
  int heads = 0;
  float scale = 1.f;
};

template <typename T, typename OutT>
struct RopeParams {
  RopeSide<T, OutT> q, k;
  int64_t nnz = 0;                        // tokens
  int rotary_dim = 0;                     // even: dims [0, rotary_dim) of rot rotate
  int rest_dim = 0;                       // dims of rest moved (0 in place: they stay)
  // Positions: pos_ids[token], or offsets[r] + token - indptr[r] for the request r that holds token.
  Ids pos_ids, indptr, offsets;
  int64_t batch_size = 0;                 // requests of indptr/offsets
  // Frequencies: cos_sin_cache [max_position, rotary_dim] (cos of frequency j at j, sin at
  // rotary_dim / 2 + j), or, without it, inv_freq_j = 1 / rope_theta^(2j / rotary_dim) blended as
  // (1 - s) * inv_freq_j / rope_scale + s * inv_freq_j, s = clamp(inv_freq_j * smooth_a + smooth_b, 0, 1)
  // (Llama 3.1; smooth_a = smooth_b = 0 for plain RoPE).
  const float* cos_sin_cache = nullptr;
  float rope_theta = 1e4f;
  float rcp_scale = 1.f;
  float smooth_a = 0.f, smooth_b = 0.f;
};

constexpr int kRopeMaxThreads = 512;

template <typename T, typename OutT>
__device__ __forceinline__ int64_t RopePosition(const RopeParams<T, OutT>& p, int64_t token) {
  if (p.pos_ids.data != nullptr) return p.pos_ids[token];
  // The last request r with indptr[r] <= token (empty requests before it are passed over).
  int64_t lo = 0, hi = p.batch_size;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.indptr[mid] <= token) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return p.offsets[lo] + (token - p.indptr[lo]);
}

template <typename OutT>
constexpr bool kIsFp8 = std::is_same_v<OutT, __nv_fp8_e4m3> || std::is_same_v<OutT, __nv_fp8_e5m2>;

// The vector of f(e) for e < N in OutT: 16-bit types rounded in pairs (Vec::from_floats), FP8
// saturated to its largest finite value and rounded to nearest even.
template <typename OutT, int N, typename F>
__device__ __forceinline__ Vec<OutT, N> RopeOut(F&& f) {
  if constexpr (kIsFp8<OutT>) {
    Vec<OutT, N> v;
#pragma unroll
    for (int e = 0; e < N; ++e) v.elems[e] = OutT(f(e));
    return v;
  } else {
    return Vec<OutT, N>::from_floats(f);
  }
}

// A thread's piece of a token: unit u of head `head` (q heads first, then k heads). Units below
// rot_units rotate kVec dims (NeoX: of the first half, with their partners rotary_dim / 2 further;
// interleaved: kVec / 2 pairs); the others move kVec dims of the head's rest.
template <typename T, typename OutT, bool kInterleave, int kVec>
__global__ void __launch_bounds__(kRopeMaxThreads)
    RopeKernel(const RopeParams<T, OutT> p, int tokens_per_block, int units_per_head, int rot_units) {
  extern __shared__ float rope_table[];  // [tokens_per_block][2][rotary_dim / 2]: cos, then sin
  using In = Vec<T, kVec>;
  const int half = p.rotary_dim / 2;
  const int64_t first = int64_t(blockIdx.x) * tokens_per_block;
  const int tokens = int(min(int64_t(tokens_per_block), p.nnz - first));
  const int units_per_token = (p.q.heads + p.k.heads) * units_per_head;
  const int total = tokens * units_per_token;

  struct Unit {
    const T* in;   // the unit's first element
    OutT* out;
    int token;     // within the block
    int d;         // the first element's dim in rot (rotating) or rest
    bool rotates;
    float scale;
  };
  auto locate = [&](int w) {
    Unit unit;
    unit.token = w / units_per_token;
    const int rest = w - unit.token * units_per_token;
    int head = rest / units_per_head;
    const int u = rest - head * units_per_head;
    const bool is_q = head < p.q.heads;
    const RopeSide<T, OutT>& side = is_q ? p.q : p.k;
    head -= is_q ? 0 : p.q.heads;
    const int64_t n = first + unit.token;
    unit.rotates = u < rot_units;
    unit.d = (unit.rotates ? u : u - rot_units) * kVec;
    const RopeTensor<const T>& in = unit.rotates ? side.rot : side.rest;
    const RopeTensor<OutT>& out = unit.rotates ? side.rot_out : side.rest_out;
    unit.in = in.data + n * in.stride_n + head * in.stride_h + unit.d;
    unit.out = out.data + n * out.stride_n + head * out.stride_h + unit.d;
    unit.scale = side.scale;
    return unit;
  };

  WaitForPriorGrids();  // positions, the cache and q/k may come from the kernel before
  int w = threadIdx.x;
  bool have = w < total;
  Unit unit{};
  In a, b;
  if (have) {
    unit = locate(w);
    a.load(unit.in);
    if (!kInterleave && unit.rotates) b.load(unit.in + half);
  }

  for (int e = threadIdx.x; e < tokens * half; e += blockDim.x) {
    const int t = e / half, j = e - t * half;
    const int64_t pos = RopePosition(p, first + t);
    float c, s;
    if (p.cos_sin_cache != nullptr) {
      const float* row = p.cos_sin_cache + pos * p.rotary_dim;
      c = row[j];
      s = row[half + j];
    } else {
      float inv_freq = 1.f / powf(p.rope_theta, float(2 * j) / float(p.rotary_dim));
      const float smooth = fminf(fmaxf(inv_freq * p.smooth_a + p.smooth_b, 0.f), 1.f);
      inv_freq = (1.f - smooth) * (inv_freq * p.rcp_scale) + smooth * inv_freq;
      sincosf(float(pos) * inv_freq, &s, &c);
    }
    rope_table[t * 2 * half + j] = c;
    rope_table[t * 2 * half + half + j] = s;
  }
  __syncthreads();

  while (have) {
    const int d = unit.d;
    const float scale = unit.scale;
    if (!unit.rotates) {
      if constexpr (std::is_same_v<OutT, T>) {
        a.store(unit.out);  // a plain copy (scale is 1)
      } else {
        RopeOut<OutT, kVec>([&](int e) { return to_float(a[e]) * scale; }).store(unit.out);
      }
    } else {
      const float* cos = rope_table + unit.token * 2 * half;
      const float* sin = cos + half;
      if constexpr (kInterleave) {
        // Pair (2i, 2i + 1) of the head turns by frequency i.
        RopeOut<OutT, kVec>([&](int e) {
          const int j = (d + e) / 2;
          const float x = to_float(a[e]), partner = to_float(a[e ^ 1]);
          return (e % 2 == 0 ? x * cos[j] - partner * sin[j] : x * cos[j] + partner * sin[j]) * scale;
        }).store(unit.out);
      } else {
        // Dim d + e of the first half and d + e + rotary_dim / 2 turn together by frequency d + e.
        RopeOut<OutT, kVec>([&](int e) {
          return (to_float(a[e]) * cos[d + e] - to_float(b[e]) * sin[d + e]) * scale;
        }).store(unit.out);
        RopeOut<OutT, kVec>([&](int e) {
          return (to_float(b[e]) * cos[d + e] + to_float(a[e]) * sin[d + e]) * scale;
        }).store(unit.out + half);
      }
    }
    w += blockDim.x;
    have = w < total;
    if (have) {
      unit = locate(w);
      a.load(unit.in);
      if (!kInterleave && unit.rotates) b.load(unit.in + half);
    }
  }
}

template <typename T, typename OutT, bool kInterleave, int kVec>
cudaError_t LaunchRope(const RopeParams<T, OutT>& p, cudaStream_t stream, bool pdl) {
  const int half = p.rotary_dim / 2;
  const int rot_units = kInterleave ? p.rotary_dim / kVec : half / kVec;
  const int units_per_head = rot_units + p.rest_dim / kVec;
  const int64_t units_per_token = int64_t(p.q.heads + p.k.heads) * units_per_head;
  if (units_per_token == 0) return cudaSuccess;  // no heads
  if (units_per_token > INT_MAX / 2) return cudaErrorInvalidValue;
  // Enough tokens a block for about 256 units, within 16 KB of table.
  int64_t tokens_per_block = units_per_token >= 256 ? 1 : 256 / units_per_token;
  tokens_per_block = std::min<int64_t>(tokens_per_block, std::max(1, 16384 / (8 * std::max(half, 1))));
  tokens_per_block = std::min<int64_t>(tokens_per_block, p.nnz);
  const int64_t units = tokens_per_block * units_per_token;
  const int threads = int(std::min<int64_t>((units + 31) / 32 * 32, kRopeMaxThreads));
  const int64_t blocks = (p.nnz + tokens_per_block - 1) / tokens_per_block;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  const size_t table_bytes = size_t(tokens_per_block) * 2 * half * sizeof(float);
  return LaunchWithSharedMemory(RopeKernel<T, OutT, kInterleave, kVec>, dim3(unsigned(blocks)), dim3(threads),
                                table_bytes, stream, pdl, p, int(tokens_per_block), units_per_head, rot_units);
}

// Whether every head of `t` starts `vec`-element aligned for a vec-element access.
template <typename U>
bool RopeAligned(const RopeTensor<U>& t, int vec) {
  return reinterpret_cast<uintptr_t>(t.data) % (vec * sizeof(U)) == 0 && t.stride_n % vec == 0 &&
         t.stride_h % vec == 0;
}

template <typename T, typename OutT>
bool RopeSideAligned(const RopeSide<T, OutT>& side, bool has_rest, int vec) {
  return side.heads == 0 || (RopeAligned(side.rot, vec) && RopeAligned(side.rot_out, vec) &&
                             (!has_rest || (RopeAligned(side.rest, vec) && RopeAligned(side.rest_out, vec))));
}

// Whether vec-element vectors cover the rotary dims and the rest, every one aligned.
template <typename T, typename OutT>
bool RopeLayoutSupported(const RopeParams<T, OutT>& p, bool interleave, int vec) {
  const int rot_multiple = interleave ? vec : 2 * vec;
  const bool has_rest = p.rest_dim > 0;
  return p.rotary_dim % rot_multiple == 0 && p.rest_dim % vec == 0 && RopeSideAligned(p.q, has_rest, vec) &&
         RopeSideAligned(p.k, has_rest, vec);
}

// Rotates q.rot into q.rot_out and moves q.rest into q.rest_out (k likewise): 16-byte vectors of
// the input where the dims and every head's start allow them. Otherwise, for 16-bit outputs,
// single elements (NeoX) or pairs (interleaved; callers make sure then that the dims and every
// head's start are even, 4-byte aligned); FP8 outputs need the 16-byte vectors
// (RopeLayoutSupported), else cudaErrorInvalidValue.
template <typename T, typename OutT>
cudaError_t Rope(const RopeParams<T, OutT>& p, bool interleave, cudaStream_t stream, bool pdl) {
  if (p.nnz == 0) return cudaSuccess;
  constexpr int kWide = kVec16<T>;
  const bool wide = RopeLayoutSupported(p, interleave, kWide);
  if constexpr (kIsFp8<OutT>) {
    if (!wide) return cudaErrorInvalidValue;
    return interleave ? LaunchRope<T, OutT, true, kWide>(p, stream, pdl)
                      : LaunchRope<T, OutT, false, kWide>(p, stream, pdl);
  } else {
    if (interleave) {
      return wide ? LaunchRope<T, OutT, true, kWide>(p, stream, pdl) : LaunchRope<T, OutT, true, 2>(p, stream, pdl);
    }
    return wide ? LaunchRope<T, OutT, false, kWide>(p, stream, pdl) : LaunchRope<T, OutT, false, 1>(p, stream, pdl);
  }
}

}  // namespace aotinfer
