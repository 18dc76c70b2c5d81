// Grouped W4A16 MoE GEMV for small token counts, one source for HIP (AMD) and CUDA (NVIDIA).
//
// On AMD the inner product is __builtin_amdgcn_fdot2 (v_dot2_f32_f16: two fp16 products summed
// into an fp32 accumulator), compiled wave32 (-mno-wavefrontsize64) for RDNA2 (gfx1030). Under
// CUDA the same dot is two fp32 FMAs on the converted halves, so the logic runs, and is tested,
// on an NVIDIA GPU. Nothing else differs between the two builds.
//
// Shapes: T rows, P (row, expert) pairs, E experts, H hidden, I intermediate, G group size.
// Weights use the canonical layout of kernels/quant.py: packed [E, N, K/8] uint32, nibble i of
// word j is q[k = 8j + i] in 0..15 (value q - 8), scales [E, N, K/G] fp32 (signed).
//
//   gate_up pass: gu[s, n]  = sum_k x[row(s), k] * w13[e, n, k]           n < 2I, K = H
//   down pass:    out[row(s), h] += router(s) * sum_k act(gu[s, k]) * gu[s, I + k] * w2[e, h, k]
// where s is a pair's position after sorting pairs by expert (order, bounds).
//
// One block owns (expert e, kRowsPerBlock output rows, one K chunk) and walks the expert's pairs
// MT at a time: the MT activation rows of the chunk are staged in shared memory as fp16 pairs
// (x[8j+p], x[8j+p+4]), matching how one packed word splits into four half2 with two bit ops.
// Each warp reads rows_per_warp(MT) weight rows at once, lanes striding over 16-byte quads.

#include <stdint.h>

#ifdef __HIP__
#include <hip/hip_runtime.h>
typedef hipStream_t gpu_stream_t;
typedef hipError_t gpu_error_t;
#define GPU_GET_LAST_ERROR hipGetLastError
#define GPU_MEMSET_ASYNC hipMemsetAsync
typedef _Float16 half2_t __attribute__((ext_vector_type(2)));
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <string.h>
typedef cudaStream_t gpu_stream_t;
typedef cudaError_t gpu_error_t;
#define GPU_GET_LAST_ERROR cudaGetLastError
#define GPU_MEMSET_ASYNC cudaMemsetAsync
#endif

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 8;
constexpr int kThreads = kWarp * kWarps;
constexpr int kRowsPerBlock = 64;
// weight rows a warp reads at once: more rows keep more bytes in flight, more tokens need more
// registers (acc[rows][MT] plus the dequantized words reused across tokens)
__host__ __device__ constexpr int rows_per_warp(int mt) { return mt >= 4 ? 2 : 4; }
constexpr int kSmemBytes = 32 * 1024;
constexpr uint32_t kNibbleMask = 0x000F000Fu;
constexpr uint32_t kFp16Bias = 0x64006400u;  // fp16 1024.0 in both halves

// ---- the only platform-specific arithmetic --------------------------------------------------

#ifdef __HIP__
__device__ inline half2_t as_half2(uint32_t bits) { return __builtin_bit_cast(half2_t, bits); }

__device__ inline uint32_t nibbles_to_half2(uint32_t bits) {
  const half2_t offset = {(_Float16)1032.0f, (_Float16)1032.0f};  // 1024 bias + zero point 8
  return __builtin_bit_cast(uint32_t, as_half2(bits | kFp16Bias) - offset);
}

__device__ inline uint32_t floats_to_half2(float lo, float hi) {
  const half2_t h = {(_Float16)lo, (_Float16)hi};
  return __builtin_bit_cast(uint32_t, h);
}

// fdot2: c + a.x * b.x + a.y * b.y, fp16 products, fp32 accumulation (v_dot2_f32_f16)
__device__ inline float dot2(uint32_t a, uint32_t b, float c) {
  return __builtin_amdgcn_fdot2(as_half2(a), as_half2(b), c, false);
}

__device__ inline float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor(v, offset, kWarp);
  return v;
}
#else
__device__ inline __half2 as_half2(uint32_t bits) {
  __half2 h;
  memcpy(&h, &bits, sizeof(h));
  return h;
}

__device__ inline uint32_t half2_bits(__half2 h) {
  uint32_t bits;
  memcpy(&bits, &h, sizeof(bits));
  return bits;
}

__device__ inline uint32_t nibbles_to_half2(uint32_t bits) {
  return half2_bits(__hsub2(as_half2(bits | kFp16Bias), __float2half2_rn(1032.0f)));
}

__device__ inline uint32_t floats_to_half2(float lo, float hi) { return half2_bits(__floats2half2_rn(lo, hi)); }

// the fdot2 twin: same fp16 inputs, products and sum in fp32
__device__ inline float dot2(uint32_t a, uint32_t b, float c) {
  const float2 fa = __half22float2(as_half2(a));
  const float2 fb = __half22float2(as_half2(b));
  return fmaf(fa.y, fb.y, fmaf(fa.x, fb.x, c));
}

__device__ inline float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
#endif

// ---- shared logic ---------------------------------------------------------------------------

template <int ACT>
__device__ inline float activate(float x) {
  if (ACT == 0) return x / (1.0f + __expf(-x));          // silu
  return 0.5f * x * (1.0f + erff(x * 0.70710678118f));   // gelu (erf)
}

// 8 fp16 x[8j .. 8j+7] as 4 words (x0,x1) (x2,x3) (x4,x5) (x6,x7) -> pairs (x0,x4) (x1,x5) (x2,x6) (x3,x7)
__device__ inline uint4 pair_up(uint4 v) {
  uint4 p;
  p.x = (v.x & 0xFFFFu) | (v.z << 16);
  p.y = (v.x >> 16) | (v.z & 0xFFFF0000u);
  p.z = (v.y & 0xFFFFu) | (v.w << 16);
  p.w = (v.y >> 16) | (v.w & 0xFFFF0000u);
  return p;
}

// one packed word (q[8j+0..7]) against one staged activation word: 4 fdot2
__device__ inline float dot_word(uint32_t w, uint4 a, float acc) {
  acc = dot2(nibbles_to_half2(w & kNibbleMask), a.x, acc);
  acc = dot2(nibbles_to_half2((w >> 4) & kNibbleMask), a.y, acc);
  acc = dot2(nibbles_to_half2((w >> 8) & kNibbleMask), a.z, acc);
  return dot2(nibbles_to_half2((w >> 12) & kNibbleMask), a.w, acc);
}

struct Pass {
  const uint32_t* w;   // [E, N, K/8]
  const float* s;      // [E, N, K/G]
  int n, k, group;     // N output rows, K input columns
  int chunk;           // K columns per block (multiple of 32)
};

// DOWN = false: stage x rows, write gu [P, 2I].  DOWN = true: stage act(gate) * up, add into out.
template <int MT, bool DOWN, int ACT>
__global__ void __launch_bounds__(kThreads) fdot2_moe_kernel(
    Pass pass, const uint4* __restrict__ x, int x_words_per_row, const float* __restrict__ gu,
    int inter, const int32_t* __restrict__ pair_rows, const float* __restrict__ router,
    const int32_t* __restrict__ order, const int32_t* __restrict__ bounds, float* __restrict__ out,
    int out_stride) {
  extern __shared__ uint4 staged[];  // [MT][4][quads]: word j of token t at t*words + (j%4)*quads + j/4
  __shared__ int32_t rows_s[MT];
  __shared__ float router_s[MT];

  const int e = blockIdx.x;
  const int start = bounds[e], end = bounds[e + 1];
  if (start == end) return;
  const int k_begin = blockIdx.z * pass.chunk;
  const int words = (min(pass.k, k_begin + pass.chunk) - k_begin) / 8;
  const int quads = words / 4;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const bool split_k = gridDim.z > 1;
  constexpr int kRowsPerWarp = rows_per_warp(MT);

  for (int m0 = start; m0 < end; m0 += MT) {
    const int mt = min(MT, end - m0);
    __syncthreads();  // the previous chunk is done with `staged`
    if (threadIdx.x < MT) {
      const int t = threadIdx.x;
      const int pair = t < mt ? order[m0 + t] : 0;
      rows_s[t] = t < mt ? pair_rows[pair] : 0;
      router_s[t] = t < mt ? router[pair] : 0.0f;
    }
    for (int idx = threadIdx.x; idx < MT * words; idx += kThreads) {
      const int t = idx / words, j = idx % words;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (t < mt) {
        if (DOWN) {  // gu row of sorted pair m0 + t: gate at k, up at I + k
          const float* g = gu + (size_t)(m0 + t) * 2 * inter + k_begin + 8 * j;
          const float4 g0 = *reinterpret_cast<const float4*>(g);
          const float4 g1 = *reinterpret_cast<const float4*>(g + 4);
          const float4 u0 = *reinterpret_cast<const float4*>(g + inter);
          const float4 u1 = *reinterpret_cast<const float4*>(g + inter + 4);
          v.x = floats_to_half2(activate<ACT>(g0.x) * u0.x, activate<ACT>(g1.x) * u1.x);
          v.y = floats_to_half2(activate<ACT>(g0.y) * u0.y, activate<ACT>(g1.y) * u1.y);
          v.z = floats_to_half2(activate<ACT>(g0.z) * u0.z, activate<ACT>(g1.z) * u1.z);
          v.w = floats_to_half2(activate<ACT>(g0.w) * u0.w, activate<ACT>(g1.w) * u1.w);
        } else {
          const int row = pair_rows[order[m0 + t]];
          v = pair_up(x[(size_t)row * x_words_per_row + k_begin / 8 + j]);
        }
      }
      staged[t * words + (j % 4) * quads + j / 4] = v;
    }
    __syncthreads();

    for (int pass_row = 0; pass_row < kRowsPerBlock; pass_row += kWarps * kRowsPerWarp) {
      const int n0 = blockIdx.y * kRowsPerBlock + pass_row + warp * kRowsPerWarp;
      float acc[kRowsPerWarp][MT];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) acc[r][t] = 0.0f;

      for (int q = lane; q < quads; q += kWarp) {
        const int group = (k_begin + 32 * q) / pass.group;  // a quad (32 columns) lies in one group
        uint4 wq[kRowsPerWarp];
        float sc[kRowsPerWarp];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const int n = min(n0 + r, pass.n - 1);  // rows past N compute garbage that is never stored
          const size_t row = (size_t)e * pass.n + n;
          wq[r] = reinterpret_cast<const uint4*>(pass.w + row * (pass.k / 8) + k_begin / 8)[q];
          sc[r] = pass.s[row * (pass.k / pass.group) + group];
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const uint4* a = staged + t * words + q;
          const uint4 a0 = a[0], a1 = a[quads], a2 = a[2 * quads], a3 = a[3 * quads];
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) {
            float part = dot_word(wq[r].x, a0, 0.0f);
            part = dot_word(wq[r].y, a1, part);
            part = dot_word(wq[r].z, a2, part);
            part = dot_word(wq[r].w, a3, part);
            acc[r][t] = fmaf(part, sc[r], acc[r][t]);
          }
        }
      }

#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const float sum = warp_sum(acc[r][t]);
          const int n = n0 + r;
          if (lane == 0 && t < mt && n < pass.n) {
            if (DOWN) {
              atomicAdd(out + (size_t)rows_s[t] * out_stride + n, sum * router_s[t]);
            } else if (split_k) {
              atomicAdd(out + (size_t)(m0 + t) * out_stride + n, sum);
            } else {
              out[(size_t)(m0 + t) * out_stride + n] = sum;
            }
          }
        }
      }
    }
  }
}

int chunk_for(int k, int mt) {
  const int fit = kSmemBytes / (mt * 2);  // fp16 columns of MT rows that fit the budget
  return min(k, fit - fit % 32);
}

template <int MT, bool DOWN, int ACT>
void launch_pass(const Pass& pass, int experts, const uint4* x, int x_words, const float* gu, int inter,
                 const int32_t* pair_rows, const float* router, const int32_t* order, const int32_t* bounds,
                 float* out, int out_stride, gpu_stream_t stream) {
  const dim3 grid(experts, (pass.n + kRowsPerBlock - 1) / kRowsPerBlock, (pass.k + pass.chunk - 1) / pass.chunk);
  const size_t smem = (size_t)MT * pass.chunk * 2;
  fdot2_moe_kernel<MT, DOWN, ACT><<<grid, kThreads, smem, stream>>>(
      pass, x, x_words, gu, inter, pair_rows, router, order, bounds, out, out_stride);
}

template <int MT, int ACT>
void launch_layer(const Pass& gate_up, const Pass& down, int experts, int num_pairs, const uint4* x, int hidden,
                  int inter, const int32_t* pair_rows, const float* router, const int32_t* order,
                  const int32_t* bounds, float* gu, float* out, gpu_stream_t stream) {
  if (gate_up.chunk < gate_up.k) GPU_MEMSET_ASYNC(gu, 0, (size_t)num_pairs * 2 * inter * sizeof(float), stream);
  launch_pass<MT, false, ACT>(gate_up, experts, x, hidden / 8, nullptr, inter, pair_rows, router, order, bounds,
                              gu, 2 * inter, stream);
  launch_pass<MT, true, ACT>(down, experts, nullptr, 0, gu, inter, pair_rows, router, order, bounds, out, hidden,
                             stream);
}

template <int ACT>
void launch_mt(int mt, const Pass& gate_up, const Pass& down, int experts, int num_pairs, const uint4* x,
               int hidden, int inter, const int32_t* pair_rows, const float* router, const int32_t* order,
               const int32_t* bounds, float* gu, float* out, gpu_stream_t stream) {
  switch (mt) {
    case 1: launch_layer<1, ACT>(gate_up, down, experts, num_pairs, x, hidden, inter, pair_rows, router, order, bounds, gu, out, stream); break;
    case 2: launch_layer<2, ACT>(gate_up, down, experts, num_pairs, x, hidden, inter, pair_rows, router, order, bounds, gu, out, stream); break;
    case 4: launch_layer<4, ACT>(gate_up, down, experts, num_pairs, x, hidden, inter, pair_rows, router, order, bounds, gu, out, stream); break;
    default: launch_layer<8, ACT>(gate_up, down, experts, num_pairs, x, hidden, inter, pair_rows, router, order, bounds, gu, out, stream); break;
  }
}

}  // namespace

// x [T, H] fp16; pair_rows/order [P] int32; router [P] fp32; bounds [E+1] int32 (pairs of expert e
// are order[bounds[e]:bounds[e+1]]); w13 [E, 2I, H/8], s13 [E, 2I, H/G]; w2 [E, H, I/8], s2 [E, H, I/G];
// gu [P, 2I] fp32 scratch; out [T, H] fp32, zeroed by the caller. H and I multiples of 32 and of G.
// tokens_per_step: 1, 2, 4 or 8 rows staged at once. activation: 0 silu, 1 gelu. Returns 0 or the
// runtime's error code.
extern "C" int hm_fdot2_moe(const void* x, const int32_t* pair_rows, const float* router, const int32_t* order,
                            const int32_t* bounds, const uint32_t* w13, const float* s13, const uint32_t* w2,
                            const float* s2, float* gu, float* out, int experts, int num_pairs, int hidden,
                            int inter, int group, int tokens_per_step, int activation, void* stream) {
  const int mt = tokens_per_step;
  const Pass gate_up{w13, s13, 2 * inter, hidden, group, chunk_for(hidden, mt)};
  const Pass down{w2, s2, hidden, inter, group, chunk_for(inter, mt)};
  const gpu_stream_t s = static_cast<gpu_stream_t>(stream);
  const uint4* xv = static_cast<const uint4*>(x);
  if (activation == 0) {
    launch_mt<0>(mt, gate_up, down, experts, num_pairs, xv, hidden, inter, pair_rows, router, order, bounds, gu, out, s);
  } else {
    launch_mt<1>(mt, gate_up, down, experts, num_pairs, xv, hidden, inter, pair_rows, router, order, bounds, gu, out, s);
  }
  return static_cast<int>(GPU_GET_LAST_ERROR());
}
