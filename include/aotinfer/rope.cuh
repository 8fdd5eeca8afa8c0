// Rotary position embedding (RoPE) of queries and keys, out of place or in place: one kernel for
// every frequency rule (theta^(-2j/rotary_dim) scaled plainly or by Llama 3.1's smoothing, or a
// precomputed cos/sin cache) and both layouts (NeoX's halves, GPT-J's interleaved pairs).
//
// Memory-bound: each token's q and k heads are read and written once, in 16-byte vectors. A block
// takes one or a few tokens with all their heads, so a token's cos/sin pairs are computed once
// (rotary_dim / 2 sincosf in float32, accurate where a fast __sincosf drifts at large positions)
// into shared memory and shared by its heads. Each thread loads its first vector before the table is
// built, so that the position lookup and the sincosf overlap the first loads. The frequency rule
// is a runtime choice: it is read only while the table is filled, and a template parameter would
// only double the instantiations. Rows are strided (q and k are often slices of a fused qkv).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "aotinfer/ids.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

// q and k heads: [nnz, heads, head_dim], the last dimension contiguous. Strides in elements.
template <typename T>
struct RopeTensor {
  T* data = nullptr;
  int64_t stride_n = 0;
  int64_t stride_h = 0;
};

template <typename T>
struct RopeParams {
  RopeTensor<T> q_out, k_out;             // may be q and k themselves (in place)
  RopeTensor<const T> q, k;
  int64_t nnz = 0;                        // tokens
  int num_q_heads = 0, num_k_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;                     // even, <= head_dim: dims [0, rotary_dim) rotate
  bool copy_rest = false;                 // out of place: dims past rotary_dim are copied
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

template <typename T>
__device__ __forceinline__ int64_t RopePosition(const RopeParams<T>& p, int64_t token) {
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

// A thread's piece of a token: unit u of head `head` (q heads first, then k heads). Units below
// rot_units rotate: for NeoX a vector of the first half with its partner rotary_dim / 2 further,
// for interleaved pairs one vector; the rest copy dims past rotary_dim (out of place only).
template <typename T, bool kInterleave, int kVec>
__global__ void __launch_bounds__(kRopeMaxThreads)
    RopeKernel(const RopeParams<T> p, int tokens_per_block, int units_per_head, int rot_units) {
  extern __shared__ float rope_table[];  // [tokens_per_block][2][rotary_dim / 2]: cos, then sin
  using V = Vec<T, kVec>;
  const int half = p.rotary_dim / 2;
  const int64_t first = int64_t(blockIdx.x) * tokens_per_block;
  const int tokens = int(min(int64_t(tokens_per_block), p.nnz - first));
  const int units_per_token = (p.num_q_heads + p.num_k_heads) * units_per_head;
  const int total = tokens * units_per_token;

  struct Unit {
    const T* in;
    T* out;
    int token;  // within the block
    int u;
  };
  auto locate = [&](int w) {
    Unit unit;
    unit.token = w / units_per_token;
    const int rest = w - unit.token * units_per_token;
    const int head = rest / units_per_head;
    unit.u = rest - head * units_per_head;
    const int64_t n = first + unit.token;
    if (head < p.num_q_heads) {
      unit.in = p.q.data + n * p.q.stride_n + head * p.q.stride_h;
      unit.out = p.q_out.data + n * p.q_out.stride_n + head * p.q_out.stride_h;
    } else {
      const int h = head - p.num_q_heads;
      unit.in = p.k.data + n * p.k.stride_n + h * p.k.stride_h;
      unit.out = p.k_out.data + n * p.k_out.stride_n + h * p.k_out.stride_h;
    }
    return unit;
  };
  // The unit's first vector (and NeoX's partner) at its element offset in the head.
  auto first_dim = [&](int u) {
    if (u >= rot_units) return p.rotary_dim + (u - rot_units) * kVec;
    return u * kVec;
  };

  WaitForPriorGrids();  // positions, the cache and q/k may come from the kernel before
  int w = threadIdx.x;
  bool have = w < total;
  Unit unit{};
  V a, b;
  if (have) {
    unit = locate(w);
    a.load(unit.in + first_dim(unit.u));
    if (!kInterleave && unit.u < rot_units) b.load(unit.in + first_dim(unit.u) + half);
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
    const int d = first_dim(unit.u);
    if (unit.u >= rot_units) {
      a.store(unit.out + d);
    } else {
      const float* cos = rope_table + unit.token * 2 * half;
      const float* sin = cos + half;
      if constexpr (kInterleave) {
        // Pair (2i, 2i + 1) of the head turns by frequency i.
        const V r = V::from_floats([&](int e) {
          const int j = (d + e) / 2;
          const float x = to_float(a[e]), partner = to_float(a[e ^ 1]);
          return e % 2 == 0 ? x * cos[j] - partner * sin[j] : x * cos[j] + partner * sin[j];
        });
        r.store(unit.out + d);
      } else {
        // Element d + e of the first half and d + e + rotary_dim / 2 turn together by frequency d + e.
        const V r1 = V::from_floats([&](int e) {
          return to_float(a[e]) * cos[d + e] - to_float(b[e]) * sin[d + e];
        });
        const V r2 = V::from_floats([&](int e) {
          return to_float(b[e]) * cos[d + e] + to_float(a[e]) * sin[d + e];
        });
        r1.store(unit.out + d);
        r2.store(unit.out + d + half);
      }
    }
    w += blockDim.x;
    have = w < total;
    if (have) {
      unit = locate(w);
      a.load(unit.in + first_dim(unit.u));
      if (!kInterleave && unit.u < rot_units) b.load(unit.in + first_dim(unit.u) + half);
    }
  }
}

template <typename T, bool kInterleave, int kVec>
cudaError_t LaunchRope(const RopeParams<T>& p, cudaStream_t stream, bool pdl) {
  const int half = p.rotary_dim / 2;
  const int rot_units = kInterleave ? p.rotary_dim / kVec : half / kVec;
  const int units_per_head = rot_units + (p.copy_rest ? (p.head_dim - p.rotary_dim) / kVec : 0);
  const int64_t units_per_token = int64_t(p.num_q_heads + p.num_k_heads) * units_per_head;
  if (units_per_token == 0) return cudaSuccess;  // in place with nothing to turn
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
  return LaunchWithSharedMemory(RopeKernel<T, kInterleave, kVec>, dim3(unsigned(blocks)), dim3(threads), table_bytes,
                                stream, pdl, p, int(tokens_per_block), units_per_head, rot_units);
}

// Whether every head of `t` starts kVec-element aligned (a 16-byte access for kVec = kVec16<T>).
template <typename T, typename U>
bool RopeAligned(const RopeTensor<U>& t, int vec) {
  return reinterpret_cast<uintptr_t>(t.data) % (vec * sizeof(T)) == 0 && t.stride_n % vec == 0 &&
         t.stride_h % vec == 0;
}

// Whether kVec-element vectors cover the rotary dims and the rest of every head, aligned.
template <typename T>
bool RopeLayoutSupported(const RopeParams<T>& p, bool interleave, int vec) {
  const int rot_multiple = interleave ? vec : 2 * vec;
  return p.rotary_dim % rot_multiple == 0 && p.head_dim % vec == 0 && RopeAligned<T>(p.q, vec) &&
         RopeAligned<T>(p.k, vec) && RopeAligned<T>(p.q_out, vec) && RopeAligned<T>(p.k_out, vec);
}

// Rotates p.q into p.q_out and p.k into p.k_out: 16-byte vectors where the rotary dims, head_dim
// and every head's start allow them, else single elements (NeoX) or pairs (interleaved; callers
// make sure then that head_dim and every head's start are even, 4-byte aligned).
template <typename T>
cudaError_t Rope(const RopeParams<T>& p, bool interleave, cudaStream_t stream, bool pdl) {
  if (p.nnz == 0) return cudaSuccess;
  constexpr int kWide = kVec16<T>;
  if (interleave) {
    if (RopeLayoutSupported(p, true, kWide)) return LaunchRope<T, true, kWide>(p, stream, pdl);
    return LaunchRope<T, true, 2>(p, stream, pdl);
  }
  if (RopeLayoutSupported(p, false, kWide)) return LaunchRope<T, false, kWide>(p, stream, pdl);
  return LaunchRope<T, false, 1>(p, stream, pdl);
}

}  // namespace aotinfer
