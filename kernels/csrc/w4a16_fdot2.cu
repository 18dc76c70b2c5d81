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
//   gate_up pass: gu[z, s, n]   = sum_{k in chunk z} x[row(s), k] * w13[e, n, k]          n < 2I, K = H
//   down pass:    part[z, p, h] = router(p) * sum_{k in chunk z} act(g[s, k]) * u[s, k] * w2[e, h, k]
//                 with g, u = sum over z of gu[z, s, :I], gu[z, s, I:] (z ascending)
//   combine:      out[t, h]     = sum over the pairs p of row t (ascending) of sum over z of part[z, p, h]
// where s is a pair's position after sorting pairs by expert (order, bounds), p its index, z a
// K chunk. Every sum has a fixed order and every element one writer: no float atomics, so the
// output is bitwise identical run to run.
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
typedef _Float16 half2_t __attribute__((ext_vector_type(2)));
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <string.h>
typedef cudaStream_t gpu_stream_t;
typedef cudaError_t gpu_error_t;
#define GPU_GET_LAST_ERROR cudaGetLastError
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

__device__ inline float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }

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
    int gu_chunks, size_t gu_chunk_stride, int inter, const int32_t* __restrict__ pair_rows,
    const float* __restrict__ router, const int32_t* __restrict__ order, const int32_t* __restrict__ bounds,
    float* __restrict__ out, int out_stride, size_t out_chunk_stride) {
  extern __shared__ uint4 staged[];  // [MT][4][quads]: word j of token t at t*words + (j%4)*quads + j/4
  __shared__ int32_t pairs_s[MT];
  __shared__ float router_s[MT];

  const int e = blockIdx.x;
  const int start = bounds[e], end = bounds[e + 1];
  if (start == end) return;
  const int k_begin = blockIdx.z * pass.chunk;
  const int words = (min(pass.k, k_begin + pass.chunk) - k_begin) / 8;
  const int quads = words / 4;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  out += blockIdx.z * out_chunk_stride;  // this K chunk's slice
  constexpr int kRowsPerWarp = rows_per_warp(MT);

  for (int m0 = start; m0 < end; m0 += MT) {
    const int mt = min(MT, end - m0);
    __syncthreads();  // the previous chunk is done with `staged`
    if (threadIdx.x < MT) {
      const int t = threadIdx.x;
      const int pair = t < mt ? order[m0 + t] : 0;
      pairs_s[t] = pair;
      router_s[t] = t < mt ? router[pair] : 0.0f;
    }
    for (int idx = threadIdx.x; idx < MT * words; idx += kThreads) {
      const int t = idx / words, j = idx % words;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (t < mt) {
        if (DOWN) {  // gu row of sorted pair m0 + t, its K chunks summed in order: gate at k, up at I + k
          const float* g = gu + (size_t)(m0 + t) * 2 * inter + k_begin + 8 * j;
          float4 g0 = *reinterpret_cast<const float4*>(g);
          float4 g1 = *reinterpret_cast<const float4*>(g + 4);
          float4 u0 = *reinterpret_cast<const float4*>(g + inter);
          float4 u1 = *reinterpret_cast<const float4*>(g + inter + 4);
          for (int z = 1; z < gu_chunks; ++z) {
            const float* c = g + z * gu_chunk_stride;
            g0 = add4(g0, *reinterpret_cast<const float4*>(c));
            g1 = add4(g1, *reinterpret_cast<const float4*>(c + 4));
            u0 = add4(u0, *reinterpret_cast<const float4*>(c + inter));
            u1 = add4(u1, *reinterpret_cast<const float4*>(c + inter + 4));
          }
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
              out[(size_t)pairs_s[t] * out_stride + n] = sum * router_s[t];
            } else {
              out[(size_t)(m0 + t) * out_stride + n] = sum;
            }
          }
        }
      }
    }
  }
}

// out[t, h] = sum over row t's pairs (row_order[row_bounds[t]:row_bounds[t+1]], ascending) of
// the K chunks of part[z, p, h], z ascending; one thread per (t, h), rows without pairs get 0
__global__ void __launch_bounds__(kThreads) combine_kernel(
    const float* __restrict__ part, int chunks, size_t chunk_stride, const int32_t* __restrict__ row_order,
    const int32_t* __restrict__ row_bounds, float* __restrict__ out, int hidden) {
  const int t = blockIdx.x;
  const int h = blockIdx.y * kThreads + threadIdx.x;
  if (h >= hidden) return;
  float acc = 0.0f;
  for (int j = row_bounds[t]; j < row_bounds[t + 1]; ++j) {
    const float* p = part + (size_t)row_order[j] * hidden + h;
    for (int z = 0; z < chunks; ++z) acc += p[z * chunk_stride];
  }
  out[(size_t)t * hidden + h] = acc;
}

int chunk_for(int k, int mt) {
  const int fit = kSmemBytes / (mt * 2);  // fp16 columns of MT rows that fit the budget
  return min(k, fit - fit % 32);
}

int chunks(const Pass& pass) { return (pass.k + pass.chunk - 1) / pass.chunk; }

// one call's arguments (see hm_fdot2_moe)
struct Layer {
  Pass gate_up, down;
  int experts, num_pairs, num_rows, hidden, inter;
  const uint4* x;
  const int32_t *pair_rows, *order, *bounds, *row_order, *row_bounds;
  const float* router;
  float *gu, *part, *out;  // gu [Z13, P, 2I] and part [Z2, P, H]: the workspace
};

template <int MT, bool DOWN, int ACT>
void launch_pass(const Layer& l, const Pass& pass, gpu_stream_t stream) {
  const dim3 grid(l.experts, (pass.n + kRowsPerBlock - 1) / kRowsPerBlock, chunks(pass));
  const size_t smem = (size_t)MT * pass.chunk * 2;
  const size_t gu_stride = (size_t)l.num_pairs * 2 * l.inter;
  fdot2_moe_kernel<MT, DOWN, ACT><<<grid, kThreads, smem, stream>>>(
      pass, l.x, l.hidden / 8, DOWN ? l.gu : nullptr, chunks(l.gate_up), gu_stride, l.inter, l.pair_rows, l.router, l.order,
      l.bounds, DOWN ? l.part : l.gu, DOWN ? l.hidden : 2 * l.inter,
      DOWN ? (size_t)l.num_pairs * l.hidden : gu_stride);
}

template <int MT, int ACT>
void launch_layer(const Layer& l, gpu_stream_t stream) {
  launch_pass<MT, false, ACT>(l, l.gate_up, stream);
  launch_pass<MT, true, ACT>(l, l.down, stream);
  const dim3 grid(l.num_rows, (l.hidden + kThreads - 1) / kThreads);
  combine_kernel<<<grid, kThreads, 0, stream>>>(l.part, chunks(l.down), (size_t)l.num_pairs * l.hidden,
                                                l.row_order, l.row_bounds, l.out, l.hidden);
}

template <int ACT>
void launch_mt(int mt, const Layer& l, gpu_stream_t stream) {
  switch (mt) {
    case 1: launch_layer<1, ACT>(l, stream); break;
    case 2: launch_layer<2, ACT>(l, stream); break;
    case 4: launch_layer<4, ACT>(l, stream); break;
    default: launch_layer<8, ACT>(l, stream); break;
  }
}

Pass gate_up_pass(const uint32_t* w13, const float* s13, int hidden, int inter, int group, int mt) {
  return Pass{w13, s13, 2 * inter, hidden, group, chunk_for(hidden, mt)};
}

Pass down_pass(const uint32_t* w2, const float* s2, int hidden, int inter, int group, int mt) {
  return Pass{w2, s2, hidden, inter, group, chunk_for(inter, mt)};
}

}  // namespace

// Floats of workspace hm_fdot2_moe needs: gu [Z13, P, 2I] then part [Z2, P, H], Z the K chunks.
extern "C" size_t hm_fdot2_workspace_floats(int num_pairs, int hidden, int inter, int tokens_per_step) {
  const int z13 = chunks(gate_up_pass(nullptr, nullptr, hidden, inter, 0, tokens_per_step));
  const int z2 = chunks(down_pass(nullptr, nullptr, hidden, inter, 0, tokens_per_step));
  return (size_t)num_pairs * ((size_t)z13 * 2 * inter + (size_t)z2 * hidden);
}

// x [T, H] fp16; pair_rows/order [P] int32; router [P] fp32; bounds [E+1] int32 (pairs of expert e
// are order[bounds[e]:bounds[e+1]]); row_order [P], row_bounds [T+1] int32 (pairs of row t are
// row_order[row_bounds[t]:row_bounds[t+1]], ascending); w13 [E, 2I, H/8], s13 [E, 2I, H/G];
// w2 [E, H, I/8], s2 [E, H, I/G]; workspace: hm_fdot2_workspace_floats fp32; out [T, H] fp32, every
// element written. H and I multiples of 32 and of G. tokens_per_step: 1, 2, 4 or 8 rows staged at
// once. activation: 0 silu, 1 gelu. Returns 0 or the runtime's error code.
extern "C" int hm_fdot2_moe(const void* x, const int32_t* pair_rows, const float* router, const int32_t* order,
                            const int32_t* bounds, const int32_t* row_order, const int32_t* row_bounds,
                            const uint32_t* w13, const float* s13, const uint32_t* w2, const float* s2,
                            float* workspace, float* out, int experts, int num_pairs, int num_rows, int hidden,
                            int inter, int group, int tokens_per_step, int activation, void* stream) {
  const int mt = tokens_per_step;
  Layer l{gate_up_pass(w13, s13, hidden, inter, group, mt), down_pass(w2, s2, hidden, inter, group, mt),
          experts, num_pairs, num_rows, hidden, inter, static_cast<const uint4*>(x),
          pair_rows, order, bounds, row_order, row_bounds, router, workspace, nullptr, out};
  l.part = workspace + (size_t)chunks(l.gate_up) * num_pairs * 2 * inter;
  const gpu_stream_t s = static_cast<gpu_stream_t>(stream);
  if (activation == 0) {
    launch_mt<0>(mt, l, s);
  } else {
    launch_mt<1>(mt, l, s);
  }
  return static_cast<int>(GPU_GET_LAST_ERROR());
}
