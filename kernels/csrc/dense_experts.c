/* Dense routed experts on the CPU in float32: what a worker computes for a 16-bit checkpoint
 * (kernels/backends/reference.py, DenseReference), one call per request.
 *
 *   out[t] = sum over the pairs p of row t, experts ascending:  w_p * down(act(gate x_t) * up x_t)
 *
 * A decode request is a row or two; computed with a tensor library it costs a few dispatches per
 * expert, which on the development machine were most of a worker's time. Here it is one call:
 * hm_dense_experts on tensors the caller validated, or hm_dense_frame straight from a FORWARD
 * frame's bytes (protos/frames.py), which checks the request itself.
 *
 * Every output element is a sum in a fixed order (k ascending in each projection, then the
 * pairs of its row by ascending expert, in request order within an expert), compiled without
 * floating-point contraction (native_build.HOST_FLAGS): the same bits on every run, whatever the
 * batch, the row blocking or the vector width. Rows go through the weights ROW_BLOCK at a time,
 * so that each weight row read serves them all, their sums in registers (rows_times).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ACT_SILU = 0, ACT_GELU = 1 }; /* kernels/activations.py ACTIVATION_CODES */
enum { ROW_BLOCK = 4, TILE_COLS = 16 }; /* a tile's accumulators: 4 rows x 16 columns, in registers */

typedef float v8 __attribute__((vector_size(32))); /* AVX where -march has it, else two SSE halves */

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* torch.nn.functional's float32 formulas: silu x / (1 + e^-x), gelu 0.5 x (1 + erf(x / sqrt 2)). */
static float activate(float g, int act) {
    if (act == ACT_SILU) return g / (1.0f + expf(-g));
    return 0.5f * g * (1.0f + erff(g * 0.70710678118654752440f));
}

/* c[i][j] = sum over k ascending of a[i][k] w[k][j], for rows i < n <= ROW_BLOCK; w is [K, N]
 * row-major, c's rows ldc apart. Each element is one multiply-then-add chain from zero, the
 * same in the vector lanes and in the scalar tail. Inlined with n constant (rows_times_n). */
static inline __attribute__((always_inline)) void rows_times(int n, const float *const *a, int64_t K, const float *w,
                                                             int64_t N, float *c, int64_t ldc) {
    int64_t j = 0;
    for (; j + TILE_COLS <= N; j += TILE_COLS) {
        v8 acc[ROW_BLOCK][2] = {{{0}}};
        for (int64_t k = 0; k < K; ++k) {
            v8 w0 = load8(w + k * N + j), w1 = load8(w + k * N + j + 8);
            for (int i = 0; i < n; ++i) {
                v8 ak = (v8){0} + a[i][k];
                acc[i][0] += ak * w0;
                acc[i][1] += ak * w1;
            }
        }
        for (int i = 0; i < n; ++i) {
            store8(c + i * ldc + j, acc[i][0]);
            store8(c + i * ldc + j + 8, acc[i][1]);
        }
    }
    for (; j < N; ++j) {
        for (int i = 0; i < n; ++i) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; ++k) sum += a[i][k] * w[k * N + j];
            c[i * ldc + j] = sum;
        }
    }
}

static void rows_times_n(int n, const float *const *a, int64_t K, const float *w, int64_t N, float *c, int64_t ldc) {
    switch (n) {
    case 1: rows_times(1, a, K, w, N, c, ldc); break;
    case 2: rows_times(2, a, K, w, N, c, ldc); break;
    case 3: rows_times(3, a, K, w, N, c, ldc); break;
    default: rows_times(ROW_BLOCK, a, K, w, N, c, ldc); break;
    }
}

/* The sum itself, on pairs already checked: rows in [0, T), local experts in [0, E). */
static int dense_experts(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, const float *const *w13t,
                         const float *const *w2t, int act, const int64_t *pair_rows, const int64_t *pair_experts,
                         const float *pair_weights, int64_t P, float *out) {
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    if (P == 0) return 0;

    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)); /* counting sort: pairs by expert */
    int64_t *order = malloc((size_t)P * sizeof(int64_t));
    float *gu = malloc((size_t)(ROW_BLOCK * 2 * I) * sizeof(float));
    float *y = malloc((size_t)(ROW_BLOCK * H) * sizeof(float));
    int status = (start && order && gu && y) ? 0 : -2;
    if (status == 0) {
        for (int64_t p = 0; p < P; ++p) start[pair_experts[p] + 1]++;
        for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
        for (int64_t p = 0; p < P; ++p) order[start[pair_experts[p]]++] = p; /* start[e] -> end of e */
        for (int64_t e = 0, lo = 0; e < E; lo = start[e++]) {
            const float *w13 = w13t[e], *w2 = w2t[e];
            for (int64_t b = lo; b < start[e]; b += ROW_BLOCK) {
                int64_t n = start[e] - b < ROW_BLOCK ? start[e] - b : ROW_BLOCK;
                const float *rows[ROW_BLOCK], *h[ROW_BLOCK];
                for (int64_t i = 0; i < n; ++i) {
                    rows[i] = x + pair_rows[order[b + i]] * H;
                    h[i] = gu + i * 2 * I;
                }
                rows_times_n((int)n, rows, H, w13, 2 * I, gu, 2 * I); /* [n, 2I]: gate, then up */
                for (int64_t i = 0; i < n; ++i) {
                    float *g = gu + i * 2 * I;
                    for (int64_t j = 0; j < I; ++j) g[j] = activate(g[j], act) * g[I + j];
                }
                rows_times_n((int)n, h, I, w2, H, y, H); /* [n, H] */
                for (int64_t i = 0; i < n; ++i) {
                    int64_t p = order[b + i];
                    float weight = pair_weights[p], *row = out + pair_rows[p] * H;
                    for (int64_t c = 0; c < H; ++c) row[c] += weight * y[i * H + c];
                }
            }
        }
    }
    free(start);
    free(order);
    free(gu);
    free(y);
    return status;
}

/* x [T, H] float32; w13t: E pointers to [H, 2I] (gate columns, then up); w2t: E pointers to
 * [I, H]; pairs: rows in [0, T), local experts in [0, E), router weights; out [T, H] is
 * overwritten. Returns 0, -1 for a pair out of range (nothing computed), -2 out of memory. */
int hm_dense_experts(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, const float *const *w13t,
                     const float *const *w2t, int act, const int64_t *pair_rows, const int64_t *pair_experts,
                     const float *pair_weights, int64_t P, float *out) {
    for (int64_t p = 0; p < P; ++p)
        if (pair_rows[p] < 0 || pair_rows[p] >= T || pair_experts[p] < 0 || pair_experts[p] >= E) return -1;
    return dense_experts(x, T, H, I, E, w13t, w2t, act, pair_rows, pair_experts, pair_weights, P, out);
}

enum { WIRE_FLOAT32 = 1, WIRE_FLOAT16 = 2, WIRE_BFLOAT16 = 3 }; /* protos/expert.proto DType */

static float half_to_float(uint16_t h) { /* exact, subnormals, infinities and NaNs included */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exponent = 113;
        while (!(mantissa & 0x400u)) { mantissa <<= 1; --exponent; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A FORWARD frame's request on one set of experts, read from the frame's payload: hidden [T, H]
 * of wire dtype `dtype`, then pair rows (int32), global expert ids (int32) and router weights
 * (float32), P of each; this set holds experts [first, first + E). Writes the [T, H] float32
 * partial to out. Returns 0; 1 when the request is not one this call takes, computing nothing
 * (a pair out of range, an expert outside the set, a (row, expert) pair twice, another dtype):
 * the caller's general path then computes it or names what is wrong; -2 out of memory. */
int hm_dense_frame(const void *payload, int dtype, int64_t T, int64_t H, int64_t P, int64_t first, int64_t I,
                   int64_t E, const float *const *w13t, const float *const *w2t, int act, float *out) {
    if (P <= 0 || (dtype != WIRE_FLOAT32 && dtype != WIRE_FLOAT16 && dtype != WIRE_BFLOAT16)) return 1;
    size_t itemsize = dtype == WIRE_FLOAT32 ? 4 : 2;
    const unsigned char *pairs = (const unsigned char *)payload + (size_t)(T * H) * itemsize;
    int32_t row32, expert32;
    float weight;
    int64_t *rows = malloc((size_t)P * sizeof(int64_t)), *experts = malloc((size_t)P * sizeof(int64_t));
    float *weights = malloc((size_t)P * sizeof(float)), *x = NULL;
    unsigned char *seen = calloc((size_t)(T * E + 7) / 8, 1); /* (row, expert) bitmap */
    int status = (rows && experts && weights && seen) ? 0 : -2;
    for (int64_t p = 0; status == 0 && p < P; ++p) { /* the frame's arrays may be unaligned: memcpy */
        memcpy(&row32, pairs + 4 * p, 4);
        memcpy(&expert32, pairs + 4 * (P + p), 4);
        memcpy(&weight, pairs + 4 * (2 * P + p), 4);
        int64_t key = (int64_t)row32 * E + (expert32 - first);
        if (row32 < 0 || row32 >= T || expert32 < first || expert32 >= first + E || (seen[key / 8] >> key % 8) & 1) {
            status = 1;
            break;
        }
        seen[key / 8] |= (unsigned char)(1u << key % 8);
        rows[p] = row32;
        experts[p] = expert32 - first;
        weights[p] = weight;
    }
    if (status == 0 && dtype == WIRE_FLOAT32 && ((uintptr_t)payload % sizeof(float)) == 0) {
        status = dense_experts(payload, T, H, I, E, w13t, w2t, act, rows, experts, weights, P, out);
    } else if (status == 0) {
        x = malloc((size_t)(T * H) * sizeof(float));
        if (!x) status = -2;
        for (int64_t i = 0; status == 0 && i < T * H; ++i) {
            uint16_t h;
            if (dtype == WIRE_FLOAT32) {
                memcpy(&x[i], (const unsigned char *)payload + 4 * i, 4);
                continue;
            }
            memcpy(&h, (const unsigned char *)payload + 2 * i, 2);
            if (dtype == WIRE_FLOAT16) {
                x[i] = half_to_float(h);
            } else {
                uint32_t bits = (uint32_t)h << 16;
                memcpy(&x[i], &bits, sizeof bits);
            }
        }
        if (status == 0) status = dense_experts(x, T, H, I, E, w13t, w2t, act, rows, experts, weights, P, out);
    }
    free(rows);
    free(experts);
    free(weights);
    free(seen);
    free(x);
    return status;
}
